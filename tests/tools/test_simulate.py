"""The policy study: what a policy learns is fitted on the other folds, scored on the held-out one."""

import itertools
import random

import pytest

from edgerun.budget.planner import miss_curve, split_quotas, trace_steps
from edgerun.cache.policy import BypassLFUSet
from edgerun.tools.routes import RouteTrace, TraceHeader
from edgerun.tools.simulate import (
    STUDY,
    best_split,
    fold_split,
    folds_of,
    layer_accesses,
    policy_study,
    replay_set,
    simulate,
)

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
    # one quota for every layer: Belady's is their bound; Belady with bypass is the bypassing row's
    one = [p for p in STUDY if "/" not in p and "bypass" not in p]
    assert all(rows[p].misses >= rows["belady"].misses for p in one)
    assert all(rows[p].misses >= rows["belady/best"].misses for p in STUDY if "bypass" not in p)
    assert rows["lfu-bypass"].misses >= rows["belady+bypass"].misses
    assert rows["belady+bypass"].misses <= rows["belady"].misses  # leaving misses unheld saves reads
    # the bypassing row: each fold's layers replayed from empty at their fitted decays
    decays = iter(rows["lfu-bypass"].choices)  # by fold, then layer
    want = sum(
        replay_set(layer_accesses(part, pos, 4), BypassLFUSet(4, float(next(decays)), HEADER.top_k))
        for part in folds_of(trace, 3)
        for pos in range(len(HEADER.moe_layers))
    )
    assert rows["lfu-bypass"].misses == want
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
    with pytest.raises(ValueError, match="policy 'mru' is not one of lfu, lfu-bypass, lru, belady"):
        simulate(trace, 4, "mru")


def _layered(n: int, flip: int) -> RouteTrace:
    """Three MoE layers, 8 experts, top-2: a layer that cycles through six experts (it hits only
    once they all fit), one that reuses a pair, one that drifts. From token ``flip`` on, the
    first two layers swap patterns."""
    rng = random.Random(3)
    cycle, pair = [(0, 1), (2, 3), (4, 5)], (6, 7)
    tokens = []
    for t in range(n):
        a, b = cycle[t % 3], pair
        if t >= flip:
            a, b = b, a
        tokens.append((a, b, tuple(rng.sample(range(2 + t // 40 % 4, 6 + t // 40 % 4), 2))))
    return RouteTrace(TraceHeader("toy", "qwen3_moe", 3, (0, 1, 2), 8, 2), tuple(tokens))


def test_per_layer_quotas_replay_each_layer_at_its_own_quota():
    trace = _layered(90, 90)
    quotas = {0: 6, 1: 2, 2: 3}
    for policy in ("lfu", "lru", "belady"):
        got = simulate(trace, quotas, policy)
        assert got.quota == quotas
        assert got.misses == {layer: simulate(trace, q, policy).misses[layer] for layer, q in quotas.items()}
    assert simulate(trace, quotas, "lru").misses == {0: 6, 1: 2, 2: simulate(trace, 3, "lru").misses[2]}
    with pytest.raises(ValueError, match=r"missing \[2\], not MoE layers \[5\]"):
        simulate(trace, {0: 6, 1: 2, 5: 3})
    with pytest.raises(ValueError, match=r"quota 1 is below top_k 2 \(layer 1\)"):
        simulate(trace, {0: 6, 1: 1, 2: 3})


def test_the_study_splits_slots_by_the_folds_it_does_not_score():
    """Fold 0's split comes from folds 1 and 2 alone: there the pair and the cycle have swapped
    layers, so the planner gives the cycle's six slots to layer 1, though fold 0 needs them in
    layer 0; and rerouting fold 0 changes no split fitted for it."""
    trace = _layered(360, 120)
    parts = folds_of(trace, 3)
    rows = policy_study(trace, 4, folds=3)
    for name, by in (("layer", "lru"), ("lfu-layer", "lfu")):
        want = [fold_split([p for j, p in enumerate(parts) if j != k], 4, by) for k in range(3)]
        assert rows[f"belady/{name}"].choices == ["/".join(map(str, s.values())) for s in want]
        assert want[0] == {0: 2, 1: 6, 2: 4}  # the swapped layers of the other folds
    # the study's per-layer rows replay each fold at its split, as simulate() does
    lru = sum(simulate(p, want_k, "lru").total_misses for p, want_k in zip(parts, want, strict=True))
    assert rows["lru/layer"].misses == lru
    # fold 0 rerouted so that layer 2 cycles through all eight experts: fitted on fold 0 the split
    # would give layer 2 every expert; the study's split for fold 0 stays as it was
    cycle8 = [(0, 1), (2, 3), (4, 5), (6, 7)]
    fold0 = tuple(((6, 7), (6, 7), cycle8[t % 4]) for t in range(len(parts[0].tokens)))
    other = RouteTrace(trace.header, fold0 + trace.tokens[len(fold0) :])
    assert fold_split(folds_of(other, 3)[:1], 4) == {0: 2, 1: 2, 2: 8}
    study = policy_study(other, 4, folds=3)
    for name in ("layer", "lfu-layer"):
        assert study[f"belady/{name}"].choices[0] == rows[f"belady/{name}"].choices[0]


def test_best_split_is_the_fewest_misses_over_every_split():
    rng = random.Random(5)
    for _ in range(20):
        curves = [{q: rng.randrange(50) for q in range(2, 7)} for _ in range(3)]
        slots = rng.randrange(6, 19)
        brute = min(
            (sum(c[q] for c, q in zip(curves, split, strict=True)), split)
            for split in itertools.product(range(2, 7), repeat=3)
            if sum(split) <= slots
        )
        assert best_split(curves, slots) == brute
    with pytest.raises(ValueError, match="5 slots cannot hold every layer's smallest quota"):
        best_split(curves, 5)


def test_fold_split_is_the_planners_split_of_the_lru_curves():
    trace = _layered(360, 120)
    curves = [miss_curve(steps, 8) for steps in trace_steps(trace, 1)]
    assert fold_split([trace], 4) == dict(zip((0, 1, 2), split_quotas(curves, 12, 2), strict=True))


def test_prefetch_replay_refuses_a_layer_holding_every_expert_before_a_streamed_one():
    """The prefetcher skips a layer that holds every expert and predicts the next streamed layer
    from the one before it, which the trace's predictions (each layer from the previous) are not."""
    trace = _layered(30, 30)
    trace = RouteTrace(trace.header, trace.tokens, predicted=tuple(tok[1:] for tok in trace.tokens))
    with pytest.raises(ValueError, match="layer 1 holds every expert and a later layer streams"):
        simulate(trace, {0: 2, 1: 8, 2: 3}, "lfu", prefetch_depth=1)
    last = simulate(trace, {0: 2, 1: 3, 2: 8}, "lfu", prefetch_depth=1)  # the last layer: nothing after it
    assert last.prefetch[2]["issued"] == 0 and last.prefetch[1]["issued"] > 0


def test_prefetch_reads_fewer_guesses_once_most_are_wrong():
    """The prefetch gate (cache.policy.PrefetchGate, the cache's and the simulator's): while at
    least half of a layer's guesses are used it reads every guess not held (up to the depth);
    once most are wrong, only the first, which keeps the count going; right again, all again."""
    from edgerun.cache.policy import PrefetchGate

    header = TraceHeader("toy", "qwen3_moe", 2, (0, 1), 12, 2)
    n = 40
    routes = [((0, 1), ((2 * t) % 12, (2 * t + 1) % 12)) for t in range(n)]  # layer 1 misses twice a token
    right = tuple(((r[1],)) for r in routes)
    wrong = tuple((((r[1][0] + 6) % 12, (r[1][1] + 6) % 12),) for r in routes)  # never the next routes
    for guesses, issued, useful in ((right, 2 * n, 2 * n), (wrong, 2 + (n - 1), 0)):
        trace = RouteTrace(header, tuple(routes), predicted=guesses)
        pf = simulate(trace, 2, "lru", prefetch_depth=4).prefetch[1]
        assert (pf["issued"], pf["useful"]) == (issued, useful), pf
    gate = PrefetchGate()
    assert gate.limit(4) == 4
    gate.record(1, 2)
    assert gate.limit(4) == 1 and gate.limit(0) == 0
    gate.record(1, 0)
    assert gate.limit(4) == 4
    gate.record(0, 200)  # halved past its window: the counts stay small, the decision the same
    assert gate.useful + gate.wasted <= PrefetchGate.WINDOW and gate.limit(4) == 1


def test_two_ahead_stages_the_surest_guess_first_and_refines_within_the_layers_share():
    """Prefetch two layers ahead, by hand: with 4 prefetch buffers each layer has 2; the guess from
    two layers back takes at most half (its surest, 5), the guess from one layer back adds what it
    lacks (4; 6 finds no room). One ahead reads the later guess alone. With fewer buffers than
    layers to share them, the replay reads one ahead, as the cache does."""
    header = TraceHeader("toy", "qwen3_moe", 3, (0, 1, 2), 8, 2)
    trace = RouteTrace(
        header,
        (((0, 1), (2, 3), (4, 5)),),
        predicted=(((2, 3), (4, 6)),),
        predicted2=(((5, 7),),),
    )
    counts = lambda issued, useful: {"issued": issued, "useful": useful, "wasted": issued - useful}  # noqa: E731
    two = simulate(trace, 2, "lru", prefetch_depth=4, prefetch_ahead=2)
    assert two.prefetch == {0: counts(0, 0), 1: counts(2, 2), 2: counts(2, 2)}
    one = simulate(trace, 2, "lru", prefetch_depth=4)
    assert one.prefetch == {0: counts(0, 0), 1: counts(2, 2), 2: counts(2, 1)}
    assert two.misses == one.misses  # prefetch never changes what the books count
    wrong = RouteTrace(header, trace.tokens, predicted=trace.predicted, predicted2=(((6, 7),),))
    one_buffer = simulate(wrong, 2, "lru", prefetch_depth=1, prefetch_ahead=2).prefetch
    assert one_buffer == simulate(wrong, 2, "lru", prefetch_depth=1).prefetch  # 4, not the wrong 6
    assert one_buffer[2] == counts(1, 1)
    with pytest.raises(ValueError, match="has no 'predicted2' experts"):
        simulate(
            RouteTrace(header, trace.tokens, predicted=trace.predicted),
            2,
            "lru",
            prefetch_depth=4,
            prefetch_ahead=2,
        )
