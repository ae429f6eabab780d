"""The router and attention decode kernels on a CUDA device: the real geometries against the
references, bit-for-bit repeats, CUDA-graph replay equal to eager at moving positions, a 32K
context, verify windows equal to their one-row calls, the router GEMV with the shared expert's
gate_up in its launch equal to the two launches, and the probe's cases.

Skipped without CUDA (CI has none); run on the GPU machine before resolving. Tolerances: the
probe's TOLERANCE for the model dtype (kernels/decode_reference.py says why), through
check_router / check_attention (the value row at pos and every other cache row bit for bit,
rows past pos never read: they hold NaN).
"""

import pytest
import torch
from router_cases import router, with_shared
from test_decode_reference import qwen3_30b_args, qwen36_args

from edgerun.kernels.decode_reference import (
    TOLERANCE,
    AttnDims,
    capacity_mismatch,
    check_attention,
    check_router,
    clone_inputs,
    probe_cases,
    random_attention_inputs,
    random_router_inputs,
    run_attention,
    run_router,
    window_mismatch,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (none on this machine)")
DTYPES = [torch.float32, torch.bfloat16]
QWEN36 = AttnDims(16, 2, 256, 64, True)
QWEN3_30B = AttnDims(32, 4, 128, 128, False)


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("E, extra", [(256, 1), (128, 0)])
@pytest.mark.parametrize("N", [1, 7])
def test_router(N, E, extra, dtype, normalize):
    from edgerun.kernels import decode_triton as K

    inputs = random_router_inputs(N, E, 8, extra, gen(E + N), "cuda", dtype, normalize)
    check_router(*run_router(inputs, K.router_topk), TOLERANCE[dtype])


@pytest.mark.parametrize("pos", [0, 3000, 4095])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "dims, unit_offset", [(QWEN36, True), (QWEN3_30B, False)], ids=["qwen3.6", "qwen3-30b"]
)
def test_attention(dims, unit_offset, dtype, pos):
    from edgerun.kernels import decode_triton as K

    inputs = random_attention_inputs(dims, 4096, pos, gen(pos), "cuda", dtype, unit_offset)
    check_attention(*run_attention(inputs, K.attention_decode), TOLERANCE[dtype])


@pytest.mark.parametrize("pos", [0, 5, 31, 100, 2048, 32767])
@pytest.mark.parametrize("dims", [QWEN36, QWEN3_30B], ids=["qwen3.6", "qwen3-30b"])
def test_attention_reading_early_is_the_same_bits(dims, pos, monkeypatch):
    """``ATTN_EARLY`` (the position, the first tile of older keys and values and the output gate
    read before the launches' waits): the output and the caches bit for bit the late reads',
    the launches in one CUDA graph with PDL as in a decode step, the cache then holding the key at
    pos from the step before (its old bits must not be read)."""
    from edgerun.kernels import decode_triton as K

    inputs = random_attention_inputs(dims, 32768, pos, gen(pos), "cuda", torch.bfloat16)
    results = {}
    for early in (False, True):
        monkeypatch.setattr(K, "ATTN_EARLY", early)
        got = clone_inputs(inputs)
        K.attention_decode(**got)  # compiled, then one graph
        got = clone_inputs(inputs)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            K.attention_decode(**got)
        for name in ("k_cache", "v_cache"):
            got[name].copy_(inputs[name])
        graph.replay()
        torch.cuda.synchronize()
        results[early] = (got["out"].clone(), got["k_cache"], got["v_cache"])
    assert all(torch.equal(a, b) for a, b in zip(results[True], results[False], strict=True))


@pytest.mark.parametrize("pos", [20000, 32767])
def test_attention_at_a_32k_context(pos):
    from edgerun.kernels import decode_triton as K

    inputs = random_attention_inputs(QWEN36, 32768, pos, gen(1), "cuda", torch.bfloat16)
    check_attention(*run_attention(inputs, K.attention_decode), TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("pos", [5, 200, 1000, 3000])
def test_attention_bits_do_not_depend_on_the_cache_capacity(pos):
    """A request's static state is sized by its length (256, 512, ... positions): the same
    history at the same position gives the same bits in a cache of any capacity."""
    from edgerun.kernels import decode_triton as K

    caps = [c for c in (256, 1024, 4096, 32768) if c > pos]
    got = capacity_mismatch(K.attention_decode, QWEN36, pos, caps, gen(pos), "cuda", torch.bfloat16)
    assert got is None, got


# 2044..2051: Qwen3.6's split of 32 positions (64 splits) turns 64 at pos 2048, whose first split
# reads the keys of 2044..2047 that other programs of the launch write; 31, 32: a tile boundary
@pytest.mark.parametrize("n, start", [(1, 3000), (2, 31), (5, 100), (8, 2044), (8, 4088)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "dims, unit_offset", [(QWEN36, True), (QWEN3_30B, False)], ids=["qwen3.6", "qwen3-30b"]
)
def test_attention_window_is_its_one_row_calls(dims, unit_offset, dtype, n, start):
    """A verify window of n tokens in one call: each row's output and the caches afterwards are
    those of n one-row calls in order, bit for bit."""
    from edgerun.kernels import decode_triton as K

    got = window_mismatch(K.attention_decode, dims, start, n, 4096, gen(start), "cuda", dtype, unit_offset)
    assert got is None, got


def test_graph_replay_equals_eager():
    from edgerun.kernels import decode_triton as K

    attn = random_attention_inputs(QWEN36, 4096, 0, gen(0), "cuda", torch.bfloat16)
    router = random_router_inputs(1, 256, 8, 1, gen(1), "cuda", torch.bfloat16)
    static = {**clone_inputs(attn), **clone_inputs(router)}
    eager_attn, eager_router = clone_inputs(attn), clone_inputs(router)

    def step(a, r):
        return K.attention_decode(**a), K.router_topk(**r)

    def split(t):
        return {k: t[k] for k in attn}, {k: t[k] for k in router}

    side = torch.cuda.Stream()  # compile outside the capture, on a side stream (torch's recipe)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(*split(clone_inputs(static)))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(*split(static))
    for name in ("k_cache", "v_cache"):  # capture ran nothing; start both from the same caches
        static[name].copy_(attn[name])
    for i, p in enumerate([5, 6, 2000, 4095]):  # the position moves on the device only
        g = gen(10 + i)
        qkv = torch.randn(attn["qkv"].shape, generator=g, device="cuda").bfloat16()
        logits = torch.randn(router["logits"].shape, generator=g, device="cuda").bfloat16()
        static["qkv"].copy_(qkv), static["logits"].copy_(logits), static["pos"].fill_(p)
        eager_attn.update(qkv=qkv, pos=torch.tensor([p], device="cuda"))
        eager_router.update(logits=logits)
        graph.replay()
        step(eager_attn, eager_router)
        for name in ("out", "k_cache", "v_cache"):
            assert torch.equal(static[name], eager_attn[name]), (p, name)
        for name in ("weights_out", "ids_out", "gate_out"):
            assert torch.equal(static[name], eager_router[name]), (p, name)


@pytest.mark.parametrize("scheme", ["int4", "int8", "plain"])
def test_router_gemv_with_the_shared_gate_up_is_each_ones_launch(scheme):
    """Qwen3.6's router (257 x 2048, plain) with the shared expert's gate_up (1024 x 2048) in its
    launch: logits, the normalised x and SiLU(gate) * up each bit for bit the launch it replaces,
    the gate_up's programs normalising x themselves."""
    from edgerun.kernels.qlinear_reference import random_qweight
    from edgerun.kernels.qlinear_triton import pairs

    w, norm = router(256, 1, 2048, torch.bfloat16, seed=3, device="cuda")
    shared = random_qweight(scheme, 1024, 2048, 32, gen(4), "cuda", torch.bfloat16)
    assert pairs(w, shared, 2048)
    for i in range(3):
        x = (torch.randn(1, 2048, generator=gen(30 + i), device="cuda") * 3).bfloat16()
        one, two = with_shared(w, norm, shared, x)
        for name, a, b in zip(("logits", "h", "mid"), one, two, strict=True):
            assert torch.equal(a, b), (i, name)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("args", [qwen36_args, qwen3_30b_args])
def test_probe_cases_on_this_gpu(args, dtype):
    assert probe_cases(args(), "cuda", dtype) < TOLERANCE[dtype]
