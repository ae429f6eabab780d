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
