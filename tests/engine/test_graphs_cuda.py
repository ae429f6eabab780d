"""CUDA graphs with eager miss service: graph-captured and eager decoding run the same
operations, so they must give identical logits (torch.equal) and tokens, in every expert-step
mode: stacked resident experts (one graph per step), every expert in a slot (one graph, slots
looked up on the device), streaming with misses (graph segments, misses served between them),
the reference expert kernel (eager expert steps), and mapped (unified-memory style) slot pools.
A prompt's first chunk replays from a prefill graph captured for its padded length: bit for bit
the eager prefill at a bucket's own length, the same greedy tokens at other lengths.
Skipped without CUDA (CI has none); run on the GPU machine before resolving."""

import dataclasses

import pytest
import torch

from edgerun.config import CacheConfig
from edgerun.engine.params import SamplingParams
from edgerun.engine.policy import KernelPolicy
from edgerun.engine.runner import Runner
from hf_fixtures import ARCHS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (none on this machine)")
PROMPT = list(range(3, 35))  # 32 tokens: a prefill-graph length, so its graph runs eager's shapes
STEPS = 24


def _load(bundle, setup, graphs):
    kw = dict(device="cuda", dtype=torch.bfloat16, kernels=KernelPolicy(graphs=graphs))
    if setup in ("stacked", "held"):  # no cache: resident experts, held as bf16 blocks unless the
        # reference is asked for (then torch's products over the stacked tensors)
        kw["kernels"] = KernelPolicy(experts="reference" if setup == "stacked" else "auto", graphs=graphs)
        return Runner.load(bundle, **kw)
    if setup == "reference":
        kw["kernels"] = KernelPolicy(experts="reference", graphs=graphs)
    cache = CacheConfig(
        {"table": 16}.get(setup, 2),  # table: every expert held (read in at load), one graph a step
        # device slots behind a page-locked host tier; far: the tier holds every expert and the GPU
        # reads the ones its 2 slots lack in place (one graph a step); far-copy: the same tier, misses copied
        host_quotas={"tiered": 5, "far": 16, "far-copy": 16}.get(setup),
        pool="mapped" if setup == "mapped" else None,
        tier_reads="copy" if setup == "far-copy" else None,
    )
    if setup in ("far", "far-cpu"):  # all on the GPU, or every far expert of a decode step on the CPU
        cache = dataclasses.replace(cache, host_quotas=16, cpu_experts="on" if setup == "far-cpu" else "off")
    return Runner.load(bundle, cache=cache, **kw)


def _decode(runner, tokens=None):
    """The logits of the prompt and of STEPS - 1 decode steps, each step fed the greedy token of
    the logits before it, or ``tokens[i]`` (another run's)."""
    state = runner.new_state(len(PROMPT) + STEPS)
    logits = runner.prefill(state, PROMPT)
    out = []
    for i in range(STEPS):
        out.append(logits.clone())
        logits = runner.decode_step(state, int(logits.argmax()) if tokens is None else tokens[i])
    return out


@pytest.mark.parametrize(
    "setup", ["stacked", "held", "table", "routed", "reference", "mapped", "tiered", "far"]
)
@pytest.mark.parametrize("arch", ARCHS)
def test_graph_and_eager_decode_are_identical(bundles, arch, setup):
    b = bundles[(arch, "int4")]
    eager, graph = _load(b, setup, "off"), _load(b, setup, "on")
    want = {"stacked": "stacked", "held": "table", "table": "table", "far": "table", "reference": "eager"}
    want = want.get(setup, "routed")
    a, g = _decode(eager), _decode(graph)
    assert set(graph.decoder.modes.values()) == {want}
    if setup != "reference" and setup != "stacked":
        assert graph.kernels.moe.impl == "triton", graph.kernels.fallbacks
    for step, (x, y) in enumerate(zip(a, g)):
        assert torch.equal(x, y), f"step {step}: max |graph - eager| {float((x - y).abs().max())}"
    assert "graphs" not in graph.fallbacks(), graph.fallbacks()
    counts = graph.decode_counts()
    replayed = counts["graph"] + counts["mixed"]
    assert replayed == STEPS - 1 and counts["eager"] == 1  # the warm-up step; the rest replayed
    if setup in ("stacked", "held", "table", "far"):
        assert counts["mixed"] == 0  # nothing needs the host: whole steps are graphs
    else:
        assert counts["mixed"] == replayed
    assert eager.decode_counts()["eager"] == STEPS
    if setup == "table":
        assert graph.cache.totals().misses == 0
    if setup in ("routed", "mapped", "tiered"):
        assert graph.cache.totals().evictions > 0
    if setup == "tiered":
        t = graph.cache.totals()
        assert t.tier_copies == t.misses > 0 and graph.cache.tier_mem[graph.args.moe_layers[0]].is_pinned()


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("arch", ARCHS)
def test_direct_picks_emit_the_tokens_the_copied_picks_do(bundles, arch, temperature, monkeypatch):
    """``graphs.DIRECT_PICK`` (the greedy launch writes its pick into the pinned host slot of its
    position's parity and advances the device's position): a request's queued steps emit the
    tokens they emit with the picks copied back and the position filled each step, greedy and
    drawn (the draw keyed by the same position)."""
    from edgerun.engine import graphs

    b = bundles[(arch, "int4")]
    out = {}
    for direct in (False, True):
        monkeypatch.setattr(graphs, "DIRECT_PICK", direct)
        r = _load(b, "table", "on")
        params = SamplingParams(max_tokens=STEPS, ignore_eos=True, temperature=temperature, seed=7)
        out[direct] = [e.token_id for e in r.generate(r.request(PROMPT, params)) if e.token_id is not None]
        assert r.decoder.direct == direct
        if direct:  # the device's position is the state's: the last step's greedy launch advanced it
            assert int(r.decoder.pos[0]) == r.decoder.state.pos == r.decoder._dev_pos
    assert out[True] == out[False] and len(out[True]) == STEPS


@pytest.mark.parametrize("setup,temperature", [("table", 0.0), ("routed", 0.0), ("table", 0.8)])
@pytest.mark.parametrize("arch", ARCHS)
def test_a_warm_up_leaves_the_request_its_tokens_counts_and_books(bundles, arch, setup, temperature):
    """``Runner.warm_up`` (``edgerun generate``, before its one request): the decode step
    compiled and captured, a sampled request's draw too, and (every expert held) the prompt's
    prefill bucket captured, ahead. The request then replays every step, emits the tokens a
    cold runner emits (a seeded draw: the same draws), and the step counts and held experts'
    hits are the request's alone; a streamed layer's lookups of the warm-up step stay counted
    (``warm_tokens``, which the CLI's misses/token divides by)."""
    b = bundles[(arch, "int4")]
    cold, warm = _load(b, setup, "on"), _load(b, setup, "on")

    def request(r):
        params = SamplingParams(max_tokens=STEPS, ignore_eos=True, temperature=temperature, seed=7)
        return r.request(PROMPT, params)

    line = warm.warm_up(request(warm))
    assert line is not None and "the decode step compiled and captured" in line, line
    assert ("the prefill graph of 32 tokens captured" in line) == (setup == "table"), line
    assert ("its sampled draw compiled and captured" in line) == (temperature > 0), line
    assert warm.decode_counts() == {"graph": 0, "mixed": 0, "eager": 0}
    assert warm.warm_tokens == (1 if setup == "routed" else 0)
    if setup == "table":
        assert warm.cache.totals().hits == cold.cache.totals().hits  # nothing served: nothing counted
    tokens = {}
    for name, r in (("cold", cold), ("warm", warm)):
        tokens[name] = [e.token_id for e in r.generate(request(r)) if e.token_id is not None]
    assert tokens["warm"] == tokens["cold"] and len(tokens["cold"]) == STEPS
    replayed = "graph" if setup == "table" else "mixed"
    assert warm.decode_counts()[replayed] == STEPS - 1 and warm.decode_counts()["eager"] == 0
    assert cold.decode_counts()["eager"] == 1  # its first step warmed up there
    if setup == "table":
        assert warm.prefill_counts() == cold.prefill_counts() == {"graph": 1, "eager": 0}
        assert warm.cache.totals().hits == cold.cache.totals().hits
    assert warm.warm_up(request(warm)) is None  # nothing left to warm
    assert "graphs" not in warm.fallbacks() and "prefill_graphs" not in warm.fallbacks()


@pytest.mark.parametrize("arch", ARCHS)
def test_start_up_captures_every_prefill_length_so_a_request_captures_none(bundles, arch):
    """``Runner.capture_prefill`` (serve's start-up, after its probe made the decoder): the
    prefill graph of every padded length captured at once. Prompts of each length then replay
    with no capture of their own, their logits bit for bit those of a runner that captures each
    length on first use; a streamed model, whose prompts replay no graph, captures nothing."""
    b = bundles[(arch, "int4")]
    first_use, ahead = _load(b, "table", "on"), _load(b, "table", "on")
    ahead.new_state(len(PROMPT) + STEPS)
    line = ahead.capture_prefill()
    buckets = ahead.decoder.prefill.buckets
    assert len(buckets) >= 3 and line.startswith(
        f"prefill graphs of {', '.join(map(str, buckets))} tokens captured in"
    )
    assert ahead.capture_counts() == {"decode": 0, "prefill": len(buckets)}
    for n in (5, 16, 32, 40):
        prompt = list(range(3, 3 + n))
        logits = [r.prefill(r.new_state(len(PROMPT) + STEPS), prompt) for r in (first_use, ahead)]
        assert torch.equal(*logits), (
            f"{n} tokens: max |ahead - on first use| {float((logits[0] - logits[1]).abs().max())}"
        )
    assert ahead.capture_counts()["prefill"] == len(buckets)  # none while serving
    assert first_use.capture_counts()["prefill"] == len(
        {next(x for x in buckets if x >= n) for n in (5, 16, 32, 40)}
    )
    assert ahead.prefill_counts() == {"graph": 4, "eager": 0} and "prefill_graphs" not in ahead.fallbacks()
    streamed = _load(b, "routed", "on")
    streamed.new_state(len(PROMPT) + STEPS)
    assert streamed.capture_prefill() is None and streamed.capture_counts()["prefill"] == 0


@pytest.mark.parametrize("ahead", [1, 2])
@pytest.mark.parametrize("arch", ARCHS)
def test_prefetch_changes_no_bit_of_a_streamed_graph_decode(bundles, arch, ahead):
    """Decode prefetch on CUDA (the next layer's predicted experts read into staging while a
    layer's own misses land; two ahead, the one after's too): the same logits, bit for bit, as
    with it off, in graph segments with misses served between them, and the greedy tokens of
    every expert held; its reads counted, some of them used."""
    b = bundles[(arch, "int4")]
    kw = dict(device="cuda", dtype=torch.bfloat16, kernels=KernelPolicy(graphs="on"))
    off, on = (
        Runner.load(b, cache=CacheConfig(2, prefetch=pf, prefetch_ahead=ahead, staging=8), **kw)
        for pf in (False, True)
    )
    held = _load(b, "table", "on")
    a, p, h = _decode(off), _decode(on), _decode(held)
    assert on.cache.prefetch_ahead == ahead
    if len(on.args.moe_layers) > 2:  # two ahead: each layer's mixer predicts the one after next too
        assert bool(on.decoder.predict2) == (ahead > 1)
    assert on.cache.prefetch_depth > 0 and off.cache.prefetch_depth == 0
    for step, (x, y) in enumerate(zip(a, p)):
        assert torch.equal(x, y), f"step {step}: max |prefetch on - off| {float((x - y).abs().max())}"
    assert [int(x.argmax()) for x in p] == [int(x.argmax()) for x in h]
    t = on.cache.totals()
    assert t.misses == off.cache.totals().misses > 0
    assert t.prefetch_issued > 0 and t.prefetch_useful > 0
    assert t.prefetch_issued == t.prefetch_useful + t.prefetch_wasted + sum(
        len(v) for v in on.cache._staged.values()
    )  # every read issued is claimed, dropped, or still waiting for its layer's next lookup
    for r in (off, on, held):
        r.cache.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_mapped_and_tiered_slots_equal_device_slots(bundles, arch):
    b = bundles[(arch, "int4")]
    dev, mapped, tiered = _load(b, "routed", "on"), _load(b, "mapped", "on"), _load(b, "tiered", "on")
    assert mapped.cache.pool_kind == "mapped" and mapped.cache.pools[mapped.args.moe_layers[0]].is_cuda
    assert mapped.cache.host_slots[mapped.args.moe_layers[0]].is_pinned()
    # no fallback of its own (mapped_slots; the reads'): the same as device slots' (which may name
    # one unrelated to slots, e.g. deltanet_prefill where fla-core is not installed)
    assert mapped.fallbacks() == dev.fallbacks() and "mapped_slots" not in mapped.fallbacks()
    for x, y, z in zip(_decode(dev), _decode(mapped), _decode(tiered)):
        assert torch.equal(x, y) and torch.equal(x, z)


@pytest.mark.parametrize("arch", ARCHS)
def test_misses_left_unheld_decode_the_bits_held_misses_do(bundles, arch):
    """lfu-bypass on a GPU: a miss that loses to the held experts is read into a spill row (device
    memory; page-locked host memory the GPU reads in place for mapped slots) and the expert
    kernels read it there as slot Q + j. In graph segments and eagerly, the logits equal, bit for
    bit, those of the same quota holding every miss (LFU), and the greedy tokens every expert
    held gives; misses were passed."""
    b = bundles[(arch, "int4")]

    def load(graphs, **cache):
        kw = dict(device="cuda", dtype=torch.bfloat16, kernels=KernelPolicy(graphs=graphs))
        return Runner.load(b, cache=CacheConfig(3, **cache), **kw)

    lfu = load("on", policy="lfu")
    runs = [load(g, policy="lfu-bypass", pool=p) for g, p in (("on", None), ("off", None), ("on", "mapped"))]
    want, held = _decode(lfu), [int(x.argmax()) for x in _decode(_load(b, "table", "on"))]
    for r in runs:
        assert r.cache.spill and r.cache.fallbacks() == lfu.cache.fallbacks()
        got = _decode(r)
        for step, (x, y) in enumerate(zip(want, got)):
            assert torch.equal(x, y), (
                f"{r.cache.pool_kind} step {step}: max |diff| {float((x - y).abs().max())}"
            )
        assert [int(x.argmax()) for x in got] == held
        assert r.cache.totals().passed > 0
    assert runs[2].cache.pool_kind == "mapped" and next(iter(runs[2].cache.spill_host.values())).is_pinned()


@pytest.mark.parametrize("arch", ARCHS)
def test_far_tier_reads_in_place_the_bits_device_slots_hold(bundles, arch):
    """A host tier holding every expert behind 2 device slots: the GPU reads the other experts in
    place from pinned memory, with no miss, no host sync (one graph a step) and the same logits,
    bit for bit, as every expert in device slots; with tier_reads=copy the same tier serves
    misses by copies (graph segments), again the same logits. The far pairs are counted."""
    b = bundles[(arch, "int4")]
    held, far, copy = _load(b, "table", "on"), _load(b, "far", "on"), _load(b, "far-copy", "on")
    layer = far.args.moe_layers[0]
    assert layer in far.cache.far and not copy.cache.far and far.cache.tier_mem[layer].is_pinned()
    for x, y, z in zip(_decode(held), _decode(far), _decode(copy)):
        assert torch.equal(x, y) and torch.equal(x, z)
    assert set(far.decoder.modes.values()) == {"table"} and set(copy.decoder.modes.values()) == {"routed"}
    t = far.cache.totals()
    assert t.misses == 0 and t.evictions == 0 and t.far_reads > 0 and t.hits > 0
    # the device set follows use: experts the kernels counted most move into the device slots
    # (copied from the pinned tier between steps), and the logits stay bit for bit the same
    cache, k = far.cache, 0
    layer = next(iter(cache.far))
    cache.rebalance_far()  # fold in what decoding counted so far
    cold = [e for e in range(far.args.num_experts) if e not in cache.slots[layer].slot_of][:2]
    cache._far_uses[k, cold] = 1000
    copies = cache.totals().tier_copies
    assert cache.rebalance_far(max_swaps=2) >= 2
    table = cache.slot_table(layer).tolist()
    assert all(table[e] < cache.slots[layer].quota for e in cold) and cache.totals().tier_copies >= copies + 2
    for x, y in zip(_decode(held), _decode(far)):
        assert torch.equal(x, y)
    assert copy.cache.totals().tier_copies > 0 and copy.cache.totals().far_reads == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_decode_agrees_with_the_cpu_forward(bundles, arch):
    """fp32 on both sides, reference expert kernel: greedy tokens equal the CPU model's."""
    from edgerun.engine.sampler import SamplingParams

    b = bundles[(arch, "bf16")]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    cpu = Runner.load(b, device="cpu", dtype=torch.float32).generate_ids(PROMPT, params)
    for experts in ("reference", "auto"):
        r = Runner.load(
            b, device="cuda", dtype=torch.float32, cache=CacheConfig(4), kernels=KernelPolicy(experts=experts)
        )
        assert r.generate_ids(PROMPT, params) == cpu, experts


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_dense_kernels_agree_with_the_modules(bundles, arch):
    """dense=triton (fused norms and DeltaNet step) against dense=torch (the modules), fp32:
    the kernels differ from the modules only in summation order (~1e-7 relative), so logits
    agree to 1e-4 and greedy tokens are identical."""
    b = bundles[(arch, "bf16")]
    runs = {}
    for dense in ("torch", "triton"):
        r = Runner.load(
            b, device="cuda", dtype=torch.float32, cache=CacheConfig(4), kernels=KernelPolicy(dense=dense)
        )
        assert r.kernels.dense == dense, r.kernels.fallbacks
        runs[dense] = _decode(r)
    for x, y in zip(runs["torch"], runs["triton"]):
        assert torch.allclose(x, y, atol=1e-4, rtol=0), float((x - y).abs().max())
        assert int(x.argmax()) == int(y.argmax())


@pytest.mark.parametrize("setup", ["stacked", "streamed"])
@pytest.mark.parametrize("graphs", ["on", "off"])
def test_trace_on_cuda_records_every_token_as_the_cpu_does(bundles, tmp_path, setup, graphs):
    """`edgerun trace` on the GPU runs the decoder (graph or eager), not the model's forward:
    every decoded token is still traced, as many as on the CPU, with the prefill's routes equal."""
    from edgerun.cli import main
    from edgerun.tools.routes import read_trace

    b = bundles[("qwen3_5_moe", "bf16")]
    extra = ["--quota", "4"] if setup == "streamed" else []
    traces = {}
    for device in ("cpu", "cuda"):
        out = tmp_path / f"{device}.jsonl"
        argv = [
            "trace",
            "t5 t6",
            "--model",
            str(b),
            "--out",
            str(out),
            "--max-tokens",
            "18",
            "--device",
            device,
        ]
        graph_flag = ["--graphs", graphs] if device == "cuda" else []  # the CPU refuses --graphs on
        assert main(argv + ["--dtype", "float32"] + graph_flag + extra) == 0
        traces[device] = read_trace(out)
    assert len(traces["cuda"].tokens) == len(traces["cpu"].tokens) > 18 - 1
    assert traces["cuda"].tokens[0] == traces["cpu"].tokens[0]


@pytest.mark.parametrize("setup", ["table", "routed"])
@pytest.mark.parametrize("arch", ARCHS)
def test_int4_dense_graph_and_eager_decode_are_identical(dense_bundles, arch, setup):
    """int4 projections through the fused GEMVs: graph == eager, bit for bit, and a greedy
    request (each step's token chosen on the device, the next step queued before it is read)
    gives the tokens of the host loop."""
    from edgerun.engine.sampler import SamplingParams

    b = dense_bundles[arch]
    eager, graph = _load(b, setup, "off"), _load(b, setup, "on")
    assert graph.kernels.dense == "triton" and "dense_kernel" not in graph.fallbacks(), graph.kernels.choices
    assert any(m.scheme == "int4" and m.gemv for m in graph.model.modules() if hasattr(m, "gemv"))
    for step, (x, y) in enumerate(zip(_decode(eager), _decode(graph))):
        assert torch.equal(x, y), f"step {step}: max |graph - eager| {float((x - y).abs().max())}"
    host = [int(x.argmax()) for x in _decode(graph)]  # host argmax of each step's logits
    params = SamplingParams(max_tokens=STEPS, ignore_eos=True)
    prompt_then = graph.generate_ids(PROMPT, params)  # the queued device-side greedy path
    assert prompt_then == host


@pytest.mark.parametrize("arch", ARCHS)
def test_int8_activations_graph_and_eager_decode_are_identical(dense32_bundles, arch):
    """W4A8 (x quantized to int8 per 32 columns in the decode GEMV) on every int4 g32
    projection, whatever its tile (``--dense-act int8`` gives it to weights of 16 rows a
    program only, and a tiny model has none: here it is set on each, as ``use_int8_activations``
    sets it): graph == eager bit for bit, the device-side greedy path gives the host's tokens,
    and the logits are not bf16 activations' but near them."""
    from edgerun.engine.sampler import SamplingParams
    from edgerun.models.layers import QLinear

    b = dense32_bundles[arch]
    base, eager, graph = _load(b, "table", "on"), _load(b, "table", "off"), _load(b, "table", "on")
    taken = 0
    for r in (eager, graph):
        assert r.decoder is None  # graphs are captured at the first step, after this
        for m in r.model.modules():
            eligible = isinstance(m, QLinear) and m.scheme == "int4" and m.group == 32 and m.gemv
            if eligible and m.planes is None and m.tile is None:  # as ``int8_worth`` but the tile
                m.act = "int8"
                taken += 1
    assert taken >= 2 * 4, taken  # in every layer, as many in both runners
    ref = _decode(base)
    tokens = [int(x.argmax()) for x in ref]  # every runner fed bf16 x's greedy tokens
    a, g = _decode(eager, tokens), _decode(graph, tokens)
    for step, (x, y) in enumerate(zip(a, g)):
        assert torch.equal(x, y), f"step {step}: max |graph - eager| {float((x - y).abs().max())}"
    # int8 per 32 columns rounds each x value by at most 1/254 of its group's largest: a step's
    # logits move by about a percent; a wrong scale, group or nibble order moves them by their own
    # size. The median over the steps: a tiny random router's top-k may flip at a step or two
    err = sorted(float((x - y).abs().max() / y.abs().max()) for x, y in zip(a[1:], ref[1:]))
    assert 0 < err[len(err) // 2] < 0.05, err
    host = [int(x.argmax()) for x in _decode(graph)]
    assert graph.generate_ids(PROMPT, SamplingParams(max_tokens=STEPS, ignore_eos=True)) == host


@pytest.mark.parametrize("setup", ["table", "routed"])
@pytest.mark.parametrize("arch", ARCHS)
def test_int8_expert_activations_graph_and_eager_decode_are_identical(dense32_bundles, arch, setup):
    """``--expert-act int8``: the routed experts' gate_up on x quantized to int8 per 32 columns,
    stored by the router's launch in a graph step and quantized by the expert step itself
    eagerly (the same bits, ``quantize_x``'s): graph == eager bit for bit, every expert held (one
    graph a step) or streamed (misses between graph segments), the device-side greedy path
    gives the host's tokens, and a step's logits are near bf16 x's on the same tokens, not equal."""
    from edgerun.engine.sampler import SamplingParams

    b = dense32_bundles[arch]
    base = _load(b, setup, "on")

    def load(graphs):
        r = _load(b, setup, graphs)
        r.set_kernels(KernelPolicy(graphs=graphs, expert_act="int8"))
        return r

    eager, graph = load("off"), load("on")
    assert graph.kernels.moe.act == "int8" and "expert activations" in graph.kernels.choices, (
        graph.kernels.choices
    )
    ref = _decode(base)
    tokens = [int(x.argmax()) for x in ref]
    a, g = _decode(eager, tokens), _decode(graph, tokens)
    for step, (x, y) in enumerate(zip(a, g)):
        assert torch.equal(x, y), f"step {step}: max |graph - eager| {float((x - y).abs().max())}"
    assert graph.decode_counts()["graph"] + graph.decode_counts()["mixed"] == STEPS - 1
    err = sorted(float((x - y).abs().max() / y.abs().max()) for x, y in zip(a[1:], ref[1:]))
    assert 0 < err[len(err) // 2] < 0.05, err  # as in the int8 projections' test above
    host = [int(x.argmax()) for x in _decode(graph)]
    assert graph.generate_ids(PROMPT, SamplingParams(max_tokens=STEPS, ignore_eos=True)) == host


@pytest.mark.parametrize("kind", ["int4", "dense-int4"])
@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_graphs_equal_the_eager_prefill(bundles, dense_bundles, arch, kind):
    """Every expert held (table mode): the first chunk replays a graph per padded length. At a
    bucket's length the graph runs eager's shapes: torch.equal. Padded (27 -> 32, 100 -> 128
    rows) the dense GEMMs see other row counts and may sum in other orders, so the logits agree
    to bf16 rounding and greedy decoding from either state emits the same tokens. The cache's
    hit counts are those of the eager prefill (the warm-up and capture runs are not counted)."""
    b = bundles[(arch, "int4")] if kind == "int4" else dense_bundles[arch]
    graph, eager = _load(b, "table", "on"), _load(b, "table", "on")
    eager.prefill_graphs = False
    for n in (32, 27, 100, 32):
        prompt = [3 + (7 * i) % 90 for i in range(n)]
        runs = {}
        for name, r in (("graph", graph), ("eager", eager)):
            state = r.new_state(n + 16)
            logits = r.prefill(state, prompt).clone()
            toks = [int(logits.argmax())]
            for _ in range(15):
                toks.append(int(r.decode_step(state, toks[-1]).argmax()))
            runs[name] = logits, toks
        (x, a), (y, e) = runs["graph"], runs["eager"]
        if n == 32:
            assert torch.equal(x, y), f"max |graph - eager| {float((x - y).abs().max())}"
        else:  # bf16 logits of O(1): a few units of bf16 rounding (2^-7 relative) at most
            assert torch.allclose(x.float(), y.float(), atol=5e-2, rtol=2e-2), float((x - y).abs().max())
        assert a == e, n
    assert graph.prefill_counts() == {"graph": 4, "eager": 0}
    assert eager.prefill_counts() == {"graph": 0, "eager": 4}
    assert graph.steps.prefill_captures == 2  # 32 and 128
    assert "prefill_graphs" not in graph.fallbacks(), graph.fallbacks()
    assert graph.cache.totals().hits == eager.cache.totals().hits
    assert "prefill: first chunks" in graph.kernel_summary()


@pytest.mark.parametrize("arch", ARCHS)
def test_cpu_experts_split_decodes_the_all_gpu_far_tiers_tokens(cpu_kernel_bundles, arch):
    """--cpu-experts on: every far expert of a decode step is computed on the CPU from the pinned
    tier (torch's int4 CPU kernel) while the GPU runs the device slots' experts, the layer an
    eager host op. Fed the all-GPU far tier's greedy tokens, every step picks the same token and
    its logits are within 5e-2 of their scale: the CPU kernels round x and h to bf16 (about 0.5%
    of a layer's routed output, under the probe's 2e-2; engine/cpu_experts.py states the bound)
    and two tiny layers carry that to the logits. 16 steps, the claim test_cpu_experts.py makes
    for the same kernels (a random tiny model's near-tied routers). The prompt (32 tokens, past
    the GEMV's 8) runs all-GPU: its logits are bit for bit. Decode reads no far block over PCIe;
    the CPU pairs are counted and the start-up line says so."""
    from edgerun.engine.provenance import experts_text

    b = cpu_kernel_bundles[(arch, "int4")]
    gpu, split = _load(b, "far", "on"), _load(b, "far-cpu", "on")
    assert split.cache.cpu_split and "CPU experts on" in experts_text(split)
    states = [r.new_state(len(PROMPT) + 16) for r in (gpu, split)]
    want, got = gpu.prefill(states[0], PROMPT), split.prefill(states[1], PROMPT)
    assert torch.equal(want, got)
    far_after_prompt = split.cache.far_reads()
    for _ in range(16):
        token = int(want.argmax())
        assert int(got.argmax()) == token
        want, got = gpu.decode_step(states[0], token), split.decode_step(states[1], token)
        scale = want.float().abs().max()
        assert float((got.float() - want.float()).abs().max() / scale) <= 5e-2
    assert set(split.decoder.modes.values()) == {"eager"} and set(gpu.decoder.modes.values()) == {"table"}
    assert split.cache.far_reads() == far_after_prompt  # decode read no far block: the CPU computed them
    t = split.cache.totals()
    assert t.cpu_pairs > 0 and t.misses == 0
    assert t.cpu_pairs + t.hits + t.far_reads == gpu.cache.totals().hits + gpu.cache.totals().far_reads
