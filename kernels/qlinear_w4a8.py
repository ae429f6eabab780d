"""W4A8 decode GEMV by ``dp4a`` (issue 13): an int4 g32 ``QWeight`` times one row of x quantized
to int8 per group of 32 columns. This module's kernel is the stand-alone one the benchmark times
(benchmarks/bench_w4a8_gemv.py); ``qgemv`` runs the same arithmetic (its ``_quantize``, ``_lanes``
and ``_dp4a``, QUANT 3) for a weight whose ``act`` is int8, with its norms, epilogues and rows.
The engine gives it to the int4 projections of many rows under ``--dense-act int8``
(``layers.int8_worth``; docs/gpu.md): +5-7% decode at 40 layers on an H100 (docs/benchmarks.md).

Shape legend: R = weight rows, C = columns, W = BLOCK_K // 8 words of a step, NG = BLOCK_K // 32
groups of a step.

Why: ``qgemv`` decodes each int4 value to fp32 and multiplies it by x in fp32: 4.3 SASS
instructions a weight value (benchmarks/sass_mma_gemv.py), so at Qwen3.6's projections the
instruction issue takes about as long as the bytes and the GEMV runs at 25-50% of its bytes'
time (docs/benchmarks.md). Here a 32-bit word of 8 values costs five instructions:

- ``(w & 0x0F0F0F0F) ^ 0x08080808``: columns 0, 2, 4, 6 of the word (nibbles 0, 2, 4, 6) as
  unsigned bytes q + 8 (one LOP3); ``((w >> 4) & 0x0F0F0F0F) ^ 0x08080808``: columns 1, 3, 5, 7
  (a shift and a LOP3);
- two ``dp4a.u32.s32``: each the sum of four products of those bytes with x's int8 values of the
  same columns (x's words ``xe`` and ``xo``: its even and odd columns, four a word).

A group's four words' sums are added in integers, the offset removed as -8 times the group's sum
of x's int8 values (``xb``), and the group's integer sum joins an fp32 accumulator once, times
the weight scale and x's scale: (u - 8) s_w . q_x s_x summed exactly, then one rounding a group.

x's quantization (``quantize_x``, one row): per group of 32 columns, s = max|x| / 127 and
q = floor(x * (127 / max|x|) + 0.5) (0 where the group is all zeros), every step an fp32 op
``quantize_x_ref`` repeats (the product x * inv by ``mul.rn``, which no launch's fp fusion
contracts with the + 0.5 into one rounding), so every launch that quantizes x gives the same
bits: ``quantize_x``, ``qgemv``'s QUANT 3 and its ``norm_q_out``. The kernel takes x quantized
(``xq`` from ``quantize_x``: a launch of its own, or the producer of x writing it) or quantizes
its slice of x itself each step (``QUANT_X``), the same values.

On the CPU (Triton's interpreter runs no inline assembly) ``dp4a`` is its four products in
integer operations, the same value. The integer sums are exact; the fp32 group products and
their sum are the only rounding, so the kernel agrees with ``w4a8_ref`` to fp32 summation order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from edgerun.kernels.bits_triton import _e4m3
from edgerun.kernels.dense_triton import _check as check_tensors
from edgerun.kernels.launch import _grid_sync, pdl_kwargs
from edgerun.kernels.qweight import QWeight, int4_values

GROUP = 32  # columns of an x scale; the weight's scale group must be the same


@dataclass(frozen=True)
class W4A8Config:
    block_r: int = 16  # weight rows a program
    block_k: int = 512  # columns a step (int4: block_k / 2 bytes of a row)
    num_warps: int = 2


# --------------------------------------------------------------------------------------------
# Device helpers


@triton.jit
def _dp4a(a, b, c, INTERPRET: tl.constexpr):
    """c + the dot product of a's four unsigned bytes with b's four signed bytes (int32)."""
    if INTERPRET:
        s = c
        for j in tl.static_range(4):
            s += ((a >> (8 * j)) & 0xFF) * ((b << (24 - 8 * j)) >> 24)
        return s
    return tl.inline_asm_elementwise(
        asm="dp4a.u32.s32 $0, $1, $2, $3;",
        constraints="=r,r,r,r",
        args=[a, b, c],
        dtype=tl.int32,
        is_pure=True,
        pack=1,
    )


@triton.jit
def _lanes(w, SHIFT: tl.constexpr, INTERPRET: tl.constexpr):
    """Nibbles 0, 2, 4, 6 of ``w >> SHIFT`` as unsigned bytes with their sign bit flipped (q + 8):
    one LOP3 (the compiler emits an AND and an XOR), after a shift for SHIFT 4."""
    v = w >> SHIFT if SHIFT else w
    if INTERPRET:
        return (v & 0x0F0F0F0F) ^ 0x08080808
    return tl.inline_asm_elementwise(
        asm="lop3.b32 $0, $1, 0x0F0F0F0F, 0x08080808, 0x6a;",  # (a & b) ^ c
        constraints="=r,r",
        args=[v],
        dtype=tl.int32,
        is_pure=True,
        pack=1,
    )


@triton.jit
def _terms(wd, e, o, sx, off, sw, BLOCK_R: tl.constexpr, W: tl.constexpr, NG: tl.constexpr,
           INTERPRET: tl.constexpr):  # fmt: skip
    """fp32 [BLOCK_R, NG]: a step's group terms float(q_w . q_x + off) * (s_w * s_x) of the int4
    words ``wd`` [BLOCK_R, W] (W = 4 NG) and x's even- and odd-column words ``e``, ``o`` (broadcast
    to [BLOCK_R, W]), x's scales ``sx`` and offsets ``off`` and the weight scales ``sw`` [BLOCK_R,
    NG]: the integer dot products exact, one fp32 product a group."""
    d = _dp4a(
        _lanes(wd, 0, INTERPRET),
        tl.broadcast_to(e, [BLOCK_R, W]),
        tl.zeros([BLOCK_R, W], tl.int32),
        INTERPRET,
    )
    d = _dp4a(_lanes(wd, 4, INTERPRET), tl.broadcast_to(o, [BLOCK_R, W]), d, INTERPRET)
    isum = tl.sum(tl.reshape(d, [BLOCK_R, NG, 4]), axis=2) + off
    return isum.to(tl.float32) * (sw * sx)


@triton.jit
def _given(xe, xo, xs, xb, rows, k, W: tl.constexpr, NG: tl.constexpr):
    """x's quantized words (even, odd columns), scales and offsets of the step at column k, loaded
    in the weights' layout ([BLOCK_R, .], every row the same address): no conversion through
    shared memory."""
    z = rows[:, None] * 0
    wi = k // 8 + tl.arange(0, W)
    gi = k // 32 + tl.arange(0, NG)
    e = tl.load(xe + z + wi[None, :])
    o = tl.load(xo + z + wi[None, :])
    return e, o, tl.load(xs + z + gi[None, :]), tl.load(xb + z + gi[None, :])


@triton.jit
def _dot_given(xe, xo, xs, xb, w, s, rows, wd0, sw0, C: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
               INTERPRET: tl.constexpr):  # fmt: skip
    """fp32 [BLOCK_R]: weight ``rows`` (int64) of an int4 g32 [R, C] component at w (its e4m3
    scales at s) times one row of x given quantized (``xe, xo, xs, xb``, as ``quantize_x`` writes
    them), weight scales applied (not a row's or a tensor's own); ``wd0``, ``sw0``: the first
    step's words and decoded scales, read already (before a PDL wait). The experts' gate_up runs
    it on x as the router's launch stored it quantized."""
    W: tl.constexpr = BLOCK_K // 8
    NG: tl.constexpr = BLOCK_K // 32
    w32 = w.to(tl.pointer_type(tl.int32))
    acc = tl.zeros([BLOCK_R, NG], tl.float32)
    for k in tl.static_range(0, C, BLOCK_K):
        if k == 0:
            wd = wd0
            sw = sw0
        else:
            wd = tl.load(w32 + rows[:, None] * (C // 8) + (k // 8 + tl.arange(0, W))[None, :])
            sw = _e4m3(tl.load(s + rows[:, None] * (C // 32) + (k // 32 + tl.arange(0, NG))[None, :]))
        e, o, sx, off = _given(xe, xo, xs, xb, rows, k, W, NG)
        acc += _terms(wd, e, o, sx, off, sw, BLOCK_R, W, NG, INTERPRET)
    return tl.sum(acc, axis=1)


@triton.jit
def _mul_rn(a, b, INTERPRET: tl.constexpr):
    """fp32 a * b rounded by itself: an explicit rounding mode keeps ptxas from contracting it
    with a later add into an FMA (which rounds once), whatever the launch's fp fusion, so x's
    quantization has the same bits in every launch that runs it (``quantize_x_ref``'s)."""
    if INTERPRET:
        return a * b
    return tl.inline_asm_elementwise(
        asm="mul.rn.f32 $0, $1, $2;",
        constraints="=f,f,f",
        args=[a, b],
        dtype=tl.float32,
        is_pure=True,
        pack=1,
    )


@triton.jit
def _quantize(xf, NG: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 [NG * 32] -> x's even-column words [NG * 4], odd-column words [NG * 4] (int32, four
    int8 a word, column 8i + 2j in byte j of even word i), scales [NG] fp32 and offsets [NG]
    (-8 x the group's sum of its int8 values)."""
    return _quantize_groups(tl.reshape(xf, [NG, 32]), NG, INTERPRET)


@triton.jit
def _quantize_groups(xg, NG: tl.constexpr, INTERPRET: tl.constexpr):
    """``_quantize`` of x given as its groups, fp32 [NG, 32] (loaded in that shape, the compiler
    keeps a group's values in few threads: fewer shuffles for its max and sum)."""
    amax = tl.max(tl.abs(xg), axis=1)
    inv = tl.where(
        amax > 0, tl.math.div_rn(tl.full([NG], 127.0, tl.float32), tl.where(amax > 0, amax, 1.0)), 0.0
    )
    q = tl.minimum(tl.maximum(tl.floor(_mul_rn(xg, inv[:, None], INTERPRET) + 0.5), -127.0), 127.0).to(
        tl.int32
    )
    offset = -8 * tl.sum(q, axis=1)
    even, odd = tl.split(tl.reshape(q & 0xFF, [NG * 4, 4, 2]))
    shift = 8 * tl.arange(0, 4)
    xe = tl.sum(even << shift[None, :], axis=1)  # disjoint bytes: the sum is their or
    xo = tl.sum(odd << shift[None, :], axis=1)
    return xe, xo, amax * (1.0 / 127.0), offset


@triton.jit
def _quantize_x_kernel(
    x, x_row, xe, xo, xs, xb, C: tl.constexpr, BLOCK: tl.constexpr, INTERPRET: tl.constexpr
):
    """Program (p, n) quantizes columns [p BLOCK, (p + 1) BLOCK) of row n of x (``_quantize``)."""
    p = tl.program_id(0)
    n = tl.program_id(1).to(tl.int64)
    NG: tl.constexpr = BLOCK // 32
    xf = tl.load(x + n * x_row + p * BLOCK + tl.arange(0, BLOCK)).to(tl.float32)
    e, o, sc, off = _quantize(xf, NG, INTERPRET)
    wi = n * (C // 8) + p * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
    tl.store(xe + wi, e)
    tl.store(xo + wi, o)
    gi = n * (C // 32) + p * NG + tl.arange(0, NG)
    tl.store(xs + gi, sc)
    tl.store(xb + gi, off)


@triton.jit
def _w4a8_kernel(x, xe, xo, xs, xb, w, s, row_scale, out, R, C: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_K: tl.constexpr, QUANT_X: tl.constexpr, PDL: tl.constexpr,
                 INTERPRET: tl.constexpr):  # fmt: skip
    """out[r] = row_scale[r] * sum over groups g of float(q_w . q_x + xb_g) * (s_w[r, g] * xs_g),
    rows [p BLOCK_R, (p + 1) BLOCK_R) (past R clamped to the last and not stored). QUANT_X: x
    (bf16) is quantized here, each step's slice by ``_quantize``; else ``xe, xo, xs, xb`` hold it.
    The step's weights and scales are loaded before the PDL wait at the first step."""
    p = tl.program_id(0)
    r = p * BLOCK_R + tl.arange(0, BLOCK_R)
    rows = tl.minimum(r, R - 1).to(tl.int64)
    W: tl.constexpr = BLOCK_K // 8
    NG: tl.constexpr = BLOCK_K // 32
    w32 = w.to(tl.pointer_type(tl.int32))
    acc = tl.zeros([BLOCK_R, NG], tl.float32)
    for k in tl.static_range(0, C, BLOCK_K):
        wi = k // 8 + tl.arange(0, W)
        gi = k // 32 + tl.arange(0, NG)
        wd = tl.load(w32 + rows[:, None] * (C // 8) + wi[None, :])
        sw = _e4m3(tl.load(s + rows[:, None] * (C // 32) + gi[None, :]))
        if k == 0:
            _grid_sync(PDL)
        if QUANT_X:
            e, o, sx, off = _quantize(tl.load(x + k + tl.arange(0, BLOCK_K)).to(tl.float32), NG, INTERPRET)
            e, o, sx, off = e[None, :], o[None, :], sx[None, :], off[None, :]
        else:
            e, o, sx, off = _given(xe, xo, xs, xb, rows, k, W, NG)
        acc += _terms(wd, e, o, sx, off, sw, BLOCK_R, W, NG, INTERPRET)
    y = tl.sum(acc, axis=1) * tl.load(row_scale + rows)
    tl.store(out + r, y.to(out.dtype.element_ty), mask=r < R)


# --------------------------------------------------------------------------------------------
# Host side


def _interpret() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"


def _check(x: torch.Tensor, w: QWeight) -> None:
    if w.scheme != "int4" or w.group != GROUP:
        raise ValueError(
            f"w4a8: the weight must be int4 with groups of {GROUP}, got {w.scheme} group {w.group}"
        )
    if x.dim() != 1 or x.shape[0] != w.cols:
        raise ValueError(f"w4a8: x must be one row of {w.cols} columns, got {list(x.shape)}")


def xq_buffers(T: int, C: int, device) -> tuple[torch.Tensor, ...]:
    """Empty (xe, xo, xs, xb) for T rows of C columns: what ``quantize_x`` writes."""
    words = torch.empty(2, T, C // 8, dtype=torch.int32, device=device)
    return (
        words[0],
        words[1],
        torch.empty(T, C // GROUP, dtype=torch.float32, device=device),
        torch.empty(T, C // GROUP, dtype=torch.int32, device=device),
    )


def check_xq(xq, T: int, C: int, device, name: str = "xq") -> tuple[torch.Tensor, ...]:
    """``xq`` (xe, xo, xs, xb) checked as x quantized for T rows of C columns on ``device``;
    errors name the tensor (``name`` and its part)."""
    if len(xq) != 4:
        raise ValueError(f"{name} must be (even words, odd words, scales, offsets), got {len(xq)} tensors")
    parts = (("even words", C // 8, torch.int32), ("odd words", C // 8, torch.int32))
    parts += (("scales", C // GROUP, torch.float32), ("offsets", C // GROUP, torch.int32))
    check_tensors({f"{name} {n}": (t, (T, w), (d,)) for (n, w, d), t in zip(parts, xq)}, device)
    return tuple(xq)


def quantize_x(
    x: torch.Tensor, block: int | None = None, out: tuple[torch.Tensor, ...] | None = None
) -> tuple[torch.Tensor, ...]:
    """x [C] or [T, C] (rows may be strided, columns contiguous; C a multiple of 32) -> (xe, xo,
    xs, xb), each [C / 8], [C / 8], [C / 32], [C / 32] a row (a leading T for [T, C]), one launch;
    into ``out`` (``xq_buffers``' for [T, C]) when given. ``block``: columns a program (a multiple
    of 32 dividing C; default the largest power of two up to 512 that does): the values do not
    depend on it."""
    rows = x if x.dim() == 2 else x[None]
    T, C = rows.shape
    if C % GROUP or rows.stride(-1) != 1:
        raise ValueError(
            f"w4a8: x's rows must be contiguous runs of whole groups of {GROUP}, got {list(x.shape)}"
        )
    if block is None:
        block = next(b for b in (512, 256, 128, 64, 32) if C % b == 0)
    if C % block or block % GROUP:
        raise ValueError(f"w4a8: x's {C} columns are not a multiple of the quantize block {block}")
    xq = xq_buffers(T, C, x.device) if out is None else check_xq(out, T, C, x.device, "out")
    if T:
        _quantize_x_kernel[(C // block, T)](
            rows,
            rows.stride(0),
            *xq,
            C=C,
            BLOCK=block,
            INTERPRET=_interpret(),
            num_warps=4,
            enable_fp_fusion=False,
        )
    return xq if x.dim() == 2 else tuple(t[0] for t in xq)


def w4a8_gemv(
    x: torch.Tensor,
    w: QWeight,
    xq: tuple[torch.Tensor, ...] | None = None,
    out: torch.Tensor | None = None,
    config: W4A8Config = W4A8Config(),
) -> torch.Tensor:
    """y [R] = w (int4 g32) @ x (one row, quantized to int8 per 32): ``xq`` from ``quantize_x``,
    or None to quantize inside the kernel."""
    _check(x, w)
    R, C = w.rows, w.cols
    if C % config.block_k:
        raise ValueError(f"w4a8: {C} columns are not a multiple of the tile's {config.block_k}")
    out = torch.empty(R, dtype=x.dtype, device=x.device) if out is None else out
    dummy = x if xq is None else None
    xe, xo, xs, xb = xq if xq is not None else (dummy,) * 4
    grid = (triton.cdiv(R, config.block_r),)
    _w4a8_kernel[grid](
        x, xe, xo, xs, xb, w.weight, w.scales, w.row_scale, out, R, C=C, BLOCK_R=config.block_r,
        BLOCK_K=config.block_k, QUANT_X=xq is None, INTERPRET=_interpret(), num_warps=config.num_warps,
        enable_fp_fusion=False, **pdl_kwargs(x.device),
    )  # fmt: skip
    return out


# --------------------------------------------------------------------------------------------
# References (torch)


def quantize_x_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [C] -> (q int32 [C], scales fp32 [C // 32]), by ``_quantize``'s fp32 operations (x of
    more rows, C a multiple of 32: every row's, flattened)."""
    xg = x.float().reshape(-1, GROUP)
    amax = xg.abs().amax(dim=1)
    inv = torch.where(
        amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax)
    )  # not 127 * (1 / amax)
    q = torch.floor(xg * inv[:, None] + 0.5).clamp(-127, 127)
    return q.to(torch.int32).reshape(-1), amax * (1.0 / 127.0)


def quantized_values_ref(x: torch.Tensor) -> torch.Tensor:
    """x [..., C] -> fp64 [..., C]: the values x quantized to int8 per 32 columns stands for, q s,
    exactly (what a W4A8 product multiplies the weights by); ``quantize_x_ref`` takes a row's
    groups in order, so it quantizes every row at once."""
    q, s = quantize_x_ref(x)
    return (q.reshape(-1, GROUP).double() * s.double()[:, None]).reshape(x.shape)


def quantize_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """x [T, C] -> (xe, xo [T, C // 8] int32, xs [T, C // 32] fp32, xb [T, C // 32] int32), each
    row as ``quantize_x`` writes it (by ``quantize_x_ref``'s operations): the even columns' int8
    bytes four a word (column 8i + 2j in byte j of word i), the odd columns' likewise, the scales
    and -8 x each group's sum."""
    q, sx = zip(*(quantize_x_ref(row) for row in x))
    q, sx = torch.stack(q), torch.stack(sx)
    T, C = q.shape
    b = (q.long() & 0xFF).reshape(T, C // 8, 4, 2)
    shift = torch.tensor([0, 8, 16, 24], device=x.device)

    def words(v: torch.Tensor) -> torch.Tensor:  # four bytes as the int32 of those bits
        u = (v << shift).sum(dim=-1)
        return torch.where(u >= 2**31, u - 2**32, u).to(torch.int32)

    xb = (-8 * q.reshape(T, C // GROUP, GROUP).sum(dim=2)).to(torch.int32)
    return words(b[..., 0]), words(b[..., 1]), sx, xb


def w4a8_terms(x: torch.Tensor, w: QWeight) -> torch.Tensor:
    """fp64 [R, C // 32]: each group's term of what the kernel computes, the group's dot product
    of q_w and q_x exactly, times its weight scale, x's scale and the row's row_scale."""
    q, sx = quantize_x_ref(x)
    qw = int4_values(w).reshape(w.rows, -1, GROUP).long()
    dots = (qw * q.reshape(-1, GROUP).long()).sum(dim=2)  # exact
    sw = w.scales.view(torch.float8_e4m3fn).double()
    return dots.double() * sw * sx.double() * w.row_scale.double()[:, None]


def w4a8_ref(x: torch.Tensor, w: QWeight) -> torch.Tensor:
    """fp64 [R]: the kernel's result before its fp32 roundings and its final rounding to x.dtype."""
    return w4a8_terms(x, w).sum(dim=1)
