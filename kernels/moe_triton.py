"""Triton kernels for the routed-expert step, reading weights straight from the slot pool.

Shape legend: T = tokens, A = active experts per token, P = T·A (token, expert) pairs,
U = distinct experts in a step, S = slots, D = hidden, I = expert width, g = group size.

Decode (few tokens, ``moe_gemv``), two launches; no weight is written back dequantized:
  1. gate_up GEMV + SiLU(gate)·up for every pair -> h fp32 [P, I]; a program per (pair, row tile).
  2. down GEMV, router weight and the sum over a token's A experts -> [T, D]; a program per
     (token, row tile) ranks the token's A entries by expert id itself and loops over them in
     that order. No atomics: the sum order is fixed, so the bits are too, whatever order the
     router listed the experts in.
Prefill (many tokens per expert, ``moe_grouped``): each distinct expert dequantized once into a
bf16 scratch (exact for int4 and bf16), then cuBLAS matmuls grouped by expert, accumulated in
fp32 in ascending expert-id order.

Rotation: a Hadamard bundle stores W_q with W = W_q·H_g on every group of g columns; H_g is
symmetric and orthonormal, so W·v = W_q·(H_g v per group). The kernels rotate the activations
(x before gate_up, h before down), one small launch each, instead of the weights.

Sums accumulate in fp32. Block sizes are fixed per format and geometry, never autotuned, so
every process reduces in the same order. Pools are indexed with 64-bit slot offsets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from edgerun.bundle.layout import BlockLayout
from edgerun.kernels.bits_triton import _e4m3, _nibbles
from edgerun.kernels.dense_triton import DTYPE_CODE, _round
from edgerun.kernels.launch import _grid_sync, pdl_kwargs
from edgerun.kernels.moe_reference import check_pool, layout_dims

QUANT_CODE = {"bf16": 0, "int8": 1, "int4": 2}
BITS = {"bf16": 16, "int8": 8, "int4": 4}
# (weight view, scale view) of the pool's bytes per scheme
VIEWS = {
    "bf16": (torch.bfloat16, None),
    "int8": (torch.int8, torch.float32),
    "int4": (torch.uint8, torch.uint8),
}


@dataclass(frozen=True)
class GemvConfig:
    """Fixed tile shape of the decode kernels (fixed: it decides the reduction order). The
    default was the fastest or within noise of it for int4 g32, int8 and bf16 in the sweep of
    benchmarks/bench_moe_kernel.py on an H200 (docs/benchmarks.md)."""

    block_r: int = 4  # output rows per program (launch 1: rows of gate and of up each)
    row_bytes: int = 512  # weight bytes of each row loaded per step
    num_warps: int = 2


DEFAULT_GEMV = GemvConfig()


# --------------------------------------------------------------------------------------------
# Device helpers


@triton.jit
def _rows_dot(
    w,
    s,
    r0,
    x,
    zero,
    C: tl.constexpr,
    QUANT: tl.constexpr,
    G: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """sum_c W[r0 + r, c] * x[c] for BLOCK_R rows of an [R, C] component at w (its scales at s),
    fp32, every scale applied but an int4 tensor's global one. Groups are summed, then scaled."""
    rows = r0 + tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in tl.static_range(0, C, BLOCK_K):  # unrolled: every load of the row can be in flight
        if QUANT == 2:
            j = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            lo, hi = _nibbles(tl.load(w + rows[:, None] * (C // 2) + j[None, :]), zero)
            xe = tl.load(x + 2 * j).to(tl.float32)
            xo = tl.load(x + 2 * j + 1).to(tl.float32)
            part = lo * xe[None, :] + hi * xo[None, :]
            part = tl.sum(tl.reshape(part, [BLOCK_R, BLOCK_K // G, G // 2]), axis=2)
            gi = k0 // G + tl.arange(0, BLOCK_K // G)
            acc += tl.sum(part * _e4m3(tl.load(s + rows[:, None] * (C // G) + gi[None, :])), axis=1)
        else:
            cols = k0 + tl.arange(0, BLOCK_K)
            xv = tl.load(x + cols).to(tl.float32)
            part = tl.load(w + rows[:, None] * C + cols[None, :]).to(tl.float32) * xv[None, :]
            if QUANT == 1 and G > 0:
                part = tl.sum(tl.reshape(part, [BLOCK_R, BLOCK_K // G, G]), axis=2)
                gi = k0 // G + tl.arange(0, BLOCK_K // G)
                acc += tl.sum(part * tl.load(s + rows[:, None] * (C // G) + gi[None, :]), axis=1)
            else:
                acc += tl.sum(part, axis=1)
    if QUANT == 1 and G == 0:
        acc *= tl.load(s + rows)
    return acc


@triton.jit
def _slot(slots, table, ids, p, TABLE: tl.constexpr):
    """The slot of pair p: slots[p], or (a layer whose every expert is held) table[ids[p]]."""
    if TABLE:
        return tl.load(table + tl.load(ids + p)).to(tl.int64)
    return tl.load(slots + p).to(tl.int64)  # 64-bit: slot * block passes 2^31 in large pools


# --------------------------------------------------------------------------------------------
# Kernels


@triton.jit(do_not_specialize=["zero"])  # a runtime 0 (see bits_triton._field)
def _gate_up_kernel(
    x,
    wpool,
    spool,
    slots,
    table,
    ids,
    gscales,
    h,
    w_block,
    s_block,
    w_off,
    s_off,
    zero,
    D: tl.constexpr,
    I: tl.constexpr,
    A: tl.constexpr,
    QUANT: tl.constexpr,
    G: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TABLE: tl.constexpr,
    PDL: tl.constexpr,
):
    _grid_sync(PDL)
    p = tl.program_id(0)  # pair t*A + a
    r0 = tl.program_id(1) * BLOCK_R
    slot = _slot(slots, table, ids, p, TABLE)
    w = wpool + slot * w_block + w_off
    s = spool + slot * s_block + s_off
    xt = x + (p // A) * D
    gate = _rows_dot(w, s, r0, xt, zero, D, QUANT, G, BLOCK_R, BLOCK_K)
    up = _rows_dot(w, s, r0 + I, xt, zero, D, QUANT, G, BLOCK_R, BLOCK_K)
    if QUANT == 2:
        g = tl.load(gscales + slot * 2)
        gate *= g
        up *= g
    tl.store(h + p * I + r0 + tl.arange(0, BLOCK_R), gate * tl.sigmoid(gate) * up)


@triton.jit(do_not_specialize=["zero"])
def _down_kernel(
    h,
    wpool,
    spool,
    slots,
    table,
    ids,
    rw,
    gscales,
    shared,
    out,
    w_block,
    s_block,
    w_off,
    s_off,
    zero,
    D: tl.constexpr,
    I: tl.constexpr,
    A: tl.constexpr,
    A_P2: tl.constexpr,
    QUANT: tl.constexpr,
    G: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TABLE: tl.constexpr,
    SHARED: tl.constexpr,
    INTO: tl.constexpr,
    CODE: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[t] = the router-weighted sum of token t's experts, rounded once; with INTO, out holds
    the residual and gets out + (routed [+ shared]) instead, rounded where the model's
    ``x.add_(routed + shared)`` rounds."""
    _grid_sync(PDL)
    t = tl.program_id(0)
    r0 = tl.program_id(1) * BLOCK_R
    # each entry's rank in (expert id, position) order: the experts are summed by ascending id
    ar = tl.arange(0, A_P2)
    valid = ar < A
    eid = tl.load(ids + t * A + ar, mask=valid, other=0)
    before = (eid[None, :] < eid[:, None]) | ((eid[None, :] == eid[:, None]) & (ar[None, :] < ar[:, None]))
    rank = tl.sum((before & valid[None, :]).to(tl.int32), axis=1)
    rank = tl.where(valid, rank, A_P2)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for r in tl.static_range(A):
        p = t * A + tl.sum(tl.where(rank == r, ar, 0))
        slot = _slot(slots, table, ids, p, TABLE)
        w = wpool + slot * w_block + w_off
        s = spool + slot * s_block + s_off
        y = _rows_dot(w, s, r0, h + p * I, zero, I, QUANT, G, BLOCK_R, BLOCK_K)
        if QUANT == 2:
            y *= tl.load(gscales + slot * 2 + 1)
        acc += y * tl.load(rw + p).to(tl.float32)
    cols = t * D + r0 + tl.arange(0, BLOCK_R)
    if INTO:
        acc = _round(acc, CODE)
        if SHARED:
            acc = _round(acc + tl.load(shared + cols).to(tl.float32), CODE)
        acc = _round(tl.load(out + cols).to(tl.float32) + acc, CODE)
    tl.store(out + cols, acc.to(out.dtype.element_ty))


@triton.jit
def _rotate_kernel(
    v,
    out,
    inv_sqrt_g,
    C: tl.constexpr,
    G: tl.constexpr,
    LOG_G: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[n] = v[n] with every group of G columns times H_G, the orthonormal Sylvester Hadamard
    matrix: H[i, j] = (-1)^popcount(i & j) / sqrt(G). fp32."""
    _grid_sync(PDL)
    n = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    vals = tl.reshape(tl.load(v + n * C + c).to(tl.float32), [BLOCK // G, G])
    i = tl.arange(0, G)
    m = i[:, None] & i[None, :]
    parity = tl.zeros([G, G], dtype=tl.int32)
    for b in tl.static_range(LOG_G):
        parity ^= (m >> b) & 1
    hm = (1 - 2 * parity).to(tl.float32) * inv_sqrt_g
    rot = tl.sum(vals[:, :, None] * hm[None, :, :], axis=1)  # rot[k, j] = sum_i vals[k, i] H[i, j]
    tl.store(out + n * C + c, tl.reshape(rot, [BLOCK]))


@triton.jit(do_not_specialize=["zero"])
def _dequant_kernel(
    wpool,
    spool,
    slots,
    gscales,
    out,
    w_block,
    s_block,
    w_off,
    s_off,
    zero,
    PROJ: tl.constexpr,
    R: tl.constexpr,
    C: tl.constexpr,
    QUANT: tl.constexpr,
    G: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One [R, C] projection of slot slots[u] -> out[u] as bf16: the reference's exact fp32
    values (q * scale), rounded once."""
    u = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    slot = tl.load(slots + u).to(tl.int64)
    w = wpool + slot * w_block + w_off
    s = spool + slot * s_block + s_off
    dst = out + u.to(tl.int64) * (R * C) + rows[:, None] * C
    for k0 in range(0, C, BLOCK_K):
        if QUANT == 2:
            j = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            lo, hi = _nibbles(tl.load(w + rows[:, None] * (C // 2) + j[None, :]), zero)
            gi = k0 // G + tl.arange(0, BLOCK_K // G)
            step = _e4m3(tl.load(s + rows[:, None] * (C // G) + gi[None, :])) * tl.load(
                gscales + slot * 2 + PROJ
            )
            step = tl.reshape(step, [BLOCK_R, BLOCK_K // G, 1])
            lo = tl.reshape(tl.reshape(lo, [BLOCK_R, BLOCK_K // G, G // 2]) * step, [BLOCK_R, BLOCK_K // 2])
            hi = tl.reshape(tl.reshape(hi, [BLOCK_R, BLOCK_K // G, G // 2]) * step, [BLOCK_R, BLOCK_K // 2])
            vals = tl.reshape(tl.join(lo, hi), [BLOCK_R, BLOCK_K])
        else:
            cols = k0 + tl.arange(0, BLOCK_K)
            vals = tl.load(w + rows[:, None] * C + cols[None, :]).to(tl.float32)
            if QUANT == 1:
                if G == 0:
                    vals *= tl.load(s + rows)[:, None]
                else:
                    gi = k0 // G + tl.arange(0, BLOCK_K // G)
                    sc = tl.reshape(
                        tl.load(s + rows[:, None] * (C // G) + gi[None, :]), [BLOCK_R, BLOCK_K // G, 1]
                    )
                    vals = tl.reshape(tl.reshape(vals, [BLOCK_R, BLOCK_K // G, G]) * sc, [BLOCK_R, BLOCK_K])
        tl.store(dst + k0 + tl.arange(0, BLOCK_K)[None, :], vals.to(tl.bfloat16))


# --------------------------------------------------------------------------------------------
# Host side


def _pow2_divisor(n: int, at_most: int) -> int:
    """Largest power of two <= at_most that divides n."""
    p = 1
    while p * 2 <= at_most and n % (p * 2) == 0:
        p *= 2
    return p


def _block_k(cols: int, layout: BlockLayout, row_bytes: int) -> int | None:
    """Columns per step: about row_bytes of weights, whole scale groups, dividing cols."""
    p = _pow2_divisor(cols, row_bytes * 8 // BITS[layout.quant])
    p = max(p, layout.group_size, 2 if layout.quant == "int4" else 1)
    return p if cols % p == 0 else None


def unsupported(layout: BlockLayout) -> str | None:
    """Why these kernels cannot compute ``layout``'s experts; None when they can."""
    if layout.quant not in QUANT_CODE:
        return f"quant {layout.quant!r} has no Triton kernel"
    G = layout.group_size
    if G & (G - 1):
        return f"group size {G} is not a power of two"
    D, I = layout_dims(layout)
    for what, cols in (("hidden size", D), ("expert width", I)):
        if _block_k(cols, layout, DEFAULT_GEMV.row_bytes) is None:
            return f"{what} {cols} has no power-of-two column block holding whole groups of {G}"
    return None


def _views(pool: torch.Tensor, layout: BlockLayout) -> tuple[torch.Tensor, torch.Tensor]:
    wdt, sdt = VIEWS[layout.quant]
    wv = pool.view(wdt)
    return wv, (pool.view(sdt) if sdt is not None else wv)


def _component_args(layout: BlockLayout, proj: str, wv: torch.Tensor, sv: torch.Tensor) -> tuple[int, ...]:
    """(block, block, offset, offset) in elements of the weight and scale views."""
    we, se = wv.element_size(), sv.element_size()
    w_off = layout.component(f"{proj}.weight").offset // we
    s_off = layout.component(f"{proj}.scales").offset // se if layout.quant != "bf16" else 0
    return layout.block_bytes // we, layout.block_bytes // se, w_off, s_off


def rotate_activations(v: torch.Tensor, g: int) -> torch.Tensor:
    """v [N, C] -> fp32 [N, C], each group of g columns times H_g: one launch, graph-safe."""
    N, C = v.shape
    out = torch.empty(N, C, dtype=torch.float32, device=v.device)
    if N:
        block = max(_pow2_divisor(C, 256), g)
        inv = (torch.ones(1) / math.sqrt(g)).item()  # the fp32 entry of quant.hadamard, exactly
        _rotate_kernel[(N, C // block)](
            v.contiguous(), out, inv, C=C, G=g, LOG_G=g.bit_length() - 1, BLOCK=block, **pdl_kwargs(v.device)
        )
    return out


def _check(x, pool, slot_idx, expert_ids, weights, layout, global_scales) -> None:
    check_pool(pool, layout, global_scales)
    why = unsupported(layout)
    if why:
        raise ValueError(f"Triton MoE kernels cannot run this bundle: {why}")
    D, _ = layout_dims(layout)
    if x.dim() != 2 or x.shape[1] != D:
        raise ValueError(f"x must be [T, D={D}], got {list(x.shape)}")
    if not (slot_idx.shape == expert_ids.shape == weights.shape) or slot_idx.shape[0] != x.shape[0]:
        raise ValueError(
            f"x {list(x.shape)}, slot_idx {list(slot_idx.shape)}, expert_ids {list(expert_ids.shape)} and "
            f"weights {list(weights.shape)} must agree on [T, A]"
        )
    if not pool.is_contiguous():
        raise ValueError("the slot pool must be contiguous")
    for name, t in (("x", x), ("slot_idx", slot_idx), ("expert_ids", expert_ids), ("weights", weights)):
        if t.device != pool.device:
            raise ValueError(f"{name} is on {t.device}, the slot pool on {pool.device}")


def moe_gemv(
    x: torch.Tensor,
    pool: torch.Tensor,
    slot_idx: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    layout: BlockLayout,
    global_scales: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: GemvConfig = DEFAULT_GEMV,
    table: torch.Tensor | None = None,
    into: tuple[torch.Tensor, torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """Decode: fused dequant + GEMV from the pool, two launches (four with a rotation). Same
    contract as ``moe_experts_ref``, except that everything runs in fp32 and is rounded to
    ``out_dtype`` once. Slots must be in range (not checked: that would cost a device sync).

    ``table`` (int64 [E], every expert of the layer held): the slot of an entry is
    ``table[expert_ids]``, looked up inside the kernels (``slot_idx`` is then not read).
    ``into`` (resid [T, D], shared [T, D] or None): the result is added into ``resid`` in place,
    as ``resid.add_(routed + shared)`` rounds, and ``resid`` is returned."""
    _check(x, pool, slot_idx, expert_ids, weights, layout, global_scales)
    D, I = layout_dims(layout)
    T, A = slot_idx.shape
    resid, shared = into if into is not None else (None, None)
    if resid is not None:
        _check_into(resid, shared, (T, D), x)
    out = resid if resid is not None else torch.empty(T, D, dtype=out_dtype or x.dtype, device=x.device)
    if T == 0:
        return out
    slots = slot_idx.to(torch.int64).contiguous()  # no copy (and no launch) when already so
    ids, rw = expert_ids.contiguous(), weights.contiguous()
    q, G = QUANT_CODE[layout.quant], layout.group_size
    rotated = layout.rotation == "hadamard"
    wv, sv = _views(pool, layout)
    gs = global_scales.contiguous() if layout.quant == "int4" else rw  # unused placeholder otherwise
    tab = table if table is not None else slots  # placeholder when unused
    xin = rotate_activations(x, G) if rotated else x.contiguous()
    h = torch.empty(T * A, I, dtype=torch.float32, device=x.device)
    br = _pow2_divisor(I, config.block_r)
    bk = _block_k(D, layout, config.row_bytes)
    _gate_up_kernel[(T * A, I // br)](
        xin, wv, sv, slots, tab, ids, gs, h, *_component_args(layout, "gate_up", wv, sv), 0,
        D=D, I=I, A=A, QUANT=q, G=G, BLOCK_R=br, BLOCK_K=bk, TABLE=table is not None,
        num_warps=config.num_warps, **pdl_kwargs(x.device),
    )  # fmt: skip
    if rotated:
        h = rotate_activations(h, G)
    br = _pow2_divisor(D, config.block_r)
    bk = _block_k(I, layout, config.row_bytes)
    _down_kernel[(T, D // br)](
        h, wv, sv, slots, tab, ids, rw, gs, shared if shared is not None else out, out,
        *_component_args(layout, "down", wv, sv), 0,
        D=D, I=I, A=A, A_P2=triton.next_power_of_2(A), QUANT=q, G=G, BLOCK_R=br, BLOCK_K=bk,
        TABLE=table is not None, SHARED=shared is not None, INTO=resid is not None,
        CODE=DTYPE_CODE.get(out.dtype, 0), num_warps=config.num_warps, **pdl_kwargs(x.device),
    )  # fmt: skip
    return out


def _check_into(resid: torch.Tensor, shared: torch.Tensor | None, shape: tuple[int, int], x) -> None:
    for name, t in (("resid", resid), ("shared", shared)):
        if t is None:
            continue
        if tuple(t.shape) != shape or not t.is_contiguous() or t.device != x.device:
            raise ValueError(
                f"{name} must be a contiguous {list(shape)} tensor on {x.device}, got {list(t.shape)}"
            )
        if t.dtype != resid.dtype:
            raise ValueError(f"{name} is {t.dtype}, resid {resid.dtype}: they must agree")


def dequantize_slots(
    pool: torch.Tensor,
    slots: torch.Tensor,
    layout: BlockLayout,
    global_scales: torch.Tensor | None,
    gate_up: torch.Tensor,
    down: torch.Tensor,
) -> None:
    """slots int64 [U] -> gate_up bf16 [U, 2I, D] and down bf16 [U, D, I], written in place:
    the stored (unrotated) weights, bit-equal to ``dequantize_block`` of a rotation-free layout
    rounded to bf16. Two launches."""
    D, I = layout_dims(layout)
    wv, sv = _views(pool, layout)
    gs = global_scales.contiguous() if layout.quant == "int4" else gate_up  # placeholder otherwise
    q, G = QUANT_CODE[layout.quant], layout.group_size
    for proj, dst, R, C in (("gate_up", gate_up, 2 * I, D), ("down", down, D, I)):
        br = _pow2_divisor(R, 16)
        bk = _block_k(C, layout, 256)
        _dequant_kernel[(slots.numel(), R // br)](
            wv, sv, slots, gs, dst, *_component_args(layout, proj, wv, sv), 0,
            PROJ=int(proj == "down"), R=R, C=C, QUANT=q, G=G, BLOCK_R=br, BLOCK_K=bk, num_warps=4,
        )  # fmt: skip


def moe_grouped(
    x: torch.Tensor,
    pool: torch.Tensor,
    slot_idx: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    layout: BlockLayout,
    global_scales: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    scratch_experts: int = 16,
    acc: torch.Tensor | None = None,
    expert_range: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Prefill: each distinct expert dequantized once into bf16 scratch (at most
    ``scratch_experts`` at a time), then one cuBLAS GEMM per projection and expert over its
    tokens; bf16 operands and products, sums in fp32 in ascending expert-id order. One host sync
    (the experts' token counts). ``expert_range`` (lo, hi): only those experts run, added into
    ``acc`` (fp32 [T, D]), which is returned as is (the caller rounds it once, at the end)."""
    _check(x, pool, slot_idx, expert_ids, weights, layout, global_scales)
    D, I = layout_dims(layout)
    T, A = slot_idx.shape
    out = torch.zeros(T, D, dtype=torch.float32, device=x.device) if acc is None else acc
    flat = expert_ids.flatten()
    order = torch.argsort(flat, stable=True)
    if expert_range is not None:
        e = flat[order]
        order = order[(e >= expert_range[0]) & (e <= expert_range[1])]
        if order.numel() == 0:
            return out
    _, counts = torch.unique_consecutive(flat[order], return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    uslots = slot_idx.flatten()[order][starts].to(torch.int64)
    token_of = order // A
    rw = weights.flatten()[order].float()
    rotated, G = layout.rotation == "hadamard", layout.group_size
    xin = (rotate_activations(x, G) if rotated else x).to(torch.bfloat16)
    counts = counts.tolist()
    U, chunk = len(counts), max(1, scratch_experts)
    gu = torch.empty(min(U, chunk), 2 * I, D, dtype=torch.bfloat16, device=x.device)
    dn = torch.empty(min(U, chunk), D, I, dtype=torch.bfloat16, device=x.device)
    start = 0
    for c0 in range(0, U, chunk):
        n = min(chunk, U - c0)
        dequantize_slots(pool, uslots[c0 : c0 + n].contiguous(), layout, global_scales, gu[:n], dn[:n])
        for u in range(n):
            c = counts[c0 + u]
            tok = token_of[start : start + c]
            gate, up = F.linear(xin[tok], gu[u]).float().chunk(2, dim=-1)
            hid = F.silu(gate) * up
            if rotated:
                hid = rotate_activations(hid, G)
            y = F.linear(hid.to(torch.bfloat16), dn[u]).float() * rw[start : start + c, None]
            out.index_put_((tok,), y, accumulate=True)  # tokens are unique within one expert
            start += c
    return out if acc is not None else out.to(out_dtype or x.dtype)
