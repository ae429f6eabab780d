"""scripts/train_demo_model.py --mtp-from, the MTP head's recipe, at a toy size (a few seconds on
the CPU): it trains the head on text and on the frozen model's own greedy continuations, scores
both, and writes the model's weights back unchanged beside the new head."""

import re
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "edgerun" / "demo"
HELDOUT = ROOT / "tests" / "data" / "kjv_heldout.txt"


def _train(tmp_path: Path, *extra: str) -> tuple[str, Path]:
    data, out = tmp_path / "data", tmp_path / "out"
    data.mkdir()
    text = HELDOUT.read_text()
    (data / "train.txt").write_text(text[:40000])  # any text: the recipe only tokenizes it
    (data / "val.txt").write_text(text[-8000:])
    cmd = [
        sys.executable, str(ROOT / "scripts" / "train_demo_model.py"), "--data", str(data), "--mtp-from", str(DEMO),
        "--out", str(out), "--steps", "2", "--batch-size", "4", "--warmup", "1", "--eval-every", "100",
        "--seq-len", "32", "--mtp-tokens", "4096", "--mtp-generated", "8", "--mtp-prompt", "8", *extra,
    ]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout, out


def _agreement(log: str, step: str) -> float:
    line = next(x for x in log.splitlines() if x.startswith(step))
    return float(re.search(r"on greedy continuations ([0-9.]+)", line).group(1))


def test_the_mtp_recipe_trains_on_greedy_continuations_and_keeps_the_models_weights(tmp_path):
    log, out = _train(tmp_path, "--mtp-init")
    assert "greedy continuations: train (8, 32), val (32, 32)" in log
    # --mtp-init starts from the shipped head: it already agrees with the model far above chance
    assert _agreement(log, "step 0:") > 0.5
    shipped, written = load_file(str(DEMO / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert shipped.keys() == written.keys()
    for name, t in shipped.items():
        if not name.startswith("mtp."):
            assert torch.equal(written[name], t), name
    assert any(not torch.equal(written[n], shipped[n]) for n in shipped if n.startswith("mtp."))


def test_without_init_the_head_starts_untrained(tmp_path):
    log, _ = _train(tmp_path)
    assert _agreement(log, "step 0:") < 0.1  # fc random: about chance over a 4096-token vocabulary
