"""Prefetch: reads issued before a lookup asks (the next layer's experts predicted from the
residual stream; a prefill's next batch while the current one computes). They land in staging
buffers, never in slots, so tokens, outputs and the slot books are those of prefetch off, and
no slot a step references is refilled; only the wait changes. Counted: issued, useful, wasted."""

import itertools
import shutil
import time

import pytest
import torch

from edgerun.bundle.reader import Bundle
from edgerun.cache import native
from edgerun.cache.expert_cache import ExpertCache
from edgerun.config import CacheConfig
from edgerun.engine import streaming
from edgerun.engine.runner import Runner
from edgerun.engine.sampler import SamplingParams
from edgerun.engine.setup import cache_config
from edgerun.engine.streaming import Prefetcher, StreamingExperts, load_streaming_model
from edgerun.errors import ChecksumError, ConfigError
from edgerun.server.options import load_serve_config

GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)


def _stats(cache):
    return {layer: cache.layer_stats(layer) for layer in cache.slots}


@pytest.mark.parametrize("quant,ahead", [("bf16", 1), ("int4", 1), ("int4", 2)])
def test_prefetch_keeps_tokens_and_books_and_counts_its_reads(bundles, quant, ahead):
    b = bundles[("qwen3_5_moe", quant)]
    out = {}
    for prefetch in (False, True):
        config = CacheConfig(2, prefetch=prefetch, prefetch_ahead=ahead, staging=8 if ahead > 1 else None)
        model, args, cache, _ = load_streaming_model(b, config, dtype=torch.float32)
        if prefetch:
            assert cache.prefetch_ahead == ahead
        runner = Runner(model, args, None, prefill_chunk=8)
        tokens = runner.generate_ids(list(range(5, 30)), GREEDY)
        tokens += runner.generate_ids(list(range(40, 44)), GREEDY)
        with torch.no_grad():
            logits = model(torch.arange(3, 40).view(1, -1))
        out[prefetch] = tokens, logits, _stats(cache)
        has_hooks = any(isinstance(m, StreamingExperts) and m.prefetcher for m in model.modules())
        assert has_hooks == prefetch
        assert all(r.staged == 0 for r in cache.readers.values())  # every staged buffer went back
        cache.close()
    (t0, l0, s0), (t1, l1, s1) = out[False], out[True]
    assert t0 == t1 and torch.equal(l0, l1)
    for layer, st in s1.items():  # the books are prefetch's own business: hits, misses as without
        assert (st.hits, st.misses, st.evictions, st.bytes_read) == (
            s0[layer].hits,
            s0[layer].misses,
            s0[layer].evictions,
            s0[layer].bytes_read,
        )
        assert st.prefetch_issued == st.prefetch_useful + st.prefetch_wasted
        assert s0[layer].prefetch_issued == 0
    total = sum(st.prefetch_issued for st in s1.values())
    useful = sum(st.prefetch_useful for st in s1.values())
    assert total > 0 and useful > 0
    first = min(s1)
    assert s1[first].prefetch_issued > 0  # a prefill's next batch is read ahead in every layer


def test_a_prefetch_never_touches_a_slot_a_step_references(bundles):
    bundle = Bundle.open(bundles[("qwen3_moe", "bf16")])
    cache = ExpertCache(bundle, CacheConfig(2, staging=4))
    plain = ExpertCache(bundle, CacheConfig(2, staging=4, prefetch=False))
    layer = bundle.args.moe_layers[0]
    refs = cache.get_many(layer, [0, 1])
    plain.get_many(layer, [0, 1])
    before = cache.pools[layer].clone(), list(cache.slots[layer].generation), dict(cache.slots[layer].slot_of)
    assert cache.prefetch(layer, [1, 2, 3]) == 2  # 1 is held: not read again
    for r in cache.readers.values():  # let the reads land; they must still touch nothing
        r._pool.submit(lambda: None).result()
    cache.check(layer, refs)  # the references of the step in flight stay valid
    after = cache.pools[layer], cache.slots[layer].generation, cache.slots[layer].slot_of
    assert torch.equal(before[0], after[0]) and before[1:] == after[1:]
    cache.get_many(layer, [3, 2])
    plain.get_many(layer, [3, 2])
    assert torch.equal(cache.pools[layer], plain.pools[layer])  # placed exactly as a read would
    st = cache.layer_stats(layer)
    assert (st.prefetch_issued, st.prefetch_useful, st.prefetch_wasted) == (2, 2, 0)
    assert (st.misses, st.bytes_read) == (4, plain.layer_stats(layer).bytes_read)
    cache.close()
    plain.close()


def test_prefetch_is_bounded_by_the_staging_it_leaves_to_lookups(bundles):
    bundle = Bundle.open(bundles[("qwen3_moe", "bf16")])
    top_k = bundle.args.num_experts_per_tok
    cache = ExpertCache(bundle, CacheConfig(2, staging=top_k + 1))
    assert cache.prefetch_depth == 1
    first, second = bundle.args.moe_layers[:2]
    assert cache.prefetch(second, [0, 1, 2]) == 1  # one staged buffer held at most
    assert cache.prefetch(first, [4]) == 0
    cache.get_many(first, [3, 4])  # the lookup's own reads still find buffers
    cache.get_many(second, [4, 5])  # the prefetched 0 was not asked for: dropped, wasted
    st = cache.layer_stats(second)
    assert (st.prefetch_issued, st.prefetch_useful, st.prefetch_wasted) == (1, 0, 1)
    cache.close()
    assert all(r.staged == 0 for r in cache.readers.values())

    off = ExpertCache(bundle, CacheConfig(2, staging=top_k))  # nothing beyond top_k: off, and said
    assert off.prefetch_depth == 0 and off.prefetch(first, [0]) == 0
    assert any("prefetch off" in note for note in off.adjustments)
    off.close()


@pytest.mark.parametrize(
    "reader",
    [
        "preadv",
        pytest.param(
            "native",
            marks=pytest.mark.skipif(bool(native.unavailable()), reason="the native reader cannot run here"),
        ),
    ],
)
def test_a_failed_prefetch_fails_the_lookup_that_needs_it_and_is_counted_when_wasted(
    bundles, tmp_path, reader
):
    src = Bundle.open(bundles[("qwen3_moe", "bf16")])
    layer = src.args.moe_layers[0]
    shutil.copytree(src.root, tmp_path / "b")
    bundle = Bundle.open(tmp_path / "b")
    bb = bundle.layouts[layer].block_bytes
    with open(bundle.expert_path(layer), "r+b") as f:  # experts 2 and 3 damaged where they are stored
        for e in (2, 3):
            f.seek(e * bb + 100)
            f.write(b"\x55" * 64)
    cache = ExpertCache(bundle, CacheConfig(2, staging=4, reader=reader))
    cache.prefetch(layer, [2, 3])
    # 3's read runs (and fails) before it is dropped: a read dropped before it started is cancelled,
    # which reads nothing and counts nothing (a loaded machine's pool may not have started it)
    third = cache._staged[layer][3]
    deadline = time.monotonic() + 10
    while not third.done() and time.monotonic() < deadline:
        time.sleep(0.005)
    with pytest.raises(ChecksumError, match=f"layer {layer} expert 2's block"):
        cache.get_many(layer, [2, 0])  # 2 needed: its failed prefetch is the lookup's error
    assert 2 not in cache.slots[layer].slot_of and cache.read_faults()["checksum"] == 1
    cache.get_many(layer, [0, 1])  # 3 never asked for: dropped; its failure counted, not raised
    assert cache.read_faults()["prefetch"] == 1
    cache.close()


def test_prefill_reads_the_next_batch_while_the_current_one_computes(bundles, monkeypatch):
    """Batches of a layer with more experts than slots: batch j + 1 is read before batch j's
    compute has finished, and the sum is bit-identical to reading each batch when it runs."""
    bundle = Bundle.open(bundles[("qwen3_moe", "bf16")])
    args = bundle.args
    layer = args.moe_layers[0]
    g = torch.Generator().manual_seed(3)
    N, D, A = 12, args.hidden_size, args.num_experts_per_tok
    x = torch.randn(N, D, generator=g)
    ids = torch.stack([torch.randperm(args.num_experts, generator=g)[:A] for _ in range(N)])
    weights = torch.rand(N, A, generator=g)

    clock = itertools.count()
    events = []
    compute = streaming.run_experts

    def timed(cache, layer, x, slots, ids, weights, policy, refs=(), **kw):
        start = next(clock)
        out = compute(cache, layer, x, slots, ids, weights, policy, refs, **kw)
        events.append(("compute", kw["expert_range"], start, next(clock)))
        return out

    monkeypatch.setattr(streaming, "run_experts", timed)
    outs = {}
    for prefetch in (False, True):
        cache = ExpertCache(bundle, CacheConfig(2, staging=4, prefetch=prefetch))
        reader = next(iter(cache.readers.values()))
        stage = reader.stage

        def staged(path, index, *a, stage=stage):
            events.append(("stage", index, next(clock)))
            return stage(path, index, *a)

        reader.stage = staged
        events.clear()
        outs[prefetch] = StreamingExperts(layer, cache)(x, ids, weights)
        st = cache.layer_stats(layer)
        cache.close()
    assert torch.equal(outs[False], outs[True])
    batches = [e[1] for e in events if e[0] == "compute"]
    assert batches == [(0, 1), (2, 3), (4, 5)]  # ascending, as fetches() makes them
    for (lo, hi), prev in zip(batches[1:], [e for e in events if e[0] == "compute"][:-1], strict=True):
        issued = [t for kind, e, t, *_ in events if kind == "stage" and lo <= e <= hi]
        assert issued and max(issued) < prev[3]  # read before the batch before it finished computing
    assert (st.prefetch_issued, st.prefetch_useful, st.prefetch_wasted) == (4, 4, 0)


def test_the_prefetcher_predicts_with_the_next_layers_router(bundles):
    model, args, cache, _ = load_streaming_model(bundles[("qwen3_5_moe", "bf16")], 2, dtype=torch.float32)
    pre = next(m.prefetcher for m in model.modules() if isinstance(m, StreamingExperts) and m.prefetcher)
    assert isinstance(pre, Prefetcher) and pre.next == dict(zip(args.moe_layers, args.moe_layers[1:]))
    layer = args.moe_layers[1]
    block = model.model.layers[layer]
    h = torch.randn(3, args.hidden_size)
    want = block.mlp.gate(block.post_attention_layernorm(h))[1].tolist()
    assert streaming.predicted_rows(model, layer, h) == want
    pre.remove()
    assert not any(isinstance(m, StreamingExperts) and m.prefetcher for m in model.modules())
    cache.close()


def test_two_ahead_predicts_the_layer_after_next_and_refines_it_a_layer_later(bundles):
    """Reading two ahead: a layer's lookup stages the next layer's guesses and up to half its
    share of the one after's (its surest first); the next lookup adds the refined guesses the
    first call lacked, within the share."""
    b = bundles[("qwen3_5_moe", "int4")]
    args = Bundle.open(b).args
    k = args.num_experts_per_tok
    model, _, cache, _ = load_streaming_model(
        b, CacheConfig(2, prefetch=True, prefetch_ahead=2, staging=k + 4), dtype=torch.float32
    )
    pre = next(m.prefetcher for m in model.modules() if isinstance(m, StreamingExperts) and m.prefetcher)
    layers = args.moe_layers
    assert pre.after == dict(zip(layers, layers[2:])) and (cache.prefetch_depth, cache.prefetch_share) == (
        4,
        2,
    )
    last = layers[-1]
    assert cache.prefetch(last, [0, 1, 2, 3], ahead=2) == 1  # half the share of 2
    assert cache.prefetch(last, [3, 2, 1, 0], ahead=2) == 0  # (a second call two ahead adds nothing)
    assert cache.prefetch(last, [4, 0, 5]) == 1  # refined: one more, the share full
    assert list(cache._staged[last]) == [0, 4]
    assert cache.prefetch(last, [6, 7]) == 0
    cache.close()
    # too few buffers to share: one layer ahead, and said
    one = ExpertCache(Bundle.open(b), CacheConfig(2, prefetch=True, prefetch_ahead=2, staging=k + 1))
    assert one.prefetch_ahead == 1 and any("prefetch 1 layer ahead, not 2" in a for a in one.adjustments)
    one.close()


def test_prefetch_is_a_setting_of_flags_and_serve_yaml(bundles, tmp_path):
    b = bundles[("qwen3_moe", "bf16")]
    assert cache_config(b, quota=2).prefetch is None  # the device's default
    assert cache_config(b, quota=2, prefetch=False).prefetch is False
    # the default: on for CPU slots (off on CUDA until measured there, which the cache says)
    cpu = ExpertCache(Bundle.open(b), cache_config(b, quota=2), device="cpu")
    assert cpu.prefetch_depth > 0 and not any("prefetch" in a for a in cpu.adjustments)
    cpu.close()
    with pytest.raises(ConfigError, match="--no-prefetch sets up expert streaming"):
        cache_config(None, prefetch=False)
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("prefetch: false\n")
    assert load_serve_config(cfg) == {"prefetch": False}
    cfg.write_text("prefetch: 2\n")
    with pytest.raises(ConfigError, match="key 'prefetch' must be bool"):
        load_serve_config(cfg)
    cfg.write_text("prefetch: true\nprefetch_ahead: 2\n")
    assert load_serve_config(cfg) == {"prefetch": True, "prefetch_ahead": 2}
    two = cache_config(b, quota=2, prefetch_ahead=2)  # reading ahead asks for prefetch
    assert (two.prefetch_ahead, two.prefetch) == (2, True)
    with pytest.raises(ConfigError, match="--prefetch-ahead 2 reads experts ahead, which --no-prefetch"):
        cache_config(b, quota=2, prefetch=False, prefetch_ahead=2)
    with pytest.raises(ConfigError, match="prefetch_ahead is 1 or 2 .* got 3"):
        ExpertCache(Bundle.open(b), CacheConfig(2, prefetch=True, prefetch_ahead=3))
    from edgerun.server.options import ServeOptions

    with pytest.raises(ConfigError, match="'prefetch_ahead' must be 1 or 2, got 3"):
        ServeOptions(prefetch_ahead=3)
    with pytest.raises(ConfigError, match="--prefetch-ahead sets up expert streaming"):
        cache_config(None, prefetch_ahead=2)
    # serve: the flag (or serve.yaml key) reaches the cache the daemon plans
    import argparse

    from edgerun.server.cli import add_serve_arguments, cache_plan, serve_options

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    ns = parser.parse_args(["--model", str(b), "--quota", "2", "--device", "cpu", "--prefetch-ahead", "2"])
    planned = cache_plan(serve_options(ns)).cache
    assert (planned.prefetch_ahead, planned.prefetch) == (2, True)
    with pytest.raises(SystemExit):
        parser.parse_args(["--prefetch-ahead", "3"])


def test_layers_that_hold_every_expert_are_not_predicted(bundles):
    """Quota = every expert: the layers never miss, so no router runs ahead for them (a prefill
    over them keeps no host round trip)."""
    from edgerun.bundle.reader import Bundle
    from edgerun.engine.streaming import StreamingExperts, load_streaming_model

    b = bundles[("qwen3_5_moe", "int4")]
    every = Bundle.open(b).args.num_experts
    model, _, cache, _ = load_streaming_model(b, every)
    experts = [m for m in model.modules() if isinstance(m, StreamingExperts)]
    assert experts and all(m.prefetcher is None for m in experts)
    cache.close()


def test_prefetch_room_does_not_depend_on_when_a_dropped_read_lands(bundles, monkeypatch):
    """The cache counts its outstanding prefetches itself: a dropped read still landing does not
    shrink the next layer's room, so the count is the simulator's, whatever the disk's timing."""
    import threading

    bundle = Bundle.open(bundles[("qwen3_moe", "bf16")])
    check, release = bundle.check_block, threading.Event()

    def slow(layer, expert, data):
        if expert == 5:
            release.wait(10)  # expert 5's read is still running when it is dropped
        return check(layer, expert, data)

    monkeypatch.setattr(bundle, "check_block", slow)
    top_k = bundle.args.num_experts_per_tok
    # preadv: its threads run the check in Python, where this test's hook holds expert 5's read
    cache = ExpertCache(bundle, CacheConfig(2, staging=top_k + 2, reader="preadv"))  # prefetch depth 2
    first, second = bundle.args.moe_layers[:2]
    assert cache.prefetch(first, [5]) == 1
    cache.get_many(first, [0, 1])  # 5 not asked for: dropped while its read runs
    assert cache.layer_stats(first).prefetch_wasted == 1
    assert cache.prefetch(second, [2, 3, 4]) == 2  # the full depth, though 5's buffer is still busy
    release.set()
    cache.get_many(second, [2, 3])
    assert cache.layer_stats(second).prefetch_useful == 2
    cache.close()
