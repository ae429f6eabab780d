"""Tensor-core int4 GEMV over nibble planes: a prototype for a decode GEMV whose cost does not
grow with its rows (a batch step, a verify window). Not wired into the engine: benchmarks only
(benchmarks/bench_rows_gemv.py --planes), until the H200 says it is fast at one row too.

Shape legend: N = rows of x (1..16), R = weight rows, C = columns, G = columns per scale group,
K = BLOCK_K = 4 G columns a step, W = G: columns of a plane.

Why: ``qgemv`` gives each row of x one FMA per weight value, so 4 rows cost 2.4x one at the
lm_head (docs/benchmarks.md); a tensor-core MMA takes 16 rows for the price of one. The earlier
MMA kernel (kernels/qlinear_mma.py) is flat in N but 3-6x slower at one row: it decodes to fp32,
then stores the tile to shared memory to reach the MMA's operand layout, a barrier a step.

How: the weight is repacked once (``repack_planes``) so that within each step of K columns,
16-bit element i of a row holds the step's columns i, W + i, 2W + i and 3W + i in its four
nibbles. Nibble j of every element of a step is then *plane* j: W contiguous columns, one scale
group. A plane becomes the MMA's A operand by elementwise operations alone, so the compiler
builds it in the operand's registers straight from the loaded bits (no shared memory):

- one shift and one LOP3 per pair of elements (a 32-bit register): (bits >> 4j) & 0x000F000F,
  xor 0x43084308, is the bf16 pair 136 + q (0x4300 is 128.0, the sign-flipped nibble q + 8 its
  low mantissa bits);
- one bf16x2 FMA per pair: (136 + q) * s - 136 s = q s, the group's e4m3 scale s applied, exactly
  (q s has at most 8 significant bits; -136 s is exact in bf16: 136 = 17 x 2^3);
- one MMA per plane: x's W columns (B: [W, 16], rows of x padded to 16) into an fp32
  accumulator [BLOCK_R, 16].

Each output element (r, n) is summed from row n of x alone, in the MMA's fixed order, so a row's
bits do not depend on the call's other rows (checked by the tests and the bench). The products
are exact (q s and x are bf16); the sums are fp32 in the tensor core's order, not ``qgemv``'s:
the two kernels' bits differ, so a batch must run one of them for all its row counts.

Triton's CPU interpreter runs neither inline assembly nor IEEE bf16 arithmetic: there the plane
is decoded with integer operations and scaled in fp32, the same exact values.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from edgerun.kernels.bits_triton import _e4m3
from edgerun.kernels.dense_triton import _round
from edgerun.kernels.moe_triton import _mma
from edgerun.kernels.qweight import QWeight

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
M = 16  # rows of x an MMA takes: a call's N <= M rows, padded with zeros


@triton.jit
def _plane_asm(h, J: tl.constexpr):
    """Plane J of 16-bit elements ``h`` as bf16 136 + q: a shift and a LOP3 per pair of elements."""
    return tl.inline_asm_elementwise(
        asm=f"{{ .reg .b32 t; shr.b32 t, $1, {4 * J}; lop3.b32 $0, t, 0x000F000F, 0x43084308, 0x6a; }}",
        constraints="=r,r",
        args=[h],
        dtype=tl.bfloat16,
        is_pure=True,
        pack=2,
    )


@triton.jit
def _plane(h, J: tl.constexpr):
    """``_plane_asm``'s values by integer operations on each element (the interpreter's form)."""
    return (((h >> (4 * J)) & 0xF) ^ 0x4308).to(tl.bfloat16, bitcast=True)


@triton.jit(do_not_specialize=["NT"])
def _planes_kernel(
    x,
    w,
    s,
    row_scale,
    out,
    ROWS,
    NT,
    x_row,
    out_row,
    C: tl.constexpr,
    G: tl.constexpr,
    BLOCK_R: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """out[n, r] = sum_c W[r, c] x[n, c] for BLOCK_R rows r and the NT rows of x (module
    docstring). Rows past ROWS are clamped to the last (loads stay unmasked) and not stored."""
    W: tl.constexpr = G  # columns of a plane: one scale group
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rows = tl.minimum(r, ROWS - 1).to(tl.int64)
    n = tl.arange(0, 16)
    live = n < NT
    wp = w.to(tl.pointer_type(tl.int16))
    acc = tl.zeros([BLOCK_R, 16], dtype=tl.float32)
    for k0 in range(0, C, 4 * W):
        h = tl.load(wp + rows[:, None] * (C // 4) + (k0 // 4 + tl.arange(0, W))[None, :])
        for j in tl.static_range(4):
            cols = k0 + j * W + tl.arange(0, W)
            xt = tl.load(x + n[:, None] * x_row + cols[None, :], mask=live[:, None], other=0.0)
            sc = _e4m3(tl.load(s + rows * (C // G) + (k0 + j * W) // G))
            if INTERPRET:
                wt = (_plane(h, j).to(tl.float32) * sc[:, None] - 136.0 * sc[:, None]).to(tl.bfloat16)
            else:
                sb = sc.to(tl.bfloat16)[:, None]  # exact: an e4m3 value has 4 significant bits
                wt = tl.fma(_plane_asm(h, j), sb, (-136.0 * sc).to(tl.bfloat16)[:, None])  # one rounding
            acc = _mma(wt, tl.trans(xt), acc, INTERPRET)
    y = _round(
        acc * tl.load(row_scale + rows)[:, None], 1
    )  # to bf16, nearest-even (the interpreter's cast truncates)
    tok = n[None, :]
    mask = (tok < NT) & (r[:, None] < ROWS)
    tl.store(out + tok * out_row + r[:, None], y.to(out.dtype.element_ty), mask=mask)


def planes_unsupported(w: QWeight, dtype: torch.dtype) -> str | None:
    """Why ``qgemv_planes`` cannot compute with ``w`` and x of ``dtype``; None when it can."""
    if dtype != torch.bfloat16:
        return f"x dtype {dtype} is not bf16"
    if w.scheme != "int4":
        return f"scheme {w.scheme!r} is not int4"
    if w.group < 16 or w.group & (w.group - 1):
        return f"group {w.group} is not a power of two >= 16 (an MMA step)"
    if w.cols % (4 * w.group):
        return f"{w.cols} columns are not a multiple of 4 groups of {w.group}"
    return None


def repack_planes(w: QWeight) -> torch.Tensor:
    """``w``'s int4 bytes [R, C/2] (column 2b: byte b's low nibble) repacked for
    ``qgemv_planes``: within each step of 4G columns, 16-bit element i holds the step's columns
    i + jG in its nibble j (bits 4j..4j+3). One pass, on w's device; the scales do not move."""
    why = planes_unsupported(w, torch.bfloat16)
    if why:
        raise ValueError(f"qgemv_planes cannot run this weight: {why}")
    packed, R, C, G = w.weight, w.rows, w.cols, w.group
    v = torch.stack((packed & 15, packed >> 4), dim=-1).reshape(R, C)
    v = (
        v.view(R, C // (4 * G), 4, G).transpose(2, 3).reshape(R, C)
    )  # stored column 4i + j: step column jG + i
    return (v[:, 0::2] | (v[:, 1::2] << 4)).contiguous()


def qgemv_planes(
    x: torch.Tensor, w: QWeight, planes: torch.Tensor, out: torch.Tensor | None = None, block_r: int = 128,
    num_warps: int = 4,
) -> torch.Tensor:  # fmt: skip
    """x [N, C] bf16 (N <= 16, rows may be strided, columns contiguous) times ``w`` stored as
    ``planes`` (``repack_planes(w)``) -> [N, R] bf16, one launch, no epilogue (a prototype: see
    the module docstring)."""
    why = planes_unsupported(w, x.dtype)
    if why:
        raise ValueError(f"qgemv_planes cannot run this weight: {why}")
    if x.dim() != 2 or x.shape[1] != w.cols or x.stride(1) != 1 or x.shape[0] > M:
        raise ValueError(f"x must be [N <= {M}, {w.cols}] with contiguous rows, got {list(x.shape)}")
    if tuple(planes.shape) != tuple(w.weight.shape) or planes.device != x.device:
        raise ValueError(f"planes must be repack_planes(w): {list(w.weight.shape)} on {x.device}")
    N = x.shape[0]
    if out is None:
        out = torch.empty(N, w.rows, dtype=x.dtype, device=x.device)
    if N:
        _planes_kernel[(triton.cdiv(w.rows, block_r),)](
            x, planes, w.scales, w.row_scale, out, w.rows, N, x.stride(0), out.stride(0),
            C=w.cols, G=w.group, BLOCK_R=block_r, INTERPRET=INTERPRETED, num_warps=num_warps,
        )  # fmt: skip
    return out
