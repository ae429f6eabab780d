"""The streaming MoE path: routed experts come from the expert cache, never from stacked
resident tensors. Routing, the expert math (:func:`combine_experts`), the shared expert and
the combine are the resident path's own code, so both paths give identical logits.

Shape legend: N = tokens in the forward, A = top_k, Q = the layer's slot quota.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from edgerun.bundle.reader import Bundle, load_bundle_model
from edgerun.cache.expert_cache import ExpertCache
from edgerun.models.layers import SparseMoe, combine_experts


class StreamingExperts(nn.Module):
    """Drop-in for a layer's resident ``Experts``: same call, weights from cache slots."""

    def __init__(self, layer: int, cache: ExpertCache) -> None:
        super().__init__()
        self.layer = layer
        self.cache = cache
        self.quota = cache.slots[layer].quota

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        # x [N, D], ids/weights [N, A]. When the tokens' experts outnumber the quota (prefill),
        # process them in consecutive pieces whose union fits, instead of evicting experts in use.
        rows = ids.tolist()
        out = []
        for lo, hi in pieces(rows, self.quota):
            piece = [e for row in rows[lo:hi] for e in row]
            refs = {r.expert: r for r in self.cache.get_many(self.layer, piece)}
            out.append(
                combine_experts(
                    x[lo:hi], ids[lo:hi], weights[lo:hi], lambda e, refs=refs: self.cache.weights(refs[e])
                )
            )
        return out[0] if len(out) == 1 else torch.cat(out)


def pieces(rows: list[list[int]], quota: int) -> list[tuple[int, int]]:
    """Split token rows into consecutive [lo, hi) ranges whose distinct experts number <= quota."""
    spans, lo, seen = [], 0, set()
    for i, row in enumerate(rows):
        new = seen | set(row)
        if len(new) > quota and i > lo:
            spans.append((lo, i))
            lo, new = i, set(row)
        seen = new
    spans.append((lo, len(rows)))
    return spans


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
