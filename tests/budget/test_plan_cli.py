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
    assert main(["--profile", ORIN, "--model", Q36]) == 0
    out = capsys.readouterr().out
    assert "edgerun plan: qwen3.6-35b-a3b (qwen3_5_moe) on Jetson AGX Orin (64 GB)" in out
    assert "expert quota: 256 per layer" in out


def test_json_output_loads_back(capsys):
    assert main(["--profile", RTX, "--model", Q3, "--context", "32768", "--format", "json"]) == 0
    p = report.from_json(capsys.readouterr().out)
    assert p.fits and p.context == 32768 and p.memory_kind == "discrete" and p.host_quotas


def test_refusal_exits_1_and_says_what_fits(capsys):
    assert main(["--profile", RTX, "--model", Q3, "--context", "32768", "--batch", "4"]) == 1
    out, err = capsys.readouterr()
    assert "REFUSED" in out and "Largest context that fits at batch 4" in " ".join(out.split())
    assert "does not fit" not in err  # the refusal is printed once, in the table
    assert (
        main(["--profile", RTX, "--model", Q3, "--context", "32k", "--batch", "4", "--format", "json"]) == 1
    )
    out, err = capsys.readouterr()
    assert report.from_json(out).context == 32768 and "Largest context that fits at batch 4" in err


def test_default_context_fits_the_model_and_context_takes_k(tmp_path, capsys):
    """Without --context: 4096, or the model's maximum when that is smaller; 32k is 32768."""
    cfg = tmp_path / "short.json"
    cfg.write_text(json.dumps({**QWEN3_MOE, "model_type": "qwen3_moe", "max_position_embeddings": 1024}))
    assert main(["--profile", ORIN, "--model", str(cfg), "--quant", "int8", "--format", "json"]) == 0
    assert report.from_json(capsys.readouterr().out).context == 1024
    assert main(["--profile", ORIN, "--model", Q3, "--format", "json"]) == 0
    assert report.from_json(capsys.readouterr().out).context == 4096
    with pytest.raises(SystemExit) as exc:
        main(["--profile", ORIN, "--model", Q3, "--context", "32q"])
    assert exc.value.code == 2 and "a context length like 4096 or 32k, got '32q'" in capsys.readouterr().err


def test_old_spellings_work_and_say_they_are_deprecated(capsys):
    """One release of grace: --device PROFILE, --config / --checkpoint / --bundle still plan."""
    assert main(["--device", ORIN, "--config", Q36]) == 0
    err = capsys.readouterr().err
    assert "warning: --device PROFILE is deprecated" in err and "use --profile PROFILE" in err
    assert "warning: --config is deprecated and goes in the next release; use --model" in err
    with pytest.raises(SystemExit) as exc:
        main(["--profile", ORIN, "--model", Q36, "--config", Q36])
    assert exc.value.code == 2 and "the model is already given" in capsys.readouterr().err
    assert main(["--model", Q36]) == 2
    assert "--profile PROFILE is required" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--profile", str(ROOT / "configs" / "nope.yaml"), "--model", Q36], "device profile not found"),
        (["--profile", ORIN, "--model", "/nonexistent/config.json"], "no config.json found"),
        (["--profile", ORIN, "--model", Q36, "--context", "300000"], "context 300000 must be in 1..262144"),
        (["--profile", ORIN, "--model", Q36, "--quota", "4"], "quota 4 must be in 8..256"),
        (["--profile", ORIN, "--model", Q36, "--quant", "int4", "--group-size", "24"], "int4 group size"),
    ],
)
def test_errors_exit_2(capsys, extra, message):
    assert main(extra) == 2
    assert message in capsys.readouterr().err


def test_the_plans_dtype_is_the_engines_on_the_device_unless_asked(tmp_path, capsys):
    """`edgerun plan` on a profile without CUDA counts plain tensors and KV in the dtype the CPU
    engine computes in (``runtime_dtype``); on CUDA in bf16; --dense-dtype / --kv-dtype override."""
    from edgerun.budget.planner import runtime_dtype
    from edgerun.config import load_device_profile

    cpu = str(ROOT / "configs" / "cpu.yaml")
    model = str(ROOT / "configs" / "models" / "qwen3-30b-a3b.json")
    want = runtime_dtype(load_device_profile(cpu))
    for profile, dtype in ((cpu, want), (ORIN, "bf16")):
        main(["--profile", profile, "--model", model, "--format", "json"])
        p = report.from_json(capsys.readouterr().out)
        assert (p.dense_dtype, p.kv_dtype) == (dtype, dtype)
    main(
        [
            "--profile",
            cpu,
            "--model",
            model,
            "--format",
            "json",
            "--dense-dtype",
            "fp16",
            "--kv-dtype",
            "bf16",
        ]
    )
    p = report.from_json(capsys.readouterr().out)
    assert (p.dense_dtype, p.kv_dtype) == ("fp16", "bf16")


def test_checkpoint_reads_only_config_json(tmp_path, capsys):
    ckpt = tmp_path / "tiny-moe"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({**QWEN3_MOE, "model_type": "qwen3_moe"}))
    assert main(["--profile", ORIN, "--model", str(ckpt), "--context", "64", "--quant", "int8"]) == 0
    out = capsys.readouterr().out
    assert "tiny-moe (qwen3_moe)" in out and "experts int8, 4.00 KiB per block" in out


def _bundle(tmp_path, manifest):
    b = tmp_path / "bundle"
    b.mkdir(exist_ok=True)
    if isinstance(manifest, dict):  # what names a bundle of a version this edgerun reads
        manifest = {"format": "edgerun-bundle", "version": 1, **manifest}
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
    assert main(["--profile", ORIN, "--model", bundle, "--context", "64", "--format", "json"]) == 0
    p = report.from_json(capsys.readouterr().out)
    assert p.block_bytes == (8192, 4096) and p.quant == "int8" and p.expert_origin.endswith("manifest.json")
    assert p.item("expert_slots").nbytes == 6 * 8192 + 6 * 4096
    assert any("differ from the v1 layout" in n for n in p.notes)
    assert main(["--profile", ORIN, "--model", bundle, "--quant", "int4"]) == 2
    assert "do not apply to the bundle" in capsys.readouterr().err


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
        (None, "neither an edgerun bundle (no manifest.json) nor an HF checkpoint"),
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
        # a bundle of a version this edgerun does not read is refused by plan as by verify
        (
            {"version": 3, "model_config": {**QWEN3_MOE, "model_type": "qwen3_moe"}},
            "unknown bundle format version 3",
        ),
        ({"format": None, "model_config": {}}, "key 'format' is None, expected 'edgerun-bundle'"),
    ],
)
def test_bad_bundles_say_why(tmp_path, capsys, manifest, message):
    if manifest is None:
        (tmp_path / "bundle").mkdir()
        bundle = str(tmp_path / "bundle")
    else:
        bundle = _bundle(tmp_path, manifest)
    assert main(["--profile", ORIN, "--model", bundle]) == 2
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
    args = ["--profile", ORIN, "--model", str(cfg), "--context", "64", "--quant", "int8"]
    assert main([*args, "--trace", str(tmp_path / "t.jsonl")]) == 0
    assert "prediction (trace model)" in capsys.readouterr().out


def test_module_entry_point():
    r = subprocess.run(
        [sys.executable, "-m", "edgerun.budget.cli", "--profile", ORIN, "--model", Q3, "--format", "yaml"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    assert report.from_yaml(r.stdout).model == "qwen3-30b-a3b"


def test_expert_kernel_decides_the_cpu_slots_packed_copy(capsys):
    """On a CPU profile torch's kernels' repacked copy of each int4 slot is counted, the grouped
    kernel's (none) is not; the engine's own plan counts it whatever runs (it plans before the
    probe: a refused grouped kernel runs torch's)."""
    cpu = str(ROOT / "configs" / "cpu.yaml")
    slots = {}
    for kernel in ("cpu", "cpu_grouped"):
        args = ["--profile", cpu, "--model", Q3, "--quant", "int4", "--quota", "8", "--format", "json"]
        main([*args, "--expert-kernel", kernel])
        slots[kernel] = next(
            i for i in report.from_json(capsys.readouterr().out).items if i.name == "expert_slots"
        )
    assert "packed for the CPU kernels" in slots["cpu"].detail
    assert "packed" not in slots["cpu_grouped"].detail
    assert slots["cpu"].nbytes > slots["cpu_grouped"].nbytes
