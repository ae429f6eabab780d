"""scripts/train_demo_model.py --mtp-from, the MTP head's recipe, at a toy size (a few seconds on
the CPU): it trains the head on text and on the frozen model's own greedy continuations (and
with ``--mtp-chain`` on second drafts, the head fed its own output), scores both, and writes the
model's weights back unchanged beside the new head. (That the second drafts' attention mask is
the drafting's is checked below against the head run incrementally.)"""

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
    log, out = _train(tmp_path, "--mtp-init", "--mtp-chain", "1")  # second drafts' loss too
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


def test_the_second_drafts_mask_is_drafting_one_position_at_a_time(monkeypatch):
    """The loss's one masked pass (``second_drafts``) gives each second draft what the head
    computes drafting it incrementally (its first drafts' positions, then itself): equal within
    fp32 rounding (the same sums in another order: 1e-5 of values of order 1). A plain causal mask
    over the same rows is not."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import train_demo_model as T
    import transformers as tf

    m = tf.Qwen3_5MoeForCausalLM.from_pretrained(str(DEMO), dtype=torch.float32).eval()
    m.set_experts_implementation("eager")
    full = [i for i, t in enumerate(m.config.layer_types) if t == "full_attention"]
    head = T.MtpHead(m.config, m.model.layers[full[-1]]).eval()
    win = torch.randint(5, 4000, (2, 10), generator=torch.Generator().manual_seed(0))
    B, L = win.shape
    with torch.no_grad():
        h = m.model(input_ids=win).last_hidden_state
        emb = m.model.embed_tokens(win[:, 1:])
        g = head(emb, h[:, :-1], m.model.rotary_emb(emb, torch.arange(L - 1)[None].expand(B, -1)))
        out = T.second_drafts(m, head, win, h, g)
        assert out.shape == (B, L - 2, h.shape[-1])
        for r in range(L - 2):
            e = torch.cat([emb[:, : r + 1], m.model.embed_tokens(win[:, r + 2 : r + 3])], 1)
            hh = torch.cat([h[:, : r + 1], g[:, r : r + 1]], 1)
            o = head(e, hh, m.model.rotary_emb(e, torch.arange(r + 2)[None].expand(B, -1)))[:, -1]
            assert torch.allclose(o, out[:, r], atol=1e-5), r
        causal = torch.ones(2 * L - 3, 2 * L - 3, dtype=torch.bool).tril()
        # every earlier row, the other second drafts too: not what drafting sees
        monkeypatch.setattr(T, "second_draft_mask", lambda first, second: causal)
        wrong = T.second_drafts(m, head, win, h, g)
        assert not torch.allclose(wrong, out, atol=1e-3)
