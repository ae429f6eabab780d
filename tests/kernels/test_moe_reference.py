"""The slot-pool reference is the resident model's expert combine, bit for bit; the policy's
reference path is that reference; the probe refuses without CUDA and says why. CPU only."""

import json
import os
import subprocess
import sys

import pytest
import torch
from moe_cases import FORMATS, fmt_id, layout_for, random_step

from edgerun.bundle.quant import dequantize_block, quantize_expert
from edgerun.errors import ConfigError
from edgerun.kernels.moe import MoeKernelPolicy, moe_experts
from edgerun.kernels.moe_reference import (
    combine_experts,
    expert_ffn,
    layout_dims,
    moe_experts_ref,
    random_pool,
)
from edgerun.kernels.probe import probe


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
def test_reference_equals_dequantize_and_combine(fmt, x_dtype):
    layout = layout_for(fmt)
    D, I = layout_dims(layout)
    E, S, T, A = 6, 9, 5, 3
    g = torch.Generator().manual_seed(0)
    # E experts quantized as convert writes them, placed in shuffled slots of a larger pool
    slot_of = torch.randperm(S, generator=g)[:E]
    pool, gscales = random_pool(layout, S, generator=g)  # the other slots hold other experts
    resident = []
    for e in range(E):
        block, gs = quantize_expert(
            layout, torch.randn(2 * I, D, generator=g), torch.randn(D, I, generator=g)
        )
        pool[slot_of[e]] = block
        if gs is not None:
            gscales[slot_of[e]] = gs
        resident.append(dequantize_block(layout, block, gs, dtype=x_dtype))
    x = torch.randn(T, D, generator=g).to(x_dtype)
    ids = torch.rand(T, E, generator=g).argsort(dim=1)[:, :A]
    weights = torch.rand(T, A, generator=g).softmax(dim=-1)
    got = moe_experts_ref(x, pool, slot_of[ids], ids, weights, layout, gscales)
    want = combine_experts(x, ids, weights, lambda e: resident[e])
    assert got.dtype == x_dtype
    assert torch.equal(got, want)
    assert torch.equal(moe_experts(x, pool, slot_of[ids], ids, weights, layout, gscales), want)


def test_reference_does_not_depend_on_entry_order():
    layout = layout_for(("int4", 32, "none"))
    x, pool, slots, ids, w, _, gs = random_step(layout, 4, 3, 7, torch.Generator().manual_seed(1))
    perm = torch.tensor([2, 0, 1])
    a = moe_experts_ref(x, pool, slots, ids, w, layout, gs)
    b = moe_experts_ref(x, pool, slots[:, perm], ids[:, perm], w[:, perm], layout, gs)
    assert torch.equal(a, b)
    assert (
        moe_experts_ref(x, pool, slots, ids, w, layout, gs, out_dtype=torch.bfloat16).dtype == torch.bfloat16
    )


def test_reference_refusals():
    layout = layout_for(("int4", 32, "none"))
    x, pool, slots, ids, w, _, gs = random_step(layout, 2, 2, 4, torch.Generator().manual_seed(2))
    bad = slots.clone()
    bad[1, :] = bad[0, :].flip(0)  # token 1 now maps each expert to another slot
    ids2 = ids.clone()
    ids2[1] = ids[0]
    with pytest.raises(ValueError, match="two slots"):
        moe_experts_ref(x, pool, bad, ids2, w, layout, gs)
    with pytest.raises(ValueError, match="outside the pool"):
        moe_experts_ref(x, pool, slots + 4, ids, w, layout, gs)
    with pytest.raises(ValueError, match="global scales"):
        moe_experts_ref(x, pool, slots, ids, w, layout, None)
    with pytest.raises(ValueError, match="block_bytes"):
        moe_experts_ref(x, pool[:, :-1], slots, ids, w, layout, gs)
    with pytest.raises(ValueError, match=r"\[T, A\]"):
        moe_experts_ref(x, pool, slots[:, :1], ids, w, layout, gs)


@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
def test_random_pool_holds_valid_blocks(fmt):
    layout = layout_for(fmt)
    pool, gs = random_pool(layout, 3, generator=torch.Generator().manual_seed(3))
    for s in range(3):
        for w in dequantize_block(layout, pool[s], None if gs is None else gs[s]):
            assert torch.isfinite(w).all() and w.abs().max() > 0


def test_policy_validates():
    with pytest.raises(ConfigError, match="expert kernel"):
        MoeKernelPolicy(impl="cuda")
    with pytest.raises(ConfigError, match="gemv_max_tokens"):
        MoeKernelPolicy(gemv_max_tokens=-1)


def test_probe_refuses_without_cuda_and_says_why():
    r = probe(layout_for(("int4", 32, "none")), "cpu")
    assert not r.selected and "CUDA" in r.reason and r.name == "moe_triton[int4 g32]"


def test_import_changes_no_environment_and_defers_triton():
    code = (
        "import os, sys, json; before = dict(os.environ); "
        "import edgerun.kernels.moe, edgerun.kernels.probe, edgerun.kernels.moe_reference; "
        "print(json.dumps([dict(os.environ) == before, 'edgerun.kernels.moe_triton' in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [True, False]


@pytest.mark.parametrize("fmt", [("bf16", None, "none"), ("int4", 16, "hadamard")], ids=fmt_id)
def test_expert_ranges_in_ascending_parts_equal_one_call(fmt):
    """A cache smaller than a chunk's experts runs them in ascending-id batches into one running
    sum; the result must be the one-call result bit for bit (the streaming == resident claim)."""
    from edgerun.kernels.moe import accumulator

    layout = layout_for(fmt)
    x, pool, slots, ids, w, _, gs = random_step(layout, 9, 3, 8, torch.Generator().manual_seed(2))
    want = moe_experts(x, pool, slots, ids, w, layout, gs)
    policy = MoeKernelPolicy()
    for cuts in ([(0, 2), (3, 5), (6, 7)], [(0, 0), (1, 7)], [(0, 7)]):
        acc = accumulator(x, policy)
        for lo, hi in cuts:
            # entries outside the range point at slot 0: the range's call must not read them
            part_slots = torch.where((ids >= lo) & (ids <= hi), slots, 0)
            acc = moe_experts(x, pool, part_slots, ids, w, layout, gs, policy, acc=acc, expert_range=(lo, hi))
        assert torch.equal(acc.to(x.dtype), want), cuts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_expert_output_does_not_depend_on_its_batch(dtype):
    # the ROW_TILE padding's claim: the same token through the same expert gives the same bits
    # whether it runs alone or among 1..9 other tokens (BLAS kernels differ by row remainder)
    g = torch.Generator().manual_seed(5)
    D, I = 64, 32
    gate_up = (torch.randn(2 * I, D, generator=g) / D**0.5).to(dtype)
    down = (torch.randn(D, I, generator=g) / I**0.5).to(dtype)
    rows = torch.randn(10, D, generator=g).to(dtype)
    alone = expert_ffn(rows[:1], gate_up, down)
    for n in range(2, 11):
        assert torch.equal(expert_ffn(rows[:n], gate_up, down)[:1], alone), n
