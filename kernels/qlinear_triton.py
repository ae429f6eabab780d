"""Triton GEMV for decode over a dense ``QWeight`` (plain, int8, int4), one launch per call.

Shape legend: N = tokens (1..MAX_TOKENS), R = weight rows, C = columns, S = R // 2 (``silu_mul``),
G = columns per scale group, K = BLOCK_K columns of a step.

A program owns BLOCK_R weight rows (``silu_mul``: BLOCK_R / 2 gate rows, each next to its up
row r + S) and streams them once, K columns a step: the step's weights are dequantized once into
fp32 and multiplied by each of the N tokens' x in turn, so weight bytes are read once for all
tokens. Decode is memory-bound: a one-row call unrolls its steps so every load of a row can be in
flight; a call of more rows loops over them (``GemvConfig.rolled_from``), each step's words read
one step ahead, as the decoded weights held for all its rows would otherwise run out of registers.

Sums are fp32: each group's sum(q * x) is multiplied by its scale (int8 grouped, int4), summed
into one accumulator per (token, row, group slot of a step), and the slots summed at the end;
an int4 row's sum is then multiplied by its row_scale (a power of two: exact), an int8 per-row
weight's by its one scale. The result is rounded to x.dtype once, and each epilogue rounds where
its torch ops round (kernels/qlinear_reference.py).

int4 decode is bound by instruction issue, not bandwidth, so every instruction a weight value
costs counts: weights are read as 32-bit words and decoded without int-to-float conversions (a
slow instruction on the GPU): one AND-XOR (a single LOP3) masks a field in place, flips its sign
bit and sets an exponent over it, so the float is 2^e + (q + 2^(bits-1)), and one exact
subtraction leaves q; then one FMA per token. Scale codes decode with two integer ops.

W4A8 (a weight whose ``act`` is int8, QUANT 3): each step quantizes each row's slice of x (after
the norm) to int8 per group of 32 columns and multiplies it with the step's words by ``dp4a``, two
a word (kernels/qlinear_w4a8.py), the group's integer sum joining its accumulator once. On the
MANY tile (16 rows a program) that is 3.4 SASS instructions a weight value with the norm prologue
against 5.0, 3.2 against 4.3 without (x's slice loaded as its groups there); on the FEW tile (4
rows) more than W4A16 (8.1 against 6.1 at 2,048 x 4,096), a slice's quantization being shared by
4 rows only: int8 activations pay on weights of many rows. A row's quantization is its own, so its
bits still do not depend on the call's other rows.

Tile shapes are a fixed function of (scheme, R, C) (``gemv_config``), never autotuned, and
nothing is atomic: the bits repeat. Each token has accumulators of its own, updated and summed
by the operations a one-token call runs, so a token's row is the one-token call's bit for bit
whatever the call's token count (a batch's step; checked on an H200 at Qwen3.6's shapes for
N = 1..8, and by the batch's start-up probe on the device it runs on). An earlier tile that held
all tokens in one [rows, groups, tokens] accumulator summed a row in an order that depended on
the token count: one ulp now and then. ``alone`` runs each row by the one-row kernel's programs
instead (the fallback when the probe refuses the shared pass). Token counts are compiled in
power-of-two buckets (1, 2, 4, 8; the tokens past the call's read zeros and are not stored).
No host syncs, no allocation but the output's, one launch: a call can be captured in a CUDA
graph.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from edgerun.kernels import launch
from edgerun.kernels.bits_triton import _e4m3, _field
from edgerun.kernels.dense_triton import DTYPE_CODE, _conv_silu_taps, _conv_taps, _round, _silu
from edgerun.kernels.dense_triton import _check as check_tensors
from edgerun.kernels.launch import _grid_sync, pdl_kwargs
from edgerun.kernels.qlinear_w4a8 import _quantize_groups, _terms, check_xq
from edgerun.kernels.qweight import SCHEMES, QWeight

QUANT_CODE = {"plain": 0, "int8": 1, "int4": 2}
# QUANT 3: an int4 g32 weight whose ``act`` is int8 (W4A8: x quantized per 32 columns in each step,
# dp4a products; kernels/qlinear_w4a8.py). The interpreter runs dp4a and LOP3 as integer operations.
_INTERP = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")
EPILOGUE_CODE = {"none": 0, "silu_mul": 1, "residual": 2, "gated": 3}
PER_WORD = {"int8": 4, "int4": 8}  # values in one 32-bit word of the weight
VALUE_BITS = {"int4": 4, "int8": 8, "plain": 16}  # a tile's sizing counts plain weights as 16-bit
MAX_TOKENS = 8  # rows of x a call takes; above, a GEMM (cuBLAS) is the better tool
SUB = 32  # columns summed before they join an accumulator, where no scale group decides it
# its constexprs when it runs no conv epilogue (``conv``)
NO_CONV = dict(CONV=False, CONV_C=1, CONV_K=2, CONV_KP2=2)
# its constexprs for a second GEMV when it runs none (``also``)
NO_ALSO = dict(
    TWO=False, QUANT2=0, G2=1, GROUPED2=False, ROW_SCALED2=False, EPILOGUE2=0, BLOCK_R2=2, BLOCK_K2=1, SUM2=1
)


@dataclass(frozen=True)
class GemvConfig:
    """Tile shape of ``qgemv`` (fixed: it decides the reduction order, so the bits). The default
    is the int4 / int8 tile for weights of many rows; ``gemv_config`` says which tile a weight
    gets and why."""

    block_r: int = 16  # weight rows per program (a power of two >= 2; silu_mul: half gate, half up)
    row_bytes: int = 256  # weight bytes of each row loaded per step
    num_warps: int = 2
    # calls of this many rows or more loop over their steps, each step's words read one step
    # ahead, instead of unrolling every step (whose decoded weights, kept for every row, run out
    # of registers); either way a row's operations are the same, so its bits (not part of the tile)
    rolled_from: int = 2

    def __post_init__(self) -> None:
        for name in ("block_r", "row_bytes", "num_warps"):  # rolled_from: any row count
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"GemvConfig.{name} must be a power of two, got {v}")
        if self.block_r < 2:
            raise ValueError(f"GemvConfig.block_r must be >= 2 (silu_mul pairs rows), got {self.block_r}")


# Tiles by scheme, from the sweep of benchmarks/bench_dense_gemv.py on an H200 (N = 1, C 2048 and
# 4096). MANY: weights of many rows (lm_head, a layer's projections in one GEMV), where
# bandwidth decides: each thread holds 4 rows of a step, so the activations it converts serve 4
# rows (int4 runs out of instruction issue, not bandwidth, with fewer). FEW: under MIN_PROGRAMS
# programs of MANY (R < ~8K), where latency decides: more, smaller programs.
# Rolled steps from 2 rows for MANY, from 4 for FEW: benchmarks/bench_rows_gemv.py on an H200
# (docs/benchmarks.md): the lm_head 0.81x the unrolled time at 2 rows, 0.84x at 4; FEW's small
# programs lose a little at 2 rows (out_proj 7.6 against 7.3 us) and gain at 4 (9.8 against 13.2).
# FEW int4 takes a whole 1 KB of each of 4 rows a step (a row of C = 2048 in one step) since
# 2026-12-06: on an H100, out_proj [2048, 4096] 4.2 us against 5.7 for the 2-row 512-byte tile at
# one row, 8.2 against 9.8 at 4 (rolled), the shared expert's gate_up faster at every row
# count, and 40-layer decode +4.7% (606.9 against 579.7 tok/s in one run; docs/benchmarks.md).
MANY = {"int4": GemvConfig(16, 256, 2), "int8": GemvConfig(16, 256, 2), "plain": GemvConfig(16, 512, 4)}
FEW = {
    "int4": GemvConfig(4, 1024, 4, rolled_from=4),
    "int8": GemvConfig(8, 1024, 4, rolled_from=4),
    "plain": GemvConfig(8, 1024, 4, rolled_from=4),
}
# MANY's rows for an int4 weight that takes int8 activations (W4A8, ``QWeight.act``): 512 bytes
# of each of 16 rows a step, 4 warps (x's int8 groups loaded once for 16 rows; no spill at 1-8
# rows in the sm_90 build), every row count unrolled. On an H100 (2026-12-06; docs/benchmarks.md):
# Qwen3.6's in_proj with its norm 7.3 / 10.5 / 15.8 / 27.6 us at 1 / 2 / 4 / 8 rows, against 8.6 /
# 10.0 / 14.4 / 27.7 on MANY's tile (best of unrolled and rolled) and 9.1 / 13.4 / 21.9 / 44.3
# with bf16 x; rolled it loses at every row count (11.4 / 17.2 / 36.1); 40-layer decode with
# ``--dense-act int8`` 644.5 tok/s against 607.1 with bf16 x in the same run.
MANY_A8 = GemvConfig(16, 512, 4, rolled_from=MAX_TOKENS + 1)
MIN_PROGRAMS = 4 * 132  # a few programs for each of an H200's 132 SMs
# TINY: where FEW would leave SMs without a program (a router's 257 bf16 rows: 33 programs of 8
# rows reading 32 KB each in turn), two rows a program and a row of up to 4 KB in one step, so
# that every SM reads and, with PDL, all of a program's weights are requested before it waits.
# FEW's warps, so that a router still pairs with the shared expert's gate_up (``pairs``). Only
# for weights of TINY_BYTES or more: below, a program's reads are a few KB either way.
# benchmarks/bench_route.py on an H100: Qwen3.6's router launch 6.2 µs against FEW's 7.8, the
# router GEMV alone 2.5 against 4.4.
SMS = 132
TINY_BYTES = 256 << 10
TINY = {
    "int4": GemvConfig(2, 512, 4, rolled_from=4),
    "int8": GemvConfig(2, 4096, 4, rolled_from=4),
    "plain": GemvConfig(2, 4096, 4, rolled_from=4),
}


def _pow2_divisor(n: int, at_most: int) -> int:
    """Largest power of two <= at_most that divides n."""
    p = 1
    while p * 2 <= at_most and n % (p * 2) == 0:
        p *= 2
    return p


# --------------------------------------------------------------------------------------------
# Device helpers


@triton.jit
def _words(w, rows, k0, C: tl.constexpr, QUANT: tl.constexpr, BLOCK_K: tl.constexpr):
    """The stored bits of columns [k0, k0 + BLOCK_K) of weight rows ``rows`` (int64): the values
    (plain, [BLOCK_R, BLOCK_K]) or the 32-bit words that pack them (int8, int4)."""
    if QUANT == 0:
        cols = k0 + tl.arange(0, BLOCK_K)
        return tl.load(w + rows[:, None] * C + cols[None, :])
    else:
        PER: tl.constexpr = 4 if QUANT == 1 else 8
        i = k0 // PER + tl.arange(0, BLOCK_K // PER)
        return tl.load(w.to(tl.pointer_type(tl.int32)) + rows[:, None] * (C // PER) + i[None, :])


@triton.jit
def _values(wd, zero, QUANT: tl.constexpr):
    """``_words``' bits as fp32 [BLOCK_R, BLOCK_K]: the stored values (plain) or q (int8, int4),
    unscaled."""
    if QUANT == 0:
        return wd.to(tl.float32)
    elif QUANT == 3:  # W4A8: the words as they are (``_part`` takes their lanes)
        return wd
    elif QUANT == 1:  # 4 int8 a word: column 4i + b in byte b
        hi = wd >> 16
        even = tl.interleave(_field(wd, 0, 8, zero), _field(hi, 0, 8, zero))  # bytes 0, 2
        odd = tl.interleave(_field(wd, 8, 8, zero), _field(hi, 8, 8, zero))  # bytes 1, 3
        return tl.interleave(even, odd)
    else:  # 8 int4 a word: column 8i + k in nibble k (bits 4k..4k+3)
        hi = wd >> 12  # nibbles 5..7 to bits 8..19, inside the mantissa
        n0 = tl.interleave(_field(wd, 0, 4, zero), _field(wd, 16, 4, zero))  # nibbles 0, 4
        n2 = tl.interleave(_field(wd, 8, 4, zero), _field(hi, 12, 4, zero))  # 2, 6
        n1 = tl.interleave(_field(wd, 4, 4, zero), _field(hi, 8, 4, zero))  # 1, 5
        n3 = tl.interleave(_field(wd, 12, 4, zero), _field(hi, 16, 4, zero))  # 3, 7
        return tl.interleave(tl.interleave(n0, n2), tl.interleave(n1, n3))


@triton.jit
def _scales(s, rows, k0, C: tl.constexpr, G: tl.constexpr, QUANT: tl.constexpr, BLOCK_K: tl.constexpr):
    """The group scales of columns [k0, k0 + BLOCK_K) of ``rows`` as fp32 [BLOCK_R, BLOCK_K // G]."""
    gi = k0 // G + tl.arange(0, BLOCK_K // G)
    scale = tl.load(s + rows[:, None] * (C // G) + gi[None, :])
    if QUANT >= 2:
        scale = _e4m3(scale)
    return scale


@triton.jit
def _normed(xf, inv, wf, NORM: tl.constexpr, CODE: tl.constexpr):
    """RMSNorm of x values given the row's 1 / rms, rounded where the module rounds: NORM 1
    scales by (1 + w) in fp32 (Qwen3.5); NORM 2 rounds, then scales by w (Qwen3)."""
    y = xf * inv
    if NORM == 1:
        return _round(y * (1.0 + wf), CODE)
    return _round(_round(y, CODE) * wf, CODE)


@triton.jit
def _inv_rms(x, x_row, n, NT, eps, C: tl.constexpr, BLOCK_C: tl.constexpr):
    """fp32: 1 / rms of row n of x (C columns; a row n >= NT, past the call's rows, reads as
    zeros), as ``rms_norm`` computes it; one row at a time, so its bits do not depend on how many
    rows the call has."""
    c = tl.arange(0, BLOCK_C)
    xf = tl.load(x + n * x_row + c, mask=(c < C) & (n < NT), other=0.0).to(tl.float32)
    return tl.rsqrt(tl.sum(xf * xf, axis=0) / C + eps)


@triton.jit
def _store_normed(p, x, x_row, norm_w, norm_out, eps, NT, N: tl.constexpr, C: tl.constexpr, NO_BLOCK: tl.constexpr,
                  BLOCK_C: tl.constexpr, NORM: tl.constexpr, CODE: tl.constexpr):  # fmt: skip
    """Columns [p NO_BLOCK, (p + 1) NO_BLOCK) of the RMS-normalised rows of x (program p of the
    call's, along grid axis 0) into ``norm_out`` [NT, C], for the layer's other consumers: each of the NT rows (of
    at most N) by ``_inv_rms`` and ``_normed``, so its bits do not depend on the other rows."""
    c = p * NO_BLOCK + tl.arange(0, NO_BLOCK)
    cm = c < C
    wn = tl.load(norm_w + c, mask=cm, other=0.0).to(tl.float32)
    for n in tl.static_range(N):
        if n < NT:  # a branch: the rows past the call's cost nothing
            xn = tl.load(x + n * x_row + c, mask=cm, other=0.0).to(tl.float32)
            y = _normed(xn, _inv_rms(x, x_row, n, NT, eps, C, BLOCK_C), wn, NORM, CODE)
            tl.store(norm_out + n * C + c, y.to(norm_out.dtype.element_ty), mask=cm)


@triton.jit
def _store_quantized(p, progs, x, x_row, norm_w, xe, xo, xs, xb, eps, NT, N: tl.constexpr, C: tl.constexpr,
                     BLOCK_C: tl.constexpr, NORM: tl.constexpr, CODE: tl.constexpr):  # fmt: skip
    """Groups p, p + progs, ... of 32 columns of the RMS-normalised rows of x (program p of
    ``progs``), each row's values as ``_store_normed`` stores them, quantized to int8 by
    ``_quantize_groups`` into ``xe, xo, xs, xb`` (a row's C / 8, C / 8, C / 32 and C / 32
    entries; ``qlinear_w4a8.quantize_x``'s layout): x for the layer's int8-activation consumers
    (the experts' gate_up), the bits ``quantize_x`` gives on ``norm_out``."""
    g = p
    while g < C // 32:  # a while: interpretable, and no pipelining of the next group's loads
        c = g * 32 + tl.arange(0, 32)
        wn = tl.load(norm_w + c).to(tl.float32)
        for n in tl.static_range(N):
            if n < NT:
                xn = tl.load(x + n * x_row + c).to(tl.float32)
                y = _normed(xn, _inv_rms(x, x_row, n, NT, eps, C, BLOCK_C), wn, NORM, CODE)
                e, o, sc, off = _quantize_groups(tl.reshape(y, [1, 32]), 1, _INTERP)
                tl.store(xe + n * (C // 8) + g * 4 + tl.arange(0, 4), e)
                tl.store(xo + n * (C // 8) + g * 4 + tl.arange(0, 4), o)
                tl.store(xs + n * (C // 32) + g + tl.arange(0, 1), sc)
                tl.store(xb + n * (C // 32) + g + tl.arange(0, 1), off)
        g += progs


@triton.jit
def _part(x, x_row, n, NT, cols, q, scale, wn, inv, GROUPED: tl.constexpr, NORM: tl.constexpr,
          CODE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SUM: tl.constexpr,
          QUANT: tl.constexpr = 0):  # fmt: skip
    """fp32 [BLOCK_R, BLOCK_K // SUM]: one step's group sums of token n (x RMS-normalised first
    when NORM, ``inv`` its 1 / rms, ``wn`` the norm's weights at the step's columns, fp32; a token
    n >= NT reads zeros), group scales applied."""
    xn = tl.load(x + n * x_row + cols, mask=n < NT, other=0.0).to(tl.float32)
    if NORM:
        xn = _normed(xn, inv, wn, NORM, CODE)
    if QUANT == 3:  # W4A8 (SUM = G = 32): x's slice quantized, dp4a over the words' lanes
        NG: tl.constexpr = BLOCK_K // 32
        if NORM:  # x's slice as the norm gave it (this layout measured fewer instructions here) ...
            e, o, sx, off = _quantize_groups(tl.reshape(xn, [NG, 32]), NG, _INTERP)
        else:  # ... and loaded as its groups where there is no norm (3.2 SASS a value, not 4.8)
            x2 = tl.load(x + n * x_row + tl.reshape(cols, [NG, 32]), mask=n < NT, other=0.0).to(tl.float32)
            e, o, sx, off = _quantize_groups(x2, NG, _INTERP)
        part = _terms(
            q, e[None, :], o[None, :], sx[None, :], off[None, :], scale, BLOCK_R, BLOCK_K // 8, NG, _INTERP
        )
    else:
        part = tl.sum(tl.reshape(q * xn[None, :], [BLOCK_R, BLOCK_K // SUM, SUM]), axis=2)
        if GROUPED:
            part = part * scale
    return part


@triton.jit
def _step(x, x_row, k0, q, scale, norm_w, NT, a0, a1, a2, a3, a4, a5, a6, a7,
          inv0, inv1, inv2, inv3, inv4, inv5, inv6, inv7, N: tl.constexpr, GROUPED: tl.constexpr,
          NORM: tl.constexpr, CODE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
          SUM: tl.constexpr, QUANT: tl.constexpr = 0, wn0=0.0, GIVEN: tl.constexpr = False):  # fmt: skip
    """One step of ``_accumulate``: each token's group sums of the step's columns k0 .. k0 +
    BLOCK_K added into its accumulator, by the same operations whatever N is. GIVEN: the norm's
    weights at the step's columns are ``wn0`` (read before the program's wait), else read here."""
    cols = k0 + tl.arange(0, BLOCK_K)
    wn = wn0
    if NORM and not GIVEN:
        wn = tl.load(norm_w + cols).to(tl.float32)
    a0 += _part(x, x_row, 0, NT, cols, q, scale, wn, inv0, GROUPED, NORM, CODE, BLOCK_R, BLOCK_K, SUM, QUANT)
    if N > 1:
        a1 += _part(
            x, x_row, 1, NT, cols, q, scale, wn, inv1, GROUPED, NORM, CODE, BLOCK_R, BLOCK_K, SUM, QUANT
        )
    if N > 2:
        a2 += _part(
            x, x_row, 2, NT, cols, q, scale, wn, inv2, GROUPED, NORM, CODE, BLOCK_R, BLOCK_K, SUM, QUANT
        )
    if N > 3:
        a3 += _part(
            x, x_row, 3, NT, cols, q, scale, wn, inv3, GROUPED, NORM, CODE, BLOCK_R, BLOCK_K, SUM, QUANT
        )
    if N > 4:
        a4 += _part(
            x, x_row, 4, NT, cols, q, scale, wn, inv4, GROUPED, NORM, CODE, BLOCK_R, BLOCK_K, SUM, QUANT
        )
    if N > 5:
        a5 += _part(
            x, x_row, 5, NT, cols, q, scale, wn, inv5, GROUPED, NORM, CODE, BLOCK_R, BLOCK_K, SUM, QUANT
        )
    if N > 6:
        a6 += _part(
            x, x_row, 6, NT, cols, q, scale, wn, inv6, GROUPED, NORM, CODE, BLOCK_R, BLOCK_K, SUM, QUANT
        )
    if N > 7:
        a7 += _part(
            x, x_row, 7, NT, cols, q, scale, wn, inv7, GROUPED, NORM, CODE, BLOCK_R, BLOCK_K, SUM, QUANT
        )
    return a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def _accumulate(
    x,
    x_row,
    w,
    s,
    rows,
    zero,
    wd0,
    scale0,
    norm_w,
    eps,
    NT,
    N: tl.constexpr,
    C: tl.constexpr,
    QUANT: tl.constexpr,
    G: tl.constexpr,
    GROUPED: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SUM: tl.constexpr,
    NORM: tl.constexpr,
    CODE: tl.constexpr,
    BLOCK_C: tl.constexpr,
    ROLLED: tl.constexpr,
    nw0=0.0,
    EARLY_N: tl.constexpr = False,
):
    """fp32 [BLOCK_R, N]: each of ``rows``' dot product with token n's x (RMS-normalised
    first when NORM, see ``_normed``), group scales applied (not a row's own scale). ``wd0``,
    ``scale0``: the first step's words and scales, read already. Unrolled (not ROLLED), all of a
    row's loads can be in flight; ROLLED, a loop whose next step's words are read before this
    step's products (a row's operations are the same either way).

    Each token has an accumulator of its own, [BLOCK_R, BLOCK_K // SUM] whatever N is, updated
    and summed by the same operations as in a one-token call: a token's bits do not depend on
    the call's other tokens (a batch's step, a verify window; checked on the device at start-up,
    ``rows_alone_mismatch``), while each step's weights are decoded once for all N. N is the
    call's row count rounded up to a power of two (fewer kernels to compile); the NT rows of
    the call are the first, the others read zeros and are not stored. EARLY_N (unrolled, NORM):
    ``nw0`` holds the norm's weights at the first step's columns, read before the wait."""
    inv0 = 0.0
    inv1 = 0.0
    inv2 = 0.0
    inv3 = 0.0
    inv4 = 0.0
    inv5 = 0.0
    inv6 = 0.0
    inv7 = 0.0
    if NORM:
        inv0 = _inv_rms(x, x_row, 0, NT, eps, C, BLOCK_C)
        if N > 1:
            inv1 = _inv_rms(x, x_row, 1, NT, eps, C, BLOCK_C)
        if N > 2:
            inv2 = _inv_rms(x, x_row, 2, NT, eps, C, BLOCK_C)
        if N > 3:
            inv3 = _inv_rms(x, x_row, 3, NT, eps, C, BLOCK_C)
        if N > 4:
            inv4 = _inv_rms(x, x_row, 4, NT, eps, C, BLOCK_C)
        if N > 5:
            inv5 = _inv_rms(x, x_row, 5, NT, eps, C, BLOCK_C)
        if N > 6:
            inv6 = _inv_rms(x, x_row, 6, NT, eps, C, BLOCK_C)
        if N > 7:
            inv7 = _inv_rms(x, x_row, 7, NT, eps, C, BLOCK_C)
    a0 = tl.zeros([BLOCK_R, BLOCK_K // SUM], dtype=tl.float32)
    a1 = a0
    a2 = a0
    a3 = a0
    a4 = a0
    a5 = a0
    a6 = a0
    a7 = a0
    if ROLLED:  # a loop, each step's words read one step ahead
        wd = wd0
        scale = scale0
        for k0 in range(0, C, BLOCK_K):
            ahead = tl.minimum(k0 + BLOCK_K, C - BLOCK_K)  # the last step reads itself again
            wd_next = _words(w, rows, ahead, C, QUANT, BLOCK_K)
            scale_next = scale
            if GROUPED:
                scale_next = _scales(s, rows, ahead, C, G, QUANT, BLOCK_K)
            q = _values(wd, zero, QUANT)
            a0, a1, a2, a3, a4, a5, a6, a7 = _step(
                x, x_row, k0, q, scale, norm_w, NT, a0, a1, a2, a3, a4, a5, a6, a7,
                inv0, inv1, inv2, inv3, inv4, inv5, inv6, inv7, N, GROUPED, NORM, CODE, BLOCK_R, BLOCK_K, SUM, QUANT,
            )  # fmt: skip
            wd = wd_next
            scale = scale_next
    else:  # unrolled: every load of the row can be in flight
        for k0 in tl.static_range(0, C, BLOCK_K):
            if k0 == 0:  # read before the grid sync
                q = _values(wd0, zero, QUANT)
                scale = scale0
            else:
                q = _values(_words(w, rows, k0, C, QUANT, BLOCK_K), zero, QUANT)
                if GROUPED:
                    scale = _scales(s, rows, k0, C, G, QUANT, BLOCK_K)
            a0, a1, a2, a3, a4, a5, a6, a7 = _step(
                x, x_row, k0, q, scale, norm_w, NT, a0, a1, a2, a3, a4, a5, a6, a7,
                inv0, inv1, inv2, inv3, inv4, inv5, inv6, inv7, N, GROUPED, NORM, CODE, BLOCK_R, BLOCK_K, SUM, QUANT,
                nw0, EARLY_N and k0 == 0,
            )  # fmt: skip
    tok = tl.arange(0, N)[None, :]
    y = tl.where(tok == 0, tl.sum(a0, axis=1)[:, None], tl.zeros([BLOCK_R, N], dtype=tl.float32))
    if N > 1:
        y = tl.where(tok == 1, tl.sum(a1, axis=1)[:, None], y)
    if N > 2:
        y = tl.where(tok == 2, tl.sum(a2, axis=1)[:, None], y)
    if N > 3:
        y = tl.where(tok == 3, tl.sum(a3, axis=1)[:, None], y)
    if N > 4:
        y = tl.where(tok == 4, tl.sum(a4, axis=1)[:, None], y)
    if N > 5:
        y = tl.where(tok == 5, tl.sum(a5, axis=1)[:, None], y)
    if N > 6:
        y = tl.where(tok == 6, tl.sum(a6, axis=1)[:, None], y)
    if N > 7:
        y = tl.where(tok == 7, tl.sum(a7, axis=1)[:, None], y)
    return y


@triton.jit
def _tile_rows(p, ROWS, EPILOGUE: tl.constexpr, BLOCK_R: tl.constexpr):
    """(output columns [OUT_R], weight rows [BLOCK_R] int64) of the tile of program p (of the
    call's programs along grid axis 0): BLOCK_R rows (silu_mul: row i is the gate row (i even)
    or the up row (odd) of output column i // 2, so OUT_R = BLOCK_R / 2). Rows past ROWS are
    clamped to the last (loads stay unmasked)."""
    i = tl.arange(0, BLOCK_R)
    if EPILOGUE == 1:
        OUT_R: tl.constexpr = BLOCK_R // 2
        ocol = p * OUT_R + tl.arange(0, OUT_R)
        wrow = tl.minimum(p * OUT_R + i // 2, ROWS - 1) + (i % 2) * ROWS
    else:
        ocol = p * BLOCK_R + i
        wrow = tl.minimum(ocol, ROWS - 1)
    return ocol, wrow.to(tl.int64)  # 64-bit: row offsets pass 2^31 bytes in large weights


@triton.jit
def _finish(y, ocol, wrow, row_scale, bias, gate, out, out_row, gate_row, ROWS, NT, N: tl.constexpr,
            ROW_SCALED: tl.constexpr, HAS_BIAS: tl.constexpr, EPILOGUE: tl.constexpr, CODE: tl.constexpr):  # fmt: skip
    """A tile's fp32 sums y [BLOCK_R, N] (tokens last) to its outputs: the row scale and bias,
    rounded to x.dtype (F.linear's output), then the epilogue, rounded where its torch ops round;
    the NT tokens of the call stored, columns past ROWS not. Returns the rounded F.linear output
    (fp32 holding x.dtype values: what epilogue none stores)."""
    if ROW_SCALED:
        y = y * tl.load(row_scale + wrow)[:, None]
    if HAS_BIAS:
        y = y + tl.load(bias + wrow).to(tl.float32)[:, None]
    y = _round(y, CODE)
    linear = y
    tok = tl.arange(0, N)[None, :]
    dst = out + tok * out_row + ocol[:, None]
    mask = (tok < NT) & (ocol[:, None] < ROWS)
    if EPILOGUE == 1:
        g, u = tl.split(tl.permute(tl.reshape(y, [y.shape[0] // 2, 2, N]), (0, 2, 1)))
        y = _round(_round(_silu(g), CODE) * u, CODE)
    elif EPILOGUE == 2:
        y = _round(tl.load(dst, mask=mask, other=0.0).to(tl.float32) + y, CODE)
    elif EPILOGUE == 3:
        logit = tl.load(gate + tok * gate_row, mask=tok < NT, other=0.0).to(tl.float32)
        y = _round(_round(1.0 / (1.0 + tl.exp(-logit)), CODE) * y, CODE)  # torch.sigmoid's form
    tl.store(dst, y.to(out.dtype.element_ty), mask=mask)
    return linear


# --------------------------------------------------------------------------------------------
# Kernel


@triton.jit
def _gemv_program(p, x, w, s, row_scale, bias, gate, out, norm_w, norm_out, eps, ROWS, x_row, out_row, gate_row,
                  zero, NT, N: tl.constexpr, C: tl.constexpr, QUANT: tl.constexpr, G: tl.constexpr,
                  GROUPED: tl.constexpr, ROW_SCALED: tl.constexpr, HAS_BIAS: tl.constexpr, EPILOGUE: tl.constexpr,
                  CODE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SUM: tl.constexpr,
                  NORM: tl.constexpr, NORM_OUT: tl.constexpr, BLOCK_C: tl.constexpr, NO_BLOCK: tl.constexpr,
                  ROLLED: tl.constexpr, PDL: tl.constexpr, EARLY_N: tl.constexpr = False):  # fmt: skip
    """Program p of one GEMV's tiles (``_qgemv_kernel``'s docstring), its pointers already at its
    row of the call. Returns (its output columns [BLOCK_R] (silu_mul: [BLOCK_R / 2]), their rounded
    F.linear outputs [BLOCK_R, N] (``_finish``)). EARLY_N (NORM, unrolled): the norm's weights at
    the first step's columns are read before the wait too."""
    ocol, wrow = _tile_rows(p, ROWS, EPILOGUE, BLOCK_R)
    wd0 = _words(w, wrow, 0, C, QUANT, BLOCK_K)  # weights never change: read before the sync
    scale0 = wd0
    if GROUPED:
        scale0 = _scales(s, wrow, 0, C, G, QUANT, BLOCK_K)
    nw0 = 0.0
    GIVEN: tl.constexpr = EARLY_N and NORM != 0 and not ROLLED
    if GIVEN:
        nw0 = tl.load(norm_w + tl.arange(0, BLOCK_K)).to(tl.float32)
    _grid_sync(PDL)
    if NORM_OUT:
        _store_normed(p, x, x_row, norm_w, norm_out, eps, NT, N, C, NO_BLOCK, BLOCK_C, NORM, CODE)
    y = _accumulate(
        x, x_row, w, s, wrow, zero, wd0, scale0, norm_w, eps, NT, N, C, QUANT, G, GROUPED,
        BLOCK_R, BLOCK_K, SUM, NORM, CODE, BLOCK_C, ROLLED, nw0, GIVEN,
    )  # fmt: skip
    linear = _finish(y, ocol, wrow, row_scale, bias, gate, out, out_row, gate_row, ROWS, NT, N, ROW_SCALED,
                     HAS_BIAS, EPILOGUE, CODE)  # fmt: skip
    return ocol, linear


@triton.jit(do_not_specialize=["zero"])  # a runtime 0 (see _field), whatever Triton specializes
def _qgemv_kernel(
    x,
    w,
    s,
    row_scale,
    bias,
    gate,
    out,
    norm_w,
    norm_out,
    eps,
    ROWS,
    x_row,
    out_row,
    gate_row,
    zero,
    NT,
    N: tl.constexpr,
    C: tl.constexpr,
    QUANT: tl.constexpr,
    G: tl.constexpr,
    GROUPED: tl.constexpr,
    ROW_SCALED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EPILOGUE: tl.constexpr,
    CODE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SUM: tl.constexpr,
    NORM: tl.constexpr,
    NORM_OUT: tl.constexpr,
    BLOCK_C: tl.constexpr,
    NO_BLOCK: tl.constexpr,
    ROLLED: tl.constexpr,
    w2,
    s2,
    row_scale2,
    out2,
    ROWS2,
    out2_row,
    progs,
    TWO: tl.constexpr,
    QUANT2: tl.constexpr,
    G2: tl.constexpr,
    GROUPED2: tl.constexpr,
    ROW_SCALED2: tl.constexpr,
    EPILOGUE2: tl.constexpr,
    BLOCK_R2: tl.constexpr,
    BLOCK_K2: tl.constexpr,
    SUM2: tl.constexpr,
    conv_state,
    conv_w,
    conv_act,
    CONV: tl.constexpr,
    CONV_C: tl.constexpr,
    CONV_K: tl.constexpr,
    CONV_KP2: tl.constexpr,
    xq_e,
    xq_o,
    xq_s,
    xq_b,
    NORM_Q: tl.constexpr,
    EARLY_P: tl.constexpr,
    EARLY_N: tl.constexpr,
    PDL: tl.constexpr,
):
    """ROWS: output columns (R; silu_mul: S). Rows past ROWS are clamped to the last (loads stay
    unmasked, so wide) and not stored. ``zero`` is 0 (see ``_field``). NORM: x is RMS-normalised
    with ``norm_w`` on the way in (every program computes the rows' rms itself), and with
    NORM_OUT program p also stores columns [p * NO_BLOCK, (p + 1) * NO_BLOCK) of the normalised
    rows into ``norm_out`` for the layer's other consumers. PDL: see kernels/launch.py.
    NT: the rows of x this program computes (its tokens), N: NT rounded up to a power of two
    (the compiled token slots). Grid axis 1: rows of the call computed alone (``qgemv``'s ``alone``): program (p, j) is
    program p of the one-row call on row j, its pointers offset to that row.

    TWO: programs ``progs`` and on are a second GEMV's on the same x and norm (``qgemv``'s
    ``also``: weight w2, its constexprs the ...2 ones, no bias, gate, norm_out nor top-k, into
    out2): each of its programs is the one that GEMV's own launch would run, so its bits are
    that launch's; one launch instead of two.

    CONV (one row, epilogue none; ``qgemv``'s ``conv``): output columns [0, CONV_C) are a
    DeltaNet layer's conv input, and the programs that own them also run the causal conv + SiLU
    of their columns (``dense_triton._conv_silu_of`` on the rounded outputs, the values the conv
    launch would load) into ``conv_act`` (fp32) and shift their rows of ``conv_state`` [CONV_C,
    CONV_K - 1]: the conv launch's bits, one launch fewer a DeltaNet layer.

    EARLY_P (kernels/launch.py's EARLY_PARAMS): the conv's taps and older inputs (the layer's own
    state, of its previous step) read before the wait too; EARLY_N (its EARLY_NORMS): the norm's
    weights at the first step's columns (NORM, unrolled).

    NORM_Q: the first GEMV's programs also store the normalised rows quantized to int8 per 32
    columns into ``xq_e, xq_o, xq_s, xq_b`` (``_store_quantized``; ``qgemv``'s ``norm_q_out``)."""
    j = tl.program_id(1)
    x += j * x_row
    out += j * out_row
    gate += j * gate_row
    norm_out += j * C
    p = tl.program_id(0)
    if TWO and p >= progs:
        _gemv_program(
            p - progs, x, w2, s2, row_scale2, x, x, out2 + j * out2_row, norm_w, norm_out, eps, ROWS2, x_row,
            out2_row, 0, zero, NT, N, C, QUANT2, G2, GROUPED2, ROW_SCALED2, False, EPILOGUE2, CODE, BLOCK_R2, BLOCK_K2, SUM2,
            NORM, False, BLOCK_C, NO_BLOCK, ROLLED, PDL, EARLY_N,
        )  # fmt: skip
    else:
        if CONV and EARLY_P:  # masked: the programs past the conv's columns load nothing
            cc = _tile_rows(p, ROWS, EPILOGUE, BLOCK_R)[0]
            hist, wt = _conv_taps(conv_state, conv_w, cc, cc < CONV_C, CONV_K, CONV_KP2)
        ocol, linear = _gemv_program(
            p, x, w, s, row_scale, bias, gate, out, norm_w, norm_out, eps, ROWS, x_row, out_row, gate_row, zero, NT,
            N, C, QUANT, G, GROUPED, ROW_SCALED, HAS_BIAS, EPILOGUE, CODE, BLOCK_R, BLOCK_K, SUM, NORM, NORM_OUT,
            BLOCK_C, NO_BLOCK, ROLLED, PDL, EARLY_N,
        )  # fmt: skip
        if NORM_Q:  # after the program's grid sync (in _gemv_program): x is the previous launch's
            _store_quantized(
                p, progs if TWO else tl.num_programs(0), x, x_row, norm_w, xq_e + j * (C // 8), xq_o + j * (C // 8),
                xq_s + j * (C // 32), xq_b + j * (C // 32), eps, NT, N, C, BLOCK_C, NORM, CODE,
            )  # fmt: skip
        if CONV:
            if p * BLOCK_R < CONV_C:  # the whole program's branch (CONV_C is a multiple of BLOCK_R)
                cm = ocol < CONV_C
                if not EARLY_P:
                    hist, wt = _conv_taps(conv_state, conv_w, ocol, cm, CONV_K, CONV_KP2)
                y = _conv_silu_taps(tl.reshape(linear, [BLOCK_R]), hist, wt, conv_state, ocol, cm, CONV_K,
                                    CONV_KP2, CODE)  # fmt: skip
                tl.store(conv_act + ocol, y, mask=cm)


# --------------------------------------------------------------------------------------------
# Host side


def unsupported(w: QWeight) -> str | None:
    """Why ``qgemv`` cannot compute with ``w``; None when it can."""
    if w.scheme not in SCHEMES:
        return f"scheme {w.scheme!r} is not one of {', '.join(SCHEMES)}"
    if w.weight.dim() != 2 or w.rows < 1 or w.cols < 1:
        return f"weight must be a non-empty [R, C], got {list(w.weight.shape)}"
    if w.scheme == "plain":
        if w.weight.dtype not in DTYPE_CODE:
            return f"plain weight dtype {w.weight.dtype} is not one of {list(DTYPE_CODE)}"
        return None
    C, g = w.cols, w.group
    per_row = w.scheme == "int8" and g == C
    if not per_row and (g < PER_WORD[w.scheme] or g & (g - 1)):
        return f"{w.scheme} group {g} is not a power of two >= {PER_WORD[w.scheme]}"
    if C % PER_WORD[w.scheme]:
        return f"{w.cols} columns are not a multiple of {PER_WORD[w.scheme]} (whole 32-bit words)"
    return None


def gemv_config(scheme: str, R: int, C: int, act: str = "bf16") -> GemvConfig:
    """The tile ``qgemv`` uses for a weight of this scheme, shape and activations (``QWeight.act``;
    C only decides whether a weight of few rows is large enough for TINY: a step's columns are a
    fixed number of bytes). A fixed function, so the bits repeat."""
    many, few = MANY[scheme], FEW[scheme]
    if triton.cdiv(R, many.block_r) >= MIN_PROGRAMS:
        return MANY_A8 if act == "int8" else many
    if triton.cdiv(R, few.block_r) >= SMS or R * C * VALUE_BITS[scheme] < 8 * TINY_BYTES:
        return few
    return TINY[scheme]


def _tile(w: QWeight, config: GemvConfig) -> tuple[int, int, bool]:
    """(BLOCK_K, SUM, grouped): a power-of-two step of about config.row_bytes of each row that
    divides C and holds whole scale groups, and the columns summed before accumulating."""
    C = w.cols
    grouped = w.scheme == "int4" or (w.scheme == "int8" and w.group != C)
    bits = 4 if w.scheme == "int4" else 8 * (w.weight.element_size())
    block_k = _pow2_divisor(C, max(1, config.row_bytes * 8 // bits))
    if grouped:
        block_k = max(block_k, w.group)
    block_k = max(block_k, PER_WORD.get(w.scheme, 1))
    return block_k, step_sum(block_k, w.group, grouped), grouped


def step_sum(block_k: int, group: int, grouped: bool) -> int:
    """Columns of a step summed before they join an accumulator: a scale group, else SUB (the
    GEMV step's ``SUM``, for the projections and the experts alike)."""
    return group if grouped else min(SUB, block_k)


def _where(t: torch.Tensor) -> str:
    return f"{t.dtype} {list(t.shape)} on {t.device}"


def _check(x, w, bias, epilogue, out, gate, max_rows: int = MAX_TOKENS) -> int:
    """Errors name the tensor; only attribute checks (no device work). Returns the output width."""
    if x.dim() != 2 or x.stride(1) != 1 or x.dtype not in DTYPE_CODE:
        raise ValueError(f"x must be [N, C] with contiguous rows in {list(DTYPE_CODE)}, got {_where(x)}")
    if x.shape[0] > max_rows:
        raise ValueError(f"x has {x.shape[0]} rows; a GEMV takes at most {max_rows} (use a GEMM)")
    w.check()
    why = unsupported(w)
    if why:
        raise ValueError(f"qgemv cannot run this weight: {why}")
    if x.shape[1] != w.cols:
        raise ValueError(f"x {_where(x)} does not match the weight's {w.cols} columns")
    for name, t in (("weight", w.weight), ("scales", w.scales), ("row_scale", w.row_scale)):
        if t is not None and (t.device != x.device or not t.is_contiguous()):
            raise ValueError(f"{name} must be contiguous on {x.device}, got {_where(t)}")
    if w.scheme == "plain" and w.weight.dtype != x.dtype:
        raise ValueError(f"plain weight {_where(w.weight)} must have x's dtype {x.dtype}")
    if w.scheme != "plain" and w.weight.data_ptr() % 4:
        raise ValueError(f"weight {_where(w.weight)} must start on a 4-byte boundary (read as words)")
    R = w.rows
    if bias is not None and (tuple(bias.shape) != (R,) or bias.dtype != x.dtype or bias.device != x.device):
        raise ValueError(f"bias must be {x.dtype} [{R}] on {x.device}, got {_where(bias)}")
    if epilogue not in EPILOGUE_CODE:
        raise ValueError(f"epilogue {epilogue!r} is not one of {', '.join(EPILOGUE_CODE)}")
    if epilogue == "silu_mul" and R % 2:
        raise ValueError(f"silu_mul needs gate and up rows: weight has an odd {R} rows")
    width = R // 2 if epilogue == "silu_mul" else R
    if epilogue == "residual" and out is None:
        raise ValueError("epilogue 'residual' needs out (the residual [N, R]) to add into")
    if out is not None and (
        tuple(out.shape) != (x.shape[0], width)
        or out.dtype != x.dtype
        or out.device != x.device
        or out.stride(1) != 1
    ):
        raise ValueError(f"out must be {x.dtype} [{x.shape[0]}, {width}] on {x.device}, got {_where(out)}")
    if epilogue == "gated" and (
        gate is None
        or tuple(gate.shape) != (x.shape[0], 1)
        or gate.dtype != x.dtype
        or gate.device != x.device
    ):
        got = None if gate is None else _where(gate)
        raise ValueError(f"epilogue 'gated' needs gate {x.dtype} [{x.shape[0]}, 1] on {x.device}, got {got}")
    return width


def qgemv(
    x: torch.Tensor,
    w: QWeight,
    bias: torch.Tensor | None = None,
    epilogue: str = "none",
    out: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
    config: GemvConfig | None = None,
    norm: tuple[torch.Tensor, float, bool] | None = None,
    norm_out: torch.Tensor | None = None,
    alone: bool = False,
    rolled: bool | None = None,
    also: tuple[QWeight, str, torch.Tensor] | None = None,
    conv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    norm_q_out: tuple[torch.Tensor, ...] | None = None,
) -> torch.Tensor:
    """``qlinear_ref`` in one launch, for decode: x [N, C] (N <= MAX_TOKENS, rows may be strided,
    columns contiguous) in fp32, bf16 or fp16; every tensor on x's device; ``out`` must not
    overlap x. ``config`` overrides ``gemv_config`` (benchmarks; a weight that always runs
    another tile, ``QLinear.tile``): it changes the bits.

    ``alone``: each row by programs of its own (the one-row kernel over a grid of rows: its
    weights read again for each row, mostly from L2), rather than one pass over all rows that
    decodes each step's weights once; both give each row the one-row call's bits by design, the
    device's compiled code decides (``Runner.probe_batch`` checks the shared pass, this is its
    fallback).

    ``norm`` (weight [C] in x's dtype, eps, unit_offset): x is RMS-normalised on the way in, as
    ``rms_norm_ref`` would (one launch fewer than a separate norm); ``norm_out`` [N, C] then also
    receives the normalised x, and ``norm_q_out`` (xe, xo [N, C / 8] int32, xs [N, C / 32] fp32,
    xb [N, C / 32] int32) the normalised x quantized to int8 per 32 columns, the bits
    ``qlinear_w4a8.quantize_x`` gives on it (what the experts' gate_up takes as ``xq``).

    ``also`` (w2, epilogue2 'none' or 'silu_mul', out2): a second GEMV of the same x (and norm)
    in the same launch, into out2, where ``pairs(w, w2, C)``: its programs are those its own
    call would run (the same tile, so the same bits), after this one's.

    ``conv`` (conv_state [1, CC, K - 1] and conv_weight [CC, K] in x's dtype, act fp32 [1, CC];
    one row, epilogue none; ``folds_conv``): the output's first CC columns are a DeltaNet layer's
    conv input; the launch also runs its causal conv + SiLU into ``act`` and shifts
    ``conv_state``, the bits of ``dense_triton.delta_decode``'s conv launch (which then does not
    run: its ``act``)."""
    width = _check(x, w, bias, epilogue, out, gate)
    N, C = x.shape
    _check_norm(x, norm, norm_out)
    xq = _check_norm_q(x, norm, norm_q_out) if norm_q_out is not None else (x,) * 4
    pair = _check_also(x, w, also, alone, config, rolled) if also is not None else None
    cfg = config or gemv_config(w.scheme, w.rows, C, w.act)
    folded = _check_conv(x, epilogue, width, cfg, conv, also) if conv is not None else _no_conv(x)
    if out is None:
        out = torch.empty(N, width, dtype=x.dtype, device=x.device)
    if N == 0:
        return out
    progs, (wt, st, rs), tile = _weight_args(w, x, epilogue, width, cfg)
    grid = (progs + (pair["progs2"] if pair else 0), N if alone else 1)
    n = 1 if alone else N
    _qgemv_kernel[grid](
        x, wt, st, rs, bias if bias is not None else x, gate if gate is not None else x, out,
        norm[0] if norm is not None else x, norm_out if norm_out is not None else x,
        norm[1] if norm is not None else 0.0,
        width, x.stride(0), out.stride(0), gate.stride(0) if gate is not None else 0, 0, n,
        N=triton.next_power_of_2(n), C=C, **tile,
        HAS_BIAS=bias is not None, CODE=DTYPE_CODE[x.dtype],
        NORM=0 if norm is None else (1 if norm[2] else 2), NORM_OUT=norm_out is not None,
        BLOCK_C=triton.next_power_of_2(C), NO_BLOCK=triton.next_power_of_2(triton.cdiv(C, progs)),
        ROLLED=(n >= cfg.rolled_from) if rolled is None else rolled,
        **(pair["args"] if pair else _no_also(x)), progs=progs, **folded,
        xq_e=xq[0], xq_o=xq[1], xq_s=xq[2], xq_b=xq[3], NORM_Q=norm_q_out is not None,
        EARLY_P=launch.EARLY_PARAMS, EARLY_N=launch.EARLY_NORMS, num_warps=cfg.num_warps, **pdl_kwargs(x.device),
    )  # fmt: skip
    return out


def pairs(w: QWeight, w2: QWeight, cols: int) -> bool:
    """Whether ``qgemv`` can run w2 in w's launch (``also``): both weights take it and their
    tiles run the same warps (a launch has one warp count, and a tile's bits follow it)."""
    if unsupported(w) or unsupported(w2) or w.cols != cols or w2.cols != cols:
        return False
    return (
        gemv_config(w.scheme, w.rows, cols, w.act).num_warps
        == gemv_config(w2.scheme, w2.rows, cols, w2.act).num_warps
    )


def _check_also(x, w, also, alone, config, rolled) -> dict:
    """The second GEMV's kernel arguments; errors name what does not fit."""
    w2, epilogue2, out2 = also
    N, C = x.shape
    if N != 1 or alone or config is not None or rolled is not None:
        raise ValueError("qgemv's also takes one row of x, on the default tiles")
    if epilogue2 not in ("none", "silu_mul"):
        raise ValueError(f"qgemv's also: epilogue must be 'none' or 'silu_mul', got {epilogue2!r}")
    width2 = _check(x, w2, None, epilogue2, out2, None)
    if out2 is None:
        raise ValueError(f"qgemv's also needs out2 [{N}, {width2}]")
    if not pairs(w, w2, C):
        raise ValueError(f"qgemv's also: {w2.scheme} [{w2.rows}, {w2.cols}] does not pair with {w.scheme} [{w.rows}, {w.cols}] (pairs())")  # fmt: skip
    progs2, (wt, st, rs), tile = _weight_args(
        w2, x, epilogue2, width2, gemv_config(w2.scheme, w2.rows, C, w2.act)
    )
    args = dict(w2=wt, s2=st, row_scale2=rs, out2=out2, ROWS2=width2, out2_row=out2.stride(0), TWO=True)
    return {"progs2": progs2, "args": args | {f"{k}2": v for k, v in tile.items()}}


def folds_conv(w: QWeight, cols: int, channels: int) -> bool:
    """Whether ``qgemv``'s ``conv`` can run a conv over ``channels`` of w's first output columns
    in w's launch: w takes qgemv and its tile's programs split at the channels' end."""
    if unsupported(w) or w.cols != cols or not 0 < channels <= w.rows:
        return False
    return channels % gemv_config(w.scheme, w.rows, cols, w.act).block_r == 0


def _check_conv(x, epilogue, width, cfg, conv, also) -> dict:
    """The conv epilogue's kernel arguments; errors name what does not fit."""
    conv_state, conv_weight, act = conv
    if x.shape[0] != 1 or epilogue != "none" or also is not None:
        raise ValueError("qgemv's conv takes one row of x, epilogue 'none', and no also")
    if conv_weight.dim() != 2:
        raise ValueError(f"conv weight must be [CC, K], got {_where(conv_weight)}")
    CC, K = conv_weight.shape
    if K < 2 or not 0 < CC <= width or CC % cfg.block_r:
        raise ValueError(
            f"qgemv's conv over {CC} channels ({K} taps) does not fit {width} outputs in tiles of {cfg.block_r} rows"
        )
    expected = {
        "conv_state": (conv_state, (1, CC, K - 1), (x.dtype,)),
        "conv weight": (conv_weight, (CC, K), (x.dtype,)),
        "act": (act, (1, CC), (torch.float32,)),
    }
    check_tensors(expected, x.device)
    return dict(
        conv_state=conv_state, conv_w=conv_weight, conv_act=act, CONV=True, CONV_C=CC, CONV_K=K,
        CONV_KP2=triton.next_power_of_2(K),
    )  # fmt: skip


def _no_conv(x: torch.Tensor) -> dict:
    """The conv epilogue's arguments when there is none: placeholders, never read."""
    return dict(conv_state=x, conv_w=x, conv_act=x, **NO_CONV)


def _weight_args(w: QWeight, x: torch.Tensor, epilogue: str, width: int, cfg: GemvConfig) -> tuple:
    """A weight's part of a ``_qgemv_kernel`` launch on its tile ``cfg``: (its programs, (weight,
    scales, row scale) with x as the placeholder of what it has not, its constexprs by their
    first GEMV's names: QUANT, G, GROUPED, ROW_SCALED, EPILOGUE, BLOCK_R, BLOCK_K, SUM)."""
    block_k, sub, grouped = _tile(w, cfg)
    tensors = (
        w.weight,
        w.scales if w.scales is not None else x,
        w.row_scale if w.row_scale is not None else (w.scales if w.scheme == "int8" else x),
    )
    tile = dict(
        QUANT=3 if w.act == "int8" else QUANT_CODE[w.scheme], G=w.group, GROUPED=grouped,
        ROW_SCALED=w.scheme == "int4" or (w.scheme == "int8" and not grouped), EPILOGUE=EPILOGUE_CODE[epilogue],
        BLOCK_R=cfg.block_r, BLOCK_K=block_k, SUM=sub,
    )  # fmt: skip
    return triton.cdiv(width, cfg.block_r // 2 if epilogue == "silu_mul" else cfg.block_r), tensors, tile


def _no_also(x: torch.Tensor) -> dict:
    """The second GEMV's arguments when there is none: placeholders, never read."""
    return dict(w2=x, s2=x, row_scale2=x, out2=x, ROWS2=0, out2_row=0, **NO_ALSO)


def _check_norm_q(x: torch.Tensor, norm, norm_q_out) -> tuple[torch.Tensor, ...]:
    """norm_q_out's four tensors, checked; errors name the one that does not fit."""
    N, C = x.shape
    if norm is None:
        raise ValueError("norm_q_out is the normalised x quantized: it needs norm")
    if C % 32:
        raise ValueError(f"norm_q_out quantizes groups of 32 columns; x has {C}")
    return check_xq(norm_q_out, N, C, x.device, "norm_q_out")


def _check_norm(x: torch.Tensor, norm, norm_out: torch.Tensor | None) -> None:
    if norm is None:
        if norm_out is not None:
            raise ValueError("norm_out is the normalised x: it needs norm")
        return
    N, C = x.shape
    weight = norm[0]
    if tuple(weight.shape) != (C,) or weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(f"norm weight must be {x.dtype} [{C}] on {x.device}, got {_where(weight)}")
    if not weight.is_contiguous():
        raise ValueError("norm weight must be contiguous")
    if norm_out is not None:
        if tuple(norm_out.shape) != (N, C) or norm_out.dtype != x.dtype or not norm_out.is_contiguous():
            raise ValueError(f"norm_out must be a contiguous {x.dtype} [{N}, {C}], got {_where(norm_out)}")
        if norm_out.data_ptr() == x.data_ptr():
            raise ValueError("norm_out must not be x: other programs still read x")


@triton.jit(do_not_specialize=["zero", "R"])
def _dequant_kernel(
    w,
    s,
    rs,
    out,
    zero,
    R,
    C: tl.constexpr,
    G: tl.constexpr,
    QUANT: tl.constexpr,
    PER_ROW: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CODE: tl.constexpr,
):
    """BLOCK_R rows by BLOCK_K columns of an int8 / int4 weight's exact values (``qweight``'s
    ``dequantize``: q * scale, q * (e4m3 * row_scale)), rounded once to the output dtype."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rows = tl.minimum(r, R - 1).to(tl.int64)  # the tail program reads a valid row, stores none of it
    k0 = tl.program_id(1) * BLOCK_K
    q = _values(_words(w, rows, k0, C, QUANT, BLOCK_K), zero, QUANT)
    if PER_ROW:
        vals = q * tl.load(s + rows)[:, None]
    else:
        step = _scales(s, rows, k0, C, G, QUANT, BLOCK_K)
        if QUANT == 2:
            step = step * tl.load(rs + rows)[:, None]
        vals = tl.reshape(tl.reshape(q, [BLOCK_R, BLOCK_K // G, G]) * step[:, :, None], [BLOCK_R, BLOCK_K])
    cols = k0 + tl.arange(0, BLOCK_K)
    tl.store(
        out + rows[:, None] * C + cols[None, :],
        _round(vals, CODE).to(out.dtype.element_ty),
        mask=(r < R)[:, None],
    )


def dequantize_weight(w: QWeight, dtype: torch.dtype) -> torch.Tensor:
    """An int8 / int4 weight's exact values rounded to ``dtype`` [R, C] in one launch: the bits
    of ``qweight.dequantize(w).to(dtype)``, for prefill's GEMMs (cuBLAS) over quantized weights."""
    why = unsupported(w)
    if why or w.scheme == "plain":
        raise ValueError(f"cannot dequantize this weight with the Triton kernel: {why or 'it is plain'}")
    R, C, G = w.rows, w.cols, w.group
    out = torch.empty(R, C, dtype=dtype, device=w.weight.device)
    per_row = w.scheme == "int8" and G == C
    block_k = _pow2_divisor(C, 256)
    if not per_row:
        block_k = max(block_k, G)
    block_r = 16
    rs = w.row_scale if w.row_scale is not None else w.scales
    _dequant_kernel[(triton.cdiv(R, block_r), C // block_k)](
        w.weight, w.scales, rs, out, 0, R, C=C, G=G, QUANT=QUANT_CODE[w.scheme], PER_ROW=per_row,
        BLOCK_R=block_r, BLOCK_K=block_k, CODE=DTYPE_CODE[dtype], num_warps=4,
    )  # fmt: skip
    return out
