"""Triton kernels for the routed-expert step, reading weights straight from the slot pool.

Shape legend: T = tokens, A = active experts per token, P = T·A (token, expert) pairs,
U = distinct experts in a step, S = slots, D = hidden, I = expert width, g = group size.

Decode (few tokens, ``moe_gemv``), two launches; no weight is written back dequantized:
  1. gate_up GEMV + SiLU(gate)·up for every pair -> h fp32 [P, I]; a program per (pair, row tile),
     the tile's gate and up rows interleaved so that one pass over x serves both.
  2. down GEMV times the global scale and the router weight for every pair -> fp32 parts
     [P, D], a program per (pair, row tile), so a token's A experts run in parallel; the program
     that arrives last at the tile's counter (an atomic counter, reset by it) adds the token's
     parts in ascending expert id order and finishes the rows. No atomics on data: the sum order
     is fixed, so the bits are too, whatever order the router listed the experts in and whichever
     program came last.
At one token the shared expert's down projection can ride in launch 1 as programs after the
pairs' (``shared_down``: each qgemv's own program on its tile, so its bits are its launch's).
Over a slot table, launch 1 can also route the router's logits itself (``route``: a pair's
programs pick its expert, ``router_topk``'s program stores the ids and weights), and launch 2
then reads them after its wait: the router's top-k without a launch of its own.
Both run the dense GEMV's step (``qgemv``'s ``_accumulate``: 32-bit words decoded without
conversions, a scale group summed in registers): 5.0 and 7.3 SASS instructions a weight value at
the default tile, against 9.5 and 11.6 for the per-byte decode with shuffled group sums they
replaced (static counts, sm_90; docs/benchmarks.md).
Prefill (many tokens per expert, ``moe_grouped``), a grouped GEMM with no host round trip: the
(token, expert) pairs are sorted by slot on the device (one expert a slot) and cut into tiles of
one expert each (``align_pairs``: a counting sort in one program); gate_up + SiLU·up per tile,
then down times the router weight per tile, each weight tile dequantized to bf16 in the kernel
(exact for int4) for bf16 tensor-core products with fp32 sums; then each token's experts summed
in fp32 by ascending expert id, rounded once. Four launches and two fills a layer. No atomics: a
row's sums do not depend on the other rows of its tile.

Rotation: a Hadamard bundle stores W_q with W = W_q·H_g on every group of g columns; H_g is
symmetric and orthonormal, so W·v = W_q·(H_g v per group). The kernels rotate the activations
(x before gate_up, h before down), one small launch each, instead of the weights.

Sums accumulate in fp32. Block sizes are fixed per format and geometry, never autotuned, so
every process reduces in the same order. Pools are indexed with 64-bit slot offsets.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from edgerun.bundle.layout import BlockLayout
from edgerun.kernels import launch
from edgerun.kernels.bits_triton import _e4m3, _nibbles
from edgerun.kernels.decode_triton import _check_route, _pick, _route_row
from edgerun.kernels.dense_triton import DTYPE_CODE, _round
from edgerun.kernels.launch import _grid_sync, _wait_set, pdl_kwargs
from edgerun.kernels.moe_reference import FarTier, RouterLogits, check_pool, layout_dims
from edgerun.kernels.qlinear_triton import (
    MANY,
    _accumulate,
    _gemv_program,
    _pow2_divisor,
    _scales,
    _weight_args,
    _words,
    step_sum,
)
from edgerun.kernels.qlinear_triton import GemvConfig as GemvTile
from edgerun.kernels.qlinear_triton import _check as check_gemv
from edgerun.kernels.qlinear_triton import unsupported as gemv_unsupported
from edgerun.kernels.qlinear_w4a8 import GROUP as A8_GROUP
from edgerun.kernels.qlinear_w4a8 import _dot_given, check_xq
from edgerun.kernels.scratch import counters

INTERPRETED = (
    os.environ.get("TRITON_INTERPRET") == "1"
)  # Triton's CPU interpreter (read at import, as Triton does)
QUANT_CODE = {"bf16": 0, "int8": 1, "int4": 2}
# a routing gate_up launch tells the down launch's programs when its ids are stored, so they read
# their slot and first weights before their wait (``_down_kernel``'s READY); False: they read them
# after it (an A/B switch for benchmarks/ab_decode.py, read at the call)
DOWN_READY = True
# the gate_up programs of a routed step pick their expert, and its routing program routes, on
# int32 keys where the logits are bf16 (``decode_triton``'s KEY32: the same ids and weights; a
# warp's maximum one REDUX instead of 6 levels of 64-bit shuffles): the gate_up launch 297 -> 261
# µs a step, 40-layer decode +1.8% on an H100, the same tokens (docs/benchmarks.md, 2026-12-07,
# fortieth session); False: int64 keys (an A/B switch for benchmarks/ab_decode.py, read at the call)
PICK32 = True
READY_PAD = 32  # int32s a 128 B line: the polled ready flags start a line of their own
BITS = {"bf16": 16, "int8": 8, "int4": 4}
# (weight view, scale view) of the pool's bytes per scheme
VIEWS = {
    "bf16": (torch.bfloat16, None),
    "int8": (torch.int8, torch.float32),
    "int4": (torch.uint8, torch.uint8),
}


@dataclass(frozen=True)
class GemvConfig:
    """Fixed tile shape of the decode kernels (fixed: it decides the reduction order, so one
    tile serves every token count). The default was the fastest at 4 tokens and within 0.4 us of
    the fastest at 1 in the sweep of benchmarks/bench_moe_kernel.py on an H200, int4 g32
    (docs/benchmarks.md, 2026-12-04); the down's 32 rows a program (16 before) with the down
    reading its weights before its wait in a routed step (``DOWN_READY``) gave 40-layer decode
    +1.2% on an H100, and the step alone the same or less time at 1-8 tokens (2026-12-07)."""

    block_r: int = 4  # columns of h per program of launch 1 (each a gate and an up row)
    row_bytes: int = 512  # weight bytes of each row loaded per step
    num_warps: int = 2
    down_rows: int = 32  # rows of an expert's down projection per program of launch 2


DEFAULT_GEMV = GemvConfig()


# --------------------------------------------------------------------------------------------
# Device helpers


@triton.jit
def _rows_first(w, s, rows, C: tl.constexpr, QUANT: tl.constexpr, G: tl.constexpr, GROUPED: tl.constexpr,
                BLOCK_K: tl.constexpr):  # fmt: skip
    """(words, scales) of ``_rows_dot``'s first step: loads a kernel may issue before it waits
    for the previous one (kernels/launch.py), as ``qgemv``'s programs do."""
    wd0 = _words(w, rows, 0, C, QUANT, BLOCK_K)
    scale0 = wd0
    if GROUPED:
        scale0 = _scales(s, rows, 0, C, G, QUANT, BLOCK_K)
    return wd0, scale0


@triton.jit
def _rows_dot(x, w, s, rows, zero, wd0, scale0, C: tl.constexpr, QUANT: tl.constexpr, G: tl.constexpr,
              GROUPED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SUM: tl.constexpr):  # fmt: skip
    """fp32 [BLOCK_R]: sum_c W[r, c] x[c] for weight ``rows`` (int64) of an [R, C] component at w
    (its scales at s; the first step's words and scales ``_rows_first``'s), every scale applied
    but an int4 tensor's global one. The dense GEMV's own step (``qgemv``'s ``_accumulate`` for
    one row: 32-bit words decoded without conversions, each step's group sums in registers), so
    an expert's weight value costs what a projection's does."""
    y = _accumulate(x, 0, w, s, rows, zero, wd0, scale0, x, 0.0, 1, 1, C, QUANT, G, GROUPED,
                    BLOCK_R, BLOCK_K, SUM, 0, 0, 16, False)  # fmt: skip
    y = tl.sum(y, axis=1)  # [BLOCK_R, 1]: the one row's sums
    if QUANT == 1 and not GROUPED:
        y *= tl.load(s + rows)  # int8 scaled per row
    return y


@triton.jit
def _slot(slots, table, ids, p, TABLE: tl.constexpr):
    """The slot of pair p: slots[p], or (a layer whose every expert is held) table[ids[p]]."""
    if TABLE:
        return tl.load(table + tl.load(ids + p, cache_modifier=".cg"), cache_modifier=".cg").to(tl.int64)
    # 64-bit: slot * block passes 2^31 in large pools; .cg: the down kernel reads it before its wait
    return tl.load(slots + p, cache_modifier=".cg").to(tl.int64)


@triton.jit
def _at(slot, split, block, far):
    """Where slot ``slot``'s block starts, in elements from the pool's start: a device slot below
    ``split``; at and above it, row slot - split of the far tier (pinned host memory the GPU reads
    in place over PCIe), which starts ``far`` elements from the pool (any sign: one address space)."""
    return tl.where(slot < split, slot * block, far + (slot - split) * block)


# --------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _expert_ranks(ids, t, A: tl.constexpr, A_P2: tl.constexpr):
    """Token t's entries (positions ``ar``, expert ids ``eid``) and each one's rank in (expert id,
    position) order, the order its experts are summed in (padding entries rank A_P2)."""
    ar = tl.arange(0, A_P2)
    valid = ar < A
    eid = tl.load(ids + t * A + ar, mask=valid, other=0, cache_modifier=".cg")
    before = (eid[None, :] < eid[:, None]) | ((eid[None, :] == eid[:, None]) & (ar[None, :] < ar[:, None]))
    rank = tl.sum((before & valid[None, :]).to(tl.int32), axis=1)
    return ar, eid, tl.where(valid, rank, A_P2)


@triton.jit
def _shared_down_program(row, sd_x, sd_w, sd_s, sd_rs, sd_gate, sd_out, sd_rows, sd_progs, zero, SD_C: tl.constexpr,
                         SD_QUANT: tl.constexpr, SD_G: tl.constexpr, SD_GROUPED: tl.constexpr,
                         SD_ROW_SCALED: tl.constexpr, SD_EPILOGUE: tl.constexpr, SD_BLOCK_R: tl.constexpr,
                         SD_BLOCK_K: tl.constexpr, SD_SUM: tl.constexpr, SD_CODE: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """A program in the shared expert's down rows of an expert launch (``row`` of them along axis
    0): ``qgemv(sd_x, w, None, "gated", sd_out, sd_gate)``'s program q on its tile, or (q past
    its programs) only the wait."""
    q = row * tl.num_programs(1) + tl.program_id(1)
    if q < sd_progs:
        _gemv_program(
            q, sd_x, sd_w, sd_s, sd_rs, sd_x, sd_gate, sd_out, sd_x, sd_x, 0.0, sd_rows, 0, 0, 0, zero, 1,
            1, SD_C, SD_QUANT, SD_G, SD_GROUPED, SD_ROW_SCALED, False, SD_EPILOGUE, SD_CODE, SD_BLOCK_R, SD_BLOCK_K,
            SD_SUM, 0, False, 1, 1, False, PDL,
        )  # fmt: skip
    else:
        _grid_sync(PDL)


@triton.jit(do_not_specialize=["zero", "lo", "hi"])  # a runtime 0 (see bits_triton._field); any range
def _gate_up_kernel(
    x,
    wpool,
    spool,
    slots,
    table,
    ids,
    gscales,
    h,
    far_reads,
    uses,
    w_block,
    s_block,
    w_off,
    s_off,
    split,
    w_far,
    s_far,
    zero,
    lo,
    hi,
    D: tl.constexpr,
    I: tl.constexpr,
    A: tl.constexpr,
    QUANT: tl.constexpr,
    G: tl.constexpr,
    GROUPED: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SUM: tl.constexpr,
    TABLE: tl.constexpr,
    FAR: tl.constexpr,
    RANGE: tl.constexpr,
    pairs,
    sd_x,
    sd_w,
    sd_s,
    sd_rs,
    sd_gate,
    sd_out,
    sd_rows,
    sd_progs,
    SD: tl.constexpr,
    SD_C: tl.constexpr,
    SD_QUANT: tl.constexpr,
    SD_G: tl.constexpr,
    SD_GROUPED: tl.constexpr,
    SD_ROW_SCALED: tl.constexpr,
    SD_EPILOGUE: tl.constexpr,
    SD_BLOCK_R: tl.constexpr,
    SD_BLOCK_K: tl.constexpr,
    SD_SUM: tl.constexpr,
    SD_CODE: tl.constexpr,
    xe,
    xo,
    xs,
    xb,
    XQ: tl.constexpr,
    INTERPRET: tl.constexpr,
    logits,
    logit_row,
    rw,
    ROUTE: tl.constexpr,
    E: tl.constexpr,
    BLOCK_E: tl.constexpr,
    A_P2: tl.constexpr,
    NORMALIZE: tl.constexpr,
    RCODE: tl.constexpr,
    PICK32: tl.constexpr,
    ready,
    ready_n,
    READY: tl.constexpr,
    EARLY_P: tl.constexpr,
    PDL: tl.constexpr,
):
    """h[p] = SiLU(gate) * up of pair p's expert, fp32: program (p, j) computes h columns
    [j BLOCK_R / 2, (j + 1) BLOCK_R / 2). RANGE: pairs whose expert is outside lo..hi do
    nothing (their slot is not read). XQ (int4 g32): x given quantized to int8 per 32 columns
    (``xe, xo, xs, xb``, a token's row each; ``moe_gemv``'s ``xq``), the products W4A8
    (``qlinear_w4a8._dot_given``); x itself is not read.

    SD (one token; ``moe_gemv``'s ``shared_down``): the programs past the ``pairs`` rows of
    axis 0, in row-major order, are the shared expert's down projection, ``qgemv(sd_x, w, None,
    "gated", sd_out, sd_gate)`` on its tile (the ``SD_`` constexprs, ``sd_progs`` programs): each
    the program that GEMV's own launch runs, so its bits are that launch's (the launch's warps
    are its tile's); the down launch reads its output as ``shared``. One launch fewer a layer.

    ROUTE (``moe_gemv``'s ``route``): ids and the router weights ``rw`` are not written yet; a
    pair's programs find its expert from token t's row of ``logits`` themselves (``_pick``: the
    top-k's pick a = p % A, after the wait, the router's launch being the one before), and the
    program (t A, 0) stores the token's ids and weights as ``router_topk`` would (its program,
    ``_route_row``) for the down launch and the host. One launch fewer a MoE layer. READY: that
    program then sets ``ready[t]`` to ``ready_n`` (the down launch's programs of the token), a
    release after its stores, so the down programs may read the ids before their wait
    (``_down_kernel``'s READY). PICK32 (bf16 logits): the picks and the routing on int32 keys, the same ids
    and weights. EARLY_P (with ROUTE): the slot table read before the wait (the cache wrote it
    before the step), a pick's slot then taken from registers, not loaded after the pick."""
    p = tl.program_id(0)  # pair t*A + a
    if SD and p >= pairs:
        _shared_down_program(p - pairs, sd_x, sd_w, sd_s, sd_rs, sd_gate, sd_out, sd_rows, sd_progs, zero, SD_C,
                             SD_QUANT, SD_G, SD_GROUPED, SD_ROW_SCALED, SD_EPILOGUE, SD_BLOCK_R, SD_BLOCK_K, SD_SUM,
                             SD_CODE, PDL)  # fmt: skip
    else:
        tab = 0
        if ROUTE and EARLY_P:
            e_all = tl.arange(0, BLOCK_E)
            tab = tl.load(table + e_all, mask=e_all < E, other=0, cache_modifier=".cg")
        _grid_sync(PDL)
        run = True
        if RANGE:
            e = tl.load(ids + p)
            run = (e >= lo) & (e <= hi)
        if run:
            eid = 0
            if ROUTE:
                row = logits + (p // A).to(tl.int64) * logit_row
                eid = _pick(row, p % A, E, A, BLOCK_E, RCODE == 1 and PICK32)  # 1: bf16 logits
                if (p % A == 0) & (tl.program_id(1) == 0):
                    _route_row(logits, logit_row, p // A, rw, ids, rw, E, A, BLOCK_E, A_P2, NORMALIZE, False,
                               RCODE, RCODE == 1 and PICK32)  # fmt: skip
                    if READY:
                        tl.debug_barrier()  # every thread's ids and weights stored, then released
                        tl.atomic_xchg(ready + p // A, ready_n, sem="release")
            slot = _pair_slot(slots, table, ids, p, eid, TABLE, ROUTE, tab, BLOCK_E, EARLY_P)
            _gate_up_pair(x, wpool, spool, slot, ids, gscales, h, far_reads, uses, w_block, s_block, w_off, s_off,
                          split, w_far, s_far, zero, p, D, I, A, QUANT, G, GROUPED, BLOCK_R, BLOCK_K, SUM, FAR, xe,
                          xo, xs, xb, XQ, INTERPRET, eid, ROUTE)  # fmt: skip


@triton.jit
def _pair_slot(slots, table, ids, p, eid, TABLE: tl.constexpr, ROUTE: tl.constexpr, tab, BLOCK_E: tl.constexpr,
               GIVEN: tl.constexpr):  # fmt: skip
    """The slot of pair p: (ROUTE, a table: every expert held) expert ``eid``'s, found by the
    program from the logits (GIVEN: taken from ``tab``, the table's [BLOCK_E] entries as loaded);
    else ``_slot``'s."""
    if ROUTE:
        if GIVEN:
            return tl.sum(tl.where(tl.arange(0, BLOCK_E) == eid, tab, 0)).to(tl.int64)
        return tl.load(table + eid, cache_modifier=".cg").to(tl.int64)
    return _slot(slots, table, ids, p, TABLE)


@triton.jit
def _gate_up_pair(x, wpool, spool, slot, ids, gscales, h, far_reads, uses, w_block, s_block, w_off, s_off,
                  split, w_far, s_far, zero, p, D: tl.constexpr, I: tl.constexpr, A: tl.constexpr,
                  QUANT: tl.constexpr, G: tl.constexpr, GROUPED: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_K: tl.constexpr, SUM: tl.constexpr, FAR: tl.constexpr, xe, xo, xs, xb,
                  XQ: tl.constexpr, INTERPRET: tl.constexpr, eid, ROUTE: tl.constexpr):  # fmt: skip
    """Program (p, program_id(1)) of ``_gate_up_kernel``'s experts: its h columns of pair p, whose
    expert's block is at ``slot`` (ROUTE: expert ``eid``, found by the program; else ids[p]'s)."""
    if FAR:
        if tl.program_id(1) == 0:  # one count a pair whose expert is read from the far tier
            tl.atomic_add(far_reads, (slot >= split).to(tl.int64))
            if ROUTE:  # and every pair by its expert
                tl.atomic_add(uses + eid, 1)
            else:
                tl.atomic_add(uses + tl.load(ids + p), 1)
    w = wpool + _at(slot, split, w_block, w_far) + w_off
    s = spool + _at(slot, split, s_block, s_far) + s_off
    # row i of the tile: the gate row (i even) or the up row (odd) of h column i // 2, so one
    # pass over x's columns (each converted once) serves both
    i = tl.arange(0, BLOCK_R)
    OUT_R: tl.constexpr = BLOCK_R // 2
    rows = (tl.program_id(1) * OUT_R + i // 2 + (i % 2) * I).to(tl.int64)
    wd0, scale0 = _rows_first(w, s, rows, D, QUANT, G, GROUPED, BLOCK_K)
    if XQ:
        t = p // A
        xw, xg = t * (D // 8), t * (D // 32)
        y = _dot_given(
            xe + xw, xo + xw, xs + xg, xb + xg, w, s, rows, wd0, scale0, D, BLOCK_R, BLOCK_K, INTERPRET
        )
    else:
        y = _rows_dot(
            x + (p // A) * D, w, s, rows, zero, wd0, scale0, D, QUANT, G, GROUPED, BLOCK_R, BLOCK_K, SUM
        )
    if QUANT == 2:
        y *= tl.load(gscales + slot * 2)
    gate, up = tl.split(tl.reshape(y, [OUT_R, 2]))
    tl.store(h + p * I + tl.program_id(1) * OUT_R + tl.arange(0, OUT_R), gate * tl.sigmoid(gate) * up)


@triton.jit(do_not_specialize=["zero", "lo", "hi"])
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
    part,
    count,
    w_block,
    s_block,
    w_off,
    s_off,
    split,
    w_far,
    s_far,
    zero,
    lo,
    hi,
    D: tl.constexpr,
    I: tl.constexpr,
    A: tl.constexpr,
    A_P2: tl.constexpr,
    QUANT: tl.constexpr,
    G: tl.constexpr,
    GROUPED: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SUM: tl.constexpr,
    TABLE: tl.constexpr,
    SHARED: tl.constexpr,
    INTO: tl.constexpr,
    CODE: tl.constexpr,
    RANGE: tl.constexpr,
    ACC: tl.constexpr,
    LATE: tl.constexpr,
    ready,
    READY: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[t] = the router-weighted sum of token t's experts, rounded once; with INTO, out holds
    the residual and gets out + (routed [+ shared]) instead, rounded where the model's
    ``x.add_(routed + shared)`` rounds.

    Program (p, j): rows [j BLOCK_R, (j + 1) BLOCK_R) of pair p's expert times h[p], times its
    global scale and router weight, into ``part`` [P, D] fp32: the A experts of a token run in
    parallel. The program that arrives last at ``count[t, j]`` (an atomic counter, reset by it)
    adds the token's A parts in ascending expert id (then position) order and finishes the rows,
    so the sum's order, and the bits, depend neither on the order the router listed the experts
    in, nor on which program came last, nor on the other tokens.

    RANGE (a step in parts, ``moe_gemv``'s ``expert_range``): pairs whose expert is outside
    lo..hi compute nothing but still arrive, and only the experts in lo..hi are summed; with ACC
    the sum starts from ``out`` (fp32) rather than 0 and is stored unrounded, so consecutive
    ranges in ascending order add exactly what one call adds, in the same order.

    LATE (the gate_up launch routed, ``moe_gemv``'s ``route``): ids and rw are written by the
    launch just before: without READY nothing is read before the wait. READY (with LATE): the
    routing program of that launch sets ``ready[t]`` to the token's count of down programs once
    its ids are stored; each program waits for it to be set (thread 0 polling with acquire loads),
    takes one off (the last leaves it 0 for the next call), then reads its slot and first step of
    weights before the wait, as without LATE. The routing program has started before any down
    program can (PDL launches this kernel only once every gate_up program has), so the wait ends."""
    p = tl.program_id(0)  # pair t*A + a
    t = p // A
    j = tl.program_id(1)
    r0 = j * BLOCK_R
    rows = (r0 + tl.arange(0, BLOCK_R)).to(tl.int64)
    run = True
    EARLY: tl.constexpr = not RANGE and (READY or not LATE)
    if not EARLY:  # nothing before the wait: a step in parts' pair outside lo..hi reads no slot,
        _grid_sync(PDL)  # and a routing gate_up launch (LATE) wrote ids just before
    if RANGE:
        e = tl.load(ids + p)
        run = (e >= lo) & (e <= hi)
    if run:
        # otherwise the pair's slot and first step of weights before the wait (kernels/launch.py):
        # the router wrote ids (the slots: the cache, before the step's expert launches) two
        # launches back, the gate_up launch between them writes neither; or (READY) the gate_up
        # launch's routing program has said its ids are stored
        if READY:
            _wait_set(ready + t, INTERPRET)
            tl.atomic_add(ready + t, -1, sem="relaxed")
        slot = _slot(slots, table, ids, p, TABLE)
        w = wpool + _at(slot, split, w_block, w_far) + w_off
        s = spool + _at(slot, split, s_block, s_far) + s_off
        wd0, scale0 = _rows_first(w, s, rows, I, QUANT, G, GROUPED, BLOCK_K)
        if EARLY:
            _grid_sync(PDL)
        _down_part(h, w, s, rows, zero, wd0, scale0, gscales, slot, rw, part, p, D, I, QUANT, G, GROUPED, BLOCK_R,
                   BLOCK_K, SUM)  # fmt: skip
    tl.debug_barrier()  # every thread's part stored before the arrival is released
    if tl.atomic_add(count + t * (D // BLOCK_R) + j, 1, sem="acq_rel") == A - 1:
        tl.store(count + t * (D // BLOCK_R) + j, 0)  # ready for the next call
        _down_finish(
            out, part, ids, shared, t, rows, lo, hi, D, A, A_P2, BLOCK_R, SHARED, INTO, CODE, RANGE, ACC
        )


@triton.jit
def _down_part(h, w, s, rows, zero, wd0, scale0, gscales, slot, rw, part, p, D: tl.constexpr, I: tl.constexpr,
               QUANT: tl.constexpr, G: tl.constexpr, GROUPED: tl.constexpr, BLOCK_R: tl.constexpr,
               BLOCK_K: tl.constexpr, SUM: tl.constexpr):  # fmt: skip
    """Pair p's down ``rows`` (its expert's block at w / s, the first step's words and scales
    loaded) times h[p], times its global scale and router weight, into ``part`` [P, D] fp32."""
    y = _rows_dot(h + p * I, w, s, rows, zero, wd0, scale0, I, QUANT, G, GROUPED, BLOCK_R, BLOCK_K, SUM)
    if QUANT == 2:
        y *= tl.load(gscales + slot * 2 + 1)
    tl.store(part + p * D + rows, y * tl.load(rw + p, cache_modifier=".cg").to(tl.float32))


@triton.jit
def _down_finish(out, part, ids, shared, t, rows, lo, hi, D: tl.constexpr, A: tl.constexpr, A_P2: tl.constexpr,
                 BLOCK_R: tl.constexpr, SHARED: tl.constexpr, INTO: tl.constexpr, CODE: tl.constexpr,
                 RANGE: tl.constexpr, ACC: tl.constexpr):  # fmt: skip
    """Token t's ``rows`` of out, by the program that arrived last: its A parts added in
    ascending expert id (then position) order, then rounded as the down kernel's docstring says."""
    # each entry's rank in (expert id, position) order: the experts are summed by ascending id
    ar, eid, rank = _expert_ranks(ids, t, A, A_P2)
    cols = t * D + rows
    if ACC:
        acc = tl.load(out + cols)
    else:
        acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for r in tl.static_range(A):
        q = t * A + tl.sum(tl.where(rank == r, ar, 0))
        if RANGE:
            e = tl.sum(tl.where(rank == r, eid, 0))
            if (e >= lo) & (e <= hi):
                acc += tl.load(part + q * D + rows, cache_modifier=".cg")
        else:
            acc += tl.load(part + q * D + rows, cache_modifier=".cg")
    if INTO:
        acc = _round(acc, CODE)
        if SHARED:
            acc = _round(acc + tl.load(shared + cols, cache_modifier=".cg").to(tl.float32), CODE)
        acc = _round(tl.load(out + cols).to(tl.float32) + acc, CODE)
    else:  # rounded as torch rounds (the interpreter's own cast truncates; the GPU's is the same)
        acc = _round(acc, CODE)
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


@triton.jit
def _weight_tile(
    w,
    s,
    rows,
    k0,
    rmask,
    zero,
    C: tl.constexpr,
    QUANT: tl.constexpr,
    G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Rows ``rows`` [BLOCK_N] by columns k0 .. k0 + BLOCK_K of an [R, C] component at w (its
    scales at s) as bf16: q times its group scale, exact for int4 (q * e4m3 has at most 7
    significant bits) and int8 per row (whose scale, like an int4 tensor's global, the caller
    applies after the dot); an int8 per-group value is rounded to bf16 once. Rows outside
    ``rmask`` and columns past C read as 0."""
    if QUANT == 2:
        j = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        m = rmask[:, None] & (j[None, :] < C // 2)
        lo, hi = _nibbles(tl.load(w + rows[:, None] * (C // 2) + j[None, :], mask=m, other=0), zero)
        gi = k0 // G + tl.arange(0, BLOCK_K // G)
        sm = rmask[:, None] & (gi[None, :] < C // G)
        step = _e4m3(tl.load(s + rows[:, None] * (C // G) + gi[None, :], mask=sm, other=0))
        step = tl.reshape(step, [BLOCK_N, BLOCK_K // G, 1])
        lo = tl.reshape(tl.reshape(lo, [BLOCK_N, BLOCK_K // G, G // 2]) * step, [BLOCK_N, BLOCK_K // 2])
        hi = tl.reshape(tl.reshape(hi, [BLOCK_N, BLOCK_K // G, G // 2]) * step, [BLOCK_N, BLOCK_K // 2])
        return tl.reshape(tl.join(lo, hi), [BLOCK_N, BLOCK_K]).to(tl.bfloat16)
    cols = k0 + tl.arange(0, BLOCK_K)
    m = rmask[:, None] & (cols[None, :] < C)
    vals = tl.load(w + rows[:, None] * C + cols[None, :], mask=m, other=0)
    if QUANT == 0:
        return vals.to(tl.bfloat16)
    vals = vals.to(tl.float32)
    if G > 0:
        gi = k0 // G + tl.arange(0, BLOCK_K // G)
        sm = rmask[:, None] & (gi[None, :] < C // G)
        sc = tl.reshape(
            tl.load(s + rows[:, None] * (C // G) + gi[None, :], mask=sm, other=0), [BLOCK_N, BLOCK_K // G, 1]
        )
        vals = _round(tl.reshape(tl.reshape(vals, [BLOCK_N, BLOCK_K // G, G]) * sc, [BLOCK_N, BLOCK_K]), 1)
    return vals.to(tl.bfloat16)


@triton.jit
def _mma(a, b, acc, INTERPRET: tl.constexpr):
    """acc + a @ b on bf16 operands (tensor cores). Triton's CPU interpreter multiplies bf16
    operands as raw integers, so there they go in as fp32: the operands are bf16 values, so the
    products are the same and only the fp32 summation order may differ."""
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _tile_rows(tile_slot, rows, P, A: tl.constexpr, BLOCK_M: tl.constexpr):
    """Tile m's slot (-1: an unused tile), and its rows: the (token, expert) pair of each (P:
    padding), whether it is one, and the token."""
    m = tl.program_id(0)
    slot = tl.load(tile_slot + m)
    offs = m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(rows + offs)
    valid = pair < P
    return slot, offs.to(tl.int64), pair.to(tl.int64), valid


@triton.jit(do_not_specialize=["zero", "P"])
def _grouped_gate_up_kernel(
    x,
    wpool,
    spool,
    tile_slot,
    rows,
    gscales,
    h,
    far_reads,
    w_block,
    s_block,
    w_off,
    s_off,
    split,
    w_far,
    s_far,
    zero,
    P,
    D: tl.constexpr,
    I: tl.constexpr,
    A: tl.constexpr,
    QUANT: tl.constexpr,
    G: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FAR: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """h[row] = SiLU(x W_gate^T) * (x W_up^T) for the BLOCK_M rows of one expert's tile and
    BLOCK_N of its I columns (fp32; padding rows compute 0)."""
    slot, offs, pair, valid = _tile_rows(tile_slot, rows, P, A, BLOCK_M)
    if slot < 0:
        return
    if FAR:
        if tl.program_id(1) == 0:  # the tile's pairs, when its expert is read from the far tier
            tl.atomic_add(far_reads, tl.sum(valid.to(tl.int64)) * (slot >= split).to(tl.int64))
    tok = pair // A
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < I
    w = wpool + _at(slot, split, w_block, w_far) + w_off
    s = spool + _at(slot, split, s_block, s_far) + s_off
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xk = tl.load(x + tok[:, None] * D + k[None, :], mask=valid[:, None] & (k[None, :] < D), other=0.0)
        xk = _round(xk.to(tl.float32), 1).to(tl.bfloat16)
        wg = _weight_tile(w, s, n, k0, nmask, zero, D, QUANT, G, BLOCK_N, BLOCK_K)
        acc_g = _mma(xk, tl.trans(wg), acc_g, INTERPRET)
        wu = _weight_tile(w, s, n + I, k0, nmask, zero, D, QUANT, G, BLOCK_N, BLOCK_K)
        acc_u = _mma(xk, tl.trans(wu), acc_u, INTERPRET)
    if QUANT == 2:
        g = tl.load(gscales + slot * 2)
        acc_g *= g
        acc_u *= g
    if QUANT == 1 and G == 0:
        acc_g *= tl.load(s + n, mask=nmask, other=0)[None, :]
        acc_u *= tl.load(s + I + n, mask=nmask, other=0)[None, :]
    hv = acc_g * tl.sigmoid(acc_g) * acc_u
    tl.store(h + offs[:, None] * I + n[None, :], hv, mask=nmask[None, :])


@triton.jit(do_not_specialize=["zero", "P"])
def _grouped_down_kernel(
    h,
    wpool,
    spool,
    tile_slot,
    rows,
    rw,
    gscales,
    y,
    w_block,
    s_block,
    w_off,
    s_off,
    split,
    w_far,
    s_far,
    zero,
    P,
    D: tl.constexpr,
    I: tl.constexpr,
    A: tl.constexpr,
    QUANT: tl.constexpr,
    G: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """y[pair] = router weight * (h W_down^T) for one expert's tile and BLOCK_N of the D
    columns, fp32, written at the pair's own row (padding rows write nothing)."""
    slot, offs, pair, valid = _tile_rows(tile_slot, rows, P, A, BLOCK_M)
    if slot < 0:
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < D
    w = wpool + _at(slot, split, w_block, w_far) + w_off
    s = spool + _at(slot, split, s_block, s_far) + s_off
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        hk = tl.load(h + offs[:, None] * I + k[None, :], mask=k[None, :] < I, other=0.0)
        hk = _round(hk, 1).to(tl.bfloat16)
        wd = _weight_tile(w, s, n, k0, nmask, zero, I, QUANT, G, BLOCK_N, BLOCK_K)
        acc = _mma(hk, tl.trans(wd), acc, INTERPRET)
    if QUANT == 2:
        acc *= tl.load(gscales + slot * 2 + 1)
    if QUANT == 1 and G == 0:
        acc *= tl.load(s + n, mask=nmask, other=0)[None, :]
    acc *= tl.load(rw + pair, mask=valid, other=0).to(tl.float32)[:, None]
    tl.store(y + pair[:, None] * D + n[None, :], acc, mask=valid[:, None] & nmask[None, :])


@triton.jit
def _combine_kernel(
    y,
    ids,
    acc_in,
    out,
    lo,
    hi,
    D: tl.constexpr,
    A: tl.constexpr,
    A_P2: tl.constexpr,
    BLOCK: tl.constexpr,
    ACC: tl.constexpr,
    CODE: tl.constexpr,
):
    """out[t] = the sum of token t's experts lo..hi (their rows of y), by ascending expert id,
    in fp32: added to ``acc_in`` in place (ACC: one part of a step run in parts, so parts in
    ascending order add exactly as one call does), or rounded once into ``out``."""
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cmask = c < D
    ar, eid, rank = _expert_ranks(ids, t, A, A_P2)
    if ACC:
        acc = tl.load(acc_in + t * D + c, mask=cmask, other=0.0)
    else:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
    for r in tl.static_range(A):
        a = tl.sum(tl.where(rank == r, ar, 0))
        e = tl.sum(tl.where(rank == r, eid, 0))
        if (e >= lo) & (e <= hi):
            acc += tl.load(y + (t * A + a) * D + c, mask=cmask, other=0.0)
    if ACC:
        tl.store(acc_in + t * D + c, acc, mask=cmask)
    else:
        tl.store(out + t * D + c, _round(acc, CODE).to(out.dtype.element_ty), mask=cmask)


@triton.jit
def _align_kernel(
    ids,
    slots,
    rows,
    tile_slot,
    P,
    lo,
    hi,
    BLOCK_M: tl.constexpr,
    S_P2: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """``align_pairs`` in one program: a stable counting sort of the pairs by slot (one expert a
    slot), each slot's run padded to whole tiles of BLOCK_M rows. ``rows`` and ``tile_slot``
    come filled with their padding (P, -1); pairs whose expert is outside lo..hi are left out."""
    s_ar = tl.arange(0, S_P2)
    b_ar = tl.arange(0, BLOCK_P)
    counts = tl.zeros([S_P2], dtype=tl.int32)
    p0 = 0
    while p0 < P:  # a while: Triton's interpreter cannot run a for over a runtime bound
        p = p0 + b_ar
        e = tl.load(ids + p, mask=p < P, other=-1)
        keep = (p < P) & (e >= lo) & (e <= hi)
        s = tl.load(slots + p, mask=keep, other=-1)
        counts += tl.sum(((s[:, None] == s_ar[None, :]) & keep[:, None]).to(tl.int32), axis=0)
        p0 += BLOCK_P
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    base = tl.cumsum(tiles, axis=0) - tiles  # tiles of the slots before
    seen = tl.zeros([S_P2], dtype=tl.int32)  # pairs of each slot in the blocks before
    p0 = 0
    while p0 < P:
        p = p0 + b_ar
        e = tl.load(ids + p, mask=p < P, other=-1)
        keep = (p < P) & (e >= lo) & (e <= hi)
        s = tl.load(slots + p, mask=keep, other=-1)
        hit = (s[:, None] == s_ar[None, :]) & keep[:, None]  # [BLOCK_P, S_P2]
        earlier = (s[:, None] == s[None, :]) & (b_ar[None, :] < b_ar[:, None]) & keep[None, :]
        rank = tl.sum(tl.where(hit, seen[None, :], 0), axis=1) + tl.sum(earlier.to(tl.int32), axis=1)
        tile = tl.sum(tl.where(hit, base[None, :], 0), axis=1) + rank // BLOCK_M
        tl.store(rows + tile * BLOCK_M + rank % BLOCK_M, p, mask=keep)
        tl.store(tile_slot + tile, s.to(tl.int64), mask=keep)
        seen += tl.sum(hit.to(tl.int32), axis=0)
        p0 += BLOCK_P


# --------------------------------------------------------------------------------------------
# Host side


def _block_k(cols: int, layout: BlockLayout, row_bytes: int) -> int | None:
    """Columns per step: about row_bytes of weights, whole scale groups and 32-bit words,
    dividing cols."""
    p = _pow2_divisor(cols, row_bytes * 8 // BITS[layout.quant])
    p = max(p, layout.group_size, 32 // BITS[layout.quant])
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


def _check(x, pool, slot_idx, expert_ids, weights, layout, global_scales, far=None) -> None:
    check_pool(pool, layout, global_scales, None if far is None else far.rows)
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
    if not pool.is_contiguous() or (far is not None and not far.rows.is_contiguous()):
        raise ValueError("the slot pool and its far tier must be contiguous")
    named = (("x", x), ("slot_idx", slot_idx), ("expert_ids", expert_ids), ("weights", weights))
    if far is not None:
        named += (("the far tier", far.rows),) + (
            (("far_reads", far.reads),) if far.reads is not None else ()
        )
    for name, t in named:
        if t.device != pool.device:
            raise ValueError(f"{name} is on {t.device}, the slot pool on {pool.device}")


def _far_args(pool: torch.Tensor, far: FarTier | None, wv: torch.Tensor, sv: torch.Tensor) -> tuple:
    """(far_reads, split, w_far, s_far, FAR): the kernels' view of a far tier: slots from
    ``split`` on are its rows, ``w_far`` / ``s_far`` elements of the weight / scale view from the
    pool's start (device and pinned host memory share one virtual address space). Counting (FAR)
    needs both counters."""
    if far is None:
        return pool, pool.shape[0], 0, 0, False  # placeholder counter: never written
    delta = far.rows.data_ptr() - pool.data_ptr()
    we, se = wv.element_size(), sv.element_size()
    if delta % we or delta % se:
        raise ValueError(f"the far tier starts {delta} bytes from the pool: not a whole number of elements")
    counting = far.reads is not None and far.uses is not None
    reads = far.reads if counting else pool
    return reads, pool.shape[0], delta // we, delta // se, counting


def moe_gemv(
    x: torch.Tensor,
    pool: torch.Tensor,
    slot_idx: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    layout: BlockLayout,
    global_scales: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: GemvConfig | None = None,
    table: torch.Tensor | None = None,
    into: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    far: FarTier | None = None,
    acc: torch.Tensor | None = None,
    expert_range: tuple[int, int] | None = None,
    shared_down: tuple | None = None,
    xq: tuple[torch.Tensor, ...] | None = None,
    route: RouterLogits | None = None,
) -> torch.Tensor:
    """Decode, and prompts of up to a few hundred tokens (``moe.GEMV_MAX_TOKENS``): fused
    dequant + GEMV from the pool, two launches (four with a rotation). Same contract as
    ``moe_experts_ref``, except that everything runs in fp32 and is rounded to ``out_dtype``
    once. Slots must be in range (not checked: that would cost a device sync).

    ``table`` (int64 [E], every expert of the layer held): the slot of an entry is
    ``table[expert_ids]``, looked up inside the kernels (``slot_idx`` is then not read).
    ``into`` (resid [T, D], shared [T, D] or None): the result is added into ``resid`` in place,
    as ``resid.add_(routed + shared)`` rounds, and ``resid`` is returned. ``far``: slots S.. are
    the far tier's rows, read in place (``moe_experts``). ``expert_range`` (lo, hi) with ``acc``
    (fp32 [T, D]): a step in parts, as ``moe_grouped`` runs one: only those experts run (the
    others' slots are not read), added into ``acc`` in ascending id order, unrounded; parts over
    consecutive ranges in ascending order give one call's sum, bit for bit.

    ``shared_down`` (w, mid [1, S], gate [1, 1], its qgemv tile; one token, ``into`` with a
    shared output; ``folds_shared_down``): the shared expert's down projection, ``qgemv(mid, w,
    None, "gated", shared, gate, config=tile)``, runs in the gate_up launch (its programs after
    the experts', each bit for bit its own launch's) and the down launch adds its output as
    ``shared``: two launches for the step, not three.

    ``xq`` (xe, xo [T, D / 8] int32, xs [T, D / 32] fp32, xb [T, D / 32] int32: x quantized to
    int8 per 32 columns, as ``qlinear_w4a8.quantize_x`` writes a row; int4 g32 experts, no
    rotation): the gate_up products are W4A8 on it (``_dot_given``) and x is not read.

    ``route`` (with ``table``, no ``expert_range``): the router's logits, not yet routed; the
    gate_up launch routes them (``router_topk``'s program and bits) into ``expert_ids`` and
    ``weights`` (contiguous: written in place) on its way, where ``router_topk`` took a launch
    of its own before it: a MoE layer's decode step in one launch fewer."""
    _check(x, pool, slot_idx, expert_ids, weights, layout, global_scales, far)
    config = config or DEFAULT_GEMV  # (read at the call: benchmarks/ab_decode.py may replace it)
    D, I = layout_dims(layout)
    T, A = slot_idx.shape
    resid, shared = into if into is not None else (None, None)
    if resid is not None:
        _check_into(resid, shared, (T, D), x)
    if expert_range is not None:
        if acc is None or resid is not None or table is not None:
            raise ValueError("a step in parts (expert_range) takes an fp32 acc, and neither into nor table")
        _check_into(acc, None, (T, D), x)
        if acc.dtype != torch.float32:
            raise ValueError(f"acc must be float32, got {acc.dtype}")
        out = acc
    elif acc is not None:
        raise ValueError("acc is the running sum of a step in parts: give expert_range too")
    else:
        out = resid if resid is not None else torch.empty(T, D, dtype=out_dtype or x.dtype, device=x.device)
    lo, hi = expert_range if expert_range is not None else (0, 0)
    if shared_down is not None and (T != 1 or shared is None):
        raise ValueError("shared_down runs with one token, into a residual and a shared output")
    if route is not None:
        _check_fold(route, table, expert_range, expert_ids, weights, T, A)
    if T == 0:
        return out
    slots = slot_idx.to(torch.int64).contiguous()  # no copy (and no launch) when already so
    ids, rw = expert_ids.contiguous(), weights.contiguous()
    q, G = QUANT_CODE[layout.quant], layout.group_size
    rotated = layout.rotation == "hadamard"
    wv, sv = _views(pool, layout)
    reads, split, w_far, s_far, count_far = _far_args(pool, far, wv, sv)
    uses = far.uses if count_far else reads
    gs = global_scales.contiguous() if layout.quant == "int4" else rw  # unused placeholder otherwise
    tab = table if table is not None else slots  # placeholder when unused
    xin = rotate_activations(x, G) if rotated else x.contiguous()
    xe, xo, xs, xb = _check_xq(xq, layout, T, D, x.device) if xq is not None else (xin,) * 4
    h = torch.empty(T * A, I, dtype=torch.float32, device=x.device)
    grouped = layout.quant == "int4" or (layout.quant == "int8" and G > 0)
    br = 2 * _pow2_divisor(I, config.block_r)  # a gate and an up row for each of block_r columns of h
    bk = _block_k(D, layout, config.row_bytes)
    cols = 2 * I // br  # programs a pair (grid axis 1)
    sd, extra = (
        _shared_down_args(shared_down, shared, config, cols) if shared_down is not None else (_no_sd(x), 0)
    )
    dbr = _pow2_divisor(D, config.down_rows)
    # the down's arrival counters, then (READY) the tokens' ready flags, on lines of their own
    ready_at = -(-T * (D // dbr) // READY_PAD) * READY_PAD
    early = route is not None and DOWN_READY
    count = counters(x.device, ready_at + -(-T // READY_PAD) * READY_PAD if early else T * (D // dbr))
    ready = count[ready_at:] if early else count
    dbk = _block_k(I, layout, config.row_bytes)
    part = torch.empty(T * A, D, dtype=torch.float32, device=x.device)  # before the gate_up launch (READY)
    _gate_up_kernel[(T * A + extra, cols)](
        xin, wv, sv, slots, tab, ids, gs, h, reads, uses, *_component_args(layout, "gate_up", wv, sv),
        split, w_far, s_far, 0, lo, hi,
        D=D, I=I, A=A, QUANT=q, G=G, GROUPED=grouped, BLOCK_R=br, BLOCK_K=bk, SUM=step_sum(bk, G, grouped),
        TABLE=table is not None, FAR=count_far, RANGE=expert_range is not None, pairs=T * A, **sd,
        xe=xe, xo=xo, xs=xs, xb=xb, XQ=xq is not None, INTERPRET=INTERPRETED, **_route_args(route, rw, A),
        ready=ready, ready_n=A * (D // dbr), READY=early, EARLY_P=launch.EARLY_PARAMS, num_warps=config.num_warps,
        **pdl_kwargs(x.device),
    )  # fmt: skip
    try:
        if rotated:
            h = rotate_activations(h, G)
        _down_kernel[(T * A, D // dbr)](
            h, wv, sv, slots, tab, ids, rw, gs, shared if shared is not None else out, out, part,
            count, *_component_args(layout, "down", wv, sv), split, w_far, s_far, 0,
            lo, hi, D=D, I=I, A=A, A_P2=triton.next_power_of_2(A), QUANT=q, G=G, GROUPED=grouped, BLOCK_R=dbr,
            BLOCK_K=dbk, SUM=step_sum(dbk, G, grouped), TABLE=table is not None, SHARED=shared is not None,
            INTO=resid is not None, CODE=DTYPE_CODE.get(out.dtype, 0), RANGE=expert_range is not None,
            ACC=expert_range is not None, LATE=route is not None, ready=ready, READY=early,
            INTERPRET=INTERPRETED, num_warps=config.num_warps, **pdl_kwargs(x.device),
        )  # fmt: skip
    except BaseException:
        if early:  # flags no down program took off: the next call's down would read stale ids, and
            ready[:T].zero_()  # the counters (shared by every call) would not be 0 between calls
        raise
    return out


def _check_fold(route: RouterLogits, table, expert_range, ids: torch.Tensor, weights: torch.Tensor, T: int,
                A: int) -> None:  # fmt: skip
    """``moe_gemv``'s ``route``, checked: errors name what does not fit."""
    if table is None or expert_range is not None:
        raise ValueError("route (the top-k in the expert launch) needs a slot table and no expert_range")
    logits = route.logits
    if logits.dim() != 2 or logits.shape[0] != T or logits.stride(1) != 1:
        raise ValueError(
            f"route's logits must be [T={T}, E + X] with contiguous rows, got {list(logits.shape)}"
        )
    if table.shape != (route.num_experts,):
        raise ValueError(f"route has {route.num_experts} experts, the slot table {list(table.shape)}")
    if not (ids.is_contiguous() and weights.is_contiguous()):
        raise ValueError("route writes expert_ids and weights in place: both must be contiguous")
    _check_route("moe_gemv's route", T, logits.shape[1], logits.dtype, logits.device, route.num_experts, A,
                 weights, ids)  # fmt: skip


def _route_args(route: RouterLogits | None, rw: torch.Tensor, A: int) -> dict:
    """The gate_up kernel's routing arguments (placeholders without ``route``)."""
    if route is None:
        return dict(logits=rw, logit_row=0, rw=rw, ROUTE=False, E=1, BLOCK_E=1, A_P2=1, NORMALIZE=False, RCODE=0,
                    PICK32=False)  # fmt: skip
    logits = route.logits
    return dict(
        logits=logits, logit_row=logits.stride(0), rw=rw, ROUTE=True, E=route.num_experts,
        BLOCK_E=triton.next_power_of_2(route.num_experts), A_P2=triton.next_power_of_2(A),
        NORMALIZE=route.normalize, RCODE=DTYPE_CODE[logits.dtype], PICK32=PICK32,
    )  # fmt: skip


def a8_unsupported(layout: BlockLayout) -> str | None:
    """Why the gate_up launch cannot take x quantized to int8 (``moe_gemv``'s ``xq``), or None."""
    if layout.quant != "int4" or layout.group_size != A8_GROUP:
        return f"int8 activations need int4 experts in groups of {A8_GROUP}, these are {layout.quant} group {layout.group_size}"
    if layout.rotation != "none":
        return f"int8 activations take x as the router's launch stores it; these experts' x is rotated ({layout.rotation})"
    return None


def _check_xq(xq, layout: BlockLayout, T: int, D: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """xq's four tensors, checked; errors name the one that does not fit."""
    why = a8_unsupported(layout)
    if why:
        raise ValueError(f"moe_gemv's xq: {why}")
    return check_xq(xq, T, D, device)


# the gate_up kernel's shared-down constexprs when it runs none (``shared_down``)
NO_SD = dict(
    SD=False,
    SD_C=1,
    SD_QUANT=0,
    SD_G=1,
    SD_GROUPED=False,
    SD_ROW_SCALED=False,
    SD_EPILOGUE=3,
    SD_BLOCK_R=2,
    SD_BLOCK_K=1,
    SD_SUM=1,
    SD_CODE=0,
)


def _no_sd(x: torch.Tensor) -> dict:
    """The gate_up launch's shared-down arguments when it runs none: placeholders, never read."""
    return dict(sd_x=x, sd_w=x, sd_s=x, sd_rs=x, sd_gate=x, sd_out=x, sd_rows=0, sd_progs=0, **NO_SD)


def folds_shared_down(w, tile: GemvTile, config: GemvConfig = DEFAULT_GEMV) -> bool:
    """Whether ``moe_gemv``'s ``shared_down`` can run weight w (a ``QWeight``) on qgemv tile
    ``tile`` in the gate_up launch: qgemv takes w, the tile runs this launch's warps, and
    unrolled at one row (as qgemv runs it)."""
    return gemv_unsupported(w) is None and tile.num_warps == config.num_warps and tile.rolled_from > 1


def shared_down_tile(w) -> GemvTile | None:
    """The qgemv tile a shared expert's down projection w (a ``QWeight``) runs on everywhere
    once the engine runs the decode kernels, so that its one-token step can ride in the gate_up
    launch (``shared_down``) with the bits of its own launches elsewhere (a batch's rows, a
    verify window): the weight's MANY tile at this launch's warps (int4 and int8: MANY itself;
    plain: MANY's at 2 warps, not 4), or None where the launch cannot run it (its default tile,
    its own launch)."""
    if w.scheme not in MANY:
        return None
    tile = dataclasses.replace(MANY[w.scheme], num_warps=DEFAULT_GEMV.num_warps)
    return tile if folds_shared_down(w, tile) else None


def _shared_down_args(
    shared_down: tuple, shared: torch.Tensor, config: GemvConfig, cols: int
) -> tuple[dict, int]:
    """The gate_up launch's arguments for ``shared_down`` and the rows of axis 0 its programs
    take (``cols`` programs a row); errors name what does not fit."""
    w, mid, gate, tile = shared_down
    if not folds_shared_down(w, tile, config):
        raise ValueError(
            f"shared_down: {w.scheme} [{w.rows}, {w.cols}] on a tile of {tile.num_warps} warps does not run in "
            f"the gate_up launch ({config.num_warps} warps; folds_shared_down)"
        )
    width = check_gemv(mid, w, None, "gated", shared, gate)
    if mid.shape[0] != 1:
        raise ValueError(f"shared_down takes one row of mid, got {list(mid.shape)}")
    progs, (wt, st, rs), t = _weight_args(w, mid, "gated", width, tile)
    args = dict(
        sd_x=mid, sd_w=wt, sd_s=st, sd_rs=rs, sd_gate=gate, sd_out=shared, sd_rows=width, sd_progs=progs, SD=True,
        SD_C=w.cols, SD_CODE=DTYPE_CODE[mid.dtype],
    )  # fmt: skip
    return args | {f"SD_{k}": v for k, v in t.items()}, triton.cdiv(progs, cols)


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


@dataclass(frozen=True)
class GroupedConfig:
    """Fixed tile shape of the prefill kernels (fixed: a row's sums do not depend on which other
    rows share its tile, so a token's result is the same whatever the chunk or the other tokens).
    block_k is raised to the group size where a group is wider."""

    block_m: int = 32  # (token, expert) pairs per tile, all of one expert
    block_n: int = 64  # output columns per program
    block_k: int = 64  # reduction step
    num_warps: int = 4
    num_stages: int = 3


DEFAULT_GROUPED = GroupedConfig()


ALIGN_MAX_SLOTS = 1024  # pools up to this many slots are tiled by one _align_kernel program


def align_pairs(
    expert_ids: torch.Tensor,
    slot_idx: torch.Tensor,
    slots: int,
    block_m: int,
    expert_range: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tiles of a grouped step, on the device, with no host round trip: (rows int32
    [n·block_m]: the pair t·A + a of each tile row, P where a tile is padded; tile_slot int64
    [n]: each tile's slot, -1 for the unused tiles at the end). Pairs are sorted by slot (one
    expert a slot; stable), each slot's run padded to whole tiles; ``expert_range`` (lo, hi)
    keeps only those experts. n = ceil(P / block_m) + min(P, slots) bounds the tiles. Two fills
    and one launch (``_align_kernel``) for pools of up to ALIGN_MAX_SLOTS slots; torch sorts
    above (``align_pairs_torch``, the same tiles)."""
    P = expert_ids.numel()
    n_max = -(-P // block_m) + min(P, slots)
    if slots > ALIGN_MAX_SLOTS:
        return align_pairs_torch(expert_ids, slot_idx, slots, block_m, expert_range)
    dev = expert_ids.device
    rows = torch.full((n_max * block_m,), P, dtype=torch.int32, device=dev)
    tile_slot = torch.full((n_max,), -1, dtype=torch.int64, device=dev)
    lo, hi = expert_range if expert_range is not None else (0, torch.iinfo(torch.int32).max)
    if P:
        _align_kernel[(1,)](
            expert_ids.contiguous(), slot_idx.contiguous(), rows, tile_slot, P, lo, hi, BLOCK_M=block_m,
            S_P2=triton.next_power_of_2(slots), BLOCK_P=64, num_warps=8,
        )  # fmt: skip
    return rows, tile_slot


def align_pairs_torch(
    expert_ids: torch.Tensor,
    slot_idx: torch.Tensor,
    slots: int,
    block_m: int,
    expert_range: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``align_pairs`` in torch ops (about 25 launches): for pools of more slots than one
    program tiles, and the reference the kernel is tested against."""
    key = slot_idx.flatten()
    P = key.numel()
    dev = key.device
    n_max = -(-P // block_m) + min(P, slots)
    keep = None
    if expert_range is not None:
        flat = expert_ids.flatten()
        keep = (flat >= expert_range[0]) & (flat <= expert_range[1])
        key = torch.where(keep, key, torch.iinfo(key.dtype).max)  # dropped pairs sort last
    order = torch.argsort(key, stable=True)
    e = key[order]
    j = torch.arange(P, device=dev)
    start = torch.ones(P, dtype=torch.bool, device=dev)
    start[1:] = e[1:] != e[:-1]
    end = torch.ones(P, dtype=torch.bool, device=dev)
    end[:-1] = start[1:]
    rank = j - torch.cummax(torch.where(start, j, 0), 0).values  # position in the slot's run
    tiles = torch.where(end, rank // block_m + 1, 0)  # a slot's tile count, at its last pair
    if keep is not None:
        tiles = torch.where(keep[order], tiles, 0)
    base = torch.cumsum(tiles, 0) - tiles  # tiles of the slots before
    tile = base + rank // block_m
    pos = base * block_m + rank
    if keep is not None:  # dropped pairs go to one spare row and one spare tile past the end
        kept = keep[order]
        pos = torch.where(kept, pos, n_max * block_m)
        tile = torch.where(kept, tile, n_max)
    rows = torch.full((n_max * block_m + 1,), P, dtype=torch.int32, device=dev)
    rows.scatter_(0, pos, order.to(torch.int32))
    tile_slot = torch.full((n_max + 1,), -1, dtype=torch.int64, device=dev)
    tile_slot.scatter_(0, tile, e.to(torch.int64))  # a tile's pairs share a slot
    return rows[:-1], tile_slot[:-1]


def moe_grouped(
    x: torch.Tensor,
    pool: torch.Tensor,
    slot_idx: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    layout: BlockLayout,
    global_scales: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    acc: torch.Tensor | None = None,
    expert_range: tuple[int, int] | None = None,
    config: GroupedConfig = DEFAULT_GROUPED,
    far: FarTier | None = None,
) -> torch.Tensor:
    """Prefill: a grouped GEMM over every expert of the step, three launches after the tiling
    (``align_pairs``), no host round trip: gate_up + SiLU·up per expert tile (weights dequantized
    to bf16 in the kernel, bf16 products, fp32 sums), down times the router weight per tile, then
    each token's experts summed in fp32 by ascending expert id and rounded once. ``expert_range``
    (lo, hi): only those experts run (the others' slots are not read), added into ``acc`` (fp32
    [T, D]), which is returned as is (the caller rounds it once, at the end). ``far``: slots S..
    are the far tier's rows, read in place (``moe_experts``)."""
    _check(x, pool, slot_idx, expert_ids, weights, layout, global_scales, far)
    config = config or DEFAULT_GEMV  # (read at the call: benchmarks/ab_decode.py may replace it)
    D, I = layout_dims(layout)
    T, A = slot_idx.shape
    out = acc if acc is not None else torch.empty(T, D, dtype=out_dtype or x.dtype, device=x.device)
    if T == 0:
        return out
    P, bm = T * A, config.block_m
    slots = pool.shape[0] + (far.rows.shape[0] if far is not None else 0)
    rows, tile_slot = align_pairs(expert_ids, slot_idx, slots, bm, expert_range)
    n_tiles = tile_slot.numel()
    q, G = QUANT_CODE[layout.quant], layout.group_size
    rotated = layout.rotation == "hadamard"
    wv, sv = _views(pool, layout)
    reads, split, w_far, s_far, count = _far_args(pool, far, wv, sv)
    rw = weights.contiguous()
    gs = global_scales.contiguous() if layout.quant == "int4" else rw  # unused placeholder otherwise
    xin = rotate_activations(x, G) if rotated else x.contiguous()
    h = torch.empty(n_tiles * bm, I, dtype=torch.float32, device=x.device)
    bk = max(config.block_k, G)
    common = dict(
        A=A, QUANT=q, G=G, BLOCK_M=bm, BLOCK_N=config.block_n, BLOCK_K=bk, INTERPRET=INTERPRETED,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    _grouped_gate_up_kernel[(n_tiles, triton.cdiv(I, config.block_n))](
        xin, wv, sv, tile_slot, rows, gs, h, reads, *_component_args(layout, "gate_up", wv, sv),
        split, w_far, s_far, 0, P, D=D, I=I, FAR=count, **common
    )  # fmt: skip
    if rotated:
        h = rotate_activations(h, G)
    y = torch.empty(P, D, dtype=torch.float32, device=x.device)
    _grouped_down_kernel[(n_tiles, triton.cdiv(D, config.block_n))](
        h, wv, sv, tile_slot, rows, rw, gs, y, *_component_args(layout, "down", wv, sv),
        split, w_far, s_far, 0, P, D=D, I=I, **common
    )  # fmt: skip
    lo, hi = expert_range if expert_range is not None else (0, torch.iinfo(torch.int32).max)
    block = min(triton.next_power_of_2(D), 512)
    ids = expert_ids.contiguous()
    _combine_kernel[(T, triton.cdiv(D, block))](
        y, ids, out, out, lo, hi, D=D, A=A, A_P2=triton.next_power_of_2(A), BLOCK=block,
        ACC=acc is not None, CODE=DTYPE_CODE.get(out.dtype, 0), num_warps=4,
    )  # fmt: skip
    return out
