"""The CPU's default compute dtype: chosen by its bf16 hardware through one table
(``cpu_features.DEFAULT_DTYPE``; the CPU is mocked here, and the AMX row too where a case needs a
bf16 default: as shipped every row is fp32 until bf16 is measured faster), overridden by
``--dtype``, and said with its reason in the start-up line."""

from pathlib import Path

import pytest
import torch

from edgerun.engine.provenance import provenance
from edgerun.engine.setup import plan_experts, runtime
from edgerun.kernels import cpu_features

AMX = cpu_features.CpuFeatures("Xeon (mocked)", frozenset({"avx512_bf16", "amx_tile", "amx_bf16"}))
NO_AMX = cpu_features.CpuFeatures("EPYC (mocked)", frozenset({"avx512_bf16"}))
CPU_PROFILE = Path(__file__).resolve().parents[2] / "configs" / "cpu.yaml"


BF16_ROW = ("bfloat16", "bf16 matrix tiles")  # an AMX row a measurement could set


@pytest.fixture
def cpu(monkeypatch):
    """Pretend this CPU is the given one, for every reader of ``cpu_features.read``; ``bf16``:
    with the AMX row of the table set to bf16."""
    before = torch.get_num_threads()

    def use(features, bf16: bool = False):
        monkeypatch.setattr(cpu_features, "read", lambda text=None: features)
        if bf16:
            monkeypatch.setitem(cpu_features.DEFAULT_DTYPE, "amx", BF16_ROW)

    yield use
    torch.set_num_threads(before)  # loading the demo sets one thread, process-wide


@pytest.mark.parametrize(
    ("features", "bf16", "want"),
    [(AMX, True, torch.bfloat16), (AMX, False, torch.float32), (NO_AMX, True, torch.float32)],
)
def test_auto_follows_the_hardware_and_dtype_overrides_it(cpu, features, bf16, want):
    cpu(features, bf16)
    assert runtime("cpu", "auto").dtype == want
    assert runtime("cpu", None).dtype == want
    assert runtime("cpu", "float32").dtype == torch.float32
    assert runtime("cpu", "bfloat16").dtype == torch.bfloat16


def test_auto_on_cuda_stays_the_checkpoints(cpu, monkeypatch):
    cpu(AMX)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert runtime("cuda", "auto").dtype is None


def test_resident_plan_counts_the_default_dtype(cpu):
    plans = {}
    for features in (AMX, NO_AMX):
        cpu(features, bf16=True)
        plans[features.default_dtype()] = plan_experts(None, "cpu", "auto", profile=CPU_PROFILE).summary
    assert "every expert resident (bf16)" in plans["bfloat16"]
    assert "every expert resident (fp32)" in plans["float32"]


def _device_line(dtype: str) -> str:
    rt = runtime("cpu", dtype)
    runner = rt.load(None, progress=False)
    return provenance(runner, None).splitlines()[1].strip()


def test_start_up_line_says_which_dtype_and_why(cpu):
    cpu(AMX)
    line = _device_line("auto")
    assert line.startswith("device cpu, dtype float32, threads 1")
    assert line.endswith("; cpu AMX: float32 by default (bf16 measured 0.91-1.05x of fp32 with AMX)")
    cpu(AMX, bf16=True)
    line = _device_line("auto")
    assert line.startswith("device cpu, dtype bfloat16, threads 1")
    assert line.endswith("; cpu AMX: bfloat16 by default (bf16 matrix tiles)")
    line = _device_line("float32")
    assert line.startswith("device cpu, dtype float32, threads 1")
    assert line.endswith("; cpu AMX: float32 as asked (the default here is bfloat16: bf16 matrix tiles)")
    cpu(NO_AMX)
    line = _device_line("auto")
    assert line.startswith("device cpu, dtype float32, threads 1")
    assert line.endswith(
        "; cpu AVX512-BF16, no AMX: float32 by default (bf16 measured no faster without AMX)"
    )
