"""Expert-cache policies from the caching literature against LFU with decay, under the study's
protocol (issue 15): does any reach <= 0.8x LRU's misses and <= 1.3x Belady's at two quotas?

    python benchmarks/policy_candidates.py heldout.jsonl [--quota 3 4 5 6 7 8] [--folds 4] [--only arc lirs]

``edgerun simulate --study``'s protocol: contiguous folds, each scored from a cold cache, whatever
a policy learns (a decay, a window, a pinned set, a scorer's weights) fitted per layer on the other
folds, by their misses. The rules are those of the cache's ``lfu`` (``cache.policy``): hits and
misses against the set held when a lookup starts, every miss is read and held after it, the
victims are held experts outside the lookup (all but the bypass rows). Policies:

- ``lfu, study decays``: the cache's LFU with decay, the decay fitted from the study's grid
  (``simulate.DECAYS``): the baseline, equal to the study's row.
- ``lrfu, fine decays``: LRFU (a use weighted ``(1/2) ** (lambda * age)``) is LFU with decay
  ``2 ** -lambda``; here fitted from a finer grid of 11 decays.
- ``lfu, two decays``: a long-decay count plus ``w`` x a short-decay one (recent bursts).
- ``lfu + pinned``: the other folds' ``n`` most used experts kept (evicted only when a lookup
  leaves nothing else), LFU among the rest.
- ``w-tinylfu``: the ``w`` most recently used held experts outside the lookup are kept (the
  window), LFU among the rest. (TinyLFU's admission, "keep the new expert only if it is used
  more than the victim", is what LFU with decay does already here: every expert's decayed count is
  kept held or not, and a newcomer with a low count is the next victim.)
- ``arc``: ARC (Megiddo and Modha), two LRU lists, seen once and seen twice, and their ghosts
  steering the target size of the first; a miss's slot from the list ARC names, skipping the
  lookup's own experts.
- ``2q``: 2Q (Johnson and Shasha), a FIFO for first uses (``kin`` x quota), ghosts of its
  evictions (``kout`` x experts), an LRU for the experts seen again.
- ``lirs``: LIRS (Jiang and Zhang), experts with a short reuse distance held as LIR, ``hir``
  slots (fitted) a FIFO for the rest, promoted when reused while on the recency stack.
- ``learned scorer``: evicts the held expert with the lowest predicted ``sum_k g ** (k - 1) x
  [used k lookups on]`` (``g`` fitted), a least-squares fit on the other folds of 10 history
  features: decayed counts at six decays, 1 / (1 + lookups since the last use), the fitted
  transition ``P(used in the next 3 lookups | an expert of this lookup)`` from this lookup's and
  the previous one's experts, and the other folds' use share. ``+ other layers``: also this
  step's experts at every earlier MoE layer through the same kind of table (only where every
  step is one lookup in every layer, as in the held-out text trace).
- ``lfu + bypass``: LFU with decay that may leave a miss unheld (the study of the rule the cache
  now has as ``lfu-bypass``, ``cache.policy.BypassLFUSet``, which also keeps a lookup's held
  experts and passes at most top_k misses; ``edgerun simulate --study`` replays that one): every
  miss is read and used, then the ``quota`` experts with the highest decayed counts among the
  held ones and the lookup's stay (TinyLFU's admission, which
  the cache's rule of holding every miss turns into LFU itself). Held against ``belady +
  bypass``: the same rule keeping the experts used soonest again, the fewest misses any policy
  that may leave a miss unheld can have.

Deterministic: the same numbers on every run.
"""

from __future__ import annotations

import argparse
import time
from collections import OrderedDict, defaultdict

import numpy as np

from edgerun.cache.policy import LRUSet
from edgerun.tools.routes import read_trace
from edgerun.tools.simulate import (
    DECAYS,
    _belady_misses,
    belady_bypass_misses,
    folds_of,
    layer_accesses,
    ranked,
    replay_set,
)

FINE_DECAYS = (0.9, 0.95, 0.97, 0.98, 0.985, 0.99, 0.993, 0.995, 0.998, 0.999, 1.0)
SCORER_DECAYS = (0.5, 0.8, 0.9, 0.95, 0.99, 0.999)
BIG = 1e9  # a pinned expert's score: evicted only when nothing else outside the lookup is held
BASES = ("lru", "belady", "belady + bypass")  # every run's rows, what the others are held against


def score_misses(lookups: list[list[int]], quota: int, score: np.ndarray, bypass: bool = False) -> int:
    """Misses of ``lookups`` where a miss evicts the held experts outside the lookup with the
    lowest ``score[lookup, expert]`` (ties: the least recent), the cache's rules otherwise;
    ``bypass``: a miss is held only if it outscores a held expert (``admitted_misses``)."""
    if bypass:
        return admitted_misses(lookups, quota, score)
    held: dict[int, int] = {}  # expert -> last use on a clock of ids touched
    clock = misses = 0
    for t, ids in enumerate(lookups):
        new = [e for e in ids if e not in held]
        misses += len(new)
        excess = len(held) + len(new) - quota
        if excess > 0:
            row, step = score[t], set(ids)
            for _, _, e in sorted((row[e], at, e) for e, at in held.items() if e not in step)[:excess]:
                del held[e]
        for e in ids:
            held[e] = clock
            clock += 1
    return misses


def kept_best(held: dict[int, int], quota: int, rank: dict[int, tuple]) -> dict[int, int]:
    """A bypassing cache's set after a lookup: the ``quota`` experts of ``held`` (the held ones and
    the lookup's, each with its entry) with the highest ``rank``."""
    if len(held) <= quota:
        return held
    return {e: held[e] for e in sorted(held, key=rank.__getitem__, reverse=True)[:quota]}


def admitted_misses(lookups: list[list[int]], quota: int, score: np.ndarray) -> int:
    """``score_misses`` with bypass: every miss is read and used, then the ``quota`` experts with
    the highest score among the held ones and the lookup's stay (LFU with TinyLFU's admission:
    a newcomer stays only if it outscores a held expert; ties: the more recent stays)."""
    held: dict[int, int] = {}  # expert -> last use on a clock of ids touched
    clock = misses = 0
    for t, ids in enumerate(lookups):
        for e in ids:
            misses += e not in held
            held[e] = clock
            clock += 1
        held = kept_best(held, quota, {e: (score[t, e], c) for e, c in held.items()})
    return misses


def uses(lookups: list[list[int]], experts: int) -> np.ndarray:
    """[lookup, expert]: 1 where the lookup routes to the expert."""
    u = np.zeros((len(lookups), experts))
    for t, ids in enumerate(lookups):
        u[t, ids] = 1.0
    return u


def decayed(u: np.ndarray, decay: float) -> np.ndarray:
    """Each expert's uses up to and including each lookup, the k-th before weighted decay ** k:
    LFU with decay's score (the same floats, so the same victims)."""
    out, c = np.empty_like(u), np.zeros(u.shape[1])
    for t in range(len(u)):
        c = c * decay + u[t]
        out[t] = c
    return out


def since_last(u: np.ndarray) -> np.ndarray:
    out, last = np.empty_like(u), np.full(u.shape[1], -1e6)
    for t in range(len(u)):
        last = np.where(u[t] > 0, t, last)
        out[t] = t - last
    return out


def transitions(now: np.ndarray, later: np.ndarray, horizon: int = 3, g: float = 0.7) -> np.ndarray:
    """[a, e]: uses of ``e`` in ``later`` within ``horizon`` lookups after a use of ``a`` in
    ``now`` (the k-th lookup on weighted g ** (k - 1)), per use of ``a``."""
    m, n = np.zeros((now.shape[1], later.shape[1])), len(now)
    for k in range(1, horizon + 1):
        m += g ** (k - 1) * (now[: n - k].T @ later[k:])
    return m / (now.sum(0) + 1e-9)[:, None]


def ahead(u: np.ndarray, g: float, horizon: int = 64) -> np.ndarray:
    """The scorer's target: sum over k >= 1 of g ** (k - 1) x [used k lookups on]."""
    y, n = np.zeros_like(u), len(u)
    for k in range(1, min(horizon, n - 1) + 1):
        y[: n - k] += g ** (k - 1) * u[k:]
    return y


def scorer_features(seq: list[np.ndarray], layer: int, tables, share: np.ndarray) -> np.ndarray:
    """[lookup, expert, feature] of layer ``layer`` (``seq``: every layer's uses, aligned by step
    where ``tables`` has cross-layer entries)."""
    u = seq[layer]
    prev = np.vstack([np.zeros((1, u.shape[1])), u[:-1]])
    fs = [decayed(u, d) * (1 - d) for d in SCORER_DECAYS]
    fs += [
        1.0 / (1.0 + since_last(u)),
        u @ tables[layer],
        prev @ tables[layer],
        np.broadcast_to(share, u.shape),
    ]
    fs += [seq[j] @ m for j, m in tables.items() if j != layer]
    return np.stack(fs, -1)


def learned_scorer(fit, test, layer, quota, experts, cross):
    """(misses on ``test``, the chosen g) of the least-squares scorer fitted on ``fit`` (every
    layer's lookups, one list per layer)."""
    uf = [uses(lk, experts) for lk in fit]
    ut = [uses(lk, experts) for lk in test]
    tables = {j: transitions(uf[j], uf[layer]) for j in (range(layer + 1) if cross else [layer])}
    share = uf[layer].mean(0)
    xf = scorer_features(uf, layer, tables, share)
    xt = scorer_features(ut, layer, tables, share)
    a = np.concatenate([xf.reshape(-1, xf.shape[-1]), np.ones((xf.shape[0] * experts, 1))], 1)
    best = None
    for g in (0.5, 0.8, 0.9):
        w = np.linalg.lstsq(a, ahead(uf[layer], g).reshape(-1), rcond=None)[0][:-1]
        m = score_misses(fit[layer], quota, xf @ w)
        if best is None or m < best[0]:
            best = (m, g, w)
    _, g, w = best
    return score_misses(test[layer], quota, xt @ w), (g,)


class ARC:
    """ARC over one layer's slots: T1 (seen once) and T2 (seen again) held, B1 and B2 their
    ghosts, ``p`` the target size of T1 that ghost hits move."""

    def __init__(self, quota: int) -> None:
        self.c, self.p = quota, 0.0
        self.t1, self.t2, self.b1, self.b2 = OrderedDict(), OrderedDict(), OrderedDict(), OrderedDict()

    def _replace(self, step: set[int], in_b2: bool) -> None:
        t1 = [e for e in self.t1 if e not in step]
        t2 = [e for e in self.t2 if e not in step]
        if t1 and (not t2 or len(self.t1) > self.p or (in_b2 and len(self.t1) == self.p)):
            del self.t1[t1[0]]
            self.b1[t1[0]] = None
        else:
            del self.t2[t2[0]]
            self.b2[t2[0]] = None

    def access(self, ids: list[int]) -> int:
        c, step, misses = self.c, set(ids), 0
        for e in ids:
            if e in self.t1:
                del self.t1[e]
                self.t2[e] = None
            elif e in self.t2:
                self.t2.move_to_end(e)
        for e in ids:
            if e in self.t1 or e in self.t2:
                continue
            misses += 1
            full = len(self.t1) + len(self.t2) >= c
            if e in self.b1 or e in self.b2:
                in_b2 = e in self.b2
                if in_b2:
                    self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1))
                    del self.b2[e]
                else:
                    self.p = min(c, self.p + max(len(self.b2) / len(self.b1), 1))
                    del self.b1[e]
                if full:
                    self._replace(step, in_b2)
                self.t2[e] = None
                continue
            if len(self.t1) + len(self.b1) >= c:
                if len(self.t1) < c:
                    self.b1.popitem(last=False)
                    if full:
                        self._replace(step, False)
                else:
                    victim = next((x for x in self.t1 if x not in step), None)
                    if victim is None:
                        self._replace(step, False)
                    else:
                        del self.t1[victim]
            else:
                if len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) >= 2 * c and self.b2:
                    self.b2.popitem(last=False)
                if full:
                    self._replace(step, False)
            self.t1[e] = None
        return misses


class TwoQ:
    """2Q: a FIFO for experts seen once (``kin`` x quota slots before it yields), ghosts of its
    evictions (``kout`` x experts), an LRU for experts seen again while a ghost."""

    def __init__(self, quota: int, experts: int, kin: float, kout: float) -> None:
        self.c, self.kin, self.kout = quota, max(1, round(quota * kin)), max(1, round(experts * kout))
        self.fifo, self.ghosts, self.lru = OrderedDict(), OrderedDict(), OrderedDict()

    def access(self, ids: list[int]) -> int:
        step, misses = set(ids), 0
        for e in ids:
            if e in self.lru:
                self.lru.move_to_end(e)
        for e in ids:
            if e in self.lru or e in self.fifo:
                continue
            misses += 1
            if len(self.fifo) + len(self.lru) >= self.c:
                fifo = [x for x in self.fifo if x not in step]
                lru = [x for x in self.lru if x not in step]
                if fifo and (len(self.fifo) > self.kin or not lru):
                    del self.fifo[fifo[0]]
                    self.ghosts[fifo[0]] = None
                    if len(self.ghosts) > self.kout:
                        self.ghosts.popitem(last=False)
                else:
                    del self.lru[lru[0]]
            if e in self.ghosts:
                del self.ghosts[e]
                self.lru[e] = None
            else:
                self.fifo[e] = None
        return misses


class WindowLFU:
    """W-TinyLFU's shape: the ``window`` most recently used held experts outside the lookup stay,
    the lowest decayed count among the rest goes (ties: the least recent)."""

    def __init__(self, quota: int, decay: float, window: int) -> None:
        self.c, self.decay, self.window = quota, decay, window
        self.held: dict[int, int] = {}
        self.score: dict[int, tuple[float, int]] = {}
        self.clock = self.now = 0

    def access(self, ids: list[int]) -> int:
        self.now += 1
        now, d = self.now, self.decay
        for e in ids:
            s, t = self.score.get(e, (0.0, now))
            self.score[e] = (s * d ** (now - t) + 1.0, now)
        new = [e for e in ids if e not in self.held]
        excess = len(self.held) + len(new) - self.c
        if excess > 0:
            step = set(ids)
            out = sorted(((at, e) for e, at in self.held.items() if e not in step), reverse=True)
            rest = out[min(self.window, len(out) - excess) :]
            rest.sort(key=lambda r: (self.score[r[1]][0] * d ** (now - self.score[r[1]][1]), r[0]))
            for _, e in rest[:excess]:
                del self.held[e]
        for e in ids:
            self.held[e] = self.clock
            self.clock += 1
        return len(new)


def lfu_scores(experts: int):
    """LFU with decay ``g[0]`` as scores."""
    return lambda lookups, g: decayed(uses(lookups, experts), g[0])


def two_decay_scores(experts: int):
    """A decay ``g[0]`` count plus ``g[2]`` x a decay ``g[1]`` one, each per lookup of weight."""

    def score(lookups, g):
        u = uses(lookups, experts)
        return decayed(u, g[0]) * (1 - g[0]) + g[2] * decayed(u, g[1]) * (1 - g[1])

    return score


def pinned_scores(experts: int, order: list[int]):
    """LFU with decay ``g[0]``, the first ``g[1]`` of ``order`` kept."""

    def score(lookups, g):
        pinned = np.zeros(experts)
        pinned[order[: g[1]]] = BIG
        return decayed(uses(lookups, experts), g[0]) + pinned

    return score


class LIRS:
    """LIRS (Jiang and Zhang): experts whose last two uses were close (small inter-reference
    recency) are LIR and held; ``hir`` slots hold the others (HIR), first in first out. A
    recency stack keeps the LIR experts and the HIR ones seen since the oldest LIR one (non-held
    ones up to ``experts``): an HIR expert used again while in it becomes LIR, and the stack's
    oldest LIR expert becomes HIR."""

    def __init__(self, quota: int, experts: int, hir: int) -> None:
        self.c, self.lirs, self.bound = quota, quota - hir, experts
        self.stack: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.fifo: OrderedDict[int, None] = OrderedDict()  # held HIR experts, oldest first
        self.lir: set[int] = set()
        self.held: set[int] = set()

    def _top(self, e: int) -> None:
        self.stack.pop(e, None)
        self.stack[e] = None

    def _prune(self) -> None:
        """Drop HIR experts from the stack's bottom until an LIR one is there."""
        while self.stack and next(iter(self.stack)) not in self.lir:
            self.stack.popitem(last=False)

    def _promote(self, e: int) -> None:
        """``e`` becomes LIR; past the LIR count, the stack's oldest LIR expert turns HIR (held)."""
        self.lir.add(e)
        self.fifo.pop(e, None)
        if len(self.lir) > self.lirs:
            oldest = next(x for x in self.stack if x in self.lir)
            self.lir.discard(oldest)
            self.fifo[oldest] = None
        self._prune()

    def _evict(self, step: set[int]) -> None:
        victim = next((e for e in self.fifo if e not in step), None)
        if victim is None:  # every HIR slot holds this lookup's experts: the oldest LIR one goes
            victim = next(e for e in self.stack if e in self.lir and e not in step)
            self.lir.discard(victim)
            del self.stack[victim]
            self._prune()
        else:
            del self.fifo[victim]
        self.held.discard(victim)

    def access(self, ids: list[int]) -> int:
        step, misses = set(ids), 0
        for e in ids:
            if e not in self.held:
                misses += 1
                if len(self.held) >= self.c:
                    self._evict(step)
                self.held.add(e)
            if e in self.lir:
                self._top(e)
                self._prune()
            elif len(self.lir) < self.lirs or e in self.stack:
                self._top(e)
                self._promote(e)
            else:
                self._top(e)
                self.fifo.pop(e, None)
                self.fifo[e] = None
            while len(self.stack) > self.bound:  # forget the oldest non-held HIR entries
                old = next((x for x in self.stack if x not in self.held), None)
                if old is None:
                    break
                del self.stack[old]
        return misses


def stateful(test, fit, make, grid):
    """(misses on ``test``, the parameters) of ``make(*params)`` with the grid point whose fresh
    replay of ``fit`` missed least."""

    def run(lookups, params):
        table = make(*params)
        return sum(table.access(ids) for ids in lookups)

    best = min(grid, key=lambda g: (run(fit, g), g))
    return run(test, best), best


def scored(test, fit, quota, score, grid, bypass=False):
    """The same for a scoring policy: ``score(lookups, params)`` -> [lookup, expert] scores."""
    best = min(grid, key=lambda g: (score_misses(fit, quota, score(fit, g), bypass), g))
    return score_misses(test, quota, score(test, best), bypass), best


def layer_runs(test, fit_all, held, pos, quota, experts, top_k, cross):
    """Per policy, a call giving its (misses, fitted parameters) on ``test``, layer ``pos``'s
    lookups of the scored fold, fitted on ``fit_all`` (every layer's lookups of the other folds);
    ``held`` is every layer's lookups of the scored fold (the cross-layer scorer's features)."""
    fit = fit_all[pos]
    count, two = lfu_scores(experts), two_decay_scores(experts)

    def lfu(decays):
        return [(d,) for d in decays]

    pins = pinned_scores(experts, ranked(fit))
    runs = {
        "lru": lambda: (replay_set(test, LRUSet(quota)), ()),
        "belady": lambda: (_belady_misses(test, quota), ()),
        "belady + bypass": lambda: (belady_bypass_misses(test, quota), ()),
        "lfu, study decays": lambda: scored(test, fit, quota, count, lfu(DECAYS)),
        "lfu + bypass": lambda: scored(test, fit, quota, count, lfu(DECAYS), bypass=True),
        "lrfu, fine decays": lambda: scored(test, fit, quota, count, lfu(FINE_DECAYS)),
        "lfu, two decays": lambda: scored(
            test,
            fit,
            quota,
            two,
            [(a, b, w) for a in (0.99, 0.995, 0.999) for b in (0.5, 0.8, 0.9) for w in (0.1, 0.3, 1.0, 3.0)],
        ),
        "lfu + pinned": lambda: scored(
            test,
            fit,
            quota,
            pins,
            [(d, n) for d in (0.99, 0.999) for n in range(quota - top_k + 1)],
        ),
        "w-tinylfu": lambda: stateful(
            test,
            fit,
            lambda d, w: WindowLFU(quota, d, w),
            [(d, w) for d in (0.99, 0.999) for w in (1, 2, 3)],
        ),
        "arc": lambda: stateful(test, fit, lambda: ARC(quota), [()]),
        "2q": lambda: stateful(
            test,
            fit,
            lambda kin, kout: TwoQ(quota, experts, kin, kout),
            [(a, b) for a in (0.25, 0.5) for b in (0.25, 0.5, 1.0)],
        ),
        "lirs": lambda: stateful(
            test, fit, lambda hir: LIRS(quota, experts, hir), [(n,) for n in range(1, quota - 1)]
        ),
        "learned scorer": lambda: learned_scorer(fit_all, held, pos, quota, experts, False),
    }
    if cross:
        runs["learned scorer + other layers"] = lambda: learned_scorer(
            fit_all, held, pos, quota, experts, True
        )
    return runs


def candidates(path: str, quota: int, folds: int, only=None) -> tuple[dict[str, tuple[int, dict]], int]:
    """Per policy (those named in ``only``, or all; ``BASES`` always), (misses over every
    fold, how often each parameter was chosen); the tokens."""
    trace = read_trace(path)
    h = trace.header
    experts, layers = h.num_experts, len(h.moe_layers)
    pieces = folds_of(trace, folds)
    parts = [
        [[list(dict.fromkeys(a)) for a in layer_accesses(p, pos, quota)] for pos in range(layers)]
        for p in pieces
    ]
    # the cross-layer scorer aligns layers by step: only where every step is one lookup in each
    cross = all(len(lk) == len(set(p.step_ids())) for p, part in zip(pieces, parts) for lk in part)
    misses: dict[str, int] = defaultdict(int)
    chose: dict[str, dict] = defaultdict(lambda: defaultdict(int))

    for k in range(folds):
        others = [j for j in range(folds) if j != k]
        fit_all = [[a for j in others for a in parts[j][pos]] for pos in range(layers)]
        for pos in range(layers):
            runs = layer_runs(parts[k][pos], fit_all, parts[k], pos, quota, experts, h.top_k, cross)
            unknown = set(only or ()).difference(runs)
            if unknown:
                raise SystemExit(f"--only: no policy {sorted(unknown)}; the policies: {', '.join(runs)}")
            for name, run in runs.items():
                if only and name not in only and name not in BASES:
                    continue
                m, params = run()
                misses[name] += m
                chose[name][params] += 1
    return {name: (m, chose[name]) for name, m in misses.items()}, len(trace.tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--quota", type=int, nargs="+", default=[3, 4, 5, 6, 7, 8])
    ap.add_argument("--folds", type=int, default=4)
    ap.add_argument("--only", nargs="+", metavar="POLICY", help="these policies (the names printed) only")
    ns = ap.parse_args()
    # "meets": <= 0.8x LRU and <= 1.3x the Belady of the policy's own rule (with bypass or not)
    print("| quota | policy | misses/token | x LRU | x Belady | x Belady + bypass | meets | fitted |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for quota in ns.quota:
        t0 = time.perf_counter()
        rows, tokens = candidates(ns.trace, quota, ns.folds, ns.only)
        lru, belady, belady_b = (rows[b][0] for b in BASES)
        for name, (m, chose) in rows.items():
            top = sorted(chose.items(), key=lambda c: (-c[1], c[0]))[:2]
            fitted = ", ".join(f"{'/'.join(f'{x:g}' for x in g)} x{n}" for g, n in top if g)
            oracle = belady_b if "bypass" in name else belady
            meets = "yes" if m <= 0.8 * lru and m <= 1.3 * oracle and name not in BASES else ""
            print(
                f"| {quota} | {name} | {m / tokens:.3f} | {m / lru:.3f} | {m / belady:.3f} | {m / belady_b:.3f} "
                f"| {meets} | {fitted} |",
                flush=True,
            )
        print(f"<!-- quota {quota}: {time.perf_counter() - t0:.0f} s -->", flush=True)


if __name__ == "__main__":
    main()
