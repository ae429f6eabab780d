"""The Triton expert kernels on a CUDA device: every scheme against the reference, bit-for-bit
repeats, a token's rows equal to its call alone, exact dequantization, the start-up probe, and a pool past 2^31 bytes.

Skipped without CUDA (CI has none); run on the GPU machine before resolving. Tolerances: the
GEMV path computes in fp32 and differs from the fp32 reference only in summation order (1e-4
of the output's scale covers sums of 2048 terms); bf16 outputs and the bf16 GEMM path use the
probe's TOLERANCE (its docstring says why).
"""

import pytest
import torch
from moe_cases import (
    FORMATS,
    REAL_FORMATS,
    check_gemv_a8,
    check_gemv_tokens_alone,
    fmt_id,
    layout_for,
    random_step,
    rel_err,
)

from edgerun.kernels.moe import GEMV_MAX_TOKENS, MoeKernelPolicy, moe_experts
from edgerun.kernels.moe_reference import moe_experts_ref, random_pool
from edgerun.kernels.probe import TOLERANCE, probe

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (none on this machine)")
REAL = dict(hidden=2048, inter=512)


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def check_gemv(layout, T, A, S, seed):
    from edgerun.kernels import moe_triton as K

    args = random_step(layout, T, A, S, gen(seed), device="cuda")
    ref = moe_experts_ref(*args)
    out = K.moe_gemv(*args)
    assert rel_err(out, ref) < 1e-4
    assert torch.equal(out, K.moe_gemv(*args))
    x, *rest = args
    bf = K.moe_gemv(x.bfloat16(), *rest)
    assert bf.dtype == torch.bfloat16 and rel_err(bf, ref) < TOLERANCE
    assert torch.equal(bf, K.moe_gemv(x.bfloat16(), *rest))


@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
def test_gemv_tiny(fmt, T):
    check_gemv(layout_for(fmt), T, 3, 7, seed=T)


@pytest.mark.parametrize("T", [1, 8])
@pytest.mark.parametrize("fmt", REAL_FORMATS, ids=fmt_id)
def test_gemv_real_geometry(fmt, T):
    check_gemv(layout_for(fmt, **REAL), T, 8, 12, seed=T)


@pytest.mark.parametrize("T", [1, 8])
def test_gemv_int8_activations_real_geometry(T):
    from edgerun.kernels import moe_triton as K

    check_gemv_a8(K, layout_for(("int4", 32, "none"), **REAL), T, 8, 16, gen(T), "cuda", 1e-4)


@pytest.mark.parametrize("fmt", REAL_FORMATS, ids=fmt_id)
def test_grouped_real_geometry(fmt):
    """The grouped GEMM against the reference; a token's bits do not depend on which other tokens
    (how many, in which tiles) run with it, nor on the router's order of its experts."""
    from edgerun.kernels import moe_triton as K

    args = random_step(layout_for(fmt, **REAL), 300, 8, 64, gen(7), device="cuda", x_dtype=torch.bfloat16)
    x, pool, slots, ids, w, layout, gs = args
    ref = moe_experts_ref(x.float(), *args[1:])
    out = K.moe_grouped(*args)
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) < TOLERANCE
    assert torch.equal(out, K.moe_grouped(*args))
    sub = torch.tensor([0, 7, 150, 299], device="cuda")
    assert torch.equal(out[sub], K.moe_grouped(x[sub], pool, slots[sub], ids[sub], w[sub], layout, gs))
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(0)).cuda()
    assert torch.equal(out, K.moe_grouped(x, pool, slots[:, perm], ids[:, perm], w[:, perm], layout, gs))


@pytest.mark.parametrize("kernel", ["grouped", "gemv"])
@pytest.mark.parametrize("fmt", REAL_FORMATS[2:], ids=fmt_id)
def test_in_expert_ranges_equals_one_call(fmt, kernel):
    """Prefill with more experts than slots: ascending-id parts into one fp32 sum give the bits
    of one call (each token's experts are added in the same order), on either kernel."""
    from edgerun.kernels.moe import accumulator

    policy = MoeKernelPolicy("triton", gemv_max_tokens=0 if kernel == "grouped" else None)
    x, pool, slots, ids, w, layout, gs = random_step(
        layout_for(fmt, **REAL), 24, 8, 16, gen(9), device="cuda", x_dtype=torch.bfloat16
    )
    want = moe_experts(x, pool, slots, ids, w, layout, gs, policy)
    acc = accumulator(x, policy)
    for lo, hi in ((0, 5), (6, 6), (7, 15)):
        part = torch.where((ids >= lo) & (ids <= hi), slots, 0)
        acc = moe_experts(x, pool, part, ids, w, layout, gs, policy, acc=acc, expert_range=(lo, hi))
    assert torch.equal(acc.to(x.dtype), want)


@pytest.mark.parametrize("fmt", REAL_FORMATS, ids=fmt_id)
def test_gemv_tokens_are_their_calls_alone(fmt):
    from edgerun.kernels import moe_triton as K

    check_gemv_tokens_alone(K, layout_for(fmt, **REAL), 8, 8, 24, gen(21), "cuda")


def test_policy_dispatches_to_the_kernels():
    from edgerun.kernels import moe_triton as K

    layout = layout_for(("int4", 32, "none"), **REAL)
    policy = MoeKernelPolicy(impl="triton", gemv_max_tokens=4)
    for T, path in ((4, K.moe_gemv), (5, K.moe_grouped)):
        args = random_step(layout, T, 8, 10, gen(T), device="cuda", x_dtype=torch.bfloat16)
        assert torch.equal(moe_experts(*args, policy=policy), path(*args))
    # by default the format's measured boundary (kernels/moe.GEMV_MAX_TOKENS)
    most = GEMV_MAX_TOKENS["int4"]
    for T, path in ((most, K.moe_gemv), (most + 1, K.moe_grouped)):
        args = random_step(layout, T, 8, 256, gen(T), device="cuda", x_dtype=torch.bfloat16)
        assert torch.equal(moe_experts(*args, policy=MoeKernelPolicy("triton")), path(*args))


@pytest.mark.parametrize("fmt", REAL_FORMATS + [("int8", 64, "hadamard"), ("int4", 16, "none")], ids=fmt_id)
def test_probe_selects_on_this_gpu(fmt):
    r = probe(layout_for(fmt, **REAL), "cuda")
    print(r)
    assert r.selected, r.reason


def test_pool_past_2_31_bytes():
    from edgerun.kernels import moe_triton as K

    layout = layout_for(("int4", 32, "none"), **REAL)
    S = -(-(1 << 31) // layout.block_bytes) + 8  # the last 8 slots start past byte 2^31
    pool = torch.empty(S, layout.block_bytes, dtype=torch.uint8, device="cuda")
    gscales = torch.empty(S, 2, device="cuda")
    top = torch.arange(S - 8, S, device="cuda")
    pool[top], gscales[top] = random_pool(layout, 8, generator=gen(11), device="cuda")
    assert int(top[0]) * layout.block_bytes >= 2**31
    args = random_step(layout, 2, 8, 8, gen(12), device="cuda", pool=pool, gscales=gscales, slots=top)
    ref = moe_experts_ref(*args)
    assert rel_err(K.moe_gemv(*args), ref) < 1e-4
    assert rel_err(K.moe_grouped(*args), ref) < TOLERANCE


@pytest.mark.parametrize("scheme", ["int4", "int8", "plain"])
def test_shared_down_in_the_gate_up_launch_at_the_real_geometry(scheme):
    """Qwen3.6's shared expert down projection (2,048 x 512, its expert-kernel tile) in the
    gate_up launch of a one-token step of Qwen3.6's int4 experts (8 of 16 slots): its output and
    the residual bit for bit its own qgemv launch's followed by the two expert launches, twice."""
    from edgerun.kernels import moe_triton as K
    from edgerun.kernels.qlinear_reference import random_qweight
    from edgerun.kernels.qlinear_triton import qgemv

    layout = layout_for(("int4", 32, "none"), **REAL)
    g = gen(21)
    x, pool, slots, ids, w, _, gs = random_step(layout, 1, 8, 16, g, "cuda", x_dtype=torch.bfloat16)
    down = random_qweight(scheme, 2048, 512, 32, g, "cuda", torch.bfloat16)
    tile = K.shared_down_tile(down)
    assert tile is not None
    mid = torch.randn(1, 512, generator=g, device="cuda").bfloat16()
    logit = torch.randn(1, 1, generator=g, device="cuda").bfloat16()
    resid = torch.randn(1, 2048, generator=g, device="cuda").bfloat16()
    shared = qgemv(mid, down, None, "gated", torch.empty_like(resid), logit, config=tile)
    want = K.moe_gemv(x, pool, slots, ids, w, layout, gs, into=(resid.clone(), shared))
    for _ in range(2):
        got_shared = torch.full_like(resid, float("nan"))
        got = K.moe_gemv(
            x,
            pool,
            slots,
            ids,
            w,
            layout,
            gs,
            into=(resid.clone(), got_shared),
            shared_down=(down, mid, logit, tile),
        )
        assert torch.equal(got_shared, shared) and torch.equal(got, want)


@pytest.mark.parametrize("pick32", [False, True], ids=["int64-keys", "int32-keys"])
@pytest.mark.parametrize("T", [1, 4])
def test_gemv_routes_the_router_logits_at_the_real_geometry(T, pick32, monkeypatch):
    """``route`` at Qwen3.6's router (256 experts, top 8, renormalised) over a slot table: the
    ids, weights and the residual after the step are router_topk's launch followed by the step
    on its ids, bit for bit, the down reading early (``DOWN_READY``), the picks and routing on int64 or
    int32 keys (``PICK32``); twice, the ready flags and arrival counters back at 0 after each."""
    from edgerun.kernels import moe_triton as K
    from edgerun.kernels.scratch import counters

    monkeypatch.setattr(K, "PICK32", pick32)
    from edgerun.kernels.decode_triton import router_topk
    from edgerun.kernels.moe_reference import RouterLogits

    layout = layout_for(("int4", 32, "none"), **REAL)
    g = gen(40 + T)
    x, pool, _, _, _, _, gs = random_step(layout, T, 8, 256, g, device="cuda", x_dtype=torch.bfloat16)
    table = torch.randperm(256, generator=g, device="cuda")
    logits = torch.randn(T, 257, generator=g, device="cuda").bfloat16()
    w = torch.empty(T, 8, dtype=torch.bfloat16, device="cuda")
    ids = torch.empty(T, 8, dtype=torch.long, device="cuda")
    router_topk(logits, 256, 8, True, w, ids)
    resid = torch.randn(T, 2048, generator=g, device="cuda").bfloat16()
    want = K.moe_gemv(x, pool, table[ids], ids, w, layout, gs, table=table, into=(resid.clone(), None))
    route = RouterLogits(logits, 256, True)
    for _ in range(2):
        got_w, got_ids = torch.full_like(w, float("nan")), torch.full_like(ids, -1)
        got = K.moe_gemv(
            x,
            pool,
            table[ids],
            got_ids,
            got_w,
            layout,
            gs,
            table=table,
            into=(resid.clone(), None),
            route=route,
        )
        assert torch.equal(got_ids, ids) and torch.equal(got_w, w) and torch.equal(got, want)
        assert not counters(x.device, 1).any(), "a ready flag or arrival counter left set"
