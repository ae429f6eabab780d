"""What this CPU offers the CPU path, from ``/proc/cpuinfo``'s flags: AVX512-BF16 (bf16 dot
products) and AMX (``amx_tile`` + ``amx_bf16``: bf16 matrix tiles, which oneDNN uses for bf16
matmuls), and the compute dtype the CPU path takes when none is asked for (:data:`DEFAULT_DTYPE`),
named with the reason in the start-up line, so no choice is silent. ``--dtype`` overrides it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")
HARDWARE = {"amx": "AMX", "avx512_bf16": "AVX512-BF16, no AMX", "none": "no bf16 hardware found"}
# The CPU default compute dtype by bf16 hardware, and why. AVX512-BF16 without AMX: bf16 measured
# no faster than fp32 (docs/benchmarks.md, 2-core dev VM: 0.78-0.98x). AMX: bf16 measured 1.05x
# with bf16 projections and 0.91x with int4 ones (benchmarks/cpu_dtype.py on the H200 host's
# 16-core AMX Xeon, 2026-12-01): not a gain worth other greedy tokens than fp32's, so fp32. A
# default is a measured choice, and this row is the one line to change.
DEFAULT_DTYPE = {
    "amx": ("float32", "bf16 measured 0.91-1.05x of fp32 with AMX"),
    "avx512_bf16": ("float32", "bf16 measured no faster without AMX"),
    "none": ("float32", "bf16 would be emulated"),
}


@dataclass(frozen=True)
class CpuFeatures:
    model: str  # "model name", or "unknown"
    flags: frozenset[str]  # the subset of FLAGS present

    @property
    def amx(self) -> bool:
        return {"amx_tile", "amx_bf16"} <= self.flags

    @property
    def avx512_bf16(self) -> bool:
        return "avx512_bf16" in self.flags

    @property
    def bf16_hardware(self) -> str:
        """A key of :data:`DEFAULT_DTYPE`: "amx", "avx512_bf16" or "none"."""
        return "amx" if self.amx else "avx512_bf16" if self.avx512_bf16 else "none"

    def default_dtype(self) -> str:
        """The compute dtype (a torch dtype's name) the CPU path takes when none is asked for."""
        return DEFAULT_DTYPE[self.bf16_hardware][0]

    def describe(self, dtype: str) -> str:
        """This CPU's bf16 hardware and how ``dtype`` (the compute dtype's name) came about: the
        default here and why, or asked for over another default; short: the start-up line shows
        it after the dtype and threads."""
        default, why = DEFAULT_DTYPE[self.bf16_hardware]
        hw = HARDWARE[self.bf16_hardware]
        if dtype == default:
            return f"{hw}: {dtype} by default ({why})"
        return f"{hw}: {dtype} as asked (the default here is {default}: {why})"


def read(text: str | None = None) -> CpuFeatures:
    """This CPU's features, from ``text`` (``/proc/cpuinfo``'s content; read when None). Without
    the file (not Linux) nothing is known, and ``describe`` says so."""
    if text is None:
        try:
            text = CPUINFO.read_text()
        except OSError:
            return CpuFeatures("unknown CPU (no /proc/cpuinfo)", frozenset())
    model, flags = "unknown CPU", frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model == "unknown CPU":
            model = value.strip()
        elif key == "flags" and not flags:
            flags = frozenset(value.split()) & frozenset(FLAGS)
    return CpuFeatures(model, flags)
