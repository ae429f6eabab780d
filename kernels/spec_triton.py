"""The small steps between a device-decided speculative step's parts (engine/spec_steps.py), one
launch each instead of a dozen torch ops: on a model whose step is a few hundred launches of a
few microseconds, each launch saved is time saved.

- ``accept``: a = the leading drafts equal to the argmax of the row before them; the step's
  outputs (a, every row's argmax) for the host; the MTP head's catch-up window inputs (the
  verify rows' positions, argmaxes and final normed hidden rows).
- ``next_inputs``: after the head's window, its argmax at row a is the first draft; the next
  verify window's positions (after the kept rows) and first two tokens; the head's draft step
  inputs (position, token, hidden row a) when more drafts follow.
- ``draft_on``: after a head draft step, its token is draft j (and the next window's row j + 1);
  the next draft step's position and hidden row.

- ``Rollback``: every DeltaNet layer's conv and recurrent states become those after the kept
  row, gathered from the verify window's trails of per-row states, in one launch.
- ``mtp_input``: the MTP head's two input norms side by side, before its ``fc``.

In the first four, indices are int64, every row count is at most a few, and a hidden row is
copied with its dtype: no arithmetic on values, so nothing there changes a bit. No kernel reads
a location it (or another thread of its program) writes: a program's threads are not ordered.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _copy(dst, src, n: tl.constexpr, BLOCK: tl.constexpr):
    """``n`` values from ``src`` to ``dst``, with their dtype."""
    for s in range(0, n, BLOCK):
        o = s + tl.arange(0, BLOCK)
        tl.store(dst + o, tl.load(src + o, mask=o < n), mask=o < n)


@triton.jit
def _accept_kernel(
    v_idx, drafts, kept, out, c_idx, v_hidden, c_hidden, N, K,
    ND: tl.constexpr, NP: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    j = tl.arange(0, NP)
    rows = j < N
    best = tl.load(v_idx + 2 * N + j, mask=rows, other=0)
    d = tl.load(drafts + j, mask=j < K, other=0)
    a = tl.min(tl.where((best != d) & (j < K), j, K), axis=0)
    tl.store(kept, a)
    tl.store(out, a)
    tl.store(out + 1 + j, best, mask=rows)
    tl.store(c_idx + N + j, tl.load(v_idx + N + j, mask=rows, other=0), mask=rows)
    tl.store(c_idx + 2 * N + j, best, mask=rows)
    _copy(c_hidden, v_hidden, ND, BLOCK)


@triton.jit
def _next_kernel(
    kept, out, c_idx, c_hidden, v_idx, drafts, h_idx, h_hidden, N,
    D: tl.constexpr, MORE: tl.constexpr, NP: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    a = tl.load(kept)
    d1 = tl.load(c_idx + 2 * N + a)  # the head's argmax at row a
    tl.store(drafts, d1)
    p = tl.load(c_idx + N)  # the verify window's first position (its copy: v_idx is rewritten here)
    j = tl.arange(0, NP)
    tl.store(v_idx + N + j, p + a + 1 + j, mask=j < N)
    tl.store(v_idx + 2 * N, tl.load(out + 1 + a))
    tl.store(v_idx + 2 * N + 1, d1)
    if MORE:  # the head's one-row draft step: position p + a + 1, token d1, hidden row a
        tl.store(h_idx + 1, p + a + 1)
        tl.store(h_idx + 2, d1)
        _copy(h_hidden, c_hidden + a * D, D, BLOCK)


@triton.jit
def _draft_kernel(
    h_idx,
    h_hidden_out,
    h_hidden_in,
    drafts,
    v_idx,
    j,
    N,
    D: tl.constexpr,
    MORE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.load(h_idx + 2)  # the draft step's argmax: draft j + 1
    tl.store(drafts + j, t)
    tl.store(v_idx + 2 * N + 1 + j, t)
    if MORE:  # the next draft step runs at the position of the next window's row j
        tl.store(h_idx + 1, tl.load(v_idx + N + j))
        _copy(h_hidden_in, h_hidden_out, D, BLOCK)


@triton.jit
def _as_ptr(address, BITS: tl.constexpr):
    """An address (int64) as a pointer to BITS-bit integers (a copy moves the bits as they are)."""
    if BITS == 8:
        return address.to(tl.pointer_type(tl.int8))
    elif BITS == 16:
        return address.to(tl.pointer_type(tl.int16))
    elif BITS == 32:
        return address.to(tl.pointer_type(tl.int32))
    else:
        return address.to(tl.pointer_type(tl.int64))


@triton.jit
def _rollback_kernel(table, kept, CONV_BITS: tl.constexpr, REC_BITS: tl.constexpr, BLOCK: tl.constexpr):
    """Program (b, l): block b of layer l's two states, from row a of their trails. Table row l:
    the conv trail's and state's addresses and the state's values, then the recurrent ones'."""
    a = tl.load(kept).to(tl.int64)
    row = table + tl.program_id(1) * 6
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    trail, state, n = _as_ptr(tl.load(row), CONV_BITS), _as_ptr(tl.load(row + 1), CONV_BITS), tl.load(row + 2)
    tl.store(state + o, tl.load(trail + a * n + o, mask=o < n), mask=o < n)
    trail, state, n = (
        _as_ptr(tl.load(row + 3), REC_BITS),
        _as_ptr(tl.load(row + 4), REC_BITS),
        tl.load(row + 5),
    )
    tl.store(state + o, tl.load(trail + a * n + o, mask=o < n), mask=o < n)


@triton.jit
def _mtp_input_kernel(
    tokens, embed, hidden, w_e, w_h, out, eps, D: tl.constexpr, BLOCK_D: tl.constexpr, UNIT: tl.constexpr
):
    """Row r: [norm_e(embed[tokens[r]]), norm_h(hidden[r])] into out[r] (2D wide)."""
    r = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    m = d < D
    tok = tl.load(tokens + r)
    for half in tl.static_range(2):
        if half == 0:
            x = tl.load(embed + tok * D + d, mask=m, other=0.0)
            w = tl.load(w_e + d, mask=m, other=0.0)
        else:
            x = tl.load(hidden + r * D + d, mask=m, other=0.0)
            w = tl.load(w_h + d, mask=m, other=0.0)
        xf = x.to(tl.float32)
        y = xf * (1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / D + eps))
        if UNIT:  # scale by (1 + w) in fp32, then the cast (Qwen3.5)
            y = (y * (1.0 + w.to(tl.float32))).to(x.dtype)
        else:  # cast, then scale by w in the model's dtype (Qwen3)
            y = (w.to(tl.float32) * y.to(x.dtype).to(tl.float32)).to(x.dtype)
        tl.store(out + r * 2 * D + half * D + d, y, mask=m)


def mtp_input(tokens, embed, hidden, norm_e, norm_h, out) -> None:
    """The MTP head's ``fc`` input in one launch: for each row r, the RMS norms (``norm_e``,
    ``norm_h``: the head's ``pre_fc_norm_*`` modules, as ``kernels/dense_reference.rms_norm_ref``
    computes them, up to the order of the sum of squares) of the embedding row of ``tokens[r]``
    and of ``hidden[r]``, side by side in ``out`` [N, 2D]. Drafts only read it: a draft decides
    what is verified, never what is emitted."""
    n, dim = hidden.shape
    _mtp_input_kernel[(n,)](
        tokens, embed, hidden, norm_e.weight, norm_h.weight, out, float(norm_e.eps),
        D=dim, BLOCK_D=triton.next_power_of_2(dim), UNIT=bool(norm_e.unit_offset),
    )  # fmt: skip


def _np(n: int) -> int:
    return max(2, triton.next_power_of_2(n))


def accept(v_idx, drafts, kept, out, c_idx, v_hidden, c_hidden) -> None:
    """``v_idx`` [3, N] (the verify window's slots/positions/argmaxes), ``drafts`` [K] -> ``kept``
    [1], ``out`` [N + 1]; ``c_idx`` [3, N] and ``c_hidden`` [N, D] (the head window's inputs)."""
    n, k = v_idx.shape[1], drafts.numel()
    nd = v_hidden.numel()
    _accept_kernel[(1,)](
        v_idx, drafts, kept, out, c_idx, v_hidden, c_hidden, n, k, ND=nd, NP=_np(n), BLOCK=1024
    )


def next_inputs(kept, out, c_idx, c_hidden, v_idx, drafts, h_idx, h_hidden, more: bool) -> None:
    """See the module docstring; ``h_idx`` [3, 1] and ``h_hidden`` [1, D]: the head's draft step."""
    n, d = v_idx.shape[1], c_hidden.shape[-1]
    _next_kernel[(1,)](
        kept, out, c_idx, c_hidden, v_idx, drafts, h_idx, h_hidden, n, D=d, MORE=more, NP=_np(n), BLOCK=1024
    )


def draft_on(h_idx, h_hidden_out, h_hidden_in, drafts, v_idx, j: int, more: bool) -> None:
    """After draft step ``j`` (1-based: drafts[j] is its token); see the module docstring."""
    n, d = v_idx.shape[1], h_hidden_in.shape[-1]
    _draft_kernel[(1,)](h_idx, h_hidden_out, h_hidden_in, drafts, v_idx, j, n, D=d, MORE=more, BLOCK=1024)


ROLLBACK_BLOCK = 1024


class Rollback:
    """Every DeltaNet layer's two states (conv, recurrent: [1, ...] each) become row ``kept`` of
    their window trails ([rows, ...]) in one launch, whatever the layer count (30 at Qwen3.6's
    geometry, where a launch a layer cost 1.3 µs each): the kernel reads the tensors' addresses
    from a table made on the first call and remade only when an address changes (never during
    a graph's capture: the capture follows a first eager run over the same buffers). The table
    keeps its tensors alive. Values are copied with their bits (their dtype's width), no
    arithmetic."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._table: torch.Tensor | None = None
        self._keep: list[torch.Tensor] = []
        self._bits = (16, 32)

    def __call__(
        self,
        layers: list[tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]],
        kept: torch.Tensor,
    ) -> None:
        """``layers``: each DeltaNet layer's ((conv trail, recurrent trail), (conv, recurrent))."""
        if not layers:
            return
        key = tuple(t.data_ptr() for trails, states in layers for t in (*trails, *states))
        if key != self._key:
            self._make(layers, kept.device)
            self._key = key
        most = max(max(cs.numel(), rs.numel()) for _, (cs, rs) in layers)
        grid = (triton.cdiv(most, ROLLBACK_BLOCK), len(layers))
        _rollback_kernel[grid](
            self._table, kept, CONV_BITS=self._bits[0], REC_BITS=self._bits[1], BLOCK=ROLLBACK_BLOCK
        )

    def _make(self, layers, device) -> None:
        rows, keep, bits = [], [], set()
        for trails, states in layers:
            row = []
            for t, st in zip(trails, states):
                if not (
                    t.is_contiguous()
                    and st.is_contiguous()
                    and t[0].numel() == st.numel()
                    and t.dtype == st.dtype
                ):
                    raise ValueError(f"rollback: trail {list(t.shape)} {t.dtype} and state {list(st.shape)} {st.dtype} must be contiguous rows of one shape and dtype")  # fmt: skip
                if t.device != device or st.device != device:
                    raise ValueError(
                        f"rollback: trail and state on {t.device} / {st.device}, kept on {device}"
                    )
                row += [t.data_ptr(), st.data_ptr(), st.numel()]
                keep += [t, st]
            rows.append(row)
            bits.add((trails[0].element_size() * 8, trails[1].element_size() * 8))
        if len(bits) != 1:
            raise ValueError(
                f"rollback: every layer's states must share their dtypes, got widths {sorted(bits)}"
            )
        self._bits = bits.pop()
        self._table = torch.tensor(rows, dtype=torch.int64).to(device)
        self._keep = keep
