"""A sampled token chosen on the GPU, one launch a step (a torch sort before it when the request
filters by top-k or top-p): temperature, top-k, top-p, then a draw, as ``engine/sampler.py``'s
``Sampler.probs`` defines the distribution, without copying the logits to the host.

The CPU sampler copies a step's logits to the host and sorts them there: 4-25 ms a token at
Qwen3.6's 248,320 logits on a 2-core VM, more than the GPU's whole decode step, and a host
wait between steps. Here the step's graph picks the token itself, as it does a greedy one, so a
sampled request is pipelined like a greedy one (``Runner._tokens``).

One program a row, over the row's logits in tiles, in a fixed order (the bits repeat, whatever
the row count or the other rows):

- filtered (top-k or top-p): the logits sorted descending (stable, so ties keep id order). The
  top-k set is every logit >= the k-th largest (ties at the k-th stay, as the CPU sampler's mask
  keeps them); top-p drops, in that order, each logit whose probability mass before it (within
  the top-k set) reaches ``top_p``, the first always kept.
- unfiltered: the logits in id order, every one kept.
- the draw: u in [0, 1) from Philox keyed by the request's seed and the token's index in its
  sequence (its position: the step reads it from the decode step's positions), then the first
  kept logit, in the order above, whose running sum of exp((logit - max) / T) passes u times
  their total (inverse CDF). The same (seed, position, logits) give the same token on the same
  device, in a graph or not, alone or in a batch.

A row with a NaN or infinite logit is refused: its chosen logit comes back NaN (the host raises
``NonFiniteLogits``, as it does for a greedy step); else the chosen logit is the token's own.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from edgerun.kernels.bits_triton import KEY_EMPTY, _key_index, _order_key
from edgerun.kernels.launch import _grid_sync, pdl_kwargs

BLOCK = 4096  # logits a tile: a tile is loaded, scaled and summed at once (61 tiles at 248,320)
FLOATS, INTS = 2, 2  # per-row parameters: (temperature, top_p) fp32; (top_k, seed) int64


@triton.jit
def _tile_exp(src, start, m, inv_t, V, BLOCK: tl.constexpr):
    """exp((x - m) / T) of the tile at ``start`` (0 past V), and its offsets and logits."""
    o = start + tl.arange(0, BLOCK)
    x = tl.load(src + o, mask=o < V, other=float("-inf")).to(tl.float32)
    e = tl.where(o < V, tl.exp((x - m) * inv_t), 0.0)
    return o, x, e


@triton.jit
def _mass(src, m, inv_t, V, upto, BLOCK: tl.constexpr):
    """The sum of exp((x - m) / T) over positions < upto, tile by tile in order."""
    total = tl.zeros([], tl.float32)
    start = 0
    while start < upto:
        o, x, e = _tile_exp(src, start, m, inv_t, V, BLOCK)
        total += tl.sum(tl.where(o < upto, e, 0.0), axis=0)
        start += BLOCK
    return total


@triton.jit
def _sample_kernel(
    vals, order, floats, ints, counter, counter_add, uniform, token, token_stride, chosen, chosen_stride,
    logits, V, vals_stride, logits_stride,
    SORTED: tl.constexpr, HAS_U: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0).to(tl.int64)
    temperature = tl.load(floats + n * 2)
    top_p = tl.load(floats + n * 2 + 1)
    top_k = tl.load(ints + n * 2).to(tl.int32)
    inv_t = 1.0 / temperature
    lane = tl.arange(0, BLOCK)
    # a row that filters draws over its sorted logits, any other over its logits in id order,
    # whatever the call's other rows do
    own = (top_p < 1.0) | ((top_k > 0) & (top_k < V))
    own = own & SORTED
    src = logits + n * logits_stride
    if own:
        src = vals + n * vals_stride

    # the largest logit, and whether any is NaN or infinite
    bad = tl.zeros([], tl.int32)
    m = tl.full([], float("-inf"), tl.float32)
    if own:  # descending: NaN and +inf sort first, -inf last
        first = tl.load(src).to(tl.float32)
        last = tl.load(src + V - 1).to(tl.float32)
        m = first
        bad = ((first != first) | (first == float("inf")) | (last == float("-inf"))).to(tl.int32)
    else:
        start = 0
        while start < V:
            o = start + lane
            x = tl.load(src + o, mask=o < V, other=0.0).to(tl.float32)
            finite = (x == x) & (tl.abs(x) < float("inf"))
            bad += tl.sum(tl.where((o < V) & ~finite, 1, 0), axis=0)
            m = tl.maximum(m, tl.max(tl.where(o < V, x, float("-inf")), axis=0))
            start += BLOCK

    kept = V
    if own:
        if (top_k > 0) & (top_k < V):  # every logit >= the k-th (scaled, as the CPU compares them)
            kth = tl.load(src + top_k - 1).to(tl.float32) * inv_t
            kept = top_k
            start = (top_k // BLOCK) * BLOCK
            more = top_k < V
            while more & (start < V):
                o = start + lane
                x = tl.load(src + o, mask=o < V, other=float("-inf")).to(tl.float32)
                below = (o >= top_k) & (o < V) & (x * inv_t < kth)
                stop = tl.min(tl.where(below, o, V), axis=0)
                kept = tl.where(stop < V, stop, tl.maximum(kept, tl.minimum(start + BLOCK, V)))
                more = stop == V
                start += BLOCK
        if top_p < 1.0:  # drop from the first logit whose mass before it reaches top_p
            z = _mass(src, m, inv_t, V, kept, BLOCK)
            before = tl.zeros([], tl.float32)
            cut = kept
            start = 0
            while (cut == kept) & (start < kept):
                o, x, e = _tile_exp(src, start, m, inv_t, V, BLOCK)
                p = tl.where(o < kept, e / z, 0.0)
                ahead = before + tl.cumsum(p, axis=0) - p  # mass before each
                cut = tl.min(tl.where((o >= 1) & (o < kept) & (ahead >= top_p), o, kept), axis=0)
                before += tl.sum(p, axis=0)
                start += BLOCK
            kept = cut

    # the draw: the first kept logit whose running mass passes u times the kept mass
    if HAS_U:
        u = tl.load(uniform + n)
    else:
        u = tl.rand(tl.load(ints + n * 2 + 1), tl.load(counter + n) + counter_add)
    target = u * _mass(src, m, inv_t, V, kept, BLOCK)
    pick = kept - 1
    run = tl.zeros([], tl.float32)
    start = 0
    found = pick < 0
    while (found == 0) & (start < kept):
        o, x, e = _tile_exp(src, start, m, inv_t, V, BLOCK)
        e = tl.where(o < kept, e, 0.0)
        passed = (run + tl.cumsum(e, axis=0) > target) & (o < kept) & (e > 0.0)
        first = tl.min(tl.where(passed, o, kept), axis=0)
        found = first < kept
        pick = tl.where(found, first, pick)
        run += tl.sum(e, axis=0)
        start += BLOCK
    # a last positive term rounding past the total: the last kept logit with mass (u < 1)
    tok = pick.to(tl.int64)
    if SORTED:  # (else ``order`` is a stand-in of another type)
        if own:
            tok = tl.load(order + n * vals_stride + pick)
    value = tl.load(logits + n * logits_stride + tok).to(tl.float32)
    value = tl.where(bad > 0, float("nan"), value)
    tl.store(token + n * token_stride, tok)
    tl.store(chosen + n * chosen_stride, value.to(chosen.dtype.element_ty))


@triton.jit
def _greedy_meet(
    src, key, keys, tickets, token, token_stride, chosen, chosen_stride, n, CHUNKS: tl.constexpr,
    pos, host_token, host_chosen, host_stride, DIRECT: tl.constexpr,
):  # fmt: skip
    """A program's best key of its span: alone (CHUNKS 1), the row's token and logit; else the
    row's programs meet in ``keys[n]`` and the last to arrive stores them and resets the scratch."""
    if CHUNKS > 1:
        tl.atomic_max(keys + n, key)
        if tl.atomic_add(tickets + n, 1) == CHUNKS - 1:
            key = tl.atomic_xchg(keys + n, KEY_EMPTY)
            tl.atomic_xchg(tickets + n, 0)
            _greedy_store(src, _key_index(key), token, token_stride, chosen, chosen_stride, n, pos, host_token,
                          host_chosen, host_stride, DIRECT)  # fmt: skip
    else:
        _greedy_store(src, _key_index(key), token, token_stride, chosen, chosen_stride, n, pos, host_token,
                      host_chosen, host_stride, DIRECT)  # fmt: skip


@triton.jit
def _greedy_store(src, idx, token, token_stride, chosen, chosen_stride, n, pos, host_token, host_chosen,
                  host_stride, DIRECT: tl.constexpr):  # fmt: skip
    """Row n's token and its logit. DIRECT (``greedy``'s ``direct``): also into host slot p % 2
    of the pinned ``host_token`` / ``host_chosen`` (slot stride ``host_stride``), p the row's
    position in ``pos``, which then becomes p + 1 (the next step's)."""
    value = tl.load(src + idx).to(tl.float32)
    tl.store(token + n * token_stride, idx.to(tl.int64))
    tl.store(chosen + n * chosen_stride, value.to(chosen.dtype.element_ty))
    if DIRECT:
        p = tl.load(pos + n)
        at = (p % 2) * host_stride + n
        tl.store(host_token + at, idx.to(tl.int64))
        tl.store(host_chosen + at, value.to(host_chosen.dtype.element_ty))
        tl.store(pos + n, p + 1)


# greedy: a program's span of a row (tiles of BLOCK); a row longer than one span is split among
# programs that meet in one int64 key a row (``greedy``): (the logit's order - 2^31) * 2^32 +
# (2^32 - 1 - its index), so the largest key is the largest logit's first index
GREEDY_SPAN = 4 * BLOCK
# each tile reduced by one maximum over those keys instead of three fp32 / index reductions (the
# NaN, the top, its first index), and a program a tile (GREEDY_SPAN's 4 tiles run one after the
# other): the same token and logit. The greedy launch 8.5-10.4 -> 4.6-5.0 µs a step at 248,320
# logits on an H100, decode +0.2-0.3% at 40 layers (docs/benchmarks.md, 2026-12-07, forty-fourth
# session). An A/B switch read at the call; EDGERUN_GREEDY_KEYS=0 clears it at import.
GREEDY_KEYS = os.environ.get("EDGERUN_GREEDY_KEYS", "1") != "0"


@triton.jit
def _greedy_kernel(
    logits, stride, V, keys, tickets, token, token_stride, chosen, chosen_stride, pos, host_token, host_chosen,
    host_stride, CHUNKS: tl.constexpr, SPAN: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
    KEYS: tl.constexpr = False, DIRECT: tl.constexpr = False,
):  # fmt: skip
    _grid_sync(PDL)  # (reads nothing before: the logits are the previous kernel's)
    n = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    lane = tl.arange(0, BLOCK)
    src = logits + n * stride
    if KEYS:  # one maximum of the order keys a tile
        kbest = tl.full([], KEY_EMPTY, tl.int64)
        for t in range(0, SPAN, BLOCK):
            o = c * SPAN + t + lane
            inb = o < V
            x = tl.load(src + o, mask=inb, other=float("-inf")).to(tl.float32)
            kbest = tl.maximum(kbest, tl.max(tl.where(inb, _order_key(x, o), KEY_EMPTY), axis=0))
        _greedy_meet(src, kbest, keys, tickets, token, token_stride, chosen, chosen_stride, n, CHUNKS, pos,
                     host_token, host_chosen, host_stride, DIRECT)  # fmt: skip
    else:
        best = tl.full([], float("-inf"), tl.float32)
        idx = tl.full([], V, tl.int32)  # V: none yet
        nan_at = tl.full([], V, tl.int32)
        for t in range(0, SPAN, BLOCK):
            o = c * SPAN + t + lane
            inb = o < V
            x = tl.load(src + o, mask=inb, other=float("-inf")).to(tl.float32)
            isnan = (x != x) & inb
            nan_at = tl.minimum(nan_at, tl.min(tl.where(isnan, o, V), axis=0))
            x = tl.where(isnan, float("-inf"), x)
            top = tl.max(x, axis=0)
            at = tl.min(tl.where(inb & ~isnan & (x == top), o, V), axis=0)
            take = (at < V) & ((top > best) | (idx == V))  # an earlier tile keeps its ties
            best = tl.where(take, top, best)
            idx = tl.where(take, at, idx)
        # NaN is the largest (as torch.argmax takes it), its first index first
        idx = tl.where(nan_at < V, nan_at, idx)
        if CHUNKS > 1:
            # the span's best as a key whose int64 order is (logit, then the lower index): +0.0 for
            # -0.0 (they compare equal), NaN above +inf; the last program of the row to arrive reads
            # the row's largest key and resets both for the next call
            key = _order_key(tl.where(nan_at < V, float("nan"), best), idx)
            _greedy_meet(src, tl.where(idx < V, key, KEY_EMPTY), keys, tickets, token, token_stride, chosen,
                         chosen_stride, n, CHUNKS, pos, host_token, host_chosen, host_stride, DIRECT)  # fmt: skip
        else:
            _greedy_store(src, idx, token, token_stride, chosen, chosen_stride, n, pos, host_token, host_chosen,
                          host_stride, DIRECT)  # fmt: skip


def greedy_scratch(rows: int, device: torch.device) -> torch.Tensor:
    """``greedy``'s per-row key and arrival count [2, rows] (int64), as a call leaves them."""
    scratch = torch.zeros(2, rows, dtype=torch.int64, device=device)
    scratch[0].fill_(KEY_EMPTY.value)
    return scratch


def greedy(
    logits: torch.Tensor,
    token: torch.Tensor,
    chosen: torch.Tensor,
    scratch: torch.Tensor,
    span: int | None = None,
    direct: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Each row's greedy token and its logit, as ``torch.argmax`` then ``torch.gather`` give
    them, in one launch: the first index of the largest logit (NaN counts as the largest, so a
    row with a NaN picks its first NaN and its chosen logit is NaN). ``logits`` [N, V]
    (contiguous rows), ``token`` [N] int64 and ``chosen`` [N] (may be strided), ``scratch``
    from ``greedy_scratch`` (rows >= N; left as it was found: a row of more than GREEDY_SPAN
    logits is split among programs that meet there). No host sync: a call can be captured in a
    CUDA graph. Exact: a maximum and a first index, whatever the split. ``span``: a program's
    logits (a power of two; default GREEDY_SPAN), smaller in tests to split small rows.

    ``direct`` (pos int64 [N] on the device; host_token int64 [2, N] and host_chosen [2, N],
    pinned host memory, which the kernel writes through the device's mapping): each row's token
    and logit also into host slot pos[n] % 2, and pos[n] advanced by one, so that a decode step
    needs neither copies back nor a fill of its position before the next
    (``graphs.DIRECT_PICK``). The host reads a slot after an event recorded behind the launch."""
    N, V = logits.shape
    if logits.stride(1) != 1:
        raise ValueError(f"logits must have contiguous rows, got strides {logits.stride()}")
    if V >= 2**31 - 1:
        raise ValueError(f"{V} logits a row: greedy indexes them in int32")
    if token.dtype != torch.int64 or token.numel() < N or scratch.shape[1] < N:
        raise ValueError(
            f"greedy of {N} rows: token {token.dtype} {list(token.shape)}, scratch {list(scratch.shape)}"
        )
    if direct is not None:
        pos, host_token, host_chosen = direct
        if pos.dtype != torch.int64 or pos.numel() < N or pos.device != logits.device:
            raise ValueError(f"direct: pos must be int64 with {N} entries on {logits.device}")
        if (
            tuple(host_token.shape) != (2, N) or host_token.dtype != torch.int64
            or tuple(host_chosen.shape) != (2, N) or not host_token.is_contiguous() or not host_chosen.is_contiguous()
        ):  # fmt: skip
            raise ValueError(
                f"direct: host_token int64 [2, {N}] and host_chosen [2, {N}], contiguous; got "
                f"{host_token.dtype} {list(host_token.shape)}, {list(host_chosen.shape)}"
            )
        if logits.is_cuda and not (host_token.is_pinned() and host_chosen.is_pinned()):
            raise ValueError("direct: the host slots must be pinned memory (the kernel writes them)")
    else:
        pos = host_token = host_chosen = token  # placeholders, not read
    if N == 0:
        return
    span = span or (BLOCK if GREEDY_KEYS else GREEDY_SPAN)
    block = min(BLOCK, span, triton.next_power_of_2(V))
    chunks = triton.cdiv(V, span)
    if chunks == 1:
        span = triton.cdiv(V, block) * block
    _greedy_kernel[(N, chunks)](
        logits, logits.stride(0), V, scratch[0], scratch[1], token, token.stride(0), chosen, chosen.stride(0),
        pos, host_token, host_chosen, N, CHUNKS=chunks, SPAN=span, BLOCK=block,
        num_warps=8 if block >= BLOCK else 4, KEYS=GREEDY_KEYS, DIRECT=direct is not None,
        **pdl_kwargs(logits.device),
    )  # fmt: skip


def filtered(top_k: int, top_p: float) -> bool:
    """Whether a request may filter (top-k, or top-p below 1): a call with such a row sorts its
    logits first. A row draws over its sorted logits when it does filter (top-k below the
    vocabulary, or top-p below 1), else over its logits in id order, whether the call sorted
    or not: its token does not depend on the call's other rows."""
    return top_k > 0 or top_p < 1.0


class SampleBuffers:
    """The per-row parameters and the sort's output for rows of ``vocab`` logits on ``device``
    (static: a CUDA graph captures the launches that read them)."""

    def __init__(self, rows: int, vocab: int, device: torch.device, dtype: torch.dtype) -> None:
        kw = dict(device=device)
        self.floats = torch.ones(rows, FLOATS, dtype=torch.float32, **kw)
        self.ints = torch.zeros(rows, INTS, dtype=torch.int64, **kw)
        self.vals = torch.empty(rows, vocab, dtype=dtype, **kw)
        self.order = torch.empty(rows, vocab, dtype=torch.int64, **kw)

    def set(self, rows: list[tuple[float, float, int, int]]) -> None:
        """Each row's (temperature, top_p, top_k, seed): one copy each way, no sync."""
        self.floats[: len(rows)].copy_(torch.tensor([[t, p] for t, p, _, _ in rows], dtype=torch.float32))
        self.ints[: len(rows)].copy_(torch.tensor([[k, s] for _, _, k, s in rows], dtype=torch.int64))


def sample(
    logits: torch.Tensor,
    buffers: SampleBuffers,
    counter: torch.Tensor,
    counter_add: int,
    token: torch.Tensor,
    chosen: torch.Tensor,
    sort: bool,
    uniform: torch.Tensor | None = None,
) -> None:
    """Rows of ``logits`` [N, V] (contiguous rows) -> ``token`` [N] (int64, may be strided) and
    ``chosen`` [N] (the token's logit, NaN where a logit is not finite), each row by the
    parameters in ``buffers`` (``SampleBuffers.set``) and the draw keyed by its seed and
    ``counter[n] + counter_add`` (int64 [N]: the index of the token drawn). ``sort``: the rows
    filter (``filtered``); every row of a call then sorts. ``uniform`` [N] fp32 replaces the
    draw (tests). No host sync, fixed shapes: a call can be captured in a CUDA graph."""
    N, V = logits.shape
    if logits.stride(1) != 1:
        raise ValueError(f"logits must have contiguous rows, got strides {logits.stride()}")
    if N > buffers.floats.shape[0] or V != buffers.vals.shape[1]:
        raise ValueError(
            f"logits {list(logits.shape)} do not fit sample buffers of {buffers.floats.shape[0]} rows x "
            f"{buffers.vals.shape[1]}"
        )
    for name, t, dtype in (("counter", counter, torch.int64), ("token", token, torch.int64)):
        if t.dtype != dtype or t.numel() < N or t.device != logits.device:
            raise ValueError(
                f"{name} must be {dtype} with {N} entries on {logits.device}, got {t.dtype} {list(t.shape)}"
            )
    if N == 0:
        return
    vals, order = logits, logits  # order unused unless sorted
    if sort:
        vals, order = buffers.vals[:N], buffers.order[:N]
        torch.sort(logits, dim=-1, descending=True, stable=True, out=(vals, order))
    _sample_kernel[(N,)](
        vals, order, buffers.floats, buffers.ints, counter, counter_add,
        uniform if uniform is not None else buffers.floats, token, token.stride(0), chosen, chosen.stride(0),
        logits, V, vals.stride(0), logits.stride(0),
        SORTED=sort, HAS_U=uniform is not None, BLOCK=BLOCK, num_warps=8,
    )  # fmt: skip
