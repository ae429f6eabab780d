"""The decode step with every fused kernel (projection GEMVs with their epilogues, router top-k,
attention, the DeltaNet step, the expert kernels looking their slots up and adding into the
residual) against the same step on torch, on tiny bundles of both architectures, under Triton's
CPU interpreter: the integration of the kernels the CUDA engine runs, checked without a GPU.

Not collected on its own: tests/kernels/test_interpret.py runs it with TRITON_INTERPRET=1. The
model runs in fp32, where every kernel differs from torch only in summation order and
transcendental ulps (about 1e-6 of a value): logits agree within 1e-4 of their scale (a wrong
row, head, epilogue or slot moves them by O(1) of it) and greedy tokens are identical.

The qwen3_5_moe model has two layers, a DeltaNet one and an attention one (hf_fixtures' default
four repeat that pair): every kernel and the hand-over between the layer types still run, and
each int4 projection GEMV costs the interpreter most of a second a call, so two layers more
would double the time and check nothing new.
"""

import os

import pytest
import torch

from edgerun.bundle.convert import ConvertOptions, convert
from edgerun.config import CacheConfig
from edgerun.engine.graphs import DecodeGraphs
from edgerun.engine.policy import Resolved
from edgerun.engine.runner import Runner
from edgerun.kernels.moe import MoeKernelPolicy
from hf_fixtures import ARCHS, build_hf

pytestmark = [
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="run by test_interpret.py"),
    pytest.mark.usefixtures("few_attention_programs"),  # tests/engine/conftest.py
]
CPU = torch.device("cpu")
PROMPT = [3, 14, 15, 9, 2, 6]
STEPS = 3


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    from tokenizers import Tokenizer, models

    root = tmp_path_factory.mktemp("fused")
    out = {}
    for arch in ARCHS:
        src = root / arch
        extra = {}
        if arch == "qwen3_5_moe":  # one layer of each type (the interpreter's cost is per layer)
            extra = dict(
                shared_expert_intermediate_size=32,
                num_hidden_layers=2,
                layer_types=["linear_attention", "full_attention"],
            )
        build_hf(arch, src, seed=7, hidden_size=64, moe_intermediate_size=32, **extra)
        Tokenizer(models.WordLevel({f"t{i}": i for i in range(97)}, unk_token="t0")).save(
            str(src / "tokenizer.json")
        )
        out[arch] = src
    return out


def decode(
    runner: Runner, policy: Resolved, monkeypatch
) -> tuple[list[int], list[torch.Tensor], int, int, int]:
    """Greedy tokens, each step's logits, how many projections the decode steps ran through the
    torch reference (an exact dequantization then F.linear) instead of the GEMV, how many
    GEMV launches ran a second projection in theirs (``qgemv``'s also), and how many ran a
    DeltaNet conv in theirs (``conv``)."""
    from edgerun.kernels import qlinear_reference, qlinear_triton

    runner.model.use_kernels(policy.dense == "triton")
    runner.decoder = DecodeGraphs(runner.model, runner.args, runner.cache, policy, CPU, 16)
    state = runner.decoder.reset()
    tokens, logits, ref_calls, paired, convs = [], [], [], [], []
    ref, gemv = qlinear_reference.qlinear_ref, qlinear_triton.qgemv
    with torch.no_grad():
        token = int(runner.prefill(state, PROMPT).argmax())
        monkeypatch.setattr(
            qlinear_reference, "qlinear_ref", lambda *a, **k: ref_calls.append(1) or ref(*a, **k)
        )

        def counted(*a, **k):
            paired.append(k.get("also") is not None)
            convs.append(k.get("conv") is not None)
            return gemv(*a, **k)

        monkeypatch.setattr(qlinear_triton, "qgemv", counted)
        for _ in range(STEPS):
            tokens.append(token)
            step = runner.decode_step(state, token).clone()
            logits.append(step)
            token = int(step.argmax())
        monkeypatch.setattr(qlinear_reference, "qlinear_ref", ref)
        monkeypatch.setattr(qlinear_triton, "qgemv", gemv)
    return tokens, logits, len(ref_calls), sum(paired), sum(convs)


# each scheme once (the interpreter is slow): plain, int8 per group and int4, both architectures
@pytest.mark.parametrize(
    "arch, dense", [("qwen3_moe", "bf16"), ("qwen3_moe", "int8"), ("qwen3_5_moe", "int4")]
)
def test_fused_decode_step_matches_torch(sources, tmp_path, arch, dense, monkeypatch):
    bundle = tmp_path / "b"
    group = None if dense == "bf16" else 16  # the tiny projections are 32 to 128 columns wide
    convert(sources[arch], bundle, ConvertOptions("int4", 16, dense=dense, dense_group=group))
    runner = Runner.load(
        bundle, device="cpu", dtype=torch.float32, cache=CacheConfig(64)
    )  # every expert held
    assert all(runner.cache.slot_table(layer) is not None for layer in runner.args.moe_layers)
    want_tokens, want, torch_calls, _, _ = decode(
        runner, Resolved(MoeKernelPolicy(), graphs=False, dense="torch"), monkeypatch
    )
    assert torch_calls > 0  # the count sees the reference when it runs
    fused = Resolved(MoeKernelPolicy("triton"), graphs=False, dense="triton")
    from edgerun.kernels import decode_triton

    topk, routed = decode_triton.router_topk, []
    monkeypatch.setattr(decode_triton, "router_topk", lambda *a, **k: routed.append(1) or topk(*a, **k))
    got_tokens, got, fused_ref_calls, paired, convs = decode(runner, fused, monkeypatch)
    assert fused_ref_calls == 0  # every projection of a fused decode step ran the GEMV
    # every MoE layer's top-k in its expert launch (``route``), none in a launch of its own
    assert runner.decoder.fold_topk == set(runner.args.moe_layers) and not routed
    # Qwen3.5's shared expert: its gate_up in each MoE layer's router launch, its down in the
    # expert step's gate_up launch; each DeltaNet layer's conv in its in_proj's launch, every step
    qwen35 = arch == "qwen3_5_moe"
    assert paired == (STEPS * len(runner.args.moe_layers) if qwen35 else 0)
    deltas = sum(t == "linear_attention" for t in runner.args.layer_types)
    assert convs == (STEPS * deltas if qwen35 else 0) and (deltas > 0) == qwen35
    assert runner.decoder.fold_down == (set(runner.args.moe_layers) if qwen35 else set())
    assert runner.decoder.modes and set(runner.decoder.modes.values()) == {"table"}
    assert got_tokens == want_tokens
    for g, w in zip(got, want):
        assert float((g - w).abs().max() / w.abs().max()) < 1e-4
    if qwen35:
        # the greedy launch writing its pick into the host slot and advancing the position
        # (``DIRECT_PICK``): queued steps give the same tokens, and no position is filled between
        picks, fills, d = pipelined(runner, fused, monkeypatch, direct=True)
        assert d.direct and picks == [*want_tokens, int(want[-1].argmax())]
        assert fills == 1  # the first step's (after the prefill); each later step's by the kernel
        assert int(d.pos[0]) == d.state.pos == d._dev_pos == len(PROMPT) + STEPS
        assert int(d.token_host[(d.state.pos - 1) % 2, 0]) == picks[-1]
        # a drawn token keyed by the same position either way (the launch advanced it first)
        from edgerun.engine.params import SamplingParams
        from edgerun.engine.sampler import Sampler

        params = SamplingParams(temperature=1.0, seed=11)
        plain = pipelined(runner, fused, monkeypatch, direct=False, sampler=Sampler(params, len(PROMPT)))
        direct = pipelined(runner, fused, monkeypatch, direct=True, sampler=Sampler(params, len(PROMPT)))
        assert plain[0] == direct[0] and plain[1] == STEPS and direct[1] == 1


def pipelined(runner: Runner, policy: Resolved, monkeypatch, direct: bool, sampler=None):
    """Queued steps as ``Runner._tokens`` runs them (step i + 1 queued before step i's token is
    read) on a new decoder made with ``DIRECT_PICK`` = ``direct``: (the prefill's token and the
    steps', the position fills the steps queued, the decoder)."""
    from edgerun.engine import graphs

    monkeypatch.setattr(graphs, "DIRECT_PICK", direct)
    runner.model.use_kernels(True)
    d = runner.decoder = DecodeGraphs(runner.model, runner.args, runner.cache, policy, CPU, 16)
    state = d.reset()
    fills, fill = [], d.pos.fill_
    with torch.no_grad():
        token = int(runner.prefill(state, PROMPT).argmax())
        d.pos.fill_ = lambda v: fills.append(v) or fill(v)  # (the instance's, shadowing the method)
        d.sample_with(sampler)
        picks, pending = [token], d.launch(token)
        for i in range(STEPS):
            queued = d.launch(None) if i + 1 < STEPS else None
            picks.append(d.result(pending))
            pending = queued
        d.sample_with(None)
    del d.pos.fill_
    return picks, len(fills), d


def test_batch_rows_are_the_one_sequence_step(sources, tmp_path):
    """A batch's step over its state pool (``RowSteps``: the fused kernels index the pool by
    slot, the GEMVs' tiles hold a fixed row count): a sequence's logits as a row beside another
    at another position equal its step as the one sequence of a decoder, bit for bit, with the
    experts streamed (routed: the rows' experts looked up together). One small case: the
    interpreter is slow."""
    bundle = tmp_path / "b"
    convert(sources["qwen3_5_moe"], bundle, ConvertOptions("int4", 16, dense="int4", dense_group=16))
    runner = Runner.load(bundle, device="cpu", dtype=torch.float32, cache=CacheConfig(4))  # 6 experts, top 2
    fused = Resolved(MoeKernelPolicy("triton"), graphs=False, dense="triton")
    runner.kernels = fused
    runner.model.use_kernels(True)
    runner.decoder = DecodeGraphs(runner.model, runner.args, runner.cache, fused, CPU, 16)
    state = runner.decoder.reset()
    with torch.no_grad():
        runner.prefill(state, PROMPT[:2])
        single = runner.decode_step(state, 5).clone()
    assert runner.decoder.fold_down == set(runner.args.moe_layers)  # routed too: the shared down folds
    runner.decoder = None
    runner.enable_batch(2)
    rows = [runner.batch.join(16) for _ in range(2)]
    for row, p in zip(rows, (PROMPT[:2], [1])):
        runner.prefill(row.state, p)
    logits, picks = runner.batch_step([r.slot for r in rows], [r.state for r in rows], [5, 9])
    assert torch.equal(logits[0], single)  # the one sequence's step folds (its conv, its shared down)
    assert picks[0][0] == int(single.argmax()) and [r.state.pos for r in rows] == [3, 2]
    assert set(runner.row_steps.by_rows[2].modes.values()) == {"routed"}


def test_batch_greedy_rows_run_a_step_ahead(sources, tmp_path):
    """Greedy rows of a batch queue the step after the one they wait for (``RowSteps.advance``:
    each row consumes its pick on the device): two requests interleaved as the engine worker
    drives them (each alone for its first step, then together) give the tokens each gets alone
    with every step waiting for its feed; steps ahead were taken. Plain dense weights and every expert held (table mode: a step
    with no host work), to keep the interpreter's time down."""
    from edgerun.engine.sampler import SamplingParams

    bundle = tmp_path / "b"
    convert(sources["qwen3_5_moe"], bundle, ConvertOptions("int4", 16))
    runner = Runner.load(bundle, device="cpu", dtype=torch.float32, cache=CacheConfig(6))  # 6 experts
    runner.kernels = Resolved(MoeKernelPolicy("triton"), graphs=False, dense="triton")
    runner.model.use_kernels(True)
    runner.enable_batch(2)
    steps = runner.row_steps
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    prompts = (PROMPT, [1, 2])
    steps.pipeline = False
    want = [runner.generate_ids(p, params) for p in prompts]
    assert steps.ahead_steps == 0
    steps.pipeline = True
    gens = [runner.generate(runner.request(p, params)) for p in prompts]
    got, live = [[], []], [True, True]
    while any(live):  # one event of each request a round, as the engine worker does
        for i, g in enumerate(gens):
            if live[i]:
                e = next(g, None)
                if e is None:
                    live[i] = False
                elif e.token_id is not None:
                    got[i].append(e.token_id)
    assert got == want
    assert steps.ahead_steps > 0 and steps.ahead_rows > 0
    assert not runner.batch.rows and not steps.unread()  # the ended rows' last steps ahead dropped


def test_a_sampled_steps_draw_is_the_samplers_draw_of_its_logits(sources, tmp_path):
    """The decode step's own draw (``DecodeGraphs.sample_with``: the token drawn after the step
    and consumed by the next one on the device, never read by the host in between) gives the
    tokens the sampler draws from each step's logits (``Sampler.device_draw``, keyed by the same
    seed and positions), for a filtering request (the sorted draw) and a plain one; after
    ``sample_with(None)`` the step takes the argmax again."""
    from edgerun.engine.sampler import Sampler, SamplingParams

    bundle = tmp_path / "b"
    convert(sources["qwen3_moe"], bundle, ConvertOptions("int4", 16))
    runner = Runner.load(bundle, device="cpu", dtype=torch.float32, cache=CacheConfig(64))
    fused = Resolved(MoeKernelPolicy("triton"), graphs=False, dense="triton")
    runner.model.use_kernels(True)
    decoder = DecodeGraphs(runner.model, runner.args, runner.cache, fused, CPU, 16)
    for kw in (dict(temperature=1.5, top_p=0.9, seed=4), dict(temperature=2.0, seed=5)):
        params = SamplingParams(max_tokens=4, **kw)
        with torch.no_grad():
            stepwise = Sampler(params, position=len(PROMPT))
            state = decoder.reset()
            want = [stepwise.device_draw(runner.prefill(state, PROMPT))]
            stepwise.position += 1
            for _ in range(3):
                want.append(stepwise.device_draw(decoder.step(want[-1])))
                stepwise.position += 1
            sampler = Sampler(params, position=len(PROMPT))
            state = decoder.reset()
            got = [sampler.device_draw(runner.prefill(state, PROMPT))]
            decoder.sample_with(sampler)
            handle = decoder.launch(got[0])
            for _ in range(3):
                queued = decoder.launch(None)  # consumes the drawn token still in the step's buffer
                got.append(decoder.result(handle))
                handle = queued
            decoder.sample_with(None)
        assert got == want, kw
        assert len(set(want)) > 1  # a draw, not a constant
    with torch.no_grad():
        handle = decoder.launch(want[-1])
    assert decoder.result(handle) == int(decoder.logits[0].argmax())
