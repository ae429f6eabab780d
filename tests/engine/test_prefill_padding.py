"""A prompt chunk padded to a captured length (``engine/graphs.PrefillGraphs``) on the CPU: the
model's forward over the padded rows with ``valid`` marking the prompt leaves the state as the
prompt alone does and gives the prompt rows' outputs, so decoding on from it emits the same
tokens; and which chunks may replay (buckets, first chunks, capturable expert steps). The graph
capture itself needs CUDA (tests/engine/test_graphs_cuda.py)."""

from dataclasses import replace

import pytest
import torch

from edgerun.config import CacheConfig
from edgerun.engine.graphs import DecodeGraphs, PrefillGraphs, prefill_buckets
from edgerun.engine.policy import KernelPolicy, resolve
from edgerun.engine.runner import Runner
from edgerun.models.layers import DeltaState, KVCache
from hf_fixtures import ARCHS

CPU = torch.device("cpu")
PROMPT = list(range(3, 30))  # 27 tokens, padded to 32 and to 64


@pytest.mark.parametrize("pad_to", [32, 64])
@pytest.mark.parametrize("arch", ARCHS)
def test_a_padded_chunk_leaves_the_state_of_the_prompt_alone(bundles, arch, pad_to):
    runner = Runner.load(bundles[(arch, "int4")], device="cpu", dtype=torch.float32)
    model, n, steps = runner.model, len(PROMPT), 12
    plain, padded = model.new_state(1, 96), model.new_state(1, 96)
    tokens = torch.tensor([PROMPT])
    filled = torch.tensor([PROMPT + [0] * (pad_to - n)])
    valid = torch.arange(pad_to) < torch.tensor([n])
    with torch.no_grad():
        want = model.hidden(tokens, plain)
        got = model.hidden(filled, padded, valid=valid)[:, :n]
        padded.pos = n  # the caller's part (PrefillGraphs.run)
        # fp32 both: the padded rows add exact zeros (beta = g = 0), but the GEMMs and the
        # chunked delta rule see T = 27 vs 32/64 rows and may block their sums differently
        # (~1e-6 relative); a state advanced by a padded row is off by O(1e-2) or more
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), float((got - want).abs().max())
        kinds = set()
        for a, b in zip(plain.layers, padded.layers):
            if isinstance(a, DeltaState):
                kinds.add("delta")
                # the last inputs of the prompt, not of the padding (the projection's GEMM rounds
                # as above; a padded input in the window is off by O(1e-1))
                assert torch.allclose(a.conv, b.conv, atol=1e-5, rtol=1e-4)
                assert torch.allclose(a.recurrent, b.recurrent, atol=1e-5, rtol=1e-4)
            elif isinstance(a, KVCache):
                kinds.add("kv")
                assert torch.allclose(a.k[:, :, :n], b.k[:, :, :n], atol=1e-5, rtol=1e-4)
        assert "kv" in kinds and ("delta" in kinds) == (arch == "qwen3_5_moe")
        toks = {}
        for name, state, first in (("plain", plain, want), ("padded", padded, got)):
            out = [int(model.lm_head(first[:, -1:])[0, -1].argmax())]
            for _ in range(steps):
                out.append(int(model(torch.tensor([[out[-1]]]), state, last_only=True)[0, -1].argmax()))
            toks[name] = out
    assert toks["padded"] == toks["plain"]


def test_buckets_cover_every_length_up_to_the_limit():
    for limit in (1, 40, 100, 512, 700, 2048):
        b = prefill_buckets(limit)
        assert b == sorted(set(b)) and b[-1] == limit
        for n in range(1, limit + 1):
            fit = next(x for x in b if x >= n)
            assert fit - n < 128 and (fit <= 16 or fit < 2 * n)  # at most 127 padded rows, under 2x


@pytest.mark.parametrize("arch", ARCHS)
def test_only_first_chunks_of_capturable_steps_replay(bundles, arch):
    """Which chunks may replay, decided without CUDA: the decoder's policy is forced to graphs
    on (its capture is not reached here)."""
    b = bundles[(arch, "int4")]
    E = Runner.load(b, device="cpu").args.num_experts
    for quota, want in ((E, None), (2, "routed")):
        runner = Runner.load(b, device="cpu", cache=CacheConfig(quota))
        policy = resolve(KernelPolicy(), CPU, [])
        policy.graphs = True
        policy.moe = replace(policy.moe, impl="triton")  # table mode: the device kernels' slot lookup
        d = DecodeGraphs(runner.model, runner.args, runner.cache, policy, CPU, 64, runner.steps)
        p = PrefillGraphs(d, 48)
        assert p.buckets == [16, 32, 48]
        if want is None:
            assert p.why_eager is None
            assert [p.bucket(0, n) for n in (1, 16, 17, 48, 49)] == [16, 16, 32, 48, None]
            assert p.bucket(48, 10) is None  # a later chunk: its attention starts past position 0
        else:
            assert want in p.why_eager and p.bucket(0, 10) is None
    off = DecodeGraphs(runner.model, runner.args, runner.cache, resolve(KernelPolicy(), CPU, []), CPU, 64)
    assert PrefillGraphs(off).why_eager == "CUDA graphs off"


def test_eager_prefill_chunks_are_counted(bundles):
    runner = Runner.load(bundles[("qwen3_moe", "int4")], device="cpu")
    runner.prefill_chunk = 10
    state = runner.new_state(len(PROMPT) + 1)
    with torch.no_grad():
        runner.prefill(state, PROMPT)
    assert runner.prefill_counts() == {"graph": 0, "eager": 3}


def test_eager_prefill_is_restored_even_when_the_block_fails(bundles):
    runner = Runner.load(bundles[("qwen3_moe", "int4")], device="cpu")
    with pytest.raises(RuntimeError, match="inside"), runner.eager_prefill():
        assert runner.prefill_graphs is False
        raise RuntimeError("inside")
    assert runner.prefill_graphs is True
