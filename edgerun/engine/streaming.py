"""The routed-expert step over the expert cache: the one place a layer's experts run from slots.

:func:`run_experts` is called by the streaming layer (:class:`StreamingExperts`, every forward:
prefill, and decode on the CPU) and by the CUDA decode step (``engine/graphs.py``) alike. The
cache (``cache/expert_cache.py``) only keeps books and moves bytes; the kernel it runs is the
engine's resolved choice (``kernels/moe.py``). Routing, the shared expert and the combine are
the model's own code (``models/layers.SparseMoe``), so the resident and streaming paths give
identical logits with the reference kernel; the Triton kernels agree within their probe's
tolerance.

Shape legend: N = tokens in the forward, A = top_k, Q = the layer's slot quota.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import torch
from torch import nn

from edgerun.bundle.reader import Bundle, load_bundle_model
from edgerun.cache.expert_cache import ExpertCache
from edgerun.cache.policy import fetches
from edgerun.cache.slots import SlotRef
from edgerun.config import CacheConfig
from edgerun.kernels.moe import MoeKernelPolicy, accumulator, moe_experts
from edgerun.kernels.moe_reference import RouterLogits
from edgerun.models.layers import MAX_GEMV_ROWS, VERIFY_WINDOW, Experts, SparseMoe

REFERENCE = MoeKernelPolicy()


def run_experts(
    cache: ExpertCache,
    layer: int,
    x: torch.Tensor,
    slots: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    policy: MoeKernelPolicy,
    refs: Sequence[SlotRef] = (),
    acc: torch.Tensor | None = None,
    expert_range: tuple[int, int] | None = None,
    table: torch.Tensor | None = None,
    into: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    out_dtype: torch.dtype | None = None,
    shared_down: tuple | None = None,
    xq: tuple[torch.Tensor, ...] | None = None,
    route: RouterLogits | None = None,
) -> torch.Tensor:
    """Layer ``layer``'s routed experts over its slot pool: x [N, D], slots / ids [N, A] (the
    slot of each entry), weights [N, A] -> [N, D] (``acc`` and ``expert_range``: one part of a
    step run in parts; ``table``: slots looked up from the layer's device slot table; ``into``:
    added into a residual in place; ``out_dtype``: the result's, default x's; ``shared_down``: the
    shared expert's down projection in the step's launch; ``xq``: x quantized to int8 for int8
    expert activations; ``route``: the router's logits, routed by the step's launch into ids and
    weights; see ``moe_experts``).

    ``refs`` are the slot references the lookup handed out for ``slots``; each is checked
    against the slot table first, so a slot refilled since its lookup is refused
    (:class:`~edgerun.cache.slots.StaleSlotError`), never read as another expert's bytes. A
    step whose slots come from the device-side table (every expert held, nothing evictable)
    has none to check. A step being captured into a CUDA graph checks its slots but not its spill
    rows: the capture follows a whole eager step whose later lookups reused those rows, and at
    each replay the layer's lookup fills them just before its segment."""
    cache.check(layer, refs, spill=not (x.is_cuda and torch.cuda.is_current_stream_capturing()))
    pool, layout, scales = cache.pools[layer], cache.bundle.layouts[layer], cache.slot_scales[layer]
    return moe_experts(
        x, pool, slots, ids, weights, layout, scales, policy, out_dtype,
        acc=acc, expert_range=expert_range, table=table, into=into, packed=cache.packed[layer],
        far=cache.beyond(layer), shared_down=shared_down, xq=xq, route=route,
    )  # fmt: skip


def predicted_rows(model, layer: int, residual: torch.Tensor) -> list[list[int]]:
    """Layer ``layer``'s router applied (after the layer's own MLP norm) to ``residual`` [N, D],
    a residual stream of an earlier layer: the experts it would route to were the stream not to
    change before it (it changes slowly between layers)."""
    block = model.model.layers[layer]
    gate = block.mlp.gate
    logits = gate.logits(residual, norm=block.post_attention_layernorm)
    return gate.select(logits)[1].tolist()


class Prefetcher:
    """Decode reads that do not wait for the router: once a streamed MoE layer has its own
    experts, the next streamed MoE layer's are predicted from the residual stream the first
    layer's MLP reads (kept by a hook on its norm) and prefetched, so those reads overlap this
    layer's expert compute and the next layer's token mixer. The model's forward path (CPU
    decode, prefill); the CUDA decode step does the same from its static buffers."""

    def __init__(self, model, cache: ExpertCache) -> None:
        self.model, self.cache = model, cache
        layers = model.model.layers
        E = cache.bundle.args.num_experts
        # a layer whose quota holds every expert never misses (hold_complete_layers read them all
        # in), and a host tier's misses are copies (its prefetch reads nothing): nothing to
        # predict for either, and no router run, no host sync on their behalf
        streamed = [
            i
            for i, b in enumerate(layers)
            if isinstance(getattr(b.mlp, "experts", None), StreamingExperts)
            and cache.slots[i].quota < E
            and i not in cache.tier
        ]
        self.next = dict(zip(streamed, streamed[1:], strict=False))
        # prefetch_ahead 2: the streamed layer after next too, from the same residual stream
        self.after = (
            {i: self.next[j] for i, j in self.next.items() if j in self.next}
            if cache.prefetch_ahead > 1
            else {}
        )
        self._residual: dict[int, torch.Tensor] = {}
        self._hooks = [
            layers[i].post_attention_layernorm.register_forward_pre_hook(partial(self._keep, i))
            for i in self.next
        ]
        for i in self.next:
            layers[i].mlp.experts.prefetcher = self

    def _keep(self, layer: int, module, inputs) -> None:
        self._residual[layer] = inputs[0]

    def issue(self, layer: int) -> int:
        """After ``layer``'s lookup: prefetch the next streamed layer's predicted experts (and,
        two ahead, the one after's: its first guesses, which the next layer's issue refines)."""
        residual = self._residual.pop(layer, None)
        if residual is None or layer not in self.next:
            return 0
        residual = residual.reshape(-1, residual.shape[-1])
        issued = 0
        for ahead, target in ((1, self.next[layer]), (2, self.after.get(layer))):
            if target is not None:
                rows = predicted_rows(self.model, target, residual)
                first = fetches(rows, self.cache.slots[target].quota)[0]  # its first lookup's
                issued += self.cache.prefetch(target, first, ahead)
        return issued

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        for i in self.next:
            self.model.model.layers[i].mlp.experts.prefetcher = None


def lookup(
    cache: ExpertCache, layer: int, rows: list[list[int]], device, then: Callable[[], object] | None = None
) -> tuple[torch.Tensor, list[SlotRef]]:
    """The slot of every entry of ``rows`` (tokens' expert ids) as a tensor on ``device``, and
    the references to check before use; the misses are read first (``then`` runs once their
    reads are queued, before they are awaited: the next layer's prefetch)."""
    refs = cache.get_many(layer, [e for row in rows for e in row], then)
    slot_of = {r.expert: r.slot for r in refs}
    return torch.tensor([[slot_of[e] for e in row] for row in rows], device=device), refs


class StreamingExperts(nn.Module):
    """Drop-in for a layer's resident ``Experts``: same call, weights from cache slots, computed
    by :func:`run_experts` under ``policy`` (the engine's resolved choice; the reference by
    default, which is ``combine_experts`` over the dequantized slots, as the resident path)."""

    def __init__(self, layer: int, cache: ExpertCache, policy: MoeKernelPolicy = REFERENCE) -> None:
        super().__init__()
        self.layer = layer
        self.cache = cache
        self.quota = cache.slots[layer].quota
        self.policy = policy
        self.prefetcher: Prefetcher | None = None  # set by a Prefetcher (decode prediction)
        self.split = None  # a far layer's CpuExperts (engine/cpu_experts.attach): decode steps split
        self._table: torch.Tensor | None = None

    def held(self) -> torch.Tensor | None:
        """The device slot table once the layer holds every expert (then it never evicts, so the
        table stays valid), else None."""
        if self._table is None:
            self._table = self.cache.slot_table(self.layer)
        return self._table

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        # x [N, D], ids/weights [N, A]
        c, i = self.cache, self.layer
        if ids.shape[0] > 1 and VERIFY_WINDOW.get():  # a verify window: the union of its rows' experts
            c.count_window(i, len(set(ids.flatten().tolist())))
        # every expert held: the slots are looked up on the device (Triton), or in one index op
        # for a CPU decode step (no eviction bookkeeping: a layer holding every expert never evicts)
        fast = self.policy.impl == "triton" or (
            self.policy.impl in ("cpu", "cpu_grouped") and x.shape[0] == 1
        )
        table = self.held() if fast else None
        if table is not None:
            c.count_hits(i, ids.numel())
            self._prefetch_next()
            if self.split is not None and self._splits(x):

                def gpu(slots: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
                    return run_experts(c, i, x, slots, ids, w, self.policy, out_dtype=out_dtype)

                out = self.split.step(x, ids, weights, table, gpu)
                if out is not None:
                    return out
            return run_experts(c, i, x, ids, ids, weights, self.policy, table=table)
        rows = ids.tolist()
        batches = fetches(rows, self.quota)
        if len(batches) == 1:
            slots, refs = lookup(c, i, rows, x.device, then=self._prefetch_next)
            return run_experts(c, i, x, slots, ids, weights, self.policy, refs)
        # more distinct experts than slots (prefill): ascending-id batches that fit, each expert
        # read once and run over all its tokens, summing in the order of one pass. Batch j + 1
        # (the last: the next layer's first) is read into staging while batch j computes.
        acc = accumulator(x, self.policy)
        for j, batch in enumerate(batches):
            refs = c.get_many(i, batch)
            if j + 1 < len(batches):
                c.prefetch(i, batches[j + 1])
            else:
                self._prefetch_next()
            slot_of = {r.expert: r.slot for r in refs}
            filler = slot_of[batch[0]]  # entries of other experts: any valid slot, never read
            slots = torch.tensor([[slot_of.get(e, filler) for e in row] for row in rows], device=x.device)
            part = (batch[0], batch[-1])
            acc = run_experts(c, i, x, slots, ids, weights, self.policy, refs, acc=acc, expert_range=part)
        return acc.to(x.dtype)

    def _splits(self, x: torch.Tensor) -> bool:
        """A step the CPU experts split: a decode step (at most MAX_GEMV_ROWS rows: a batch
        step, a verify window; a prompt chunk that short too), not being captured into a CUDA
        graph (the split reads the routing back to the host)."""
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        return x.shape[0] <= MAX_GEMV_ROWS and not capturing

    def _prefetch_next(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.issue(self.layer)


class HeldExperts(nn.Module):
    """A MoE layer's routed experts held whole as expert blocks of a bundle's ``layout``, outside
    the expert cache: the MTP head's on CUDA, which a bundle stores stacked in its dense part.
    Built from the stacked ``Experts`` by the quantizer convert writes the model's blocks with
    (int4: a quarter of bf16's bytes), then run by the cache's kernels over a slot table of every
    expert, as a layer that holds all its experts runs (``table`` mode in a decode step)."""

    def __init__(self, stacked: nn.Module, layout, device: torch.device, policy: MoeKernelPolicy = REFERENCE):
        from edgerun.bundle.quant import PROJECTIONS, quantize_expert

        super().__init__()
        E = stacked.gate_up_proj.shape[0]
        self.layout, self.policy = layout, policy
        pool = torch.zeros(E, layout.block_bytes, dtype=torch.uint8, device=device)
        self.register_buffer("pool", pool, persistent=False)
        scales = torch.empty(E, 2, device=device) if layout.quant == "int4" else None
        self.register_buffer("scales", scales, persistent=False)
        self.register_buffer("table", torch.arange(E, dtype=torch.int64, device=device), persistent=False)
        self.packed: dict = {}  # the CPU kernels' repacked slots (kernels/moe.moe_experts)
        if _copies_bits(stacked, layout):  # bf16 into bf16 blocks: the same bits, every expert at once
            for proj in PROJECTIONS:
                c, w = layout.component(f"{proj}.weight"), getattr(stacked, f"{proj}_proj").detach()
                pool[:, c.offset : c.offset + c.nbytes] = w.reshape(E, -1).to(device).view(torch.uint8)
            return
        for e in range(E):  # an expert at a time, on ``device``: never all of them unquantized there
            w = (stacked.gate_up_proj[e], stacked.down_proj[e])
            block, gscales = quantize_expert(layout, *(t.detach().to(device, torch.float32) for t in w))
            pool[e] = block
            if scales is not None:
                scales[e] = gscales

    def run(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        policy: MoeKernelPolicy | None = None,
        into: tuple[torch.Tensor, torch.Tensor | None] | None = None,
        shared_down: tuple | None = None,
        xq: tuple[torch.Tensor, ...] | None = None,
    ) -> torch.Tensor:
        """x [N, D], ids / weights [N, A] -> [N, D] (or added into ``into``; ``shared_down``: the
        shared expert's down projection in the step's launch; ``xq``: x quantized to int8; see
        ``moe_experts``)."""
        return moe_experts(
            x, self.pool, ids, ids, weights, self.layout, self.scales, policy or self.policy,
            table=self.table, into=into, packed=self.packed, shared_down=shared_down, xq=xq,
        )  # fmt: skip

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.run(x, ids, weights)

    gathered = gathered_rows = forward  # a decode step's device op (engine/graphs stacked mode)


def _copies_bits(stacked: nn.Module, layout) -> bool:
    return (
        layout.quant == "bf16"
        and layout.rotation == "none"
        and stacked.gate_up_proj.dtype == stacked.down_proj.dtype == torch.bfloat16
    )


def hold_experts(layers, layout, policy: MoeKernelPolicy, device: torch.device) -> int:
    """Every stacked routed-expert module of the MoE ``layers`` held instead as expert blocks of
    ``layout`` (:class:`HeldExperts`) on ``device``, a layer at a time (its stacked tensors are
    dropped as its blocks are made). Returns the bytes the held experts of ``layers`` hold."""
    held = 0
    for layer in layers:
        if not isinstance(layer.mlp, SparseMoe):
            continue
        if isinstance(layer.mlp.experts, Experts):
            layer.mlp.experts = HeldExperts(layer.mlp.experts, layout, device, policy)
        e = layer.mlp.experts
        if isinstance(e, HeldExperts):
            held += e.pool.nbytes + (e.scales.nbytes if e.scales is not None else 0)
    return held


def hold_mtp_experts(model, cache: ExpertCache, policy: MoeKernelPolicy, device: torch.device) -> int:
    """The MTP head's routed experts, loaded stacked (on the host: the device never holds them
    so), held instead as expert blocks of the bundle's layout (:class:`HeldExperts`) on
    ``device``. Returns the bytes they hold there."""
    layout = cache.bundle.layouts[cache.bundle.args.moe_layers[0]]
    return hold_experts(model.mtp.layers, layout, policy, device)


def resident_layout(model, args, device: torch.device):
    """The bf16 expert block layout a CUDA runner holds a model's resident stacked experts in
    (a checkpoint, or a bundle loaded without an expert cache), so they run on the expert
    cache's Triton kernels, table mode, not a gather and torch's batched products: the same
    bits, every expert at once (:class:`HeldExperts`). None where there is nothing to hold so:
    not CUDA, no stacked experts, or experts in a dtype other than bf16 (held as bf16 blocks,
    their values would change)."""
    from edgerun.bundle.layout import expert_block_layout

    if torch.device(device).type != "cuda":
        return None
    stacked = [
        x.mlp.experts
        for x in _with_mtp_layers(model)
        if isinstance(x.mlp, SparseMoe) and isinstance(x.mlp.experts, Experts)
    ]
    if not stacked or any(e.gate_up_proj.dtype != torch.bfloat16 for e in stacked):
        return None
    return expert_block_layout(args, "bf16")


def hold_resident_experts(model, layout, policy: MoeKernelPolicy, device: torch.device) -> int:
    """The model's (and its MTP head's) resident stacked experts held as ``layout`` blocks on
    ``device`` (:func:`resident_layout`). Returns the bytes the held blocks take."""
    return hold_experts(_with_mtp_layers(model), layout, policy, device)


def _with_mtp_layers(model) -> list:
    """The model's decoder layers, then its MTP head's (where one is loaded)."""
    mtp = getattr(model, "mtp", None)
    return [*model.model.layers, *(mtp.layers if mtp is not None else ())]


def load_streaming_model(
    bundle_dir: str | Path,
    config,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    providers=None,
    log=None,
    expert_kernel: str = "cpu",
):
    """(model, args, cache, report): dense weights resident, routed experts streamed through
    an :class:`ExpertCache` built from ``config`` (a :class:`CacheConfig`, or a quota per layer). A planned config is re-planned against the dense bytes actually
    loaded before the cache is sized (``log`` gets the difference), counting what the CPU expert
    kernel the request ``expert_kernel`` resolves to holds (``engine/setup.plan_kernel``)."""
    from edgerun.engine.cpu_experts import attach as attach_cpu_experts
    from edgerun.engine.setup import measured_resident, plan_kernel, replan

    if not isinstance(config, CacheConfig):
        config = CacheConfig(quotas=config)
    bundle = Bundle.open(bundle_dir, providers=providers)  # validated once, before anything is allocated
    model, args, report = load_bundle_model(bundle, dtype=dtype, device=device, experts=False)
    # measure what loading used, then size what remains
    kernel = "cpu"  # what a plan counts: the most a CPU expert kernel holds, unless known less
    if config.profile is not None and torch.device(device).type == "cpu" and bundle.layouts:
        layouts = list(dict.fromkeys(bundle.layouts.values()))
        kernel = plan_kernel(expert_kernel, layouts, args.num_experts_per_tok)
    config = replan(config, Path(bundle_dir), measured_resident(model), providers, log, kernel)
    cache = ExpertCache(bundle, config, device=device)
    for i, layer in enumerate(model.model.layers):
        if isinstance(layer.mlp, SparseMoe):
            layer.mlp.experts = StreamingExperts(i, cache)
    cache.hold_complete_layers()
    cache.cpu_split_text = attach_cpu_experts(model, cache, config.cpu_experts)
    if config.warm:
        cache.warm(config.warm)
    if cache.prefetch_depth:
        Prefetcher(model, cache)
    report.expert_layout += f", streamed (quota {cache.quotas[args.moe_layers[0]]}/layer)"
    return model, args, cache, report
