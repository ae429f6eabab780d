"""The CUDA decode step's operations (engine/graphs.py), run eagerly on the CPU: attention over
the whole static KV buffer with a mask, the static DeltaNet state, the router and shared expert
into static buffers, and each expert-step mode that runs without CUDA (stacked resident experts,
the reference kernel over cache slots). CI has no GPU; this covers the logic the captured graphs
replay. tests/engine/test_graphs_cuda.py checks graph == eager on a GPU."""

import pytest
import torch

from edgerun.bundle.reader import load_bundle_model
from edgerun.engine.graphs import DecodeGraphs
from edgerun.engine.policy import KernelPolicy, resolve
from edgerun.engine.streaming import load_streaming_model
from hf_fixtures import ARCHS

PROMPT = list(range(3, 20))
CPU = torch.device("cpu")


def _decoder(bundle, source):
    if source == "stacked":
        model, args, _ = load_bundle_model(bundle, dtype=torch.float32)
        cache, layouts = None, []
    else:
        model, args, cache, _ = load_streaming_model(bundle, 4, dtype=torch.float32)
        layouts = list(dict.fromkeys(cache.bundle.layouts.values()))
    policy = resolve(KernelPolicy(), CPU, layouts)
    return DecodeGraphs(model, args, cache, policy, CPU, capacity=64), model


def _run(dec, model, steps=12):
    state = dec.reset()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT]), state, last_only=True)[0, -1]
        out, tok = [], int(logits.argmax())
        for _ in range(steps):
            logits = dec.step(tok).clone()
            out.append(logits)
            tok = int(logits.argmax())
    return out


@pytest.mark.parametrize("source", ["stacked", "cache"])
@pytest.mark.parametrize("arch", ARCHS)
def test_static_decode_matches_the_model_forward(bundles, arch, source):
    b = bundles[(arch, "int4")]
    dec, model = _decoder(b, source)
    assert set(dec.modes.values()) == {"stacked" if source == "stacked" else "eager"}
    assert not dec.policy.graphs  # no CUDA: the operations run uncaptured
    got = _run(dec, model)
    ref_model, _, _ = load_bundle_model(b, dtype=torch.float32)
    st = ref_model.new_state(1, 64)
    with torch.no_grad():
        logits = ref_model(torch.tensor([PROMPT]), st, last_only=True)[0, -1]
        for step in got:
            want = ref_model(torch.tensor([[int(logits.argmax())]]), st, last_only=True)[0, -1]
            # same model, fp32: attention over a masked 64-position buffer and the gathered
            # expert matmuls sum in another order than the forward, so ~1e-7 relative per sum;
            # 1e-4 absolute on O(1) logits leaves room for that and catches any real mistake
            # (a wrong position, head grouping, or expert is off by O(1))
            assert torch.allclose(step, want, atol=1e-4, rtol=0), float((step - want).abs().max())
            assert int(step.argmax()) == int(want.argmax())
            logits = want
    assert dec.counters.eager_steps == len(got)


def test_reset_starts_a_new_sequence(bundles):
    dec, model = _decoder(bundles[("qwen3_5_moe", "int4")], "cache")
    first, second = _run(dec, model), _run(dec, model)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_a_step_past_the_capacity_is_refused(bundles):
    dec, model = _decoder(bundles[("qwen3_moe", "bf16")], "stacked")
    dec.reset()
    dec.state.pos = dec.capacity
    with pytest.raises(ValueError, match="holds 64 positions"):
        dec.step(1)


def test_a_capture_holds_the_garbage_collector_off(monkeypatch):
    """``capture_graph``: no collection runs while a stream captures (one that frees a pinned
    buffer or an event of an earlier run aborts the process), and the collector is back on
    after, also when the capture fails; left off if it was off. (CUDA's capture stood in for:
    the ordering is the claim, which needs no GPU.)"""
    import contextlib
    import gc

    from edgerun.engine import graphs

    seen = []

    @contextlib.contextmanager
    def capturing(g, pool=None, stream=None):
        yield

    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "graph", capturing)
    monkeypatch.setattr(graphs, "side_stream", lambda device: None)
    assert gc.isenabled()
    graphs.capture_graph(lambda: seen.append(gc.isenabled()), torch.device("cpu"))
    assert seen == [False] and gc.isenabled()

    def fails():
        raise RuntimeError("capture failed")

    with pytest.raises(RuntimeError, match="capture failed"):
        graphs.capture_graph(fails, torch.device("cpu"))
    assert gc.isenabled()
    gc.disable()
    try:
        graphs.capture_graph(lambda: None, torch.device("cpu"))
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_the_probe_cases_include_each_delta_in_proj_with_its_conv(bundles):
    """``gemv_cases`` names a DeltaNet model's in_proj at its own rows with the conv epilogue
    (the dense probe checks the conv in its launch there); a model without DeltaNet layers has
    no such case."""
    for arch in ARCHS:
        model, args, _ = load_bundle_model(bundles[(arch, "int4")], dtype=torch.float32)
        conv = [c for c in model.gemv_cases() if c[4] == "conv"]
        deltas = [m.linear_attn.in_proj for m in model.model.layers if hasattr(m, "linear_attn")]
        want = {(m.scheme, m.out_features, m.in_features, m.group) for m in deltas}
        assert {c[:4] for c in conv} == want and (not want or len(conv) == len(want))
        assert all(c[5] == ("unit" if args.norm_unit_offset else "plain") for c in conv)
