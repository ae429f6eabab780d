"""Sampled tokens drawn on the GPU (kernels/sample_triton.py): a seeded sampled request's ids,
torch.equal, are the same pipelined from the decode step's graph (the draw replayed after the
step, the next step queued before the token is read), step by step with the sampler drawing from
each step's logits, with graphs off, and among a batch's neighbours; the same seed repeats them
and another changes them; every token is counted as drawn on the device. The kernel's
distribution is checked under the interpreter (tests/kernels/interpreted_sample.py).
Skipped without CUDA (CI has none)."""

import pytest
import torch
from test_batch import PROMPTS, together

from edgerun.config import CacheConfig
from edgerun.engine.policy import KernelPolicy
from edgerun.engine.runner import Runner
from edgerun.engine.sampler import Sampler, SamplingParams
from hf_fixtures import ARCHS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (none on this machine)")
STEPS = 20
FILTERS = {"plain": {}, "top_p": {"top_p": 0.9}, "top_k": {"top_k": 8, "top_p": 0.95}}


def _load(bundle, graphs="on"):
    return Runner.load(
        bundle,
        device="cuda",
        dtype=torch.bfloat16,
        cache=CacheConfig(16),
        kernels=KernelPolicy(graphs=graphs),
    )


def _params(seed, filters, n=STEPS):
    return SamplingParams(max_tokens=n, temperature=0.9, seed=seed, ignore_eos=True, **FILTERS[filters])


def _stepwise(runner, prompt, params):
    """The sampler drawing from each decode step's logits (the decoder's step, not pipelined)."""
    sampler = Sampler(params, position=len(prompt))
    state = runner.new_state(len(prompt) + params.max_tokens)
    token = sampler(runner.prefill(state, prompt))
    out = [token]
    for _ in range(params.max_tokens - 1):
        token = sampler(runner.decode_step(state, token))
        out.append(token)
    return out


@pytest.mark.parametrize("filters", list(FILTERS))
@pytest.mark.parametrize("arch", ARCHS)
def test_a_seed_gives_the_same_draws_pipelined_stepwise_eager_and_again(bundles, arch, filters):
    b = bundles[(arch, "int4")]
    graph, eager = _load(b), _load(b, graphs="off")
    prompt = PROMPTS[0]
    piped = graph.generate_ids(prompt, _params(7, filters))
    assert len(piped) == STEPS
    assert graph.sampled == {"device": STEPS, "host": 0}
    assert graph.decoder._draw_graphs, "the draw was never captured"
    assert "draw_graphs" not in graph.fallbacks(), graph.fallbacks()
    assert graph.generate_ids(prompt, _params(7, filters)) == piped
    assert _stepwise(graph, prompt, _params(7, filters)) == piped
    assert eager.generate_ids(prompt, _params(7, filters)) == piped
    others = {tuple(graph.generate_ids(prompt, _params(s, filters))) for s in (8, 9, 10)}
    assert any(o != tuple(piped) for o in others), "three other seeds all drew the same tokens"
    # a greedy request after sampled ones takes the argmax again
    greedy = SamplingParams(max_tokens=STEPS, ignore_eos=True)
    assert graph.generate_ids(prompt, greedy) == eager.generate_ids(prompt, greedy)


@pytest.mark.parametrize("arch", ARCHS)
def test_sampled_tokens_among_neighbours_equal_alone(bundles, arch):
    runner = _load(bundles[(arch, "int4")])
    prompts, max_tokens = PROMPTS[:3], [10, 6, 12]
    sampling = [
        {"temperature": 0.8, "seed": 1, "top_p": 0.9},
        {},  # a greedy neighbour
        {"temperature": 1.1, "seed": 2, "top_k": 5},
    ]
    alone = [
        runner.generate_ids(p, SamplingParams(max_tokens=n, ignore_eos=True, **extra))
        for p, n, extra in zip(prompts, max_tokens, sampling)
    ]
    runner.enable_batch(3)
    got = together(runner, prompts, max_tokens, [0, 1, 1], sampling)
    for i in range(3):
        assert torch.equal(torch.tensor(got[i]), torch.tensor(alone[i])), i
    assert runner.sampled["host"] == 0
