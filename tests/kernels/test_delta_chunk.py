"""The chunked delta rule through fla-core (kernels/delta_chunk.py): its probe and its agreement
with the torch reference. The CUDA cases skip without CUDA (CI has none) or without fla-core
installed (it is an edgerun[gpu] dependency); TOLERANCE is the module's, for its stated reasons."""

import pytest
import torch

from edgerun.kernels.delta_chunk import (
    TOLERANCE,
    delta_rule_fla,
    fla_version,
    probe_chunk,
    random_inputs,
    reference_bthk,
)
from edgerun.kernels.dense_reference import DeltaDims, delta_rule_chunked

QWEN36 = DeltaDims(16, 32, 128, 128, 4)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (none on this machine)")
fla = pytest.mark.skipif(fla_version() is None, reason="fla-core is not installed here")


def test_probe_refuses_off_cuda_and_says_why():
    r = probe_chunk(QWEN36, "cpu")
    assert not r.selected and "CUDA" in r.reason


def test_policy_keeps_the_reference_on_cpu():
    from edgerun.engine.policy import KernelPolicy, resolve
    from edgerun.models.registry import load_args
    from hf_fixtures import QWEN3_5_MOE

    args = load_args(dict(QWEN3_5_MOE, model_type="qwen3_5_moe_text"))[1]
    out = resolve(KernelPolicy(), torch.device("cpu"), args=args)
    assert out.choices["deltanet prefill"] == "torch" and not out.delta_chunk
    assert "deltanet_prefill" not in out.fallbacks


@cuda
@fla
def test_probe_selects_on_this_gpu():
    r = probe_chunk(QWEN36, "cuda")
    assert r.selected, r.reason


@cuda
@fla
@pytest.mark.parametrize("T", [64, 300, 1024])
def test_fla_matches_the_reference_across_chunks(T):
    """Grouped heads (16 key, 32 value heads), a prompt in two chunks carrying the state, against
    one reference pass."""
    q, k, v, gate, beta, s0 = random_inputs(QWEN36, T, torch.Generator(device="cuda").manual_seed(T))
    want, want_s = reference_bthk(q, k, v, gate, beta, s0.clone())
    cut = T // 3
    o1, s1 = delta_rule_fla(*(t[:, :cut] for t in (q, k, v, gate, beta)), s0.clone())
    o2, s2 = delta_rule_fla(*(t[:, cut:] for t in (q, k, v, gate, beta)), s1)
    got = torch.cat([o1, o2], dim=1)
    assert float((got - want).abs().max() / want.abs().max()) < TOLERANCE
    assert float((s2 - want_s).abs().max() / want_s.abs().max()) < TOLERANCE


def test_reference_layout_is_the_models():
    """reference_bthk (the probe's reference) is the model's own computation: repeat the key
    heads, then delta_rule_chunked in [B, H, T, *]."""
    q, k, v, gate, beta, s0 = random_inputs(DeltaDims(2, 4, 8, 8, 4), 70, torch.Generator().manual_seed(1))
    got, got_s = reference_bthk(q, k, v, gate, beta, s0)
    qq, kk = (t.repeat_interleave(2, dim=2).transpose(1, 2) for t in (q, k))
    want, want_s = delta_rule_chunked(
        qq, kk, v.transpose(1, 2), gate.transpose(1, 2), beta.transpose(1, 2), s0
    )
    assert torch.equal(got, want.transpose(1, 2)) and torch.equal(got_s, want_s)
