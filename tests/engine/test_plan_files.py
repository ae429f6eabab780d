"""Per-layer quotas from a route trace (the planner's miss curves) and warm sets: one code path
(engine/setup.cache_config) for `generate` and `serve` (--trace / --warm, serve.yaml)."""

import json
from pathlib import Path

import pytest

from edgerun.budget.cli import plan_for_bundle
from edgerun.bundle.reader import Bundle
from edgerun.cli import build_parser, main
from edgerun.engine.setup import cache_config
from edgerun.errors import ConfigError
from edgerun.server.cli import cache_plan, serve_options
from edgerun.tools.routes import RouteTrace, TraceHeader, write_trace

CPU = Path(__file__).resolve().parents[2] / "configs" / "cpu.yaml"


@pytest.fixture
def files(bundles, tmp_path):
    """A CPU profile whose expert slots hold 14 blocks in all (4 MoE layers, 6 experts, top 2),
    a trace where the first MoE layer uses two experts and the others cycle through all six,
    and a warm set."""
    b = bundles[("qwen3_5_moe", "int4")]
    args = Bundle.open(b).args
    full = plan_for_bundle(b, CPU, 64)
    fixed = sum(i.nbytes for i in full.items if i.name != "expert_slots")
    profile = tmp_path / "small.yaml"
    cap = fixed + 14 * full.block_bytes[0] + 100
    profile.write_text(CPU.read_text().replace("memory_cap: 23GiB", f"memory_cap: {cap}"))
    E = args.num_experts
    tokens = [((0, 1),) + tuple(((t + i) % E, (t + i + 1) % E) for i in range(1, 4)) for t in range(60)]
    trace = tmp_path / "t.jsonl"
    write_trace(trace, RouteTrace(TraceHeader.for_model(args, "tiny"), tuple(tokens)))
    warm = tmp_path / "w.json"
    warm.write_text(json.dumps({"frequencies": {str(layer): [1] * E for layer in args.moe_layers}}))
    return b, args, profile, trace, warm


def test_serve_and_generate_size_per_layer_quotas_from_a_trace(files, tmp_path):
    b, args, profile, trace, warm = files
    uniform = cache_config(b, profile=profile, context=64)
    traced = cache_config(b, profile=profile, context=64, trace=trace)
    want = dict(zip(args.moe_layers, plan_for_bundle(b, profile, 64, trace=trace).quotas))
    assert traced.quotas == want and len(set(want.values())) > 1  # per layer, from the miss curves
    assert want[args.moe_layers[0]] == args.num_experts_per_tok  # two experts: nothing more to gain
    assert traced.quotas != uniform.quotas and "from route trace" in traced.summary
    # serve: flags and serve.yaml reach the same settings (at batch 1, generate's: serve's CPU default
    # batches 4 requests, a plan this tiny profile does not hold)
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"model: {b}\nprofile: {profile}\ncontext: 64\ntrace: {trace}\nwarm: {warm}\nbatch: 1\n")
    served = cache_plan(serve_options(build_parser().parse_args(["serve", "--config", str(cfg)]))).cache
    assert served.quotas == want and served.warm == {
        layer: [1] * args.num_experts for layer in args.moe_layers
    }
    flags = ["serve", "--model", str(b), "--profile", str(profile), "--context", "64", "--trace", str(trace)]
    flags += ["--batch", "1"]
    assert cache_plan(serve_options(build_parser().parse_args(flags)))[0].quotas == want


def test_generate_runs_with_a_trace_and_a_warm_set(files, capsys):
    b, _, profile, trace, warm = files
    argv = ["generate", "--token-ids", "3,4", "--max-tokens", "2", "--device", "cpu", "--dtype", "bfloat16"]
    argv += ["--model", str(b), "--profile", str(profile), "--context", "64"]
    assert main([*argv, "--trace", str(trace), "--warm", str(warm)]) == 0
    assert "from route trace" in capsys.readouterr().err


def test_a_trace_without_a_profile_is_refused(files):
    b, _, _, trace, _ = files
    with pytest.raises(ConfigError, match="sizes per-layer quotas in a device plan: give --profile"):
        cache_config(b, quota=2, trace=trace)


def test_a_batch_that_does_not_fit_resident_names_the_batch_that_does(tmp_path):
    """serve's batch is planned: where the model fits held whole one request at a time but not
    B at once, the refusal says so (--batch N) before suggesting a streamed bundle."""
    from edgerun.budget.cli import plan_resident
    from edgerun.engine.setup import resident_plan
    from edgerun.errors import EdgerunError

    base = Path(__file__).resolve().parents[2] / "configs" / "cpu.yaml"
    one, _ = plan_resident(None, base, 4096, device="cpu", dtype="fp32", batch=1)
    used = sum(pool.used for pool in one.pools)
    tight = tmp_path / "tight.yaml"
    tight.write_text(base.read_text().replace("memory_cap: 23GiB", f"memory_cap: {used + 2**20}"))
    assert "every expert resident" in resident_plan(None, tight, 4096, "cpu", "fp32", batch=1)[0]
    four, _ = plan_resident(None, tight, 4096, device="cpu", dtype="fp32", batch=4)
    assert not four.fits and 1 <= four.refusal.max_batch < 4
    with pytest.raises(EdgerunError) as err:
        resident_plan(None, tight, 4096, "cpu", "fp32", batch=4)
    want = f"(--batch {four.refusal.max_batch}); or stream the experts from a bundle instead"
    assert want in str(err.value)


def test_the_dtype_asked_for_is_the_one_planned(bundles, tmp_path):
    """`--dtype` reaches a bundle's plan: plain resident tensors, KV and state are held in it, so
    an fp32 engine's plan leaves fewer bytes for expert slots than a bf16 one's on the same cap."""
    from edgerun.engine.setup import plan_experts

    b = bundles[("qwen3_5_moe", "int4")]
    half, full = (plan_for_bundle(b, CPU, 64, dense_dtype=d) for d in ("bf16", "fp32"))
    assert (half.dense_dtype, full.dense_dtype) == ("bf16", "fp32")
    fixed = sum(i.nbytes for i in full.items if i.name != "expert_slots")
    profile = tmp_path / "small.yaml"
    profile.write_text(
        CPU.read_text().replace("memory_cap: 23GiB", f"memory_cap: {fixed + 14 * half.block_bytes[0]}")
    )
    got = {
        d: plan_experts(b, "cpu", d, profile=profile, context=64).cache.quotas
        for d in ("bfloat16", "float32")
    }
    want = {
        d: dict(zip(half.moe_layers, plan_for_bundle(b, profile, 64, dense_dtype=n).quotas))
        for d, n in (("bfloat16", "bf16"), ("float32", "fp32"))
    }
    assert got == want and sum(got["bfloat16"].values()) > sum(got["float32"].values())


def test_a_whole_model_is_planned_in_the_dtype_asked_for_beside_lanes_asked_for():
    """The resident plan of an HF checkpoint follows --dtype, and lanes asked for beside it are
    lanes, not a dtype."""
    from edgerun.engine.setup import plan_experts

    for dtype, name in (("bfloat16", "bf16"), ("float32", "fp32")):
        got = plan_experts(None, "cpu", dtype, profile=CPU, context=4096)
        assert f"every expert resident ({name})" in got.summary and got.prefill_lanes == 1  # the CPU
    thor = CPU.parent / "jetson_thor.yaml"
    got = plan_experts(None, "cuda", "float32", profile=thor, context=4096, batch=4, prefill_lanes=2)
    assert "(prompts in 2 lanes): every expert resident (fp32)" in got.summary and got.prefill_lanes == 2


def test_the_bundle_a_refusal_names_is_planned_as_it_will_run(bundles, tmp_path):
    """A whole checkpoint that does not fit names the int4 bundle that would, planned in the
    dtype the engine runs (here fp32): converted and planned as a bundle, it fits with the same
    quotas (it was planned at bf16, so the suggestion could fail when applied)."""
    from edgerun.budget.cli import plan_resident
    from edgerun.bundle.convert import ConvertOptions, convert

    src = bundles[("qwen3_5_moe", "int4")].parent / "qwen3_5_moe"
    whole, _ = plan_resident(src, CPU, 64, device="cpu", dtype="fp32")
    profile = tmp_path / "tight.yaml"
    cap = f"memory_cap: {whole.pools[0].used - 1}"
    profile.write_text(CPU.read_text().replace("memory_cap: 23GiB", cap))
    whole, streamed = plan_resident(src, profile, 64, device="cpu", dtype="fp32")
    assert not whole.fits and streamed.fits and streamed.dense_dtype == "fp32"
    convert(src, tmp_path / "b", ConvertOptions("int4"))
    real = plan_for_bundle(tmp_path / "b", profile, 64, dense_dtype="fp32")
    assert real.fits and real.quotas == streamed.quotas


def test_generate_and_serve_plan_the_expert_kernel_edgerun_plan_counts(bundles, tmp_path):
    """Before loading, a bundle's plan counts the CPU expert kernel --expert-kernel resolves to,
    as `edgerun plan` does: where the grouped kernel (no repacked copies) fits and torch's
    kernels (a repacked copy of each int4 slot) would not, generate and serve are not refused."""
    from edgerun.bundle.convert import ConvertOptions, convert

    b = tmp_path / "b"  # int4 in the default group: torch's kernels repack it
    convert(bundles[("qwen3_5_moe", "int4")].parent / "qwen3_5_moe", b, ConvertOptions("int4"))
    grouped = plan_for_bundle(b, CPU, 64, expert_kernel="cpu_grouped")
    packed = plan_for_bundle(b, CPU, 64, expert_kernel="cpu")
    assert packed.pools[0].used > grouped.pools[0].used  # the repacked copies
    profile = tmp_path / "tight.yaml"
    profile.write_text(CPU.read_text().replace("memory_cap: 23GiB", f"memory_cap: {grouped.pools[0].used}"))
    assert plan_for_bundle(b, profile, 64, expert_kernel="cpu_grouped").fits
    assert plan_for_bundle(b, profile, 64, expert_kernel="cpu").quotas != grouped.quotas
    got = cache_config(b, profile=profile, context=64)  # --expert-kernel auto: the grouped kernel
    want = plan_for_bundle(b, profile, 64, expert_kernel="cpu_grouped").quotas
    assert list(got.quotas.values()) == list(want)
    cpu = cache_config(b, profile=profile, context=64, expert_kernel="cpu")
    assert sum(cpu.quotas.values()) < sum(got.quotas.values())
