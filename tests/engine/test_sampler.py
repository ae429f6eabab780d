import pytest
import torch

from edgerun.engine.sampler import Sampler, SamplingError, SamplingParams


def _logits(seed=0, v=50):
    return torch.randn(v, generator=torch.Generator().manual_seed(seed))


def test_greedy_is_argmax():
    logits = _logits()
    assert Sampler(SamplingParams())(logits) == int(logits.argmax())
    assert Sampler(SamplingParams(temperature=1.0, top_k=1, seed=1))(logits) == int(logits.argmax())


def test_temperature_below_1e_5_is_greedy():
    """Dividing real-sized logits by 1e-37 overflows to inf: such temperatures are greedy."""
    logits = _logits() * 30
    for t in (1e-300, 1e-38, 1e-37, 9e-6):
        params = SamplingParams(temperature=t, seed=1)
        assert params.greedy and Sampler(params)(logits) == int(logits.argmax()), t
    assert not SamplingParams(temperature=1e-5).greedy


def test_same_seed_same_tokens_different_seed_differs():
    logits = _logits()

    def draw(seed):
        s = Sampler(SamplingParams(temperature=1.5, seed=seed))
        return [s(logits) for _ in range(50)]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_top_k_restricts_support():
    logits = _logits()
    allowed = set(torch.topk(logits, 3).indices.tolist())
    s = Sampler(SamplingParams(temperature=5.0, top_k=3, seed=0))
    assert {s(logits) for _ in range(200)} <= allowed


def test_top_p_keeps_smallest_nucleus():
    logits = torch.tensor([4.0, 3.0, 0.0, -1.0, -2.0])
    probs = torch.softmax(logits, -1)  # ~[0.71, 0.26, 0.013, ...]
    assert probs[0] < 0.9 < probs[0] + probs[1]
    s = Sampler(SamplingParams(temperature=1.0, top_p=0.9, seed=0))
    seen = {s(logits) for _ in range(300)}
    assert seen == {0, 1}


@pytest.mark.parametrize("top_p", [1e-320, 5e-324, 1e-45, 1e-9])
def test_a_top_p_below_fp32_keeps_the_most_likely_token(top_p):
    """A top_p that rounds to 0 in fp32 (1e-320) drops no token by underflow: the nucleus is the
    most likely token, as for any top_p below its probability."""
    logits = _logits()
    s = Sampler(SamplingParams(temperature=1.0, top_p=top_p, seed=0))
    assert {s(logits) for _ in range(20)} == {int(logits.argmax())}


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(max_tokens=-1), "max_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(stop=("",)), "stop"),
    ],
)
def test_invalid_params_name_the_field(kw, field):
    with pytest.raises(SamplingError, match=field):
        SamplingParams(**kw)


def test_a_cpu_engine_draws_on_the_host_counts_it_and_says_so():
    from edgerun.engine.provenance import provenance
    from edgerun.engine.runner import Runner

    runner = Runner.load(None, device="cpu")  # the demo
    params = SamplingParams(max_tokens=5, temperature=0.8, seed=3, ignore_eos=True)
    ids = runner.generate_ids([1, 2, 3], params)
    assert runner.generate_ids([1, 2, 3], params) == ids
    assert runner.sampled == {"device": 0, "host": 10}
    runner.generate_ids([1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True))  # greedy: not counted
    assert runner.sampled == {"device": 0, "host": 10}
    assert "sampling: on the host" in provenance(runner, None)


def test_a_sampler_keys_device_draws_by_position_and_a_non_negative_seed():
    s = Sampler(SamplingParams(temperature=1.0, seed=-5), position=12)
    assert s.position == 12 and 0 <= s.seed < 2**63 and s.row() == (1.0, 1.0, 0, s.seed)
    assert Sampler(SamplingParams(temperature=1.0, seed=-5)).seed == s.seed
    assert not s.sort and Sampler(SamplingParams(temperature=1.0, top_p=0.9)).sort
    s(torch.tensor([0.0, 1.0, 2.0]))
    assert s.position == 13


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=0.8, top_p=0.95),
        dict(temperature=0.7, top_p=0.8, top_k=20),
        dict(temperature=1.5, top_p=0.99),  # a nucleus past the first 1,024 sorted
        dict(temperature=1.0, top_p=0.5, top_k=3000),
        dict(temperature=1.0, top_k=7),
    ],
)
def test_probs_sorts_only_the_head_and_keeps_the_definitions_distribution(kw):
    """``probs`` sorts the top-k set, or a growing head of the logits, not all of them: the kept
    set equals the full sort's (bf16 logits: many ties, at the k-th and at the cut) and each
    probability agrees within 1e-6 (fp32 sums in another order)."""
    g = torch.Generator().manual_seed(11)
    for scale in (0.5, 3.0):
        logits = (torch.randn(5000, generator=g) * scale).to(torch.bfloat16)
        params = SamplingParams(**kw)
        want, got = Sampler(params).probs_reference(logits), Sampler(params).probs(logits)
        assert torch.equal(want > 0, got > 0), (scale, int((want > 0).sum()), int((got > 0).sum()))
        assert float((want - got).abs().max()) < 1e-6
