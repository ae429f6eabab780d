"""The streaming MoE path: routed experts come from the expert cache, never from stacked
resident tensors. Routing, the expert math (:func:`combine_experts`), the shared expert and
the combine are the resident path's own code, so both paths give identical logits (with the
reference expert kernel; the Triton kernels agree within their probe's tolerance).

Shape legend: N = tokens in the forward, A = top_k, Q = the layer's slot quota.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from edgerun.bundle.reader import Bundle, load_bundle_model
from edgerun.cache.expert_cache import ExpertCache
from edgerun.kernels.moe import MoeKernelPolicy, accumulator
from edgerun.models.layers import SparseMoe

REFERENCE = MoeKernelPolicy()


class StreamingExperts(nn.Module):
    """Drop-in for a layer's resident ``Experts``: same call, weights from cache slots, computed
    by ``moe_experts`` under ``policy`` (the engine's resolved choice; the reference by default,
    which is :func:`combine_experts` over the dequantized slots, as the resident path)."""

    def __init__(self, layer: int, cache: ExpertCache, policy: MoeKernelPolicy = REFERENCE) -> None:
        super().__init__()
        self.layer = layer
        self.cache = cache
        self.quota = cache.slots[layer].quota
        self.policy = policy

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        # x [N, D], ids/weights [N, A]
        c, i = self.cache, self.layer
        rows = ids.tolist()
        batches = fetches(rows, self.quota)
        if len(batches) == 1:
            slots = torch.tensor(c.slot_rows(i, rows), device=x.device)
            return c.run(i, x, slots, ids, weights, self.policy)
        # more distinct experts than slots (prefill): ascending-id batches that fit, each expert
        # read once and run over all its tokens, summing in the order of one pass
        acc = accumulator(x, self.policy)
        for batch in batches:
            slot_of = dict(zip(batch, c.slot_rows(i, [batch])[0]))
            filler = slot_of[batch[0]]  # entries of other experts: any valid slot, never read
            slots = torch.tensor([[slot_of.get(e, filler) for e in row] for row in rows], device=x.device)
            acc = c.run(i, x, slots, ids, weights, self.policy, acc=acc, expert_range=(batch[0], batch[-1]))
        return acc.to(x.dtype)


def fetches(rows: list[list[int]], quota: int) -> list[list[int]]:
    """The cache lookups one forward of a layer makes, in order: every token's experts at once
    when their union fits the quota, else the distinct experts in ascending-id batches of at
    most ``quota`` (the expert cache simulator replays exactly these)."""
    distinct = sorted({e for row in rows for e in row})
    if len(distinct) <= quota:
        return [[e for row in rows for e in row]]
    return [distinct[lo : lo + quota] for lo in range(0, len(distinct), quota)]


def load_streaming_model(
    bundle_dir: str | Path,
    quota: int | dict[int, int],
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    **cache_kw,
):
    """(model, args, cache, report): dense weights resident, routed experts streamed."""
    bundle = Bundle.open(bundle_dir)  # validated once, before anything is allocated
    model, args, report = load_bundle_model(bundle, dtype=dtype, device=device, experts=False)
    dtype = model.model.embed_tokens.weight.dtype
    cache = ExpertCache(bundle, quota, device=device, dtype=dtype, **cache_kw)
    for i, layer in enumerate(model.model.layers):
        if isinstance(layer.mlp, SparseMoe):
            layer.mlp.experts = StreamingExperts(i, cache)
    report.expert_layout += f", streamed (quota {cache.quotas[args.moe_layers[0]]}/layer)"
    return model, args, cache, report
