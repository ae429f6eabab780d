"""Speculative decoding with the MTP head on CUDA (issue 17): a verify window runs the decode
step's own kernels (``DecodeGraphs.verify``: the GEMV's rows shared or alone as the start-up
probe found, attention and the DeltaNet step in their window modes, the rows stepped in order on
the one sequence's state, the expert kernels over the rows), eagerly or replayed
from its CUDA graphs, so its rows equal the one-row steps' logits (torch.equal), its rolled-back
state equals plain decoding's, and greedy output with K = 1, 2, 3 equals plain greedy, token for
token: a tiny random qwen3_5_moe with an MTP head (every expert held, streamed, a checkpoint's
experts held as bf16 blocks or resident stacked; bf16 and int8 dense) and the demo model, graphs on
and off.
Skipped without CUDA (CI has none; the CPU twin is test_speculative.py, and the verify step runs
under Triton's interpreter in interpreted_speculative.py); run on the GPU machine before resolving."""

import copy

import pytest
import torch
from test_speculative import (
    PROMPT,
    _states_equal,
    check_device_steps,
    wide,  # noqa: F401  (a fixture)
)
from test_speculative import sources as mtp_sources  # noqa: F401  (a fixture, by this name)

from edgerun.config import CacheConfig
from edgerun.engine.policy import KernelPolicy
from edgerun.engine.runner import Runner
from edgerun.engine.sampler import SamplingParams
from edgerun.engine.speculative import SpeculativeConfig
from edgerun.engine.streaming import HeldExperts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (none on this machine)")
# (source, quota, the decoder's expert step, the expert kernel asked for): 6 experts, top 2; quota
# 4 holds a 2-row window's; a checkpoint's resident experts held as bf16 blocks (auto: the expert
# kernels, table mode) or stacked (the reference asked for: torch's products, a row at a time)
SETUPS = {
    "table": ("int4", 6, "table", "auto"),
    "routed": ("int4", 4, "routed", "auto"),
    "held": ("hf", None, "table", "auto"),
    "stacked": ("hf", None, "stacked", "reference"),
    "int8-dense": ("int8-dense", 6, "table", "auto"),
}


@pytest.fixture(scope="module")
def cuda_sources(mtp_sources, tmp_path_factory):  # noqa: F811
    """test_speculative's ``sources``, and an int4 bundle with int8 dense projections (one scale a row)."""
    from edgerun.bundle.convert import ConvertOptions, convert

    out = tmp_path_factory.mktemp("mtp-cuda") / "int8-dense"
    fused = mtp_sources["int4"].parent / "fused-mtp"  # the checkpoint the fixture's bundles come from
    convert(fused, out, ConvertOptions("int4", 16, dense="int8", dense_group=0))
    return {**mtp_sources, "int8-dense": out}


def _load(paths, setup: str, graphs: str, k: int | None = None) -> Runner:
    source, quota, _, experts = SETUPS[setup]
    return Runner.load(
        paths[source],
        device="cuda",
        dtype=torch.bfloat16,
        cache=CacheConfig(quota) if quota else None,
        kernels=KernelPolicy(graphs=graphs, dense="triton", experts=experts),
        speculative=SpeculativeConfig("mtp", k) if k else None,
    )


@pytest.mark.parametrize("graphs", ["on", "off"])
@pytest.mark.parametrize("setup", list(SETUPS))
def test_verify_rows_are_one_row_steps_and_rollback_is_plain_decodings_state(cuda_sources, setup, graphs):
    runner = _load(cuda_sources, setup, graphs)
    rows = [7, 70, 33, 1] if setup != "routed" else [7, 70]
    with torch.inference_mode():
        state = runner.new_state(64)
        assert set(runner.decoder.modes.values()) == {SETUPS[setup][2]}
        runner.prefill(state, PROMPT)
        start, steps, after = state.pos, [], {}
        for i, t in enumerate(rows):
            steps.append(runner.decode_step(state, t).clone())
            after[i + 1] = copy.deepcopy(state)
        for _ in range(2):  # with graphs: warm-up and capture, then a replay
            runner.decoder.reset()
            runner.prefill(state, PROMPT)
            logits, _ = runner.decoder.verify(rows)
            for j in range(len(rows)):
                assert torch.equal(logits[j], steps[j]), j
        window = copy.deepcopy(state)
        for kept in range(1, len(rows) + 1):
            s = copy.deepcopy(window)
            s.rollback(start, kept)
            assert _states_equal(s, after[kept], start + kept), kept
    if graphs == "on":
        assert runner.steps.graph_steps + runner.steps.mixed_steps > 0
        assert "graphs" not in runner.fallbacks(), runner.fallbacks()


@pytest.mark.parametrize("graphs", ["on", "off"])
@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_with_mtp_drafts_equals_plain_greedy(cuda_sources, setup, graphs, k):
    if setup == "routed" and k > 1:
        pytest.skip("quota 4 holds a window of 2 rows' experts (K = 1); K > 1 needs every expert: table")
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    want = _load(cuda_sources, setup, graphs).generate_ids(PROMPT, params)
    spec = _load(cuda_sources, setup, graphs, k)
    # a bundle through the expert cache, and a checkpoint on the expert kernels, hold the head's
    # experts as blocks (stacked: a checkpoint's with the reference asked for)
    assert isinstance(spec.model.mtp.layers[0].mlp.experts, HeldExperts) == (setup != "stacked")
    for _ in range(2):  # the second request replays what the first captured
        events = list(spec.generate(spec.request(PROMPT, params)))
        got = [e.token_id for e in events if e.token_id is not None]
        assert torch.equal(torch.tensor(got), torch.tensor(want))
    stats = events[-1].stats
    assert stats.speculative.emitted == len(want) - 1 and stats.row_step_s > 0
    # greedy steps decided on the device wherever a step has no host work; streamed, host-driven
    device = stats.speculative.steps if setup != "routed" else 0
    assert stats.speculative.device_steps == device, stats.speculative
    assert "spec_graphs" not in spec.fallbacks(), spec.fallbacks()
    c = spec.steps
    if graphs == "on":
        assert c.graph_steps + c.mixed_steps > 0 and "graphs" not in spec.fallbacks(), spec.fallbacks()
    else:
        assert c.graph_steps == c.mixed_steps == 0 and c.eager_steps > 0


@pytest.mark.parametrize("graphs", ["on", "off"])
@pytest.mark.parametrize("k", [2, 3])
def test_streamed_windows_that_evict_keep_greedy_output(wide, k, graphs):  # noqa: F811
    """16 experts at a quota of exactly a window's (top_k x (K + 1)): the routed decoder's windows
    miss and evict inside a request (host-driven steps), and the output is plain greedy's."""

    def load(spec=None):
        return Runner.load(
            wide, device="cuda", dtype=torch.bfloat16, cache=CacheConfig(2 * (k + 1)),
            kernels=KernelPolicy(graphs=graphs, dense="triton"), speculative=spec,
        )  # fmt: skip

    params = SamplingParams(max_tokens=40, ignore_eos=True)
    want = load().generate_ids(PROMPT, params)
    spec = load(SpeculativeConfig("mtp", k))
    assert set(spec.decoder.modes.values()) == {"routed"}
    events = list(spec.generate(spec.request(PROMPT, params)))
    assert [e.token_id for e in events if e.token_id is not None] == want
    totals = spec.cache.totals()
    assert totals.evictions > 0, totals
    assert events[-1].stats.speculative.device_steps == 0  # a miss's read is host work


@pytest.mark.parametrize("k", [1, 2, 3])
def test_the_demo_models_drafts_are_kept_and_its_output_is_plain_greedys(k):
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    plain = Runner.load(None, device="cuda")
    spec = Runner.load(None, device="cuda", speculative=SpeculativeConfig("mtp", k))
    prompt = plain.tokenizer.encode("And God said")
    events = list(spec.generate(spec.request(prompt, params)))
    assert [e.token_id for e in events if e.token_id is not None] == plain.generate_ids(prompt, params)
    stats = events[-1].stats.speculative
    assert stats.accepted / stats.drafted > 0.3, stats
    # the demo checkpoint's experts, the head's too, run the expert kernels as bf16 blocks
    assert spec.kernels.moe.impl == "triton" and set(spec.decoder.modes.values()) == {"table"}
    assert isinstance(spec.model.mtp.layers[0].mlp.experts, HeldExperts)


@pytest.mark.parametrize("graphs", ["on", "off"])
@pytest.mark.parametrize("setup", ["table", "held", "stacked"])
def test_a_device_step_keeps_its_accepted_rows_and_rolls_back_to_plain_decodings_state(
    cuda_sources, setup, graphs
):
    """Device-decided steps of K = 2 (engine/spec_steps.py) whose drafts match plain greedy's for
    0, 1 or 2 rows (``check_device_steps``), eagerly and replayed from their graph: the first
    step warms up and captures, the rest replay."""
    runner = _load(cuda_sources, setup, graphs, 2)
    with torch.inference_mode():
        state = runner.new_state(64)
        chain = check_device_steps(runner, state, PROMPT, (0, 1, 2, 2, 1, 0), runner.decoder.reset)
    if graphs == "on":
        assert chain.graph is not None and "spec_graphs" not in runner.fallbacks(), runner.fallbacks()
