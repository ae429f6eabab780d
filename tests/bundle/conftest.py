"""Fixtures for bundle tests: tiny random HF checkpoints (hidden 64, expert width 32, so int4
groups of 16 and 32 both fit) with a tokenizer and chat template, and bundles converted from
them once per session (tests that damage a bundle work on a copy)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from edgerun.bundle.convert import ConvertOptions, convert

ARCHS = ("qwen3_moe", "qwen3_5_moe")
DIMS = dict(hidden_size=64, moe_intermediate_size=32)
CHAT_TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"


def add_tokenizer(ckpt: Path) -> None:
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(97)}
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(ckpt / "tokenizer.json"))
    (ckpt / "tokenizer_config.json").write_text('{"model_max_length": 512}')
    (ckpt / "chat_template.jinja").write_text(CHAT_TEMPLATE)


@pytest.fixture(scope="session")
def sources(tmp_path_factory) -> dict[str, Path]:
    """{"qwen3_moe": fp32 checkpoint, "qwen3_moe/bf16": the same in bf16, ...} for both archs."""
    from hf_fixtures import build_hf, rewrite

    out = {}
    for arch in ARCHS:
        d = tmp_path_factory.mktemp(arch)
        build_hf(arch, d / "fp32", seed=3, **DIMS)
        add_tokenizer(d / "fp32")
        rewrite(d / "fp32", d / "bf16", dtype=torch.bfloat16)
        add_tokenizer(d / "bf16")
        out[arch], out[f"{arch}/bf16"] = d / "fp32", d / "bf16"
    return out


@pytest.fixture(scope="session")
def bundles(sources, tmp_path_factory):
    """bundles(source_key, quant, group=None, rotate=False) -> bundle dir, converted once."""
    root = tmp_path_factory.mktemp("bundles")
    made: dict[tuple, Path] = {}

    def get(key: str, quant: str, group: int | None = None, rotate: bool = False) -> Path:
        k = (key, quant, group, rotate)
        if k not in made:
            dst = root / f"{key.replace('/', '_')}-{quant}-{group}-{int(rotate)}"
            convert(sources[key], dst, ConvertOptions(quant, group, rotate))
            made[k] = dst
        return made[k]

    return get


@pytest.fixture
def bundle_copy(bundles, tmp_path):
    """A private copy of a session bundle, to damage."""

    def get(*args, **kw) -> Path:
        dst = tmp_path / "copy"
        shutil.copytree(bundles(*args, **kw), dst)
        return dst

    return get


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny tensors gain nothing from a second thread, and on a busy 2-core machine spinning
    OpenMP threads make them many times slower; restored after each test."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
