"""The policy study: what a policy learns is fitted on the other folds, scored on the held-out one."""

import random

import pytest

from edgerun.tools.routes import RouteTrace, TraceHeader
from edgerun.tools.simulate import STUDY, folds_of, policy_study, simulate

HEADER = TraceHeader("toy", "qwen3_moe", 1, (0,), 12, 2)


def _trace(n: int, seed: int = 0) -> RouteTrace:
    """A skewed routing: experts 0 and 1 are hot, the rest a drifting working set."""
    rng = random.Random(seed)
    tokens = []
    for t in range(n):
        hot = rng.choice((0, 1))
        cold = 2 + (t // 50 + rng.randrange(3)) % 10
        tokens.append(((hot, cold),))
    return RouteTrace(HEADER, tuple(tokens))


def test_folds_are_contiguous_and_cover_the_trace():
    trace = RouteTrace(HEADER, _trace(10).tokens, steps=(0, 0, 1, 1, 1, 2, 3, 3, 4, 5))
    parts = folds_of(trace, 3)
    assert sum(len(p.tokens) for p in parts) == 10
    assert [p.steps for p in parts] == [
        (0, 0, 1, 1, 1),
        (2,),
        (3, 3, 4, 5),
    ]  # cut near n/3, 2n/3; never in a step
    with pytest.raises(ValueError, match="at least 2 folds"):
        folds_of(trace, 1)


def test_study_rows_are_bounded_by_belady_and_lru_matches_the_simulator():
    trace = _trace(600)
    rows = policy_study(trace, 4, folds=3)
    assert list(rows) == list(STUDY)
    opt = rows["belady"].misses
    assert all(r.misses >= opt for r in rows.values())
    # each fold replayed from empty: LRU's row is the simulator's LRU over each fold, summed
    assert rows["lru"].misses == sum(simulate(p, 4, "lru").total_misses for p in folds_of(trace, 3))
    assert rows["pinned+lru"].misses < rows["lru"].misses  # the hot pair is worth pinning here
    assert len(rows["lfu-decay"].choices) == 3  # one fitted decay per fold and layer


def test_a_study_pins_no_more_than_the_widest_lookup_leaves():
    """A prefill step's lookup can fill the quota: then nothing can be pinned (no crash)."""
    decode = _trace(300)
    prefill = RouteTrace(HEADER, decode.tokens, steps=(0,) * 20 + tuple(range(1, 281)))
    rows = policy_study(prefill, 4, folds=2)
    assert set(rows["pinned+lru"].choices) == {"0"}
    assert rows["pinned+lru"].misses == rows["lru+warm"].misses  # pinning none is the warm start


def test_prefetch_replay_needs_predictions_and_an_online_policy():
    trace = _trace(20)
    with pytest.raises(ValueError, match="has no 'predicted' experts: record it with `edgerun trace`"):
        simulate(trace, 4, "lfu", prefetch_depth=2)
    with pytest.raises(ValueError, match="prefetch replays the cache's own policies"):
        simulate(trace, 4, "belady", prefetch_depth=2)
    with pytest.raises(ValueError, match="policy 'mru' is not one of lfu, lru, belady"):
        simulate(trace, 4, "mru")
