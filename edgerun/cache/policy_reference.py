"""The expert cache's eviction policies as first written: their definition, for reading, not
for speed (an eviction is one pass over the held experts; a step builds Python objects per
expert). :mod:`edgerun.cache.policy` keeps the same books in flat per-expert tables and a heap and
is tested against these to make the same decisions (``tests/cache/test_policy.py``); the
research policies of ``benchmarks/policy_bounds.py`` extend these classes.

The rules are :mod:`edgerun.cache.policy`'s: hits and misses against the set held when a step
starts, the step's ids become most recent in router order, LRU evicts the oldest ids outside the
step, LFU with decay the lowest decayed use count (ties: the least recent).
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Iterable

from edgerun.cache.policy import Access, checked_pins


class LRUSet:
    """The experts one layer holds, oldest first, at most ``quota`` of them. ``pinned`` experts
    (a warm set) are never evicted once held; the others share the remaining slots as an LRU."""

    passed: tuple[int, ...] = ()  # the last lookup's misses left unheld: none but a bypassing set's

    def __init__(self, quota: int, pinned: Iterable[int] = ()) -> None:
        self.quota, self.pinned = quota, checked_pins(quota, pinned)
        self._order: OrderedDict[int, None] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, expert: int) -> bool:
        return expert in self._order

    def order(self) -> list[int]:
        """Held ids, oldest first."""
        return list(self._order)

    def discard(self, expert: int) -> None:
        """Forget ``expert`` if held (its slot's fill failed), so the next access misses on it."""
        self._order.pop(expert, None)

    def access(self, ids: Iterable[int]) -> Access:
        step = list(dict.fromkeys(ids))
        if len(step) > self.quota:
            raise ValueError(
                f"a step routes to {len(step)} distinct experts but the quota is {self.quota}: "
                "one step's experts would evict each other"
            )
        hits = tuple(e for e in step if e in self._order)
        misses = tuple(e for e in step if e not in self._order)
        evictions = self._victims(step, len(misses))
        for e in evictions:
            del self._order[e]
        for e in step:
            self._order[e] = None
            self._order.move_to_end(e)
        return Access(hits, misses, tuple(evictions))

    def _victims(self, step: list[int], new: int) -> tuple[int, ...]:
        """The oldest held ids outside the step (and unpinned) that ``new`` misses displace."""
        excess = len(self._order) + new - self.quota
        if excess <= 0:
            return ()
        keep = self.pinned.union(step)
        victims = [e for e in self._order if e not in keep][:excess]
        if len(victims) < excess:
            raise ValueError(
                f"a step routes to {len(step)} experts, {len(keep) - len(victims)} held ones pinned or in "
                f"the step: the quota {self.quota} cannot take its misses"
            )
        return tuple(victims)


class LFUSet(LRUSet):
    """LFU with decay: each expert's score is its uses, each weighted ``decay`` ** (lookups since);
    the lowest-scoring held ids outside the step are evicted (ties: the least recent). ``decay``
    1 is plain LFU over the whole history, near 0 is LRU. Scores are ranked by a key that does not
    change between an expert's uses (``log score - at * log decay``), so an eviction is one pass."""

    def __init__(self, quota: int, decay: float) -> None:
        super().__init__(quota)
        if not 0 < decay <= 1:
            raise ValueError(f"LFU decay must be in (0, 1], got {decay}")
        self.decay = decay
        self._log_decay = math.log(decay)
        self._score: dict[int, tuple[float, int]] = {}  # expert -> (score, at lookup), held or not
        self._key: dict[int, float] = {}  # expert -> its rank key, valid at every later lookup
        self._now = 0

    def access(self, ids: Iterable[int]) -> Access:
        step = list(dict.fromkeys(ids))
        out = super().access(step)  # the step's own scores never decide its evictions
        self._count(step)
        return out

    def _count(self, step: list[int]) -> None:
        """One lookup of ``step``: each of its experts' score and rank key."""
        self._now += 1
        for e in step:
            s, t = self._score.get(e, (0.0, self._now))
            s = s * self.decay ** (self._now - t) + 1.0
            self._score[e] = (s, self._now)
            self._key[e] = math.log(s) - self._now * self._log_decay

    def _victims(self, step: list[int], new: int) -> tuple[int, ...]:
        excess = len(self._order) + new - self.quota
        if excess <= 0:
            return ()
        keep, key = set(step), self._key
        held = ((key[e], age, e) for age, e in enumerate(self._order) if e not in keep)  # oldest first
        return tuple(e for _, _, e in heapq.nsmallest(excess, held))


class BypassLFUSet(LFUSet):
    """LFU with decay whose misses need not be held: after the lookup's scores count it, the
    held ids outside the lookup and its misses are ranked by (key, age; a miss younger than every
    held id, in router order), and the lowest ``excess`` (what the slots cannot take) lose, at
    most ``spill`` of them misses: a held loser is evicted, a losing miss passed (used, not held)."""

    def __init__(self, quota: int, decay: float, spill: int) -> None:
        super().__init__(quota, decay)
        self.spill = spill
        self.passed: tuple[int, ...] = ()

    def access(self, ids: Iterable[int]) -> Access:
        step = list(dict.fromkeys(ids))
        if len(step) > self.quota:
            return super().access(step)  # refused
        order = list(self._order)
        misses = [e for e in step if e not in self._order]
        excess = len(order) + len(misses) - self.quota
        if excess <= 0:
            self.passed = ()
            return super().access(step)
        self._count(step)  # the misses' keys count this use; the held ones outside the step are unchanged
        ranked = sorted(
            [(self._key[e], age, e) for age, e in enumerate(order) if e not in step]
            + [(self._key[e], len(order) + i, e) for i, e in enumerate(misses)]
        )
        evicted: list[int] = []
        passed: list[int] = []
        for _, _, e in ranked:
            if len(evicted) + len(passed) == excess:
                break
            if e in self._order:
                evicted.append(e)
            elif len(passed) < self.spill:
                passed.append(e)
        for e in evicted:
            del self._order[e]
        for e in step:
            if e not in passed:
                self._order[e] = None
                self._order.move_to_end(e)
        self.passed = tuple(e for e in misses if e in passed)
        return Access(tuple(e for e in step if e not in misses), tuple(misses), tuple(evicted))
