"""The router GEMV with the shared expert's gate_up in its launch (``qgemv``'s ``also``, the
decode step's) against the launches it replaces: shared by the interpreted and the CUDA tests."""

from __future__ import annotations

import torch

from edgerun.kernels.qlinear_reference import random_norm
from edgerun.kernels.qlinear_triton import qgemv
from edgerun.kernels.qweight import QWeight


def router(E: int, extra: int, D: int, dtype, seed: int, device="cpu") -> tuple:
    """A random plain router weight [E + X, D] (logits of normalised rows a few units wide) and
    a trained-like RMSNorm (weight, eps, unit_offset) with a unit offset (Qwen3.5's), as the
    decode step's router GEMV takes them, from ``seed``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    w = QWeight("plain", (torch.randn(E + extra, D, generator=gen, device=device) * 2 * D**-0.5).to(dtype))
    return w, random_norm("unit", D, gen, device, dtype)


def with_shared(w, norm, shared: QWeight, x) -> tuple[tuple, tuple]:
    """((logits, normalised x, SiLU(gate) * up) of the router GEMV with the shared expert's
    gate_up in its launch (``qgemv``'s ``also``), the same of the launches it replaces: the
    router (its norm_out), then the gate_up on the normalised x it stored. Outputs start as NaN:
    a value the one launch does not write shows."""
    N, D = x.shape
    nan = dict(dtype=x.dtype, device=x.device)
    logits = torch.full((N, w.rows), float("nan"), **nan)
    h = torch.full((N, D), float("nan"), **nan)
    mid = torch.full((N, shared.rows // 2), float("nan"), **nan)
    qgemv(x, w, out=logits, norm=norm, norm_out=h, also=(shared, "silu_mul", mid))
    h2 = torch.empty_like(h)
    apart = qgemv(x, w, norm=norm, norm_out=h2)
    return (logits, h, mid), (apart, h2, qgemv(h2, shared, epilogue="silu_mul"))
