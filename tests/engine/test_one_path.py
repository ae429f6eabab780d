"""The one decode path's contracts on the CPU: the static-buffer attention step is the module's
forward; a slot reference made stale by an eviction is refused; every decoded token is traced,
decoder steps included; fallbacks are counted per event; a quota that holds every expert reads
them all in at load (so CUDA decodes one graph a step); the cache only keeps books and bytes;
generation yields between prefill chunks, and a caller may stop it there, freeing its state."""

import weakref

import pytest
import torch

from edgerun.bundle.reader import Bundle
from edgerun.cache.expert_cache import ExpertCache
from edgerun.cache.slots import StaleSlotError
from edgerun.config import CacheConfig
from edgerun.engine.graphs import DecodeGraphs
from edgerun.engine.policy import KernelPolicy
from edgerun.engine.runner import Runner
from edgerun.engine.sampler import SamplingParams
from edgerun.engine.streaming import REFERENCE, lookup, run_experts
from edgerun.engine.trace import RouteRecorder
from edgerun.models.layers import StaticStep
from edgerun.tools.routes import read_trace
from hf_fixtures import ARCHS

CPU = torch.device("cpu")
PROMPT = list(range(3, 20))


@pytest.mark.parametrize("arch", ARCHS)
def test_static_attention_step_equals_the_forward(bundles, arch):
    runner = Runner.load(bundles[(arch, "bf16")], device="cpu")
    model, S = runner.model, 32
    layer = next(layer for layer in model.model.layers if hasattr(layer, "self_attn"))
    attn = layer.self_attn
    g = torch.Generator().manual_seed(0)
    xs = torch.randn(1, 9, runner.args.hidden_size, generator=g)
    with torch.no_grad():
        rope = model.rotary(torch.arange(9), xs.dtype)
        want = attn(xs, rope, attn.new_state(1, S, CPU, xs.dtype), 0)  # all 9 tokens in one forward
        cache = attn.new_state(1, S, CPU, xs.dtype)
        for t in range(9):
            pos = torch.tensor([t])
            cos, sin = model.rotary(pos, xs.dtype)
            step = StaticStep(cos, sin, pos, torch.arange(S))
            got = torch.zeros(1, runner.args.hidden_size)  # the residual it adds its output into
            attn.decode_static(xs[:, t], step, cache, residual=got, norm=torch.nn.Identity())
            # fp32 both: SDPA and the masked fp32 softmax over the 32-slot buffer sum in other
            # orders (~1e-7 relative); 1e-5 on O(1) outputs catches a wrong position, mask or
            # head grouping, each of which is off by O(1e-1)
            assert torch.allclose(got[0], want[0, t], atol=1e-5, rtol=0), t


def test_a_reference_made_stale_by_an_eviction_is_refused(bundles):
    bundle = Bundle.open(bundles[("qwen3_moe", "bf16")])
    cache = ExpertCache(bundle, CacheConfig(2))
    layer, D, A = bundle.args.moe_layers[0], bundle.args.hidden_size, bundle.args.num_experts_per_tok
    x, w = torch.randn(1, D), torch.full((1, A), 1.0 / A)
    ids = torch.tensor([[0, 1]])
    slots, refs = lookup(cache, layer, ids.tolist(), "cpu")
    run_experts(cache, layer, x, slots, ids, w, REFERENCE, refs)  # fresh: runs
    lookup(cache, layer, [[2, 3]], "cpu")  # evicts experts 0 and 1: their slots now hold 2 and 3
    with pytest.raises(StaleSlotError, match="expert 0 in slot"):
        run_experts(cache, layer, x, slots, ids, w, REFERENCE, refs)
    cache.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_decoder_steps_are_traced_like_forward_steps(bundles, arch, tmp_path):
    """The CUDA decoder (its operations run uncaptured on the CPU here) bypasses the model's
    forward, so the runner hands its routes to the recorder: the trace holds every token."""
    b, n = bundles[(arch, "int4")], 8
    plain = Runner.load(b, device="cpu", cache=CacheConfig(4))
    rec = RouteRecorder.for_runner(plain, tmp_path / "plain.jsonl", "tiny")
    want = plain.generate_ids(PROMPT, SamplingParams(max_tokens=n, ignore_eos=True))
    rec.close()

    runner = Runner.load(b, device="cpu", cache=CacheConfig(4))
    runner.decoder = DecodeGraphs(
        runner.model, runner.args, runner.cache, runner.kernels, CPU, 64, runner.steps
    )
    rec = RouteRecorder.for_runner(runner, tmp_path / "decoder.jsonl", "tiny")
    state = runner.decoder.reset()
    with torch.no_grad():
        got = [int(runner.prefill(state, PROMPT).argmax())]
        for _ in range(n - 1):
            got.append(int(runner.decode_step(state, got[-1]).argmax()))
    rec.close()
    assert runner.routes is None  # closing detaches the recorder
    assert got == want
    a, d = read_trace(tmp_path / "plain.jsonl"), read_trace(tmp_path / "decoder.jsonl")
    assert len(d.tokens) == len(a.tokens) == len(PROMPT) + n - 1
    assert d.tokens[: len(PROMPT)] == a.tokens[: len(PROMPT)]  # the prefill forward: identical routes
    assert runner.steps.eager_steps == n - 1  # the decoder ran every decode step


def test_fallbacks_are_counted_per_engine_step(bundles):
    runner = Runner.load(
        bundles[("qwen3_moe", "int4")], device="cpu", cache=CacheConfig(4), kernels=KernelPolicy(experts="triton"),
        prefill_chunk=8,
    )  # fmt: skip
    assert "expert_kernel" in runner.fallbacks()  # triton asked for on a CPU
    assert runner.fallback_counts() == {"expert_kernel": 0}
    runner.generate_ids(PROMPT, SamplingParams(max_tokens=5, ignore_eos=True))
    # 17 prompt tokens in chunks of 8: 3 prefill forwards, then 4 decode steps
    assert runner.fallback_counts() == {"expert_kernel": 7}


@pytest.mark.parametrize("arch", ARCHS)
def test_a_quota_of_every_expert_reads_them_all_at_load(bundles, arch):
    runner = Runner.load(bundles[(arch, "int4")], device="cpu", cache=CacheConfig(64))
    cache, E = runner.cache, runner.args.num_experts
    for layer in runner.args.moe_layers:
        assert cache.slot_table(layer) is not None  # the device-side lookup a CUDA graph needs
        assert cache.io[layer].warm_reads == E and cache.layer_stats(layer).misses == 0
    runner.generate_ids(PROMPT, SamplingParams(max_tokens=4))
    assert cache.totals().misses == 0 and cache.totals().evictions == 0


def test_the_cache_keeps_books_and_bytes_only():
    import edgerun.cache.expert_cache as module

    assert not hasattr(module.ExpertCache, "run") and not hasattr(module.ExpertCache, "weights")
    assert "moe_experts" not in vars(module) and "dequantize_block" not in vars(module)


def test_the_graph_module_holds_no_model_math():
    """engine/graphs.py plans, captures and replays; attention, MLP and expert math are the
    model's (models/layers.py) and the expert step is engine/streaming.run_experts."""
    import ast
    from pathlib import Path

    import edgerun.engine.graphs as graphs

    tree = ast.parse(Path(graphs.__file__).read_text())
    called = {
        node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
    }
    math = {
        "matmul",
        "bmm",
        "softmax",
        "sigmoid",
        "silu",
        "linear",
        "apply_rotary",
        "masked_fill",
        "moe_experts",
    }
    assert not called & math, called & math


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_steps_are_queued_on_the_device_and_give_the_host_loops_tokens(bundles, arch):
    """A greedy request on the decoder takes each step's token from the step's own argmax and
    queues the next step before reading it (runs uncaptured on the CPU here): the same tokens
    as the host loop, which samples each step's logits."""
    from edgerun.engine.sampler import Sampler

    b, n = bundles[(arch, "int4")], 7
    params = SamplingParams(max_tokens=n, ignore_eos=True)
    want = Runner.load(b, device="cpu", cache=CacheConfig(64)).generate_ids(PROMPT, params)

    runner = Runner.load(b, device="cpu", cache=CacheConfig(64))
    runner.decoder = DecodeGraphs(
        runner.model, runner.args, runner.cache, runner.kernels, CPU, 64, runner.steps
    )
    runner.decoder.step = None  # the queued path never asks the host for a step's logits
    state = runner.decoder.reset()
    with torch.no_grad():
        got = list(runner._tokens(state, runner.prefill(state, PROMPT), Sampler(params), n))
    assert got == want
    assert runner.steps.eager_steps == n - 1 and state.pos == len(PROMPT) + n - 1


def test_generate_yields_between_prefill_chunks_and_stops_there():
    """Issue 19, item 9: the daemon feeds its watchdog and checks for cancellation at each event,
    so a long prefill must yield between its chunks."""
    runner = Runner.load(None, device="cpu", prefill_chunk=4)
    forwards = []
    hook = runner.model.register_forward_hook(lambda *args: forwards.append(1))
    try:
        events = runner.generate(runner.request(list(range(3, 13)), SamplingParams(max_tokens=2)))
        chunks = [next(events) for _ in range(3)]  # 10 prompt tokens: chunks of 4, 4 and 2
        assert [(e.text, e.token_id, e.finish_reason) for e in chunks] == [("", None, None)] * 3
        assert [e.prefilled for e in chunks] == [4, 8, 10]  # the prompt tokens through the model
        assert len(forwards) == 3 and next(events).token_id is not None
        forwards.clear()
        events = runner.generate(runner.request(list(range(3, 13)), SamplingParams(max_tokens=2)))
        next(events)
        events.close()  # the client left during the first chunk
        assert len(forwards) == 1
    finally:
        hook.remove()


def test_a_stopped_prefill_frees_its_state_and_stats_time_the_first_token():
    """Closing a generation between prefill chunks drops its decode state (KV, recurrent
    state) at once; a finished one reports TTFT (from the request) and the prefill time apart."""
    runner = Runner.load(None, device="cpu", prefill_chunk=4)
    states = []
    new_state = runner.new_state
    runner.new_state = lambda n: states.append(weakref.ref(s := new_state(n))) or s
    events = runner.generate(runner.request(list(range(3, 23)), SamplingParams(max_tokens=2)))
    next(events)
    assert states[0]() is not None and states[0]().pos == 4
    events.close()
    assert states[0]() is None, "the cancelled prefill's state is still referenced"

    params = SamplingParams(max_tokens=3, ignore_eos=True)
    *_, last = runner.generate(runner.request(list(range(3, 23)), params))
    s = last.stats
    assert s.prompt_tokens == 20 and s.generated_tokens == 3
    assert 0 < s.prefill_s <= s.ttft_s and s.decode_s > 0
    assert f"TTFT {s.ttft_s * 1e3:.0f} ms, prefill {s.prefill_tps:.1f} tok/s" in s.line()


def test_a_warm_up_does_nothing_on_a_cpu_and_names_a_failure_then_leaves_the_request_its_own():
    """``Runner.warm_up`` (``edgerun generate``'s, before its request): nothing to compile or
    capture on a CPU. Where its work fails (on a GPU), it says so in its line and drops the
    decoder it made, so the request builds and warms one of its own; the request's tokens are
    those of a runner that never warmed up."""
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    runner = Runner.load(None, device="cpu")
    request = runner.request(PROMPT, params)
    assert runner.warm_up(request) is None and runner.decoder is None and runner.warm_tokens == 0
    assert runner.capture_prefill() is None  # serve's start-up: no prefill graph on a CPU
    assert runner.capture_counts() == {"decode": 0, "prefill": 0}
    want = runner.generate_ids(PROMPT, params)

    def fails(request, did):
        did.append("the decode step compiled and captured")
        runner.decoder = object()  # what it made before it failed
        raise RuntimeError("capture refused")

    runner.device, runner._warm_parts = torch.device("cuda"), fails  # the GPU's path, not run on one
    line = runner.warm_up(request)
    assert (
        line == "warm-up failed, the request compiles and captures for itself: RuntimeError: capture refused"
    )
    assert runner.decoder is None
    runner.device = CPU
    assert runner.generate_ids(PROMPT, params) == want
