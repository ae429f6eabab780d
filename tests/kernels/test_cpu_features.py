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


def test_describe_names_hardware_and_dtype_choice():
    epyc, amx, old = (cpu_features.read(t) for t in (EPYC, SAPPHIRE, OLD))
    assert epyc.describe("float32") == "AVX512-BF16, no AMX (bf16 no faster)"
    assert amx.describe("float32") == "AMX (bf16 not measured there)"
    assert old.describe("float32") == "no bf16 hardware"
    assert epyc.describe("bfloat16") == "AVX512-BF16, no AMX"


def test_no_cpuinfo_is_said():
    assert cpu_features.read("").model == "unknown CPU"


def test_resolve_on_cpu_names_the_cpu_choice():
    r = resolve(KernelPolicy(), torch.device("cpu"), dtype=torch.bfloat16)
    assert not r.cpu.endswith("faster)")  # bf16 asked for: no reason for fp32 given
    assert resolve(KernelPolicy(), torch.device("cpu")).cpu == cpu_features.read().describe("float32")
    assert resolve(KernelPolicy(), torch.device("meta")).cpu == ""
