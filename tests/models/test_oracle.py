"""edgerun against the Hugging Face reference on tiny random checkpoints of both architectures,
in every on-disk layout real checkpoints use.

Tolerance for logits: atol 1e-5 in fp32. Both sides run the same math in fp32 but through
different kernels (SDPA vs eager attention, our chunked delta rule vs theirs), so results may
differ by a few ulps per op; logits here are O(1), and 1e-5 is ~100 ulps. Greedy tokens must be
identical.
"""

import pytest
import torch

from edgerun.models.checkpoint import load_model
from hf_fixtures import ARCHS, rewrite

ATOL = 1e-5
LAYOUTS = {
    "save_pretrained": None,
    "fused": dict(fused=True),
    "multimodal": dict(fused=True, multimodal=True),
    "sharded": dict(shards=3),
}


def _prompt(n=70, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 97, (1, n), generator=g)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("arch", ARCHS)
def test_logits_and_greedy_match_transformers(hf_checkpoints, tmp_path, arch, layout):
    hf, ckpt = hf_checkpoints[arch]
    if LAYOUTS[layout] is not None:
        ckpt = rewrite(ckpt, tmp_path / layout, **LAYOUTS[layout])
    model, args, report = load_model(ckpt)
    ids = _prompt()
    with torch.no_grad():
        ref = hf(ids).logits
        out = model(ids)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)

    # 32 greedy tokens through edgerun's incremental decode vs HF generate
    prompt = ids[:, :12]
    with torch.no_grad():
        hf_tokens = hf.generate(prompt, max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
    state = model.new_state(1, 64)
    ours = []
    with torch.no_grad():
        logits = model(prompt, state, last_only=True)
        for _ in range(32):
            nxt = int(logits[0, -1].argmax())
            ours.append(nxt)
            logits = model(torch.tensor([[nxt]]), state, last_only=True)
    assert ours == hf_tokens[0, 12:].tolist()

    if layout == "multimodal":
        assert report.prefix == "model.language_model."
        assert report.ignored["vision"] == 2 and report.ignored["mtp"] == 2
    assert report.expert_layout == ("fused" if layout in ("fused", "multimodal") else "per-expert")


@pytest.mark.parametrize("arch", ARCHS)
def test_half_precision_checkpoints_load(hf_checkpoints, tmp_path, arch):
    """bf16 / fp16 files load; computing in fp32 from them equals HF run on the same rounded weights."""
    hf, ckpt = hf_checkpoints[arch]
    ids = _prompt(20)
    for dtype in (torch.bfloat16, torch.float16):
        half = rewrite(ckpt, tmp_path / str(dtype), fused=True, dtype=dtype)
        model, _, _ = load_model(half, dtype=torch.float32)
        rounded = {k: v.to(dtype).float() for k, v in hf.state_dict().items()}
        ref_model = type(hf)(hf.config).eval()
        ref_model.load_state_dict(rounded)
        with torch.no_grad():
            torch.testing.assert_close(model(ids), ref_model(ids).logits, atol=ATOL, rtol=0)
        kept, _, _ = load_model(half)  # default: keep the checkpoint dtype
        assert kept.model.embed_tokens.weight.dtype == dtype
