"""benchmarks/stream_timeline.py runs by hand (on the GPU, where prefetch's cost is in question):
its wrappers must keep finding the lookup path, and its phases must add up."""

import json

import bench_scripts
import pytest


@pytest.fixture(scope="module")
def timeline():
    return bench_scripts.load("stream_timeline")


def test_each_streamed_lookup_is_timed_and_its_phases_fill_it(bundles, tmp_path, timeline):
    """With prefetch off and on, every timed token's MoE layers are looked up on the host (the
    wrappers saw them), no phase is negative, prefetch costs nothing with it off and its reads
    are issued with it on; the engine's own counters show the misses and the prefetches."""
    from edgerun.bundle.reader import Bundle

    model = bundles[("qwen3_5_moe", "bf16")]
    layers = len(Bundle.open(model).args.moe_layers)
    out = tmp_path / "t.json"
    argv = ["--model", str(model), "--quota", "2", "--device", "cpu", "--tokens", "6", "--warm", "2"]
    assert timeline.main(argv + ["--json", str(out)]) == 0
    off, on = json.loads(out.read_text())["rows"]
    assert (off["prefetch"], on["prefetch"]) == (False, True)
    for r in (off, on):
        assert r["tokens"] == 6 and r["lookups_per_token"] == pytest.approx(layers, abs=1)
        assert set(r["ms_per_layer"]) == set(timeline.PHASES) and min(r["ms_per_layer"].values()) >= 0
        assert r["misses"] > 0
    assert off["ms_per_layer"]["prefetch"] == 0.0 and off["prefetch_issued"] == 0
    assert on["ms_per_layer"]["prefetch"] > 0 and on["prefetch_issued"] > 0
    # two layers ahead (both prefetch calls of a lookup timed)
    argv += ["--prefetch", "on", "--prefetch-ahead", "2", "--staging", "8"]
    assert timeline.main(argv + ["--json", str(out)]) == 0
    (two,) = json.loads(out.read_text())["rows"]
    assert two["prefetch_ahead"] == 2 and two["prefetch_issued"] > 0 and two["ms_per_layer"]["prefetch"] > 0


def test_prefetch_ahead_scores_guesses_against_the_routers_own_choices():
    """benchmarks/prefetch_ahead.py: where every layer's residual stream is the same rows, each
    layer's guess from any earlier layer is its own choice (recall 1 at every distance); with
    the choices shuffled between tokens it is not."""
    import torch

    from edgerun.engine.runner import Runner

    ahead = bench_scripts.load("prefetch_ahead")
    runner = Runner.load(None, device="cpu")  # the demo model
    model = runner.model
    residual, chosen, handles = ahead.capture(model)
    runner.prefill(runner.new_state(24), list(range(3, 27)))
    for h in handles:
        h.remove()
    layers = sorted(residual)
    assert len(layers) == len(runner.args.moe_layers) and all(chosen[i] for i in layers)
    real = ahead.score(model, residual, chosen, 3)
    assert [r["ahead"] for r in real] == [1, 2, 3] and all(
        0 <= r["recall_k"] <= r["recall_2k"] <= 1 for r in real
    )
    x = torch.cat(residual[layers[0]])
    same = {i: [x] for i in layers}
    own = {}
    for j in layers:
        block = model.model.layers[j]
        with torch.no_grad():
            own[j] = [block.mlp.gate.select(block.mlp.gate.logits(x, norm=block.post_attention_layernorm))[1]]
    for r in ahead.score(model, same, own, 3):
        assert r["recall_k"] == r["recall_2k"] == r["first"] == 1.0
    shuffled = {j: [ids[0].roll(1, dims=0)] for j, ids in own.items()}
    assert all(r["recall_k"] < 1.0 for r in ahead.score(model, same, shuffled, 3))
