"""Tensor-core int4 GEMV over nibble planes: a decode GEMV whose cost does not grow with its rows
(a batch step, a verify window): ``qgemv``'s operations (bias, epilogues, RMSNorm prologue,
programmatic dependent launch) for an int4 weight stored as ``repack_planes``' bytes, 1..16 rows.

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

Tiles (``planes_config``): 128 weight rows a program (two m64 MMAs a plane, which halves the
x-side work a weight value costs against 64 rows: 3.73 SASS instructions a value, 4.30 with
the norm prologue, against ``qgemv``'s 4.30 at one row and 9.38 at four; benchmarks/
sass_mma_gemv.py). A weight of few rows splits its columns among programs (``split``), each
summing its part of every row; the last program of a tile to arrive (an atomic counter, reset
by it) adds the parts in a fixed order and finishes the tile, so the bits still repeat and a
row's still do not depend on the other rows. Triton's pipeliner copies the next steps' words
into shared memory while a step computes.

Where it runs: a batch daemon (``Runner._use_planes``) puts its int4 projections of at least
PLANES_MIN_VALUES weights on it, for every row count, after its start-up probe against the
reference; a batch-1 daemon keeps ``qgemv``, faster at one row. The prefill dequantizes the
repacked bytes (``dequantize_planes``: the reference's bits), so no second copy is kept.

Triton's CPU interpreter runs neither inline assembly nor IEEE bf16 arithmetic: there the plane
is decoded with integer operations and scaled in fp32, the same exact values.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from edgerun.kernels.bits_triton import _e4m3
from edgerun.kernels.dense_triton import DTYPE_CODE, _round
from edgerun.kernels.launch import _grid_sync, pdl_kwargs
from edgerun.kernels.moe_triton import _mma
from edgerun.kernels.qlinear_triton import (
    EPILOGUE_CODE,
    _check,
    _check_norm,
    _finish,
    _inv_rms,
    _normed,
    _store_normed,
    _tile_rows,
)
from edgerun.kernels.qweight import QWeight

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
M = 16  # rows of x an MMA takes: a call's N <= M rows, padded with zeros
MIN_PROGRAMS = 256  # split a weight's columns until about this many programs stream it (2 a SM)
MIN_STEPS = 2  # ... while each program keeps this many steps: the partial sums cost a round trip
REPACK_ROWS = 8192  # rows repacked at a time: the temporaries stay ~C x 8192 bytes


@dataclass(frozen=True)
class PlanesConfig:
    """Tile of ``qgemv_planes`` (fixed per weight: with ``split`` it decides the summation order,
    so the bits). ``split``: programs that share a tile's columns, each summing C / split of them;
    the last to finish adds the partial sums in a fixed order and stores (no atomics on data)."""

    block_r: int = 128  # weight rows a program (the MMA's M: 64 a warpgroup's wgmma, here two)
    num_warps: int = 4
    split: int = 1
    num_stages: int = 3  # steps of words in flight: Triton's software pipeline depth
    # steps of each row's words a program asks L2 to fetch before its grid sync (PDL: while the
    # previous kernel finishes); 0: none (an experiment, off until measured: docs/benchmarks.md;
    # the engine's tiles take EDGERUN_PLANES_PREFETCH)
    prefetch: int = 0

    def __post_init__(self) -> None:
        if self.prefetch < 0:
            raise ValueError(f"PlanesConfig.prefetch must be >= 0, got {self.prefetch}")
        if self.num_stages < 1:
            raise ValueError(f"PlanesConfig.num_stages must be >= 1, got {self.num_stages}")
        for name in ("block_r", "num_warps", "split"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"PlanesConfig.{name} must be a power of two, got {v}")
        if self.block_r < 16:
            raise ValueError(f"PlanesConfig.block_r must be >= 16 (an MMA's rows), got {self.block_r}")


def planes_config(R: int, C: int, G: int, block_r: int = 128, num_warps: int = 4) -> PlanesConfig:
    """The tile a weight of this shape gets: ``block_r`` rows a program, the columns split in two
    while fewer than MIN_PROGRAMS programs run (a weight of few rows is otherwise streamed by few
    SMs) and each keeps MIN_STEPS steps. A fixed function of the shape, so the bits repeat."""
    tiles, steps, split = triton.cdiv(R, block_r), C // (4 * G), 1
    while tiles * split < MIN_PROGRAMS and steps // (2 * split) >= MIN_STEPS and steps % (2 * split) == 0:
        split *= 2
    return PlanesConfig(block_r, num_warps, split, prefetch=prefetch_steps())


def prefetch_steps() -> int:
    """``PlanesConfig.prefetch`` for the engine's tiles: ``EDGERUN_PLANES_PREFETCH`` (steps, a
    measurement switch like ``EDGERUN_PDL``: an L2 hint, the bits do not depend on it), else 0."""
    raw = os.environ.get("EDGERUN_PLANES_PREFETCH", "0")
    if not raw.isdigit():
        raise ValueError(f"EDGERUN_PLANES_PREFETCH must be a number of steps (0, 2, 4, ...), got {raw!r}")
    return int(raw)


# --------------------------------------------------------------------------------------------
# Device helpers


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


@triton.jit
def _plane_values(h, J: tl.constexpr, sw, INTERPRET: tl.constexpr):
    """bf16 [BLOCK_R, W]: plane J of a step's elements ``h``, q s exactly, s the e4m3 scale of
    its group (byte J of the step's scale word ``sw`` [BLOCK_R])."""
    sc = _e4m3((sw >> (8 * J)) & 0xFF)
    if INTERPRET:
        return (_plane(h, J).to(tl.float32) * sc[:, None] - 136.0 * sc[:, None]).to(tl.bfloat16)
    sb = sc.to(tl.bfloat16)[:, None]  # exact: an e4m3 value has 4 significant bits
    return tl.fma(_plane_asm(h, J), sb, (-136.0 * sc).to(tl.bfloat16)[:, None])  # one rounding, exact


@triton.jit
def _prefetch_l2(ptrs):
    """Ask L2 to fetch the line at each pointer (no result: a hint; the interpreter skips it)."""
    tl.inline_asm_elementwise(
        asm="prefetch.global.L2 [$1]; mov.u32 $0, 0;",
        constraints="=r,l",
        args=[ptrs],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _normed_bf16(xf, inv, wf, NORM: tl.constexpr, INTERPRET: tl.constexpr):
    """``_normed``'s values (bf16 x) as bf16: on the GPU a cast rounds to nearest-even as
    ``_round`` does, in one instruction instead of its integer steps (the interpreter's cast
    truncates, so there ``_round`` runs)."""
    if INTERPRET:
        return _normed(xf, inv, wf, NORM, 1).to(tl.bfloat16)
    y = xf * inv
    if NORM == 1:
        return (y * (1.0 + wf)).to(tl.bfloat16)
    return (y.to(tl.bfloat16).to(tl.float32) * wf).to(tl.bfloat16)


@triton.jit(do_not_specialize=["ROWS", "NT"])
def _planes_kernel(
    x,
    w,
    s,
    row_scale,
    bias,
    gate,
    out,
    norm_w,
    norm_out,
    part,
    count,
    eps,
    ROWS,
    NT,
    x_row,
    out_row,
    gate_row,
    C: tl.constexpr,
    G: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EPILOGUE: tl.constexpr,
    NORM: tl.constexpr,
    NORM_OUT: tl.constexpr,
    NO_BLOCK: tl.constexpr,
    BLOCK_C: tl.constexpr,
    CODE: tl.constexpr,
    PREFETCH: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (p, k): BLOCK_R weight rows (``_tile_rows``) times the NT rows of x over columns
    [k C / SPLIT, (k + 1) C / SPLIT), one step of 4 G columns at a time (Triton's pipeliner
    copies the words of the next num_stages - 1 steps into shared memory meanwhile). SPLIT > 1: the partial sums go to ``part``, and the
    program that arrives last at ``count[p]`` sums them in order k = 0..SPLIT-1, resets the
    counter and finishes the tile. NORM / NORM_OUT / PDL: as in ``_qgemv_kernel``."""
    W: tl.constexpr = G  # columns of a plane: one scale group
    STEP: tl.constexpr = 4 * G
    SPAN: tl.constexpr = C // SPLIT
    ocol, wrow = _tile_rows(tl.program_id(0), ROWS, EPILOGUE, BLOCK_R)
    k_lo = tl.program_id(1) * SPAN
    n = tl.arange(0, 16)
    live = n < NT
    hp = w.to(tl.pointer_type(tl.int16)) + wrow[:, None] * (C // 4) + tl.arange(0, W)[None, :]
    sp = s.to(tl.pointer_type(tl.int32)) + wrow * (C // STEP)  # a step's 4 scale bytes: one word
    if PREFETCH > 0:  # weights never change: safe before the sync
        row0 = w + wrow * (C // 2) + k_lo // 2  # a row's steps are contiguous: 2 G bytes each
        PRE: tl.constexpr = PREFETCH if PREFETCH < SPAN // STEP else SPAN // STEP
        for st in tl.static_range(0, PRE, 2):  # a 128-byte line: 2 steps
            _prefetch_l2(row0 + st * 2 * G)
    _grid_sync(PDL)
    if NORM_OUT:
        if tl.program_id(1) == 0:  # the first column part of each tile
            _store_normed(
                tl.program_id(0), x, x_row, norm_w, norm_out, eps, NT, 16, C, NO_BLOCK, BLOCK_C, NORM, CODE
            )
    inv = tl.zeros([16], dtype=tl.float32)
    if NORM:
        for m in tl.static_range(16):
            if m < NT:  # a branch: a call's rows cost what they are
                inv = tl.where(n == m, _inv_rms(x, x_row, m, NT, eps, C, BLOCK_C), inv)
    acc = tl.zeros([BLOCK_R, 16], dtype=tl.float32)
    for kk in range(0, SPAN, STEP):  # Triton's pipeliner reads h num_stages - 1 steps ahead
        k0 = k_lo + kk
        h = tl.load(hp + k0 // 4)
        sw = tl.load(sp + k0 // STEP)
        for j in tl.static_range(4):
            cols = k0 + j * W + tl.arange(0, W)
            xt = tl.load(x + n[:, None] * x_row + cols[None, :], mask=live[:, None], other=0.0)
            if NORM:
                wn = tl.load(norm_w + cols).to(tl.float32)
                xt = _normed_bf16(xt.to(tl.float32), inv[:, None], wn[None, :], NORM, INTERPRET)
            acc = _mma(_plane_values(h, j, sw, INTERPRET), tl.trans(xt), acc, INTERPRET)
    if SPLIT == 1:
        _finish(acc, ocol, wrow, row_scale, bias, gate, out, out_row, gate_row, ROWS, NT, 16, True, HAS_BIAS,
                EPILOGUE, CODE)  # fmt: skip
    else:
        p = tl.program_id(0)
        tiles = tl.num_programs(0)
        at = n[None, :] * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]  # [SPLIT, tiles, NT, BLOCK_R] fp32
        tl.store(part + (tl.program_id(1) * tiles + p) * NT * BLOCK_R + at, acc, mask=live[None, :])
        tl.debug_barrier()  # every thread's partial sums stored before the arrival is released
        if tl.atomic_add(count + p, 1, sem="acq_rel") == SPLIT - 1:
            acc = tl.zeros([BLOCK_R, 16], dtype=tl.float32)
            for k in tl.static_range(SPLIT):  # a fixed order, whichever program came last
                src = part + (k * tiles + p) * NT * BLOCK_R + at
                acc += tl.load(src, mask=live[None, :], other=0.0, cache_modifier=".cg")
            tl.store(count + p, 0)  # ready for the next call
            _finish(acc, ocol, wrow, row_scale, bias, gate, out, out_row, gate_row, ROWS, NT, 16, True, HAS_BIAS,
                    EPILOGUE, CODE)  # fmt: skip


@triton.jit(do_not_specialize=["R"])
def _dequant_planes_kernel(w, s, rs, out, R, C: tl.constexpr, G: tl.constexpr, BLOCK_R: tl.constexpr,
                           CODE: tl.constexpr):  # fmt: skip
    """One step (4 G columns) of BLOCK_R rows of a planes weight's exact values, q (s row_scale)
    rounded once to the output dtype: ``dequantize_weight``'s bits."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rows = tl.minimum(r, R - 1).to(tl.int64)
    k0 = tl.program_id(1) * 4 * G
    h = tl.load(
        w.to(tl.pointer_type(tl.int16)) + rows[:, None] * (C // 4) + (k0 // 4 + tl.arange(0, G))[None, :]
    )
    sw = tl.load(s.to(tl.pointer_type(tl.int32)) + rows * (C // (4 * G)) + k0 // (4 * G))
    rsc = tl.load(rs + rows)
    for j in tl.static_range(4):
        q = _plane(h, j).to(tl.float32) - 136.0  # the kernel's decode of plane j, exact
        step = _e4m3((sw >> (8 * j)) & 0xFF) * rsc
        cols = k0 + j * G + tl.arange(0, G)
        vals = _round(q * step[:, None], CODE)
        tl.store(
            out + rows[:, None] * C + cols[None, :], vals.to(out.dtype.element_ty), mask=(r < R)[:, None]
        )


# --------------------------------------------------------------------------------------------
# Host side


def planes_unsupported(w: QWeight, dtype: torch.dtype) -> str | None:
    """Why ``qgemv_planes`` cannot compute with ``w`` and x of ``dtype``; None when it can."""
    if dtype != torch.bfloat16:
        return f"x dtype {dtype} is not bf16"
    if w.act != "bf16":
        return f"{w.act} activations (W4A8) run on qgemv only"
    if w.scheme != "int4":
        return f"scheme {w.scheme!r} is not int4"
    if w.group < 16 or w.group & (w.group - 1):
        return f"group {w.group} is not a power of two >= 16 (an MMA step)"
    if w.cols % (4 * w.group):
        return f"{w.cols} columns are not a multiple of 4 groups of {w.group}"
    for name, t in (("weight", w.weight), ("scales", w.scales)):
        if t.data_ptr() % 4:
            return f"{name} does not start on a 4-byte boundary (read as words)"
    return None


def _planes_order(v: torch.Tensor, G: int, inverse: bool) -> torch.Tensor:
    """Nibble values [r, C] (column order) to stored order (column 4i + j of a step: its column
    jG + i), or back."""
    r, C = v.shape
    shape = (r, C // (4 * G), G, 4) if inverse else (r, C // (4 * G), 4, G)
    return v.view(shape).transpose(2, 3).reshape(r, C)


def _repack(packed: torch.Tensor, G: int, inverse: bool = False) -> torch.Tensor:
    out = torch.empty_like(packed)
    for r0 in range(0, packed.shape[0], REPACK_ROWS):
        p = packed[r0 : r0 + REPACK_ROWS]
        v = _planes_order(torch.stack((p & 15, p >> 4), dim=-1).reshape(p.shape[0], -1), G, inverse)
        out[r0 : r0 + REPACK_ROWS] = v[:, 0::2] | (v[:, 1::2] << 4)
    return out


def repack_planes(w: QWeight) -> torch.Tensor:
    """``w``'s int4 bytes [R, C/2] (column 2b: byte b's low nibble) repacked for
    ``qgemv_planes``: within each step of 4G columns, 16-bit element i holds the step's columns
    i + jG in its nibble j (bits 4j..4j+3). On w's device, REPACK_ROWS rows at a time; the
    scales do not move."""
    why = planes_unsupported(w, torch.bfloat16)
    if why:
        raise ValueError(f"qgemv_planes cannot run this weight: {why}")
    return _repack(w.weight, w.group)


def planes_weight(w: QWeight) -> QWeight:
    """``w`` with its bytes repacked (``repack_planes``): the weight ``qgemv_planes`` takes."""
    return QWeight("int4", repack_planes(w), w.scales, w.row_scale, w.group)


def unpack_planes(w: QWeight) -> torch.Tensor:
    """``repack_planes``' inverse: a planes weight's bytes back in ``QWeight``'s int4 order."""
    return _repack(w.weight, w.group, inverse=True)


def planes_counters(w: QWeight, device: torch.device | str) -> torch.Tensor:
    """The arrival counters a split call of ``w`` needs (``qgemv_planes``' ``count``): one per
    tile of the smallest, each back at 0 when its call returns. Allocate once, outside graph
    capture, and use for the calls of one stream."""
    return torch.zeros(triton.cdiv(w.rows, 16), dtype=torch.int32, device=device)


def qgemv_planes(
    x: torch.Tensor,
    w: QWeight,
    bias: torch.Tensor | None = None,
    epilogue: str = "none",
    out: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
    norm: tuple[torch.Tensor, float, bool] | None = None,
    norm_out: torch.Tensor | None = None,
    config: PlanesConfig | None = None,
    count: torch.Tensor | None = None,
) -> torch.Tensor:
    """``qgemv`` for an int4 weight whose bytes are ``repack_planes``' (``w.weight``), x [N, C]
    bf16 with N <= 16 (rows may be strided, columns contiguous), in one launch: the same
    arguments and outputs, other bits (module docstring). ``count``: ``planes_counters(w)``,
    needed when the config splits the columns."""
    why = planes_unsupported(w, x.dtype)
    if why:
        raise ValueError(f"qgemv_planes cannot run this weight: {why}")
    width = _check(x, w, bias, epilogue, out, gate, max_rows=M)
    _check_norm(x, norm, norm_out)
    N, C = x.shape
    if out is None:
        out = torch.empty(N, width, dtype=x.dtype, device=x.device)
    if N == 0:
        return out
    cfg = config or planes_config(w.rows, C, w.group)
    if C % (cfg.split * 4 * w.group):
        raise ValueError(f"split {cfg.split} does not cut {C} columns into whole steps of {4 * w.group}")
    tiles = triton.cdiv(width, cfg.block_r // 2 if epilogue == "silu_mul" else cfg.block_r)
    part = x
    if cfg.split > 1:
        if count is None or count.dtype != torch.int32 or count.device != x.device or count.numel() < tiles:
            raise ValueError(f"a split call needs count: int32 [>= {tiles}] on {x.device} (planes_counters)")
        part = torch.empty(cfg.split * tiles * N * cfg.block_r, dtype=torch.float32, device=x.device)
    _planes_kernel[(tiles, cfg.split)](
        x, w.weight, w.scales, w.row_scale, bias if bias is not None else x, gate if gate is not None else x,
        out, norm[0] if norm is not None else x, norm_out if norm_out is not None else x, part,
        count if count is not None else x, norm[1] if norm is not None else 0.0,
        width, N, x.stride(0), out.stride(0), gate.stride(0) if gate is not None else 0,
        C=C, G=w.group, BLOCK_R=cfg.block_r, SPLIT=cfg.split, HAS_BIAS=bias is not None,
        EPILOGUE=EPILOGUE_CODE[epilogue], NORM=0 if norm is None else (1 if norm[2] else 2),
        NORM_OUT=norm_out is not None, NO_BLOCK=triton.next_power_of_2(triton.cdiv(C, tiles)),
        BLOCK_C=triton.next_power_of_2(C), CODE=DTYPE_CODE[x.dtype], INTERPRET=INTERPRETED,
        PREFETCH=0 if INTERPRETED else cfg.prefetch,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_kwargs(x.device),
    )  # fmt: skip
    return out


def dequantize_planes(w: QWeight, dtype: torch.dtype) -> torch.Tensor:
    """A planes weight's exact values [R, C] rounded to ``dtype`` in one launch: the bits of
    ``qlinear_triton.dequantize_weight`` of the weight before ``repack_planes`` (prefill)."""
    why = planes_unsupported(w, torch.bfloat16)
    if why:
        raise ValueError(f"cannot dequantize this planes weight: {why}")
    R, C, G = w.rows, w.cols, w.group
    out = torch.empty(R, C, dtype=dtype, device=w.weight.device)
    _dequant_planes_kernel[(triton.cdiv(R, 16), C // (4 * G))](
        w.weight, w.scales, w.row_scale, out, R, C=C, G=G, BLOCK_R=16, CODE=DTYPE_CODE[dtype], num_warps=4
    )
    return out
