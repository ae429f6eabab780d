"""The router GEMV that routes its own logits (``qgemv``'s ``topk``) against the two launches
it replaces (``qgemv``, then ``router_topk`` on its output): shared by the interpreted and the
CUDA tests."""

from __future__ import annotations

import torch

from edgerun.kernels.decode_reference import random_router
from edgerun.kernels.decode_triton import TopK, router_topk
from edgerun.kernels.qlinear_triton import qgemv
from edgerun.kernels.qweight import QWeight


def router(E: int, extra: int, D: int, dtype, seed: int, device="cpu") -> tuple:
    """``random_router`` with a unit-offset norm (Qwen3.5's), from ``seed``."""
    return random_router(E, extra, D, torch.Generator(device=device).manual_seed(seed), device, dtype, True)


def both_ways(w, norm, x, E: int, A: int, normalize: bool, count: torch.Tensor, **kw) -> tuple[tuple, tuple]:
    """((logits, weights, ids) of the one launch, the same of the two), x's rows RMS-normalised in
    the GEMV. The one launch writes into NaN / -1 (a row routed from logits not yet stored, or
    not routed, shows); ``kw``: qgemv's ``config``, ``alone``."""
    N = x.shape[0]
    logits = torch.full((N, w.rows), float("nan"), dtype=x.dtype, device=x.device)
    weights = torch.full((N, A), float("nan"), dtype=x.dtype, device=x.device)
    ids = torch.full((N, A), -1, dtype=torch.int64, device=x.device)
    topk = TopK(E, A, normalize, weights, ids, count)
    qgemv(x, w, out=logits, norm=norm, topk=topk, **kw)
    apart = qgemv(x, w, norm=norm, **kw)
    w2, i2 = torch.empty_like(weights), torch.empty_like(ids)
    router_topk(apart, E, A, normalize, w2, i2)
    return (logits, weights, ids), (apart, w2, i2)


def with_shared(w, norm, shared: QWeight, x, E: int, A: int, count: torch.Tensor) -> tuple[tuple, tuple]:
    """((logits, weights, ids, normalised x, SiLU(gate) * up) of the router GEMV with the shared
    expert's gate_up in its launch (``qgemv``'s ``also``), the same of the launches it replaces:
    the router (its top-k, its norm_out), then the gate_up on the normalised x it stored.
    Outputs start as NaN / -1: a value the one launch does not write shows."""
    N, D = x.shape
    nan = dict(dtype=x.dtype, device=x.device)
    logits = torch.full((N, w.rows), float("nan"), **nan)
    weights = torch.full((N, A), float("nan"), **nan)
    ids = torch.full((N, A), -1, dtype=torch.int64, device=x.device)
    h = torch.full((N, D), float("nan"), **nan)
    mid = torch.full((N, shared.rows // 2), float("nan"), **nan)
    topk = TopK(E, A, True, weights, ids, count)
    qgemv(x, w, out=logits, norm=norm, norm_out=h, topk=topk, also=(shared, "silu_mul", mid))
    h2 = torch.empty_like(h)
    apart = qgemv(x, w, norm=norm, norm_out=h2)
    w2, i2 = torch.empty_like(weights), torch.empty_like(ids)
    router_topk(apart, E, A, True, w2, i2)
    return (logits, weights, ids, h, mid), (apart, w2, i2, h2, qgemv(h2, shared, epilogue="silu_mul"))
