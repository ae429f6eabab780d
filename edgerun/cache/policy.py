"""Expert-cache bookkeeping: which experts one MoE layer holds and which to evict. Plain
Python, no torch: the slot manager drives it, the planner and the simulator replay route traces
through the same classes, so simulated and counted misses agree.

One step's routed ids are deduplicated keeping router order. Hits and misses are decided against
the set held when the step starts, so a step's experts never evict each other (the quota is at
least the step's distinct ids). Then every id of the step becomes most recent, in router order:
the earliest id of the step is the oldest of them. :class:`LRUSet` evicts the oldest ids not in
the step; :class:`LFUSet` (the cache's default, :data:`DEFAULT_POLICY`) the least used, each use
weighted down by ``decay`` per lookup since, the oldest first among equals. LFU with decay 0.99
had the fewest misses of the policies measured on the demo model's held-out routing
(docs/benchmarks.md, "Expert cache policy").
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Iterable
from typing import NamedTuple


class Access(NamedTuple):
    """Unpacks as ``hits, misses, evictions``."""

    hits: tuple[int, ...]  # router order
    misses: tuple[int, ...]  # router order: the experts to read
    evictions: tuple[int, ...]  # oldest first: the slots the misses may take once free slots run out


class LRUSet:
    """The experts one layer holds, oldest first, at most ``quota`` of them. ``pinned`` experts
    (a warm set) are never evicted once held; the others share the remaining slots as an LRU."""

    def __init__(self, quota: int, pinned: Iterable[int] = ()) -> None:
        if quota < 1:
            raise ValueError(f"quota must be >= 1, got {quota}")
        self.quota = quota
        self.pinned = frozenset(pinned)
        if len(self.pinned) >= quota:
            raise ValueError(f"{len(self.pinned)} pinned experts leave none of the quota {quota} to the LRU")
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
        self._now += 1
        for e in step:
            s, t = self._score.get(e, (0.0, self._now))
            s = s * self.decay ** (self._now - t) + 1.0
            self._score[e] = (s, self._now)
            self._key[e] = math.log(s) - self._now * self._log_decay
        return out

    def _victims(self, step: list[int], new: int) -> tuple[int, ...]:
        excess = len(self._order) + new - self.quota
        if excess <= 0:
            return ()
        keep, key = set(step), self._key
        held = ((key[e], age, e) for age, e in enumerate(self._order) if e not in keep)  # oldest first
        return tuple(e for _, _, e in heapq.nsmallest(excess, held))


CACHE_POLICIES = ("lfu", "lru")
DEFAULT_POLICY = "lfu"
DEFAULT_DECAY = 0.99  # per lookup: the decay the held-out study's fits chose most often


def expert_set(quota: int, policy: str = DEFAULT_POLICY, decay: float = DEFAULT_DECAY) -> LRUSet:
    """The books of one layer's slots under ``policy`` (one of :data:`CACHE_POLICIES`)."""
    if policy == "lru":
        return LRUSet(quota)
    if policy == "lfu":
        return LFUSet(quota, decay)
    raise ValueError(f"expert cache policy {policy!r} is not one of {', '.join(CACHE_POLICIES)}")


def replay_misses(steps: Iterable[Iterable[int]], table: LRUSet) -> int:
    """Misses of ``steps`` (one lookup's ids each) through ``table``, from what it holds now."""
    return sum(len(table.access(ids).misses) for ids in steps)


def fetches(rows: list[list[int]], quota: int) -> list[list[int]]:
    """The cache lookups one forward of a layer makes, in order: every token's experts at once
    when their union fits the quota, else the distinct experts in ascending-id batches of at
    most ``quota`` (the streaming layer runs exactly these; the simulator replays them)."""
    distinct = sorted({e for row in rows for e in row})
    if len(distinct) <= quota:
        return [[e for row in rows for e in row]]
    return [distinct[lo : lo + quota] for lo in range(0, len(distinct), quota)]
