"""Bundles for the streaming tests (CPU and CUDA)."""

import pytest

from edgerun.bundle.convert import ConvertOptions, convert
from hf_fixtures import ARCHS


def _add_tokenizer(ckpt):
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({f"t{i}": i for i in range(97)}, unk_token="t0")).save(
        str(ckpt / "tokenizer.json")
    )


@pytest.fixture(scope="session")
def bundles(tmp_path_factory):
    """Tiny checkpoints (hidden 64, expert width 32: int4 groups fit) as bf16 and int4 bundles."""
    from hf_fixtures import build_hf

    root = tmp_path_factory.mktemp("stream-bundles")
    out = {}
    for arch in ARCHS:
        src = root / arch
        build_hf(arch, src, seed=5, hidden_size=64, moe_intermediate_size=32)
        _add_tokenizer(src)
        for quant, group, rotate in (("bf16", None, False), ("int4", 16, True)):
            convert(src, root / f"{arch}-{quant}", ConvertOptions(quant, group, rotate))
            out[(arch, quant)] = root / f"{arch}-{quant}"
    return out


@pytest.fixture(scope="session")
def dense_bundles(tmp_path_factory):
    """Tiny int4 bundles whose dense projections are int4 too (group 16: the tiny widths are
    multiples of 32), one per architecture."""
    from hf_fixtures import build_hf

    root = tmp_path_factory.mktemp("dense-bundles")
    out = {}
    for arch in ARCHS:
        src = root / arch
        extra = {"shared_expert_intermediate_size": 32} if arch == "qwen3_5_moe" else {}
        build_hf(arch, src, seed=5, hidden_size=64, moe_intermediate_size=32, **extra)
        _add_tokenizer(src)
        convert(src, root / f"{arch}-dense", ConvertOptions("int4", 16, dense="int4", dense_group=16))
        out[arch] = root / f"{arch}-dense"
    return out


@pytest.fixture(scope="session")
def dense32_bundles(tmp_path_factory):
    """Tiny int4 bundles whose dense projections are int4 in groups of 32 (what int8
    activations take), one per architecture."""
    from hf_fixtures import build_hf

    root = tmp_path_factory.mktemp("dense32-bundles")
    out = {}
    for arch in ARCHS:
        src = root / arch
        extra = {"shared_expert_intermediate_size": 32, "linear_value_head_dim": 16}
        if arch != "qwen3_5_moe":
            extra = {"intermediate_size": 96}  # every projection's columns whole groups of 32
        build_hf(arch, src, seed=7, hidden_size=64, moe_intermediate_size=32, **extra)
        _add_tokenizer(src)
        convert(src, root / f"{arch}-dense32", ConvertOptions("int4", 32, dense="int4", dense_group=32))
        out[arch] = root / f"{arch}-dense32"
    return out


@pytest.fixture(scope="session")
def cpu_kernel_bundles(tmp_path_factory):
    """Tiny checkpoints (hidden 64, expert width 32) as the bundles the CPU expert kernels run:
    int4 groups of 32 and int8 per row, unrotated."""
    from hf_fixtures import build_hf

    root = tmp_path_factory.mktemp("cpu-kernel-bundles")
    out = {}
    for arch in ARCHS:
        src = root / arch
        build_hf(arch, src, seed=5, hidden_size=64, moe_intermediate_size=32)
        _add_tokenizer(src)
        for quant, group in (("int4", 32), ("int8", None)):
            convert(src, root / f"{arch}-{quant}", ConvertOptions(quant, group))
            out[(arch, quant)] = root / f"{arch}-{quant}"
    return out


@pytest.fixture
def few_attention_programs(monkeypatch):
    """The interpreted engine scripts' attention on 8 programs a kv head, not TARGET_PROGRAMS'
    128: the interpreter runs every program in turn, about 4 ms even for one past the position
    that returns at once, and a tiny model's positions all fall in the first split either way.
    The split plan itself is interpreted_decode.py's (tests/kernels), at its real value."""
    from edgerun.kernels import decode_triton

    monkeypatch.setattr(decode_triton, "TARGET_PROGRAMS", 8)
