import pytest
import torch

from edgerun.engine.policy import KernelPolicy, resolve
from edgerun.kernels import cpu_features

EPYC = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni\n\n"
SAPPHIRE = (
    "model name\t: Intel Xeon Platinum 8480+\nflags\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n"
)
OLD = "model name\t: Intel Core i7\nflags\t: sse4_2 avx2\n"


def test_flags_parsed_from_cpuinfo():
    f = cpu_features.read(EPYC)
    assert f.model == "AMD EPYC"
    assert f.flags == {"avx2", "avx512f", "avx512_bf16"}
    assert f.avx512_bf16 and not f.amx
    assert cpu_features.read(SAPPHIRE).amx
    assert not cpu_features.read(OLD).avx512_bf16


def test_default_dtype_follows_the_table(monkeypatch):
    epyc, amx, old = (cpu_features.read(t) for t in (EPYC, SAPPHIRE, OLD))
    assert amx.default_dtype() == "float32"  # until bf16 is measured faster with AMX
    monkeypatch.setitem(cpu_features.DEFAULT_DTYPE, "amx", ("bfloat16", "bf16 matrix tiles"))
    assert amx.default_dtype() == "bfloat16"
    assert epyc.default_dtype() == "float32"
    assert old.default_dtype() == "float32"
    only_tile = cpu_features.read("flags\t: avx512_bf16 amx_tile\n")  # AMX without its bf16 unit
    assert only_tile.default_dtype() == "float32"


def test_describe_names_hardware_dtype_and_why(monkeypatch):
    epyc, amx, old = (cpu_features.read(t) for t in (EPYC, SAPPHIRE, OLD))
    assert amx.describe("float32") == "AMX: float32 by default (bf16 measured 0.91-1.05x of fp32 with AMX)"
    monkeypatch.setitem(cpu_features.DEFAULT_DTYPE, "amx", ("bfloat16", "bf16 matrix tiles"))
    assert (
        epyc.describe("float32")
        == "AVX512-BF16, no AMX: float32 by default (bf16 measured no faster without AMX)"
    )
    assert amx.describe("bfloat16") == "AMX: bfloat16 by default (bf16 matrix tiles)"
    assert old.describe("float32") == "no bf16 hardware found: float32 by default (bf16 would be emulated)"
    assert epyc.describe("bfloat16") == (
        "AVX512-BF16, no AMX: bfloat16 as asked (the default here is float32: bf16 measured no faster without AMX)"
    )
    assert (
        amx.describe("float32") == "AMX: float32 as asked (the default here is bfloat16: bf16 matrix tiles)"
    )


def test_no_cpuinfo_is_said():
    assert cpu_features.read("").model == "unknown CPU"


def test_resolve_on_cpu_names_the_cpu_choice(monkeypatch):
    monkeypatch.setattr(
        cpu_features, "read", lambda text=None: cpu_features.CpuFeatures("x", frozenset({"avx512_bf16"}))
    )
    assert resolve(KernelPolicy(), torch.device("cpu"), dtype=torch.bfloat16).cpu.startswith(
        "AVX512-BF16, no AMX: bfloat16 as asked"
    )
    assert resolve(KernelPolicy(), torch.device("cpu")).cpu.startswith(
        "AVX512-BF16, no AMX: float32 by default"
    )
    assert resolve(KernelPolicy(), torch.device("meta")).cpu == ""


def test_a_build_cache_that_cannot_be_written_is_a_build_error(tmp_path, monkeypatch):
    """XDG_CACHE_HOME on a full, read-only or foreign filesystem: the C kernel is not built (a
    BuildError, which the engine turns into a named fallback), not a failed load."""
    from edgerun.kernels import cbuild

    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # its edgerun/kernels cannot be made
    src = tmp_path / "k.c"
    src.write_text("int f(void) { return 1; }\n")
    with pytest.raises(cbuild.BuildError, match="cannot write the build cache"):
        cbuild.build(src, ["cc"], ["-shared", "-fPIC"], what="a test kernel")
