"""Tokenizer, special tokens, EOS ids and the chat template, from an HF model directory.

Uses the ``tokenizers`` library for tokenizer.json and a sandboxed jinja2 environment for the
chat template (tokenizer_config.json ``chat_template`` or ``chat_template.jinja``), configured as
Hugging Face renders it (trim_blocks, lstrip_blocks, loop controls, ``raise_exception``), and
compiled once. Encoding goes through ``encode_batch``, which releases the GIL (``encode`` holds
it): a long prompt tokenized in a worker thread stalls neither the event loop nor the engine.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from edgerun.errors import ConfigError


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    from edgerun.models.args import read_json

    data = read_json(path)
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<|im_end|>", ...}
        return value.get("content")
    return value if isinstance(value, str) else None


CHATML_ROLES = frozenset({"system", "user", "assistant", "tool"})
# the roles a template tests for: message.role == "user", message['role'] in ["user", "system"]
_ROLE_TESTS = re.compile(r"""role['"]?\]?\s*(?:==\s*(['"]\w+['"])|in\s*[\[(]([^\])]*)[\])])""")
_PRIVATE_USE = range(0x100000, 0x10FFFE)  # supplementary private use area B: stand-ins for specials


@dataclass
class Tokenizer:
    tok: Any  # tokenizers.Tokenizer
    eos_token_ids: tuple[int, ...]
    bos_token: str | None
    eos_token: str | None
    chat_template: str | None
    _compiled: tuple[str, Any] | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def from_dir(cls, model_dir: str | Path, config_eos: tuple[int, ...] = ()) -> Tokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        d = Path(model_dir)
        path = d / "tokenizer.json"
        if not path.is_file():
            raise ConfigError(f"{d}: no tokenizer.json (pass token ids instead, or add the tokenizer files)")
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as exc:  # the tokenizers library raises a bare Exception on a damaged file
            raise ConfigError(f"{path}: not a usable tokenizer ({exc})") from None
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
        """Special tokens' text is parsed as the special tokens (a raw prompt is the caller's own)."""
        return self.tok.encode_batch([text], add_special_tokens=False)[0].ids

    def _encode_plain(self, text: str) -> list[int]:
        return self._plain.encode_batch([text], add_special_tokens=False)[0].ids

    @cached_property
    def _plain(self) -> Any:
        """A copy of the tokenizer that encodes special tokens' text as ordinary text."""
        plain = type(self.tok).from_str(self.tok.to_str())
        plain.encode_special_tokens = True
        return plain

    @cached_property
    def _specials(self) -> re.Pattern | None:
        """Matches any special token's text, longest first (as ``tokenizers`` splits them)."""
        texts = sorted(
            (t.content for t in self.tok.get_added_tokens_decoder().values() if t.special), key=len
        )
        return re.compile("|".join(re.escape(t) for t in reversed(texts))) if texts else None

    @cached_property
    def max_token_bytes(self) -> int:
        """An upper bound on the UTF-8 bytes of text one token stands for."""
        return max(len(t.encode()) for t in self.tok.get_vocab(with_added_tokens=True))

    @cached_property
    def roles(self) -> frozenset[str]:
        """The roles the chat template tests for; ChatML's when it tests none (prints any)."""
        found = set()
        for eq, listed in _ROLE_TESTS.findall(self.chat_template or ""):
            found.update(re.findall(r"""['"](\w+)['"]""", eq or listed))
        return frozenset(found) or CHATML_ROLES

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ConfigError("this model has no chat template (tokenizer_config.json 'chat_template')")
        if self._compiled is None or self._compiled[0] != self.chat_template:
            self._compiled = (self.chat_template, compile_template(self.chat_template))
        return render_template(
            self._compiled[1],
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """The chat prompt's token ids, with special tokens only where the template put them: a
        special token's text inside a message is plain text, so content cannot forge a turn. Each
        such text is swapped for a private-use character while the template renders; the
        rendering is split at the template's special tokens, and the pieces between them are
        encoded as plain text with the characters swapped back. (Roles are the caller's to check
        against :attr:`roles`.)"""
        specials = self._specials
        if specials is None:
            return self.encode(self.apply_chat_template(messages, add_generation_prompt))
        content = "".join(m["content"] for m in messages)
        template = self.chat_template or ""
        free = (chr(c) for c in _PRIVATE_USE if chr(c) not in content and chr(c) not in template)
        stand_in = {t: next(free) for t in dict.fromkeys(specials.findall(content))}
        masked = [{**m, "content": specials.sub(lambda t: stand_in[t[0]], m["content"])} for m in messages]
        text = self.apply_chat_template(masked, add_generation_prompt)
        back = str.maketrans({c: t for t, c in stand_in.items()})
        ids, start = [], 0
        for t in specials.finditer(text):
            ids += self._encode_plain(text[start : t.start()].translate(back))
            ids.append(self.tok.token_to_id(t[0]))
            start = t.end()
        return ids + self._encode_plain(text[start:].translate(back))


def compile_template(template: str) -> Any:
    """A chat template compiled into its sandbox: compile once, render per request."""
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
        return env.from_string(template)
    except TemplateError as exc:
        raise ConfigError(f"chat template does not compile: {exc}") from exc


def render_template(template: Any, **context: Any) -> str:
    """Render a template from :func:`compile_template`."""
    from jinja2 import TemplateError

    try:
        return template.render(**context)
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
