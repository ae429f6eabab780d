"""Expert-cache bookkeeping: which experts one MoE layer holds and in what LRU order. Plain
Python, no torch: the slot manager drives it, the planner replays route traces through it.

One step's routed ids are deduplicated keeping router order. Hits and misses are decided against
the set held when the step starts, so a step's experts never evict each other (the quota is at
least the step's distinct ids). Then every id of the step becomes most recent, in router order:
the earliest id of the step is the oldest of them. Evictions are the oldest ids not in the step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import NamedTuple


class Access(NamedTuple):
    """Unpacks as ``hits, misses, evictions``."""

    hits: tuple[int, ...]  # router order
    misses: tuple[int, ...]  # router order: the experts to read
    evictions: tuple[int, ...]  # oldest first: the slots the misses may take once free slots run out


class LRUSet:
    """The experts one layer holds, oldest first, at most ``quota`` of them."""

    def __init__(self, quota: int) -> None:
        if quota < 1:
            raise ValueError(f"quota must be >= 1, got {quota}")
        self.quota = quota
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
        evictions = []
        excess = len(self._order) + len(misses) - self.quota
        if excess > 0:
            in_step = set(step)
            for e in self._order:
                if e not in in_step:
                    evictions.append(e)
                    if len(evictions) == excess:
                        break
        for e in evictions:
            del self._order[e]
        for e in step:
            self._order[e] = None
            self._order.move_to_end(e)
        return Access(hits, misses, tuple(evictions))


def fetches(rows: list[list[int]], quota: int) -> list[list[int]]:
    """The cache lookups one forward of a layer makes, in order: every token's experts at once
    when their union fits the quota, else the distinct experts in ascending-id batches of at
    most ``quota`` (the streaming layer runs exactly these; the simulator replays them)."""
    distinct = sorted({e for row in rows for e in row})
    if len(distinct) <= quota:
        return [[e for row in rows for e in row]]
    return [distinct[lo : lo + quota] for lo in range(0, len(distinct), quota)]
