"""Batched decoding (issue 18): a request's greedy tokens run among 1, 3 and B-1 neighbours
(joining and leaving at other steps, at other positions) equal its tokens run alone, torch.equal
on the ids: the demo model, and tiny random qwen3_moe / qwen3_5_moe bundles with their experts
resident and streamed (a quota below the union of a step's experts, so a step reads in parts).
The step itself: a multi-row step's logits equal each sequence's one-row step, bit for bit."""

import copy

import pytest
import torch

from edgerun.config import CacheConfig
from edgerun.engine import speculative as S
from edgerun.engine.runner import Runner
from edgerun.engine.sampler import SamplingParams
from edgerun.errors import EdgerunError
from hf_fixtures import ARCHS

B = 6
PROMPTS = [
    [5, 17, 3, 44, 9],
    [1, 2, 3],
    [60, 20, 30, 40, 50, 61, 70, 11, 12, 13, 14],
    [42] * 9,
    [7, 8],
    [90, 3, 90, 3, 90, 3, 1],
    [13],
]
MAX_TOKENS = [10, 4, 12, 7, 12, 2, 9]  # neighbours leave at different steps


def together(runner: Runner, prompts, max_tokens, joins, sampling=None) -> list[list[int]]:
    """Greedy ids of each prompt (``sampling``: request i's extra SamplingParams fields, a
    list), its generator advanced once per round as the daemon's worker does; request i starts
    at round ``joins[i]``."""
    gens: dict[int, object] = {}
    out = [[] for _ in prompts]
    rnd = 0
    while rnd == 0 or gens:
        for i, r in enumerate(joins):
            if r == rnd:
                extra = sampling[i] if sampling is not None else {}
                params = SamplingParams(max_tokens=max_tokens[i], ignore_eos=True, **extra)
                gens[i] = runner.generate(runner.request(prompts[i], params))
        for i in list(gens):
            event = next(gens[i], None)
            if event is None:
                del gens[i]
            elif event.token_id is not None:
                out[i].append(event.token_id)
        rnd += 1
    return out


def check_invariance(runner: Runner, prompts=PROMPTS, max_tokens=MAX_TOKENS) -> None:
    alone = []
    for p, n in zip(prompts, max_tokens):
        alone.append(runner.generate_ids(p, SamplingParams(max_tokens=n, ignore_eos=True)))
    runner.enable_batch(B)
    for neighbours in (1, 3, B - 1):
        group = list(range(neighbours + 1))
        # the first request starts alone; the others join over the next rounds, some mid-stream
        joins = [0] + [1 + j // 2 for j in range(neighbours)]
        got = together(runner, [prompts[i] for i in group], [max_tokens[i] for i in group], joins)
        for i in group:
            assert torch.equal(torch.tensor(got[i]), torch.tensor(alone[i])), (neighbours, i)
    stats = runner.batch.stats
    assert max(k for k, n in stats.sizes.items() if n) == B  # the B - 1 case filled the batch
    assert runner.batch.running == 0 and sorted(runner.batch.free) == list(range(B))


@pytest.fixture(scope="module")
def demo():
    return Runner.load(None, device="cpu")


def test_demo_greedy_among_neighbours_equals_alone(demo):
    runner = copy.copy(demo)  # a shallow copy: this test's batch is its own
    check_invariance(runner)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("experts", ["resident", "streamed"])
def test_tiny_greedy_among_neighbours_equals_alone(bundles, arch, experts):
    cache = CacheConfig(3) if experts == "streamed" else None  # top_k 2: a step of 2+ rows reads in parts
    runner = Runner.load(bundles[(arch, "int4")], device="cpu", cache=cache)
    check_invariance(runner)
    if experts == "streamed":
        assert sum(runner.cache.layer_stats(i).misses for i in runner.args.moe_layers) > 0
        # a batch's multi-row steps are no speculative verify windows (edgerun_verify_window_*)
        assert runner.cache.totals().verify_windows == 0


def test_multi_row_step_is_each_rows_one_row_step(bundles):
    runner = Runner.load(bundles[("qwen3_5_moe", "bf16")], device="cpu")
    states, singles = [], []
    for p in PROMPTS[:4]:
        state = runner.new_state(32)
        runner.prefill(state, p)
        states.append(state)
        singles.append(copy.deepcopy(state))
    tokens = [4, 50, 4, 96]
    rows = runner.decode_rows(states, tokens)
    for b, (state, t) in enumerate(zip(singles, tokens)):
        assert torch.equal(rows[b], runner.decode_step(state, t)), b
        assert states[b].pos == state.pos


def test_batch_refusals(demo):
    runner = copy.copy(demo)
    with pytest.raises(EdgerunError, match="batch must be >= 1"):
        runner.enable_batch(0)
    with pytest.raises(EdgerunError, match="lanes prefill a CUDA batch's prompts"):
        runner.enable_batch(2, lanes=2)  # a CPU batch has no streams to prefill on at once
    with pytest.raises(EdgerunError, match="prefill lanes must be >= 1"):
        runner.enable_batch(2, lanes=0)
    runner.enable_batch(2)
    rows = [runner.batch.join(8), runner.batch.join(8)]
    with pytest.raises(EdgerunError, match="all 2 batch slots are taken"):
        runner.batch.join(8)
    runner.batch.leave(rows[0])
    with pytest.raises(EdgerunError, match="exceeds the batch's slots"):
        runner.batch.join(runner.max_context + 1)
    with pytest.raises(EdgerunError, match="do not combine yet"):
        runner.enable_speculative(S.SpeculativeConfig("mtp", 1))
    on_gpu = copy.copy(demo)
    on_gpu.device = torch.device("cuda")  # refused before anything is allocated there
    with pytest.raises(EdgerunError, match="need the Triton dense kernels"):
        on_gpu.enable_batch(4)


def test_a_streamed_plan_covers_top_k_times_the_batch(bundles):
    from pathlib import Path

    from edgerun.engine.setup import cache_config

    profile = Path(__file__).resolve().parents[2] / "configs" / "cpu.yaml"
    bundle = bundles[("qwen3_moe", "int4")]  # 6 experts, top 2
    one = cache_config(bundle, profile=profile, context=64, batch=1)
    three = cache_config(bundle, profile=profile, context=64, batch=3)
    q = min(three.quotas.values())
    assert three.batch == 3 and f"context 64, batch 3: quota {q} per layer" in three.summary
    assert q >= 6 and min(one.quotas.values()) >= 2 and "batch" not in one.summary
    with pytest.raises(EdgerunError, match=r"Largest batch that fits at context 64: \d+\."):
        cache_config(bundle, profile=profile, context=64, batch=10**9)


def test_a_state_copied_into_a_pool_entry_continues_as_itself(bundles):
    """``DecodeState.copy_into`` (a batch sequence's first chunk is prefilled on the one-sequence
    state and copied into its pool entry): the entry then decodes as the original, bit for bit."""
    runner = Runner.load(bundles[("qwen3_5_moe", "bf16")], device="cpu")
    runner.enable_batch(2)
    src = runner.new_state(16)
    runner.prefill(src, PROMPTS[0])
    row = runner.batch.join(16)
    try:
        src.copy_into(row.state)
        assert row.state.pos == src.pos == len(PROMPTS[0])
        assert torch.equal(runner.decode_step(row.state, 7), runner.decode_step(src, 7))
        with pytest.raises(ValueError, match="does not fit one of 3 positions"):
            src.copy_into(runner.model.new_state(1, 3))
    finally:
        runner.batch.leave(row)


def test_a_batch_steps_own_fallback_is_listed():
    """The start-up probe's fallback (``batch_gemv``, set when the shared-row GEMV is refused)
    is among the batch steps' fallbacks, which the runner's fallbacks and /metrics list."""
    from types import SimpleNamespace

    from edgerun.engine.graphs import RowSteps

    steps = RowSteps(None, None, None, None, "cpu", SimpleNamespace(max_len=16), None)
    assert steps.fallbacks == {}
    steps.own_fallbacks["batch_gemv"] = "each row's projections by programs of its own: row 1 differs"
    assert steps.fallbacks == {"batch_gemv": "each row's projections by programs of its own: row 1 differs"}


@pytest.mark.parametrize("fault", ["mismatch", "build"])
def test_a_refused_tensor_core_gemv_leaves_the_batch_on_qgemv(monkeypatch, fault):
    """``Runner._use_planes`` on a CUDA batch whose planes probe fails (a mismatch against the
    reference, or a kernel the device cannot build): the projections go back to ``qgemv`` and the
    reason is kept for the fallbacks (``batch_gemv_planes``), naming the error; the daemon does
    not die. (The CUDA run of the kernel itself is in test_batch_cuda.py.)"""
    from types import SimpleNamespace

    from edgerun.kernels import qlinear_reference

    calls = []

    def use_planes(on):
        calls.append(on)
        return ["a projection"] if on else []

    def probe(*a, **k):
        if fault == "mismatch":
            raise qlinear_reference.Mismatch("qgemv_planes int4 [128, 64] group 16 none: error 0.5")
        raise RuntimeError("PTX .version 8.7 does not support .target sm_1000")

    monkeypatch.setattr(qlinear_reference, "probe_cases", probe)
    monkeypatch.setattr("edgerun.engine.runner.planes_cases", lambda taken: [])
    stub = SimpleNamespace(
        model=SimpleNamespace(
            use_planes=use_planes, model=SimpleNamespace(embed_tokens=torch.nn.Embedding(2, 2))
        ),
        kernels=SimpleNamespace(dense="triton"),
        device=torch.device("cuda"),
    )
    Runner._use_planes(stub, 4)
    assert calls == [True, False] and stub.planes == 0
    want = "error 0.5" if fault == "mismatch" else "RuntimeError: PTX .version 8.7"
    assert stub.planes_refused.startswith("the batch's projections on qgemv") and want in stub.planes_refused
