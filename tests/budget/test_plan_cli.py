import json
import subprocess
import sys
from pathlib import Path

import pytest

from edgerun.budget import report
from edgerun.budget.cli import main, plan_for_bundle
from edgerun.budget.planner import RESIDENT_CATEGORIES
from hf_fixtures import QWEN3_MOE

ROOT = Path(__file__).resolve().parents[2]
ORIN = str(ROOT / "configs" / "orin.yaml")
RTX = str(ROOT / "configs" / "rtx5070.yaml")
Q36 = str(ROOT / "configs" / "models" / "qwen3.6-35b-a3b.json")
Q3 = str(ROOT / "configs" / "models" / "qwen3-30b-a3b.json")


def test_plan_from_a_bare_config(capsys):
    assert main(["--device", ORIN, "--config", Q36]) == 0
    out = capsys.readouterr().out
    assert "edgerun plan: qwen3.6-35b-a3b (qwen3_5_moe) on Jetson AGX Orin (64 GB)" in out
    assert "expert quota: 256 per layer" in out


def test_json_output_loads_back(capsys):
    assert main(["--device", RTX, "--config", Q3, "--context", "32768", "--format", "json"]) == 0
    p = report.from_json(capsys.readouterr().out)
    assert p.fits and p.context == 32768 and p.memory_kind == "discrete" and p.host_quotas


def test_refusal_exits_1_and_says_what_fits(capsys):
    assert main(["--device", RTX, "--config", Q3, "--context", "32768", "--batch", "4"]) == 1
    out, err = capsys.readouterr()
    assert "REFUSED" in out and "Largest context that fits at batch 4" in err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--device", str(ROOT / "configs" / "nope.yaml"), "--config", Q36], "device profile not found"),
        (["--device", ORIN, "--config", "/nonexistent/config.json"], "no config.json found"),
        (["--device", ORIN, "--config", Q36, "--context", "300000"], "context 300000 must be in 1..262144"),
        (["--device", ORIN, "--config", Q36, "--quota", "4"], "quota 4 must be in 8..256"),
        (["--device", ORIN, "--config", Q36, "--quant", "int4", "--group-size", "24"], "int4 group size"),
    ],
)
def test_errors_exit_2(capsys, extra, message):
    assert main(extra) == 2
    assert message in capsys.readouterr().err


def test_checkpoint_reads_only_config_json(tmp_path, capsys):
    ckpt = tmp_path / "tiny-moe"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({**QWEN3_MOE, "model_type": "qwen3_moe"}))
    assert main(["--device", ORIN, "--checkpoint", str(ckpt), "--context", "64", "--quant", "int8"]) == 0
    out = capsys.readouterr().out
    assert "tiny-moe (qwen3_moe)" in out and "experts int8, 4.00 KiB per block" in out


def _bundle(tmp_path, manifest):
    b = tmp_path / "bundle"
    b.mkdir(exist_ok=True)
    (b / "manifest.json").write_text(manifest if isinstance(manifest, str) else json.dumps(manifest))
    return str(b)


def test_bundle_manifest(tmp_path, capsys):
    cfg = {**QWEN3_MOE, "model_type": "qwen3_moe"}
    manifest = {
        "model_config": cfg,
        "quant": {"scheme": "int8", "group_size": 0},
        "layers": [{"layer": 0, "block_bytes": 8192}, {"layer": 2, "block_bytes": 4096}],
    }
    bundle = _bundle(tmp_path, manifest)
    assert main(["--device", ORIN, "--bundle", bundle, "--context", "64", "--format", "json"]) == 0
    p = report.from_json(capsys.readouterr().out)
    assert p.block_bytes == (8192, 4096) and p.quant == "int8" and p.expert_origin.endswith("manifest.json")
    assert p.item("expert_slots").nbytes == 6 * 8192 + 6 * 4096
    assert any("differ from the v1 layout" in n for n in p.notes)
    assert main(["--device", ORIN, "--bundle", bundle, "--quant", "int4"]) == 2
    assert "do not apply to --bundle" in capsys.readouterr().err


def test_plan_for_bundle_uses_measured_resident_bytes(tmp_path):
    """The engine re-plans with what loading measured: those bytes replace the estimate."""
    manifest = {
        "model_config": {**QWEN3_MOE, "model_type": "qwen3_moe"},
        "quant": {"scheme": "int8", "group_size": 0},
        "block_bytes": 4096,
    }
    bundle = _bundle(tmp_path, manifest)
    estimated = plan_for_bundle(bundle, ORIN, 64)
    held = {it.name for it in estimated.items} & set(RESIDENT_CATEGORIES)
    assert held  # the tiny model has embeddings, attention, routers, norms
    measured = {c: 2 * estimated.item(c).nbytes for c in held}
    p = plan_for_bundle(bundle, ORIN, 64, resident=measured)
    assert {c: p.item(c).nbytes for c in measured} == measured


@pytest.mark.parametrize(
    "manifest, message",
    [
        (None, "no manifest.json, so this is not an edgerun bundle"),
        ("{not json", "manifest is not valid JSON"),
        ({"quant": "int8"}, "manifest key 'model_config' (the HF config) is missing"),
        (
            {"model_config": {**QWEN3_MOE, "model_type": "qwen3_moe"}, "quant": "int8", "layers": []},
            "no block_bytes for MoE layer 0",
        ),
        (
            {"model_config": {**QWEN3_MOE, "model_type": "qwen3_moe"}, "quant": "int8", "block_bytes": 5000},
            "layer 0 block_bytes must be a positive multiple of 4096",
        ),
    ],
)
def test_bad_bundles_say_why(tmp_path, capsys, manifest, message):
    if manifest is None:
        (tmp_path / "bundle").mkdir()
        bundle = str(tmp_path / "bundle")
    else:
        bundle = _bundle(tmp_path, manifest)
    assert main(["--device", ORIN, "--bundle", bundle]) == 2
    assert message in capsys.readouterr().err


def test_trace_flag(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**QWEN3_MOE, "model_type": "qwen3_moe"}))
    header = {"edgerun_route_trace": 1, "model": {"name": "tiny", "model_type": "qwen3_moe"}}
    header.update(num_layers=3, moe_layers=[0, 2], num_experts=6, top_k=2)
    lines = [json.dumps(header)] + [
        json.dumps({"experts": [[t % 6, (t + 1) % 6], [0, 1]]}) for t in range(12)
    ]
    (tmp_path / "t.jsonl").write_text("\n".join(lines) + "\n")
    args = ["--device", ORIN, "--config", str(cfg), "--context", "64", "--quant", "int8"]
    assert main([*args, "--trace", str(tmp_path / "t.jsonl")]) == 0
    assert "prediction (trace model)" in capsys.readouterr().out


def test_module_entry_point():
    r = subprocess.run(
        [sys.executable, "-m", "edgerun.budget.cli", "--device", ORIN, "--config", Q3, "--format", "yaml"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    assert report.from_yaml(r.stdout).model == "qwen3-30b-a3b"
