"""Batch-1 decode on CUDA: the step as a list of operations over static buffers, captured in CUDA
graphs where they can be and run eagerly where they must.

A decode step is a sequence of *device* operations (embedding, each layer's token mixer, norms,
router and shared expert, the routed-expert kernel, the head) and *host* operations (a layer's
routing read back to the host so the expert cache can serve its misses). Consecutive device
operations form a segment; in graph mode each segment is one captured CUDA graph, replayed every
step, and host operations run between segments. In eager mode the very same operations run
uncaptured, so both modes compute the same bits (``tests/engine/test_graphs_cuda.py``).

What a MoE layer's expert step needs decides its operations:

- ``table``: every expert of the layer sits in a slot and the expert kernel reads slots through
  an index tensor: the slot lookup runs on the device, nothing leaves the graph. With every layer
  so, a whole step is one graph. The MTP head's experts held as blocks (``HeldExperts``) run so
  from their own pool.
- ``routed``: the cache may miss. Host op: read the layer's top-k back, let the cache serve the
  misses (reads, copies), write the slot indices into a static tensor. The expert kernel then
  runs at the start of the next segment, reading slots through that tensor.
- ``eager``: the reference expert step (host-side dequantization) runs between segments.
- ``stacked``: resident stacked expert weights, gathered by id on the device (capturable); the
  held head's blocks through the expert kernel the policy resolved, where it is not Triton.

The model math is the model's own (``DecoderLayer.mix_static``, ``SparseMoe``, ``Experts``) and
the routed-expert step is ``engine/streaming.run_experts``, the one the streaming layer calls:
this module only plans, captures and replays. Attention reads the whole static KV buffer with
a mask (``Attention.decode_static``), so its shapes never change; the position and token are
device tensors the host writes before each step. Prefill runs the model's own forward on the
same static state: eagerly, or (:class:`PrefillGraphs`) a prompt's first chunk replayed from a
graph captured for its length padded up to a bucket. A speculative verify window
(:meth:`DecodeGraphs.verify`) is a decoder of K + 1 rows over the one sequence's state: the same
operations, each token mixer taking the rows in one call (attention and DeltaNet step them in
position order inside their programs), the projections in one GEMV where probed exact.
"""

from __future__ import annotations

import gc
import math
import os
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch

from edgerun.budget.planner import PREFILL_GRAPH_TOKENS  # longer first chunks run eagerly
from edgerun.cache.slots import SlotRef
from edgerun.engine.sampler import NonFiniteLogits
from edgerun.engine.streaming import HeldExperts, StreamingExperts, lookup, run_experts
from edgerun.errors import EdgerunError
from edgerun.kernels.moe import add_into, folds_route
from edgerun.kernels.moe_reference import RouterLogits
from edgerun.kernels.scratch import scratch_set
from edgerun.models.layers import (
    DecodeState,
    DeltaState,
    SparseMoe,
    StaticStep,
    draft_rows,
    exact_rows,
    verify_window,
)

if TYPE_CHECKING:
    from edgerun.kernels.sample_triton import SampleBuffers

_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}
# decode steps between two moves of a far tier's device slots toward its most used experts
# (``ExpertCache.rebalance_far``: a device sync and up to Q/8 copies a layer, between steps)
FAR_REBALANCE_STEPS = 64
# A one-sequence step's greedy launch also writes its token and logit into the host slot of its
# position's parity (pinned memory, through the device's mapping) and advances the device's
# position (``sample_triton.greedy``'s ``direct``): between two queued steps the stream then has
# no copies back and no fill of the position, only the event the host waits on. +0.9% at 40
# layers on an H200, the same tokens (docs/benchmarks.md, 2026-12-07, forty-fifth session). An
# A/B switch (benchmarks/ab_decode.py), read where a decoder is made; EDGERUN_DIRECT_PICK=0 clears it.
DIRECT_PICK = os.environ.get("EDGERUN_DIRECT_PICK", "1") != "0"


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The one side stream per device that warm-up steps run on and graphs are captured on:
    cuBLAS keeps a workspace (32 MiB on Hopper) for each stream it has run on, for the process's
    life, so a new stream per capture would leave one more behind each time (the planner counts
    two: the compute stream's and this one's, ``library_workspaces``)."""
    device = torch.device(device)
    if device.index is None:
        device = torch.device(device.type, torch.cuda.current_device())
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


def run_on_side_stream(fn, device: torch.device, stream: torch.cuda.Stream | None = None) -> None:
    """``fn`` run eagerly on the side stream (or ``stream``: a prefill lane's), after the current
    stream's work and before its next: a first run before a capture (library handles, Triton
    compiles), which is that call's run."""
    stream = stream or side_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream(device).wait_stream(stream)


def capture_graph(
    fn, device: torch.device, pool=None, stream: torch.cuda.Stream | None = None
) -> torch.cuda.CUDAGraph:
    """``fn``'s launches recorded (not run) into a CUDA graph on the side stream (or ``stream``).
    Python's garbage collector is held off meanwhile: a collection during the capture may free a
    CUDA object of an earlier run (a pinned buffer, an event) whose release is not allowed while
    a stream captures, which aborts the process (seen on an H200: test_graphs_cuda.py)."""
    g = torch.cuda.CUDAGraph()
    was = gc.isenabled()
    gc.disable()  # (torch.cuda.graph collects once as it starts)
    try:
        with torch.cuda.graph(g, pool=pool, stream=stream or side_stream(device)):
            fn()
    finally:
        if was:
            gc.enable()
    return g


@dataclass
class DecodeCounters:
    graph_steps: int = 0  # every device op replayed from graphs, no host op
    mixed_steps: int = 0  # graphs, with host ops (miss service) between segments
    eager_steps: int = 0  # nothing replayed: graphs off, the warm-up step, or capture failed
    captures: int = 0  # graph sets captured (one per static state size)
    prefill_graph_chunks: int = 0  # prompt chunks replayed from a prefill graph (PrefillGraphs)
    prefill_eager_chunks: int = 0  # prompt chunks run eagerly (see PrefillGraphs.why_eager)
    prefill_captures: int = 0  # prefill graphs captured (one per padded length used)


@dataclass
class _MoeBuffers:
    ids: torch.Tensor  # [1, A] int64, written by the router
    weights: torch.Tensor  # [1, A] model dtype
    slots: torch.Tensor  # [1, A] int64, the slot of each id (routed and table modes)
    slots_host: torch.Tensor | None  # pinned [1, A] staging of ``slots`` (routed mode)
    table: torch.Tensor | None  # [E] int64 expert -> slot (table mode)
    refs: list[SlotRef]  # the lookup's references, checked when the expert step is queued
    predicted: torch.Tensor | None = None  # [1, A] int64: the next host-op layer's experts, predicted
    predicted_weights: torch.Tensor | None = None  # [1, A] (select writes both)
    # prefetch two ahead: the host-op layer after that one's, predicted from the same stream
    predicted2: torch.Tensor | None = None
    predicted2_weights: torch.Tensor | None = None
    # where the shared expert's down projection runs in the expert step's launch (``fold_down``):
    # its input (SiLU(gate) * up, [1, S]) and the router's logits [1, E + 1], from the router's
    # launch, static so that a later segment's graph reads them
    mid: torch.Tensor | None = None
    logits: torch.Tensor | None = None


class DecodeGraphs:
    """One decode step over static buffers: of one sequence (its own static state, ``pool``
    None), or of ``rows`` sequences of a batch's state pool at once (``pool``: row n's state
    is the pool's entry ``slots[n]``, written before each step with the rows' positions and
    tokens; ``run_rows``). Rows never meet: every kernel computes a row as a one-row step
    does, so a batch's row is its sequence's step whichever rows share it (the engine's
    start-up probe checks it, ``Runner.probe_batch``). Or (``window``, a one-sequence state)
    a speculative verify window: ``rows`` consecutive tokens of that one sequence, each row
    computed as the one-row step at its position computes it (``run_window``). Or (``head``,
    the model's MTP head) its one-row draft step over a state of its own: the input row is the
    head's ``fc`` of the token's embedding and :attr:`hidden_in` (the main model's final normed
    hidden row, or the head's own last), the outputs its normed hidden row (:attr:`hidden`),
    logits and greedy token (speculative.py ``MtpDrafter``)."""

    def __init__(
        self,
        model,
        args,
        cache,
        policy,
        device: torch.device,
        capacity: int,
        counters: DecodeCounters | None = None,
        rows: int = 1,
        pool: DecodeState | None = None,
        window: DecodeState | None = None,
        trail: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
        head=None,
    ) -> None:
        self.model, self.args, self.cache, self.policy = model, args, cache, policy
        self.device = torch.device(device)
        self.capacity = capacity
        self.head = head
        self.layers = model.model.layers if head is None else head.layers
        ref = model.model.embed_tokens.weight
        self.dtype = ref.dtype
        D, K, N = args.hidden_size, args.num_experts_per_tok, rows
        self.rows = N
        kw = dict(device=self.device)
        self.state = pool if pool is not None else window
        if self.state is None:
            self.state = (
                model.new_state(1, capacity, device=self.device)
                if head is None
                else head.new_state(capacity, self.device, self.dtype)
            )
        # slots, positions and tokens of the rows: one buffer, written by one copy a step
        self.indices = torch.zeros(3, N, dtype=torch.long, **kw)
        self.slots = self.indices[0] if pool is not None else None
        self.pos = self.indices[1]
        self.token = self.indices[2].view(N, 1)
        self.x = torch.zeros(N, D, dtype=self.dtype, **kw)
        self.h = torch.zeros_like(self.x)
        self.hq = None  # h quantized to int8 per 32 columns by the router's launch (int8 expert activations)
        if policy.moe.act == "int8":
            from edgerun.kernels.qlinear_w4a8 import xq_buffers

            self.hq = xq_buffers(N, D, self.device)
        self.shared = torch.zeros_like(self.x)
        R = args.rotary_dim
        self.static = StaticStep(
            cos=torch.zeros(N, R, dtype=self.dtype, **kw),
            sin=torch.zeros(N, R, dtype=self.dtype, **kw),
            pos=self.pos,
            kv_index=torch.arange(capacity, **kw),
            fused=policy.dense == "triton",
            inv_freq=model.rotary.inv_freq,
            slots=self.slots,
            window=window is not None,
        )
        self.logits = torch.zeros(N, args.vocab_size, dtype=self.dtype, **kw)
        self.chosen = torch.zeros(N, 1, dtype=self.dtype, **kw)  # the greedy token's logit
        # the greedy token of each step and its logit, read back through two host slots (see
        # ``launch``): argmax takes a NaN as the largest value, so a finite chosen logit means
        # there is no NaN and no +inf among the step's logits, at the cost of one tiny gather
        cuda = self.device.type == "cuda"
        # with the fused kernels (their probe checks this one too), the argmax and its logit in
        # one launch (``sample_triton.greedy``), where torch takes two
        self._greedy = None
        if policy.dense == "triton":
            from edgerun.kernels.sample_triton import greedy_scratch

            self._greedy = greedy_scratch(N, self.device)
        self.token_host = torch.zeros(2, N, dtype=torch.long, pin_memory=cuda)
        self.chosen_host = torch.zeros(2, N, dtype=self.dtype, pin_memory=cuda)
        self.events = [torch.cuda.Event() for _ in range(2)] if cuda else None
        self._slot = 0
        # DIRECT_PICK (one sequence, the fused greedy launch): the greedy launch writes host slot
        # pos % 2 and pos + 1; ``_dev_pos``, the position the device holds where the host knows it
        self.direct = (
            DIRECT_PICK and self._greedy is not None and pool is None and window is None and head is None
        )
        self._dev_pos: int | None = None
        self.modes: dict[int, str] = {}
        self.moe: dict[int, _MoeBuffers] = {}
        for i, layer in enumerate(self.layers):
            if isinstance(layer.mlp, SparseMoe):
                mode, table = self._expert_mode(i)
                self.modes[i] = mode
                self.moe[i] = _MoeBuffers(
                    ids=torch.zeros(N, K, dtype=torch.long, **kw),
                    weights=torch.zeros(N, K, dtype=self.dtype, **kw),
                    slots=torch.zeros(N, K, dtype=torch.long, **kw),
                    slots_host=torch.zeros(N, K, dtype=torch.long, pin_memory=self.device.type == "cuda")
                    if mode == "routed"
                    else None,
                    table=table,
                    refs=[],
                )
        if pool is not None:
            why = rows_unsupported(self.static.fused, self.modes, self.layers)
            if why:
                raise EdgerunError(f"a batch's decode step on {self.device.type}: {why}")
        # a verify window: the DeltaNet layers' states after each row (``DecodeState.rollback``),
        # and the rows' final normed hidden states (the MTP head's input)
        self.trail: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.is_window = window is not None
        self.hidden: torch.Tensor | None = torch.zeros_like(self.x) if head is not None else None
        self.hidden_in = torch.zeros_like(self.x) if head is not None else None
        self.both = torch.zeros(N, 2 * D, dtype=self.dtype, **kw) if head is not None else None  # fc's input
        if window is not None:
            why = rows_unsupported(self.static.fused, self.modes, self.layers, one_sequence=True)
            if why:
                raise EdgerunError(f"a speculative verify step on {self.device.type}: {why}")
            self.hidden = torch.zeros_like(self.x)
            # ``trail``: buffers of at least N states a DeltaNet layer, shared by the windows of
            # one state (``verify``); else the window's own
            trail = trail if trail is not None else window_trail(self.state, N)
            self.trail = {i: (conv[:N], recurrent[:N]) for i, (conv, recurrent) in trail.items()}
        # decode prefetch: where layer i and the next MoE layer j both serve misses on the host,
        # j's router runs on i's residual stream in i's segment, and i's host op (after its own
        # lookup) prefetches what it predicts, so j's reads overlap i's expert step and j's mixer
        # (a host tier's layers are left out: their misses are copies, their prefetch reads nothing)
        host = [
            i
            for i, m in self.modes.items()
            if m in ("routed", "eager") and i not in getattr(self.cache, "tier", {})
        ]
        prefetch = self.cache is not None and self.cache.prefetch_depth > 0
        self.predict = (
            {i: j for i, j in zip(host, host[1:], strict=False) if j == self._next_moe(i)} if prefetch else {}
        )
        # reading two ahead (the cache's prefetch_ahead): the layer after j too, where it follows
        # j as j follows i; j's own prediction refines it a layer later
        ahead = self.cache.prefetch_ahead if prefetch else 0
        self.predict2 = (
            {i: self.predict[j] for i, j in self.predict.items() if j in self.predict} if ahead > 1 else {}
        )
        for i in self.predict:
            buf = self.moe[i]
            buf.predicted, buf.predicted_weights = torch.zeros_like(buf.ids), torch.zeros_like(buf.weights)
            if i in self.predict2:
                buf.predicted2, buf.predicted2_weights = (
                    torch.zeros_like(buf.ids),
                    torch.zeros_like(buf.weights),
                )
        # one row of one sequence with the fused kernels: each MoE layer whose expert step runs the
        # decode kernel over its slots also runs its shared expert's down projection there (one
        # launch fewer a layer; its bits those of its own launch)
        self.fold_down = {i for i in self.modes if self._folds_down(i)}
        for i in self.fold_down:
            mlp, buf = self.layers[i].mlp, self.moe[i]
            buf.mid = torch.zeros(N, mlp.shared_expert.down_proj.in_features, dtype=self.dtype, **kw)
        # each MoE layer whose expert step runs the decode kernel over a slot table routes there:
        # the router's launch leaves its logits, the expert launch picks and stores the top-k
        # (``moe_experts``' ``route``; router_topk's bits, one launch fewer a layer)
        self.fold_topk = {i for i in self.modes if self._folds_topk(i)}
        for i in self.fold_down | self.fold_topk:
            self.moe[i].logits = torch.zeros(
                N, self.layers[i].mlp.gate.proj.out_features, dtype=self.dtype, **kw
            )
        self.ops = self._plan()
        if head is not None and self.rows > 1:  # the MTP head's windows: every projection a GEMV
            self.ops = [(kind, _in_draft_rows(fn)) for kind, fn in self.ops]
        self._segments: list | None = None
        self.graphs: list[torch.cuda.CUDAGraph] | None = None
        self.counters = counters or DecodeCounters()
        self.prefill: PrefillGraphs | None = None  # the runner's, made on its first prompt
        self.windows: dict[int, DecodeGraphs] = {}  # verify windows over this state, by row count
        self._trail: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # their shared DeltaNet trail
        self._trail_rows = 0
        self.head_step: DecodeGraphs | None = None  # the MTP head's draft step (``draft_step``)
        self.chains: dict = {}  # device-decided speculative steps by draft count (engine/spec_steps.py)
        self.fallbacks: dict[str, str] = {}
        # sampled steps (``sample_with``): the draw's buffers, whether it sorts, its graphs by that
        self._draw: SampleBuffers | None = None
        self._draw_sort: bool | None = None
        self._draw_graphs: dict[bool, torch.cuda.CUDAGraph | None] = {}
        self._warm = False
        self._far_steps = 0  # decode steps since load: a far tier's device set follows its use

    # ---- planning ---------------------------------------------------------------------

    def _expert_mode(self, i: int) -> tuple[str, torch.Tensor | None]:
        """(mode, the device slot table in table mode)."""
        experts = self.layers[i].mlp.experts
        if self.cache is None and isinstance(experts, StreamingExperts):
            self.cache = experts.cache
        return expert_mode(experts, self.policy)

    def _folds_down(self, i: int) -> bool:
        """Whether layer i's expert step runs its shared expert's down projection (see __init__)."""
        mlp = self.layers[i].mlp
        if self.rows != 1 or self.is_window or self.modes[i] not in ("routed", "table"):
            return False
        return self.policy.moe.impl == "triton" and mlp.defers_down(self.x, self.static.fused)

    def _folds_topk(self, i: int) -> bool:
        """Whether layer i's expert step routes the router's logits itself (see __init__)."""
        experts = self.layers[i].mlp.experts
        if not (self.static.fused and self.modes[i] == "table" and isinstance(experts, StreamingExperts)):
            return False
        return folds_route(self.policy.moe, experts.cache.bundle.layouts[i], self.rows)

    def _next_moe(self, i: int) -> int | None:
        return next((j for j in sorted(self.modes) if j > i), None)

    def _plan(self) -> list[tuple[str, object]]:
        ops: list[tuple[str, object]] = [("device", self._embed)]
        for i in range(len(self.layers)):
            ops.append(("device", partial(self._mixer, i)))
            mode = self.modes.get(i)
            if mode == "routed":
                ops.append(("host", partial(self._route, i)))
            if mode in ("routed", "table"):
                ops.append(("device", partial(self._experts_slots, i)))
            elif mode == "stacked":
                ops.append(("device", partial(self._experts_stacked, i)))
            elif mode == "eager":
                ops.append(("host", partial(self._experts_eager, i)))
        ops.append(("device", self._head))
        return ops

    def segments(self) -> list[list]:
        """Device ops grouped between host ops: [[device...], host, [device...], ...]."""
        if self._segments is None:
            self._segments = self._group()
        return self._segments

    def _group(self) -> list:
        out: list = []
        for kind, fn in self.ops:
            if kind == "host":
                out.append(fn)
            elif out and isinstance(out[-1], list):
                out[-1].append(fn)
            else:
                out.append([fn])
        return out

    @property
    def host_ops(self) -> int:
        return sum(1 for seg in self.segments() if not isinstance(seg, list))

    # ---- the operations ---------------------------------------------------------------

    def _embed(self) -> None:
        embed, h = self.model.model.embed_tokens.weight, self.head
        if h is not None and self.static.fused:  # the MTP head's input in one launch, then its fc
            from edgerun.kernels import spec_triton  # Triton only with the fused kernels

            norms = (h.pre_fc_norm_embedding, h.pre_fc_norm_hidden)
            spec_triton.mtp_input(self.indices[2], embed, self.hidden_in, *norms, self.both)
            h.fc(self.both, out=self.x)
        else:
            torch.index_select(embed, 0, self.indices[2], out=self.x)
            if h is not None:  # the MTP head's input: fc(its norms of the embedding and hidden_in)
                both = torch.cat(
                    [h.pre_fc_norm_embedding(self.x), h.pre_fc_norm_hidden(self.hidden_in)], dim=-1
                )
                self.x.copy_(h.fc(both))
        if not self.static.fused:  # the fused attention kernel computes its rope from the position
            cos, sin = self.model.rotary(self.pos, self.dtype)
            self.static.cos.copy_(cos)
            self.static.sin.copy_(sin)

    def _mixer(self, i: int) -> None:
        layer = self.layers[i]
        layer.mix_static(self.x, self.state.layers[i], self.static, self.trail.get(i))
        mlp, norm = layer.mlp, layer.post_attention_layernorm
        if not isinstance(mlp, SparseMoe):
            mlp(self.x, "residual", self.x, norm=norm)
            return
        buf = self.moe[i]
        fused = self.static.fused  # the fused kernels (the shared gate_up in the router GEMV's launch)
        mlp.route_shared(
            self.x,
            (buf.weights, buf.ids),
            fused,
            norm,
            self.h,
            self.shared,
            buf.mid,
            buf.logits,
            i in self.fold_down,
            self.hq,
            topk=i not in self.fold_topk,
        )  # MLP input in h (and hq)
        if i in self.predict:  # the next layer's router on this residual stream (see __init__)
            nxt = self.layers[self.predict[i]]
            guess = (buf.predicted_weights, buf.predicted)
            nxt.mlp.gate.route(self.x, guess, fused, nxt.post_attention_layernorm)
        if i in self.predict2:  # and the one after's, two ahead
            after = self.layers[self.predict2[i]]
            guess = (buf.predicted2_weights, buf.predicted2)
            after.mlp.gate.route(self.x, guess, fused, after.post_attention_layernorm)

    def _into(self, i: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The expert step's result goes into the residual stream, with the shared expert's."""
        return self.x, self.shared if self.layers[i].mlp.has_shared else None

    def _route(self, i: int) -> None:
        buf = self.moe[i]
        rows = buf.ids.tolist()  # waits for the router
        self._count_window(i, rows)
        # the next layer's predicted reads queue behind this layer's own, before those are awaited
        slots, buf.refs = lookup(self.cache, i, rows, "cpu", then=partial(self._prefetch, i))
        buf.slots_host.copy_(slots)
        buf.slots.copy_(buf.slots_host, non_blocking=True)

    def _prefetch(self, i: int) -> None:
        """After layer i's lookup: start the reads of the next layer's predicted experts (and,
        two ahead, the first guesses of the layer after it)."""
        if i in self.predict:  # the rows' predictions, each expert once, in the rows' order
            rows = self.moe[i].predicted.tolist()
            self.cache.prefetch(self.predict[i], list(dict.fromkeys(e for row in rows for e in row)))
        if i in self.predict2:
            rows = self.moe[i].predicted2.tolist()
            self.cache.prefetch(self.predict2[i], list(dict.fromkeys(e for row in rows for e in row)), 2)

    def _experts_slots(self, i: int) -> None:
        buf = self.moe[i]
        experts = self.layers[i].mlp.experts
        shared_down = None
        if i in self.fold_down:  # the shared expert's down projection in the gate_up launch
            shared_down = self.layers[i].mlp.shared_down(buf.mid, buf.logits)
        if isinstance(experts, HeldExperts):  # the MTP head's, held outside the cache
            experts.run(
                self.h, buf.ids, buf.weights, self.policy.moe, into=self._into(i), shared_down=shared_down,
                xq=self.hq,
            )  # fmt: skip
            return
        # table: the kernel looks every slot up itself; routed: the refs of the lookup just before
        # this segment (captured: checked at capture, and at replay nothing runs between the
        # lookup and the kernel)
        route = None
        if i in self.fold_topk:  # the router's launch left its logits: this launch routes them
            gate = self.layers[i].mlp.gate
            route = RouterLogits(buf.logits, gate.num_experts, gate.normalize)
        run_experts(
            self.cache, i, self.h, buf.slots, buf.ids, buf.weights, self.policy.moe, buf.refs,
            table=buf.table, into=self._into(i), shared_down=shared_down, xq=self.hq, route=route,
        )  # fmt: skip

    def _experts_eager(self, i: int) -> None:
        buf = self.moe[i]
        experts = self.layers[i].mlp.experts
        if experts.split is not None:  # the layer's forward splits the step with the CPU
            self._prefetch(i)
            add_into(experts(self.h, buf.ids, buf.weights), self._into(i))
            return
        rows = buf.ids.tolist()
        self._count_window(i, rows)
        slots, refs = lookup(self.cache, i, rows, self.device, then=partial(self._prefetch, i))
        x, shared = self._into(i)
        # a verify window's rows one at a time: the reference multiplies an expert's rows together,
        # and a product's bits may depend on how many rows it takes
        for r in [slice(j, j + 1) for j in range(self.rows)] if self.is_window else [slice(None)]:
            xq = None if self.hq is None else tuple(t[r] for t in self.hq)
            run_experts(
                self.cache, i, self.h[r], slots[r], buf.ids[r], buf.weights[r], self.policy.moe, refs,
                into=(x[r], None if shared is None else shared[r]), xq=xq,
            )  # fmt: skip

    def _count_window(self, i: int, rows: list[list[int]]) -> None:
        """A verify window's union of its rows' experts, counted where the host sees the ids (a
        layer whose lookup runs on the device, table mode, holds every expert: not counted)."""
        if self.is_window and self.rows > 1:
            self.cache.count_window(i, len({e for row in rows for e in row}))

    def _experts_stacked(self, i: int) -> None:
        buf = self.moe[i]
        mlp = self.layers[i].mlp
        if self.head is not None and self.rows > 1:  # the MTP head's rows only draft: one pass
            routed = mlp.experts.gathered_rows(self.h, buf.ids, buf.weights)
        else:  # ``gathered`` takes one token: a verify window's rows one at a time, each as its step
            parts = [
                mlp.experts.gathered(self.h[r : r + 1], buf.ids[r : r + 1], buf.weights[r : r + 1])
                for r in range(self.rows)
            ]
            routed = parts[0] if self.rows == 1 else torch.cat(parts)
        self.x.add_(mlp.combine(routed, self.shared if mlp.has_shared else None))

    def _head(self) -> None:
        norm = self.model.model.norm if self.head is None else self.head.norm
        self.model.lm_head(self.x, out=self.logits, norm=norm, norm_out=self.hidden)
        # the greedy next token, where the next step's embedding reads it (``launch``); a host
        # that samples otherwise writes its own token there first
        if self._greedy is not None:
            from edgerun.kernels.sample_triton import greedy

            direct = (self.pos, self.token_host, self.chosen_host) if self.direct else None
            greedy(self.logits, self.indices[2], self.chosen[:, 0], self._greedy, direct=direct)
            return
        torch.argmax(self.logits, dim=-1, keepdim=True, out=self.token)
        torch.gather(self.logits, -1, self.token, out=self.chosen)

    def routes(self) -> dict[int, list[list[int]]]:
        """The expert ids each MoE layer's router chose in the last step (its static buffers)."""
        return {i: buf.ids.tolist() for i, buf in self.moe.items()}

    # ---- running a step ---------------------------------------------------------------

    def reset(self) -> DecodeState:
        """The static state, emptied for a new sequence (KV past the position is masked)."""
        return empty_state(self.state)

    def step(self, token: int | None) -> torch.Tensor:
        """Consume ``token`` (None: the greedy token the previous step chose, on the device) at
        the state's position; the next-token logits [V] (a static buffer: read it before the
        next step)."""
        self._run(token)
        return self.logits[0]

    def launch(self, token: int | None = None) -> int:
        """Queue a step without waiting for it: consume ``token``, or (None) the token the
        previous step chose on the device (greedy, or drawn: :meth:`sample_with`), so the host
        can queue step i + 1 before it reads step i's token. Returns a handle for
        :meth:`result`; two steps may be in flight (with :attr:`direct`, a step's host slot is
        its position's parity: read a step's result before the step two positions on is queued)."""
        k = self.state.pos % 2 if self.direct else self._slot
        self._run(token)
        if self._draw_sort is not None:
            self._draw_step()
        self._slot = k ^ 1
        # the greedy launch wrote the slot itself (direct); a draw's token is copied over it
        self._read_back(k, copy=not self.direct or self._draw_sort is not None)
        return k

    def sample_with(self, sampler) -> None:
        """Each :meth:`launch` from now draws its token on the device (kernels/sample_triton.py)
        by ``sampler``'s parameters and seed, keyed by the position it predicts, instead of
        taking the argmax (``sampler`` None, or greedy: the argmax again). The draw is the one
        ``Sampler`` makes of the same logits at the same position, bit for bit (the same kernel
        and inputs): replayed from a graph of its own, captured on its first use (one a sort
        setting), when the step's are."""
        if sampler is None or sampler.params.greedy:
            self._draw_sort = None
            return
        if self.rows != 1 or self.is_window or self.head is not None:
            raise ValueError("sample_with draws the token of a one-sequence decode step")
        from edgerun.kernels.sample_triton import SampleBuffers

        if self._draw is None:
            self._draw = SampleBuffers(1, self.args.vocab_size, self.device, self.dtype)
        self._draw.set([sampler.row()])
        self._draw_sort = sampler.sort

    def _draw_op(self) -> None:
        from edgerun.kernels.sample_triton import sample

        # the step consumed the token at pos: its logits are for position pos + 1 (direct: the
        # greedy launch has advanced pos to it already)
        add = 0 if self.direct else 1
        sample(self.logits, self._draw, self.pos, add, self.indices[2], self.chosen[:, 0], self._draw_sort)

    def _draw_step(self) -> None:
        """The draw after a step: replayed where the step's graphs replay, else eager."""
        if not self.policy.graphs or self.graphs is None:
            self._draw_op()
            return
        sort = self._draw_sort
        if sort not in self._draw_graphs:
            run_on_side_stream(self._draw_op, self.device)  # compiles, and is this step's draw
            try:
                self._draw_graphs[sort] = capture_graph(self._draw_op, self.device)
            except Exception as exc:  # noqa: BLE001 - any capture failure: draw eagerly, say why
                self._draw_graphs[sort] = None
                self.fallbacks["draw_graphs"] = (
                    f"capture failed, sampled draws eager: {type(exc).__name__}: {exc}"
                )
            return
        g = self._draw_graphs[sort]
        if g is None:
            self._draw_op()
        else:
            g.replay()

    def result(self, handle: int) -> int:
        """The token the step behind ``handle`` chose (greedy or drawn; waits for that step
        only); refused when its logits were not all finite."""
        tokens, chosen = self._picks(handle)
        return greedy_pick(tokens[0], chosen[0])

    def _read_back(self, k: int, copy: bool = True) -> None:
        """Queue the copy of the step's greedy tokens and their logits into host slot ``k``
        (``copy`` False: the greedy launch wrote it, :attr:`direct`), and the slot's event."""
        if copy:
            self.token_host[k].copy_(self.indices[2], non_blocking=True)
            self.chosen_host[k].copy_(self.chosen[:, 0], non_blocking=True)
        if self.events is not None:
            self.events[k].record()

    def _picks(self, k: int) -> tuple[list[int], list[float]]:
        """Host slot ``k``'s greedy tokens and their logits, one a row (waits for them)."""
        if self.events is not None:
            self.events[k].synchronize()
        return self.token_host[k].tolist(), self.chosen_host[k].float().tolist()

    def _run(self, token: int | None) -> None:
        if self.state.pos >= self.capacity:
            raise ValueError(
                f"decode state holds {self.capacity} positions; position {self.state.pos} is past it"
            )
        if token is not None:
            self.token.fill_(token)
        if self._dev_pos != self.state.pos:  # (direct: the last step's greedy launch advanced it)
            self.pos.fill_(self.state.pos)
        self._dev_pos = None  # unknown until the step is queued
        self._execute()
        if self.direct:
            self._dev_pos = self.state.pos + 1
        self.state.pos += 1

    def run_rows(self, slots: list[int], positions: list[int], tokens: list[int]) -> None:
        """Queue one step of the rows (pool mode): row n consumes ``tokens[n]`` at
        ``positions[n]`` of the pool's entry ``slots[n]``; its logits land in row n of
        :attr:`logits`, its greedy token and that token's logit in :attr:`token` and
        :attr:`chosen` (:meth:`read_rows`)."""
        if self.slots is None:
            raise ValueError("run_rows steps a batch's pool; this decoder holds one sequence")
        if not len(slots) == len(positions) == len(tokens) == self.rows:
            raise ValueError(f"a step of {self.rows} rows takes {self.rows} slots, positions and tokens")
        if len(set(slots)) != len(slots):
            raise ValueError(f"rows of one step share a pool entry: slots {slots}")
        if max(positions) >= self.capacity:
            raise ValueError(
                f"the pool's entries hold {self.capacity} positions; position {max(positions)} is past it"
            )
        self.indices.copy_(torch.tensor([slots, positions, tokens], dtype=torch.long))
        self._execute()

    def verify(self, tokens: list[int], most: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """A speculative verify window over this decoder's state: ``tokens`` at positions
        pos..pos + N - 1, the state advanced by N -> (logits [N, V], the final normed hidden
        states [N, D]; copies), row j bit for bit the one-row step at its position (with the
        KV and DeltaNet state rows < j left). Each DeltaNet layer's state after each row is kept
        for ``DecodeState.rollback``, in buffers the windows share, of ``most`` rows (the longest
        window the caller asks for, K + 1: the planner's count). Run by a decoder of N rows over
        this state, made (and, with graphs, captured) on a window of N rows' first use; counted
        as this decoder's steps are."""
        w = self.window(len(tokens), most)
        with verify_window():
            w.run_window(tokens)
        self.fallbacks.update(w.fallbacks)
        return w.logits.clone(), w.hidden.clone()

    def window(self, n: int, most: int = 0) -> DecodeGraphs:
        """The decoder of a window of ``n`` rows over this decoder's state (made on first use;
        ``most``: see :meth:`verify`); of the MTP head's rows for its draft step."""
        if max(n, most) > self._trail_rows:  # (re)made for the longest window, its windows with it
            self.windows.clear()
            self._trail_rows = max(n, most)
            self._trail = window_trail(self.state, self._trail_rows)
        if n not in self.windows:
            self.windows[n] = DecodeGraphs(
                self.model, self.args, self.cache, self.policy, self.device, self.capacity,
                self.counters, rows=n, window=self.state, trail=self._trail, head=self.head,
            )  # fmt: skip
        return self.windows[n]

    def draft_step(self) -> DecodeGraphs:
        """The model's MTP head's one-row draft step (head mode, see the class) at this
        decoder's capacity, made (and, with graphs, captured on its first step) on first use.
        Its steps are not the engine's decode steps: counted apart; a capture that failed is
        in the runner's fallbacks as ``mtp_graphs``."""
        if self.head_step is None:
            self.head_step = DecodeGraphs(
                self.model, self.args, None, self.policy, self.device, self.capacity, head=self.model.mtp
            )
        return self.head_step

    def run_window(self, tokens: list[int]) -> None:
        """Queue the verify window (window mode, see :meth:`verify`): row j consumes
        ``tokens[j]`` at the state's position + j; within ``exact_rows``."""
        if not self.is_window:
            raise ValueError("run_window steps a verify window; this decoder was not made for one")
        start, n = self.state.pos, len(tokens)
        if n != self.rows:
            raise ValueError(f"a verify window of {self.rows} rows takes {self.rows} tokens, got {n}")
        if start + n > self.capacity:
            raise ValueError(
                f"decode state holds {self.capacity} positions; a window to position {start + n - 1} is past it"
            )
        self.indices[1:].copy_(torch.tensor([list(range(start, start + n)), tokens], dtype=torch.long))
        self._execute()
        self.state.pos += n
        for i, (conv, recurrent) in self.trail.items():
            self.state.layers[i].trail = [(conv[j : j + 1], recurrent[j : j + 1]) for j in range(n)]

    def continue_rows(self) -> None:
        """Queue the step after the last one over the same rows and pool entries (pool mode):
        each row consumes the greedy token the last step chose (already in the token row of
        :attr:`indices`) at its next position; nothing is copied from the host, so it can be
        queued before the last step's tokens are read (``RowSteps.advance``)."""
        if self.slots is None:
            raise ValueError("continue_rows steps a batch's pool; this decoder holds one sequence")
        self.pos.add_(1)
        self._execute()

    def next_host_slot(self) -> int:
        """The host slot (of two) the next read-back goes to."""
        k, self._slot = self._slot, self._slot ^ 1
        return k

    def read_rows(self) -> tuple[list[int], list[float]]:
        """The rows' greedy tokens and their logits, after :meth:`run_rows` (waits for the step)."""
        self._read_back(0)
        return self._picks(0)

    def _execute(self) -> None:
        if not self.policy.graphs:
            self._run_eager()
        elif not self._warm:
            self._warm_up()
        elif self.graphs is None:
            self._run_eager()  # capture failed: recorded in fallbacks
        else:
            self._replay()
        self.count_table_hits(self.rows)
        if self.cache is not None and self.cache.far:
            self._far_steps += 1
            if self._far_steps % FAR_REBALANCE_STEPS == 0:
                self.cache.rebalance_far()

    def count_table_hits(self, tokens: int) -> None:
        """The hits of ``tokens`` tokens' expert steps in table mode, which ran on the device (a
        replayed graph keeps no books)."""
        for i in self._table_layers():
            self.cache.count_hits(i, tokens * self.args.num_experts_per_tok)

    def _table_layers(self) -> list[int]:
        """The streamed MoE layers whose expert steps run in table mode (every expert held)."""
        return [
            i
            for i, m in self.modes.items()
            if m == "table" and isinstance(self.layers[i].mlp.experts, StreamingExperts)
        ]

    def held_hits(self) -> dict[int, int]:
        """The hit counters of the table-mode layers, for :meth:`put_back` after a run that
        serves no request (a warm-up, a capture): held experts keep no other books."""
        return {i: self.cache.slots[i].counters.hits for i in self._table_layers()}

    def put_back(self, hits: dict[int, int]) -> None:
        for i, n in hits.items():
            self.cache.slots[i].counters.hits = n

    def prepare(self) -> bool:
        """The first step's one-time work (``_warm_up``: Triton compiles, library handles, the
        capture) done now, before a request: one step of token 0 at position 0, the state
        emptied after, the step not counted and the hits of held experts put back. A routed
        layer's lookups of that step stay in the cache's books (its misses were read: see
        :attr:`lookups_kept`). False where there is nothing to do: graphs off, or already warm."""
        if not self.policy.graphs or self._warm:
            return False
        c = self.counters
        was = c.graph_steps, c.mixed_steps, c.eager_steps
        hits = self.held_hits()
        self.reset()
        try:
            self._run(0)
            torch.cuda.synchronize(self.device)
        finally:
            self.reset()
            c.graph_steps, c.mixed_steps, c.eager_steps = was
            self.put_back(hits)
        return True

    def prepare_draw(self, sampler) -> bool:
        """The draw graph of ``sampler``'s sort setting (:meth:`sample_with`) compiled and
        captured now, on the step's logits buffer (its token is overwritten by the next step's
        input); False where there is nothing to do (greedy, graphs not replaying, captured already)."""
        if sampler.params.greedy or not self.policy.graphs or self.graphs is None:
            return False
        self.sample_with(sampler)  # its buffers made outside inference mode, as a request makes them
        try:
            if self._draw_sort in self._draw_graphs:
                return False
            with torch.inference_mode():  # the draw, as a request's steps run it
                self._draw_step()
            torch.cuda.synchronize(self.device)
        finally:
            self.sample_with(None)
        return True

    @property
    def lookups_kept(self) -> bool:
        """Whether a step's expert lookups stay in the cache's books (a layer streamed with
        misses: its host op looks up and reads), so a step run by :meth:`prepare` counts there."""
        return self.cache is not None and any(m in ("routed", "eager") for m in self.modes.values())

    def _run_eager(self) -> None:
        for _, fn in self.ops:
            fn()
        self.counters.eager_steps += 1

    def _warm_up(self) -> None:
        """The first step runs eagerly on a side stream (library handles, Triton compiles), then
        every segment is captured; a failed capture leaves the engine eager, recorded."""
        run_on_side_stream(self._run_eager, self.device)
        self._warm = True
        try:
            self.graphs = self._capture()
            self.counters.captures += 1
        except Exception as exc:  # noqa: BLE001 - any capture failure: run eagerly, say why
            self.graphs = None
            self.fallbacks["graphs"] = f"capture failed, decoding eagerly: {type(exc).__name__}: {exc}"

    def _capture(self) -> list[torch.cuda.CUDAGraph]:
        pool = torch.cuda.graph_pool_handle()
        graphs = [
            capture_graph(partial(_run_ops, seg), self.device, pool)
            for seg in self.segments()
            if isinstance(seg, list)
        ]
        torch.cuda.synchronize(self.device)
        return graphs

    def _replay(self) -> None:
        graphs = iter(self.graphs)
        for seg in self.segments():
            if isinstance(seg, list):
                next(graphs).replay()
            else:
                seg()
        if len(self.graphs) < len(self.segments()):  # host ops ran between the graphs
            self.counters.mixed_steps += 1
        else:
            self.counters.graph_steps += 1

    def describe(self) -> str:
        modes = sorted(set(self.modes.values()))
        n_graphs = sum(1 for s in self.segments() if isinstance(s, list))
        how = f"{n_graphs} graph(s) per step" if self.policy.graphs else "eager"
        how += f", dense {self.policy.dense}"
        text = f"decode {how}, {self.host_ops} host op(s) per step, expert steps {'/'.join(modes) or 'none'}"
        if self.direct:
            text += ", picks written to the host by the greedy launch"
        if self.windows:
            text += f"; verify windows of {'/'.join(map(str, sorted(self.windows)))} rows"
        if self.prefill is not None:
            p = self.prefill
            text += (
                f"; prefill: first chunks of up to {p.buckets[-1]} tokens from graphs"
                if p.why_eager is None and p.buckets
                else f"; prefill eager ({p.why_eager or 'no bucket fits'})"
            )
        return text


def _run_ops(ops: list) -> None:
    for fn in ops:
        fn()


def _in_draft_rows(fn):
    """``fn`` run within ``draft_rows`` (models/layers.py)."""

    def run() -> None:
        with draft_rows():
            fn()

    return run


def window_trail(state: DecodeState, rows: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Room for ``rows`` conv and recurrent states of each DeltaNet layer of ``state``, by layer."""
    return {
        i: (e.conv.new_zeros(rows, *e.conv.shape[1:]), e.recurrent.new_zeros(rows, *e.recurrent.shape[1:]))
        for i, e in enumerate(state.layers)
        if isinstance(e, DeltaState)
    }


def greedy_pick(token: int, chosen: float) -> int:
    """A step's token, given its logit (argmax takes a NaN as the largest value, so a finite
    chosen logit means no NaN and no +inf among the step's logits; a device draw's chosen logit
    is NaN where any logit is NaN or infinite); refused otherwise."""
    if not math.isfinite(chosen):
        raise NonFiniteLogits(f"the step's logits hold NaN or infinite values (its chosen logit is {chosen})")
    return token


def expert_mode(experts, policy) -> tuple[str, torch.Tensor | None]:
    """How a decode step runs a MoE layer's ``experts`` under the kernel ``policy`` (the module
    docstring's modes), with the device slot table in table mode."""
    if isinstance(experts, HeldExperts):  # every expert held as a block: table mode on the Triton kernels
        return ("table", experts.table) if policy.moe.impl == "triton" else ("stacked", None)
    if not isinstance(experts, StreamingExperts):
        return "stacked", None
    if policy.moe.impl != "triton" or experts.split is not None:  # CPU experts: host work
        return "eager", None
    table = experts.cache.slot_table(experts.layer)
    return ("table" if table is not None else "routed"), table


def rows_unsupported(fused: bool, modes: dict[int, str], layers, one_sequence: bool = False) -> str | None:
    """Why a step of a batch's rows (``one_sequence``: a verify window's rows of one sequence)
    cannot run over these kernels and expert steps; None when it can (rows of a pool need the
    fused attention and DeltaNet kernels, which index it by slot, and an expert step that takes
    several rows; a window's rows run the fused kernels' window modes, and resident stacked
    experts a row at a time)."""
    if not fused:
        if one_sequence:
            return "a verify window's rows need the Triton dense kernels (attention and DeltaNet), not in use"
        return "the rows of a pool need the Triton dense kernels (attention and DeltaNet by slot), not in use"
    if "stacked" in modes.values() and not one_sequence:
        return (
            "resident stacked experts (not held as blocks for the Triton expert kernel: experts not in "
            "bf16, or another expert kernel asked for) step one row at a time; serve a bundle with a "
            "quota, or bf16 weights on the Triton expert kernel"
        )
    split = [i for i, m in modes.items() if m == "eager" and layers[i].mlp.experts.split is not None]
    if split:
        return f"layers {split} split their experts with the CPU (--cpu-experts), one row at a time"
    return None


@dataclass(eq=False)
class Queued:
    """A batch step queued on the device: its rows (``engine/batch.Row``) in order, their
    logits (a copy) and the host slot its greedy tokens are read back into."""

    g: DecodeGraphs
    k: int
    logits: torch.Tensor
    rows: list
    picks: tuple[list[int], list[float]] | None = None

    def read(self) -> tuple[list[int], list[float]]:
        """The rows' greedy tokens and their logits (waits for the step, once)."""
        if self.picks is None:
            self.picks = self.g._picks(self.k)
        return self.picks


class RowSteps:
    """A batch's decode steps on CUDA: a :class:`DecodeGraphs` per row count 1..B over
    the batch's state pool, each captured on its first step (the start-up probe takes them
    all). Every step runs within ``exact_rows``: every kernel of the step computes a row as the
    one-row call does (the GEMVs in accumulators of its own, or by programs of its own), so a
    row's bits do not depend on the step's other rows.

    Greedy rows run a step ahead (:meth:`advance`): once a step over rows that are all greedy is
    queued, the step after it is queued too, each row consuming the token the first chose on
    the device, before the host reads those tokens; so the GPU does not wait for the host
    between steps (the batch's form of the one-sequence pipelining, ``Runner._tokens``). A
    row's next feed is then checked to be the token its step ahead consumed."""

    def __init__(self, model, args, cache, policy, device, pool: DecodeState, counters: DecodeCounters):
        self.make = partial(
            DecodeGraphs, model, args, cache, policy, device, pool.max_len, counters, pool=pool
        )
        self.by_rows: dict[int, DecodeGraphs] = {}
        self.own_fallbacks: dict[str, str] = {}  # kind -> reason, beside its decoders' fallbacks
        self.last: dict[int, Queued] = {}  # by row count: the step its decoder ran last
        self._unread: list[Queued] = []  # steps ahead whose tokens the host has not read yet
        self.pipeline = True  # greedy rows may run a step ahead (off: each step waits for its feed)
        self.ahead_steps = 0  # steps queued ahead of their rows' feeds
        self.ahead_rows = 0  # rows whose results came from a step ahead

    def graphs(self, n: int) -> DecodeGraphs:
        if n not in self.by_rows:
            self.by_rows[n] = self.make(rows=n)
        return self.by_rows[n]

    def step(self, slots: list[int], positions: list[int], tokens: list[int]):
        """(logits [N, V], a copy; the rows' greedy tokens; their logits) for one step."""
        g = self.graphs(len(slots))
        self._settle(g)
        with exact_rows():
            g.run_rows(slots, positions, tokens)
        logits = g.logits.clone()
        return (logits, *g.read_rows())

    def advance(self, rows: list, pipeline: bool = True) -> list[int]:
        """One step for ``rows`` (``engine/batch.Row``, each fed a token): sets each row's
        logits and greedy pick and advances its state's position. A row whose step ran ahead
        takes that step's results; the others run a step now. Then, with ``pipeline``, when
        every row of this step is greedy and the step has no host work, the next step is queued
        before this one's tokens are read. Returns the row counts of the steps queued."""
        ahead = [r for r in rows if r.ahead is not None]
        for r in ahead:
            if r.token != r.ahead_token:
                raise EdgerunError(
                    f"batch slot {r.slot}: fed token {r.token}, but its step ahead consumed {r.ahead_token}"
                )
        steps: list[Queued] = list({id(r.ahead): r.ahead for r in ahead}.values())
        ran = []
        rest = [r for r in rows if r.ahead is None]
        if rest:
            g = self.graphs(len(rest))
            self._settle(g)
            with exact_rows():
                g.run_rows([r.slot for r in rest], [r.state.pos for r in rest], [r.token for r in rest])
            steps.append(self._queued(g, rest))
            ran.append(len(rest))
        self.ahead_rows += len(ahead)
        nxt = None
        if pipeline and self.pipeline and len(steps) == 1:
            q = steps[0]
            if (
                {id(r) for r in q.rows} == {id(r) for r in rows}  # every row of the step fed now
                and self.last.get(q.g.rows) is q  # its decoder's buffers hold this step's rows
                and all(r.greedy and r.state.pos + 1 < r.state.max_len for r in q.rows)
                and q.g.host_ops == 0
            ):
                with exact_rows():
                    q.g.continue_rows()
                nxt = self._queued(q.g, q.rows)
                self._unread.append(nxt)
                ran.append(len(q.rows))
                self.ahead_steps += 1
        for q in steps:
            picked, chosen = q.read()
            if q in self._unread:
                self._unread.remove(q)
            for i, r in enumerate(q.rows):
                if r in rows:
                    r.logits, r.pick, r.token, r.ahead, r.ahead_token = (
                        q.logits[i],
                        (picked[i], chosen[i]),
                        None,
                        None,
                        None,
                    )
                    r.state.pos += 1
        if nxt is not None:
            for r in nxt.rows:
                r.ahead, r.ahead_token = nxt, r.pick[0]
        return ran

    def _queued(self, g: DecodeGraphs, rows: list) -> Queued:
        """The step just queued on ``g``: its logits copied, its tokens' read-back queued."""
        k = g.next_host_slot()
        g._read_back(k)
        q = Queued(g, k, g.logits.clone(), list(rows))
        self.last[g.rows] = q
        return q

    def unread(self) -> list[Queued]:
        """The steps ahead whose tokens are not read yet and whose rows have not all left (a
        step ahead of rows that then ended is dropped: its copies are queued before any later
        read-back into the same host slot, so nothing waits for it)."""
        self._unread = [q for q in self._unread if not all(r.left for r in q.rows)]
        return self._unread

    def _settle(self, g: DecodeGraphs) -> None:
        """Read the tokens of any step ahead still unread on ``g`` before its host slots and
        buffers are used again (a row that did not feed this round keeps its results)."""
        for q in [q for q in self.unread() if q.g is g]:
            q.read()
            self._unread.remove(q)

    @property
    def fallbacks(self) -> dict[str, str]:
        """Its decoders' fallbacks and its own (``batch_gemv``: the start-up probe refused the
        shared-row GEMV, ``Runner.probe_batch``)."""
        out = dict(self.own_fallbacks)
        for g in self.by_rows.values():
            out.update(g.fallbacks)
        return out

    def describe(self) -> str:
        if not self.by_rows:
            return "batch steps: none yet"
        any_g = next(iter(self.by_rows.values()))
        return f"batch steps of {sorted(self.by_rows)} rows: {any_g.describe()}"


def prefill_buckets(limit: int) -> list[int]:
    """The padded lengths prefill graphs are captured for, up to ``limit`` (included): 16, 32, 64,
    then every multiple of 128 (at most 127 padded rows where a chunk is longer than 64)."""
    return sorted({n for n in (16, 32, 64) if n < limit} | set(range(128, limit + 1, 128)) | {limit})


class PrefillGraphs:
    """A prompt's first chunk replayed from a CUDA graph: prefill is the model's forward over T
    rows, which is host-bound at the lengths chat prompts have (thousands of launches issued
    from Python for ~10 ms of GPU work at 512 tokens and 8 layers), so each padded length (a
    bucket, :func:`prefill_buckets`) is captured once, on first use, and replayed after.

    The chunk is padded with token 0 up to its bucket and the model runs on all of it with
    ``valid`` marking the prompt's rows (``CausalLM.hidden``): padded rows leave the DeltaNet
    state untouched and come after every prompt row causally; their KV lands past the position,
    where decode masks it and later tokens overwrite it; their routed-expert rows are computed
    and dropped (rows are independent, in ``kernels/moe_triton``'s ``moe_gemv`` and
    ``moe_grouped`` alike). The logits are those of the last prompt row. Only the first chunk
    of a sequence (position 0) and only when every expert step is capturable (every MoE layer
    in table mode) replays; anything else runs the same forward eagerly and is counted
    (``prefill_eager_chunks``, and why in :attr:`why_eager`).
    """

    def __init__(
        self,
        decoder: DecodeGraphs,
        limit: int = PREFILL_GRAPH_TOKENS,
        state: DecodeState | None = None,
        lane: int = 0,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        """``state`` (default: the decoder's static state), ``lane`` and ``stream``: a prefill
        lane's own scratch state, scratch set (``kernels/scratch.py``) and stream, which it
        warms up and captures on (:class:`PrefillLanes`); by default the side stream."""
        self.decoder = decoder
        self.state = state if state is not None else decoder.state
        self.lane, self.stream = lane, stream
        self.buckets = prefill_buckets(min(limit, decoder.capacity, self.state.max_len))
        self.graphs: dict[
            int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None
        ] = {}
        self.hidden: torch.Tensor | None = None  # the last replayed chunk's final normed hidden rows
        self.pool = None
        modes = set(decoder.modes.values())
        self.why_eager = (
            "CUDA graphs off" if not decoder.policy.graphs
            else f"expert steps {'/'.join(sorted(modes - {'table'}))} are not capturable" if modes - {"table"}
            else None
        )  # fmt: skip

    def bucket(self, start: int, n: int) -> int | None:
        """The padded length a chunk of ``n`` rows at position ``start`` replays at, or None."""
        if self.why_eager is not None or start != 0:
            return None
        return next((b for b in self.buckets if b >= n), None)

    def prepare(self, n: int) -> int | None:
        """The graph a first chunk of ``n`` rows replays captured now (``_capture``: nothing
        counted, the state emptied after); its bucket, or None where there is nothing to do
        (such a chunk does not replay, or its bucket is captured already)."""
        b = self.bucket(0, n)
        if b is None or b in self.graphs:
            return None
        self.graphs[b] = self._capture(b)
        return b

    def run(self, ids: torch.Tensor, start: int) -> torch.Tensor | None:
        """The chunk ``ids`` [1, n] (on the device) at ``start`` through a graph: its last logits
        [V] (a static buffer: read it before the next prefill), the state advanced by n; None
        where it does not replay (then the caller runs it eagerly)."""
        n = ids.shape[1]
        b = self.bucket(start, n)
        if b is None or self.graphs.get(b, ...) is None:
            return None
        d = self.decoder
        self.prepare(n)  # captured on first use (a failed capture leaves None: eager)
        if self.graphs[b] is None:
            return None
        graph, tokens, n_valid, logits, hidden = self.graphs[b]
        tokens[:, :n].copy_(ids)
        tokens[:, n:].zero_()
        n_valid.fill_(n)
        graph.replay()
        self.hidden = hidden[:, :n]  # the MTP head's input (speculative decoding's prompts)
        self.state.pos = start + n
        d.count_table_hits(n)
        d.counters.prefill_graph_chunks += 1
        return logits[0]

    def reset(self) -> DecodeState:
        """The state emptied for a new sequence (the decoder's own, or the lane's)."""
        return empty_state(self.state)

    def _forward(self, tokens, n_valid, logits, hidden) -> None:
        model = self.decoder.model
        valid = torch.arange(tokens.shape[1], device=tokens.device) < n_valid
        with scratch_set(self.lane):
            hidden.copy_(model.hidden(tokens, self.state, valid=valid))
            logits.copy_(model.lm_head(hidden[0].index_select(0, n_valid - 1)))

    def _capture(self, b: int):
        """Warm up (Triton compiles and autotunes, library handles) on a side stream, then capture
        bucket ``b``; the state is emptied again after each (both start a sequence). A failed
        capture leaves that bucket eager, recorded in the decoder's fallbacks."""
        d = self.decoder
        kw = dict(device=d.device)
        tokens = torch.zeros(1, b, dtype=torch.long, **kw)
        n_valid = torch.full((1,), b, dtype=torch.long, **kw)
        logits = torch.zeros(1, d.args.vocab_size, dtype=d.dtype, **kw)
        hidden = torch.zeros(1, b, d.args.hidden_size, dtype=d.dtype, **kw)
        # the two runs below serve no request: the cache's books (held experts keep none) are put back
        hits = d.held_hits()
        forward = partial(self._forward, tokens, n_valid, logits, hidden)
        try:
            run_on_side_stream(forward, d.device, self.stream)
            self.reset()
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            graph = capture_graph(forward, d.device, self.pool, self.stream)
            torch.cuda.synchronize(d.device)
        except Exception as exc:  # noqa: BLE001 - any capture failure: this length runs eagerly, say why
            d.fallbacks["prefill_graphs"] = (
                f"prefill capture at {b} tokens failed, eager: {type(exc).__name__}: {exc}"
            )
            return None
        finally:
            self.reset()
            d.put_back(hits)
        d.counters.prefill_captures += 1
        return graph, tokens, n_valid, logits, hidden


def empty_state(state: DecodeState) -> DecodeState:
    """``state`` emptied for a new sequence: DeltaNet states zeroed, position 0 (KV past the
    position is masked)."""
    for entry in state.layers:
        if isinstance(entry, DeltaState):
            entry.conv.zero_()
            entry.recurrent.zero_()
            entry.trail = None
    state.pos = 0
    return state


class PrefillLanes:
    """The first chunks of several batch sequences' prompts prefilled at the same time: short
    prompts are bound by the latency of many small kernels, so one prompt leaves most of the GPU
    idle and the prompts of requests that arrive together (a batch's joiners) would otherwise
    run one after another. Each of ``n`` lanes has a stream, a scratch state (one chunk long), a
    scratch set for the kernels that keep counters (``kernels/scratch.py``) and prefill graphs
    of its own, warmed up and captured on its stream (so cuBLAS's per-stream workspace is its
    own too); prompts take the lanes in turn.

    A lane runs what the one-sequence prefill graph runs, over buffers of its own: a prompt's
    bits do not depend on its lane or on the prompts beside it (the batch's start-up probe and
    tests/engine/test_batch_cuda.py check it). :meth:`run` returns the chunk's last logits and
    an event recorded on the lane's stream after the sequence's state was copied into its slot:
    wait for it before reading either (``Runner._batch_tokens``)."""

    def __init__(self, decoder: DecodeGraphs, n: int, tokens: int, limit: int = PREFILL_GRAPH_TOKENS) -> None:
        if n < 2:
            raise ValueError(f"prefill lanes: at least 2, got {n}")
        self.decoder = decoder
        model, device = decoder.model, decoder.device
        self.lanes = []
        for k in range(n):
            state = model.new_state(1, tokens, device=device)
            stream = torch.cuda.Stream(device)
            self.lanes.append(PrefillGraphs(decoder, limit, state, lane=k + 1, stream=stream))
        self.turn = 0

    def run(self, ids: torch.Tensor, into: DecodeState) -> tuple[torch.Tensor, torch.cuda.Event] | None:
        """The first chunk ``ids`` [1, n] of the sequence whose state is ``into`` through the
        next lane: (its last logits [V], the event to wait for), or None where no graph
        replays it (the caller runs it as a lone prompt)."""
        lane = self.lanes[self.turn]
        if lane.bucket(0, ids.shape[1]) is None:
            return None
        self.turn = (self.turn + 1) % len(self.lanes)
        main = torch.cuda.current_stream(self.decoder.device)
        lane.stream.wait_stream(main)  # the chunk's ids, the slot zeroed, its last occupant's steps
        with torch.cuda.stream(lane.stream):
            lane.reset()
            logits = lane.run(ids, 0)
            if logits is None:  # its capture failed (a fallback the decoder names)
                main.wait_stream(lane.stream)
                return None
            lane.state.copy_into(into)
            logits = logits.clone()
            done = torch.cuda.Event()
            done.record(lane.stream)
        # the caching allocator frees blocks in their stream's order: the main stream reads these
        logits.record_stream(main)
        ids.record_stream(lane.stream)
        return logits, done
