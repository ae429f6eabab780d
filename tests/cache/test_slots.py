"""Slot bookkeeping: LRU with router-order insertion, generations, quota and budget refusals."""

import pytest

from edgerun.cache.slots import Fill, LayerSlots, QuotaError, StaleSlotError


def test_router_order_insertion_decides_the_oldest():
    s = LayerSlots(layer=0, quota=2, top_k=2)
    refs, fills = s.assign([7, 3])
    assert [r.expert for r in refs] == [7, 3] and [f.expert for f in fills] == [7, 3]
    _, fills = s.assign([9])  # 7 was inserted first: it is the oldest and goes
    assert [f.expert for f in fills] == [9] and 7 not in s.slot_of
    _, fills = s.assign([3])
    assert fills == [] and s.counters.hits == 1 and s.counters.misses == 3 and s.counters.evictions == 1


def test_duplicates_in_a_step_are_fetched_once():
    s = LayerSlots(0, 4, 2)
    refs, fills = s.assign([5, 1, 5, 1, 2])
    assert [r.expert for r in refs] == [5, 1, 2] and len(fills) == 3


def test_refilled_slot_refuses_old_reference():
    s = LayerSlots(0, 2, 2)
    (old, _), _ = s.assign([1, 2])
    s.check(old)
    s.assign([3, 4])  # both slots refilled
    with pytest.raises(StaleSlotError, match=r"expert 1 in slot \d \(generation 1\) is stale"):
        s.check(old)


def test_abandoned_fill_is_read_again():
    s = LayerSlots(0, 2, 1)
    _, fills = s.assign([5])
    s.abandon(fills[0])
    _, again = s.assign([5])
    assert again == [Fill(5, again[0].slot)]


def test_quota_below_top_k_is_refused():
    with pytest.raises(QuotaError, match=r"layer 3: expert quota 7 is below top_k 8"):
        LayerSlots(3, 7, 8)
