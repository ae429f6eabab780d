"""Speculative decoding's CUDA path (issue 17) under Triton's CPU interpreter: a verify window
runs the decode step's fused kernels (``DecodeGraphs.verify``: the GEMVs' rows alone, attention
and the DeltaNet step one row after another on the one sequence's state, the expert kernels over
the rows), so its rows are the one-row steps' logits bit for bit, its rolled-back state is plain
decoding's, and greedy output with K = 1, 2, 3 drafts is plain greedy's; with every expert held
(table mode), streamed (routed: a window's union looked up on the host) and resident stacked
(a checkpoint). A tiny two-layer qwen3_5_moe (one DeltaNet, one attention layer) with an MTP
head, fp32, on the CPU.

Not collected on its own: test_speculative.py runs it with TRITON_INTERPRET=1.
"""

import copy
import os

import pytest
import torch
from test_speculative import _states_equal

from edgerun.bundle.convert import ConvertOptions, convert
from edgerun.config import CacheConfig
from edgerun.engine.graphs import DecodeGraphs
from edgerun.engine.policy import Resolved
from edgerun.engine.runner import Runner
from edgerun.engine.sampler import SamplingParams
from edgerun.engine.speculative import MtpDrafter, SpeculativeConfig
from edgerun.kernels.moe import MoeKernelPolicy
from edgerun.models.layers import KVCache

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="run by test_speculative.py"
)
CPU = torch.device("cpu")
PROMPT = [5, 17, 3, 44, 9]
V = 48  # vocabulary: the lm_head's rows
FUSED = Resolved(MoeKernelPolicy("triton"), graphs=False, dense="triton")


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    from tokenizers import Tokenizer, models

    from hf_fixtures import add_mtp, build_hf

    root = tmp_path_factory.mktemp("spec-fused")
    layers = ["linear_attention", "full_attention"]
    # small as the kernels take it (the interpreter runs a program at a time): few output rows
    build_hf("qwen3_5_moe", root / "hf", seed=7, hidden_size=32, moe_intermediate_size=16,
             shared_expert_intermediate_size=16, num_hidden_layers=2, layer_types=layers,
             num_attention_heads=2, num_key_value_heads=1, linear_num_value_heads=2, vocab_size=V)  # fmt: skip
    fused = add_mtp(root / "hf", root / "fused-mtp", seed=3, fused=True)
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(V)}, unk_token="t0")).save(
        str(fused / "tokenizer.json")
    )
    convert(fused, root / "bundle", ConvertOptions("bf16", None, dense="bf16"))
    return {"bundle": root / "bundle", "hf": fused}


def fused_runner(path, cache: CacheConfig | None, k: int = 1, policy: Resolved = FUSED) -> Runner:
    """A runner whose decode steps and verify windows run the CUDA path's kernels on the CPU (a
    DecodeGraphs over its one-sequence state, graphs off)."""
    runner = Runner.load(
        path, device="cpu", dtype=torch.float32, cache=cache, speculative=SpeculativeConfig("mtp", k)
    )
    runner.kernels = policy
    runner.model.use_kernels(True)
    runner.decoder = DecodeGraphs(runner.model, runner.args, runner.cache, policy, CPU, 32, runner.steps)
    return runner


# every expert held (table mode: slots looked up on the device), streamed (routed: the window's
# union looked up on the host between segments; quota 4 = top_k x 2 rows), resident stacked, and
# the reference expert step (eager, the rows one at a time)
@pytest.mark.parametrize(
    ("source", "quota", "rows", "mode"),
    [
        ("bundle", 64, [7, 40, 33], "table"),
        ("bundle", 4, [7, 40], "routed"),
        ("hf", None, [7, 40], "stacked"),
        ("bundle", 4, [7, 40], "eager"),
    ],
)
def test_verify_rows_are_one_row_steps_and_rollback_is_plain_decodings_state(
    sources, source, quota, rows, mode
):
    policy = Resolved(MoeKernelPolicy(), graphs=False, dense="triton") if mode == "eager" else FUSED
    runner = fused_runner(sources[source], CacheConfig(quota) if quota else None, policy=policy)
    d = runner.decoder
    assert set(d.modes.values()) == {mode}
    with torch.inference_mode():
        state = d.reset()
        runner.prefill(state, PROMPT)
        start, steps, after = state.pos, [], {}
        for i, t in enumerate(rows):
            steps.append(runner.decode_step(state, t).clone())
            after[i + 1] = copy.deepcopy(state)
        scribble(d.reset())
        runner.prefill(state, PROMPT)
        eager = runner.steps.eager_steps
        windows = runner.cache.totals().verify_windows if runner.cache else 0
        logits, hidden = d.verify(rows)
        assert runner.steps.eager_steps == eager + 1  # a window is one step, counted as it ran
        if mode in ("routed", "eager"):  # its union of experts counted, per MoE layer
            assert runner.cache.totals().verify_windows - windows == len(runner.args.moe_layers)
        assert logits.shape == (len(rows), runner.args.vocab_size) and hidden.shape == (len(rows), 32)
        for j in range(len(rows)):
            assert torch.equal(logits[j], steps[j]), j
        window = copy.deepcopy(state)
        for kept in range(1, len(rows) + 1):
            s = copy.deepcopy(window)
            s.rollback(start, kept)
            assert _states_equal(s, after[kept], start + kept), kept
        if mode != "table":
            return
        # decoding on from a rolled-back state is decoding on from plain's
        state.rollback(start, 1)
        got = runner.decode_step(state, 9).clone()
        after[1].copy_into(state)
        assert torch.equal(got, runner.decode_step(state, 9))


def scribble(state) -> None:
    """Random keys and values at every position: a window row that read a position before the
    row that writes it (or plain decoding's leftovers there) would not go unnoticed."""
    for entry in state.layers:
        if isinstance(entry, KVCache):
            entry.k.normal_()
            entry.v.normal_()


def oracle_drafts(want: list[int], seed: int):
    """``MtpDrafter.draft`` drafting plain greedy's own tokens, corrupted from a random draft on:
    windows keep every prefix length (a random tiny head's drafts are rarely kept)."""
    g = torch.Generator().manual_seed(seed)

    def draft(self, seq, n, choose):
        i = len(seq) - len(PROMPT)  # seq's next token is want[i]
        out = [want[i + j] if i + j < len(want) else 0 for j in range(n)]
        bad = int(torch.randint(0, n + 1, (), generator=g))
        return out[:bad] + [(t + 1) % V for t in out[bad:]], [torch.zeros(V)] * n

    return draft


def test_greedy_with_mtp_drafts_equals_plain_greedy(sources, monkeypatch):
    """K = 1, 2, 3 with plain greedy's tokens as drafts, corrupted at random (every kept-prefix
    length occurs; the MTP head's own drafts are the CPU path's code, test_speculative.py)."""
    runner = fused_runner(sources["bundle"], CacheConfig(64))
    params = SamplingParams(max_tokens=5, ignore_eos=True)  # the first window may draft 3
    runner.speculative = None
    want = runner.generate_ids(PROMPT, params)
    accepted = 0
    for k in (1, 2, 3):
        monkeypatch.setattr(MtpDrafter, "draft", oracle_drafts(want, k))
        runner.speculative = SpeculativeConfig("mtp", k)
        scribble(runner.decoder.state)
        events = list(runner.generate(runner.request(PROMPT, params)))
        got = [e.token_id for e in events if e.token_id is not None]
        assert torch.equal(torch.tensor(got), torch.tensor(want)), k
        stats = events[-1].stats.speculative
        assert stats.emitted == len(want) - 1 and stats.drafted >= stats.accepted, stats
        accepted += stats.accepted
    assert accepted > 0 and 4 in runner.decoder.windows  # K = 3 drafted 3
    assert runner.steps.graph_steps == runner.steps.mixed_steps == 0 and runner.steps.eager_steps > 0
