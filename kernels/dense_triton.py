"""Triton kernels for the dense part of a batch-1 decode step.

Shape legend: B = batch (optional leading dim), N = rows, D = width, C = conv channels
(2·Hk·Dk + Hv·Dv), K = conv taps, Hk / Hv = key / value heads, R = Hv / Hk, Dk / Dv = head dims.

- ``delta_decode``: a Gated DeltaNet layer's whole T = 1 step between the projections and
  out_proj (causal conv + SiLU, l2norms, decay, delta rule, gated RMSNorm) in three launches. A
  key head's q/k channels are shared by its R value heads, and their conv state must be read
  before it is shifted, so the conv runs first, a program per block of channels (each owns its
  channels' state), into an fp32 scratch; then a program per (batch, value head) runs the delta
  rule on a [Dk, Dv / S] slice of its fp32 state tile (Hv x S programs, S = ``delta_slices``:
  a value column's update reads only its own column, so a head's columns split among programs:
  256 programs for Qwen3.6, where a program per value head left most SMs idle, and one per key
  head more so). A split head's gated RMSNorm over all Dv then runs in a small launch of its own,
  a program per (row, value head), on the outputs the S programs stored (with one slice the
  delta rule's program runs it). The head's last program to arrive at an atomic counter ran it
  before: every program's arrival and the serial tail cost the step more than the launch (1.6-1.9%
  at 40 layers on an H100, docs/benchmarks.md, 2026-12-07). With ``trail``, a verify window: N
  consecutive tokens of one sequence in the same launches, each program stepping the rows in
  order (the per-row arithmetic the one-row kernels' own helpers), so each row, and the states
  it leaves in the trail, are the one-row call's bits. With ``act``, no conv launch: the conv ran in
  the in_proj GEMV's launch (``qgemv``'s ``conv``: the same helper, ``_conv_silu_of``, whose taps
  are summed one at a time in order, so its bits do not depend on the program's layout).

Math is fp32, rounded to the model dtype at every point the modules round (conv products, conv
sum, SiLU, sigmoid(b), the delta-rule output, the normalised value), so a kernel differs from
its reference (kernels/dense_reference.py) only by fp32 summation order and transcendental ulps,
and through those by an occasional one-ulp flip of a rounded value. Tile shapes and warps are a
fixed function of the geometry (never autotuned, never of the row count), nothing is atomic
and every reduction has a fixed order: the bits repeat.
No host syncs and no data-dependent allocation: every call can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from edgerun.kernels import launch
from edgerun.kernels.dense_reference import DeltaDims
from edgerun.kernels.launch import _grid_sync, pdl_kwargs

# dtype -> code the kernels round to (0: none needed)
DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
MAX_TILE = 1 << 15  # elements of a head's padded [Dk, Dv] state tile
# the gated norm launch lets the out_proj GEMV after it launch before its own wait, so out_proj's
# programs read their first weights while the delta rule still runs (kernels/launch.py's
# LAUNCH_FIRST; the same bits): +1.2% at 40 layers on an H100, the same tokens (the step waits
# 1.0 µs less a DeltaNet out_proj, 0.8 more a delta rule: docs/benchmarks.md, 2026-12-07,
# forty-first session); False: after its wait (an A/B switch for benchmarks/ab_decode.py, read at the call)
NORM_LAUNCH_FIRST = True
DELTA_PROGRAMS = 256  # programs a row's delta rule aims at (``delta_slices``): two for each of an H100's SMs
MIN_SLICE = 16  # value columns of a head a program takes at the least
CONV_BLOCK = 128  # conv channels per program of the step's first launch
L2NORM_EPS = tl.constexpr(1e-6)  # edgerun.models.layers.l2norm's default, which GatedDeltaNet uses


# --------------------------------------------------------------------------------------------
# Device helpers


@triton.jit
def _round(x, CODE: tl.constexpr):
    """fp32 x rounded to nearest-even in the dtype CODE names, as fp32. bf16 by bit arithmetic,
    because Triton's CPU interpreter truncates a bf16 cast where the GPU (and torch) round;
    NaN payloads are not preserved."""
    if CODE == 1:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        x = bits.to(tl.float32, bitcast=True)
    elif CODE == 2:
        x = x.to(tl.float16).to(tl.float32)
    return x


@triton.jit
def _silu(x):
    return x / (1.0 + tl.exp(-x))  # torch's form


@triton.jit
def _conv_silu(x, cs, cs_out, w, c, cmask, K: tl.constexpr, KP2: tl.constexpr, ACT: tl.constexpr):
    """SiLU of the causal depthwise conv of channels c over [conv state cs, new input x[c]]
    (``_conv_silu_of``)."""
    return _conv_silu_of(tl.load(x + c, mask=cmask, other=0.0), cs, cs_out, w, c, cmask, K, KP2, ACT)


@triton.jit
def _conv_taps(cs, w, c, cmask, K: tl.constexpr, KP2: tl.constexpr):
    """What channels c's conv reads besides its new input: the state's K - 1 older inputs and the
    K taps' weights ([channels, KP2] each), loadable before a PDL wait (the state is the layer's
    own from its previous step, the weights never change)."""
    t = tl.arange(0, KP2)[None, :]
    hist = tl.load(cs + c[:, None] * (K - 1) + t, mask=cmask[:, None] & (t < K - 1), other=0.0)
    wt = tl.load(w + c[:, None] * K + t, mask=cmask[:, None] & (t < K), other=0.0)
    return hist, wt


@triton.jit
def _conv_silu_of(new, cs, cs_out, w, c, cmask, K: tl.constexpr, KP2: tl.constexpr, ACT: tl.constexpr):
    """SiLU of the causal depthwise conv of channels c over [conv state cs, new input ``new``
    (their values in the model dtype, or fp32 holding such values: the projection's epilogue)]
    (fp32 values rounded as the module rounds them); the state shifted by the new input goes to
    cs_out (cs itself, or a verify window's trail entry). The taps are summed in their order, one
    at a time, so the bits do not depend on how the program's threads hold the channels (the
    conv launch's programs and the projection's epilogue, ``qgemv``'s ``conv``, hold them
    differently)."""
    hist, wt = _conv_taps(cs, w, c, cmask, K, KP2)
    return _conv_silu_taps(new, hist, wt, cs_out, c, cmask, K, KP2, ACT)


@triton.jit
def _conv_silu_taps(new, hist, wt, cs_out, c, cmask, K: tl.constexpr, KP2: tl.constexpr, ACT: tl.constexpr):
    """``_conv_silu_of`` on its taps as ``_conv_taps`` loaded them."""
    t = tl.arange(0, KP2)[None, :]
    window = tl.where(t == K - 1, new.to(tl.float32)[:, None], hist.to(tl.float32))  # [channels, KP2]
    prod = _round(window * wt.to(tl.float32), ACT)
    s = tl.sum(tl.where(t == 0, prod, 0.0), axis=1)  # one term and zeros: exact, whatever the order
    for i in tl.static_range(1, K):
        s += tl.sum(tl.where(t == i, prod, 0.0), axis=1)
    s = _round(s, ACT)
    # the shifted state goes where other threads read the old one: all reads first
    tl.debug_barrier()
    tl.store(
        cs_out + c[:, None] * (K - 1) + t - 1,
        window.to(cs_out.dtype.element_ty),
        mask=cmask[:, None] & (t >= 1) & (t < K),
    )
    return _round(_silu(s), ACT)


@triton.jit
def _head_tile(sv, DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr, SLICE: tl.constexpr):
    """Offsets and mask of slice ``sv`` (value columns [sv SLICE, (sv + 1) SLICE)) of a value
    head's [Dk, Dv] state tile, padded to [BLOCK_DK, SLICE]."""
    ik = tl.arange(0, BLOCK_DK)
    iv = sv * SLICE + tl.arange(0, SLICE)
    return ik[:, None] * DV + iv[None, :], (ik < DK)[:, None] & (iv < DV)[None, :]


@triton.jit
def _gated_norm(o, iv, z, nw, out, h, eps, DV: tl.constexpr, ACT: tl.constexpr, ROUND_NORM: tl.constexpr):
    """The gated RMSNorm of value head h's output o (fp32, rounded as the module rounds) over
    its columns iv (all Dv of them, padded), by the norm's weights nw (fp32, ``_norm_weights``),
    stored into its columns of ``out``."""
    mv = iv < DV
    y = _round(o * tl.rsqrt(tl.sum(o * o, axis=0) / DV + eps), ACT) * nw
    if ROUND_NORM:
        y = _round(y, ACT)
    zz = tl.load(z + h * DV + iv, mask=mv, other=0.0).to(tl.float32)
    y = _round(y * _silu(zz), ACT)
    tl.store(out + h * DV + iv, y.to(out.dtype.element_ty), mask=mv)


@triton.jit
def _norm_weights(norm_w, iv, DV: tl.constexpr):
    """The gated norm's weights at columns iv (fp32; 0 past Dv)."""
    return tl.load(norm_w + iv, mask=iv < DV, other=0.0).to(tl.float32)


@triton.jit
def _head_params(A_log, dt_bias, h):
    """Value head h's A_log and dt_bias (fp32): weights, loadable before a PDL wait."""
    return tl.load(A_log + h).to(tl.float32), tl.load(dt_bias + h).to(tl.float32)


@triton.jit
def _delta_rule(
    S,
    x,
    z,
    a,
    b,
    alog,
    dtb,
    nw,
    out,
    h,
    sv,
    eps,
    q_scale,
    NK: tl.constexpr,
    R: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    SLICE: tl.constexpr,
    ACT: tl.constexpr,
    ROUND_NORM: tl.constexpr,
):
    """One row's delta rule for slice sv of value head h (its value columns [sv SLICE, (sv +
    1) SLICE)), from that slice S of the head's fp32 state tile: x is the row's conv + SiLU
    output (fp32 [C]), z, a, b and out its rows of those, alog and dtb the head's A_log and
    dt_bias (``_head_params``); returns the slice's state after the row. The head's gated
    RMSNorm takes all its columns: with one slice (SLICE == BLOCK_DV) this program runs it, by
    the norm's weights nw (``_norm_weights`` at its columns, loaded by the caller); else
    each program stores its columns' output (rounded as the module rounds: exact in out's dtype)
    and ``_gated_norm_kernel``'s launch runs it. The R value heads of a key head each normalise
    its q and k."""
    j = h // R  # the key head
    ik = tl.arange(0, BLOCK_DK)
    mk = ik < DK
    iv = sv * SLICE + tl.arange(0, SLICE)
    mv = iv < DV
    q = tl.load(x + j * DK + ik, mask=mk, other=0.0)
    k = tl.load(x + NK * DK + j * DK + ik, mask=mk, other=0.0)
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + L2NORM_EPS) * q_scale
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + L2NORM_EPS)

    v = tl.load(x + 2 * NK * DK + h * DV + iv, mask=mv, other=0.0)
    beta = _round(1.0 / (1.0 + tl.exp(-tl.load(b + h).to(tl.float32))), ACT)
    sp = tl.load(a + h).to(tl.float32) + dtb
    e = tl.exp(sp)
    u = 1.0 + e
    log1p = tl.where(u == 1.0, e, tl.log(u) * (e / (u - 1.0)))  # accurate log1p(e)
    g = -tl.exp(alog) * tl.where(sp > 20.0, sp, log1p)  # softplus

    S = S * tl.exp(g)
    predicted = tl.sum(S * k[:, None], axis=0)
    delta = (v - predicted) * beta
    S = S + k[:, None] * delta[None, :]
    o = _round(tl.sum(S * q[:, None], axis=0), ACT)
    if SLICE == BLOCK_DV:
        _gated_norm(o, iv, z, nw, out, h, eps, DV, ACT, ROUND_NORM)
    else:  # the output as the module rounds it (exact in out's dtype); the norm's launch follows
        tl.store(out + h * DV + iv, o.to(out.dtype.element_ty), mask=mv)
    return S


# --------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _state_row(slots, bi, SLOTS: tl.constexpr):
    """The state entry of row ``bi``: ``slots[bi]`` (a pool's), or the row itself."""
    if SLOTS:
        return tl.load(slots + bi)
    return bi


@triton.jit
def _gated_norm_kernel(out, z, z_row, norm_w, eps, HVDV: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
                       ACT: tl.constexpr, ROUND_NORM: tl.constexpr, LAUNCH_FIRST: tl.constexpr,
                       EARLY_P: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """The last launch of a step whose heads split among programs: program (row, value head)
    runs the head's gated RMSNorm on the delta rule's output in ``out`` (its stored, rounded
    values), in place. LAUNCH_FIRST: the next launch (out_proj's GEMV) may launch before this
    one's wait (kernels/launch.py). EARLY_P: the norm's weights read before the wait."""
    bi = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    every = tl.arange(0, BLOCK_DV)
    if EARLY_P:
        nw = _norm_weights(norm_w, every, DV)
    _grid_sync(PDL, LAUNCH_FIRST)
    if not EARLY_P:
        nw = _norm_weights(norm_w, every, DV)
    o = tl.load(out + bi * HVDV + h * DV + every, mask=every < DV, other=0.0).to(tl.float32)
    _gated_norm(o, every, z + bi * z_row, nw, out + bi * HVDV, h, eps, DV, ACT, ROUND_NORM)


@triton.jit
def _delta_conv_kernel(
    qkv,
    qkv_row,
    conv_state,
    slots,
    conv_w,
    act,
    C: tl.constexpr,
    K: tl.constexpr,
    KP2: tl.constexpr,
    ACT: tl.constexpr,
    BLOCK_C: tl.constexpr,
    SLOTS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Launch 1 of the step: the causal conv + SiLU of BLOCK_C channels (values rounded as the
    module rounds them) into ``act`` (fp32), and their conv state shifted. A channel is one
    program's alone, so reading its history before the shift needs no other program."""
    _grid_sync(PDL)
    bi = tl.program_id(0).to(tl.int64)
    si = _state_row(slots, bi, SLOTS)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    m = c < C
    cs = conv_state + si * (C * (K - 1))
    y = _conv_silu(qkv + bi * qkv_row, cs, cs, conv_w, c, m, K, KP2, ACT)
    tl.store(act + bi * C + c, y, mask=m)


@triton.jit
def _delta_conv_window_kernel(
    qkv,
    qkv_row,
    conv_state,
    trail,
    conv_w,
    act,
    N,
    C: tl.constexpr,
    K: tl.constexpr,
    KP2: tl.constexpr,
    ACT: tl.constexpr,
    BLOCK_C: tl.constexpr,
    PDL: tl.constexpr,
):
    """Launch 1 of a verify window: N rows of one sequence (state entry 0), in order, for
    BLOCK_C channels. Row r reads the conv state row r - 1 stored (its trail entry; row 0 the
    state's) and stores its own in trail entry r, as N one-row launches would store and reload
    it; the last row's is the new state."""
    _grid_sync(PDL)
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    m = c < C
    size = C * (K - 1)
    cs = conv_state
    r = 0
    while r < N:  # a while, not a for: no software pipelining of the next row's loads
        y = _conv_silu(qkv + r * qkv_row, cs, trail + r * size, conv_w, c, m, K, KP2, ACT)
        tl.store(act + r * C + c, y, mask=m)
        tl.debug_barrier()  # the next row reads what this row's threads stored
        cs = trail + r * size
        r += 1
    t = tl.arange(0, KP2)[None, :]
    keep = c[:, None] * (K - 1) + t
    kmask = m[:, None] & (t < K - 1)
    tl.store(conv_state + keep, tl.load(cs + keep, mask=kmask), mask=kmask)


@triton.jit
def _delta_decode_kernel(
    act,
    z,
    a,
    b,
    z_row,
    a_row,
    b_row,
    A_log,
    dt_bias,
    state,
    slots,
    norm_w,
    out,
    eps,
    q_scale,
    SLOTS: tl.constexpr,
    NK: tl.constexpr,
    R: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    SLICE: tl.constexpr,
    ACT: tl.constexpr,
    ROUND_NORM: tl.constexpr,
    EARLY_P: tl.constexpr,
    PDL: tl.constexpr,
):
    """Launch 2: a value head's delta rule and gated RMSNorm, a program per (batch, value head,
    slice of its value columns). EARLY_P: the head's A_log and dt_bias read before the wait."""
    C = 2 * NK * DK + NK * R * DV
    HV = NK * R
    bi = tl.program_id(0).to(tl.int64)  # 64-bit: batch offsets of the state pass 2^31 at B > 4096
    h = tl.program_id(1)  # value head
    sv = tl.program_id(2)  # slice of its value columns
    tile, tmask = _head_tile(sv, DK, DV, BLOCK_DK, SLICE)
    # the state was last written by this layer's previous step, kernels ago: read before the sync
    s_ptr = state + (_state_row(slots, bi, SLOTS) * HV + h) * (DK * DV) + tile
    S = tl.load(s_ptr, mask=tmask, other=0.0)
    nw = 0.0  # a head in one program: its norm's weights (with EARLY_P before the wait)
    if EARLY_P:
        alog, dtb = _head_params(A_log, dt_bias, h)
        if SLICE == BLOCK_DV:
            nw = _norm_weights(norm_w, tl.arange(0, BLOCK_DV), DV)
    _grid_sync(PDL)
    if not EARLY_P:
        alog, dtb = _head_params(A_log, dt_bias, h)
        if SLICE == BLOCK_DV:
            nw = _norm_weights(norm_w, tl.arange(0, BLOCK_DV), DV)
    S = _delta_rule(
        S, act + bi * C, z + bi * z_row, a + bi * a_row, b + bi * b_row, alog, dtb, nw,
        out + bi * (HV * DV), h, sv, eps, q_scale, NK, R, DK, DV, BLOCK_DK, BLOCK_DV, SLICE,
        ACT, ROUND_NORM,
    )  # fmt: skip
    tl.store(s_ptr, S, mask=tmask)


@triton.jit
def _delta_decode_window_kernel(
    act,
    z,
    a,
    b,
    z_row,
    a_row,
    b_row,
    A_log,
    dt_bias,
    state,
    trail,
    norm_w,
    out,
    eps,
    q_scale,
    N,
    NK: tl.constexpr,
    R: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    SLICE: tl.constexpr,
    ACT: tl.constexpr,
    ROUND_NORM: tl.constexpr,
    PDL: tl.constexpr,
):
    """Launch 2 of a verify window: a program per (value head, slice of its value columns)
    steps the N rows in order from state entry 0, the fp32 state slice carried in registers (the
    one-row launches store and reload it in fp32: the same values), stored after row r in trail
    entry r and after the last row in the state (a split head's norms: the launch after)."""
    C = 2 * NK * DK + NK * R * DV
    HV = NK * R
    h = tl.program_id(0)  # value head
    sv = tl.program_id(1)  # slice of its value columns
    tile, tmask = _head_tile(sv, DK, DV, BLOCK_DK, SLICE)
    S = tl.load(state + h * (DK * DV) + tile, mask=tmask, other=0.0)  # last written kernels ago
    _grid_sync(PDL)
    alog, dtb = _head_params(A_log, dt_bias, h)
    nw = 0.0  # a head in one program: its norm's weights
    if SLICE == BLOCK_DV:
        nw = _norm_weights(norm_w, tl.arange(0, BLOCK_DV), DV)
    r = 0
    while r < N:  # (Triton's interpreter cannot range over a runtime int)
        S = _delta_rule(
            S, act + r * C, z + r * z_row, a + r * a_row, b + r * b_row, alog, dtb, nw,
            out + r * (HV * DV), h, sv, eps, q_scale, NK, R, DK, DV, BLOCK_DK, BLOCK_DV, SLICE,
            ACT, ROUND_NORM,
        )  # fmt: skip
        tl.store(trail + (r * HV + h) * (DK * DV) + tile, S, mask=tmask)
        r += 1
    tl.store(state + h * (DK * DV) + tile, S, mask=tmask)


# --------------------------------------------------------------------------------------------
# Host side


def _warps(elements: int, per_thread: int) -> int:
    """Warps for a program holding ``elements`` values, about ``per_thread`` a thread: 1 to 8."""
    return max(1, min(8, elements // (32 * per_thread)))


def delta_slices(n_v: int, dv: int) -> int:
    """Programs a value head's delta rule splits among (a power of two): about DELTA_PROGRAMS
    programs a row, each at least MIN_SLICE value columns. A function of the geometry alone, so a
    row's bits depend neither on the call's rows nor on the device."""
    most = max(1, triton.next_power_of_2(dv) // MIN_SLICE)
    want = max(1, DELTA_PROGRAMS // n_v)
    return min(most, 1 << (want.bit_length() - 1))


def unsupported_delta(dims: DeltaDims) -> str | None:
    """Why ``delta_decode`` cannot run a layer of this geometry; None when it can."""
    if min(dims.n_k, dims.n_v, dims.dk, dims.dv) < 1:
        return f"every head count and head dim must be positive, got {dims}"
    if dims.n_v % dims.n_k:
        return f"value heads ({dims.n_v}) are not a multiple of key heads ({dims.n_k})"
    if dims.kernel < 2:
        return f"conv kernel {dims.kernel} keeps no state (needs >= 2 taps)"
    tile = triton.next_power_of_2(dims.dk) * triton.next_power_of_2(dims.dv)
    if tile > MAX_TILE:
        return f"a head's padded [Dk, Dv] = [{dims.dk}, {dims.dv}] state tile ({tile}) is over {MAX_TILE}"
    return None


def _check(expected: dict, device: torch.device, strided_rows: bool = False) -> None:
    """expected: name -> (tensor, shape, allowed dtypes). Errors name the tensor. ``strided_rows``:
    row inputs [N, X] or [X] whose rows may be strided (views of one projection's output), each
    row's columns contiguous; otherwise every tensor contiguous."""
    for name, (t, shape, dtypes) in expected.items():
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"{name} must be {list(shape)}, got {list(t.shape)}")
        if t.dtype not in dtypes:
            raise ValueError(f"{name} must be {' or '.join(map(str, dtypes))}, got {t.dtype}")
        if strided_rows and t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name} must have contiguous columns")
        if not strided_rows and not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, expected {device}")


def delta_decode(
    mixed_qkv: torch.Tensor,
    z: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    conv_state: torch.Tensor,
    conv_weight: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    n_k: int,
    n_v: int,
    dk: int,
    dv: int,
    slots: torch.Tensor | None = None,
    trail: tuple[torch.Tensor, torch.Tensor] | None = None,
    act: torch.Tensor | None = None,
) -> torch.Tensor:
    """``delta_decode_ref`` in three launches: the conv, the delta rule and, where a value head
    splits among programs (``delta_slices``), the heads' gated norms (same arguments, same
    in-place updates of conv_state and state). mixed_qkv, z, a, b, conv_state and conv_weight
    share the model dtype (fp32, bf16 or fp16); A_log, dt_bias and norm_weight may be any of
    those; state is fp32.

    Rows: mixed_qkv [C] or [N, C] (z, a, b alike), each row a sequence of its own; its states
    are entry n of conv_state [N, C, K - 1] and state [N, Hv, Dk, Dv], or, with ``slots`` (int64
    [N], distinct), entry ``slots[n]`` of a pool's [B, ...]. The rows of mixed_qkv, z, a and b
    may be strided (views of one projection's output); everything else contiguous, on one
    device. A row's programs are the one-row call's: its bits do not depend on the other rows.

    ``trail`` (conv_trail [N, C, K - 1] in the model dtype, recurrent_trail [N, Hv, Dk, Dv]
    fp32): a verify window instead, the N rows one sequence's consecutive tokens on conv_state
    [1, C, K - 1] and state [1, Hv, Dk, Dv], still three launches. Row n's output and the states
    after it (in trail entry n; the last row's also in the states) are bit for bit those of N
    one-row calls in order, each followed by copies of the states into the trail.

    ``act`` (fp32 [N, C], one row without slots or trail): the conv + SiLU of mixed_qkv, already
    computed, and conv_state already shifted, by the projection's launch (``qgemv``'s ``conv``,
    whose bits are the conv launch's): no conv launch."""
    if conv_weight.dim() != 2:
        raise ValueError(f"conv_weight must be [C, K], got {list(conv_weight.shape)}")
    dims = DeltaDims(n_k, n_v, dk, dv, conv_weight.shape[1])
    why = unsupported_delta(dims)
    if why:
        raise ValueError(f"delta_decode cannot run this layer: {why}")
    if mixed_qkv.dim() not in (1, 2):
        raise ValueError(f"mixed_qkv must be [C] or [N, C], got {list(mixed_qkv.shape)}")
    dtype = mixed_qkv.dtype
    if dtype not in DTYPE_CODE:
        raise ValueError(f"mixed_qkv must be one of {list(DTYPE_CODE)}, got {dtype}")
    lead = tuple(mixed_qkv.shape[:-1])
    C, K, Hv = dims.conv_dim, dims.kernel, n_v
    batch = lead[0] if lead else 1
    pool = (conv_state.shape[0],) if slots is not None and conv_state.dim() == 3 else lead
    model, floats = (dtype,), tuple(DTYPE_CODE)
    rows = {
        "mixed_qkv": (mixed_qkv, (*lead, C), model),
        "z": (z, (*lead, Hv * dv), model),
        "a": (a, (*lead, Hv), model),
        "b": (b, (*lead, Hv), model),
    }
    if trail is not None:
        if slots is not None:
            raise ValueError(
                "trail (one sequence's verify window) and slots (a batch's rows) exclude each other"
            )
        if not lead or not batch:
            raise ValueError(f"trail needs rows: mixed_qkv [N >= 1, C], got {list(mixed_qkv.shape)}")
        if not isinstance(trail, tuple | list) or len(trail) != 2:
            raise ValueError("trail must be (conv_trail [N, C, K - 1], recurrent_trail [N, Hv, Dk, Dv])")
        pool = (1,)
    expected = {
        "conv_state": (conv_state, (*pool, C, K - 1), model),
        "conv_weight": (conv_weight, (C, K), model),
        "A_log": (A_log, (Hv,), floats),
        "dt_bias": (dt_bias, (Hv,), floats),
        "state": (state, (*pool, Hv, dk, dv), (torch.float32,)),
        "norm_weight": (norm_weight, (dv,), floats),
    }
    if slots is not None:
        if not lead:
            raise ValueError("slots need rows: mixed_qkv [N, C]")
        expected["slots"] = (slots, (batch,), (torch.int64,))
    if act is not None:
        if slots is not None or trail is not None or batch != 1:
            raise ValueError(
                "act (the conv done in the projection's launch) takes one row, without slots or trail"
            )
        expected["act"] = (act, (*lead, C), (torch.float32,))
    if trail is not None:
        expected["conv_trail"] = (trail[0], (batch, C, K - 1), model)
        expected["recurrent_trail"] = (trail[1], (batch, Hv, dk, dv), (torch.float32,))
    _check(expected, mixed_qkv.device)
    _check(rows, mixed_qkv.device, strided_rows=True)
    out = torch.empty(*lead, Hv * dv, dtype=dtype, device=mixed_qkv.device)
    if not batch:
        return out
    row = [t.stride(0) if lead else 0 for t in (mixed_qkv, z, a, b)]
    scratch = act if act is not None else torch.empty(*lead, C, dtype=torch.float32, device=mixed_qkv.device)
    blocks, kp2 = triton.cdiv(C, CONV_BLOCK), triton.next_power_of_2(K)
    bdk, bdv = triton.next_power_of_2(dk), triton.next_power_of_2(dv)
    slices = delta_slices(Hv, dv)
    # no FMA contraction (Triton's and ptxas's): contracted or not is the compiler's choice per
    # kernel, and a window's rows must be its one-row launches' bits (test_dense_cuda.py)
    pdl = pdl_kwargs(mixed_qkv.device) | {"enable_fp_fusion": False}
    delta = dict(
        NK=n_k, R=n_v // n_k, DK=dk, DV=dv, BLOCK_DK=bdk, BLOCK_DV=bdv, SLICE=bdv // slices,
        ACT=DTYPE_CODE[dtype], ROUND_NORM=norm_weight.dtype == dtype,
        num_warps=_warps(bdk * bdv // slices, 32), **pdl,
    )  # fmt: skip
    if trail is not None:
        _delta_conv_window_kernel[(blocks,)](
            mixed_qkv, row[0], conv_state, trail[0], conv_weight, scratch, batch, C=C, K=K, KP2=kp2,
            ACT=DTYPE_CODE[dtype], BLOCK_C=CONV_BLOCK, num_warps=4, **pdl,
        )  # fmt: skip
        _delta_decode_window_kernel[(Hv, slices)](
            scratch, z, a, b, row[1], row[2], row[3], A_log, dt_bias, state, trail[1], norm_weight, out,
            eps, dk**-0.5, batch, **delta,
        )  # fmt: skip
        return _split_norms(out, z, row[1], norm_weight, eps, batch, slices, dims, dtype, pdl)
    idx = slots if slots is not None else state  # placeholder when unused (never read)
    if act is None:  # conv + SiLU, rounded, into the fp32 scratch
        _delta_conv_kernel[(batch, blocks)](
            mixed_qkv, row[0], conv_state, idx, conv_weight, scratch, C=C, K=K, KP2=kp2,
            ACT=DTYPE_CODE[dtype], BLOCK_C=CONV_BLOCK, SLOTS=slots is not None, num_warps=4, **pdl,
        )  # fmt: skip
    _delta_decode_kernel[(batch, Hv, slices)](
        scratch, z, a, b, row[1], row[2], row[3], A_log, dt_bias, state, idx, norm_weight, out,
        eps, dk**-0.5, SLOTS=slots is not None, EARLY_P=launch.EARLY_PARAMS, **delta,
    )  # fmt: skip
    return _split_norms(out, z, row[1], norm_weight, eps, batch, slices, dims, dtype, pdl)


def _split_norms(out, z, z_row, norm_weight, eps, rows, slices, dims, dtype, pdl) -> torch.Tensor:
    """The gated RMSNorms of heads whose delta rule split among programs: one launch after it."""
    if slices > 1:
        bdv = triton.next_power_of_2(dims.dv)
        _gated_norm_kernel[(rows, dims.n_v)](
            out, z, z_row, norm_weight, eps, HVDV=dims.n_v * dims.dv, DV=dims.dv, BLOCK_DV=bdv,
            ACT=DTYPE_CODE[dtype], ROUND_NORM=norm_weight.dtype == dtype, LAUNCH_FIRST=NORM_LAUNCH_FIRST,
            EARLY_P=launch.EARLY_PARAMS, num_warps=_warps(bdv, 2), **pdl,
        )  # fmt: skip
    return out
