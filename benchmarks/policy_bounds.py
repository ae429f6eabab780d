"""How far below LFU with decay can an expert-cache policy get on a route trace (issue 15)?

Runs ``edgerun simulate --study``'s protocol (contiguous folds, each scored from a cold cache with
what a policy learns fitted on the other folds) for online policies that ``cache.policy`` does
not have, and for oracles that read the scored fold itself, which no online policy can do:

    python benchmarks/policy_bounds.py heldout.jsonl [--quota 4 5 6] [--folds 4]
    python benchmarks/policy_bounds.py --cost  # bookkeeping time per token at 40 layers x 256 experts, top-8

The policies here extend ``cache.policy_reference`` (the definition, one pass per eviction), so
``--cost`` times those; the cache's own books are timed by ``benchmarks/cache_books.py``.

Online (fitted on the other folds, by their misses; the same classes' interface as ``LRUSet``):
- ``lfu+next``: LFU with decay, plus ``beta`` x the probability, learned online per layer, that
  the held expert is used within the next ``H`` lookups after each of the current lookup's
  experts (the k-th later lookup weighted ``g`` ** (k - 1)): MoE routing is temporally correlated.
- ``lfu, adaptive decay``: evicts by the key of whichever of four decays had the fewest misses
  in shadow replays of the same lookups, the recent misses weighted down by ``window`` a lookup.
- ``lfu+pair, pre-trained``: LFU with decay, plus ``beta`` x how often the held expert followed
  (within 3 lookups) this lookup's exact set of experts, a table first learned on the other
  folds, then online (demo-sized: top-2 of 16 experts makes 120 such sets).
Oracles (cheating: they read the fold they are scored on):
- ``oracle: fold counts``: evicts the expert used least in the whole scored fold (perfect
  long-run frequencies, the best a frequency policy can know).
- ``oracle: pair transitions``: LFU (0.99) plus the probability, counted on the scored fold, that
  the expert is used within the next 3 lookups after this lookup's exact set of experts.
- ``oracle: next W uses``: evicts the expert used least in the next W lookups (W = 20, 100).
Deterministic: the same numbers on every run.
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
import time
from collections import defaultdict

from edgerun.cache.policy import replay_misses
from edgerun.cache.policy_reference import LFUSet, LRUSet
from edgerun.tools.routes import read_trace
from edgerun.tools.simulate import DECAYS, _belady_misses, folds_of, layer_accesses, replay_set


class NextLFU(LFUSet):
    """LFU with decay; an expert's eviction score adds ``beta`` x the mean, over the current
    lookup's experts ``a``, of (uses of the expert within ``horizon`` lookups after ``a``'s uses,
    the k-th later lookup weighted ``g`` ** (k - 1)) / (uses of ``a``)."""

    def __init__(self, quota: int, decay: float, beta: float, horizon: int = 4, g: float = 0.7) -> None:
        super().__init__(quota, decay)
        self.beta, self.horizon, self.g = beta, horizon, g
        self._after: dict[int, dict[int, float]] = {}
        self._uses: dict[int, int] = {}
        self._recent: list[list[int]] = []  # the last ``horizon`` lookups, oldest first

    def access(self, ids):
        step = list(dict.fromkeys(ids))
        out = super().access(step)
        w = 1.0
        for past in reversed(self._recent):
            for a in past:
                row = self._after.setdefault(a, {})
                for e in step:
                    row[e] = row.get(e, 0.0) + w
            w *= self.g
        self._recent = (self._recent + [step])[-self.horizon :]
        for a in step:
            self._uses[a] = self._uses.get(a, 0) + 1
        return out

    def _victims(self, step, new):
        excess = len(self._order) + new - self.quota
        if excess <= 0:
            return ()
        keep, d, now = set(step), self.decay, self._now
        rows = [(self._after[a], self._uses[a]) for a in step if a in self._after]
        scored = []
        for age, e in enumerate(self._order):
            if e in keep:
                continue
            s, t = self._score[e]
            follow = sum(row.get(e, 0.0) / n for row, n in rows) / len(step)
            scored.append((s * d ** (now - t) * (1 - d) + self.beta * follow, age, e))
        return tuple(e for _, _, e in heapq.nsmallest(excess, scored))


class AdaptiveLFU(LFUSet):
    """Evicts by the LFU key of whichever of ``decays`` had the fewest recent misses (each
    lookup's weighted ``window`` x the one before) replaying the same lookups in shadow."""

    def __init__(self, quota: int, window: float, decays=(0.9, 0.95, 0.99, 0.999)) -> None:
        super().__init__(quota, decays[0])
        self.window = window
        self._shadows = [LFUSet(quota, d) for d in decays]
        self._recent_misses = [0.0] * len(decays)
        self._best = 0

    def access(self, ids):
        step = list(dict.fromkeys(ids))
        out = LRUSet.access(self, step)  # evictions by the best shadow's keys (_victims)
        for k, shadow in enumerate(self._shadows):
            self._recent_misses[k] = self._recent_misses[k] * self.window + len(shadow.access(step).misses)
        self._best = min(range(len(self._shadows)), key=lambda k: (self._recent_misses[k], k))
        return out

    def _victims(self, step, new):
        excess = len(self._order) + new - self.quota
        if excess <= 0:
            return ()
        keep, key = set(step), self._shadows[self._best]._key
        held = ((key[e], age, e) for age, e in enumerate(self._order) if e not in keep)
        return tuple(e for _, _, e in heapq.nsmallest(excess, held))


class PairLFU(LFUSet):
    """LFU with decay; an expert's eviction score adds ``beta`` x the share of the earlier lookups
    of exactly this lookup's set of experts after which it was used within ``horizon`` lookups.
    Demo-sized: with top-8 of 256 experts a lookup's exact set hardly ever comes back."""

    def __init__(self, quota: int, decay: float, beta: float, horizon: int = 3) -> None:
        super().__init__(quota, decay)
        self.beta, self.horizon = beta, horizon
        self._after: dict[frozenset, dict[int, int]] = {}  # -1: the context's own count
        self._recent: list[frozenset] = []

    def access(self, ids):
        step = list(dict.fromkeys(ids))
        out = super().access(step)
        for ctx in set(self._recent):
            row = self._after[ctx]
            for e in step:
                row[e] = row.get(e, 0) + 1
        ctx = frozenset(step)
        row = self._after.setdefault(ctx, {})
        row[-1] = row.get(-1, 0) + 1
        self._recent = (self._recent + [ctx])[-self.horizon :]
        return out

    def learned(self, steps) -> PairLFU:
        """Learn the table from ``steps``, then start from an empty cache (a pre-trained table)."""
        replay_misses(steps, self)
        self._order.clear()
        self._score.clear()
        self._key.clear()
        self._recent = []
        return self

    def _victims(self, step, new):
        excess = len(self._order) + new - self.quota
        if excess <= 0:
            return ()
        keep, d, now = set(step), self.decay, self._now
        row = self._after.get(frozenset(step), {})
        n = row.get(-1, 0)
        scored = []
        for age, e in enumerate(self._order):
            if e not in keep:
                s, t = self._score[e]
                follow = row.get(e, 0) / n if n else 0.0
                scored.append((s * d ** (now - t) * (1 - d) + self.beta * follow, age, e))
        return tuple(e for _, _, e in heapq.nsmallest(excess, scored))


class Oracle(LRUSet):
    """Evicts the lowest ``rank(lookup index, expert)`` (ties: the least recent)."""

    def __init__(self, quota: int, rank) -> None:
        super().__init__(quota)
        self.rank, self.i = rank, 0

    def access(self, ids):
        out = super().access(ids)
        self.i += 1
        return out

    def _victims(self, step, new):
        excess = len(self._order) + new - self.quota
        if excess <= 0:
            return ()
        keep = set(step)
        held = ((self.rank(self.i, e), age, e) for age, e in enumerate(self._order) if e not in keep)
        return tuple(e for _, _, e in heapq.nsmallest(excess, held))


def fold_counts(test):
    counts = defaultdict(int)
    for ids in test:
        for e in ids:
            counts[e] += 1
    return lambda i, e: counts[e]


def next_uses(test, window):
    def rank(i, e):  # lookup i is the one being made
        return sum(e in test[j] for j in range(i + 1, min(i + 1 + window, len(test))))

    return rank


def pair_oracle(quota, test, horizon=3):
    after = defaultdict(lambda: defaultdict(int))
    for i, ids in enumerate(test):
        row = after[frozenset(ids)]
        row[-1] += 1
        for e in {e for j in range(i + 1, min(i + 1 + horizon, len(test))) for e in test[j]}:
            row[e] += 1

    def run(beta):
        lfu = LFUSet(quota, 0.99)

        def victims(step, new):
            excess = len(lfu._order) + new - lfu.quota
            if excess <= 0:
                return ()
            row, keep, now = after[frozenset(step)], set(step), lfu._now
            scored = []
            for age, e in enumerate(lfu._order):
                if e not in keep:
                    s, t = lfu._score[e]
                    scored.append((s * 0.99 ** (now - t) * 0.01 + beta * row[e] / row[-1], age, e))
            return tuple(e for _, _, e in heapq.nsmallest(excess, scored))

        lfu._victims = victims
        return replay_set(test, lfu)

    return min(run(b) for b in (0.3, 1.0, 3.0))  # the best beta for the scored fold itself


ONLINE = {  # name: (make(quota, *params), the grid the fit chooses from)
    "lfu-decay": (LFUSet, [(d,) for d in DECAYS]),
    "lfu+next": (NextLFU, [(d, b) for d in (0.95, 0.99, 0.999) for b in (0.0, 0.3, 1.0, 3.0)]),
    "lfu, adaptive decay": (AdaptiveLFU, [(w,) for w in (0.99, 0.999)]),
    "lfu+pair, pre-trained": (PairLFU, [(d, b) for d in (0.95, 0.99) for b in (0.3, 1.0, 3.0)]),
}


def bounds(path: str, quota: int, folds: int) -> dict[str, tuple[float, str]]:
    trace = read_trace(path)
    layers = len(trace.header.moe_layers)
    parts = [[layer_accesses(p, pos, quota) for pos in range(layers)] for p in folds_of(trace, folds)]
    misses = defaultdict(int)
    chose = {name: defaultdict(int) for name in ONLINE}
    for k, held in enumerate(parts):
        for pos, test in enumerate(held):
            fit = [a for j, p in enumerate(parts) if j != k for a in p[pos]]
            misses["lru"] += replay_set(test, LRUSet(quota))
            misses["belady"] += _belady_misses(test, quota)
            for name, (make, grid) in ONLINE.items():
                best = min(grid, key=lambda g: (replay_set(fit, make(quota, *g)), g))
                chose[name][best] += 1
                table = make(quota, *best)
                if name == "lfu+pair, pre-trained":  # its table learned on the other folds first
                    table.learned(fit)
                misses[name] += replay_set(test, table)
            misses["oracle: fold counts"] += replay_set(test, Oracle(quota, fold_counts(test)))
            misses["oracle: pair transitions"] += pair_oracle(quota, test)
            for w in (20, 100):
                misses[f"oracle: next {w} uses"] += replay_set(test, Oracle(quota, next_uses(test, w)))
    out = {}
    for name, m in misses.items():
        top = sorted(chose.get(name, {}).items(), key=lambda c: (-c[1], c[0]))[:2]
        out[name] = (
            m / len(trace.tokens),
            ", ".join(f"{'/'.join(f'{x:g}' for x in g)} x{n}" for g, n in top),
        )
    return out


def cost(layers=40, experts=256, top_k=8, tokens=300, warm=100, repeats=3) -> None:
    """Policy bookkeeping per token (every layer's lookup) on a synthetic Zipf(0.8) routing of the
    Qwen3.6-35B-A3B geometry: median [range] of ``repeats`` timings of ``tokens - warm`` tokens."""
    rng = random.Random(0)
    weights = [1.0 / (i + 1) ** 0.8 for i in range(experts)]
    routes = [
        [
            list(dict.fromkeys(rng.choices(range(experts), weights, k=3 * top_k)))[:top_k]
            for _ in range(tokens)
        ]
        for _ in range(layers)
    ]
    print("| quota | policy | misses/lookup | us/token, median [range] |")
    print("| --- | --- | --- | --- |")
    for quota in (32, 128):
        for name, make, params in (
            ("lru", LRUSet, ()),
            ("lfu-decay 0.99", LFUSet, (0.99,)),
            ("lfu+next 0.95/0.3", NextLFU, (0.95, 0.3)),
            ("lfu, adaptive decay 0.999", AdaptiveLFU, (0.999,)),
            ("lfu+pair 0.99/0.3", PairLFU, (0.99, 0.3)),
        ):
            times, missed = [], 0
            for _ in range(repeats):
                sets = [make(quota, *params) for _ in range(layers)]
                for layer, table in enumerate(sets):
                    replay_misses(routes[layer][:warm], table)
                t0 = time.perf_counter()
                missed = sum(
                    len(sets[layer].access(routes[layer][i]).misses)
                    for i in range(warm, tokens)
                    for layer in range(layers)
                )
                times.append((time.perf_counter() - t0) / (tokens - warm) * 1e6)
            med = statistics.median(times)
            print(
                f"| {quota} | {name} | {missed / (layers * (tokens - warm)):.2f} | "
                f"{med:.0f} [{min(times):.0f}-{max(times):.0f}] |",
                flush=True,
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", nargs="?")
    ap.add_argument("--quota", type=int, nargs="+", default=[4, 5, 6])
    ap.add_argument("--folds", type=int, default=4)
    ap.add_argument("--cost", action="store_true", help="time the policies' bookkeeping instead")
    ns = ap.parse_args()
    if ns.cost:
        return cost()
    if not ns.trace:
        ap.error("a route trace is needed (or --cost)")
    print("| quota | policy | misses/token | x LRU | x Belady | fitted |")
    print("| --- | --- | --- | --- | --- | --- |")
    for quota in ns.quota:
        t0 = time.perf_counter()
        rows = bounds(ns.trace, quota, ns.folds)
        lru, belady = rows["lru"][0], rows["belady"][0]
        for name, (mpt, fitted) in rows.items():
            print(
                f"| {quota} | {name} | {mpt:.3f} | {mpt / lru:.3f} | {mpt / belady:.3f} | {fitted} |",
                flush=True,
            )
        print(f"<!-- quota {quota}: {time.perf_counter() - t0:.0f} s -->", flush=True)


if __name__ == "__main__":
    main()
