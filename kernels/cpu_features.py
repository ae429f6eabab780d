"""What this CPU offers the CPU path, from ``/proc/cpuinfo``'s flags: AVX512-BF16 (bf16 dot
products) and AMX (``amx_tile`` + ``amx_bf16``: bf16 matrix tiles, which oneDNN uses for bf16
matmuls), named in the start-up line with the compute dtype and kernels chosen, so no choice is
silent.

The CPU default stays fp32 compute whatever the flags say: on AVX512-BF16 without AMX (this
project's dev VM) ``--dtype bfloat16`` measured no faster with the quantized kernels, which take
bf16 activations either way (docs/benchmarks.md, CPU peer); on AMX it is not measured yet, and
the line says so instead of choosing for the user.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


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

    def describe(self, dtype: str) -> str:
        """This CPU's bf16 hardware and, under the fp32 default (``dtype`` "float32"), why it is not
        bf16; short: the start-up line shows it after the dtype and threads."""
        hw = "AMX" if self.amx else "AVX512-BF16, no AMX" if self.avx512_bf16 else "no bf16 hardware"
        if dtype == "float32" and self.amx:
            return f"{hw} (bf16 not measured there)"
        if dtype == "float32" and self.avx512_bf16:
            return f"{hw} (bf16 no faster)"
        return hw


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
