"""Tokenizer, special tokens, EOS ids and the chat template, from an HF model directory.

Uses the ``tokenizers`` library for tokenizer.json and a sandboxed jinja2 environment for the
chat template (tokenizer_config.json ``chat_template`` or ``chat_template.jinja``), configured as
Hugging Face renders it (trim_blocks, lstrip_blocks, loop controls, ``raise_exception``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgerun.errors import ConfigError


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from exc
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<|im_end|>", ...}
        return value.get("content")
    return value if isinstance(value, str) else None


@dataclass
class Tokenizer:
    tok: Any  # tokenizers.Tokenizer
    eos_token_ids: tuple[int, ...]
    bos_token: str | None
    eos_token: str | None
    chat_template: str | None

    @classmethod
    def from_dir(cls, model_dir: str | Path, config_eos: tuple[int, ...] = ()) -> Tokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        d = Path(model_dir)
        path = d / "tokenizer.json"
        if not path.is_file():
            raise ConfigError(f"{d}: no tokenizer.json (pass token ids instead, or add the tokenizer files)")
        tok = HFTokenizer.from_file(str(path))
        tcfg = _read_json(d / "tokenizer_config.json")
        gcfg = _read_json(d / "generation_config.json")
        template = tcfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = d / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        bos, eos = _token_text(tcfg.get("bos_token")), _token_text(tcfg.get("eos_token"))

        ids: list[int] = []
        gen_eos = gcfg.get("eos_token_id")
        for source in (gen_eos if isinstance(gen_eos, list) else [gen_eos], list(config_eos)):
            ids.extend(int(i) for i in source if i is not None and int(i) not in ids)
        if eos is not None and (eid := tok.token_to_id(eos)) is not None and eid not in ids:
            ids.append(eid)
        return cls(tok, tuple(ids), bos, eos, template)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ConfigError("this model has no chat template (tokenizer_config.json 'chat_template')")
        return render_template(
            self.chat_template,
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )


def render_template(template: str, **context: Any) -> str:
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ConfigError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii
    )
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(**context)
    except TemplateError as exc:
        raise ConfigError(f"chat template failed to render: {exc}") from exc


class StreamDecoder:
    """Turns a growing list of token ids into text deltas without splitting UTF-8 characters.
    Decodes only a short window (prefix/read offsets), so each token costs O(1)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # window start: tokens before it are final
        self.read = 0  # tokens up to here have been emitted as text

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        before = self.tokenizer.decode(self.ids[self.prefix : self.read])
        after = self.tokenizer.decode(self.ids[self.prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        before = self.tokenizer.decode(self.ids[self.prefix : self.read])
        after = self.tokenizer.decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return after[len(before) :]
