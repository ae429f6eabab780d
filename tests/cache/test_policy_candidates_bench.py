"""benchmarks/policy_candidates.py runs by hand: its replay must decide as the cache's LFU, and
its literature policies must behave as their definitions say on short hand-made sequences."""

import random
from itertools import combinations

import bench_scripts
import numpy as np
import pytest

from edgerun.cache.policy import LFUSet, LRUSet, replay_misses


@pytest.fixture(scope="module")
def bench():
    return bench_scripts.load("policy_candidates")


def misses(table, lookups):
    return sum(table.access(ids) for ids in lookups)


@pytest.mark.parametrize("decay", [0.5, 0.9, 0.99, 1.0])
@pytest.mark.parametrize("quota", [3, 5])
def test_scored_replay_of_decayed_counts_is_the_caches_lfu(bench, decay, quota):
    """The script's baseline row is the cache's policy: the same misses on a random stream."""
    rng = random.Random(7)
    lookups = [list(dict.fromkeys(rng.choices(range(12), k=2))) for _ in range(600)]
    scores = bench.decayed(bench.uses(lookups, 12), decay)
    assert bench.score_misses(lookups, quota, scores) == replay_misses(lookups, LFUSet(quota, decay))


def test_arc_keeps_an_expert_seen_twice_through_a_scan(bench):
    """1 is used twice (ARC's T2), 2 and 3 once: ARC evicts 2 for 3, LRU evicts 1."""
    lookups = [[1], [1], [2], [3], [1]]
    assert misses(bench.ARC(2), lookups) == 3
    assert replay_misses(lookups, LRUSet(2)) == 4


def test_2q_promotes_a_ghost_and_keeps_it_through_a_scan(bench):
    """1 leaves the FIFO, comes back as a ghost (into the LRU part) and outlives 5, 6, 7."""
    lookups = [[1], [2], [3], [4], [1], [5], [6], [7], [1]]
    assert misses(bench.TwoQ(3, 16, 0.25, 0.5), lookups) == 8
    assert replay_misses(lookups, LRUSet(3)) == 9


def test_w_tinylfu_keeps_its_window_where_lfu_evicts_it(bench):
    """At [4] LFU evicts 3 (used once), the window keeps it (the most recent) and evicts 1."""
    lookups = [[1], [1], [2], [2], [3], [4], [3]]
    assert misses(bench.WindowLFU(3, 1.0, 1), lookups) == 4
    assert replay_misses(lookups, LFUSet(3, 1.0)) == 5


def test_pinned_scores_keep_the_pins_above_any_count(bench):
    score = bench.pinned_scores(4, [2, 0, 1, 3])
    s = score([[1], [1], [3]], (1.0, 2))
    assert np.array_equal(s[-1], [bench.BIG, 2.0, bench.BIG, 1.0])


def test_the_scorer_target_and_transitions_count_what_follows(bench):
    u = np.array([[1.0, 0], [0, 1], [1, 0], [0, 1]])  # experts 0, 1, 0, 1
    assert np.array_equal(bench.ahead(u, 0.5), [[0.5, 1.25], [1, 0.5], [0, 1], [0, 0]])
    # per use of a: after 0 (at 0 and 2), 1 at +1 twice and +3 (0.7 ** 2), 0 at +2 (0.7); after
    # 1 (at 1 and 3), 0 at +1, 1 at +2. Close, not equal: the count guard adds 1e-9 to each use count
    want = [[0.7 / 2, (2 + 0.7**2) / 2], [1 / 2, 0.7 / 2]]
    assert np.allclose(bench.transitions(u, u), want, rtol=1e-8, atol=0)


def test_lirs_keeps_its_reused_experts_through_a_scan(bench):
    """1 and 2 are reused (LIR, 2 of the 3 slots); 3, 4, 5 pass through the one HIR slot, so 1 and
    2 are still held at the end, where LRU has evicted both."""
    lookups = [[1], [2], [1], [2], [3], [4], [5], [1], [2]]
    assert misses(bench.LIRS(3, 16, 1), lookups) == 5
    assert replay_misses(lookups, LRUSet(3)) == 7


def test_lirs_promotes_an_hir_expert_reused_while_on_its_stack(bench):
    """3 is evicted from the HIR slot by 4 but stays on the stack, so its reuse makes it LIR and
    the stack's oldest LIR expert (1) turns HIR: it is the next victim, for 4."""
    table = bench.LIRS(3, 16, 1)
    for ids in ([1], [2], [3], [4], [3]):
        table.access(ids)
    assert table.lir == {2, 3} and list(table.fifo) == [1]
    assert table.access([4]) == 1 and table.held == {2, 3, 4}


def test_bypass_keeps_counted_experts_where_lfu_lets_a_newcomer_in(bench):
    """Quota 2, decay 1: at [3] LFU evicts 1 (counts 2 and 2, 1 the least recent) and misses it
    next; with bypass 3 (count 1) outscores neither held expert, so it is read, used and dropped."""
    lookups = [[1], [1], [2], [2], [3], [1], [2]]
    scores = bench.decayed(bench.uses(lookups, 4), 1.0)
    assert bench.score_misses(lookups, 2, scores) == 4
    assert bench.score_misses(lookups, 2, scores, bypass=True) == 3


def test_bypass_holds_every_miss_while_the_quota_has_room(bench):
    rng = random.Random(3)
    lookups = [list(dict.fromkeys(rng.choices(range(6), k=2))) for _ in range(200)]
    scores = bench.decayed(bench.uses(lookups, 6), 0.9)
    assert bench.score_misses(lookups, 6, scores, bypass=True) == 6  # each expert's first use


def fewest_misses(lookups, quota):
    """The optimum over every choice of held set after each lookup (a subset of the held experts
    and the lookup's, at most ``quota``), by dynamic programming over the held sets."""
    best = {frozenset(): 0}
    for ids in lookups:
        nxt = {}
        for held, m in best.items():
            m += len(set(ids) - held)
            pool = sorted(held | set(ids))
            for k in range(min(quota, len(pool)) + 1):
                for keep in combinations(pool, k):
                    s = frozenset(keep)
                    nxt[s] = min(nxt.get(s, m), m)
        best = nxt
    return min(best.values())


@pytest.mark.parametrize("seed", range(6))
def test_belady_with_bypass_is_the_optimum_and_below_every_policy(bench, seed):
    """On short random streams (top-2 of 6 experts, quota 3) the bound equals the exhaustive
    optimum, and no policy, with bypass or without, misses less."""
    rng = random.Random(seed)
    lookups = [list(dict.fromkeys(rng.choices(range(6), k=2))) for _ in range(14)]
    bound = bench.belady_bypass_misses(lookups, 3)
    assert bound == fewest_misses(lookups, 3)
    scores = bench.decayed(bench.uses(lookups, 6), 0.9)
    others = [
        bench._belady_misses(lookups, 3),
        bench.score_misses(lookups, 3, scores),
        bench.score_misses(lookups, 3, scores, bypass=True),
        replay_misses(lookups, LRUSet(3)),
    ]
    assert all(bound <= m for m in others)
