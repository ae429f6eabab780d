"""Layers shared by the architectures, with the decode state they keep between steps.

Shape legend: B = batch, T = new tokens, S = cached positions, D = hidden, H = heads,
Hk = kv heads, Dh = head dim, E = experts, A = active experts per token (top_k), I = expert width.
Numerics follow the Hugging Face reference exactly where it decides rounding (norm order,
fp32 router softmax, fp32 delta rule), so greedy tokens match it.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from edgerun.kernels.decode_reference import apply_rotary_ref as apply_rotary
from edgerun.kernels.decode_reference import rope_inv_freq, rotary_ref
from edgerun.kernels.dense_reference import delta_rule_chunked, delta_rule_recurrent, l2norm, rms_norm_ref
from edgerun.kernels.moe_reference import combine_experts
from edgerun.kernels.qweight import QWeight, concat_rows
from edgerun.kernels.scratch import SCRATCH_SET
from edgerun.models.args import ModelArgs

# set within a speculative verify window or a batch's step (``exact_rows``): every row computed
# as a one-row step
EXACT_ROWS: ContextVar[bool] = ContextVar("edgerun_exact_rows", default=False)


@contextmanager
def exact_rows():
    """Within the block, a projection's rows are each computed as a one-row call computes them
    (``QLinear._reference``: the CPU's BLAS one row at a time; the GEMV's rows by programs of
    their own, ``qgemv``'s ``alone``): a verify window's or a batch step's rows equal the
    one-row steps' bit for bit."""
    token = EXACT_ROWS.set(True)
    try:
        yield
    finally:
        EXACT_ROWS.reset(token)


# set over the MTP head's windows of rows: their drafts decide what is verified, never what is
# emitted, so a projection of a few rows takes the GEMV whatever its scheme (a plain weight's
# rows too, which GEMV_ROWS keeps to 2 elsewhere), its rows in one pass
DRAFT_ROWS: ContextVar[bool] = ContextVar("edgerun_draft_rows", default=False)


@contextmanager
def draft_rows():
    """Within the block, a projection of at most MAX_GEMV_ROWS rows runs the GEMV (``DRAFT_ROWS``)."""
    token = DRAFT_ROWS.set(True)
    try:
        yield
    finally:
        DRAFT_ROWS.reset(token)


# set within a speculative verify window only (not a batch's step): a streamed layer counts the
# union of the window's experts (``edgerun_verify_window_experts_total``)
VERIFY_WINDOW: ContextVar[bool] = ContextVar("edgerun_verify_window", default=False)


@contextmanager
def verify_window():
    """``exact_rows``, for a speculative verify window's rows (counted as one)."""
    token = VERIFY_WINDOW.set(True)
    try:
        with exact_rows():
            yield
    finally:
        VERIFY_WINDOW.reset(token)


# at or below this many rows of input, a QLinear whose kernel was selected runs the Triton GEMV:
# for a plain weight cuBLAS is faster from 3 rows on; for int8 / int4 the GEMV still beats an exact
# dequantization then cuBLAS at 8 (benchmarks/bench_dense_gemv.py on an H200, docs/benchmarks.md)
GEMV_ROWS = {"plain": 2, "int8": 8, "int4": 8}
MAX_GEMV_ROWS = 8  # rows the GEMV takes at most (kernels/qlinear_triton.MAX_TOKENS; no Triton import here)


def _frozen(t: torch.Tensor | None) -> nn.Parameter | None:
    if t is None or isinstance(t, nn.Parameter):
        return t
    return nn.Parameter(t, requires_grad=False)


class QLinear(nn.Module):
    """A linear layer over a weight as the bundle stores it (``kernels/qweight.py``: plain, int8
    or int4), optionally with an epilogue fused into the same pass (``kernels/qlinear_reference``
    gives each one's torch semantics):

    - ``none``: y = x W^T + b;
    - ``silu_mul``: SiLU(gate) * up, the weight holding gate rows then up rows (an MLP's first half);
    - ``residual``: ``out.add_(y)``, ``out`` being the residual stream;
    - ``gated``: sigmoid(``gate``) * y (the shared expert's output gate).

    ``gemv`` is set by the engine once the Triton GEMV passed its probe on the device
    (``Model.use_kernels``); inputs of at most GEMV_ROWS[scheme] rows then run it, anything else (and
    every input with ``gemv`` off) the torch reference, which dequantizes the weight exactly and
    calls ``F.linear`` (on CUDA with ``gemv`` on, the dequantization is one Triton launch,
    ``qlinear_triton.dequantize_weight``, with the same bits). Parameters keep the stored bytes; ``row_scale`` and int8 ``scales`` stay
    fp32 whatever the model dtype."""

    def __init__(self, w: QWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        w.check()
        self.scheme, self.group = w.scheme, w.group
        self.in_features, self.out_features = w.cols, w.rows
        self.weight = _frozen(w.weight)
        self.scales = _frozen(w.scales)
        self.row_scale = _frozen(w.row_scale)
        self.bias = _frozen(bias)
        self.gemv = False
        # within exact_rows: one GEMV for all rows (each row's bits the one-row call's: its own
        # accumulators, checked on the device by the batch's start-up probe) rather than each row
        # by programs of its own, reading the weight again (``Model.share_rows``)
        self.shared_rows = False
        self.cpu = None  # the stored bytes packed for the CPU kernels (kernels/qlinear_cpu.py), when chosen
        # the tensor-core GEMV (kernels/qlinear_planes.py) when chosen (``use_planes``): then
        # ``weight`` holds the bytes repacked in nibble planes, and these are its tile and counters
        self.planes = None
        self.planes_count: torch.Tensor | None = None
        self.lane_counts: dict[int, torch.Tensor] = {}  # scratch sets 1.. (kernels/scratch.py)
        # qgemv's tile for this weight where it is not the default (``qlinear_triton.gemv_config``),
        # in every call: a shared expert's down projection runs the expert kernel's warps, so that
        # its one-token step can ride in that kernel's launch (``moe_triton.shared_down_tile``)
        self.tile = None
        self.act = "bf16"  # int8: W4A8 in the decode GEMV (``Model.use_int8_activations``)

    @classmethod
    def of(cls, m: nn.Module) -> QLinear:
        """``m`` as a QLinear (an ``nn.Linear`` becomes a plain one over the same parameters)."""
        if isinstance(m, QLinear):
            return m
        return cls(QWeight("plain", m.weight), m.bias)

    @classmethod
    def concat(cls, mods: list[nn.Module]) -> QLinear:
        """One QLinear whose outputs are ``mods``' outputs, concatenated: projections that read the
        same input, run as one GEMV."""
        parts = [cls.of(m) for m in mods]
        bias = None
        if any(p.bias is not None for p in parts):
            ref = next(p.bias for p in parts if p.bias is not None)
            bias = torch.cat([p.bias if p.bias is not None else ref.new_zeros(p.out_features) for p in parts])
        return cls(concat_rows([p.qweight() for p in parts]), None if bias is None else bias.detach())

    def qweight(self) -> QWeight:
        """The weight as stored; with ``planes``, its bytes are in nibble-plane order."""
        return QWeight(self.scheme, self.weight, self.scales, self.row_scale, self.group, self.act)

    def nbytes(self) -> int:
        """The bytes a one-row call reads of its weight: the stored weight and its scales."""
        return sum(t.nbytes for t in (self.weight, self.scales, self.row_scale) if t is not None)

    def use_planes(self, on: bool) -> None:
        """Run decode-sized inputs on the tensor-core GEMV (``qgemv_planes``, whose cost hardly
        grows with the rows: a batch's steps) or not: the weight's bytes are repacked in place
        (no second copy), or back. Its bits differ from ``qgemv``'s, so a batch that uses it
        uses it for every row count, one-row steps included. Nothing to change imports nothing:
        a machine without Triton (the CPU demo) turns the planes off at load."""
        if on == (self.planes is not None):
            return
        from edgerun.kernels import qlinear_planes as P

        w = self.qweight()
        if on:
            why = P.planes_unsupported(w, torch.bfloat16)
            if why:
                raise ValueError(f"{self.extra_repr()}: the tensor-core GEMV cannot run it: {why}")
            self.weight = _frozen(P.repack_planes(w))
            self.planes = P.planes_config(w.rows, w.cols, w.group)
            self.planes_count = P.planes_counters(w, w.weight.device)
        else:
            self.weight = _frozen(P.unpack_planes(w))
            self.planes, self.planes_count = None, None
        self.lane_counts = {}

    def forward(
        self,
        x: torch.Tensor,
        epilogue: str = "none",
        out: torch.Tensor | None = None,
        gate: torch.Tensor | None = None,
        norm: RMSNorm | None = None,
        norm_out: torch.Tensor | None = None,
        also: tuple[QLinear, str, torch.Tensor] | None = None,
        conv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        norm_q_out: tuple[torch.Tensor, ...] | None = None,
    ) -> torch.Tensor:
        """``norm``: x is that RMSNorm of x (in the GEMV's prologue: one launch, not two), also
        written into ``norm_out`` when given, and quantized to int8 per 32 columns into
        ``norm_q_out`` (``qlinear_w4a8.xq_buffers``; the experts' int8 x) when given: by the
        GEMV's launch where it runs ``qgemv``, else by ``quantize_x`` on ``norm_out`` after it.
        x [N, C] for the epilogues, the norm and ``out``. ``also`` (other, its epilogue, its
        out; where :meth:`pairs_with`): the other projection of the same (normalised) x in the
        same launch, its bits those of its own. ``conv`` (conv_state, conv_weight, act; where
        :meth:`folds_conv`): a DeltaNet layer's conv + SiLU of the output's first channels in the
        launch's epilogue (``qgemv``'s ``conv``)."""
        nrm = None if norm is None else (norm.weight, norm.eps, norm.unit_offset)
        exact, draft = EXACT_ROWS.get(), DRAFT_ROWS.get()
        limit = self._gemv_limit()
        on_qgemv = self.gemv and x.dim() == 2 and x.shape[0] <= limit and self.planes is None
        if norm_q_out is not None and not on_qgemv:
            if norm_out is None:
                raise ValueError(f"{self.extra_repr()}: norm_q_out quantizes norm_out: give both")
            from edgerun.kernels.qlinear_w4a8 import quantize_x

            y = self(x, epilogue, out, gate, norm, norm_out, also, conv)
            quantize_x(norm_out, out=norm_q_out)
            return y
        if also is not None and not self.pairs_with(also[0], x):
            raise ValueError(f"{self.extra_repr()} and {also[0].extra_repr()} do not run in one launch here")
        if conv is not None and not self.folds_conv(x, conv[1].shape[0]):
            raise ValueError(f"{self.extra_repr()}: the conv does not run in this projection's launch here")
        few = x.dim() > 2 and x.numel() // x.shape[-1] <= limit
        if self.gemv and few and out is None and gate is None and norm is None:
            # a few rows with leading dims (a prompt's last row for the lm_head: [1, 1, D]) are a
            # GEMV too, not a dequantized copy of the whole weight (1 GB for Qwen3.6's lm_head)
            flat = self(x.reshape(-1, x.shape[-1]), epilogue)
            return flat.reshape(*x.shape[:-1], flat.shape[-1])
        if self.gemv and x.dim() == 2 and x.shape[0] <= limit and self.planes is not None:
            from edgerun.kernels import qlinear_planes

            return qlinear_planes.qgemv_planes(
                x,
                self.qweight(),
                self.bias,
                epilogue,
                out,
                gate,
                nrm,
                norm_out,
                self.planes,
                self._planes_count(),
            )  # each row in the MMA's columns of its own: one row's bits whatever the rows (no ``alone``)
        if self.gemv and x.dim() == 2 and x.shape[0] <= limit:
            from edgerun.kernels import qlinear_triton

            return qlinear_triton.qgemv(
                x,
                self.qweight(),
                self.bias,
                epilogue,
                out,
                gate,
                norm=nrm,
                norm_out=norm_out,
                alone=(exact or draft) and not self.shared_rows and also is None,  # also: one row
                config=self.tile,
                also=None if also is None else (also[0].qweight(), also[1], also[2]),
                conv=conv,
                norm_q_out=norm_q_out,
            )
        w, matmul = self.qweight(), None
        if self.cpu is not None and not x.is_cuda:
            from edgerun.kernels import qlinear_cpu

            matmul = partial(qlinear_cpu.linear, packed=self.cpu)
        elif self.gemv and self.scheme != "plain" and x.is_cuda:
            # more rows than a GEMV takes (prefill): the weight's exact values in one launch (the
            # bits the reference's torch dequantization gives), then cuBLAS
            from edgerun.kernels import qlinear_planes, qlinear_triton

            dequantize = (
                qlinear_planes.dequantize_planes
                if self.planes is not None
                else qlinear_triton.dequantize_weight
            )
            w = QWeight("plain", dequantize(w, x.dtype))
        if x.dim() == 2 or out is not None:
            return self._reference(x, w, epilogue, out, gate, nrm, norm_out, matmul)
        if norm is not None:
            raise ValueError("a projection's norm takes x [N, C]")
        lead = x.shape[:-1]
        flat = self._reference(x.reshape(-1, x.shape[-1]), w, epilogue, None, gate, None, None, matmul)
        return flat.reshape(*lead, flat.shape[-1])

    def _gemv_limit(self) -> int:
        """The most rows a GEMV takes here. Within exact_rows every row count a GEMV takes runs it,
        its rows in one pass where ``shared_rows`` was probed equal to the rows alone, else each
        row by programs of its own (``qgemv``'s alone): a row's bits are then the one-row call's,
        whatever the call. The MTP head's rows (draft_rows) take the same choice, for speed alone."""
        return MAX_GEMV_ROWS if EXACT_ROWS.get() or DRAFT_ROWS.get() else GEMV_ROWS[self.scheme]

    def pairs_with(self, other: QLinear, x: torch.Tensor) -> bool:
        """Whether ``other`` can run in this projection's launch on x (``forward``'s ``also``):
        one row, both on ``qgemv``, tiles of one warp count (``qlinear_triton.pairs``)."""
        if x.dim() != 2 or x.shape[0] != 1 or not (self.takes_qgemv(x) and other.takes_qgemv(x)):
            return False
        from edgerun.kernels.qlinear_triton import pairs

        return pairs(self.qweight(), other.qweight(), x.shape[1])

    def folds_conv(self, x: torch.Tensor, channels: int) -> bool:
        """Whether :meth:`forward` can run a conv over its first ``channels`` outputs in its
        launch on x (``conv``): one row on ``qgemv`` (``qlinear_triton.folds_conv``)."""
        if x.dim() != 2 or x.shape[0] != 1 or not self.takes_qgemv(x):
            return False
        from edgerun.kernels.qlinear_triton import folds_conv

        return folds_conv(self.qweight(), x.shape[1], channels)

    def takes_qgemv(self, x: torch.Tensor) -> bool:
        """Whether :meth:`forward` runs x (without leading dims) on ``qgemv``: the Triton GEMV,
        not the tensor-core one nor torch."""
        return self.gemv and self.planes is None and x.dim() == 2 and x.shape[0] <= self._gemv_limit()

    def _planes_count(self) -> torch.Tensor:
        """The tensor-core GEMV's arrival counters of this context's scratch set: calls on a
        prefill lane's stream may overlap the main stream's, so each lane has a set of its own,
        allocated at its first call (a warm-up, outside graph capture)."""
        k = SCRATCH_SET.get()
        if k == 0:
            return self.planes_count
        if k not in self.lane_counts:
            if self.planes_count.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"{self.extra_repr()}: scratch set {k}'s counters are first needed during graph "
                    "capture; run the lane once outside capture first"
                )
            self.lane_counts[k] = torch.zeros_like(self.planes_count)
        return self.lane_counts[k]

    def _reference(self, x, w, epilogue, out, gate, nrm, norm_out, matmul=None) -> torch.Tensor:
        """``qlinear_ref`` on x [N, C] (``matmul``: the CPU kernels' product in its stead, whose
        rows do not depend on each other). Within :func:`exact_rows` (a speculative verify
        window) on the CPU, BLAS's rows run one at a time: BLAS sums one row (a GEMV) in another
        order than several (a GEMM), so a window's row is then bit for bit the one-row decode
        step's (tests/engine/test_speculative.py), at the cost of reading the weight per row."""
        from edgerun.kernels.qlinear_reference import qlinear_ref

        n = x.shape[0]
        if n == 1 or matmul is not None or x.device.type != "cpu" or not EXACT_ROWS.get():
            return qlinear_ref(
                x, w, self.bias, epilogue, out, gate, norm=nrm, norm_out=norm_out, matmul=matmul
            )

        def row(t, i):
            return None if t is None else t[i : i + 1]

        ys = [
            qlinear_ref(row(x, i), w, self.bias, epilogue, row(out, i), row(gate, i), norm=nrm, norm_out=row(norm_out, i))
            for i in range(n)
        ]  # fmt: skip
        return out if out is not None else torch.cat(ys)

    def extra_repr(self) -> str:
        g = f", group {self.group}" if self.scheme != "plain" else ""
        return f"{self.in_features} -> {self.out_features}, {self.scheme}{g}"


def int8_worth(m: QLinear) -> bool:
    """Whether int8 activations (W4A8) pay for this projection's decode GEMV: an int4 weight in
    groups of 32 whose tile is ``qgemv``'s MANY (16 rows a program share each step's quantized x;
    on the FEW tile, 4 rows, the quantization costs more than it saves: docs/benchmarks.md) and
    that runs ``qgemv`` (not a tile of its own, as the shared expert's down does, nor the
    tensor-core GEMV of a batch, which takes bf16 x only)."""
    from edgerun.kernels.qlinear_triton import MANY, gemv_config

    if m.scheme != "int4" or m.group != 32 or m.tile is not None or not m.gemv or m.planes is not None:
        return False
    return gemv_config("int4", m.out_features, m.in_features) == MANY["int4"]


def int8_cases(mods: list[QLinear], norm: str) -> list[tuple]:
    """What the start-up probe of int8 activations runs (``probe_cases`` with ``act`` int8): each
    distinct column count at the MANY tile's least rows (its tile, as the projections run it),
    with no epilogue and with the decoder's RMSNorm prologue (``norm``: unit / plain)."""
    from edgerun.kernels.qlinear_triton import MANY, MIN_PROGRAMS

    rows = MANY["int4"].block_r * MIN_PROGRAMS
    cols = sorted({m.in_features for m in mods})
    return [("int4", rows, c, 32, "none") for c in cols] + [("int4", rows, c, 32, "none", norm) for c in cols]


def planes_cases(mods: list[QLinear]) -> list[tuple]:
    """What the tensor-core GEMV's start-up probe runs (``qlinear_reference.probe_cases`` with
    ``planes``) for these projections: each one's (int4, rows, cols, group) with no epilogue, its
    rows capped where its tile stops splitting the columns (the tile of the projection itself),
    and each epilogue and RMSNorm prologue on 128 rows (a split tile) once per (cols, group)."""
    from edgerun.kernels.qlinear_planes import MIN_PROGRAMS

    shapes, kinds = set(), set()
    for m in mods:
        shapes.add(("int4", min(m.out_features, 64 * MIN_PROGRAMS), m.in_features, m.group, "none"))
        kinds.add((m.in_features, m.group))
    for cols, group in kinds:
        shapes.update(("int4", 128, cols, group, e) for e in ("silu_mul", "residual", "gated"))
        shapes.update(
            ("int4", 128, cols, group, e, n) for e in ("none", "silu_mul") for n in ("unit", "plain")
        )
    return sorted(shapes)


class RMSNorm(nn.Module):
    """RMSNorm. ``unit_offset``: scale by (1 + w) in fp32 before the cast (Qwen3.5); otherwise
    cast first, then scale by w (Qwen3)."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_ref(x, self.weight, self.eps, self.unit_offset)


class GatedRMSNorm(nn.Module):
    """RMSNorm of the DeltaNet output, then multiplied by SiLU(z) in fp32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * xf.to(dtype)
        return (out * F.silu(z.float())).to(dtype)


class Rotary(nn.Module):
    """RoPE over the first ``rotary_dim`` channels of each head (partial rotary when < head_dim).

    Qwen3.5's multimodal RoPE (mrope sections) gives every section the same position for text
    tokens, so for text it reduces exactly to this 1-D form.
    """

    def __init__(self, rotary_dim: int, theta: float) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(rotary_dim, theta), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, rotary_dim] in ``dtype``."""
        return rotary_ref(positions, self.inv_freq, dtype)


# --------------------------------------------------------------------------------------------
# Decode state


@dataclass
class KVCache:
    k: torch.Tensor  # [B, Hk, S_max, Dh]
    v: torch.Tensor


@dataclass
class DeltaState:
    conv: torch.Tensor  # [B, C, K-1] last inputs of the causal conv
    recurrent: torch.Tensor  # [B, Hv, Dk, Dv] fp32
    # after a forward in rows mode (a verify window): (conv, recurrent) after each of its rows,
    # so a rejected tail rolls back without running the layer again
    trail: list[tuple[torch.Tensor, torch.Tensor]] | None = None


class DecodeState:
    """Per-sequence state between steps: KV for attention layers, conv + recurrent for DeltaNet."""

    def __init__(self, layers: list[KVCache | DeltaState | None], max_len: int) -> None:
        self.layers = layers
        self.max_len = max_len
        self.pos = 0  # tokens already consumed

    def rollback(self, start: int, kept: int) -> None:
        """After a verify window of rows from position ``start`` (a forward in rows mode), keep
        its first ``kept`` rows: the KV positions past them are free again (later rows overwrite
        them and nothing reads past ``pos``), and each DeltaNet layer's conv and recurrent state
        become what they were after row ``kept`` - 1."""
        if not 0 < kept <= self.pos - start:
            raise ValueError(f"keep {kept} rows of a window of {self.pos - start} from position {start}")
        for entry in self.layers:
            if isinstance(entry, DeltaState) and entry.trail is not None:
                conv, recurrent = entry.trail[kept - 1]
                entry.conv.copy_(conv)
                entry.recurrent.copy_(recurrent)
                entry.trail = None
        self.pos = start + kept

    def copy_into(self, other: DecodeState) -> None:
        """``other`` (a state of the same model, one sequence) becomes this state: its KV at
        positions 0..pos, every DeltaNet layer's conv and recurrent state, and pos."""
        n = self.pos
        if n > other.max_len:
            raise ValueError(f"a state at position {n} does not fit one of {other.max_len} positions")
        for src, dst in zip(self.layers, other.layers, strict=True):
            if isinstance(src, KVCache):
                dst.k[:, :, :n].copy_(src.k[:, :, :n])
                dst.v[:, :, :n].copy_(src.v[:, :, :n])
            elif isinstance(src, DeltaState):
                dst.conv.copy_(src.conv)
                dst.recurrent.copy_(src.recurrent)
        other.pos = n

    def nbytes(self) -> int:
        total = 0
        for entry in self.layers:
            if isinstance(entry, KVCache):
                total += entry.k.nbytes + entry.v.nbytes
            elif isinstance(entry, DeltaState):
                total += entry.conv.nbytes + entry.recurrent.nbytes
        return total


@dataclass
class StaticStep:
    """What one decode step over static buffers (CUDA graphs) shares across layers: the rope of
    the position, the position itself as a device tensor (no shape depends on it), the KV
    buffer's index, and whether the fused Triton dense kernels run."""

    cos: torch.Tensor  # [N, R]
    sin: torch.Tensor
    pos: torch.Tensor  # [N] int64: each row's position
    kv_index: torch.Tensor  # [S_max] int64
    fused: bool = False
    inv_freq: torch.Tensor | None = None  # Rotary's, for the fused attention kernel (rope from pos)
    # [N] int64: each row's entry of the state pool (a batch's step, fused kernels only); None:
    # row n is entry n (one sequence, batch 1)
    slots: torch.Tensor | None = None
    # the rows are one sequence at consecutive positions (a speculative verify window, fused
    # kernels only): its one state entry, each row's token mixers the one-row step's, in order
    window: bool = False


# --------------------------------------------------------------------------------------------
# Attention


class Attention(nn.Module):
    """GQA attention with per-head q/k RMSNorm; optional sigmoid output gate (Qwen3.5)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.gated = args.attn_output_gate
        q_out = self.n_heads * self.head_dim * (2 if self.gated else 1)
        bias = args.attention_bias
        self.q_proj = nn.Linear(args.hidden_size, q_out, bias=bias)
        self.k_proj = nn.Linear(args.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(args.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, args.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, args.rms_norm_eps, args.norm_unit_offset)
        self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps, args.norm_unit_offset)

    def new_state(self, batch: int, max_len: int, device, dtype, zero: bool = True) -> KVCache:
        """``zero`` False: uninitialised (nothing reads a position before it is written; on the
        CPU the pages are then committed only as positions are written)."""
        shape = (batch, self.n_kv, max_len, self.head_dim)
        new = torch.zeros if zero else torch.empty
        return KVCache(new(shape, device=device, dtype=dtype), new(shape, device=device, dtype=dtype))

    def fuse(self) -> None:
        """After load: q/k/v as one projection (one GEMV at decode), o_proj as a QLinear."""
        self.qkv = QLinear.concat([self.q_proj, self.k_proj, self.v_proj])
        self.o_proj = QLinear.of(self.o_proj)
        del self.q_proj, self.k_proj, self.v_proj

    def _project(self, x: torch.Tensor):
        """x [B, T, D] -> q [B, T, H, Dh], gate [B, T, H·Dh] or None, k and v [B, T, Hk, Dh]."""
        B, T, _ = x.shape
        H, Hk, Dh = self.n_heads, self.n_kv, self.head_dim
        q, k, v = self.qkv(x).split([H * Dh * (2 if self.gated else 1), Hk * Dh, Hk * Dh], dim=-1)
        gate = None
        if self.gated:
            q, gate = q.reshape(B, T, H, 2 * Dh).chunk(2, dim=-1)
            gate = gate.reshape(B, T, -1)
        return q.reshape(B, T, H, Dh), gate, k.reshape(B, T, Hk, Dh), v.reshape(B, T, Hk, Dh)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: KVCache | None,
        start: int,
        rows: bool = False,
    ) -> torch.Tensor:
        """``rows``: each row attends as a one-row decode step at its position would (the same
        SDPA call over the keys up to it), so a verify window's rows are the decode step's bits."""
        q, gate, k, v = self._heads(x, *rope)
        T = x.shape[1]
        if cache is not None:
            cache.k[:, :, start : start + T] = k
            cache.v[:, :, start : start + T] = v
            k, v = cache.k[:, :, : start + T], cache.v[:, :, : start + T]
        if rows and T > 1:
            S = k.shape[2] - T
            out = torch.cat(
                [
                    causal_attention(q[:, :, t : t + 1], k[:, :, : S + t + 1], v[:, :, : S + t + 1])
                    for t in range(T)
                ],
                dim=2,
            )
        else:
            out = causal_attention(q, k, v)
        return self._output(out, gate)

    def decode_rows(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        caches: list[KVCache],
        starts: list[int],
    ) -> torch.Tensor:
        """One token of each of B sequences, x [B, 1, D]: row b is at position ``starts[b]`` of
        its own ``caches[b]`` (rope: cos, sin [B, R], row b's position), and attends as that
        sequence's one-row decode step does (the same SDPA call over its own keys)."""
        cos, sin = (t[:, None, None] for t in rope)  # [B, 1, 1, R]: each row its own position
        q, gate, k, v = self._heads(x, cos, sin)
        outs = []
        for b, (cache, start) in enumerate(zip(caches, starts, strict=True)):
            cache.k[:, :, start : start + 1] = k[b : b + 1]
            cache.v[:, :, start : start + 1] = v[b : b + 1]
            outs.append(
                causal_attention(q[b : b + 1], cache.k[:, :, : start + 1], cache.v[:, :, : start + 1])
            )
        return self._output(torch.cat(outs), gate)

    def _heads(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, T, D] -> q [B, H, T, Dh] and k, v [B, Hk, T, Dh] (normed, rotated), and the gate."""
        q, gate, k, v = self._project(x)
        q = self.q_norm(q).transpose(1, 2)
        k = self.k_norm(k).transpose(1, 2)
        v = v.transpose(1, 2)
        return apply_rotary(q, cos, sin), gate, apply_rotary(k, cos, sin), v

    def _output(self, out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """Attention output [B, H, T, Dh] -> gated, o_proj [B, T, D]."""
        B, _, T, _ = out.shape
        out = out.transpose(1, 2).reshape(B, T, -1)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)

    def decode_static(
        self, x: torch.Tensor, step: StaticStep, cache: KVCache, residual: torch.Tensor, norm: RMSNorm
    ) -> None:
        """One token of :meth:`forward` on ``norm(x)`` over the whole static KV buffer, its output
        added into ``residual`` [B, D] in place: the new key and value are written at
        ``step.pos`` (a device tensor) and later positions are masked (the fused kernel,
        ``step.fused``, does not read them), so no shape depends on the position. x [B, D]; the
        fused path normalises x in the q/k/v GEMV's prologue."""
        B = x.shape[0]
        H, Hk, Dh = self.n_heads, self.n_kv, self.head_dim
        if step.fused:
            from edgerun.kernels import decode_triton

            qkv, out = self.qkv(x, norm=norm), x.new_empty(B, H * Dh)
            # window: the rows are one sequence's tokens, each its one-row step's (row j reads the
            # keys rows < j write); else each row a sequence of its own
            decode_triton.attention_decode(
                qkv=qkv, q_norm_w=self.q_norm.weight, k_norm_w=self.k_norm.weight, eps=self.q_norm.eps,
                unit_offset=self.q_norm.unit_offset, inv_freq=step.inv_freq, pos=step.pos, k_cache=cache.k,
                v_cache=cache.v, out=out, n_heads=H, n_kv=Hk, head_dim=Dh, gated=self.gated,
                slots=step.slots, window=step.window,
            )  # fmt: skip
            self.o_proj(out, "residual", out=residual)
            return
        if B != 1 or step.slots is not None:
            raise ValueError("a static decode step of several rows needs the fused attention kernel")
        q, gate, k, v = self._project(norm(x)[:, None])
        q = self.q_norm(q).transpose(1, 2)
        k = self.k_norm(k).transpose(1, 2)
        v = v.transpose(1, 2)
        q, k = apply_rotary(q, step.cos, step.sin), apply_rotary(k, step.cos, step.sin)
        cache.k.index_copy_(2, step.pos, k)
        cache.v.index_copy_(2, step.pos, v)
        q = q.reshape(B, Hk, H // Hk, Dh)  # head h = kv * (H // Hk) + r, as repeat_interleave pairs them
        # scores and softmax in fp32, then P (in the cache's dtype) times V: a few small kernels. A
        # fused SDPA kernel with a mask over the whole buffer measured ~100 µs a layer on an H200.
        scores = torch.matmul(q.float() * Dh**-0.5, cache.k.float().transpose(-1, -2))  # [B, Hk, H/Hk, S]
        scores = scores.masked_fill((step.kv_index > step.pos)[None, None, None, :], float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1).to(cache.v.dtype), cache.v)
        out = out.reshape(B, H * Dh)
        if gate is not None:
            out = out * torch.sigmoid(gate[:, 0])
        self.o_proj(out, "residual", out=residual)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q: [B, H, T, Dh], the last T of the positions 0..S-1 of k, v: [B, Hk, S, Dh]. Through SDPA's fused kernels (flash attention on CUDA): a whole prompt is
    causal (is_causal, grouped-query heads read in place), a later chunk causal aligned to the
    end of the keys (lower right), one token attends to everything."""
    T, S = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    if T == 1:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    if T == S:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if gqa:  # the lower-right mask's kernels take equal head counts
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    if q.device.type == "cpu":
        # what causal_lower_right runs on a CPU (no fused kernel takes it there: it materializes
        # this mask), without importing torch.nn.attention.bias, which imports torch._dynamo: a
        # second and ~120 MiB in the middle of a request's prefill
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril_(S - T)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    from torch.nn.attention.bias import causal_lower_right  # imported at start-up on CUDA (runtime)

    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(T, S))


# --------------------------------------------------------------------------------------------
# Gated DeltaNet (linear attention)


class GatedDeltaNet(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_k = args.linear_num_key_heads
        self.n_v = args.linear_num_value_heads
        self.dk = args.linear_key_head_dim
        self.dv = args.linear_value_head_dim
        self.key_dim = args.linear_key_dim
        self.value_dim = args.linear_value_dim
        self.conv_dim = args.linear_conv_dim
        self.kernel = args.linear_conv_kernel_dim
        D = args.hidden_size
        self.in_proj_qkv = nn.Linear(D, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(D, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(D, self.n_v, bias=False)
        self.in_proj_a = nn.Linear(D, self.n_v, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.n_v))
        self.A_log = nn.Parameter(torch.zeros(self.n_v))
        self.norm = GatedRMSNorm(self.dv, args.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, D, bias=False)
        self.chunk_fla = False  # the engine's choice: prompts' delta rule through fla-core

    def new_state(self, batch: int, device, dtype) -> DeltaState:
        return DeltaState(
            conv=torch.zeros(batch, self.conv_dim, self.kernel - 1, device=device, dtype=dtype),
            recurrent=torch.zeros(batch, self.n_v, self.dk, self.dv, device=device, dtype=torch.float32),
        )

    def fuse(self) -> None:
        """After load: in_proj_qkv/z/b/a as one projection (one GEMV at decode)."""
        self.in_proj = QLinear.concat([self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a])
        self.out_proj = QLinear.of(self.out_proj)
        del self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a

    def _project(self, x: torch.Tensor, norm: RMSNorm | None = None, conv=None) -> list[torch.Tensor]:
        """x [..., D] (with ``norm``: norm(x), x [N, D]) -> the qkv (conv input), z, b and a
        projections (``conv``: see ``QLinear.forward``)."""
        y = self.in_proj(x, norm=norm, conv=conv)
        return y.split([self.conv_dim, self.value_dim, self.n_v, self.n_v], dim=-1)

    def forward(
        self, x: torch.Tensor, state: DeltaState | None, rows: bool = False, valid: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``rows`` (with a state): the conv and the delta rule run one row at a time, each as
        the one-row decode step runs it, and the state after each row is kept in
        ``state.trail`` for a rollback (``DecodeState.rollback``). ``valid`` [T] bool (a padded
        chunk, ``engine/graphs.PrefillGraphs``): the rows past the prompt leave the state as the
        prompt's rows left it."""
        T = x.shape[1]
        mixed, z, b, a = self._project(x)
        if valid is not None:
            out = self._mix(mixed, b, a, state, x.dtype, valid)
        elif rows and T > 1:
            trail, parts = [], []
            for t in range(T):
                parts.append(self._mix(mixed[:, t : t + 1], b[:, t : t + 1], a[:, t : t + 1], state, x.dtype))
                trail.append((state.conv.clone(), state.recurrent.clone()))
            out = torch.cat(parts, dim=1)
            state.trail = trail
        else:
            out = self._mix(mixed, b, a, state, x.dtype)
            if rows:
                state.trail = [(state.conv.clone(), state.recurrent.clone())]
        return self._output(out, z)

    def decode_rows(self, x: torch.Tensor, states: list[DeltaState]) -> torch.Tensor:
        """One token of each of B sequences, x [B, 1, D], row b advancing its own ``states[b]``
        as that sequence's one-row decode step does (the conv and delta rule one row at a time;
        the projections take all rows)."""
        mixed, z, b, a = self._project(x)
        parts = [
            self._mix(mixed[r : r + 1], b[r : r + 1], a[r : r + 1], state, x.dtype)
            for r, state in enumerate(states)
        ]
        return self._output(torch.cat(parts), z)

    def _output(self, out: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The delta rule's output [B, T, Hv, Dv] -> gated norm, out_proj [B, T, D]."""
        B, T = out.shape[:2]
        out = self.norm(out, z.reshape(B, T, self.n_v, self.dv)).reshape(B, T, self.value_dim)
        return self.out_proj(out)

    def _mix(
        self, mixed, b, a, state: DeltaState | None, dtype, valid: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The causal conv and the gated delta rule on the projections of T rows; the state
        advances by T (by the ``valid`` rows, the first ones, where given: a padded row has
        beta = 0 and g = 0, so the delta rule leaves the state as it is, and the conv state is
        the last inputs of the valid rows; every shape stays that of T rows, for a graph).
        Returns [B, T, Hv, Dv] in ``dtype``."""
        B, T, _ = mixed.shape
        mixed = mixed.transpose(1, 2)  # [B, C, T]
        history = state.conv if state is not None else mixed.new_zeros(B, self.conv_dim, self.kernel - 1)
        window = torch.cat([history.to(mixed.dtype), mixed], dim=-1)
        if state is not None and valid is not None:  # window columns [n, n + K - 1): the last K - 1 inputs
            last = valid.sum(dtype=torch.long) + torch.arange(self.kernel - 1, device=valid.device)
            state.conv.copy_(window.index_select(-1, last))
        elif state is not None:
            state.conv.copy_(window[:, :, -(self.kernel - 1) :])
        w = self.conv1d.weight  # [C, 1, K]
        # depthwise causal conv as K multiply-adds per channel: F.conv1d is ~50x slower at decode sizes
        taps = window.to(w.dtype).unfold(-1, self.kernel, 1)  # [B, C, T, K]
        mixed = F.silu((taps * w[:, None, 0, :]).sum(-1)).to(dtype).transpose(1, 2)

        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(B, T, self.n_k, self.dk)
        k = k.reshape(B, T, self.n_k, self.dk)
        v = v.reshape(B, T, self.n_v, self.dv)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        if valid is not None:
            keep = valid[None, :, None]
            beta, g = beta * keep, g * keep
        if state is not None:
            s0 = state.recurrent
        else:
            s0 = torch.zeros(B, self.n_v, self.dk, self.dv, dtype=torch.float32, device=mixed.device)
        if T > 1 and self.chunk_fla:
            from edgerun.kernels.delta_chunk import delta_rule_fla

            # fla-core takes [B, T, H, *] and the key heads as they are (value head h reads key
            # head h // (Hv / Hk), as repeat_interleave pairs them): no copies
            q = l2norm(q.float()) * self.dk**-0.5
            out, s1 = delta_rule_fla(q, l2norm(k.float()), v.float(), g, beta.float(), s0)
        else:
            if self.n_v != self.n_k:
                q = q.repeat_interleave(self.n_v // self.n_k, dim=2)
                k = k.repeat_interleave(self.n_v // self.n_k, dim=2)
            # fp32, [B, H, T, *]
            q, k, v, beta, g = (t.transpose(1, 2).float().contiguous() for t in (q, k, v, beta, g))
            q = l2norm(q) * self.dk**-0.5
            k = l2norm(k)
            rule = delta_rule_recurrent if T == 1 else delta_rule_chunked
            out, s1 = rule(q, k, v, g, beta, s0)
            out = out.transpose(1, 2)
        if state is not None:
            state.recurrent.copy_(s1)
        return out.to(dtype)  # [B, T, Hv, Dv]

    def decode(
        self,
        x: torch.Tensor,
        state: DeltaState,
        fused: bool,
        residual: torch.Tensor,
        norm: RMSNorm,
        slots: torch.Tensor | None = None,
        trail: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """One token of each of N sequences on norm(x), x [N, D], the output added into
        ``residual`` [N, D] in place: :meth:`forward` (N = 1), or (``fused``, CUDA only) the
        two-launch Triton step (``kernels/dense_triton.py``) between the fused projection (which
        normalises x in its prologue) and out_proj; row n's states are entry n of ``state``, or
        entry ``slots[n]`` (a batch's pool). ``trail`` (conv [N, C, K-1], recurrent [N, Hv, Dk,
        Dv]): the rows are one sequence's consecutive tokens (a verify window), stepped in order
        by the kernels' window mode (still two launches), each row the one-row step's bits, the
        states after row n in row n of ``trail`` for a rollback. One row of one sequence runs the
        conv in the projection's launch where it can (``QLinear.folds_conv``): the same bits, one
        launch fewer."""
        if not fused:
            if x.shape[0] != 1 or slots is not None or trail is not None:
                raise ValueError("a static decode step of several rows needs the fused DeltaNet kernel")
            residual.add_(self(norm(x)[None], state)[0])
            return
        from edgerun.kernels import dense_triton

        conv_weight, act = self.conv1d.weight[:, 0], None
        if slots is None and trail is None and self.in_proj.folds_conv(x, self.conv_dim):
            act = torch.empty(1, self.conv_dim, dtype=torch.float32, device=x.device)  # the conv's output
        conv = None if act is None else (state.conv, conv_weight, act)
        qkv, z, b, a = self._project(x, norm, conv)  # [N, *] views of one GEMV's output
        out = dense_triton.delta_decode(
            qkv, z, a, b, conv_state=state.conv, conv_weight=conv_weight, A_log=self.A_log,
            dt_bias=self.dt_bias, state=state.recurrent, norm_weight=self.norm.weight, eps=self.norm.eps,
            n_k=self.n_k, n_v=self.n_v, dk=self.dk, dv=self.dv, slots=slots, trail=trail, act=act,
        )  # fmt: skip
        self.out_proj(out, "residual", out=residual)


# --------------------------------------------------------------------------------------------
# Feed-forward and MoE


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def fuse(self) -> None:
        """After load: gate and up as one projection whose epilogue is SiLU(gate) * up."""
        self.gate_up = QLinear.concat([self.gate_proj, self.up_proj])
        self.down_proj = QLinear.of(self.down_proj)
        del self.gate_proj, self.up_proj

    def forward(
        self, x: torch.Tensor, epilogue: str = "none", out=None, gate=None, norm=None
    ) -> torch.Tensor:
        """SiLU(x W_g) * (x W_u) (of norm(x) with ``norm``), then down_proj with ``epilogue``
        (see QLinear)."""
        return self.down_proj(self.gate_up(x, "silu_mul", norm=norm), epilogue, out, gate)


class Router(nn.Module):
    """Softmax router in fp32; top-k; optional renormalisation of the k weights. After
    :meth:`fuse`, ``proj`` computes the E expert logits followed by ``extra`` more columns
    (the shared expert's gate logit) in one GEMV."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(args.num_experts, args.hidden_size))
        self.num_experts = args.num_experts
        self.top_k = args.num_experts_per_tok
        self.normalize = args.norm_topk_prob

    def fuse(self, extra: nn.Module | None = None) -> None:
        self.proj = QLinear.concat(
            [QLinear(QWeight("plain", self.weight))] + ([extra] if extra is not None else [])
        )
        del self.weight

    def logits(self, x: torch.Tensor, norm: RMSNorm | None = None, norm_out=None) -> torch.Tensor:
        """x [N, D] -> [N, E + extra] in x's dtype (of norm(x) with ``norm``, which then also
        lands in ``norm_out``: the layer's other consumers read it there)."""
        return self.proj(x, norm=norm, norm_out=norm_out)

    def select(
        self,
        logits: torch.Tensor,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
        fused: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [N, E + extra] -> weights [N, A] (logits' dtype), ids [N, A] (int64), written
        into ``out`` (weights, ids) when given; ``fused``: the one-launch Triton kernel."""
        if fused:
            from edgerun.kernels import decode_triton

            N = logits.shape[0]
            weights, ids = out if out is not None else (
                logits.new_empty(N, self.top_k), torch.empty(N, self.top_k, dtype=torch.long, device=logits.device)
            )  # fmt: skip
            decode_triton.router_topk(logits, self.num_experts, self.top_k, self.normalize, weights, ids)
            return weights, ids
        probs = torch.softmax(logits[:, : self.num_experts], dim=-1, dtype=torch.float32)
        top, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            top = top / top.sum(dim=-1, keepdim=True)
        weights = top.to(logits.dtype)
        if out is not None:
            out[0].copy_(weights)
            out[1].copy_(ids)
            return out
        return weights, ids

    def route(
        self,
        x: torch.Tensor,
        out: tuple[torch.Tensor, torch.Tensor],
        fused: bool,
        norm: RMSNorm | None = None,
        norm_out: torch.Tensor | None = None,
        also: tuple[QLinear, str, torch.Tensor] | None = None,
        logits: torch.Tensor | None = None,
        norm_q_out: tuple[torch.Tensor, ...] | None = None,
        topk: bool = True,
    ) -> torch.Tensor:
        """:meth:`logits` then :meth:`select` into ``out`` (weights, ids); returns the logits
        (written into ``logits`` [N, E + extra] when given: a decode step's static buffer).
        ``fused``: the selection in ``router_topk``'s one launch (the GEMV's launch routed its
        own logits once: slower with PDL, docs/benchmarks.md 2026-12-06). ``also``: another
        projection of the normalised x in the GEMV's launch (QLinear's), where fused and it runs
        ``qgemv``; else the caller runs it. ``norm_q_out``: the normalised x quantized to int8 for
        the experts (:meth:`QLinear.forward`). ``topk`` False: no selection; ``out`` is left to
        the expert step, whose launch routes the logits (``moe_experts``' ``route``)."""
        if also is not None and not (fused and self.proj.takes_qgemv(x)):
            raise ValueError("Router.route runs another projection in its launch only where fused")
        logits = self.proj(x, out=logits, norm=norm, norm_out=norm_out, also=also, norm_q_out=norm_q_out)
        if topk:
            self.select(logits, out, fused)
        return logits

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, D] -> weights [N, A] (x.dtype), ids [N, A] (int64), and the logits [N, E + extra]
        (their extra columns feed the shared expert's gate). Where the engine selected the
        Triton kernels (the projection's ``gemv``), the top-k is one launch after the GEMV's."""
        N = x.shape[0]
        out = (x.new_empty(N, self.top_k), torch.empty(N, self.top_k, dtype=torch.long, device=x.device))
        logits = self.route(x, out, fused=self.proj.gemv and x.is_cuda)
        return (*out, logits)


class Experts(nn.Module):
    """All routed experts of one layer, resident and stacked: gate_up [E, 2I, D], down [E, D, I]."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        E, I, D = args.num_experts, args.moe_intermediate_size, args.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, D))
        self.down_proj = nn.Parameter(torch.empty(E, D, I))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return combine_experts(x, ids, weights, lambda e: (self.gate_up_proj[e], self.down_proj[e]))

    def gathered(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """One token, x [1, D], ids / weights [1, A] -> [1, D], with no host round trip (so a CUDA
        graph can hold it): the A experts' weights gathered by id on the device, summed in
        ascending expert-id order (a fixed order)."""
        ids, order = torch.sort(ids[0], stable=True)
        w = weights[0].index_select(0, order)
        gate_up = self.gate_up_proj.index_select(0, ids)  # [A, 2I, D]
        down = self.down_proj.index_select(0, ids)  # [A, D, I]
        h = x.to(gate_up.dtype).expand(ids.shape[0], -1)[..., None]  # [A, D, 1]
        gate, up = torch.bmm(gate_up, h)[..., 0].chunk(2, dim=-1)
        y = torch.bmm(down, (F.silu(gate) * up)[..., None])[..., 0]  # [A, D]
        return (y * w[:, None].to(y.dtype)).sum(0, keepdim=True).to(x.dtype)

    def gathered_rows(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """:meth:`gathered` for N tokens in one pass: x [N, D], ids / weights [N, A] -> [N, D].
        The batched products take all N x A (token, expert) pairs at once, so a row's bits may
        depend on N: for the MTP head's rows only, whose drafts decide what is verified, never
        what is emitted."""
        n, a = ids.shape
        ids, order = torch.sort(ids, dim=-1, stable=True)
        w = weights.gather(-1, order)
        gate_up = self.gate_up_proj.index_select(0, ids.reshape(-1))  # [N A, 2I, D]
        down = self.down_proj.index_select(0, ids.reshape(-1))  # [N A, D, I]
        h = x.to(gate_up.dtype)[:, None].expand(n, a, -1).reshape(n * a, -1, 1)
        gate, up = torch.bmm(gate_up, h)[..., 0].chunk(2, dim=-1)
        y = torch.bmm(down, (F.silu(gate) * up)[..., None])[..., 0].view(n, a, -1)
        return (y * w[..., None].to(y.dtype)).sum(1).to(x.dtype)


class SparseMoe(nn.Module):
    """Routed experts, plus (Qwen3.5) a shared expert scaled by a sigmoid gate."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.gate = Router(args)
        self.experts = Experts(args)
        self.has_shared = args.shared_expert_intermediate_size > 0
        if self.has_shared:
            self.shared_expert = MLP(args.hidden_size, args.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(args.hidden_size, 1, bias=False)

    def fuse(self) -> None:
        """After load: the router and the shared expert's gate as one GEMV (its last column is
        the gate's logit); the shared expert's gate and up as one."""
        self.gate.fuse(self.shared_expert_gate if self.has_shared else None)
        if self.has_shared:
            self.shared_expert.fuse()
            del self.shared_expert_gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        flat = x.reshape(-1, D)
        weights, ids, logits = self.gate(flat)
        out = self.combine(self.experts(flat, ids, weights), self.shared_output(flat, logits))
        return out.reshape(B, T, D)

    def shared_output(
        self, x: torch.Tensor, logits: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """The gated shared expert on x [N, D] (None without one): sigmoid(the gate logit, the
        router's last column of ``logits``) times the shared MLP, in its down projection's
        epilogue; written into ``out`` when given."""
        if not self.has_shared:
            return None
        return self.shared_expert(x, "gated", out, logits[:, self.gate.num_experts :])

    def route_shared(
        self,
        x: torch.Tensor,
        out: tuple[torch.Tensor, torch.Tensor],
        fused: bool,
        norm: RMSNorm,
        h: torch.Tensor,
        shared: torch.Tensor,
        mid: torch.Tensor | None = None,
        logits: torch.Tensor | None = None,
        defer: bool = False,
        hq: tuple[torch.Tensor, ...] | None = None,
        topk: bool = True,
    ) -> torch.Tensor:
        """The decode step's router and shared expert on norm(x), x [N, D]: the router into
        ``out`` (weights, ids) as :meth:`Router.route` (the normalised x into ``h``), the gated
        shared expert into ``shared`` (when the layer has one) as :meth:`shared_output`; returns
        the logits. With the fused kernels and one row, the shared expert's gate_up runs in the
        router's launch (``QLinear.pairs_with``: its programs normalise x themselves, its bits
        those of its own launch on h), then the top-k's: two launches for the router, its top-k
        and the shared gate_up, not three. ``mid`` [N, S] and ``logits`` [N, E + 1]: static
        buffers for the shared expert's SiLU(gate) * up and the router's logits. ``defer`` (where
        :meth:`defers_down`): the shared expert's down projection is left to the expert step's
        launch (:meth:`shared_down`, ``moe_triton.moe_gemv``'s ``shared_down``). ``hq``: h
        quantized to int8 per 32 columns too, for int8 expert activations (``Router.route``'s
        ``norm_q_out``). ``topk`` False: the top-k is left to the expert step (``Router.route``)."""
        gate_up = self.shared_expert.gate_up if self.has_shared else None
        paired = gate_up is not None and fused and self.gate.proj.pairs_with(gate_up, x)
        if defer and not (paired and self.shared_expert.down_proj.tile is not None):  # (defers_down, cheaply)
            raise ValueError("the shared expert's down projection cannot wait for the expert step here")
        if not paired:
            logits = self.gate.route(x, out, fused, norm, norm_out=h, logits=logits, norm_q_out=hq, topk=topk)
            self.shared_output(h, logits, out=shared)
            return logits
        mid = mid if mid is not None else x.new_empty(x.shape[0], gate_up.out_features // 2)
        logits = self.gate.route(
            x, out, fused, norm, norm_out=h, also=(gate_up, "silu_mul", mid), logits=logits, norm_q_out=hq,
            topk=topk,
        )  # fmt: skip
        if not defer:
            self.shared_expert.down_proj(mid, "gated", shared, logits[:, self.gate.num_experts :])
        return logits

    def defers_down(self, x: torch.Tensor, fused: bool) -> bool:
        """Whether :meth:`route_shared` on x [N, D] can leave the shared expert's down projection
        to the expert step's launch: one row, the shared gate_up in the router's launch, and the
        down projection on ``qgemv`` with the expert kernel's tile (``QLinear.tile``)."""
        if not (self.has_shared and fused):
            return False
        down = self.shared_expert.down_proj
        paired = self.gate.proj.pairs_with(self.shared_expert.gate_up, x)
        return paired and down.tile is not None and down.takes_qgemv(x) and down.bias is None

    def shared_down(self, mid: torch.Tensor, logits: torch.Tensor) -> tuple:
        """The deferred down projection for the expert step (``moe_gemv``'s ``shared_down``): the
        weight, its input ``mid``, its gate (the router's last logit column) and its tile."""
        down = self.shared_expert.down_proj
        return down.qweight(), mid, logits[:, self.gate.num_experts :], down.tile

    @staticmethod
    def combine(routed: torch.Tensor, shared: torch.Tensor | None) -> torch.Tensor:
        return routed if shared is None else routed + shared
