"""Replay route traces through cache policies (recording them is ``edgerun.engine.trace``).

``simulate`` replays a trace with the cache's own step structure (a step's tokens are
fetched together, or in ascending-id batches of distinct experts when they exceed the quota,
exactly as the streaming layer does) through the cache's own policy sets (``cache.policy``:
LFU with decay that may leave a miss unheld, the default; LFU with decay; LRU), prefetches included, or through Belady's optimal policy
(evict the expert whose next use is farthest away) as the bound any online policy stays above.

:func:`policy_study` compares the online policies of ``cache.policy`` on held-out routing:
LRU, LRU after a warm start, LFU with decay, a pinned warm set plus LRU, and Belady. Whatever a
policy learns (warm sets, the decay, how many to pin) is chosen on the other folds of the
trace and scored on the held-out one (leave-one-out over contiguous folds). It scores LRU, LFU
and Belady again with per-layer quotas at the same total slots, split as the planner splits them
(``budget.planner.split_quotas``) by the other folds' miss curves (LRU's, the planner's, or
LFU's), and Belady with the best split for the scored fold (the bound for any policy and split).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from edgerun.budget.planner import miss_curve, split_quotas, trace_steps
from edgerun.cache.policy import (
    DEFAULT_POLICY,
    PREFETCH_AHEAD,
    BypassLFUSet,
    LFUSet,
    LRUSet,
    PrefetchGate,
    expert_set,
    fetches,
    held_policy,
    replay_misses,
)
from edgerun.tools.routes import RouteTrace

POLICIES = ("lfu", "lfu-bypass", "lru", "belady")  # all but belady: the cache's own sets (cache.policy)
# policy_study's per-layer splits of quota x layers slots: by the other folds' LRU miss curves (the
# planner's), or by those of LFU with decay 0.99
SPLITS = {"layer": "lru", "lfu-layer": "lfu"}
STUDY = ("lru", "lru+warm", "lfu-decay", "pinned+lru", "belady")  # policy_study's rows: one quota
STUDY += ("lru/layer", "lfu-decay/layer", "belady/layer", "lfu-decay/lfu-layer", "belady/lfu-layer")
STUDY += ("belady/best",)  # Belady with the split that gives it the fewest misses on the scored fold
# LFU that may leave a miss unheld, and its bound: Belady under the same rule
STUDY += ("lfu-bypass", "belady+bypass")
DECAYS = (0.5, 0.8, 0.9, 0.95, 0.99, 0.999, 1.0)  # LFU decays a study fits on the other folds
PREFETCH = ("issued", "useful", "wasted")


@dataclass
class SimResult:
    policy: str
    quota: int | dict[int, int]  # one for every MoE layer, or by layer
    tokens: int
    misses: dict[int, int] = field(default_factory=dict)  # per MoE layer
    hits: dict[int, int] = field(default_factory=dict)  # per MoE layer (the cache's policies)
    prefetch: dict[int, dict[str, int]] = field(default_factory=dict)  # per MoE layer: PREFETCH counts

    @property
    def total_misses(self) -> int:
        return sum(self.misses.values())

    @property
    def misses_per_token(self) -> float:
        return self.total_misses / self.tokens if self.tokens else 0.0

    def prefetch_total(self, kind: str) -> int:
        return sum(p[kind] for p in self.prefetch.values())


def _steps(trace: RouteTrace) -> list[list[int]]:
    """Token indices of each step, in order."""
    by_step: dict[int, list[int]] = defaultdict(list)
    for t, step in enumerate(trace.step_ids()):
        by_step[step].append(t)
    return list(by_step.values())


Lookup = tuple[list[int], list[int] | None, list[int] | None]


def layer_lookups(trace: RouteTrace, layer_pos: int, quota: int, ahead: int = 1) -> list[Lookup]:
    """One MoE layer's cache lookups in order (per step, :func:`fetches`), each with what was
    read ahead for it: ``None`` for nothing, else the candidates the streaming layer hands
    ``ExpertCache.prefetch`` before it: a step's first lookup gets the experts predicted from
    the previous MoE layer (``predicted`` lines; the first layer none), each later one the batch
    itself, issued after the lookup before it. With ``ahead`` 2, a step's first lookup also
    gets, first, the experts predicted two MoE layers before (``predicted2``; the first two
    layers none): (ids, predicted a layer before, predicted two layers before)."""
    out: list[Lookup] = []
    for tokens in _steps(trace):
        batches = fetches([list(trace.tokens[t][layer_pos]) for t in tokens], quota)
        first = _predicted(trace, tokens, layer_pos, quota, 1)
        second = _predicted(trace, tokens, layer_pos, quota, 2) if ahead > 1 else None
        out.extend((b, first, second) if j == 0 else (b, b, None) for j, b in enumerate(batches))
    return out


def _predicted(trace: RouteTrace, tokens: list[int], layer_pos: int, quota: int, ahead: int):
    """A step's first lookup's candidates predicted ``ahead`` MoE layers before it (None: no layer
    that far before, or no predictions in the trace)."""
    key = "predicted" if ahead == 1 else "predicted2"
    lines = getattr(trace, key)
    if layer_pos < ahead or not lines:
        return None
    rows = [lines[t] for t in tokens]
    if any(r is None for r in rows):
        raise ValueError(f"{trace.source or 'route trace'}: a step has no {key!r} experts to replay")
    return fetches([list(r[layer_pos - ahead]) for r in rows], quota)[0]


def layer_accesses(trace: RouteTrace, layer_pos: int, quota: int) -> list[list[int]]:
    """One MoE layer's cache lookups in order (per step, :func:`fetches`)."""
    return [lookup[0] for lookup in layer_lookups(trace, layer_pos, quota)]


def belady_bypass_misses(lookups: list[list[int]], quota: int) -> int:
    """The fewest misses a cache that may leave a miss unheld can have: after each lookup the
    ``quota`` experts used soonest again among the held ones and the lookup's stay (Belady with
    bypass; a lower bound for any such policy, ``lfu-bypass`` among them, whether or not it may
    drop the lookup's own)."""
    never = 1 << 62
    steps = [list(dict.fromkeys(ids)) for ids in lookups]
    nxt: list[dict[int, int]] = [{} for _ in steps]
    last: dict[int, int] = {}
    for t in range(len(steps) - 1, -1, -1):
        for e in steps[t]:
            nxt[t][e] = last.get(e, never)
            last[e] = t
    held: dict[int, int] = {}  # expert -> its next use
    misses = 0
    for t, ids in enumerate(steps):
        for e in ids:
            misses += e not in held
            held[e] = nxt[t][e]
        if len(held) > quota:
            held = {e: held[e] for e in sorted(held, key=lambda e: (held[e], e))[:quota]}
    return misses


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


def _replay(lookups, table: LRUSet, depth: int) -> tuple[int, int, dict[str, int]]:
    """(misses, hits, prefetch counts) of ``lookups`` through ``table`` as the cache counts them,
    reading ahead at most ``depth`` experts before a lookup (the layer's share of the cache's
    prefetch buffers; ``ExpertCache.prefetch``: those not held and not already staged, as many
    as the layer's ``PrefetchGate`` allows, a guess two layers ahead at most half of them, first;
    useful if the lookup misses on them, else wasted)."""
    misses = hits = 0
    pf = dict.fromkeys(PREFETCH, 0)
    gate = PrefetchGate()
    for ids, ahead, ahead2 in lookups:
        staged: list[int] = []
        for guesses, share in ((ahead2, (depth + 1) // 2), (ahead, depth)):
            if depth and guesses:
                room = gate.limit(max(share - len(staged), 0))
                new = [e for e in dict.fromkeys(guesses) if e not in table and e not in staged]
                staged += new[:room]
        access = table.access(ids)
        misses += len(access.misses)
        hits += len(access.hits)
        useful = len(set(staged).intersection(access.misses))
        pf["issued"] += len(staged)
        pf["useful"] += useful
        pf["wasted"] += len(staged) - useful
        if staged:
            gate.record(useful, len(staged) - useful)
    return misses, hits, pf


def layer_quotas(trace: RouteTrace, quota: int | Mapping[int, int]) -> dict[int, int]:
    """Slots per MoE layer of ``trace``: one number for every layer, or one by layer (every MoE
    layer of the trace named, none other), each at least top_k."""
    h = trace.header
    if isinstance(quota, int):
        quotas = dict.fromkeys(h.moe_layers, quota)
    else:
        quotas = dict(quota)
        missing = [layer for layer in h.moe_layers if layer not in quotas]
        extra = [layer for layer in quotas if layer not in h.moe_layers]
        if missing or extra:
            raise ValueError(
                f"per-layer quotas name MoE layers {list(h.moe_layers)} of {trace.source or 'the route trace'}: "
                f"missing {missing}, not MoE layers {extra}"
            )
    for layer, q in quotas.items():
        if q < h.top_k:
            raise ValueError(
                f"quota {q} is below top_k {h.top_k}"
                + ("" if isinstance(quota, int) else f" (layer {layer})")
            )
    return quotas


def simulate(
    trace: RouteTrace,
    quota: int | Mapping[int, int],
    policy: str = DEFAULT_POLICY,
    tier_quota: int | None = None,
    prefetch_depth: int = 0,
    prefetch_ahead: int = 1,
) -> SimResult:
    """Misses (and, for the cache's policies, hits) per MoE layer of a cache of ``quota`` slots
    (one number for every layer, or a quota by layer as the planner sizes them); with
    ``tier_quota``, the storage reads of a host tier of that many experts behind it (it sees
    every lookup the device slots make, batched as the device quota batches them); with
    ``prefetch_depth`` (the cache's: staging buffers - top_k), the prefetches the streaming layer
    issues and how many were useful or wasted, as the cache counts them (the trace must carry
    ``predicted`` lines, which ``edgerun trace`` records); ``prefetch_ahead`` 2: reading two
    layers ahead too (``predicted2``), each layer with its share, depth // 2, of the buffers."""
    if policy not in POLICIES:
        raise ValueError(f"policy {policy!r} is not one of {', '.join(POLICIES)}")
    h = trace.header
    quotas = layer_quotas(trace, quota)
    if prefetch_depth:
        if policy == "belady" or tier_quota:
            raise ValueError(
                "prefetch replays the cache's own policies (lfu-bypass, lfu, lru) without a host tier"
            )
        if not trace.predicted or (prefetch_ahead > 1 and not trace.predicted2):
            key = "predicted" if not trace.predicted else "predicted2"
            raise ValueError(
                f"{trace.source or 'route trace'} has no {key!r} experts: record it with `edgerun trace`"
                + (" (traces from before prefetch two ahead lack them)" if key == "predicted2" else "")
            )
        if prefetch_ahead not in PREFETCH_AHEAD:
            raise ValueError(f"prefetch_ahead is 1 or 2, got {prefetch_ahead}")
        full = [layer for layer in h.moe_layers if quotas[layer] >= h.num_experts]
        if full and any(quotas[layer] < h.num_experts for layer in h.moe_layers if layer > full[0]):
            raise ValueError(
                f"layer {full[0]} holds every expert and a later layer streams: the prefetcher predicts "
                "across it, from a layer the trace's predictions do not come from"
            )
    res = SimResult(policy, quota if isinstance(quota, int) else quotas, len(trace.tokens))
    # as the cache: fewer prefetch buffers than layers to share them reads one layer ahead
    ahead = prefetch_ahead if prefetch_depth >= prefetch_ahead else 1
    for pos, layer in enumerate(h.moe_layers):
        q = quotas[layer]
        size = min(tier_quota or q, h.num_experts)
        # a layer holding every expert never reads; two ahead, each layer reads with its share
        depth = prefetch_depth // ahead if q < h.num_experts else 0
        lookups = layer_lookups(trace, pos, q, ahead)
        if policy == "belady":
            res.misses[layer] = _belady_misses([lookup[0] for lookup in lookups], size)
            continue
        held = held_policy(policy, bool(tier_quota))  # as the cache's slots run
        misses, hits, pf = _replay(lookups, expert_set(size, held, spill=h.top_k), depth)
        res.misses[layer] = misses
        res.hits[layer] = hits
        if prefetch_depth:
            res.prefetch[layer] = pf
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


def replay_set(accesses: list[list[int]], table: LRUSet, warm: list[int] = ()) -> int:
    """Misses of ``accesses`` through ``table`` (a ``cache.policy`` set), after preloading
    ``warm`` (least used first, as ``ExpertCache.warm`` does; not counted)."""
    if warm:
        table.access(list(warm)[-table.quota :])
    return replay_misses(accesses, table)


def ranked(accesses: list[list[int]]) -> list[int]:
    """Experts by use in ``accesses``, most used first (ties: lower id)."""
    counts: dict[int, int] = defaultdict(int)
    for ids in accesses:
        for e in ids:
            counts[e] += 1
    return sorted(counts, key=lambda e: (-counts[e], e))


def _pinned_run(accesses, quota, order, pin) -> int:
    """A warm start of the ``quota`` most used (``order``), the ``pin`` most used of them pinned."""
    return replay_set(accesses, LRUSet(quota, order[:pin]), order[:quota][::-1])


@dataclass
class StudyRow:
    policy: str
    quota: int
    tokens: int
    misses: int
    choices: list[str] = field(default_factory=list)  # what each fold's fit chose, per layer

    @property
    def misses_per_token(self) -> float:
        return self.misses / self.tokens if self.tokens else 0.0


def folds_of(trace: RouteTrace, folds: int) -> list[RouteTrace]:
    """``folds`` contiguous parts of the trace, split at step boundaries, about equal in tokens."""
    steps = trace.step_ids()
    if folds < 2:
        raise ValueError(f"a leave-one-out study needs at least 2 folds, got {folds}")
    cuts = [0]
    for f in range(1, folds):
        i = max(len(steps) * f // folds, cuts[-1])
        while 0 < i < len(steps) and steps[i] == steps[i - 1]:
            i += 1
        cuts.append(i)
    cuts.append(len(steps))
    out = []
    for lo, hi in zip(cuts, cuts[1:]):
        if lo == hi:
            raise ValueError(f"{trace.source or 'route trace'}: too few steps for {folds} folds")
        out.append(
            RouteTrace(
                trace.header,
                trace.tokens[lo:hi],
                trace.source,
                trace.steps[lo:hi],
                trace.predicted[lo:hi],
                trace.predicted2[lo:hi],
            )
        )
    return out


def fold_split(fit: Sequence[RouteTrace], quota: int, by: str = "lru") -> dict[int, int]:
    """Per MoE layer, the quotas the planner gives ``quota`` x layers slots in all
    (``split_quotas``), each layer at least top_k, by the miss curves of ``fit`` (the folds not
    scored, one after another) under the policy ``by``: ``lru``, the planner's (each token its
    own step, as it reads a trace at batch 1), or one of ``cache.policy``'s, replayed at every
    quota with the cache's step structure."""
    h = fit[0].header
    layers = range(len(h.moe_layers))
    if by == "lru":
        steps = [trace_steps(part, 1) for part in fit]
        curves = [miss_curve([s for st in steps for s in st[pos]], h.num_experts) for pos in layers]
    else:
        curves = []
        for pos in layers:
            curve = [
                replay_misses(
                    [a for p in fit for a in layer_accesses(p, pos, q)], expert_set(q, by, spill=h.top_k)
                )
                for q in range(h.top_k, h.num_experts + 1)
            ]
            curves.append([curve[0]] * h.top_k + curve)  # below top_k: never read (the floor)
    return dict(zip(h.moe_layers, split_quotas(curves, quota * len(h.moe_layers), h.top_k), strict=True))


def best_split(curves: Sequence[Mapping[int, int]], slots: int) -> tuple[int, tuple[int, ...]]:
    """The fewest misses over every split of at most ``slots`` slots between layers, and the split
    (ties: the first in lexical order), given each layer's misses by quota (layers independent)."""
    best: dict[int, tuple[int, tuple[int, ...]]] = {0: (0, ())}  # slots used -> (misses, quotas)
    for curve in curves:
        step: dict[int, tuple[int, tuple[int, ...]]] = {}
        for used, (misses, split) in best.items():
            for q, m in curve.items():
                cand = (misses + m, split + (q,))
                if used + q <= slots and (used + q not in step or cand < step[used + q]):
                    step[used + q] = cand
        best = step
    if not best:
        raise ValueError(f"{slots} slots cannot hold every layer's smallest quota")
    return min(best.values())


def _fitted_decay(fit: list[list[int]], quota: int, spill: int = 0) -> float:
    """The decay of ``DECAYS`` with the fewest misses of ``fit``: LFU's, or with ``spill``
    rows LFU with bypass's."""

    def run(d: float) -> int:
        return replay_set(fit, BypassLFUSet(quota, d, spill) if spill else LFUSet(quota, d))

    return min(DECAYS, key=lambda d: (run(d), d))


def policy_study(trace: RouteTrace, quota: int, folds: int = 4) -> dict[str, StudyRow]:
    """Misses of each :data:`STUDY` policy at ``quota`` over every fold of ``trace``, each fold
    replayed from an empty cache (or the warm start its fit chose) with what the policy learns
    fitted on the other folds: the decay minimising the fit's misses, the warm set (the fit's
    most used experts), how many of them to pin (0 .. quota - the widest lookup's distinct
    experts, top_k in decode; by the fit's misses), and for the per-layer rows (``/layer``: the
    planner's split, by LRU miss curves; ``/lfu-layer``: by the cache's LFU's) the split of
    quota x layers slots (:func:`fold_split`; the Belady rows' choices are each fold's split, the
    LFU rows' each layer's decay). ``belady/best`` is a bound, not a policy: its split is the best
    for the scored fold itself (:func:`best_split` of Belady's misses at every quota).
    ``lfu-bypass`` (its decay fitted as LFU's) is held against ``belady+bypass``
    (:func:`belady_bypass_misses`), the bound for a cache that may leave a miss unheld."""
    h = trace.header
    if not h.top_k <= quota <= h.num_experts:
        raise ValueError(f"quota {quota} is not between top_k {h.top_k} and the {h.num_experts} experts")
    parts = folds_of(trace, folds)
    rows = {p: StudyRow(p, quota, len(trace.tokens), 0) for p in STUDY}
    for k, held in enumerate(parts):
        others = [p for j, p in enumerate(parts) if j != k]
        splits = {name: fold_split(others, quota, by) for name, by in SPLITS.items()}
        for name, split in splits.items():
            rows[f"belady/{name}"].choices.append("/".join(map(str, split.values())))
        belady: list[dict[int, int]] = []  # per layer, Belady's misses on the fold at every quota
        for pos, layer in enumerate(h.moe_layers):
            belady.append(
                {
                    q: _belady_misses(layer_accesses(held, pos, q), q)
                    for q in range(h.top_k, h.num_experts + 1)
                }
            )
            fit = [a for p in others for a in layer_accesses(p, pos, quota)]
            test = layer_accesses(held, pos, quota)
            order = ranked(fit)
            order += [e for e in range(h.num_experts) if e not in order]
            decays = {quota: _fitted_decay(fit, quota)}  # by quota: the splits may repeat one
            decay = decays[quota]
            # pinned experts leave quota - pin slots to the rest: at least any lookup's width
            widest = max(len(set(ids)) for ids in fit + test)
            pin = min(range(quota - widest + 1), key=lambda p: (_pinned_run(fit, quota, order, p), p))
            rows["lru"].misses += replay_set(test, LRUSet(quota))
            rows["lru+warm"].misses += replay_set(test, LRUSet(quota), order[:quota][::-1])
            rows["lfu-decay"].misses += replay_set(test, LFUSet(quota, decay))
            rows["lfu-decay"].choices.append(f"{decay:g}")
            rows["pinned+lru"].misses += _pinned_run(test, quota, order, pin)
            rows["pinned+lru"].choices.append(str(pin))
            rows["belady"].misses += belady[pos][quota]
            bypass = _fitted_decay(fit, quota, h.top_k)
            rows["lfu-bypass"].misses += replay_set(test, BypassLFUSet(quota, bypass, h.top_k))
            rows["lfu-bypass"].choices.append(f"{bypass:g}")
            rows["belady+bypass"].misses += belady_bypass_misses(test, quota)
            for name, split in splits.items():
                q = split[layer]
                if q not in decays:
                    decays[q] = _fitted_decay([a for p in others for a in layer_accesses(p, pos, q)], q)
                decay, test = decays[q], layer_accesses(held, pos, q)
                if name == "layer":
                    rows["lru/layer"].misses += replay_set(test, LRUSet(q))
                rows[f"lfu-decay/{name}"].misses += replay_set(test, LFUSet(q, decay))
                rows[f"lfu-decay/{name}"].choices.append(f"{decay:g}")
                rows[f"belady/{name}"].misses += belady[pos][q]
        misses, best = best_split(belady, quota * len(h.moe_layers))
        rows["belady/best"].misses += misses
        rows["belady/best"].choices.append("/".join(map(str, best)))
    return rows
