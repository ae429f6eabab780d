"""Expert-cache bookkeeping: which experts one MoE layer holds and which to evict. Plain
Python, no torch: the slot manager drives it, the planner and the simulator replay route traces
through the same classes, so simulated and counted misses agree.

One step's routed ids are deduplicated keeping router order. Hits and misses are decided against
the set held when the step starts, so a step's experts never evict each other (the quota is at
least the step's distinct ids). Then every id of the step becomes most recent, in router order:
the earliest id of the step is the oldest of them. :class:`LRUSet` evicts the oldest ids not in
the step; :class:`LFUSet` the least used, each use weighted down by ``decay`` per lookup since,
the oldest first among equals. :class:`BypassLFUSet` (the cache's default, :data:`DEFAULT_POLICY`)
is LFU with decay that may leave a miss unheld: the miss is read into a spill row and used, and
stays only if it has been used more than the held expert it would evict. With decay 0.99 it had
the fewest misses of the policies measured on the demo model's held-out routing, 4-17% fewer
than LFU's (docs/benchmarks.md, "Expert cache policy" and "Bypass in the cache").

The books cost a few microseconds a lookup (``benchmarks/cache_books.py``): per held expert its
last use on a clock of ids touched (recency is a number) and, for LFU, its (score, lookup) as
of that use; the eviction order is a heap of (key, last use, expert) entries that are lower
bounds (a key only grows with use): a hit costs nothing there, and a popped entry that is out of
date is pushed again with its current key. :mod:`edgerun.cache.policy_reference` is the same
policies as one pass over the held experts per eviction, the definition these are tested
against (identical hits, misses and evictions).
"""

from __future__ import annotations

from collections.abc import Iterable
from heapq import heappop, heappush
from math import log
from typing import NamedTuple


class Access(NamedTuple):
    """Unpacks as ``hits, misses, evictions``."""

    hits: tuple[int, ...]  # router order
    misses: tuple[int, ...]  # router order: the experts to read
    evictions: tuple[int, ...]  # oldest first: the slots the misses may take once free slots run out


_new = tuple.__new__  # a NamedTuple without its Python-level __new__ (the lookups' hot path)


def checked_pins(quota: int, pinned: Iterable[int]) -> frozenset[int]:
    """``pinned`` as a set, refused unless ``quota`` (>= 1) leaves a slot to the others."""
    if quota < 1:
        raise ValueError(f"quota must be >= 1, got {quota}")
    pins = frozenset(pinned)
    if len(pins) >= quota:
        raise ValueError(f"{len(pins)} pinned experts leave none of the quota {quota} to the LRU")
    return pins


class LRUSet:
    """The experts one layer holds, oldest first, at most ``quota`` of them. ``pinned`` experts
    (a warm set) are never evicted once held; the others share the remaining slots as an LRU."""

    passed: tuple[int, ...] = ()  # the last lookup's misses left unheld: none but a bypassing set's

    def __init__(self, quota: int, pinned: Iterable[int] = ()) -> None:
        self.quota, self.pinned = quota, checked_pins(quota, pinned)
        self._at: dict[int, int] = {}  # held expert -> its last use on the clock (larger: more recent)
        self._clock = 0  # ids touched so far: a step's ids take the next numbers in router order
        # (key, last use, expert) of every held unpinned expert: at most one live entry each (its
        # last use in _entry), a lower bound of its current pair; others are dropped when popped
        self._heap: list[tuple[float, int, int]] = []
        self._entry: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._at)

    def __contains__(self, expert: int) -> bool:
        return expert in self._at

    def order(self) -> list[int]:
        """Held ids, oldest first."""
        return sorted(self._at, key=self._at.__getitem__)

    def discard(self, expert: int) -> None:
        """Forget ``expert`` if held (its slot's fill failed), so the next access misses on it."""
        self._at.pop(expert, None)  # its heap entry is dropped when popped

    def access(self, ids: Iterable[int]) -> Access:
        return self._access(list(dict.fromkeys(ids)))

    def _access(self, step: list[int]) -> Access:
        """:meth:`access` of ``step``: ids already deduplicated, in router order."""
        if len(step) > self.quota:
            raise ValueError(
                f"a step routes to {len(step)} distinct experts but the quota is {self.quota}: "
                "one step's experts would evict each other"
            )
        at = self._at
        misses = [e for e in step if e not in at]
        hits = [e for e in step if e in at] if misses else step
        victims = self._victims(step, len(misses)) if len(at) + len(misses) > self.quota else ()
        for e in victims:
            del at[e]
        self._use(step)
        n = self._clock
        at.update(zip(step, range(n, n + len(step))))
        self._clock = n + len(step)
        if misses:
            heap, entry, pinned = self._heap, self._entry, self.pinned
            for e in misses:
                if e not in pinned:
                    heappush(heap, (self._key(e), at[e], e))
                    entry[e] = at[e]
        return _new(Access, (tuple(hits), tuple(misses), victims))

    def _use(self, step: list[int]) -> None:
        """Count one lookup of ``step`` (LFU's scores)."""

    def _key(self, expert: int) -> float:
        """What ranks ``expert`` for eviction before its last use (lowest first); never falls."""
        return 0.0

    def _victims(self, step: list[int], new: int) -> tuple[int, ...]:
        """The held ids outside the step (and unpinned) that ``new`` misses displace, lowest
        (key, last use) first."""
        victims = self._lowest(step, len(self._at) + new - self.quota)
        entry = self._entry
        for _, _, e in victims:
            del entry[e]
        return tuple([e for _, _, e in victims])

    def _lowest(self, step: list[int], excess: int) -> list[tuple[float, int, int]]:
        """The heap entries (key, last use, expert) of the ``excess`` held ids outside the step
        (and unpinned) with the lowest (key, last use), in that order, popped from the heap (their
        ``_entry`` kept: the caller drops those it evicts and pushes the others back)."""
        heap, at, entry = self._heap, self._at, self._entry
        keep = set(step)
        victims: list[tuple[float, int, int]] = []
        aside: list[tuple[float, int, int]] = []  # the step's own entries, pushed back
        while len(victims) < excess and heap:
            item = heappop(heap)
            _, a, e = item
            if entry.get(e) != a:  # an entry of an expert dropped and taken in again since
                continue
            now = at.get(e)
            if now is None:  # dropped (discard)
                del entry[e]
            elif now != a:  # used since: its entry moves up to its current key
                entry[e] = now
                heappush(heap, (self._key(e), now, e))
            else:
                (aside if e in keep else victims).append(item)
        if len(victims) < excess:
            for item in aside + victims:
                heappush(heap, item)
            raise ValueError(
                f"a step routes to {len(step)} experts, {len(self.pinned.union(step)) - len(victims)} held ones "
                f"pinned or in the step: the quota {self.quota} cannot take its misses"
            )
        for item in aside:
            heappush(heap, item)
        return victims


class LFUSet(LRUSet):
    """LFU with decay: each expert's score is its uses, each weighted ``decay`` ** (lookups since);
    the lowest-scoring held ids outside the step are evicted (ties: the least recent). ``decay``
    1 is plain LFU over the whole history, near 0 is LRU.

    An expert's (score, lookup of its last use) is updated only when it is used; it is ranked by
    ``log score - at * log decay``, the log of its score at any later lookup up to a factor
    common to all, computed only when its heap entry is (the same float operations as the
    reference's, so the same ranks and ties). Each use raises it by at least ``log(2 - decay)``
    (``log(1 + 1 / uses)`` at decay 1), so a held expert's entry stays a lower bound."""

    def __init__(self, quota: int, decay: float) -> None:
        super().__init__(quota)
        if not 0 < decay <= 1:
            raise ValueError(f"LFU decay must be in (0, 1], got {decay}")
        self.decay = decay
        self._log_decay = log(decay)
        self._score: dict[int, tuple[float, int]] = {}  # expert -> (score, at lookup), held or not
        self._now = 0

    def _key(self, expert: int) -> float:
        s, t = self._score[expert]
        return log(s) - t * self._log_decay

    def _use(self, step: list[int]) -> None:
        now = self._now = self._now + 1
        score, decay = self._score, self.decay
        for e in step:
            st = score.get(e)
            score[e] = (1.0, now) if st is None else (st[0] * decay ** (now - st[1]) + 1.0, now)


class BypassLFUSet(LFUSet):
    """LFU with decay whose misses need not be held (TinyLFU's admission): every miss is read and
    used for its lookup; then, where the slots cannot take them all, the held ids outside the
    lookup and the lookup's misses compete by score, and the ``excess`` lowest (key, last use; a
    miss counts as more recent than every held id) lose: a held one is evicted, a miss is
    *passed*, served for its lookup from one of the cache's ``spill`` rows and not held. At most
    ``spill`` misses of a lookup pass (the rows there are); the lookup's held ids always stay.
    A miss's score counts its own use, so a newcomer stays only if it has been used more, by
    decayed count, than the held expert it would evict. ``passed`` after each lookup: its passed
    misses, in router order (they are among its ``misses``). On the demo's traces this read
    4-17% fewer experts than LFU (docs/benchmarks.md, "Bypass in the cache")."""

    def __init__(self, quota: int, decay: float, spill: int) -> None:
        super().__init__(quota, decay)
        if spill < 1:
            raise ValueError(f"a bypassing cache needs spill rows for its passed misses, got {spill}")
        self.spill = spill
        self.passed: tuple[int, ...] = ()

    def _access(self, step: list[int]) -> Access:
        at = self._at
        misses = [e for e in step if e not in at]
        excess = len(at) + len(misses) - self.quota
        self.passed = ()
        if excess <= 0 or len(step) > self.quota:  # free slots take every miss (or the quota refuses)
            return super()._access(step)
        hits = [e for e in step if e in at]
        self._use(step)  # the misses' keys count this use; the held ones outside the step are unchanged
        n = self._clock
        newcomers = [(self._key(e), n + i, e) for i, e in enumerate(step) if e not in at]
        low = self._lowest(step, excess)
        evicted: list[tuple[float, int, int]] = []
        passed: set[int] = set()
        for item in sorted(low + newcomers):
            if len(evicted) + len(passed) == excess:
                break
            if item[2] in at:
                evicted.append(item)
            elif len(passed) < self.spill:
                passed.add(item[2])
        heap, entry = self._heap, self._entry
        for item in low[len(evicted) :]:  # ``evicted`` is a prefix of ``low``: the rest stay held
            heappush(heap, item)
        victims = tuple([e for _, _, e in evicted])
        for e in victims:
            del at[e], entry[e]
        at.update((e, n + i) for i, e in enumerate(step) if e not in passed)
        self._clock = n + len(step)
        for e in misses:
            if e not in passed:
                heappush(heap, (self._key(e), at[e], e))
                entry[e] = at[e]
        self.passed = tuple([e for e in misses if e in passed])
        return _new(Access, (tuple(hits), tuple(misses), victims))


CACHE_POLICIES = ("lfu", "lfu-bypass", "lru")
DEFAULT_POLICY = "lfu-bypass"  # the fewest reads on the demo's held-out routing (docs/benchmarks.md)
DEFAULT_DECAY = 0.99  # per lookup: the decay the held-out study's fits chose most often


def held_policy(policy: str | None, tier: bool = False, every_held: bool = False) -> str:
    """The policy a cache's slots run when asked for ``policy`` (None: :data:`DEFAULT_POLICY`):
    ``lfu`` in place of ``lfu-bypass`` where a host tier stands behind the slots (``tier``: a
    device miss is a copy from the tier, which holds it: no read to save) or every layer holds
    every expert (``every_held``: nothing misses), so no spill rows are kept; else ``policy``. The
    cache, the simulator and the planner decide by this one rule."""
    policy = policy or DEFAULT_POLICY
    return "lfu" if policy == "lfu-bypass" and (tier or every_held) else policy


def expert_set(
    quota: int, policy: str = DEFAULT_POLICY, decay: float = DEFAULT_DECAY, spill: int = 0
) -> LRUSet:
    """The books of one layer's slots under ``policy`` (one of :data:`CACHE_POLICIES`);
    ``spill``: the rows a lookup's passed misses may use (``lfu-bypass``: the cache's top_k)."""
    if policy == "lru":
        return LRUSet(quota)
    if policy == "lfu":
        return LFUSet(quota, decay)
    if policy == "lfu-bypass":
        return BypassLFUSet(quota, decay, spill)
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


# layers ahead a decode step's prefetch may read (``prefetch_ahead``): the next streamed layer, or
# the one after it too (engine/graphs.py and engine/streaming.Prefetcher predict no further)
PREFETCH_AHEAD = (1, 2)


class PrefetchGate:
    """How many reads one layer's prefetch may issue, from how its recent ones fared: all it
    predicts (up to the depth) while at least half of them were used, else only its first guess
    not held (the router's surest), which keeps the count going. A wrong guess costs a read and a
    right one saves about one, so below half prefetch loses: a cache that already holds most of
    a step's experts is left with the guesses that are wrong (measured: docs/benchmarks.md). The
    counts are integers, halved past ``WINDOW``, so the cache and the simulator, which both
    keep one gate a layer, decide alike."""

    WINDOW = 64

    def __init__(self) -> None:
        self.useful = self.wasted = 0

    def limit(self, depth: int) -> int:
        return depth if self.useful >= self.wasted else min(depth, 1)

    def record(self, useful: int, wasted: int) -> None:
        """A lookup's outcome: prefetched reads it used, and those it dropped."""
        self.useful += useful
        self.wasted += wasted
        while self.useful + self.wasted > self.WINDOW:
            self.useful //= 2
            self.wasted //= 2
