import random

import pytest

from edgerun.cache import policy_reference as reference
from edgerun.cache.policy import BypassLFUSet, LFUSet, LRUSet, expert_set


def test_quota_two_example_from_the_issue():
    lru = LRUSet(2)
    assert lru.access([7, 3]) == ((), (7, 3), ())
    hits, misses, evictions = lru.access([9])
    assert (hits, misses, evictions) == ((), (9,), (7,))  # 7 was inserted first, so it is oldest
    assert lru.access([3]).hits == (3,)
    assert lru.order() == [9, 3]


def test_ids_are_deduplicated_in_router_order():
    lru = LRUSet(4)
    assert lru.access([5, 2, 5, 2, 8]).misses == (5, 2, 8)
    assert lru.order() == [5, 2, 8]
    assert len(lru) == 3 and 5 in lru and 4 not in lru


def test_hits_are_decided_at_the_start_of_the_step():
    # Evicting as misses arrive would drop 3 for 7 and then miss on 3: a step's experts must not
    # evict each other.
    lru = LRUSet(2)
    lru.access([3])
    lru.access([5])  # order: 3 (oldest), 5
    step = lru.access([7, 3])
    assert step.hits == (3,) and step.misses == (7,) and step.evictions == (5,)
    assert lru.order() == [7, 3]  # the whole step in router order, hits included


def test_evictions_are_oldest_first_and_skip_the_step():
    lru = LRUSet(4)
    lru.access([1, 2])
    lru.access([3, 4])
    step = lru.access([2, 5, 6])
    assert step.evictions == (1, 3)
    assert lru.order() == [4, 2, 5, 6]


def test_discard_forgets_an_expert():
    lru = LRUSet(2)
    lru.access([4, 6])
    lru.discard(4)
    lru.discard(9)  # not held: nothing to do
    assert lru.order() == [6]
    assert lru.access([4, 6]) == ((6,), (4,), ())


def test_quota_must_cover_a_step():
    with pytest.raises(ValueError, match="quota must be >= 1"):
        LRUSet(0)
    with pytest.raises(ValueError, match="3 distinct experts but the quota is 2"):
        LRUSet(2).access([1, 2, 3])


def _reference(quota, steps):
    """The definition, spelled out: hits against the held set at step start; the held set
    becomes the step's ids plus the most recent others, up to the quota."""
    held, out = [], []  # oldest first
    for ids in steps:
        step = list(dict.fromkeys(ids))
        hits = [e for e in step if e in held]
        misses = [e for e in step if e not in held]
        rest = [e for e in held if e not in step]
        keep = quota - len(step)
        evicted = rest[: max(0, len(rest) - keep)]
        held = rest[len(evicted) :] + step
        out.append((tuple(hits), tuple(misses), tuple(evicted)))
    return out, held


def test_matches_the_definition_on_random_steps():
    rng = random.Random(0)
    for quota in (2, 3, 5, 8):
        steps = [[rng.randrange(12) for _ in range(rng.randint(1, 2))] for _ in range(300)]
        lru = LRUSet(quota)
        got = [tuple(lru.access(s)) for s in steps]
        want, held = _reference(quota, steps)
        assert got == want
        assert lru.order() == held


def test_lfu_evicts_the_least_used_and_decay_forgets():
    lfu = LFUSet(2, decay=1.0)  # plain LFU: 7 used three times stays over the more recent 3
    for ids in ([7], [7], [7], [3]):
        lfu.access(ids)
    assert lfu.access([9]).evictions == (3,)
    fast = LFUSet(2, decay=0.1)  # old uses weigh almost nothing: the oldest goes, as in LRU
    for ids in ([7], [7], [7], [3]):
        fast.access(ids)
    assert fast.access([9]).evictions == (7,)
    tie = LFUSet(3, decay=1.0)  # equal scores: the least recent goes first
    tie.access([4, 5, 6])
    assert tie.access([8]).evictions == (4,)


def test_lfu_keeps_the_step_rules_and_refuses_a_bad_decay():
    lfu = LFUSet(2, decay=1.0)
    lfu.access([3])
    lfu.access([3])
    lfu.access([5])
    step = lfu.access([7, 3])  # 3 hits (decided at step start); the step's ids never evict each other
    assert step == ((3,), (7,), (5,))
    with pytest.raises(ValueError, match="decay must be in"):
        LFUSet(2, decay=0)
    with pytest.raises(ValueError, match="policy 'mru' is not one of lfu, lfu-bypass, lru"):
        expert_set(2, "mru")


def test_pinned_experts_are_never_evicted():
    pinned = LRUSet(3, pinned=[1])
    pinned.access([1, 2, 3])
    for e in (4, 5, 6):
        assert 1 not in pinned.access([e]).evictions
    assert 1 in pinned
    with pytest.raises(ValueError, match="2 pinned experts leave none of the quota 2"):
        LRUSet(2, pinned=[1, 2])


def _skewed_steps(rng, n, experts, widest):
    """Steps of 1..widest ids (duplicates allowed) drawn Zipf-like, so hot experts recur."""
    weights = [1.0 / (i + 1) for i in range(experts)]
    return [rng.choices(range(experts), weights, k=rng.randint(1, widest)) for _ in range(n)]


@pytest.mark.parametrize("decay", [None, 0.1, 0.5, 0.8, 0.9, 0.95, 0.99, 0.999, 1.0])
def test_books_decide_as_the_reference_on_random_steps(decay):
    """The fast books (flat tables, a lazy heap, LFU's global scale) make the reference's
    decisions: the same hits, misses and victims in the same order, the same held order, with
    discards (failed fills) between steps, over enough lookups to rescale LFU's weights
    (decay 0.5: every 256 lookups)."""
    rng = random.Random(str(decay))
    for quota, experts, widest in ((2, 6, 2), (5, 12, 3), (8, 40, 8), (16, 64, 8)):
        steps = _skewed_steps(rng, 1500, experts, widest)
        fast, ref = (
            (LRUSet(quota), reference.LRUSet(quota))
            if decay is None
            else (
                LFUSet(quota, decay),
                reference.LFUSet(quota, decay),
            )
        )
        for i, ids in enumerate(steps):
            assert fast.access(ids) == ref.access(ids), f"step {i} of quota {quota}"
            if i % 97 == 0:
                gone = rng.randrange(experts)
                fast.discard(gone)
                ref.discard(gone)
            assert fast.order() == ref.order()


def test_pinned_books_decide_as_the_reference():
    rng = random.Random(7)
    steps = _skewed_steps(rng, 2000, 30, 3)
    fast, ref = LRUSet(6, pinned=[0, 5]), reference.LRUSet(6, pinned=[0, 5])
    for ids in steps:
        assert fast.access(ids) == ref.access(ids)
    assert fast.order() == ref.order()
    for books in (LRUSet(3, pinned=[1, 2]), reference.LRUSet(3, pinned=[1, 2])):
        books.access([1, 2])
        books.access([3])
        with pytest.raises(ValueError, match="the quota 3 cannot take its misses"):
            books.access([4, 5])  # 1 and 2 pinned: only 3 to evict for 2 misses
        assert books.order() == [1, 2, 3] and books.access([3]).hits == (
            3,
        )  # the refused step changed nothing


def test_bypass_leaves_a_newcomer_used_less_unheld():
    """lfu-bypass: a miss is read and used, and held only if its decayed count (this use
    included) beats a held expert's outside the lookup; LFU holds every miss."""
    bypass, lfu = BypassLFUSet(2, decay=1.0, spill=1), LFUSet(2, decay=1.0)
    for ids in ([1], [1], [2], [2]):
        bypass.access(ids)
        lfu.access(ids)
    assert bypass.access([3]) == ((), (3,), ()) and bypass.passed == (3,)
    assert lfu.access([3]) == ((), (3,), (1,)) and lfu.passed == ()
    assert bypass.order() == [1, 2] and bypass.access([1]).hits == (1,)  # LFU would miss here
    assert lfu.access([1]).misses == (1,)
    # 3 used as often as 2 now, and more recently: it stays, 2 goes
    assert bypass.access([3]) == ((), (3,), (2,)) and bypass.passed == ()


def test_bypass_passes_at_most_its_spill_rows():
    """A lookup whose misses all lose keeps to ``spill`` passed ones; the rest are held, evicting
    the lowest held experts outside the lookup, which always stay."""
    books = BypassLFUSet(4, decay=1.0, spill=1)
    for _ in range(3):
        books.access([1, 2, 3, 4])
    out = books.access([4, 7, 8, 9])
    assert out.hits == (4,) and out.misses == (7, 8, 9)
    assert books.passed == (7,)  # equal counts: the earliest in router order loses first
    assert out.evictions == (1, 2) and books.order() == [3, 4, 8, 9]
    with pytest.raises(ValueError, match="needs spill rows"):
        BypassLFUSet(4, decay=1.0, spill=0)


@pytest.mark.parametrize("decay", [0.5, 0.9, 0.99, 1.0])
@pytest.mark.parametrize("spill", [1, 2, 8])
def test_bypass_books_decide_as_the_reference_on_random_steps(decay, spill):
    """The fast bypassing books make the reference's decisions (hits, misses, victims, the passed
    misses, the held order), with discards between steps."""
    rng = random.Random(f"{decay} {spill}")
    for quota, experts, widest in ((2, 6, 2), (5, 12, 3), (8, 40, 8)):
        fast, ref = BypassLFUSet(quota, decay, spill), reference.BypassLFUSet(quota, decay, spill)
        for i, ids in enumerate(_skewed_steps(rng, 1500, experts, widest)):
            assert fast.access(ids) == ref.access(ids), f"step {i} of quota {quota}"
            assert fast.passed == ref.passed
            if i % 97 == 0:
                gone = rng.randrange(experts)
                fast.discard(gone)
                ref.discard(gone)
            assert fast.order() == ref.order()
