"""The router GEMV that routes its own logits (``qgemv``'s ``topk``) against the two launches
it replaces (``qgemv``, then ``router_topk`` on its output): shared by the interpreted and the
CUDA tests."""

from __future__ import annotations

import torch

from edgerun.kernels.decode_reference import random_router
from edgerun.kernels.decode_triton import TopK, router_topk
from edgerun.kernels.qlinear_triton import qgemv


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
