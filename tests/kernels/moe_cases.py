"""Shared cases for the expert-kernel tests: layouts of every scheme and random routed steps."""

from __future__ import annotations

import torch

from edgerun.bundle.layout import BlockLayout, expert_block_layout
from edgerun.kernels.moe_reference import random_pool
from hf_fixtures import tiny_moe_args

# (quant, group, rotation) for the tiny geometry (D 64, I 32): every scheme, both int4 groups,
# int8 per row and per group, Hadamard on both quantized schemes
FORMATS = [
    ("bf16", None, "none"),
    ("int8", None, "none"),
    ("int8", 16, "none"),
    ("int8", 32, "hadamard"),
    ("int4", 16, "none"),
    ("int4", 32, "none"),
    ("int4", 16, "hadamard"),
]
# the real model's schemes (D 2048, I 512)
REAL_FORMATS = [
    ("bf16", None, "none"),
    ("int8", None, "none"),
    ("int4", 32, "none"),
    ("int4", 32, "hadamard"),
]


def fmt_id(fmt) -> str:
    q, g, r = fmt
    return q + (f"-g{g}" if g else "") + ("-rot" if r == "hadamard" else "")


def layout_for(fmt, hidden: int = 64, inter: int = 32) -> BlockLayout:
    quant, group, rotation = fmt
    return expert_block_layout(tiny_moe_args(hidden, inter, experts=8, top_k=2), quant, group, rotation)


def random_step(
    layout, T, A, S, gen, device="cpu", x_dtype=torch.float32, pool=None, gscales=None, slots=None
):
    """A routed step over a pool: each token picks A distinct experts of S (expert e lives in slot
    ``slots[e]``, a random permutation unless given). Returns the argument tuple of
    ``moe_experts_ref`` minus ``out_dtype``."""
    if pool is None:
        pool, gscales = random_pool(layout, S, generator=gen, device=device)
    if slots is None:
        slots = torch.randperm(S, generator=gen, device=device)
    D = layout.component("down.weight").shape[0]
    x = torch.randn(T, D, generator=gen, device=device).to(x_dtype)
    ids = torch.rand(T, S, generator=gen, device=device).argsort(dim=1)[:, :A]
    weights = torch.rand(T, A, generator=gen, device=device).softmax(dim=-1)
    return x, pool, slots[ids], ids, weights, layout, gscales


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| over max |ref|: error relative to the output's scale."""
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max())


def check_gemv_a8(K, layout, T, A, S, gen, device, tol: float) -> tuple:
    """``moe_gemv``'s ``xq`` (x quantized to int8 per 32 columns, as the router's launch stores
    it): within ``tol`` (the fp32 GEMV path's summation order) of the reference run on that x's
    values (q s, fp64), not bf16 x's result, the same bits again, and x itself not read. Returns
    the xq it ran."""
    from edgerun.kernels.moe_reference import moe_experts_ref
    from edgerun.kernels.qlinear_w4a8 import quantize_rows_ref, quantized_values_ref

    args = random_step(layout, T, A, S, gen, device)
    x = args[0]
    xq = quantize_rows_ref(x)
    ref = moe_experts_ref(quantized_values_ref(x), *args[1:])
    out = K.moe_gemv(*args, xq=xq)
    assert out.dtype == torch.float32 and rel_err(out, ref) < tol
    assert rel_err(K.moe_gemv(*args), ref) > 10 * tol  # x's own products are not these
    assert torch.equal(out, K.moe_gemv(*args, xq=xq))
    assert torch.equal(out, K.moe_gemv(torch.zeros_like(x), *args[1:], xq=xq))
    return xq


def check_gemv_tokens_alone(K, layout, T, A, S, gen, device) -> None:
    """``moe_gemv``'s rows of T tokens, each equal to the token's call alone (``torch.equal``),
    into a residual with a shared expert's output as the model calls it, three times over: the
    down kernel's last program to arrive sums a token's experts, and which one that is must
    not change the bits. Tokens share experts (S small against T A), as a batch's rows do."""
    x, pool, slots, ids, w, layout, gs = random_step(layout, T, A, S, gen, device, torch.bfloat16)
    resid = torch.randn(T, x.shape[1], generator=gen, device=device).bfloat16()
    shared = torch.randn(T, x.shape[1], generator=gen, device=device).bfloat16()

    def run(rows):
        r = resid[rows].clone()
        return K.moe_gemv(x[rows], pool, slots[rows], ids[rows], w[rows], layout, gs, into=(r, shared[rows]))

    every = slice(0, T)
    out = run(every)
    for _ in range(2):
        assert torch.equal(run(every), out)
    for t in range(T):
        assert torch.equal(run(slice(t, t + 1)), out[t : t + 1]), (
            f"token {t} of {T} differs from its call alone"
        )
