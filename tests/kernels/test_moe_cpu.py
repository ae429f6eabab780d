"""The CPU expert kernels (kernels/moe_cpu.py) against the reference: the repacked int4 weights
are torch's own layout and exactly the reference's weights (bit for bit), the step agrees with
``moe_experts_ref`` within the probe's tolerance, a row's result does not depend on its batch,
parts add up to one call bit for bit, and the probe refuses what the kernels cannot run."""

import pytest
import torch
from moe_cases import FORMATS, fmt_id, layout_for, random_step, rel_err

from edgerun.bundle.quant import dequantize_block, unpack_int4
from edgerun.kernels import cpu_layout, moe_cpu
from edgerun.kernels.moe import MoeKernelPolicy, accumulator, moe_experts
from edgerun.kernels.moe_reference import moe_experts_ref, random_pool
from edgerun.kernels.probe import TOLERANCE, probe_cpu

CPU = MoeKernelPolicy(impl="cpu")
SUPPORTED = [f for f in FORMATS if moe_cpu.unsupported(layout_for(f)) is None]


def test_supported_formats():
    assert [fmt_id(f) for f in SUPPORTED] == ["int8", "int4-g32"]
    assert "hadamard-rotated" in moe_cpu.unsupported(layout_for(("int4", 16, "hadamard")))
    assert "groups of (32, 64, 128, 256)" in moe_cpu.unsupported(layout_for(("int4", 16, "none")))
    assert "one scale per row" in moe_cpu.unsupported(layout_for(("int8", 16, "none")))
    assert "multiples of 64" in moe_cpu.unsupported(layout_for(("int8", None, "none"), 48, 24))


@pytest.mark.parametrize("hidden, inter", [(64, 32), (256, 64)])
def test_int4_repack_is_torchs_layout_and_exactly_the_reference_weights(hidden, inter):
    layout = layout_for(("int4", 32, "none"), hidden, inter)
    pool, gscales = random_pool(layout, 3, generator=torch.Generator().manual_seed(1))
    for s in range(3):
        packed = moe_cpu.pack_block(layout, pool[s], gscales[s])
        ref = dequantize_block(layout, pool[s], gscales[s])
        for proj, (w, scales), want in zip(("gate_up", "down"), packed, ref):
            c = layout.component(f"{proj}.weight")
            nibbles = unpack_int4(pool[s, c.offset : c.offset + c.nbytes].view(c.shape)).int() + 8
            assert torch.equal(w, torch.ops.aten._convert_weight_to_int4pack_for_cpu(nibbles, 1))
            # the bf16 scales are exact: through fp32 activations, the identity gives W^T bit for bit
            eye = torch.eye(want.shape[1])
            got = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, w, 32, scales.float())
            assert torch.equal(got, want.t())


@pytest.mark.parametrize("fmt", SUPPORTED, ids=fmt_id)
@pytest.mark.parametrize("T", [1, 3, 9])
def test_cpu_step_matches_the_reference(fmt, T):
    layout = layout_for(fmt)
    gen = torch.Generator().manual_seed(T)
    args = random_step(layout, T, 2, 8, gen)
    packed = {}
    got = moe_experts(*args, policy=CPU, packed=packed)
    ref = moe_experts_ref(*args)
    # x, gate/up, h and the output rounded to bf16 (up to 2^-9 of a value each; int8: the row
    # scales too): about 1% of the output's scale at worst, under the probe's 2%
    assert got.dtype == ref.dtype and rel_err(got, ref) < TOLERANCE
    assert sorted(packed) == sorted(set(args[2].flatten().tolist()))  # each used slot packed once
    assert torch.equal(moe_experts(*args, policy=CPU, packed=packed), got)  # from the kept packs
    # a row is a row: each token alone gives its row of the batch
    x, pool, slots, ids, weights, *rest = args
    for t in range(T):
        one = moe_experts(
            x[t : t + 1], pool, slots[t : t + 1], ids[t : t + 1], weights[t : t + 1], *rest, policy=CPU
        )
        assert torch.equal(one, got[t : t + 1])
    # in parts over ascending expert ranges: the bits of one call
    acc = accumulator(x, CPU)
    for part in ((0, 2), (3, 5), (6, 7)):
        acc = moe_experts(*args, policy=CPU, acc=acc, expert_range=part)
    assert torch.equal(acc.to(x.dtype), got)


@pytest.mark.parametrize("fmt", SUPPORTED, ids=fmt_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_row_is_the_combine_path_bit_for_bit(fmt, dtype):
    """A decode step (one token: ``one_row``, no per-expert loop of gathers and scatters) gives
    the bits of ``combine_experts``'s ascending-id fp32 sum (the path prefill and parts take)."""
    layout = layout_for(fmt)
    gen = torch.Generator().manual_seed(7)
    pool, gscales = random_pool(layout, 12, generator=gen)
    packed = {}
    for _ in range(6):
        x, pool, slots, ids, weights, *rest = random_step(
            layout, 1, 6, 12, gen, x_dtype=dtype, pool=pool, gscales=gscales
        )
        weights = weights.to(dtype)
        got = moe_experts(x, pool, slots, ids, weights, *rest, policy=CPU, packed=packed)
        acc = moe_experts(
            x, pool, slots, ids, weights, *rest, policy=CPU, packed=packed,
            acc=accumulator(x, CPU), expert_range=(0, 11),
        )  # fmt: skip
        assert got.dtype == dtype and torch.equal(got, acc.to(dtype))
    with pytest.raises(ValueError, match="same expert twice"):
        moe_experts(x, pool, slots[:, [0, 0]], ids[:, [0, 0]], weights[:, :2], *rest, policy=CPU)


@pytest.mark.parametrize("fmt", SUPPORTED, ids=fmt_id)
def test_packed_bytes_is_what_a_pack_holds_beyond_the_slot(fmt):
    """cpu_layout.packed_bytes (what the planner and ExpertCache.packed_bytes count) is the bytes
    pack_block allocates: int4 a new layout and scales, int8 views of the slot only."""
    layout = layout_for(fmt, 128, 64)
    pool, gscales = random_pool(layout, 1, generator=torch.Generator().manual_seed(0))
    packed = moe_cpu.pack_block(layout, pool[0], None if gscales is None else gscales[0])
    own = sum(t.nbytes for pair in packed for t in pair if t.untyped_storage().data_ptr() != pool.data_ptr())
    assert cpu_layout.packed_bytes(layout) == own
    assert (own > 0) == (fmt[0] == "int4")


def test_a_refilled_slot_is_repacked_once_its_entry_is_dropped():
    layout = layout_for(("int4", 32, "none"))
    gen = torch.Generator().manual_seed(3)
    pool, gscales = random_pool(layout, 4, generator=gen)
    args = random_step(layout, 1, 2, 4, gen, pool=pool, gscales=gscales, slots=torch.arange(4))
    packed = {}
    before = moe_experts(*args, policy=CPU, packed=packed)
    slot = int(args[2][0, 0])
    pool[slot], gscales[slot] = pool[(slot + 1) % 4], gscales[(slot + 1) % 4]  # another expert's bytes
    assert torch.equal(moe_experts(*args, policy=CPU, packed=packed), before)  # the stale pack
    del packed[slot]  # what ExpertCache._fill does for every slot it refills
    after = moe_experts(*args, policy=CPU, packed=packed)
    assert rel_err(after, moe_experts_ref(*args)) < TOLERANCE and not torch.equal(after, before)


def test_probe_selects_the_cpu_kernels_and_refuses_by_name():
    ok = probe_cpu(layout_for(("int4", 32, "none")), top_k=2)
    assert ok.selected and ok.name == "cpu_int4pack[int4 g32]" and "matched the reference" in ok.reason
    assert probe_cpu(layout_for(("int8", None, "none")), top_k=2).name == "cpu_int8pack[int8]"
    no = probe_cpu(layout_for(("int4", 16, "hadamard")), top_k=2)
    assert not no.selected and "hadamard-rotated" in no.reason


def test_probe_refuses_a_wrong_layout(monkeypatch):
    layout = layout_for(("int4", 32, "none"))
    here = moe_cpu.int4_block_rows()
    assert here in moe_cpu.LAYOUT_BLOCKS  # torch's own converter names this CPU's: 64 (AVX512) or 32
    other = 96 - here  # the other CPU's block: 32 rows where this one's are 64, and the reverse
    monkeypatch.setattr(moe_cpu, "int4_block_rows", lambda: other)
    result = probe_cpu(layout, top_k=2)
    assert not result.selected and "not the one this torch's CPU kernel reads" in result.reason


def test_a_layout_of_neither_block_is_refused_by_name(monkeypatch):
    from edgerun.kernels import qlinear_cpu
    from edgerun.kernels.qlinear_reference import random_qweight

    monkeypatch.setattr(moe_cpu, "int4_block_rows", lambda: None)
    result = probe_cpu(layout_for(("int4", 32, "none")), top_k=2)
    assert not result.selected and "layout of neither 64 nor 32-row blocks" in result.reason
    w = random_qweight("int4", 128, 256, 32, torch.Generator().manual_seed(1))
    assert "layout of neither" in qlinear_cpu.unsupported(w)
    with pytest.raises(RuntimeError, match="layout of neither"):
        moe_cpu.repack_int4(w.weight)
