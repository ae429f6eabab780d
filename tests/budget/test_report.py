import json

import yaml

from edgerun.budget import report
from edgerun.budget.planner import Plan, PlanOptions, plan
from edgerun.tools.routes import RouteTrace, TraceHeader


def some_plans(model_inputs, profiles):
    q36, q3 = model_inputs["qwen3.6-35b-a3b"], model_inputs["qwen3-30b-a3b"]
    tokens = tuple(tuple((i % 128, (i + 1) % 128, 5, 6, 7, 8, 9, 10) for _ in range(48)) for i in range(20))
    trace = RouteTrace(TraceHeader.for_model(q3.args, "q3"), tokens, "t.jsonl")
    return [
        plan(q36.args, q36.specs, q36.experts, profiles["orin"], 4096, model_name=q36.name, notes=q36.notes),
        plan(q36.args, q36.specs, q36.experts, profiles["cpu"], 32768),  # streams: misses > 0
        plan(
            q3.args, q3.specs, q3.experts, profiles["rtx5070"], 32768, 1, PlanOptions(tier_reads="copy")
        ),  # two tiers
        plan(q3.args, q3.specs, q3.experts, profiles["rtx5070"], 32768, 4),  # refused
        plan(q3.args, q3.specs, q3.experts, profiles["rtx5070"], 4096, trace=trace),  # trace model
        plan(
            q36.args, q36.specs, q36.experts, profiles["rtx5070"], 4096
        ),  # far tier: every expert in pinned RAM
    ]


def test_json_and_yaml_round_trip(model_inputs, profiles):
    for p in some_plans(model_inputs, profiles):
        assert report.from_json(report.to_json(p)) == p
        assert report.from_yaml(report.to_yaml(p)) == p
        d = json.loads(report.to_json(p))
        assert d["fits"] == p.fits and d["pools"][0]["headroom"] == p.pools[0].headroom
        assert yaml.safe_load(report.to_yaml(p))["quotas"] == list(p.quotas)
        assert Plan.from_dict(p.to_dict()) == p


def test_table(model_inputs, profiles):
    fits, streams, tiers, refused, traced, far = (
        report.to_table(p) for p in some_plans(model_inputs, profiles)
    )
    for row in ("embeddings", "lm_head", "attention", "deltanet", "norms", "routers", "shared_experts"):
        assert f"  {row} " in fits
    for row in ("kv_cache", "deltanet_state", "activation_workspace", "cuda_graph_pool", "pinned_staging"):
        assert f"  {row} " in fits
    assert "unified pool: cap 61.00 GiB" in fits and "headroom" in fits and "%" in fits
    assert "expert quota: 256 per layer x 40 layers (of 256 experts; top_k 8, minimum 8)" in fits
    assert "prediction (uniform model)" in fits and "note: MTP head" in fits
    assert "storage reads/token" in streams and "cuda_graph_pool" not in streams
    assert "vram pool" in tiers and "host_pinned pool" in tiers and "pinned host tier: 128 per layer" in tiers
    assert "PCIe copies/token" in tiers
    assert "OVER BY" in refused and "REFUSED: does not fit" in refused and "prediction" not in refused
    assert "prediction (trace model)" in traced
    assert "expert tiers: VRAM slots" in far and "read in place by the GPU over PCIe" in far
    assert "expert blocks read in place over PCIe/token" in far and "prefill_graph_pool" in far
