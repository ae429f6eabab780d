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


def test_released_expert_frees_its_slot_for_the_next_miss():
    t = LayerSlots(layer=0, quota=2, top_k=1)
    refs, _ = t.assign([4, 5])
    t.release(4)
    assert 4 not in t.slot_of and 4 not in t.held
    with pytest.raises(StaleSlotError):
        t.check(refs[0])
    _, fills = t.assign([9], count=False)
    assert fills == [Fill(9, refs[0].slot)] and t.slot_of[5] == refs[1].slot  # no eviction: the freed slot


def test_far_swaps_follow_use_with_a_margin():
    """A far tier's device set moves toward the most used experts: the best outside replace the
    worst inside, only by a clear margin (equal or noisy scores move nothing), capped."""
    from edgerun.cache.expert_cache import far_swaps

    scores = [0.0, 50.0, 3.0, 40.0, 0.0, 2.0]
    assert far_swaps(scores, {0, 2, 4}, max_swaps=8) == [(0, 1), (4, 3)]  # 2 (3 uses) beats 5 (2): stays
    assert far_swaps(scores, {0, 2, 4}, max_swaps=1) == [(0, 1)]
    assert far_swaps(scores, {1, 3, 2}, max_swaps=8) == []  # the held are the most used
    assert far_swaps([10.0, 12.0, 11.0], {0}, max_swaps=8) == []  # 12 <= 1.25 x 10 + 1: within the margin
    assert far_swaps([0.0, 1.0], {0}, max_swaps=8) == []  # one use is noise


def test_a_passed_miss_is_served_from_a_spill_row_until_any_layer_refills_it():
    """lfu-bypass: a miss left unheld gets slot quota + j (spill row j), shared by the layers: a
    reference to it holds until the row's next fill by any layer, then is refused."""
    spill = [0, 0]
    a, b = LayerSlots(0, 2, 2, "lfu-bypass", spill), LayerSlots(1, 2, 2, "lfu-bypass", spill)
    for _ in range(3):
        a.assign([1, 2])
    refs, fills = a.assign([1, 7])  # 7, used once, loses to 2: read into row 0, not held
    assert fills == [Fill(7, 2)] and refs[1].slot == 2 and 7 not in a.slot_of and a.counters.passed == 1
    a.check(refs[1])
    b.assign([4, 5])
    b.assign([4, 5])
    b.assign([6])  # layer 1 passes 6 into row 0
    with pytest.raises(StaleSlotError, match=r"expert 7 in spill row 0 \(generation 1\) is stale"):
        a.check(refs[1])
    _, fills = a.assign([7])  # still unheld: read again
    assert fills == [Fill(7, 2)]
    a.abandon(fills[0])  # a failed read leaves nothing valid in the row
    assert spill[0] == 4
