"""Speculative decoding's CUDA path (issue 17) under Triton's CPU interpreter: a verify window
runs the decode step's fused kernels (``DecodeGraphs.verify``: the GEMVs' rows alone, attention
one row after another, the DeltaNet step's window mode over the one sequence's state, the expert
kernels over the rows), so its rows are the one-row steps' logits bit for bit, its rolled-back state is plain
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
from test_speculative import _states_equal, check_device_steps

from edgerun.bundle.convert import ConvertOptions, convert
from edgerun.bundle.layout import expert_block_layout
from edgerun.config import CacheConfig
from edgerun.engine.graphs import DecodeGraphs
from edgerun.engine.policy import Resolved
from edgerun.engine.runner import Runner
from edgerun.engine.sampler import SamplingParams
from edgerun.engine.spec_steps import SpecSteps
from edgerun.engine.speculative import MtpDrafter, SpeculativeConfig
from edgerun.engine.streaming import HeldExperts, hold_mtp_experts, hold_resident_experts
from edgerun.kernels.moe import MoeKernelPolicy
from edgerun.models.layers import KVCache

pytestmark = [
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="run by test_speculative.py"),
    pytest.mark.usefixtures("few_attention_programs"),  # tests/engine/conftest.py
]
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


def fused_runner(
    path, cache: CacheConfig | None, k: int = 1, policy: Resolved = FUSED, held: bool = False
) -> Runner:
    """A runner whose decode steps and verify windows run the CUDA path's kernels on the CPU (a
    DecodeGraphs over its one-sequence state, graphs off); ``held``: a checkpoint's experts held
    as blocks, as on CUDA."""
    runner = Runner.load(
        path, device="cpu", dtype=torch.float32, cache=cache, speculative=SpeculativeConfig("mtp", k)
    )
    runner.kernels = policy
    runner.model.use_kernels(True)
    if runner.cache is not None:  # a CUDA runner holds a bundle's head experts as blocks
        hold_mtp_experts(runner.model, runner.cache, policy.moe, CPU)
    elif held:  # and a checkpoint's resident experts, the head's too, as bf16 blocks (Runner.set_kernels)
        layout = expert_block_layout(runner.args, "bf16")
        assert hold_resident_experts(runner.model, layout, policy.moe, CPU) > 0
    runner.decoder = DecodeGraphs(runner.model, runner.args, runner.cache, policy, CPU, 32, runner.steps)
    return runner


# every expert held (table mode: slots looked up on the device), streamed (routed: the window's
# union looked up on the host between segments; quota 4 = top_k x 2 rows), resident stacked, a
# checkpoint's experts held as blocks (table mode, no expert cache: as a CUDA runner runs one), and
# the reference expert step (eager, the rows one at a time)
@pytest.mark.parametrize(
    ("source", "quota", "rows", "mode"),
    [
        ("bundle", 64, [7, 40, 33], "table"),
        ("bundle", 4, [7, 40], "routed"),
        ("hf", None, [7, 40], "stacked"),
        ("hf", None, [7, 40, 33], "table"),
        ("bundle", 4, [7, 40], "eager"),
    ],
)
def test_verify_rows_are_one_row_steps_and_rollback_is_plain_decodings_state(
    sources, source, quota, rows, mode
):
    policy = Resolved(MoeKernelPolicy(), graphs=False, dense="triton") if mode == "eager" else FUSED
    held = source == "hf" and mode == "table"
    runner = fused_runner(sources[source], CacheConfig(quota) if quota else None, policy=policy, held=held)
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


def oracle_device_drafts(want: list[int], seed: int):
    """``SpecSteps._ops`` whose drafts for the next step are plain greedy's own tokens,
    corrupted from a random draft on (a step of the device-decided loop drafts on the device;
    on the CPU its operations run at once, so the next step's inputs can be rewritten here)."""
    g = torch.Generator().manual_seed(seed)
    real = SpecSteps._ops

    def ops(self):
        real(self)
        v = self.verify
        i = int(v.indices[1, 0]) - len(PROMPT)  # the next step's first row consumes want[i]
        assert i >= len(want) or int(v.indices[2, 0]) == want[i]  # the step's choice: plain greedy's
        out = [want[i + j] if i + j < len(want) else 0 for j in range(1, self.k + 1)]
        bad = int(torch.randint(0, self.k + 1, (), generator=g))
        self.drafts.copy_(torch.tensor(out[:bad] + [(t + 1) % V for t in out[bad:]]))
        v.indices[2, 1:].copy_(self.drafts)

    return ops


def test_greedy_with_mtp_drafts_equals_plain_greedy(sources, monkeypatch):
    """K = 1, 2, 3 with plain greedy's tokens as drafts, corrupted at random (every kept-prefix
    length occurs; the MTP head's own drafts are the CPU path's code, test_speculative.py):
    steps decided on the device (verify, accept, roll back, draft, each step queued before
    the last is read), every one of them, and the host-driven loop, which a sampled request
    takes, here by ``_spec_steps`` declining."""
    runner = fused_runner(sources["bundle"], CacheConfig(64))
    params = SamplingParams(max_tokens=7, ignore_eos=True)
    runner.speculative = None
    want = runner.generate_ids(PROMPT, params)
    accepted = 0
    for device in (True, False):
        if not device:
            monkeypatch.setattr(Runner, "_spec_steps", lambda *a: None)
        for k in (1, 2, 3):
            monkeypatch.setattr(MtpDrafter, "draft", oracle_drafts(want, k))
            monkeypatch.setattr(SpecSteps, "_ops", oracle_device_drafts(want, k))
            runner.speculative = SpeculativeConfig("mtp", k)
            scribble(runner.decoder.state)
            events = list(runner.generate(runner.request(PROMPT, params)))
            got = [e.token_id for e in events if e.token_id is not None]
            assert torch.equal(torch.tensor(got), torch.tensor(want)), (device, k)
            stats = events[-1].stats.speculative
            assert stats.emitted == len(want) - 1 and stats.drafted >= stats.accepted, stats
            assert stats.device_steps == (stats.steps if device else 0) and stats.steps > 0, stats
            accepted += stats.accepted
    assert accepted > 0 and 4 in runner.decoder.windows  # K = 3 drafted 3
    assert set(runner.decoder.chains) == {1, 2, 3} and "spec_host_steps" not in runner.fallbacks()
    assert runner.steps.graph_steps == runner.steps.mixed_steps == 0 and runner.steps.eager_steps > 0


def test_a_device_step_keeps_its_accepted_rows_and_rolls_back_to_plain_decodings_state(sources):
    """Device-decided steps of K = 2 whose drafts match plain greedy's for 0, 1 or 2 rows
    (``check_device_steps``), each from a state whose KV was scribbled over first."""
    runner = fused_runner(sources["bundle"], CacheConfig(64), k=2)
    d = runner.decoder
    with torch.inference_mode():
        check_device_steps(runner, d.reset(), PROMPT, (0, 1, 2), lambda: scribble(d.reset()))


def test_steps_with_host_work_stay_host_driven_and_say_so(sources):
    """Streamed experts (quota 4: a layer's lookup reads the routing back between segments):
    greedy speculative steps run the host-driven loop, named among the fallbacks, and the output
    is still plain greedy's."""
    runner = fused_runner(sources["bundle"], CacheConfig(4), k=1)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    spec, runner.speculative = runner.speculative, None
    want = runner.generate_ids(PROMPT, params)
    runner.speculative = spec
    events = list(runner.generate(runner.request(PROMPT, params)))
    assert [e.token_id for e in events if e.token_id is not None] == want
    assert events[-1].stats.speculative.device_steps == 0
    assert "the verify window reads back to the host" in runner.fallbacks()["spec_host_steps"]


def test_the_draft_step_drafts_what_the_heads_forward_drafts(sources):
    """The MTP head's draft step (``DecodeGraphs.draft_step``: the decode step's fused kernels
    over a static state of the head's own) computes the head's forward: fed the same prompt rows
    and then two verified rows, each group as one step of that many rows (a window over the
    head's state), then drafting a row a step, its greedy drafts equal the
    eager head's and its logits agree within fp32 rounding (other kernels, other summation
    orders: 1e-4 of the logits' scale); and greedy output drafting with it is plain greedy's."""
    runner = fused_runner(sources["bundle"], CacheConfig(64), k=3)
    model, D = runner.model, runner.args.hidden_size
    g = torch.Generator().manual_seed(11)
    hidden = torch.randn(1, len(PROMPT) + 3, D, generator=g)
    with torch.inference_mode():
        step = runner.decoder.draft_step()
        # a bundle's head holds its routed experts as blocks (HeldExperts), run by the table-mode kernel
        assert isinstance(model.mtp.layers[0].mlp.experts, HeldExperts) and set(step.modes.values()) == {
            "table"
        }
        # greedy on the device (None), then chosen on the host from the logits, which are kept
        for choose in (None, lambda lg: int(torch.argmax(lg))):
            seq = [*PROMPT, 21]
            drafters = [
                MtpDrafter(model, 32, CPU, torch.float32),
                MtpDrafter(model, 32, CPU, torch.float32, step),
            ]
            for d in drafters:
                d.extend(hidden[:, : len(PROMPT)])  # the prompt: through the head's forward
            for more in ([], [30, 2]):  # then two verified rows: one draft step each
                for d in drafters:
                    d.extend(hidden[:, len(seq) - 1 : len(seq) - 1 + len(more)]) if more else None
                seq += more
                (a, la), (b, lb) = (d.draft(seq, 3, choose) for d in drafters)
                assert a == b, (a, b)
                for d in drafters:  # fed up to the last token; the drafted positions rolled back
                    assert d.state.pos == len(seq) - 1 and d.pending is None
                if choose is None:
                    assert lb == []  # greedy drafts on the device: no logits read back
                    continue
                for x, y in zip(la, lb, strict=True):
                    assert torch.allclose(x, y, rtol=0, atol=1e-4 * float(x.abs().max())), (x - y).abs().max()
    assert {2, len(PROMPT)} <= set(step.windows)  # the prompt's rows and the two: one step each
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    runner.speculative = None
    want = runner.generate_ids(PROMPT, params)
    runner.speculative = SpeculativeConfig("mtp", 2)
    events = list(runner.generate(runner.request(PROMPT, params)))
    assert [e.token_id for e in events if e.token_id is not None] == want
    assert runner.decoder.head_step is step and step.counters.eager_steps > 0
    assert "mtp_graphs" not in runner.fallbacks()


def test_the_window_probe_shares_the_gemv_where_its_rows_stay_exact(sources, monkeypatch):
    """CUDA's start-up check of verify windows (``Runner._probe_windows``), its kernels run by
    the interpreter: windows of 2..K + 1 rows with one GEMV for all rows equal the one-row
    steps, so the GEMV stays shared; a shared GEMV whose rows are not the one-row call's is
    refused, the projections fall back to each row's own programs, named among the fallbacks."""
    from edgerun.kernels import qlinear_triton

    runner = fused_runner(sources["bundle"], CacheConfig(64), k=2)
    line = runner._probe_windows(2)
    assert line.startswith("verify windows of 2, 3 rows equal their one-row steps") and "one GEMV" in line
    assert "verify_gemv" not in runner.fallbacks() and runner.steps.eager_steps == 0
    real = qlinear_triton.qgemv

    def off_by_a_bit(x, *a, alone=False, **kw):  # a shared call's second row, nudged
        y = real(x, *a, alone=alone, **kw)
        if not alone and x.shape[0] > 1:
            y[1:] = torch.nextafter(y[1:], torch.full_like(y[1:], float("inf")))
        return y

    monkeypatch.setattr(qlinear_triton, "qgemv", off_by_a_bit)
    line = runner._probe_windows(1)
    assert "each row by its own programs" in line
    assert "row 1 of a 2-row window differs" in runner.fallbacks()["verify_gemv"]


def test_a_window_shares_the_gemv_only_for_weights_larger_than_l2(sources, monkeypatch):
    """``auto`` window rows on a GPU: projections whose weight exceeds the L2 cache run a
    window's rows in one GEMV, the rest each row by programs of its own; the probe checks the
    mix bit for bit and the start-up line says which. (The interpreter has no L2: its size is
    stood in for, between the tiny model's smallest and largest weights.)"""
    from edgerun.engine import runner as runner_mod
    from edgerun.models.layers import QLinear

    runner = fused_runner(sources["bundle"], CacheConfig(64), k=2)
    sizes = sorted({m.nbytes() for m in runner.model.modules() if isinstance(m, QLinear)})
    above = sizes[len(sizes) // 2]
    monkeypatch.setattr(runner_mod, "l2_bytes", lambda device: above)
    line = runner._probe_windows(2)
    mods = [m for m in runner.model.modules() if isinstance(m, QLinear)]
    big = [m for m in mods if m.nbytes() > above]
    assert big and len(big) < len(mods)
    assert all(m.shared_rows == (m.nbytes() > above) for m in mods)
    assert f"one GEMV for all rows for the {len(big)} weight(s) larger than L2" in line
    assert "verify_gemv" not in runner.fallbacks()


@pytest.mark.parametrize("unit", [True, False])
def test_the_mtp_heads_input_kernel_is_its_two_norms_side_by_side(unit):
    """``spec_triton.mtp_input``: the embedding rows of the tokens and the hidden rows, each RMS
    normed as ``RMSNorm`` does (both weight conventions), side by side. Only the order of the
    sum of squares differs from torch's, which moves the norm's scale by a few fp32 ulps: equal
    within 1e-6 of the values' scale. In fp32: the interpreter casts fp32 to bf16 by truncation
    (a GPU rounds to nearest), so a bf16 comparison here would measure the interpreter."""
    dtype = torch.float32
    from edgerun.kernels import spec_triton
    from edgerun.models.layers import RMSNorm

    g = torch.Generator().manual_seed(5)
    D, V = 48, 20  # a width that is not a power of two: the masked tail
    embed = torch.randn(V, D, generator=g).to(dtype)
    hidden = torch.randn(3, D, generator=g).to(dtype) * 4
    norms = []
    for _ in range(2):
        n = RMSNorm(D, 1e-6, unit)
        with torch.no_grad():
            n.weight.copy_(torch.randn(D, generator=g) * 0.1 + (0 if unit else 1))
        norms.append(n.to(dtype))
    tokens = torch.tensor([7, 0, 19])
    out = torch.empty(3, 2 * D, dtype=dtype)
    spec_triton.mtp_input(tokens, embed, hidden, norms[0], norms[1], out)
    with torch.no_grad():
        want = torch.cat([norms[0](embed[tokens]), norms[1](hidden)], dim=-1)
    assert torch.allclose(out, want, rtol=1e-6, atol=1e-6 * float(want.abs().max()))


def test_rollback_copies_every_layers_kept_row_bit_for_bit_in_one_launch():
    """``spec_triton.Rollback``: each DeltaNet layer's conv (model dtype) and recurrent (fp32)
    states become the kept row of their trails, bit for bit (a copy, no arithmetic: NaN payloads
    and -0.0 survive), states of different sizes, neither a multiple of the kernel's block, three
    layers in one launch; new buffers get a new table; a trail whose rows do not match the state
    is refused before any launch."""
    from edgerun.kernels import spec_triton

    g = torch.Generator().manual_seed(11)
    rows, conv_shape, rec_shape = 4, (1, 24, 3), (1, 2, 40, 17)  # 72 and 1,360 values

    def layer():
        conv_trail = torch.randn(rows, *conv_shape[1:], generator=g).to(torch.bfloat16)
        rec_trail = torch.randn(rows, *rec_shape[1:], generator=g)
        rec_trail.view(torch.int32)[1, 0, 0, :3] = torch.tensor([0x7FC01234, 0x7F800001, -(2**31)])
        states = (torch.zeros(conv_shape, dtype=torch.bfloat16), torch.zeros(rec_shape))
        return (conv_trail, rec_trail), states

    rollback = spec_triton.Rollback()
    for layers in ([layer() for _ in range(3)], [layer()]):
        for kept in range(rows):
            rollback(layers, torch.tensor([kept]))
            for (conv_trail, rec_trail), (conv, rec) in layers:
                assert torch.equal(conv.view(torch.int16), conv_trail[kept : kept + 1].view(torch.int16))
                assert torch.equal(rec.view(torch.int32), rec_trail[kept : kept + 1].view(torch.int32))
    (conv_trail, rec_trail), states = layer()
    with pytest.raises(ValueError, match="rollback: trail"):
        spec_triton.Rollback()([((conv_trail, rec_trail[:, :, :20]), states)], torch.tensor([0]))
