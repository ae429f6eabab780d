"""Incremental decode and chunked prefill against the full forward; run-to-run determinism.

Tolerance 1e-5 (fp32): the recurrent (token-by-token) and chunked delta-rule forms, and
attention over a cache vs over the whole sequence, are the same math in a different order.
"""

import pytest
import torch

from edgerun.engine.runner import Runner
from edgerun.engine.sampler import SamplingParams
from edgerun.models.checkpoint import load_model
from hf_fixtures import ARCHS

ATOL = 1e-5


@pytest.fixture(scope="module")
def models(hf_checkpoints):
    return {arch: load_model(hf_checkpoints[arch][1]) for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_after_prefill_equals_full_forward(models, arch):
    model, _, _ = models[arch]
    ids = torch.randint(0, 97, (1, 150), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(ids)
        state = model.new_state(1, 160)
        parts = [model(ids[:, :100], state)]  # 100 > 64: two delta-rule chunks, one partial
        parts += [model(ids[:, t : t + 1], state) for t in range(100, 150)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=ATOL, rtol=0)
    assert state.pos == 150


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_equals_unchunked(models, arch, chunk):
    model, args, _ = models[arch]
    ids = torch.randint(0, 97, (1, 90), generator=torch.Generator().manual_seed(4)).tolist()[0]
    whole = Runner(model, args, None, prefill_chunk=4096)
    chunked = Runner(model, args, None, prefill_chunk=chunk)
    a = whole.prefill(whole.new_state(100), ids)
    b = chunked.prefill(chunked.new_state(100), ids)
    torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_is_deterministic_and_chunking_invariant(models, arch):
    model, args, _ = models[arch]
    prompt = list(range(5, 45))
    params = SamplingParams(max_tokens=40)
    first = Runner(model, args, None).generate_ids(prompt, params)
    second = Runner(model, args, None).generate_ids(prompt, params)
    chunked = Runner(model, args, None, prefill_chunk=3).generate_ids(prompt, params)
    assert len(first) == 40
    assert first == second == chunked


@pytest.mark.parametrize("arch", ARCHS)
def test_batch_rows_are_independent(models, arch):
    model, _, _ = models[arch]
    ids = torch.randint(0, 97, (2, 30), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        both = model(ids)
        one = model(ids[1:])
    torch.testing.assert_close(both[1:], one, atol=ATOL, rtol=0)


def test_state_overflow_is_refused(models):
    model, _, _ = models["qwen3_5_moe"]
    state = model.new_state(1, 8)
    with pytest.raises(ValueError, match="exceeds the state's max_len 8"):
        model(torch.zeros(1, 9, dtype=torch.long), state)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, T, S", [(4, 2, 5, 13), (4, 4, 1, 9), (8, 2, 7, 7), (2, 1, 3, 200)])
def test_a_later_chunks_attention_on_the_cpu_is_causal_lower_right(dtype, heads, kv_heads, T, S):
    """On the CPU a later prompt chunk's attention builds the lower-right causal mask itself
    (torch.nn.attention.bias imports torch._dynamo): bit for bit what SDPA with
    causal_lower_right computes there."""
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    from edgerun.models.layers import causal_attention

    g = torch.Generator().manual_seed(T * S)
    q = torch.randn(1, heads, T, 16, generator=g).to(dtype)
    k, v = (torch.randn(1, kv_heads, S, 16, generator=g).to(dtype) for _ in range(2))
    rep = heads // kv_heads
    kr, vr = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    if T == 1:
        want = F.scaled_dot_product_attention(q, kr, vr)
    elif T == S:
        want = F.scaled_dot_product_attention(q, kr, vr, is_causal=True)
    else:
        want = F.scaled_dot_product_attention(q, kr, vr, attn_mask=causal_lower_right(T, S))
    assert torch.equal(causal_attention(q, k, v), want)


def test_gathered_rows_is_each_rows_gathered_step():
    """``Experts.gathered_rows`` (the MTP head's window rows in one pass) computes what
    ``gathered`` computes a row at a time: each row's experts in ascending id order, weighted.
    fp32, where the batched product over all rows differs only in summation order from one
    row's (1e-6 of the values' scale); a wrong id, weight or row order moves a row by O(1)."""
    from types import SimpleNamespace

    from edgerun.models.layers import Experts

    experts = Experts(SimpleNamespace(num_experts=6, moe_intermediate_size=8, hidden_size=24))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    x = torch.randn(3, 24, generator=g)
    ids = torch.tensor([[4, 1], [0, 5], [2, 2]])
    weights = torch.rand(3, 2, generator=g)
    with torch.no_grad():
        rows = experts.gathered_rows(x, ids, weights)
        alone = torch.cat(
            [experts.gathered(x[r : r + 1], ids[r : r + 1], weights[r : r + 1]) for r in range(3)]
        )
    assert torch.allclose(rows, alone, rtol=1e-6, atol=1e-6 * float(alone.abs().max()))
