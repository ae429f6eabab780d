"""Planning with quantized resident linear weights (`plan --dense`, a v2 bundle's `dense.quant`):
bytes per category and bytes a token reads follow the stored form, exactly."""

import json
import math
from pathlib import Path

import pytest

from edgerun.budget import report
from edgerun.budget.cli import main, plan_for_bundle
from edgerun.budget.planner import RESIDENT_CATEGORIES, PlanOptions, plan, resident_bytes
from edgerun.bundle import dense_layout as DL
from edgerun.errors import ConfigError
from edgerun.models import args as A
from hf_fixtures import QWEN3_MOE

ROOT = Path(__file__).resolve().parents[2]
ORIN = str(ROOT / "configs" / "orin.yaml")
NANO = str(ROOT / "configs" / "orin_nano.yaml")
Q36 = str(ROOT / "configs" / "models" / "qwen3.6-35b-a3b.json")


def _linear_numel(specs) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """(R, C) of every linear weight --dense quantizes, and the lm_head's."""
    linear = [s.shape for s in specs if DL.role(s.name, s.shape) == DL.LINEAR]
    head = next(s.shape for s in specs if s.name == "lm_head.weight")
    return linear, head


def test_int4_and_int8_dense_are_smaller_by_the_expected_amount(model_inputs):
    mi = model_inputs["qwen3.6-35b-a3b"]
    linear, (V, D) = _linear_numel(mi.specs)
    assert len(linear) == 40 * 3 + 30 * 5 + 10 * 4  # shared expert, DeltaNet, attention projections
    bf16 = resident_bytes(mi.specs)
    int4 = resident_bytes(mi.specs, dense=DL.DenseScheme.resolve("int4"))
    int8 = resident_bytes(mi.specs, dense=DL.DenseScheme.resolve("int8"))
    assert int4["lm_head"] == V * D // 2 + V * D // 32 + 4 == 270_172_164
    assert int8["lm_head"] == V * D + 4 * V
    for cat in (A.EMBED, A.NORM, A.ROUTER):
        assert int4[cat] == int8[cat] == bf16[cat]  # plain
    saved4 = sum(2 * R * C - (R * C // 2 + R * C // 32 + 4) for R, C in [*linear, (V, D)])
    saved8 = sum(2 * R * C - (R * C + 4 * R) for R, C in [*linear, (V, D)])
    assert sum(bf16.values()) - sum(int4.values()) == saved4
    assert sum(bf16.values()) - sum(int8.values()) == saved8
    assert sum(int4.values()) == 2_080_262_620  # docs/bundle-format.md
    # an lm_head of its own scheme; the plain lm_head of bf16
    mixed = resident_bytes(mi.specs, dense=DL.DenseScheme.resolve("int4", lm_head="bf16"))
    assert mixed["lm_head"] == bf16["lm_head"] and mixed[A.ATTENTION] == int4[A.ATTENTION]


def test_bytes_a_token_reads_drop_by_what_the_resident_weights_lose(model_inputs, profiles):
    mi = model_inputs["qwen3.6-35b-a3b"]
    plain = plan(mi.args, mi.specs, mi.experts, profiles["orin"], 4096)
    options = PlanOptions(dense=DL.DenseScheme.resolve("int4"))
    q = plan(mi.args, mi.specs, mi.experts, profiles["orin"], 4096, options=options)
    res = [sum(it.nbytes for it in p.items if it.name in RESIDENT_CATEGORIES) for p in (plain, q)]
    saved = res[0] - res[1]
    assert saved == 4_896_711_936 - 2_080_262_620
    assert plain.prediction.memory_bytes_per_token - q.prediction.memory_bytes_per_token == saved
    assert q.prediction.memory_bound_tok_s > plain.prediction.memory_bound_tok_s
    assert q.dense_quant == "int4 g32" and plain.dense_quant == "bf16"
    assert q.item("attention").detail == "int4 g32 linear weights, the rest bf16"
    assert q.item("lm_head").detail == "int4 g32 weights" and q.item("routers").detail == "bf16 weights"
    assert report.from_json(report.to_json(q)) == q


def test_orin_nano_fits_with_int4_dense_and_its_bf16_refusal_says_so(capsys):
    assert main(["--profile", NANO, "--model", Q36, "--dense", "int4"]) == 0
    out = capsys.readouterr().out
    assert "resident linear weights int4 g32; every other resident tensor bf16" in out
    assert "expert quota: 45 per layer x 40 layers" in out and "decode tok/s: 6.8 bound" in out
    assert main(["--profile", NANO, "--model", Q36]) == 1
    out = " ".join(capsys.readouterr().out.split())  # the table wraps the refusal
    assert (
        "With int4 resident linear weights (--dense int4: 2.62 GiB less resident) it fits: quota 45/layer"
        in out
    )


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--dense", "int4", "--dense-group", "64"], "--dense-group 64: int4 takes 16 or 32"),
        (["--dense-group", "32"], "no dense weight is quantized"),
        (["--dense", "int8", "--dense-group", "48"], "cannot quantize tensor 'model.layers.0.linear_attn"),
    ],
)
def test_bad_dense_options_exit_2(capsys, extra, message):
    assert main(["--profile", ORIN, "--model", Q36, *extra]) == 2
    assert message in capsys.readouterr().err


def test_lm_head_of_a_tied_model_is_refused(tmp_path, capsys):
    cfg = tmp_path / "tied.json"
    cfg.write_text(json.dumps({**QWEN3_MOE, "model_type": "qwen3_moe", "tie_word_embeddings": True}))
    args = ["--profile", ORIN, "--model", str(cfg), "--context", "64", "--quant", "int8"]
    assert main([*args, "--lm-head", "int8"]) == 2
    assert "ties its lm_head to the embedding table" in capsys.readouterr().err
    assert main([*args, "--dense", "int8"]) == 0
    assert "\n  lm_head " not in capsys.readouterr().out  # the embedding table is the lm_head


def _manifest(tmp_path, dense_quant):
    b = tmp_path / "bundle"
    b.mkdir(exist_ok=True)
    manifest = {
        "format": "edgerun-bundle",
        "version": 2,
        "model_config": {**QWEN3_MOE, "model_type": "qwen3_moe", "hidden_size": 64, "head_dim": 16},
        "quant": {"scheme": "int8", "group_size": 0},
        "layers": [{"layer": 0, "block_bytes": 8192}, {"layer": 2, "block_bytes": 8192}],
        "dense": {"quant": dense_quant},
    }
    (b / "manifest.json").write_text(json.dumps(manifest))
    return str(b)


def test_a_bundles_dense_quant_is_planned(tmp_path, capsys):
    rec = {"scheme": "int8", "group_size": 0, "rel_rmse": 0.0}
    bundle = _manifest(
        tmp_path,
        {"linear": "int4", "lm_head": "int8", "group_size": 16, "tensors": {"lm_head.weight": rec}},
    )
    assert main(["--profile", ORIN, "--model", bundle, "--context", "64", "--format", "json"]) == 0
    p = report.from_json(capsys.readouterr().out)
    assert p.dense_quant == "int4 g16, lm_head int8 per row"
    assert p.item("lm_head").nbytes == 97 * 64 + 4 * 97
    assert plan_for_bundle(bundle, ORIN, 64).item("lm_head").nbytes == 97 * 64 + 4 * 97
    assert main(["--profile", ORIN, "--model", bundle, "--dense", "int4"]) == 2
    assert "do not apply to the bundle" in capsys.readouterr().err
    bad = _manifest(tmp_path, {"linear": "int3", "lm_head": "bf16", "group_size": 0, "tensors": {}})
    assert main(["--profile", ORIN, "--model", bad]) == 2
    assert "manifest key 'dense.quant' is not usable: linear 'int3'" in capsys.readouterr().err


def test_planned_bytes_are_the_stored_bytes_of_a_bundle(tmp_path):
    """A synthesized v2 bundle (bf16 plain tensors, int4 linear weights, int8 lm_head): on a CUDA
    device (which computes in bf16, the plain tensors' stored dtype) the planner's bytes per
    category are dense.safetensors' bytes per category."""
    from edgerun.bundle.reader import Bundle
    from edgerun.models.inventory import categorize
    from edgerun.tools import synth_bundle as S

    out = S.synth_bundle(
        tmp_path / "b", S.tiny_config("qwen3_5_moe"), dense="int4", lm_head="int8", threads=2
    )
    b = Bundle.open(out)
    stored = dict.fromkeys(RESIDENT_CATEGORIES, 0)
    for name, e in b.dense.items():
        stored[categorize(name.removesuffix(DL.SCALES).removesuffix(DL.GLOBAL))] += e.nbytes
    p = plan_for_bundle(out, str(ROOT / "configs" / "orin.yaml"), 64)
    assert {c: p.item(c).nbytes for c in RESIDENT_CATEGORIES if stored[c]} == {
        c: n for c, n in stored.items() if n
    }
    assert p.dense_quant == "int4 g32, lm_head int8 per row"


def test_a_cpu_plan_counts_what_the_cpu_engine_holds(tmp_path):
    """On a CPU profile the plain resident tensors, KV and state are planned in the dtype the CPU
    engine computes in (fp32 where bf16 hardware measured no faster), not the bundle's bf16: the
    planned resident bytes are what loading measures, the KV the state's own."""
    from edgerun.budget.planner import runtime_dtype
    from edgerun.config import CacheConfig, load_device_profile
    from edgerun.engine.runner import Runner
    from edgerun.engine.setup import measured_resident
    from edgerun.tools import synth_bundle as S

    out = S.synth_bundle(tmp_path / "b", S.tiny_config("qwen3_5_moe"), dense="int8", threads=2)
    cpu = str(ROOT / "configs" / "cpu.yaml")
    dtype = runtime_dtype(load_device_profile(cpu))
    p = plan_for_bundle(out, cpu, 64)
    assert p.dense_dtype == p.kv_dtype == dtype
    runner = Runner.load(out, device="cpu", cache=CacheConfig(4))
    held = measured_resident(runner.model)
    planned = {c: p.item(c).nbytes for c in held if held[c]}
    # loading fuses the shared expert's gate row into the router's GEMV, which measures it as a
    # router's: the two categories are compared together
    for d in (held, planned):
        d["routers"] = d.get("routers", 0) + d.pop("shared_experts", 0)
    assert planned == {c: n for c, n in held.items() if n}
    state = runner.new_state(64)
    kv = sum(t.nbytes for layer in state.layers if hasattr(layer, "k") for t in (layer.k, layer.v))
    assert p.item("kv_cache").nbytes == kv


def test_quantized_bytes_formula_and_widths_int4_cannot_group():
    assert DL.quantized_nbytes((10, 64), "int4", 32) == 10 * 32 + 10 * 2 + 4
    assert DL.quantized_nbytes((10, 64), "int8", 0) == 10 * 64 + 10 * 4
    assert DL.quantized_nbytes((10, 64), "int8", 16) == 10 * 64 + 10 * 4 * 4
    assert math.prod((10, 64)) * 2 > DL.quantized_nbytes((10, 64), "int8", 0)
    odd = [A.TensorSpec("model.layers.0.self_attn.o_proj.weight", (8, 24), A.ATTENTION, 0)]
    with pytest.raises(
        ConfigError, match=r"shape \[8, 24\] as int4 with group 32: .* divide it: none|no int4"
    ):
        resident_bytes(odd, dense=DL.DenseScheme.resolve("int4"))
    assert resident_bytes(odd, dense=DL.DenseScheme.resolve("int8"))[A.ATTENTION] == 8 * 24 + 8 * 4
