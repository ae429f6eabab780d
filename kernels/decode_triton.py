"""Triton kernels for the router and the full-attention layer of a decode step (one sequence,
or the rows of a batch's step, each at its own position in its own entry of a state pool).

Shape legend: N = rows, E = experts, X = extra logit columns, A = active experts (top_k),
H = query heads, Hk = kv heads, G = H / Hk, Dh = head dim, R = rotary dim, S = S_max (the static
KV buffer's positions), P = NSPLIT (splits of the positions 0..pos).

- ``router_topk``: softmax over E in fp32, top-k, renormalisation, the shared-expert gate's
  sigmoid; a program per row (3.6 µs on an H200 at E 256, against 21 µs for the torch ops; 2.9
  on an H100 with one integer max a pick, benchmarks/bench_route.py).
  Experts are picked by their logit as stored: softmax is monotone, so this is the reference's
  order wherever its fp32 probabilities differ, and an ulp of exp cannot reorder them. Equal
  logits (-0.0 and +0.0 among them) go lowest id first. The softmax denominator and the renormalisation are summed in
  64-bit fixed point (``_fixed_sum``: exact adds, so no order or warp count shows in the bits).
  A decode step over a slot table runs it in the expert gate_up launch instead (``_route_row``
  and ``_pick``, the same keys and sums: ``moe_triton.moe_gemv``'s ``route``), one launch fewer
  a MoE layer; elsewhere it is a launch of its own after the router GEMV's. In the GEMV's launch
  (its last program to arrive routing, as an earlier version did) each program's arrival and the
  serial tail cost the step 5 µs a MoE layer on an H100, where this launch alone took 2.9 µs
  (docs/benchmarks.md, 2026-12-06, thirty-third session).
- ``attention_decode``: ``Attention.decode_static`` between the projections and o_proj, in two
  launches, each with a grid axis over rows (a row's programs are the one-row call's, offset to
  its qkv row, position and cache entry). ``_attend_kernel``, a program per (kv head, split): q/k
  RMSNorm and RoPE at ``pos``
  (read on the device), the new key and value written at ``pos`` by the program whose split
  holds it, then flash-decoding over its split of 0..pos for the kv head's G query heads at once
  (one [G, Dh] x [Dh, BLOCK_S] dot per tile, so K and V are read once per kv head). The split
  length is cdiv(pos + 1, P) rounded up to BLOCK_S, computed on the device: every active program
  gets an equal share at any pos, programs past pos exit at once, and positions past pos are
  never read. ``_combine_kernel``, a program per (query head, 64 channels): merges the active
  splits' partial (max, sum, acc) rows in a fixed order, applies the output gate, rounds. With
  PDL (``ATTN_EARLY``, not in a window) an attend program reads the position, the slot and its
  split's first tile of keys and values older than pos before its wait, and takes the row at pos
  from the registers that stored it; a combine program reads the position and the gate early.
  Measured on an H200 (bf16, both launches, CUDA-graph replay): Qwen3.6's geometry (16/2 heads
  of 256) 9 µs at pos 100, 11 µs at 3000, 28 µs at 32767 (67 MB of K and V: 2.4 TB/s), where
  decode_static's torch ops take 260 µs at any pos; Qwen3-30B's (32/4 of 128) 7, 8 and 27-33 µs.
  ``window``: the rows are a speculative verify window, consecutive tokens of one sequence, still
  two launches: each attend program writes the keys and values of its row and the earlier rows
  that fall in its split (``_write_kv``, the one write either way; programs writing the same
  position write the same bits), then reads them, so no program waits for another and a row's
  bits are its one-row call's, in order.

Math is fp32, rounded to the model dtype wherever the modules round (norm products, cos/sin,
each rotary product and sum, the probabilities before P @ V, the attention output, the sigmoid
gate and its product). The one rounding the kernel cannot take at the module's place: the module
rounds the normalised probabilities, the kernel the unnormalised ones of its running softmax (a
different 2^-9 rounding of each weight). Dots take the model dtype's operands on tensor cores
with fp32 accumulation (an fp32 model: ieee fp32). Under Triton's CPU interpreter (CPU tensors,
``EMULATE``) the operands are widened to fp32 first, exact, because the interpreter multiplies
bf16 dot operands as raw integers; and the tile loop is a while, because it cannot run a for over
device values. Same tile function, same products: the interpreter tests check the math the GPU
runs.

Tile shapes, warps and P are a fixed function of the geometry (never autotuned), nothing is
atomic and every reduction has a fixed order, so the bits repeat. No host syncs and no
allocation that depends on pos: both calls can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from edgerun.kernels import launch
from edgerun.kernels.bits_triton import (
    KEY32_EMPTY,
    KEY_EMPTY,
    _key32_index,
    _key32_value,
    _key_index,
    _key_value,
    _order_key,
    _order_key32,
)
from edgerun.kernels.dense_triton import DTYPE_CODE, _check, _round, _warps
from edgerun.kernels.launch import _grid_sync, pdl_kwargs

MAX_EXPERTS = 1024  # a router row is one program's tile
TARGET_PROGRAMS = 128  # attend programs at the longest contexts: about one per SM of an H200 (132)
MAX_HEAD_DIM = 256
MAX_TILE = 8192  # elements of a combine program's tile of partial outputs
# the attend launch reads the row's position, slot and its split's first tile of older keys and
# values, and the combine launch the position and output gate, before their waits (``EARLY``: the
# same bits): 40-layer decode +0.5% on an H100, every round of three (docs/benchmarks.md,
# 2026-12-07, fortieth session); False: after them (an A/B switch for benchmarks/ab_decode.py,
# read at the call)
ATTN_EARLY = True
# the combine launch lets the o_proj GEMV after it launch before its own wait, so o_proj's programs
# read their first weights while the attend launch still runs (kernels/launch.py's LAUNCH_FIRST;
# the same bits); off: it lost 1.4% at 40 layers on an H100 (docs/benchmarks.md, 2026-12-07,
# forty-first session; the one profiled step does not say where); an A/B switch for
# benchmarks/ab_decode.py
COMBINE_LAUNCH_FIRST = False
LOG2E = 1.4426950408889634  # scores in log2 units: exp2 in the softmax


# --------------------------------------------------------------------------------------------
# Router


@triton.jit
def _fixed_sum(v):
    """The sum of fp32 v [BLOCK] (values in [0, 1], at most MAX_EXPERTS of them) in 64-bit fixed
    point, units of 2^-52: integer adds are exact, so the result is the same whatever order the
    compiled reduction takes (it follows the layout, so the warp count). Each term is truncated by under 2^-52, the total (< 2^62)
    rounded to fp32 once."""
    q = (v * 4503599627370496.0).to(tl.int64)  # 2^52: exact, then truncated
    return tl.sum(q, axis=0).to(tl.float32) * 2.220446049250313e-16  # 2^-52: exact


@triton.jit
def _route_row(logits, row_stride, n, weights, ids, gate, E: tl.constexpr, K: tl.constexpr,
               BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, NORMALIZE: tl.constexpr,
               HAS_GATE: tl.constexpr, CODE: tl.constexpr, KEY32: tl.constexpr = False):  # fmt: skip
    """Row n of logits [N, E + X] to weights / ids [N, A] (and the gate [N, 1]): ``router_topk``'s
    program. Each pick is one integer max of ``bits_triton._order_key``s (exact, the value and
    the lowest id among equals at once; KEY32, bf16 logits: ``_order_key32``'s, in the same
    order) and the sums are ``_fixed_sum``'s, so no value depends on the kernel's warps."""
    n = n.to(tl.int64)
    row = logits + n * row_stride
    top, top_id = _route_vals(row, E, K, BLOCK_E, BLOCK_K, NORMALIZE, CODE, KEY32)
    j = tl.arange(0, BLOCK_K)
    out = n * K + j
    tl.store(weights + out, top.to(weights.dtype.element_ty), mask=j < K)
    tl.store(ids + out, top_id.to(tl.int64), mask=j < K)
    if HAS_GATE:
        g = tl.load(row + E).to(tl.float32)
        tl.store(gate + n, _round(1.0 / (1.0 + tl.exp(-g)), CODE).to(gate.dtype.element_ty))


@triton.jit
def _route_keys(row, E: tl.constexpr, BLOCK_E: tl.constexpr, KEY32: tl.constexpr = False):
    """A logit row's values (fp32) and their keys (padding: -inf and the empty key):
    ``_order_key``'s int64, or (KEY32, bf16 logits) ``_order_key32``'s int32 in the same order."""
    e = tl.arange(0, BLOCK_E)
    valid = e < E
    x = tl.load(row + e, mask=valid, other=float("-inf")).to(tl.float32)
    if KEY32:
        key = tl.where(valid, _order_key32(x, e), KEY32_EMPTY)
    else:
        key = tl.where(valid, _order_key(x, e), KEY_EMPTY)
    return x, key


@triton.jit
def _key_parts(key, KEY32: tl.constexpr):
    """(value, index) of a ``_route_keys`` key."""
    if KEY32:
        value, index = _key32_value(key), _key32_index(key)
    else:
        value, index = _key_value(key), _key_index(key)
    return value, index


@triton.jit
def _drop(key, best, KEY32: tl.constexpr):
    """The keys without ``best`` (keys are unique: exactly the pick)."""
    if KEY32:
        out = tl.where(key == best, KEY32_EMPTY, key)
    else:
        out = tl.where(key == best, KEY_EMPTY, key)
    return out


@triton.jit
def _route_vals(row, E: tl.constexpr, K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                NORMALIZE: tl.constexpr, CODE: tl.constexpr, KEY32: tl.constexpr = False):  # fmt: skip
    """A logit row's routing: (weights [BLOCK_K] fp32, rounded to the model dtype as stored;
    ids [BLOCK_K] int32), entries past K 0."""
    x, key = _route_keys(row, E, BLOCK_E, KEY32)
    valid = tl.arange(0, BLOCK_E) < E
    j = tl.arange(0, BLOCK_K)
    top_x = tl.zeros([BLOCK_K], dtype=tl.float32)
    top_id = tl.zeros([BLOCK_K], dtype=tl.int32)
    best = tl.max(key, axis=0)
    m, _ = _key_parts(best, KEY32)  # the row's max
    for i in tl.static_range(K):  # k passes of one max each: largest logit, lowest id among equals
        value, index = _key_parts(best, KEY32)
        top_x = tl.where(j == i, value, top_x)
        top_id = tl.where(j == i, index, top_id)
        if i + 1 < K:
            key = _drop(key, best, KEY32)
            best = tl.max(key, axis=0)
    total = _fixed_sum(tl.where(valid, tl.exp(x - m), 0.0))
    top = tl.exp(top_x - m) / total  # the same expression as each softmax entry
    if NORMALIZE:
        top = top / _fixed_sum(tl.where(j < K, top, 0.0))
    return tl.where(j < K, _round(top, CODE), 0.0), tl.where(j < K, top_id, 0)


@triton.jit
def _pick(row, a, E: tl.constexpr, K: tl.constexpr, BLOCK_E: tl.constexpr, KEY32: tl.constexpr = False):
    """The id of a logit row's pick ``a`` (0-based, a < K; a runtime value): ``_route_vals``'s
    picks on the same keys, a + 1 maxima. KEY32 (bf16 logits): on ``_order_key32``'s int32 keys,
    which order a bf16 row exactly as the int64 keys do, so the same ids."""
    _, key = _route_keys(row, E, BLOCK_E, KEY32)
    best = tl.max(key, axis=0)
    for i in tl.static_range(K - 1):
        if i < a:
            key = _drop(key, best, KEY32)
            best = tl.max(key, axis=0)
    _, index = _key_parts(best, KEY32)
    return index


@triton.jit
def _router_kernel(
    logits,
    weights,
    ids,
    gate,
    row_stride,
    E: tl.constexpr,
    K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NORMALIZE: tl.constexpr,
    HAS_GATE: tl.constexpr,
    CODE: tl.constexpr,
    PDL: tl.constexpr,
):
    _grid_sync(PDL)
    _route_row(logits, row_stride, tl.program_id(0), weights, ids, gate, E, K, BLOCK_E, BLOCK_K, NORMALIZE,
               HAS_GATE, CODE)  # fmt: skip


# --------------------------------------------------------------------------------------------
# Attention


@triton.jit
def _split_len(pos, NSPLIT: tl.constexpr, BLOCK_S: tl.constexpr):
    """Positions per split for a step at ``pos``: cdiv(pos + 1, NSPLIT) in whole tiles."""
    share = (pos + NSPLIT) // NSPLIT
    return (share + BLOCK_S - 1) // BLOCK_S * BLOCK_S


@triton.jit
def _scale(y, wf, UNIT_OFFSET: tl.constexpr, CODE: tl.constexpr):
    """RMSNorm's weight step on the normalised fp32 y, rounded as the module rounds."""
    if UNIT_OFFSET:
        return _round(y * (1.0 + wf), CODE)
    return _round(_round(y, CODE) * wf, CODE)


@triton.jit
def _norm_w(w, c, cmask, partner, rot):
    """A q or k norm's weights at channels c [1, DP] and at their rotate_half partners (fp32):
    weights, loadable before a PDL wait (``_norm_rope`` takes them)."""
    wf = tl.load(w + c, mask=cmask, other=0.0).to(tl.float32)
    return wf, tl.load(w + partner, mask=cmask & rot, other=0.0).to(tl.float32)


@triton.jit
def _norm_rope(
    row, rmask, wf, wpf, c, cmask, partner, sign, rot, cos, sin, eps,
    DH: tl.constexpr, UNIT_OFFSET: tl.constexpr, CODE: tl.constexpr,
):  # fmt: skip
    """RMSNorm then RoPE of rows [rows, 1] (pointers) over channels c [1, DP], the norm's weights
    at c and at the partners ``_norm_w``'s. rotate_half needs each channel's partner: it is
    normalised again from memory (same inputs, same bits)."""
    m = rmask & cmask
    x = tl.load(row + c, mask=m, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, axis=1) / DH + eps)[:, None]
    y = _scale(x * inv, wf, UNIT_OFFSET, CODE)
    xp = tl.load(row + partner, mask=m & rot, other=0.0).to(tl.float32)
    yp = _scale(xp * inv, wpf, UNIT_OFFSET, CODE)
    rotated = _round(_round(y * cos, CODE) + _round(sign * yp * sin, CODE), CODE)
    return tl.where(rot, rotated, y)


@triton.jit
def _rope_tables(pos, inv_freq, c, R: tl.constexpr, CODE: tl.constexpr):
    """Rotary tables at ``pos`` over channels c [1, DP] (Rotary.forward: fp32 angle, cos/sin
    rounded to the model dtype): whether a channel rotates, its rotate_half partner and sign,
    cos, sin."""
    half: tl.constexpr = R // 2
    rot = c < R
    partner = tl.where(c < half, c + half, c - half)
    sign = tl.where(c < half, -1.0, 1.0)
    angle = pos.to(tl.float32) * tl.load(inv_freq + c % half, mask=rot, other=0.0)
    return rot, partner, sign, _round(tl.cos(angle), CODE), _round(tl.sin(angle), CODE)


@triton.jit
def _write_kv(
    k_src, pos, k_cache, v_cache, kw, kwp, c, cmask, rot, partner, sign, cos, sin, eps, S_MAX64,
    kh, HK: tl.constexpr, DH: tl.constexpr, UNIT_OFFSET: tl.constexpr, CODE: tl.constexpr,
):  # fmt: skip
    """A token's key (k-norm by its weights ``kw, kwp`` (``_norm_w``), RoPE with the tables at its
    ``pos``, the cast to the cache dtype) and value (as projected), from its qkv row's kv head
    ``kh`` at ``k_src``, into the caches at ``pos``: the one write of the one-row step and of
    every row of a window. Returns the two rows as stored."""
    k = _norm_rope(
        k_src + tl.zeros([1, 1], tl.int32), tl.full([1, 1], 1, tl.int1), kw, kwp, c, cmask,
        partner, sign, rot, cos, sin, eps, DH, UNIT_OFFSET, CODE,
    )  # fmt: skip
    kv_row = (kh * S_MAX64 + pos) * DH + c
    k = k.to(k_cache.dtype.element_ty)
    v = tl.load(k_src + HK * DH + c, mask=cmask, other=0.0)
    tl.store(k_cache + kv_row, k, mask=cmask)
    tl.store(v_cache + kv_row, v, mask=cmask)
    return k, v  # [1, DP]: what a read of the row gives back


@triton.jit
def _tile_kv(k_cache, v_cache, base, s, smask, c, cmask, DH: tl.constexpr, EARLY: tl.constexpr = False):
    """The K and V rows of positions s [BLOCK_S] (those in smask; else 0) over channels c [1, DP];
    EARLY (read before the program's wait, kernels/launch.py): bypassing L1."""
    tile = base + s[:, None] * DH + c
    m = smask[:, None] & cmask
    if EARLY:
        kt = tl.load(k_cache + tile, mask=m, other=0.0, cache_modifier=".cg")
        vt = tl.load(v_cache + tile, mask=m, other=0.0, cache_modifier=".cg")
    else:
        kt = tl.load(k_cache + tile, mask=m, other=0.0)
        vt = tl.load(v_cache + tile, mask=m, other=0.0)
    return kt, vt


@triton.jit
def _attend_kv(q, m_i, l_i, acc, kt, vt, smask, qk_scale, CODE: tl.constexpr, EMULATE: tl.constexpr):
    """One tile's K and V rows (positions in smask) into the running softmax of q [GP, DP]."""
    if EMULATE:
        kt, vt = kt.to(tl.float32), vt.to(tl.float32)
    scores = tl.dot(q, tl.trans(kt), input_precision="ieee") * qk_scale  # log2 units
    scores = tl.where(smask[None, :], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(_round(p, CODE).to(vt.dtype), vt, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def _attend_tile(
    q, m_i, l_i, acc, k_cache, v_cache, base, s0, end, s_idx, c, cmask, qk_scale,
    DH: tl.constexpr, CODE: tl.constexpr, EMULATE: tl.constexpr,
):  # fmt: skip
    """One BLOCK_S tile of positions s0.. (those < end) into the running softmax of q [GP, DP]."""
    s = s0 + s_idx
    smask = s < end
    kt, vt = _tile_kv(k_cache, v_cache, base, s, smask, c, cmask, DH)
    return _attend_kv(q, m_i, l_i, acc, kt, vt, smask, qk_scale, CODE, EMULATE)


@triton.jit
def _attend_kernel(
    qkv, q_norm_w, k_norm_w, inv_freq, pos_ptr, slots, k_cache, v_cache, m_part, l_part, acc_part,
    eps, qk_scale,
    S_MAX: tl.constexpr, NSPLIT: tl.constexpr, HK: tl.constexpr, G: tl.constexpr,
    DH: tl.constexpr, R: tl.constexpr, GATED: tl.constexpr, GP: tl.constexpr, DP: tl.constexpr,
    BLOCK_S: tl.constexpr, UNIT_OFFSET: tl.constexpr, CODE: tl.constexpr, EMULATE: tl.constexpr,
    SLOTS: tl.constexpr, WINDOW: tl.constexpr, EARLY: tl.constexpr, EARLY_P: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """EARLY (not WINDOW): the row's position and slot and the split's first tile of keys and
    values older than pos are read before the wait (written by the step's first kernels and by
    earlier steps; the row at pos, which this launch writes, is left out and put into the tile
    from the registers that stored it, the values a read gives back); with EARLY_P the q and k
    norms' weights and the rotary tables at pos too."""
    QW: tl.constexpr = (2 if GATED else 1) * DH  # a query head's columns in qkv
    QKV_W: tl.constexpr = G * HK * QW + 2 * HK * DH
    kh = tl.program_id(0)
    split = tl.program_id(1)
    row = tl.program_id(2).to(tl.int64)  # a sequence of the step, or (WINDOW) a token of one
    if EARLY:
        pos = tl.load(pos_ptr + row, cache_modifier=".cg")
    else:
        _grid_sync(PDL)
        pos = tl.load(pos_ptr + row)
    window = qkv  # WINDOW: the qkv rows of the window's tokens, at consecutive positions
    qkv += row * QKV_W
    m_part += row * (G * HK * NSPLIT)
    l_part += row * (G * HK * NSPLIT)
    acc_part += row * (G * HK * NSPLIT * DH)
    if not WINDOW:  # a window's tokens are one sequence, in entry 0
        slot = row
        if SLOTS:
            slot = tl.load(slots + row, cache_modifier=".cg")
        k_cache += slot * (HK * S_MAX * DH)  # 64-bit: a pool's offsets pass 2^31
        v_cache += slot * (HK * S_MAX * DH)
    c = tl.arange(0, DP)[None, :]
    cmask = c < DH
    start = split * _split_len(pos, NSPLIT, BLOCK_S)
    end = tl.minimum(start + _split_len(pos, NSPLIT, BLOCK_S), pos + 1)
    S_MAX64 = tl.full([], S_MAX, tl.int64)  # 64-bit cache offsets: Hk * S_max * Dh may pass 2^31
    base = kh * S_MAX64 * DH
    s_idx = tl.arange(0, BLOCK_S)
    s_first = start + s_idx
    PRE: tl.constexpr = EARLY and EARLY_P  # the norms' weights and the rotary tables early too
    if EARLY:  # the first tile's older rows, then the wait
        kt0, vt0 = _tile_kv(
            k_cache, v_cache, base, s_first, (s_first < end) & (s_first < pos), c, cmask, DH, True
        )
        if PRE:
            rot, partner, sign, cos, sin = _rope_tables(pos, inv_freq, c, R, CODE)
            qw, qwp = _norm_w(q_norm_w, c, cmask, partner, rot)
            kw, kwp = _norm_w(k_norm_w, c, cmask, partner, rot)
        _grid_sync(PDL)
    if start <= pos:
        if not PRE:
            rot, partner, sign, cos, sin = _rope_tables(pos, inv_freq, c, R, CODE)
            qw, qwp = _norm_w(q_norm_w, c, cmask, partner, rot)
            kw, kwp = _norm_w(k_norm_w, c, cmask, partner, rot)
        r = tl.arange(0, GP)[:, None]
        rmask = r < G
        q_rows = qkv + (kh * G + r) * QW
        q = _norm_rope(
            q_rows, rmask, qw, qwp, c, cmask, partner, sign, rot, cos, sin, eps, DH, UNIT_OFFSET, CODE
        )
        if not EMULATE:  # values of the model dtype already: exact
            q = q.to(k_cache.dtype.element_ty)
        kv_col = G * HK * QW + kh * DH  # the kv head's key columns in a qkv row
        if WINDOW:  # the keys of this token and the window's earlier ones that this split reads:
            i = tl.full([], 0, tl.int64)  # each program writes those itself (any other: the same bits)
            while i <= row:
                p = tl.load(pos_ptr + i)
                if (p >= start) & (p < end):
                    rot_i, partner_i, sign_i, cos_i, sin_i = _rope_tables(p, inv_freq, c, R, CODE)
                    _write_kv(
                        window + i * QKV_W + kv_col, p, k_cache, v_cache, kw, kwp, c, cmask, rot_i,
                        partner_i, sign_i, cos_i, sin_i, eps, S_MAX64, kh, HK, DH, UNIT_OFFSET, CODE,
                    )  # fmt: skip
                i += 1
        elif end == pos + 1:  # this program's split holds pos: the new key and value go in first
            k_new, v_new = _write_kv(
                qkv + kv_col, pos, k_cache, v_cache, kw, kwp, c, cmask, rot, partner, sign, cos, sin,
                eps, S_MAX64, kh, HK, DH, UNIT_OFFSET, CODE,
            )  # fmt: skip
            if EARLY:  # the row at pos, if in the first tile, as stored
                at = (s_first == pos)[:, None]
                kt0 = tl.where(at, k_new, kt0)
                vt0 = tl.where(at, v_new, vt0)
        tl.debug_barrier()  # the rows written are read back below, by other threads of this program

        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, DP], tl.float32)
        s_next = start
        if EARLY:
            m_i, l_i, acc = _attend_kv(q, m_i, l_i, acc, kt0, vt0, s_first < end, qk_scale, CODE, EMULATE)
            s_next = start + BLOCK_S
        if EMULATE:  # the interpreter cannot run a for over device values
            s0 = s_next
            while s0 < end:
                m_i, l_i, acc = _attend_tile(
                    q, m_i, l_i, acc, k_cache, v_cache, base, s0, end, s_idx, c, cmask, qk_scale, DH, CODE, EMULATE
                )  # fmt: skip
                s0 += BLOCK_S
        else:  # a for, which Triton software-pipelines
            for s0 in range(s_next, end, BLOCK_S):
                m_i, l_i, acc = _attend_tile(
                    q, m_i, l_i, acc, k_cache, v_cache, base, s0, end, s_idx, c, cmask, qk_scale, DH, CODE, EMULATE
                )  # fmt: skip

        g = tl.arange(0, GP)
        part = (kh * G + g) * NSPLIT + split
        tl.store(m_part + part, m_i, mask=g < G)
        tl.store(l_part + part, l_i, mask=g < G)
        tl.store(acc_part + part[:, None] * DH + c, acc, mask=rmask & cmask)


@triton.jit
def _combine_kernel(
    qkv, pos_ptr, m_part, l_part, acc_part, out,
    NSPLIT: tl.constexpr, DH: tl.constexpr, GATED: tl.constexpr, PP: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, CODE: tl.constexpr,
    QKV_W: tl.constexpr, H: tl.constexpr, EARLY: tl.constexpr, LAUNCH_FIRST: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """EARLY: the row's position and (GATED) its output gate are read before the wait (the gate's
    qkv row was written two launches back, by the projection before the attend launch).
    LAUNCH_FIRST: the next launch (o_proj's GEMV) may launch before this one's wait."""
    h = tl.program_id(0)
    row = tl.program_id(2).to(tl.int64)
    qkv += row * QKV_W
    m_part += row * (H * NSPLIT)
    l_part += row * (H * NSPLIT)
    acc_part += row * (H * NSPLIT * DH)
    out += row * (H * DH)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = d < DH
    if EARLY:
        pos = tl.load(pos_ptr + row, cache_modifier=".cg")
        if GATED:
            g = tl.load(qkv + h * 2 * DH + DH + d, mask=dmask, other=0.0, cache_modifier=".cg").to(tl.float32)
        _grid_sync(PDL, LAUNCH_FIRST)
    else:
        _grid_sync(PDL, LAUNCH_FIRST)
        pos = tl.load(pos_ptr + row)
    active = (pos + _split_len(pos, NSPLIT, BLOCK_S)) // _split_len(pos, NSPLIT, BLOCK_S)
    rows = h * NSPLIT
    j = tl.arange(0, PP)
    mj = tl.load(m_part + rows + j, mask=j < active, other=float("-inf"))
    top = tl.max(mj, axis=0)
    total = tl.sum(tl.load(l_part + rows + j, mask=j < active, other=0.0) * tl.exp2(mj - top), axis=0)

    acc = tl.zeros([BLOCK_D], tl.float32)
    jb = tl.arange(0, BLOCK_P)
    for j0 in tl.static_range(0, PP, BLOCK_P):  # fixed blocks in a fixed order
        js = j0 + jb
        w = tl.exp2(tl.load(m_part + rows + js, mask=js < active, other=float("-inf")) - top)
        a = tl.load(
            acc_part + (rows + js)[:, None] * DH + d[None, :],
            mask=(js < active)[:, None] & dmask[None, :], other=0.0,
        )  # fmt: skip
        acc += tl.sum(a * w[:, None], axis=0)
    o = _round(acc / total, CODE)
    if GATED:
        if not EARLY:
            g = tl.load(qkv + h * 2 * DH + DH + d, mask=dmask, other=0.0).to(tl.float32)
        o = _round(o * _round(1.0 / (1.0 + tl.exp(-g)), CODE), CODE)
    tl.store(out + h * DH + d, o.to(out.dtype.element_ty), mask=dmask)


# --------------------------------------------------------------------------------------------
# Host side


def unsupported_router(num_experts: int, top_k: int) -> str | None:
    """Why ``router_topk`` cannot route over ``num_experts`` experts; None when it can."""
    if not 1 <= top_k <= num_experts:
        return f"top_k {top_k} is not in 1..{num_experts} (the expert count)"
    if num_experts > MAX_EXPERTS:
        return f"{num_experts} experts are over the {MAX_EXPERTS} one program holds"
    return None


def unsupported_attention(n_heads: int, n_kv: int, head_dim: int, rotary_dim: int) -> str | None:
    """Why ``attention_decode`` cannot run this geometry; None when it can."""
    if min(n_heads, n_kv, head_dim) < 1:
        return f"heads ({n_heads}), kv heads ({n_kv}) and head dim ({head_dim}) must be positive"
    if n_heads % n_kv:
        return f"query heads ({n_heads}) are not a multiple of kv heads ({n_kv})"
    if head_dim > MAX_HEAD_DIM:
        return f"head dim {head_dim} is over {MAX_HEAD_DIM}"
    if rotary_dim < 2 or rotary_dim % 2 or rotary_dim > head_dim:
        return f"rotary dim {rotary_dim} is not even and in 2..{head_dim} (the head dim)"
    return None


def _check_route(
    what, n, width, dtype, device, num_experts, top_k, weights_out, ids_out, gate_out=None
) -> None:
    """The router's checks, for logits [n, width] of ``dtype`` on ``device``: errors name the tensor."""
    why = unsupported_router(num_experts, top_k)
    if why:
        raise ValueError(f"{what} cannot run: {why}")
    if dtype not in DTYPE_CODE:
        raise ValueError(f"logits must be one of {list(DTYPE_CODE)}, got {dtype}")
    need = num_experts + (gate_out is not None)
    if width < need:
        raise ValueError(f"logits has {width} columns, needs {need} ({num_experts} experts, gate: {gate_out is not None})")  # fmt: skip
    expected = {
        "weights_out": (weights_out, (n, top_k), (dtype,)),
        "ids_out": (ids_out, (n, top_k), (torch.int64,)),
    }
    if gate_out is not None:
        expected["gate_out"] = (gate_out, (n, 1), (dtype,))
    _check(expected, device)


def router_topk(
    logits: torch.Tensor,
    num_experts: int,
    top_k: int,
    normalize: bool,
    weights_out: torch.Tensor,
    ids_out: torch.Tensor,
    gate_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``router_topk_ref`` in one launch. logits [N, E + X] (rows may be strided, columns
    contiguous) in the model dtype; writes weights_out [N, A] (model dtype), ids_out [N, A]
    int64 and, if given, gate_out [N, 1] = sigmoid(logits[:, E]) (needs X >= 1)."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [N, E + X] with contiguous rows, got {list(logits.shape)}")
    N, width = logits.shape
    dtype = logits.dtype
    _check_route(
        "router_topk", N, width, dtype, logits.device, num_experts, top_k, weights_out, ids_out, gate_out
    )
    if N:
        block = triton.next_power_of_2(num_experts)
        _router_kernel[(N,)](
            logits, weights_out, ids_out, weights_out if gate_out is None else gate_out, logits.stride(0),
            E=num_experts, K=top_k, BLOCK_E=block, BLOCK_K=triton.next_power_of_2(top_k),
            NORMALIZE=normalize, HAS_GATE=gate_out is not None, CODE=DTYPE_CODE[dtype],
            num_warps=_warps(block, 4), **pdl_kwargs(logits.device),
        )  # fmt: skip
    return weights_out, ids_out, gate_out


@dataclass(frozen=True)
class AttnPlan:
    """How ``attention_decode`` tiles a geometry: positions a tile, splits, warps, stages."""

    block_s: int
    nsplit: int
    num_warps: int = 4
    num_stages: int = 3


def attention_plan(n_kv: int, head_dim: int) -> AttnPlan:
    """The plan for a geometry, never for a position nor for the cache's capacity (a split's
    length follows the position and the split count alone, so a row's bits do not depend on the
    state's size: a request's tokens would otherwise change with its max_tokens, which sizes the
    static state, or with the requests before it): tiles of 32 positions at Dh > 128, else 64;
    TARGET_PROGRAMS programs over the kv heads (those past the position return at once)."""
    block = 32 if head_dim > 128 else 64
    return AttnPlan(block, max(1, TARGET_PROGRAMS // n_kv))


def attention_decode(
    qkv: torch.Tensor,
    q_norm_w: torch.Tensor,
    k_norm_w: torch.Tensor,
    eps: float,
    unit_offset: bool,
    inv_freq: torch.Tensor,
    pos: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    n_heads: int,
    n_kv: int,
    head_dim: int,
    gated: bool,
    slots: torch.Tensor | None = None,
    window: bool = False,
) -> torch.Tensor:
    """``attention_decode_ref`` in two launches (same arguments, same in-place cache writes), for
    N rows at once: row n is a sequence of its own at position ``pos[n]``, its keys and values
    in entry ``slots[n]`` of the caches (``slots`` None: entry n). qkv [N, Q + 2·Hk·Dh], the
    norm weights, the caches [B, Hk, S, Dh] and out [N, H·Dh] share the model dtype (fp32, bf16
    or fp16); inv_freq fp32 [R/2]; pos int64 [N] and slots int64 [N], read only on the device
    (distinct slots: rows of one step must not share a sequence). Every tensor contiguous, on
    one device. A row's programs are the one-row call's, offset: its bits do not depend on the
    other rows.

    ``window``: a speculative verify window instead, the rows being consecutive tokens of ONE
    sequence (pos[n] = pos[0] + n, read only on the device: the caller's contract) in entry 0 of
    the caches, still two launches for any N: row n's output and the cache afterwards are, bit
    for bit, those of N one-row calls in order (row n reads the keys rows < n wrote). Each of
    row n's programs writes the keys and values of rows <= n in its split itself (the one-row
    call's write, shared code) before reading them, so no program waits for another's."""
    H, Hk, Dh = n_heads, n_kv, head_dim
    if inv_freq.dim() != 1:
        raise ValueError(f"inv_freq must be [R/2], got {list(inv_freq.shape)}")
    R = 2 * inv_freq.shape[0]
    why = unsupported_attention(H, Hk, Dh, R)
    if why:
        raise ValueError(f"attention_decode cannot run this layer: {why}")
    dtype = qkv.dtype
    if dtype not in DTYPE_CODE:
        raise ValueError(f"qkv must be one of {list(DTYPE_CODE)}, got {dtype}")
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must be [B, Hk, S, Dh], got {list(k_cache.shape)}")
    if qkv.dim() != 2:
        raise ValueError(f"qkv must be [N, columns], got {list(qkv.shape)}")
    N, B, S = qkv.shape[0], k_cache.shape[0], k_cache.shape[2]
    if window and slots is not None:
        raise ValueError(
            "a window's rows are one sequence in cache entry 0: slots cannot be given with window"
        )
    if window and B < 1:
        raise ValueError("a window's rows are one sequence in cache entry 0: the caches hold no entry")
    if not window and slots is None and B != N:
        raise ValueError(f"without slots the caches hold one entry a row: {B} entries for {N} rows")
    act = (dtype,)
    width = H * Dh * (2 if gated else 1) + 2 * Hk * Dh
    expected = {
        "qkv": (qkv, (N, width), act),
        "q_norm_w": (q_norm_w, (Dh,), act),
        "k_norm_w": (k_norm_w, (Dh,), act),
        "inv_freq": (inv_freq, (R // 2,), (torch.float32,)),
        "pos": (pos, (N,), (torch.int64,)),
        "k_cache": (k_cache, (B, Hk, S, Dh), act),
        "v_cache": (v_cache, (B, Hk, S, Dh), act),
        "out": (out, (N, H * Dh), act),
    }
    if slots is not None:
        expected["slots"] = (slots, (N,), (torch.int64,))
    _check(expected, qkv.device)
    plan = attention_plan(Hk, Dh)
    nsplit, dp = plan.nsplit, triton.next_power_of_2(Dh)
    m_part = torch.empty(N, H, nsplit, dtype=torch.float32, device=qkv.device)
    l_part = torch.empty_like(m_part)
    acc_part = torch.empty(N, H, nsplit, Dh, dtype=torch.float32, device=qkv.device)
    code = DTYPE_CODE[dtype]
    G = H // Hk
    if N == 0:
        return out
    _attend_kernel[(Hk, nsplit, N)](
        qkv, q_norm_w, k_norm_w, inv_freq, pos, pos if slots is None else slots, k_cache, v_cache,
        m_part, l_part, acc_part, eps, Dh**-0.5 * LOG2E, S_MAX=S, NSPLIT=nsplit, HK=Hk, G=G, DH=Dh, R=R,
        GATED=gated, GP=max(16, triton.next_power_of_2(G)), DP=dp, BLOCK_S=plan.block_s,
        UNIT_OFFSET=unit_offset, CODE=code, EMULATE=qkv.device.type == "cpu", SLOTS=slots is not None,
        WINDOW=window, EARLY=ATTN_EARLY and not window, EARLY_P=launch.EARLY_NORMS, num_warps=plan.num_warps,
        num_stages=plan.num_stages, **pdl_kwargs(qkv.device),
        enable_fp_fusion=False,  # a window's rows are the one-row kernel's bits only if neither contracts
    )  # fmt: skip
    pp = triton.next_power_of_2(nsplit)
    block_d = min(dp, 64)  # a program per (head, 64 channels): its [splits, 64] partials in one tile
    block_p = min(pp, MAX_TILE // block_d)
    _combine_kernel[(H, triton.cdiv(Dh, block_d), N)](
        qkv, pos, m_part, l_part, acc_part, out, NSPLIT=nsplit, DH=Dh, GATED=gated, PP=pp,
        BLOCK_P=block_p, BLOCK_D=block_d, BLOCK_S=plan.block_s, CODE=code, QKV_W=width, H=H, EARLY=ATTN_EARLY,
        LAUNCH_FIRST=COMBINE_LAUNCH_FIRST,
        num_warps=_warps(block_p * block_d, 16), **pdl_kwargs(qkv.device),
    )  # fmt: skip
    return out
