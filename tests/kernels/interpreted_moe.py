"""The Triton kernels under Triton's CPU interpreter (tiny shapes, every scheme).

Not collected on its own: test_interpret.py runs this file in a child process with
TRITON_INTERPRET=1 set before Triton is imported (Triton reads it at import). Tolerances: the
GEMV path is fp32 throughout, so it differs from the fp32 reference only in summation order
(1e-5 of the output's scale); the GEMM path rounds operands and products to bf16 (probe's 2e-2).
"""

import os

import pytest
import torch
import triton
import triton.language as tl
from moe_cases import (
    FORMATS,
    check_gemv_a8,
    check_gemv_tokens_alone,
    fmt_id,
    layout_for,
    random_step,
    rel_err,
)

from edgerun.bundle.quant import dequantize_block, rotate_groups
from edgerun.kernels import moe_triton as K
from edgerun.kernels.moe_reference import random_pool
from edgerun.kernels.probe import TOLERANCE

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="run by test_interpret.py")


@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
def test_gemv_matches_reference_and_repeats(fmt):
    from edgerun.kernels.moe_reference import moe_experts_ref

    layout = layout_for(fmt)
    args = random_step(layout, 3, 3, 6, torch.Generator().manual_seed(0))  # A = 3: not a power of two
    ref = moe_experts_ref(*args)
    out = K.moe_gemv(*args)
    assert out.dtype == torch.float32 and rel_err(out, ref) < 1e-5
    assert torch.equal(out, K.moe_gemv(*args))
    x, pool, slots, ids, w, _, gs = args
    perm = torch.tensor([2, 0, 1])  # entry order does not matter: experts are summed by ascending id
    assert torch.equal(out, K.moe_gemv(x, pool, slots[:, perm], ids[:, perm], w[:, perm], layout, gs))
    bf = K.moe_gemv(x.bfloat16(), pool, slots, ids, w, layout, gs)
    assert bf.dtype == torch.bfloat16 and rel_err(bf, ref) < TOLERANCE


def test_gemv_takes_x_quantized_to_int8():
    """``xq``: moe_cases.check_gemv_a8; refused for experts it does not fit, naming why."""
    layout = layout_for(("int4", 32, "none"))
    xq = check_gemv_a8(K, layout, 3, 3, 6, torch.Generator().manual_seed(3), "cpu", 1e-5)
    for fmt, why in ((("int4", 16, "none"), "groups of 32"), (("int4", 32, "hadamard"), "rotated")):
        step = random_step(layout_for(fmt), 3, 3, 6, torch.Generator().manual_seed(3))
        with pytest.raises(ValueError, match=why):
            K.moe_gemv(*step, xq=xq)
    args = random_step(layout, 3, 3, 6, torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match=r"xq scales must be \[3, 2\]"):
        K.moe_gemv(*args, xq=(xq[0], xq[1], xq[2][:, :1], xq[3]))


def test_int8_expert_activations_policy_quantizes_x_itself():
    """``moe_experts`` with a policy of int8 activations and no ``xq`` quantizes x itself
    (``quantize_x``): the bits of the GEMV given the reference quantization; ``xq`` with a bf16
    policy is refused by name."""
    from edgerun.kernels.moe import MoeKernelPolicy, moe_experts
    from edgerun.kernels.qlinear_w4a8 import quantize_rows_ref

    layout = layout_for(("int4", 32, "none"))
    args = random_step(layout, 3, 3, 6, torch.Generator().manual_seed(5), x_dtype=torch.bfloat16)
    a8 = MoeKernelPolicy("triton", act="int8")
    out = moe_experts(*args, policy=a8)
    assert torch.equal(out, K.moe_gemv(*args, xq=quantize_rows_ref(args[0])))
    with pytest.raises(
        ValueError, match="xq is x quantized to int8 for int8 expert activations; this policy's are bf16"
    ):
        moe_experts(*args, policy=MoeKernelPolicy("triton"), xq=quantize_rows_ref(args[0]))


@pytest.mark.parametrize("fmt", [("int4", 16, "none"), ("int8", None, "none")], ids=fmt_id)
def test_gemv_tokens_are_their_calls_alone(fmt):
    check_gemv_tokens_alone(K, layout_for(fmt), 4, 3, 5, torch.Generator().manual_seed(7), "cpu")


@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
def test_grouped_matches_reference(fmt):
    from edgerun.kernels.moe_reference import moe_experts_ref

    layout = layout_for(fmt)
    # 40 pairs over 5 experts: runs longer than one tile (block_m 8 below) and padded tiles
    x, pool, slots, ids, w, _, gs = random_step(layout, 20, 2, 5, torch.Generator().manual_seed(1))
    x = x.bfloat16()
    ref = moe_experts_ref(x.float(), pool, slots, ids, w, layout, gs)
    small = K.GroupedConfig(block_m=16, block_n=16, block_k=16)
    out = K.moe_grouped(x, pool, slots, ids, w, layout, gs, config=small)
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) < TOLERANCE
    assert torch.equal(out, K.moe_grouped(x, pool, slots, ids, w, layout, gs, config=small))
    # a token's result does not depend on the other tokens (which tiles it shares) nor on the
    # order the router listed its experts in
    sub = torch.tensor([3, 11, 12])
    assert torch.equal(
        out[sub], K.moe_grouped(x[sub], pool, slots[sub], ids[sub], w[sub], layout, gs, config=small)
    )
    perm = torch.tensor([1, 0])
    flipped = K.moe_grouped(x, pool, slots[:, perm], ids[:, perm], w[:, perm], layout, gs, config=small)
    assert torch.equal(out, flipped)


@pytest.mark.parametrize("part", [None, (2, 5)])
def test_align_kernel_is_the_torch_tiling(part):
    g = torch.Generator().manual_seed(4)
    S, A = 11, 3
    ids = torch.rand(70, S, generator=g).argsort(dim=1)[:, :A]  # 210 pairs: several blocks of 64
    slot_of = torch.randperm(S, generator=g)
    for block_m in (4, 16):
        got = K.align_pairs(ids, slot_of[ids], S, block_m, part)
        want = K.align_pairs_torch(ids, slot_of[ids], S, block_m, part)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    rows, tile_slot = got
    kept = [p for p in range(ids.numel()) if part is None or part[0] <= ids.flatten()[p] <= part[1]]
    assert sorted(r for r in rows.tolist() if r < ids.numel()) == kept  # every kept pair once


@pytest.mark.parametrize("kernel", ["grouped", "gemv"])
def test_in_parts_equals_one_call(kernel):
    """A streamed prompt's experts in ascending-id parts (more distinct experts than slots)
    give the bits of one call, on either kernel: a streamed prompt is its resident prompt."""
    from edgerun.kernels.moe import MoeKernelPolicy, accumulator, moe_experts

    layout = layout_for(("int4", 16, "none"))
    policy = MoeKernelPolicy("triton", gemv_max_tokens=0 if kernel == "grouped" else None)
    x, pool, slots, ids, w, _, gs = random_step(layout, 12, 2, 6, torch.Generator().manual_seed(3))
    x = x.bfloat16()
    want = moe_experts(x, pool, slots, ids, w, layout, gs, policy)
    if kernel == "gemv":
        assert torch.equal(want, K.moe_gemv(x, pool, slots, ids, w, layout, gs))
    acc = accumulator(x, policy)
    for lo, hi in ((0, 1), (2, 2), (3, 5)):
        part = torch.where((ids >= lo) & (ids <= hi), slots, 0)  # other entries: any slot, never read
        acc = moe_experts(x, pool, part, ids, w, layout, gs, policy, acc=acc, expert_range=(lo, hi))
    assert torch.equal(acc.to(x.dtype), want)
    # an entry outside the range is not read: a slot past the pool there changes nothing
    if kernel == "gemv":
        acc2 = accumulator(x, policy)
        for lo, hi in ((0, 1), (2, 2), (3, 5)):
            part = torch.where((ids >= lo) & (ids <= hi), slots, 10**6)
            acc2 = moe_experts(x, pool, part, ids, w, layout, gs, policy, acc=acc2, expert_range=(lo, hi))
        assert torch.equal(acc2, acc)
        with pytest.raises(ValueError, match="expert_range"):
            K.moe_gemv(x, pool, slots, ids, w, layout, gs, acc=acc)


@triton.jit
def _tile_copy(wv, sv, w_off, s_off, out, zero, C: tl.constexpr, R: tl.constexpr, QUANT: tl.constexpr, G: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    for k0 in range(0, C, BLOCK_K):
        t = K._weight_tile(wv + w_off, sv + s_off, rows, k0, rows < R, zero, C, QUANT, G, BLOCK_N, BLOCK_K)
        cols = k0 + tl.arange(0, BLOCK_K)
        tl.store(out + rows[:, None] * C + cols[None, :], t, mask=(rows < R)[:, None] & (cols < C)[None, :])


@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
def test_weight_tile_is_the_exact_dequantization(fmt):
    # Every e4m3 code but NaN (subnormals included), so the bit decoding is checked code by code.
    layout = layout_for(fmt)
    plain = layout_for((fmt[0], fmt[1], "none"))
    pool, gs = random_pool(layout, 1, generator=torch.Generator().manual_seed(2))
    if layout.quant == "int4":
        for proj in ("gate_up", "down"):
            c = layout.component(f"{proj}.scales")
            pool[:, c.offset : c.offset + c.nbytes] = (torch.arange(c.nbytes) % 0x7F).to(torch.uint8)
    want = dequantize_block(plain, pool[0], None if gs is None else gs[0], dtype=torch.bfloat16)
    wv, sv = K._views(pool, layout)
    for i, proj in enumerate(("gate_up", "down")):
        R, C = want[i].shape
        _, _, w_off, s_off = K._component_args(layout, proj, wv, sv)
        got = torch.zeros(R, C, dtype=torch.bfloat16)
        G = layout.group_size
        _tile_copy[(triton.cdiv(R, 16),)](
            wv, sv, w_off, s_off, got, 0, C=C, R=R, QUANT=K.QUANT_CODE[layout.quant], G=G, BLOCK_N=16,
            BLOCK_K=max(16, G),
        )  # fmt: skip
        if layout.quant == "int4":  # the global scale is applied after the dot
            got = (got.float() * gs[0, i]).bfloat16()
        elif layout.quant == "int8" and G == 0:  # so is an int8 row scale
            rs = pool[0, layout.component(f"{proj}.scales").offset :].view(torch.float32)[:R]
            got = (got.float() * rs[:, None]).bfloat16()
        # int4 and bf16 values are bf16-exact; int8 is rounded once where the reference rounds
        # (per group; per row the reference rounds q * scale, here q is exact and scaled later)
        if layout.quant == "int8" and G == 0:
            torch.testing.assert_close(got, want[i], rtol=2**-8, atol=0)
        else:
            assert torch.equal(got, want[i]), proj


@pytest.mark.parametrize("g", [16, 32])
def test_rotation_kernel_is_the_bundle_rotation(g):
    v = torch.randn(3, 512)
    got = K.rotate_activations(v.bfloat16(), g)
    torch.testing.assert_close(got, rotate_groups(v.bfloat16(), g), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "fmt", [("int4", 16, "none"), ("int8", None, "none"), ("bf16", None, "none")], ids=fmt_id
)
def test_far_tier_reads_the_same_bits_as_one_pool(fmt):
    """Slots from S on live in another allocation (the pinned host tier a discrete GPU reads in
    place): the kernels read the same blocks, so the same bits come out as from one pool holding
    them all, and every (token, expert) pair served from the far tier is counted (and, in
    decode, every pair by its expert)."""
    from edgerun.kernels.moe_reference import FarTier, moe_experts_ref

    layout = layout_for(fmt)
    gen = torch.Generator().manual_seed(7)
    x, pool, slots, ids, w, _, gs = random_step(layout, 6, 2, 8, gen)
    S = 3  # slots 0-2 on the "device", 3-7 in the far tier
    near, rows = pool[:S].clone(), pool[S:].clone()
    reads, uses = torch.zeros(1, dtype=torch.int64), torch.zeros(8, dtype=torch.int32)
    far = FarTier(rows, reads, uses)
    far_pairs = int((slots >= S).sum())
    assert 0 < far_pairs < slots.numel()
    assert torch.equal(
        K.moe_gemv(x, near, slots, ids, w, layout, gs, far=far),
        K.moe_gemv(x, pool, slots, ids, w, layout, gs),
    )
    assert int(reads) == far_pairs
    assert torch.equal(uses, torch.bincount(ids.flatten(), minlength=8).int())  # every pair, by expert
    table = torch.empty(8, dtype=torch.int64)
    table[ids.flatten()] = slots.flatten()
    got = K.moe_gemv(x, near, slots, ids, w, layout, gs, table=table, far=far)
    assert torch.equal(got, K.moe_gemv(x, pool, slots, ids, w, layout, gs))
    small = K.GroupedConfig(block_m=16, block_n=16, block_k=16)
    reads.zero_()
    xb = x.bfloat16()
    want = K.moe_grouped(xb, pool, slots, ids, w, layout, gs, config=small)
    assert torch.equal(K.moe_grouped(xb, near, slots, ids, w, layout, gs, config=small, far=far), want)
    assert int(reads) == far_pairs
    ref = moe_experts_ref(x, near, slots, ids, w, layout, gs, far=FarTier(rows))
    assert torch.equal(ref, moe_experts_ref(x, pool, slots, ids, w, layout, gs))


@pytest.mark.parametrize("scheme", ["int4", "int8", "plain"])
@pytest.mark.parametrize("fmt", [("int4", 16, "none"), ("bf16", None, "none")], ids=fmt_id)
def test_shared_down_in_the_gate_up_launch_is_its_own_launch(fmt, scheme):
    """The shared expert's down projection in the gate_up launch (``shared_down``, one token):
    its output and the residual after the step equal, bit for bit, qgemv's own launch of it on
    the same tile (its gated epilogue) followed by the two expert launches, twice; its programs
    fill part of a row of the grid (the rest do nothing) and leave the experts' h alone."""
    from edgerun.kernels.qlinear_reference import random_qweight
    from edgerun.kernels.qlinear_triton import qgemv

    layout = layout_for(fmt)
    gen = torch.Generator().manual_seed(11)
    x, pool, slots, ids, w, _, gs = random_step(layout, 1, 2, 6, gen, x_dtype=torch.bfloat16)
    D = x.shape[1]
    down = random_qweight(scheme, D, 48, 16, gen, dtype=torch.bfloat16)
    tile = K.shared_down_tile(down)  # MANY's tile at the launch's 2 warps
    assert tile is not None and tile.num_warps == 2 and K.folds_shared_down(down, tile)
    mid = torch.randn(1, 48, generator=gen).bfloat16()
    logit = torch.randn(1, 1, generator=gen).bfloat16()
    resid = torch.randn(1, D, generator=gen).bfloat16()
    want_shared = qgemv(mid, down, None, "gated", torch.empty(1, D, dtype=torch.bfloat16), logit, config=tile)
    want = K.moe_gemv(x, pool, slots, ids, w, layout, gs, into=(resid.clone(), want_shared))
    for _ in range(2):
        shared = torch.full((1, D), float("nan"), dtype=torch.bfloat16)
        got = K.moe_gemv(x, pool, slots, ids, w, layout, gs, into=(resid.clone(), shared),
                         shared_down=(down, mid, logit, tile))  # fmt: skip
        assert torch.equal(shared, want_shared) and torch.equal(got, want)


def test_shared_down_refusals_name_what_does_not_fit():
    """Two tokens, no shared output, a tile of other warps, a mid of another width: refused."""
    from edgerun.kernels.qlinear_reference import random_qweight
    from edgerun.kernels.qlinear_triton import FEW, MANY

    layout = layout_for(("int4", 16, "none"))
    gen = torch.Generator().manual_seed(12)
    x, pool, slots, ids, w, _, gs = random_step(layout, 2, 2, 6, gen, x_dtype=torch.bfloat16)
    D = x.shape[1]
    down = random_qweight("int4", D, 48, 16, gen, dtype=torch.bfloat16)
    mid, logit = torch.randn(1, 48).bfloat16(), torch.randn(1, 1).bfloat16()
    resid, shared = torch.randn(2, D).bfloat16(), torch.zeros(2, D, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="one token"):
        K.moe_gemv(
            x,
            pool,
            slots,
            ids,
            w,
            layout,
            gs,
            into=(resid, shared),
            shared_down=(down, mid, logit, MANY["int4"]),
        )
    one = (x[:1], pool, slots[:1], ids[:1], w[:1], layout, gs)
    with pytest.raises(ValueError, match="one token"):
        K.moe_gemv(*one, into=(resid[:1], None), shared_down=(down, mid, logit, MANY["int4"]))
    assert not K.folds_shared_down(down, FEW["int4"])  # 4 warps
    with pytest.raises(ValueError, match="warps"):
        K.moe_gemv(*one, into=(resid[:1], shared[:1]), shared_down=(down, mid, logit, FEW["int4"]))
    with pytest.raises(ValueError, match="columns"):
        K.moe_gemv(*one, into=(resid[:1], shared[:1]), shared_down=(down, mid[:, :32], logit, MANY["int4"]))


@pytest.mark.parametrize(
    "fmt, T, extra",
    [
        (("int4", 32, "none"), 1, "shared_xq"),
        (("int4", 16, "hadamard"), 3, "far"),
        (("bf16", None, "none"), 2, ""),
    ],
    ids=["int4-1-shared-xq", "int4-rot-3-far", "bf16-2"],
)
def test_gemv_routes_the_router_logits_itself(fmt, T, extra, monkeypatch):
    """``route``: the gate_up launch routes the router's logits (a pair's programs pick its
    expert, one program a token stores the token's ids and weights) and the down launch reads
    them once that program says they are stored (``DOWN_READY``), or after its wait; the picks
    on int64 or (``PICK32``) int32 keys; the slot table (a permutation) looked up after the pick or
    (``EARLY_PARAMS``) read before the wait. The ids,
    weights and output equal router_topk's launch followed by the call on its ids, bit for bit
    (ties among the logits, the softmax's renormalisation, a rotation, the shared down and int8 x
    in the launch, a far tier's counts), either way, repeated; every arrival counter and ready
    flag is back at 0 after each call (each down program takes one off its token's flag)."""
    from edgerun.kernels import launch
    from edgerun.kernels.decode_triton import router_topk
    from edgerun.kernels.moe_reference import FarTier, RouterLogits
    from edgerun.kernels.qlinear_w4a8 import quantize_x
    from edgerun.kernels.scratch import counters

    layout = layout_for(fmt)
    gen = torch.Generator().manual_seed(13)
    E, A = 16, 8
    x, pool, _, _, _, _, gs = random_step(layout, T, A, E, gen, x_dtype=torch.bfloat16)
    D = x.shape[1]
    table = torch.randperm(E, generator=gen)
    logits = torch.randn(T, E + 1, generator=gen).bfloat16()
    logits[0, 3] = logits[0, 11] = logits[0, :E].max() + 1  # a tie at the top: the lower id first
    resid = torch.randn(T, D, generator=gen).bfloat16()
    want_w, want_ids = torch.empty(T, A, dtype=torch.bfloat16), torch.empty(T, A, dtype=torch.int64)
    router_topk(logits, E, A, True, want_w, want_ids)
    assert want_ids[0, 0] == 3 and want_ids[0, 1] == 11
    kw, far_args = {}, None
    if extra == "shared_xq":
        from edgerun.kernels.qlinear_reference import random_qweight

        down = random_qweight("int4", D, 48, 16, gen, dtype=torch.bfloat16)
        mid = torch.randn(1, 48, generator=gen).bfloat16()
        kw = dict(xq=quantize_x(x))
        shared_down = (down, mid, logits[:, E:], K.shared_down_tile(down))
    if extra == "far":
        near, rows = pool[:5].clone(), pool[5:].clone()
        far_args = (near, rows)

    def run(route):
        ids = torch.full((T, A), -1, dtype=torch.int64) if route else want_ids.clone()
        w = torch.full((T, A), float("nan"), dtype=torch.bfloat16) if route else want_w.clone()
        r = RouterLogits(logits, E, True) if route else None
        shared = torch.zeros(T, D, dtype=torch.bfloat16)
        call = dict(kw, table=table, into=(resid.clone(), shared), route=r)
        if extra == "shared_xq":
            call["shared_down"] = shared_down
        p = pool
        if far_args is not None:
            uses = torch.zeros(E, dtype=torch.int32)
            call["far"] = FarTier(far_args[1], torch.zeros(1, dtype=torch.int64), uses)
            p = far_args[0]
        out = K.moe_gemv(x, p, table[ids.clamp(min=0)], ids, w, layout, gs, **call)
        counted = call["far"].uses.clone() if far_args is not None else None
        return out, ids, w, shared, counted

    want = run(False)
    # EARLY_PARAMS: the slot table read before the wait, a pick's slot taken from its registers
    for ready, pick32, early in (
        (True, False, False),
        (False, False, False),
        (True, True, False),
        (True, True, True),
    ):
        monkeypatch.setattr(K, "DOWN_READY", ready)
        monkeypatch.setattr(K, "PICK32", pick32)  # int32 keys where the logits are bf16 (here: all)
        monkeypatch.setattr(launch, "EARLY_PARAMS", early)
        got = run(True)
        assert torch.equal(got[1], want_ids) and torch.equal(got[2], want_w)
        assert all(torch.equal(g, h) for g, h in zip(got[:4], want[:4]))
        if far_args is not None:
            assert torch.equal(got[4], want[4]) and int(got[4].sum()) == T * A
        assert not counters(x.device, 1).any(), "a ready flag or arrival counter left set"


def test_a_down_launch_that_fails_leaves_no_ready_flag(monkeypatch):
    """The gate_up launch has set its tokens' ready flags when the down launch fails (here: it
    raises at the launch): the call raises, the flags go back to 0 (else the next call's down
    programs would find them set before their gate_up launch routed, and read stale ids), and
    the next call gives router_topk + the step's bits."""
    from edgerun.kernels.decode_triton import router_topk
    from edgerun.kernels.moe_reference import RouterLogits
    from edgerun.kernels.scratch import counters

    layout = layout_for(("bf16", None, "none"))
    gen = torch.Generator().manual_seed(5)
    T, E, A = 2, 16, 8
    x, pool, _, _, _, _, gs = random_step(layout, T, A, E, gen, x_dtype=torch.bfloat16)
    table = torch.randperm(E, generator=gen)
    logits = torch.randn(T, E, generator=gen).bfloat16()
    want_w, want_ids = torch.empty(T, A, dtype=torch.bfloat16), torch.empty(T, A, dtype=torch.int64)
    router_topk(logits, E, A, True, want_w, want_ids)
    want = K.moe_gemv(x, pool, table[want_ids], want_ids.clone(), want_w.clone(), layout, gs, table=table)

    def routed():
        ids, w = torch.full((T, A), -1, dtype=torch.int64), torch.zeros(T, A, dtype=torch.bfloat16)
        return K.moe_gemv(x, pool, table[ids.clamp(min=0)], ids, w, layout, gs, table=table,
                          route=RouterLogits(logits, E, True))  # fmt: skip

    class Failing:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise RuntimeError("the down launch failed")

            return launch

    real = K._down_kernel
    monkeypatch.setattr(K, "_down_kernel", Failing())
    with pytest.raises(RuntimeError, match="down launch failed"):
        routed()
    assert not counters(x.device, 1).any(), "a ready flag left set by a failed call"
    monkeypatch.setattr(K, "_down_kernel", real)
    assert torch.equal(routed(), want)


def test_gemv_route_refusals_name_what_does_not_fit():
    """route without a table, with expert_range, with ids not contiguous, with another expert
    count than the table's, with logits of other rows: refused, naming it."""
    from edgerun.kernels.moe_reference import RouterLogits

    layout = layout_for(("int4", 32, "none"))
    gen = torch.Generator().manual_seed(2)
    x, pool, slots, ids, w, _, gs = random_step(layout, 2, 2, 6, gen)
    table = torch.arange(6)
    route = RouterLogits(torch.randn(2, 7), 6, True)
    cases = [
        (dict(route=route), "needs a slot table"),
        (dict(route=route, table=table, expert_range=(0, 5), acc=torch.zeros(2, x.shape[1])), "table"),
        (dict(route=RouterLogits(torch.randn(2, 9), 8, True), table=table), "8 experts, the slot table"),
        (dict(route=RouterLogits(torch.randn(3, 7), 6, True), table=table), r"\[T=2, E \+ X\]"),
    ]
    for kw, why in cases:
        with pytest.raises(ValueError, match=why):
            K.moe_gemv(x, pool, slots, ids, w, layout, gs, **kw)
    with pytest.raises(ValueError, match="contiguous"):
        K.moe_gemv(x, pool, slots, ids.t().contiguous().t(), w, layout, gs, route=route, table=table)
