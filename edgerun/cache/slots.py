"""Slot bookkeeping for one MoE layer: which expert sits in which slot, and each slot's
generation. Plain Python (no torch, no files): the expert cache drives it and moves the bytes.

Which expert to evict is the policy's set (``cache.policy``: by default LFU with decay that may
leave a miss unheld, in a spill row shared by the layers; LFU; LRU),
the same classes the planner and the simulator replay traces through, so simulated and counted
misses agree. A :class:`SlotRef` carries the slot's generation at the time it was handed out;
refilling a slot bumps its generation, and a stale reference is refused, never served another
expert's bytes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

from edgerun.cache.policy import expert_set
from edgerun.errors import EdgerunError


class StaleSlotError(EdgerunError, RuntimeError):
    pass


class QuotaError(EdgerunError, ValueError):
    pass


class SlotRef(NamedTuple):  # immutable, and made without a Python call on the lookups' hot path
    layer: int
    expert: int
    slot: int
    generation: int


class Fill(NamedTuple):
    """A miss: read ``expert`` into ``slot`` (whose generation is already bumped)."""

    expert: int
    slot: int


_new = tuple.__new__


@dataclass
class LayerCounters:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    passed: int = 0  # misses served from a spill row and not held (``lfu-bypass``)


class LayerSlots:
    """``policy``: one of ``cache.policy.CACHE_POLICIES`` (the cache passes its own; here LFU,
    which holds every miss). ``spill``: the generations of the cache's spill rows, one list
    shared by every layer (the rows are), where a passed miss (``lfu-bypass``) is read and served
    from: slots quota + j."""

    def __init__(
        self, layer: int, quota: int, top_k: int, policy: str = "lfu", spill: list[int] | None = None
    ) -> None:
        if quota < top_k:
            raise QuotaError(
                f"layer {layer}: expert quota {quota} is below top_k {top_k}; a token's experts would evict each other"
            )
        self.layer = layer
        self.quota = quota
        self.spill = spill if spill is not None else []
        self.held = expert_set(quota, policy, spill=len(self.spill))
        self.slot_of: dict[int, int] = {}
        self.generation = [0] * quota
        self.free = list(range(quota - 1, -1, -1))  # pop() hands out slot 0 first
        self.counters = LayerCounters()

    def assign(self, ids: Iterable[int], count: bool = True) -> tuple[list[SlotRef], list[Fill]]:
        """One step's experts (router order, duplicates allowed) -> (refs in the deduplicated
        router order, fills for the misses). The caller must complete every fill, or call
        :meth:`abandon` for the ones it could not, before using the refs. A passed miss's fill
        and ref name a spill row (slot quota + j), valid until the next fill of that row by any
        layer."""
        step = list(dict.fromkeys(ids))
        hits, misses, evictions = self.held._access(step)
        passed = self.held.passed
        slot_of, free, generation = self.slot_of, self.free, self.generation
        for e in evictions:
            free.append(slot_of.pop(e))
        fills = []
        spilled: dict[int, tuple[int, int]] = {}  # passed expert -> (slot, its row's generation)
        for e in misses:
            if passed and e in passed:
                j = len(spilled)
                self.spill[j] += 1
                spilled[e] = (self.quota + j, self.spill[j])
                fills.append(_new(Fill, (e, self.quota + j)))
                continue
            slot = free.pop()
            generation[slot] += 1
            slot_of[e] = slot
            fills.append(_new(Fill, (e, slot)))
        if count:
            c = self.counters
            c.hits += len(hits)
            c.misses += len(misses)
            c.evictions += len(evictions)
            c.passed += len(passed)
        layer = self.layer
        refs = [
            _new(SlotRef, (layer, e, *spilled[e]))
            if e in spilled
            else _new(SlotRef, (layer, e, s, generation[s]))
            for e in step
            for s in (slot_of.get(e),)
        ]
        return refs, fills

    def abandon(self, fill: Fill) -> None:
        """A fill failed: the slot holds nothing valid; forget the expert so it is read again (a
        spill row's references go stale)."""
        if fill.slot >= self.quota:
            self.spill[fill.slot - self.quota] += 1
        elif self.slot_of.get(fill.expert) == fill.slot:
            self.release(fill.expert)

    def release(self, expert: int) -> None:
        """Forget ``expert`` and free its slot (its generation moves on, so a reference to it is
        stale); the next miss takes the slot."""
        slot = self.slot_of.pop(expert)
        self.held.discard(expert)
        self.generation[slot] += 1
        self.free.append(slot)

    def check(self, ref: SlotRef) -> None:
        if ref.slot >= self.quota:  # a spill row: valid until its next fill
            if (
                ref.slot - self.quota >= len(self.spill)
                or self.spill[ref.slot - self.quota] != ref.generation
            ):
                raise StaleSlotError(
                    f"layer {ref.layer}: reference to expert {ref.expert} in spill row {ref.slot - self.quota} "
                    f"(generation {ref.generation}) is stale: the row was refilled since"
                )
            return
        if self.generation[ref.slot] != ref.generation or self.slot_of.get(ref.expert) != ref.slot:
            raise StaleSlotError(
                f"layer {ref.layer}: reference to expert {ref.expert} in slot {ref.slot} "
                f"(generation {ref.generation}) is stale; the slot is now at generation {self.generation[ref.slot]}"
            )

    def resident(self) -> list[int]:
        """Held experts, oldest first."""
        return self.held.order()
