"""Replay route traces through cache policies (recording them is ``edgerun.engine.trace``).

``simulate`` replays a trace with the cache's own step structure (a step's tokens are
fetched together, or in ascending-id batches of distinct experts when they exceed the quota,
exactly as the streaming layer does) through the cache's :class:`LRUSet`, or through Belady's optimal policy (evict the
expert whose next use is farthest away) as the bound any online policy stays above.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from edgerun.budget.planner import replay
from edgerun.cache.policy import fetches
from edgerun.tools.routes import RouteTrace

POLICIES = ("lru", "belady")


@dataclass
class SimResult:
    policy: str
    quota: int
    tokens: int
    misses: dict[int, int] = field(default_factory=dict)  # per MoE layer

    @property
    def total_misses(self) -> int:
        return sum(self.misses.values())

    @property
    def misses_per_token(self) -> float:
        return self.total_misses / self.tokens if self.tokens else 0.0


def layer_accesses(trace: RouteTrace, layer_pos: int, quota: int) -> list[list[int]]:
    """One MoE layer's cache lookups in order (per step, :func:`fetches`)."""
    by_step: dict[int, list[list[int]]] = defaultdict(list)
    order = []
    for token, step in zip(trace.tokens, trace.step_ids()):
        if step not in by_step:
            order.append(step)
        by_step[step].append(list(token[layer_pos]))
    out = []
    for step in order:
        out.extend(fetches(by_step[step], quota))
    return out


def _belady_misses(accesses: list[list[int]], quota: int) -> int:
    steps = [list(dict.fromkeys(ids)) for ids in accesses]
    uses: dict[int, list[int]] = defaultdict(list)
    for t, ids in enumerate(steps):
        for e in ids:
            uses[e].append(t)
    cursor = defaultdict(int)
    held: set[int] = set()
    misses = 0
    for ids in steps:
        for e in ids:
            cursor[e] += 1  # uses[e][cursor[e]] is now the next use after this step
        new = [e for e in ids if e not in held]
        misses += len(new)
        excess = len(held) + len(new) - quota
        if excess > 0:
            step = set(ids)

            def next_use(e: int) -> int:
                k = cursor[e]
                return uses[e][k] if k < len(uses[e]) else 1 << 62

            victims = sorted((e for e in held if e not in step), key=lambda e: (-next_use(e), e))[:excess]
            held.difference_update(victims)
        held.update(new)
    return misses


def simulate(trace: RouteTrace, quota: int, policy: str = "lru", tier_quota: int | None = None) -> SimResult:
    """Misses per MoE layer of a cache of ``quota`` slots; with ``tier_quota``, the storage reads
    of a host tier of that many experts behind it (it sees every lookup the device slots make,
    batched as the device quota batches them)."""
    if policy not in POLICIES:
        raise ValueError(f"policy {policy!r} is not one of {', '.join(POLICIES)}")
    h = trace.header
    if quota < h.top_k:
        raise ValueError(f"quota {quota} is below top_k {h.top_k}")
    count = replay if policy == "lru" else _belady_misses
    res = SimResult(policy, quota, len(trace.tokens))
    for pos, layer in enumerate(h.moe_layers):
        res.misses[layer] = count(layer_accesses(trace, pos, quota), tier_quota or quota)
    return res


def frequencies(trace: RouteTrace) -> dict[int, list[int]]:
    """Per MoE layer, how often each expert was routed to: the warm-set input."""
    h = trace.header
    out = {layer: [0] * h.num_experts for layer in h.moe_layers}
    for token in trace.tokens:
        for layer, ids in zip(h.moe_layers, token):
            for e in ids:
                out[layer][e] += 1
    return out
