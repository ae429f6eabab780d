"""Tensor-core decode GEMV over a dense ``QWeight`` (plain, int8, int4): ``qgemv``'s contract
(kernels/qlinear_triton.py) for 1..16 rows of bf16 / fp16 x, each row's bits independent of the
others and of the row count. An experiment for batched decode (issue 18): not wired in.

Shape legend: N = tokens (1..M), M = 16 (the MMA's rows: x is always padded to 16), R = weight
rows, C = columns, S = R // 2 (``silu_mul``), G = columns per scale group, K = BLOCK_K columns
of a step.

A program owns BLOCK_R weight rows and streams them once, K columns a step: the step's weights
are dequantized into x's dtype and one ``tl.dot`` multiplies the [BLOCK_R, K] tile by x's
[M, K] tile (rows past the call's N read zeros), adding into fp32 accumulators [BLOCK_R, M].
A tensor-core MMA computes each output element from its own row of x and column of weights
only, so a row's bits depend neither on the other rows nor on N nor on the row's position, as
long as the kernel is the same: every call, N = 1 included, runs the one compiled kernel (N is
a runtime mask, never a constexpr nor specialised on). The order over K is the loop's, fixed by
the tile (``mma_config``, a function of the weight alone).

Exactness of the dequantized tile (the MMA multiplies x.dtype operands):

- int4: q in [-8, 7] (3 significant bits) times an e4m3 scale (at most 4 significant bits, in
  [2^-9, 448], subnormal codes included) has at most 7 significant bits and lies in
  [2^-9, 3584]: exact in bf16 (8 significant bits, fp32's range) and in fp16 (11 bits, normal
  from 2^-14 to 65504). The row's power-of-two ``row_scale`` is NOT folded in: q * e4m3 * 2^k
  stays exact in bf16 (fp32's exponent range), but q * e4m3 is a multiple of 2^-9, so in fp16
  it is exact only for k in [-15, 4] (subnormal under 2^-14, overflow over 65504), and a real
  checkpoint's row scales are about 2^-14. It multiplies the fp32 sum instead, exactly.
- int8, one scale per row: q in [-127, 127] (7 significant bits) is exact in both dtypes; the
  row's fp32 scale multiplies the fp32 sum (as ``qgemv`` does).
- int8, grouped: q * scale is rounded to x.dtype, as ``qlinear_ref`` rounds the dequantized
  weight (the same bits: fp32 product, one round to nearest-even).
- plain: the stored values, already x.dtype.

Products of two bf16 / fp16 values are exact in fp32; only the sums round (in the tensor
core's fp32 accumulation, whose alignment of the addends is the hardware's). fp32 x is refused
(an fp32 MMA is tf32, not exact): ``qgemv`` is the kernel for it.

No host syncs, no allocation but the output's, one launch (PDL where supported: the first
step's weights are read before the grid sync): a call can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from edgerun.kernels.dense_triton import DTYPE_CODE, _round
from edgerun.kernels.launch import _grid_sync, pdl_kwargs
from edgerun.kernels.moe_triton import INTERPRETED, _mma
from edgerun.kernels.qlinear_triton import (
    EPILOGUE_CODE,
    MAX_TOKENS,
    MIN_PROGRAMS,
    QUANT_CODE,
    _check,
    _check_norm,
    _finish,
    _normed,
    _pow2_divisor,
    _scales,
    _tile_rows,
    _values,
    _where,
    _words,
    unsupported,
)
from edgerun.kernels.qweight import QWeight

M = 16  # rows of x an MMA takes (tl.dot's smallest M): a call's N <= M rows, padded with zeros
MMA_DTYPES = (torch.bfloat16, torch.float16)
RMS_CHUNK = 256  # columns of x summed a step for a row's rms


@dataclass(frozen=True)
class MmaConfig:
    """Tile of ``qgemv_mma`` (fixed: it decides the reduction order, so the bits)."""

    block_r: int = 64  # weight rows per program (a power of two >= 16: an MMA's side)
    block_k: int = 128  # columns a step (a power of two >= 16; raised to a whole scale group)
    num_warps: int = 4

    def __post_init__(self) -> None:
        for name in ("block_r", "block_k", "num_warps"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"MmaConfig.{name} must be a power of two, got {v}")
        if self.block_r < 16 or self.block_k < 16:
            raise ValueError(
                f"MmaConfig block_r and block_k must be >= 16, got {self.block_r}, {self.block_k}"
            )


# Untuned first guesses, by static SASS counts for sm_90 (benchmarks/sass_mma_gemv.py: int4
# instructions per weight value fall as a program's rows share x's tile: ~17 at 16 rows, ~6.8 at
# 64, ~5.8 at 128; qgemv's ~4.8 at N = 1, ~19 at N = 8) traded against programs per SM; for
# benchmarks/bench_mma_gemv.py's --sweep to correct. MANY: lm_head-sized weights; MID: at
# least one program of 64 rows per SM (an H200 has 132); FEW: below, where latency decides.
MANY = MmaConfig(128, 64, 4)
MID = MmaConfig(64, 128, 4)
FEW = MmaConfig(16, 256, 2)
SWEEP_TILES = [
    MmaConfig(*c)
    for c in (
        (16, 256, 2),
        (16, 512, 4),
        (32, 128, 2),
        (64, 128, 4),
        (128, 64, 4),
        (128, 128, 8),
        (256, 64, 8),
    )
]  # what the benchmarks compare


def mma_config(R: int) -> MmaConfig:
    """The tile ``qgemv_mma`` uses for a weight of R rows: a fixed function, so the bits repeat."""
    if triton.cdiv(R, MANY.block_r) >= MIN_PROGRAMS:
        return MANY
    return MID if triton.cdiv(R, MID.block_r) >= MIN_PROGRAMS // 4 else FEW


def mma_unsupported(w: QWeight, dtype: torch.dtype) -> str | None:
    """Why ``qgemv_mma`` cannot compute with ``w`` and x of ``dtype``; None when it can."""
    if dtype not in MMA_DTYPES:
        return f"x dtype {dtype} is not bf16 or fp16 (an fp32 MMA is tf32, not exact: use qgemv)"
    why = unsupported(w)
    if why:
        return why
    if w.act != "bf16":
        return f"{w.act} activations (W4A8) run on qgemv only"
    if w.cols % 16:
        return f"{w.cols} columns are not a multiple of 16 (an MMA step)"
    return None


@triton.jit
def _inv_rms_rows(x, x_row, NT, eps, C: tl.constexpr, CHUNK: tl.constexpr):
    """fp32 [M]: 1 / rms of each of x's first M rows (rows >= NT read zeros). A row's sum is
    reduced within the row only, in an order the tile fixes: its bits do not depend on the
    other rows."""
    n = tl.arange(0, 16)
    ss = tl.zeros([16, CHUNK], dtype=tl.float32)
    for c0 in tl.static_range(0, C, CHUNK):
        c = c0 + tl.arange(0, CHUNK)
        xf = tl.load(
            x + n[:, None] * x_row + c[None, :], mask=(n < NT)[:, None] & (c < C)[None, :], other=0.0
        )
        xf = xf.to(tl.float32)
        ss += xf * xf
    return tl.rsqrt(tl.sum(ss, axis=1) / C + eps)


@triton.jit
def _tile(wd, scale, zero, QUANT: tl.constexpr, G: tl.constexpr, GROUPED: tl.constexpr, CODE: tl.constexpr,
          DT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """[BLOCK_R, BLOCK_K] weights of one step in x's dtype DT, exactly (module docstring): group
    scales applied, a row's own scale not. ``wd``, ``scale``: the step's words and scales."""
    if QUANT == 0:
        t = wd
    else:
        q = _values(wd, zero, QUANT)
        if GROUPED:
            q = tl.reshape(tl.reshape(q, [BLOCK_R, BLOCK_K // G, G]) * scale[:, :, None], [BLOCK_R, BLOCK_K])
            if QUANT == 1:
                q = _round(q, CODE)  # the reference's rounding (the interpreter's cast truncates)
        t = q.to(DT)
    return t


# zero: a runtime 0 (see bits_triton._field); NT: Triton would compile NT == 1 as a constant, a
# kernel of its own, and the one-row call must run the kernel every N runs
@triton.jit(do_not_specialize=["zero", "NT"])
def _qgemv_mma_kernel(
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
    NORM: tl.constexpr,
    NORM_OUT: tl.constexpr,
    CHUNK: tl.constexpr,
    NO_BLOCK: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
):
    """``_qgemv_kernel``'s arguments (kernels/qlinear_triton.py), less the token constexprs: NT
    (the call's rows, <= 16) is a runtime value, so every row count runs this one kernel."""
    ocol, wrow = _tile_rows(tl.program_id(0), ROWS, EPILOGUE, BLOCK_R)
    wd0 = _words(w, wrow, 0, C, QUANT, BLOCK_K)  # weights never change: read before the sync
    scale0 = wd0
    if GROUPED:
        scale0 = _scales(s, wrow, 0, C, G, QUANT, BLOCK_K)
    _grid_sync(PDL)

    n = tl.arange(0, 16)
    live = n < NT
    inv = tl.zeros([16], dtype=tl.float32)
    if NORM:
        inv = _inv_rms_rows(x, x_row, NT, eps, C, CHUNK)
    if NORM_OUT:  # program p stores columns [p * NO_BLOCK, (p + 1) * NO_BLOCK) of the normed rows
        c = tl.program_id(0) * NO_BLOCK + tl.arange(0, NO_BLOCK)
        m = live[:, None] & (c < C)[None, :]
        xn = tl.load(x + n[:, None] * x_row + c[None, :], mask=m, other=0.0).to(tl.float32)
        wn = tl.load(norm_w + c, mask=c < C, other=0.0).to(tl.float32)
        xn = _normed(xn, inv[:, None], wn[None, :], NORM, CODE)
        tl.store(norm_out + n[:, None] * C + c[None, :], xn.to(norm_out.dtype.element_ty), mask=m)

    acc = tl.zeros([BLOCK_R, 16], dtype=tl.float32)
    for k0 in tl.static_range(0, C, BLOCK_K):
        if k0 == 0:  # read before the grid sync
            wd = wd0
            scale = scale0
        else:
            wd = _words(w, wrow, k0, C, QUANT, BLOCK_K)
            scale = wd
            if GROUPED:
                scale = _scales(s, wrow, k0, C, G, QUANT, BLOCK_K)
        wt = _tile(wd, scale, zero, QUANT, G, GROUPED, CODE, x.dtype.element_ty, BLOCK_R, BLOCK_K)
        cols = k0 + tl.arange(0, BLOCK_K)
        xt = tl.load(x + n[:, None] * x_row + cols[None, :], mask=live[:, None], other=0.0)
        if NORM:
            wn = tl.load(norm_w + cols).to(tl.float32)
            xt = _normed(xt.to(tl.float32), inv[:, None], wn[None, :], NORM, CODE).to(wt.dtype)
        acc = _mma(wt, tl.trans(xt), acc, INTERPRET)  # [BLOCK_R, 16]: element (r, n) from row n of x only

    _finish(acc, ocol, wrow, row_scale, bias, gate, out, out_row, gate_row, ROWS, NT, 16, ROW_SCALED, HAS_BIAS,
            EPILOGUE, CODE)  # fmt: skip


def _check_mma(x, w, bias, epilogue, out, gate) -> int:
    """``qgemv``'s checks (errors name the tensor), for up to M rows; returns the output width."""
    if x.dim() != 2:
        return _check(x, w, bias, epilogue, out, gate)  # raises
    N = x.shape[0]
    if N > M:
        raise ValueError(f"x has {N} rows; qgemv_mma takes at most {M} (use a GEMM)")
    for name, t in (("out", out), ("gate", gate)):
        if t is not None and (t.dim() != 2 or t.shape[0] != N):
            raise ValueError(f"{name} must have x's {N} rows, got {_where(t)}")
    k = min(N, MAX_TOKENS)  # _check holds qgemv's own row limit: it sees the first k rows
    width = _check(
        x[:k], w, bias, epilogue, None if out is None else out[:k], None if gate is None else gate[:k]
    )
    why = mma_unsupported(w, x.dtype)
    if why:
        raise ValueError(f"qgemv_mma cannot run this: {why}")
    return width


def qgemv_mma(
    x: torch.Tensor,
    w: QWeight,
    bias: torch.Tensor | None = None,
    epilogue: str = "none",
    out: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
    norm: tuple[torch.Tensor, float, bool] | None = None,
    norm_out: torch.Tensor | None = None,
    config: MmaConfig | None = None,
) -> torch.Tensor:
    """``qgemv``'s contract (every epilogue, the RMSNorm prologue) by a tensor-core MMA: x [N, C]
    with N <= 16 rows in bf16 or fp16 (fp32 is refused: use ``qgemv``). Each row's bits are
    the one-row call's, whatever N and the row's position (module docstring). ``config``
    overrides ``mma_config`` (benchmarks): it changes the bits."""
    width = _check_mma(x, w, bias, epilogue, out, gate)
    _check_norm(x, norm, norm_out)
    N, C = x.shape
    if out is None:
        out = torch.empty(N, width, dtype=x.dtype, device=x.device)
    if N == 0:
        return out
    cfg = config or mma_config(w.rows)
    grouped = w.scheme == "int4" or (w.scheme == "int8" and w.group != C)
    block_k = _pow2_divisor(C, cfg.block_k)
    if grouped:
        block_k = max(block_k, w.group)
    block_r = cfg.block_r
    grid = (triton.cdiv(width, block_r // 2 if epilogue == "silu_mul" else block_r),)
    _qgemv_mma_kernel[grid](
        x, w.weight, w.scales if w.scales is not None else x,
        w.row_scale if w.row_scale is not None else (w.scales if w.scheme == "int8" else x),
        bias if bias is not None else x, gate if gate is not None else x, out,
        norm[0] if norm is not None else x, norm_out if norm_out is not None else x,
        norm[1] if norm is not None else 0.0,
        width, x.stride(0), out.stride(0), gate.stride(0) if gate is not None else 0, 0, N,
        C=C, QUANT=QUANT_CODE[w.scheme], G=w.group, GROUPED=grouped,
        ROW_SCALED=w.scheme == "int4" or (w.scheme == "int8" and not grouped),
        HAS_BIAS=bias is not None, EPILOGUE=EPILOGUE_CODE[epilogue], CODE=DTYPE_CODE[x.dtype],
        BLOCK_R=block_r, BLOCK_K=block_k,
        NORM=0 if norm is None else (1 if norm[2] else 2), NORM_OUT=norm_out is not None,
        CHUNK=min(RMS_CHUNK, triton.next_power_of_2(C)),
        NO_BLOCK=triton.next_power_of_2(triton.cdiv(C, grid[0])),
        INTERPRET=INTERPRETED, num_warps=cfg.num_warps, **pdl_kwargs(x.device),
    )  # fmt: skip
    return out
