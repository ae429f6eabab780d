"""Streaming == resident, bit for bit: the same bundle loaded with stacked resident experts and
with experts streamed through the cache gives identical logits (torch.equal) and greedy tokens,
at every quota down to top_k (constant eviction), for both architectures, bf16 and int4."""

import re
from pathlib import Path

import pytest
import torch

from edgerun.bundle.quant import dequantize_block
from edgerun.bundle.reader import Bundle, load_bundle_model
from edgerun.cache.expert_cache import ExpertCache
from edgerun.cache.policy import fetches
from edgerun.cache.slots import QuotaError
from edgerun.config import CacheConfig
from edgerun.engine.runner import Runner
from edgerun.engine.sampler import SamplingParams
from edgerun.engine.streaming import load_streaming_model
from edgerun.engine.trace import RouteRecorder
from edgerun.kernels.moe_reference import expert_ffn
from edgerun.tools.routes import read_trace
from edgerun.tools.simulate import belady_bypass_misses, layer_accesses, simulate
from hf_fixtures import ARCHS


def _ids(n, seed):
    return torch.randint(0, 97, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("quant", ["bf16", "int4"])
@pytest.mark.parametrize("arch", ARCHS)
def test_streaming_equals_resident(bundles, arch, quant):
    b = bundles[(arch, quant)]
    resident, args, _ = load_bundle_model(b, dtype=torch.float32)
    ids = _ids(40, 1)
    with torch.no_grad():
        ref_full = resident(ids)
        st = resident.new_state(1, 48)
        ref_inc = torch.cat(
            [resident(ids[:, :30], st)] + [resident(ids[:, t : t + 1], st) for t in range(30, 40)], 1
        )
    ref_tokens = Runner(resident, args, None).generate_ids(list(range(3, 20)), SamplingParams(max_tokens=24))
    for quota in (args.num_experts_per_tok, args.num_experts_per_tok + 1, args.num_experts):
        model, _, cache, _ = load_streaming_model(b, quota, dtype=torch.float32)
        with torch.no_grad():
            assert torch.equal(model(ids), ref_full)
            st = model.new_state(1, 48)
            inc = torch.cat(
                [model(ids[:, :30], st)] + [model(ids[:, t : t + 1], st) for t in range(30, 40)], 1
            )
        assert torch.equal(inc, ref_inc)
        assert (
            Runner(model, args, None).generate_ids(list(range(3, 20)), SamplingParams(max_tokens=24))
            == ref_tokens
        )
        t = cache.totals()
        if quota == args.num_experts_per_tok:
            assert t.evictions > 0  # constant eviction really happened
        if quota == args.num_experts:
            assert t.evictions == 0 and t.misses <= args.num_experts * len(args.moe_layers)
        cache.close()


@pytest.mark.parametrize("quant", ["bf16", "int4"])
@pytest.mark.parametrize("arch", ARCHS)
def test_misses_left_unheld_give_the_resident_logits(bundles, arch, quant):
    """lfu-bypass: a miss that loses to the held experts is read into a spill row and served from
    there (slots Q.. of the kernels' view), its row reused by the next lookup of any layer; the
    logits stay the resident ones bit for bit, prefill in batches and decode alike."""
    b = bundles[(arch, quant)]
    resident, args, _ = load_bundle_model(b, dtype=torch.float32)
    ids = _ids(40, 2)
    with torch.no_grad():
        st = resident.new_state(1, 48)
        ref = torch.cat(
            [resident(ids[:, :30], st)] + [resident(ids[:, t : t + 1], st) for t in range(30, 40)], 1
        )
    for quota in (args.num_experts_per_tok, args.num_experts_per_tok + 1):
        model, _, cache, _ = load_streaming_model(
            b, CacheConfig(quota, policy="lfu-bypass"), dtype=torch.float32
        )
        with torch.no_grad():
            st = model.new_state(1, 48)
            got = torch.cat(
                [model(ids[:, :30], st)] + [model(ids[:, t : t + 1], st) for t in range(30, 40)], 1
            )
        assert torch.equal(got, ref)
        t = cache.totals()
        assert t.passed > 0 and t.misses > t.passed
        cache.close()


def test_streaming_model_holds_no_stacked_experts(bundles):
    b = bundles[("qwen3_5_moe", "bf16")]
    resident, _, _ = load_bundle_model(b, dtype=torch.float32)
    model, args, cache, _ = load_streaming_model(b, 2, dtype=torch.float32)

    def real_bytes(m):
        return sum(p.numel() * p.element_size() for p in m.parameters() if not p.is_meta)

    expert_bytes = sum(p.numel() * 4 for n, p in resident.named_parameters() if ".mlp.experts." in n)
    assert real_bytes(model) == real_bytes(resident) - expert_bytes
    assert not any(".mlp.experts." in n for n, p in model.named_parameters() if not p.is_meta)
    cache.close()


def test_budget_refusal_names_the_quota_that_fits(bundles):
    bundle = Bundle.open(bundles[("qwen3_5_moe", "int4")])
    bb = next(iter(bundle.layouts.values())).block_bytes
    n_layers = len(bundle.args.moe_layers)
    budget = 3 * bb * n_layers + 4 * bb + 2 * bb  # quota 3, 4 staging buffers, top_k = 2 spill rows
    with pytest.raises(
        QuotaError,
        match=r"4 staging buffers, 2 spill rows\) but its budget is .* bytes: a quota of 3 per layer fits",
    ):
        ExpertCache(bundle, CacheConfig(5, staging=4, budget=budget))
    with pytest.raises(QuotaError, match=r"not even the minimum quota \(top_k = 2\) fits"):
        ExpertCache(bundle, CacheConfig(2, staging=4, budget=bb * 4))
    ExpertCache(bundle, CacheConfig(3, staging=4, budget=budget)).close()
    with pytest.raises(QuotaError, match=r"a quota of 3 per layer fits"):  # lfu: no spill rows
        ExpertCache(bundle, CacheConfig(4, staging=4, budget=budget - 2 * bb, policy="lfu"))
    ExpertCache(bundle, CacheConfig(3, staging=4, budget=budget - 2 * bb, policy="lfu")).close()


def test_warm_preloads_most_used_and_counts_no_misses(bundles):
    bundle = Bundle.open(bundles[("qwen3_moe", "bf16")])
    cache = ExpertCache(bundle, CacheConfig(3))
    layer = bundle.args.moe_layers[0]
    cache.warm({layer: [0, 9, 1, 7, 5, 0]})
    assert cache.slots[layer].resident() == [4, 3, 1]  # least used first, most used most recent
    assert cache.totals().misses == 0 and cache.io[layer].warm_reads == 3
    refs = cache.get_many(layer, [1, 3])
    assert cache.totals().misses == 0 and cache.totals().hits == 2
    held = dequantize_block(bundle.layouts[layer], cache.pools[layer][refs[0].slot], None, torch.float32)
    assert torch.equal(held[0], Bundle.open(bundle.root).expert(layer, 1, torch.float32)[0])
    cache.close()


@pytest.mark.parametrize("policy", ["lfu", "lfu-bypass", "lru"])
@pytest.mark.parametrize("prefetch", [False, 1, 2])
def test_simulated_counts_equal_the_caches_counters(bundles, tmp_path, policy, prefetch):
    """Record a trace while generating through the cache (prefill in several batches, decode,
    two requests); replaying it through the simulator with the same quota, policy and prefetch
    depth gives the cache's own per-layer misses, hits and prefetches issued, useful, wasted;
    with one quota for every layer, and with a quota by layer (as a plan from a trace sizes them).
    ``prefetch`` 2: reading two layers ahead, each layer with half of 4 prefetch buffers."""
    b = bundles[("qwen3_5_moe", "int4")]
    args = Bundle.open(b).args
    layers = args.moe_layers
    assert len(layers) > 2  # the per-layer quotas below differ between layers; two ahead reaches one
    for quota in (2, 4, {layer: (4, 2, 3)[i % 3] for i, layer in enumerate(layers)}):
        staging = args.num_experts_per_tok + 4 if prefetch == 2 else None
        config = CacheConfig(
            quota, prefetch=bool(prefetch), policy=policy, staging=staging, prefetch_ahead=prefetch or 1
        )
        model, args, cache, _ = load_streaming_model(b, config, dtype=torch.float32)
        runner = Runner(model, args, None, prefill_chunk=16)
        rec = RouteRecorder(model, args, tmp_path / "t.jsonl", "tiny")
        runner.generate_ids(list(range(5, 45)), SamplingParams(max_tokens=20))
        runner.generate_ids(list(range(60, 70)), SamplingParams(max_tokens=10))
        rec.close()
        trace = read_trace(tmp_path / "t.jsonl")
        assert cache.prefetch_ahead == (prefetch or 0)
        sim = simulate(
            trace,
            quota,
            policy,
            prefetch_depth=cache.prefetch_depth,
            prefetch_ahead=cache.prefetch_ahead or 1,
        )
        stats = {layer: cache.layer_stats(layer) for layer in args.moe_layers}
        assert sim.misses == {layer: st.misses for layer, st in stats.items()}
        assert sim.hits == {layer: st.hits for layer, st in stats.items()}
        # lfu-bypass left misses unheld (where slots ran out), the others held every miss
        assert (cache.totals().passed > 0) == (policy == "lfu-bypass")
        if prefetch:
            counted = {
                layer: {
                    "issued": st.prefetch_issued,
                    "useful": st.prefetch_useful,
                    "wasted": st.prefetch_wasted,
                }
                for layer, st in stats.items()
            }
            assert sim.prefetch == counted and sim.prefetch_total("issued") > 0
            assert sim.prefetch_total("useful") > 0 and sim.prefetch_total("wasted") > 0
        if policy == "lfu-bypass":  # its bound: Belady that may leave a miss unheld too
            qs = quota if isinstance(quota, dict) else dict.fromkeys(layers, quota)
            bound = sum(
                belady_bypass_misses(layer_accesses(trace, p, qs[layer]), qs[layer])
                for p, layer in enumerate(layers)
            )
        else:
            bound = simulate(trace, quota, "belady").total_misses
        assert bound <= sim.total_misses
        cache.close()


def test_fetches_batch_distinct_experts_only_when_the_union_exceeds_the_quota():
    rows = [[1, 2], [2, 3], [5, 4], [5, 1]]
    assert fetches(rows, 5) == [[1, 2, 2, 3, 5, 4, 5, 1]]  # router order, one lookup
    assert fetches(rows, 3) == [[1, 2, 3], [4, 5]]  # each expert once, ascending
    assert fetches(rows, 2) == [[1, 2], [3, 4], [5]]


def test_expert_math_is_batch_invariant():
    """The property streaming == resident rests on: a token's expert output does not depend on
    which other tokens are computed with it (CPU BLAS, rows padded to a multiple of 4)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 48, generator=g)
    gate_up, down = torch.randn(48, 48, generator=g), torch.randn(48, 24, generator=g)
    whole = expert_ffn(x, gate_up, down)
    for lo, hi in [(0, 1), (3, 5), (5, 12), (12, 37), (36, 37)]:
        assert torch.equal(expert_ffn(x[lo:hi], gate_up, down), whole[lo:hi])


def test_generate_cli_streams_and_reports_the_cache(bundles, capsys):
    from edgerun.cli import main

    b = bundles[("qwen3_moe", "int4")]
    assert (
        main(
            [
                "generate",
                "--model",
                str(b),
                "--quota",
                "2",
                "--token-ids",
                "4,5,6",
                "--max-tokens",
                "5",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    err = capsys.readouterr().err
    assert "experts streamed (quota 2 per layer" in err and "fallbacks:" in err
    assert "expert cache:" in err and "misses" in err
    assert "warm-up" not in err  # no graphs on a CPU: nothing is compiled or captured ahead


@pytest.mark.parametrize("reader", ["io_uring", "native", "auto"])
def test_generate_reads_through_the_reader_asked_for(bundles, capsys, monkeypatch, reader):
    """The same tokens through io_uring or the native reader as through preadv, and the start-up
    line names who read; reader auto where the native reader cannot be built names its fallback
    there and reads with preadv."""
    from edgerun.cache import native
    from edgerun.cache.uring import unavailable
    from edgerun.cli import main

    argv = ["generate", "--model", str(bundles[("qwen3_5_moe", "int4")]), "--quota", "2", "--token-ids"]
    argv += ["4,5,6", "--max-tokens", "6", "--device", "cpu", "--reader"]
    assert main(argv + ["preadv"]) == 0
    want = capsys.readouterr()
    fallbacks = lambda err: re.search(r"^  fallbacks: (.*)$", err, re.M).group(1)  # noqa: E731
    assert " via preadv depth " in want.err and "native_reader" not in fallbacks(want.err)
    if reader == "io_uring" and (why := unavailable()):
        pytest.skip(f"io_uring reads cannot run here: {why}")
    if reader == "native" and (why := native.unavailable()):
        pytest.skip(f"the native reader cannot run here: {why}")
    if reader == "auto":
        monkeypatch.setattr(native, "unavailable", lambda: "no C compiler found (sysconfig CC, cc, gcc)")
    assert main(argv + [reader]) == 0
    got = capsys.readouterr()
    assert got.out == want.out
    if reader == "auto":
        assert " via preadv depth " in got.err
        assert "native_reader: no C compiler found" in fallbacks(got.err)
    else:
        assert f" via {reader} depth " in got.err and reader not in fallbacks(got.err)


def test_generate_with_a_profile_uses_the_plan(bundles, tmp_path, capsys):
    from edgerun.cli import main

    b = bundles[("qwen3_moe", "int4")]
    base = (Path(__file__).parents[2] / "configs" / "cpu.yaml").read_text()
    ok, tiny = tmp_path / "ok.yaml", tmp_path / "tiny.yaml"
    ok.write_text(base)
    tiny.write_text(base.replace("memory_cap: 23GiB", "memory_cap: 3.001GiB"))
    argv = [
        "generate",
        "--model",
        str(b),
        "--token-ids",
        "4,5",
        "--max-tokens",
        "3",
        "--device",
        "cpu",
        "--profile",
    ]
    assert main(argv + [str(ok)]) == 0
    err = capsys.readouterr().err
    assert "experts streamed (quota 6 per layer" in err  # everything fits: all 6 experts
    assert "re-planned with the measured resident weights" in err  # sized after loading, by measurement
    assert main(argv + [str(tiny)]) == 2
    assert "does not fit on" in capsys.readouterr().err
    # --quota with --profile, as in serve and plan: that quota, checked against the plan
    assert main(argv + [str(ok), "--quota", "2"]) == 0
    assert "quota 2 per layer (as asked)" in capsys.readouterr().err
    assert main(argv + [str(ok), "--quota", "1"]) == 2
    assert "quota 1 must be in 2..6" in capsys.readouterr().err


@pytest.mark.parametrize("arch", ARCHS)
def test_host_tier_streaming_equals_resident(bundles, arch):
    """Device slots behind an inclusive host tier (here both in CPU memory; on a discrete GPU
    the tier is page-locked host RAM): identical logits and tokens; the tier serves device
    misses as copies and storage sees only the tier's own misses."""
    b = bundles[(arch, "int4")]
    resident, args, _ = load_bundle_model(b, dtype=torch.float32)
    params = SamplingParams(max_tokens=24)
    want = Runner(resident, args, None).generate_ids(list(range(3, 20)), params)
    top_k, E = args.num_experts_per_tok, args.num_experts
    model, _, cache, _ = load_streaming_model(b, CacheConfig(top_k, host_quotas=E - 1), dtype=torch.float32)
    assert Runner(model, args, None).generate_ids(list(range(3, 20)), params) == want
    t = cache.totals()
    bb = cache.bundle.layouts[args.moe_layers[0]].block_bytes
    assert t.tier_copies > 0 and t.misses == t.tier_copies  # every device miss came from the tier
    assert t.bytes_read // bb < t.misses  # storage read fewer blocks than the device slots missed
    for layer in args.moe_layers:
        held = set(cache.tier[layer].slot_of)
        assert set(cache.slots[layer].slot_of) <= held  # inclusive
    cache.close()


def test_host_tier_refusals(bundles):
    b = bundles[("qwen3_moe", "bf16")]
    bundle = Bundle.open(b)
    with pytest.raises(QuotaError, match="host tier quota 2 is below the device quota 3"):
        ExpertCache(bundle, CacheConfig(3, host_quotas=2))
    with pytest.raises(QuotaError, match="host tier quotas given for layers"):
        ExpertCache(bundle, CacheConfig(3, host_quotas={99: 4}))


def test_host_tier_reads_match_the_simulator(bundles, tmp_path):
    """The tier sees every lookup, so its storage reads are the cache's policy at the tier's quota
    over the device slots' access stream, as the simulator (and the planner's storage-tier
    replay) counts."""
    b = bundles[("qwen3_5_moe", "bf16")]
    model, args, cache, _ = load_streaming_model(b, CacheConfig(2, host_quotas=4), dtype=torch.float32)
    rec = RouteRecorder(model, args, tmp_path / "t.jsonl", "tiny")
    Runner(model, args, None, prefill_chunk=16).generate_ids(
        list(range(3, 30)), SamplingParams(max_tokens=16)
    )
    rec.close()
    sim = simulate(read_trace(tmp_path / "t.jsonl"), 2, cache.policy, tier_quota=4)
    bb = cache.bundle.layouts[args.moe_layers[0]].block_bytes
    assert {layer: cache.layer_stats(layer).bytes_read // bb for layer in args.moe_layers} == sim.misses
    cache.close()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--host-quota", "4"], "--host-quota sets up expert streaming"),
        (["--slot-pool", "device"], "--slot-pool sets up expert streaming"),
        (["--read-depth", "2"], "--read-depth sets up expert streaming"),
        (["--reader", "io_uring"], "--reader sets up expert streaming"),
    ],
)
def test_streaming_flags_without_streaming_are_refused(bundles, capsys, extra, message):
    from edgerun.cli import main

    argv = ["generate", "--model", str(bundles[("qwen3_moe", "int4")]), "--token-ids", "4", "--device", "cpu"]
    assert main(argv + extra) == 2
    assert message in capsys.readouterr().err


def test_generate_with_a_host_tier_reports_it(bundles, capsys):
    from edgerun.cli import main

    argv = [
        "generate",
        "--model",
        str(bundles[("qwen3_moe", "int4")]),
        "--token-ids",
        "4,5,6",
        "--device",
        "cpu",
    ]
    assert main(argv + ["--quota", "2", "--host-quota", "4", "--max-tokens", "6"]) == 0
    err = capsys.readouterr().err
    assert "host slots, pinned host tier 4 (" in err and "served from the host tier" in err


def test_a_quota_above_the_experts_is_a_stated_adjustment(bundles):
    from edgerun.engine.provenance import provenance

    path = bundles[("qwen3_moe", "bf16")]
    runner = Runner.load(path, device="cpu", cache=CacheConfig(quotas=99))
    E = runner.args.num_experts
    assert set(runner.cache.quotas.values()) == {E}
    assert f"quota 99 is more than a layer's {E} experts: {E} used" in provenance(runner, path)
    exact = Runner.load(path, device="cpu", cache=CacheConfig(quotas=E))
    assert "more than a layer's" not in provenance(exact, path)


def test_generate_with_blocks_read_in_pieces_gives_the_same_tokens(bundles, capsys):
    """--read-pieces 3: the native reader reads each block as parts at once; the tokens equal whole
    blocks' and the start-up line says how many parts a block is read in."""
    from edgerun.bundle.reader import Bundle
    from edgerun.cache import native
    from edgerun.cli import main

    if why := native.unavailable():
        pytest.skip(f"the native reader cannot run here: {why}")
    model = bundles[("qwen3_5_moe", "bf16")]
    blocks = sorted({lay.block_bytes for lay in Bundle.open(model).layouts.values()})
    parts = [native.parts(b, 3) for b in blocks]
    assert max(parts) > 1, f"the fixture's blocks ({blocks} B) are too small to split"
    argv = ["generate", "--model", str(model), "--quota", "2", "--token-ids", "4,5,6"]
    argv += ["--max-tokens", "6", "--device", "cpu", "--reader", "native"]
    assert main(argv) == 0
    want = capsys.readouterr()
    assert "pieces a block" not in want.err
    assert main(argv + ["--read-pieces", "3"]) == 0
    got = capsys.readouterr()
    assert got.out == want.out
    assert f"{'/'.join(map(str, parts))} pieces a block" in got.err
