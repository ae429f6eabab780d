"""The grouped CPU expert kernel (kernels/moe_cpu_grouped.c) against the reference.

Tolerance: the weights are decoded exactly; int4 rows take their activations quantized to 16 bits
per group of 32 (|error| <= absmax / 64516 an element, ~1.5e-5 of the group's scale), with exact
integer group sums and fp32 after that; int8 rows take fp32 activations. Measured: 3-6e-5 of the
output's scale for int4 (two quantized activations in a row: x, then h), ~5e-7 for int8. 2e-4
leaves margin for that and still refuses any real fault (a wrong nibble, scale, slot or order
moves the output by O(1) of its scale). Both the AVX-512 VNNI rows and the portable C rows are
checked. Bits: run to run, 1 vs 2 threads, a token alone or in a batch (also where an expert's
tokens share tiles of its weight rows), and a step in expert-range parts vs one call are all
asserted equal."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from edgerun.bundle.layout import expert_block_layout
from edgerun.engine.policy import KernelPolicy, resolve
from edgerun.kernels import moe_cpu_grouped as grouped
from edgerun.kernels.moe_reference import moe_experts_ref, random_pool
from edgerun.kernels.probe import probe_cpu_grouped

TOL = 2e-4


def case(quant, D, I, T, S=12, A=8, seed=0):
    layout = expert_block_layout(
        SimpleNamespace(hidden_size=D, moe_intermediate_size=I), quant, 32 if quant == "int4" else None
    )
    gen = torch.Generator().manual_seed(seed)
    pool, gscales = random_pool(layout, S, generator=gen)
    x = torch.randn(T, D, generator=gen)
    ids = torch.rand(T, S, generator=gen).argsort(dim=1)[:, :A]
    weights = torch.rand(T, A, generator=gen).softmax(dim=-1)
    slot_of = torch.randperm(S, generator=gen)  # expert e in slot slot_of[e]
    return (x, pool, slot_of[ids], ids, weights, layout, gscales)


def rel_err(out, ref):
    return float((out - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("quant", ["int4", "int8"])
@pytest.mark.parametrize("D, I, T", [(64, 32, 1), (64, 32, 5), (96, 64, 3), (2048, 768, 1)])
@pytest.mark.parametrize("portable", [False, True])
def test_matches_the_reference(quant, D, I, T, portable):
    args = case(quant, D, I, T)
    out = grouped.moe_grouped(*args, portable=portable)
    assert out.dtype == torch.float32 and out.shape == (T, D)
    assert rel_err(out, moe_experts_ref(*args)) < TOL


@pytest.mark.parametrize("quant", ["int4", "int8"])
@pytest.mark.parametrize("portable", [False, True])
def test_bits_do_not_depend_on_threads_runs_or_the_batch(quant, portable):
    args = case(quant, 256, 128, 5)
    one = grouped.moe_grouped(*args, threads=1, portable=portable)
    assert torch.equal(one, grouped.moe_grouped(*args, threads=2, portable=portable))
    assert torch.equal(
        one, grouped.moe_grouped(*args, threads=3, portable=portable)
    )  # more threads than cores
    assert torch.equal(one, grouped.moe_grouped(*args, threads=2, portable=portable))
    x, pool, slots, ids, w, layout, gs = args
    for t in (0, 3):
        alone = grouped.moe_grouped(
            x[t : t + 1], pool, slots[t : t + 1], ids[t : t + 1], w[t : t + 1], layout, gs, portable=portable
        )
        assert torch.equal(alone, one[t : t + 1])


def routed(quant, T, rows, S=12, seed=1):
    """case() with the routing given: rows[t] the experts of token t (expert e in slot S - 1 - e)."""
    x, pool, _, _, _, layout, gs = case(quant, 256, 128, T, S=S, seed=seed)
    ids = torch.tensor(rows)
    w = torch.rand(ids.shape, generator=torch.Generator().manual_seed(seed)).softmax(dim=-1)
    return x, pool, S - 1 - ids, ids, w, layout, gs


def routings():
    """The expert-major path's cases: an expert's tokens run in tiles of 4 (moe_cpu_grouped.c's NT)."""
    gen = torch.Generator().manual_seed(2)
    many = torch.rand(64, 12, generator=gen).argsort(dim=1)[:, :8].tolist()  # ~43 tokens an expert
    same = [[0, 2, 5, 7]] * 7  # every token repeats the same experts: tiles of 4 + 3
    lone = [[0, 1, 2, 3]] * 5 + [[0, 1, 2, 11]]  # expert 11 has one token, in the last tile
    odd = torch.rand(11, 12, generator=gen).argsort(dim=1)[:, :6].tolist()  # T = 11
    return {"many": many, "same": same, "lone": lone, "odd": odd}


@pytest.mark.parametrize("quant", ["int4", "int8"])
@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("name", ["many", "same", "lone", "odd"])
def test_an_experts_tokens_together_give_each_token_its_bits_alone(quant, portable, name):
    """Tokens sharing an expert run in one tile of its weight rows; each token's output is still
    the bits of the token alone (and of any subset of the batch), at 1 and 2 threads."""
    args = routed(quant, len(routings()[name]), routings()[name])
    x, pool, slots, ids, w, layout, gs = args
    batch = grouped.moe_grouped(*args, threads=2, portable=portable)
    assert torch.equal(batch, grouped.moe_grouped(*args, threads=1, portable=portable))
    assert rel_err(batch, moe_experts_ref(*args)) < TOL
    for t in range(x.shape[0]):
        one = slice(t, t + 1)
        alone = grouped.moe_grouped(x[one], pool, slots[one], ids[one], w[one], layout, gs, portable=portable)
        assert torch.equal(alone, batch[one]), f"token {t}"
    odd = torch.arange(1, x.shape[0], 2)  # every other token: other tiles, other neighbours
    part = grouped.moe_grouped(x[odd], pool, slots[odd], ids[odd], w[odd], layout, gs, portable=portable)
    assert torch.equal(part, batch[odd])


def test_expert_parts_of_a_shared_expert_batch_give_the_bits_of_one_call():
    """Prefill in parts (streaming.py): entries outside expert_range are skipped, not tiled."""
    x, pool, slots, ids, w, layout, gs = routed("int4", 11, routings()["odd"])
    whole = grouped.moe_grouped(x, pool, slots, ids, w, layout, gs)
    acc = torch.zeros(x.shape)
    for part in ((0, 2), (3, 8), (9, 11)):
        acc = grouped.moe_grouped(x, pool, slots, ids, w, layout, gs, acc=acc, expert_range=part)
    assert torch.equal(acc, whole)


def test_torch_thread_count_is_taken_per_call():
    args = case("int4", 256, 128, 1)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        a = grouped.moe_grouped(*args)
        torch.set_num_threads(2)
        b = grouped.moe_grouped(*args)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(a, b)


def test_a_step_in_expert_parts_gives_the_bits_of_one_call():
    x, pool, slots, ids, w, layout, gs = case("int4", 64, 32, 4)
    whole = grouped.moe_grouped(x, pool, slots, ids, w, layout, gs)
    acc = torch.zeros(x.shape)
    for part in ((0, 3), (4, 7), (8, 11)):
        acc = grouped.moe_grouped(x, pool, slots, ids, w, layout, gs, acc=acc, expert_range=part)
    assert torch.equal(acc, whole)


def test_out_dtype_and_entry_order():
    x, pool, slots, ids, w, layout, gs = case("int4", 64, 32, 2)
    out = grouped.moe_grouped(x.bfloat16(), pool, slots, ids, w, layout, gs)
    assert out.dtype == torch.bfloat16
    perm = torch.tensor([3, 1, 0, 2, 7, 6, 5, 4])  # the same experts listed in another order
    base = grouped.moe_grouped(x, pool, slots, ids, w, layout, gs)
    assert torch.equal(
        grouped.moe_grouped(x, pool, slots[:, perm], ids[:, perm], w[:, perm], layout, gs), base
    )


def test_bad_inputs_are_refused_by_name():
    x, pool, slots, ids, w, layout, gs = case("int4", 64, 32, 2)
    with pytest.raises(ValueError, match="slot_idx holds slots outside the pool's 0..11"):
        grouped.moe_grouped(x, pool, slots + 12, ids, w, layout, gs)
    with pytest.raises(ValueError, match="slot_idx holds slots outside"):
        grouped.moe_grouped(x, pool, slots - 20, ids, w, layout, gs)
    with pytest.raises(ValueError, match="slot pool must be a contiguous"):
        grouped.moe_grouped(x, torch.cat([pool, pool], dim=1)[:, ::2], slots, ids, w, layout, gs)
    with pytest.raises(ValueError, match="slot pool"):
        grouped.moe_grouped(x, pool.view(torch.int8), slots, ids, w, layout, gs)
    with pytest.raises(ValueError, match="expert_ids must be"):
        grouped.moe_grouped(x, pool, slots, ids.int(), w, layout, gs)
    with pytest.raises(ValueError, match=re.escape("x must be a CPU  tensor of shape [2, 64]")):
        grouped.moe_grouped(x[:, :32], pool, slots, ids, w, layout, gs)
    with pytest.raises(ValueError, match="weights must be"):
        grouped.moe_grouped(x, pool, slots, ids, w[:, :4], layout, gs)
    with pytest.raises(ValueError, match="acc must be a contiguous CPU torch.float32"):
        grouped.moe_grouped(
            x,
            pool,
            slots,
            ids,
            w,
            layout,
            gs,
            acc=torch.zeros(2, 64, dtype=torch.bfloat16),
            expert_range=(0, 5),
        )
    with pytest.raises(ValueError, match="global"):
        grouped.moe_grouped(x, pool, slots, ids, w, layout, gs[:, :1])
    with pytest.raises(ValueError, match="global_scales must be a CPU torch.float32 tensor"):
        grouped.moe_grouped(x, pool, slots, ids, w, layout, gs.to("meta"))  # read by pointer: not on the CPU
    dup = ids.clone()
    dup[0, 1] = dup[0, 0]
    with pytest.raises(ValueError, match="routed to the same expert twice"):
        grouped.moe_grouped(x, pool, slots, dup, w, layout, gs)


def test_unsupported_layouts_are_named():
    def layout(quant, group, rotation="none", D=64, I=32):
        return expert_block_layout(
            SimpleNamespace(hidden_size=D, moe_intermediate_size=I), quant, group, rotation
        )

    assert (
        grouped.unsupported(layout("int4", 32)) is None and grouped.unsupported(layout("int8", None)) is None
    )
    assert "groups of 32, this bundle's are 16" in grouped.unsupported(layout("int4", 16))
    assert "hadamard-rotated" in grouped.unsupported(layout("int4", 32, "hadamard"))
    assert "multiples of 32, these are 64 and 48" in grouped.unsupported(layout("int8", None, I=48))
    assert "bf16" in grouped.unsupported(layout("bf16", None))


def test_one_openmp_runtime_in_the_process():
    """Linked against the libgomp torch bundles: one runtime, one thread pool setting."""
    grouped.library()
    maps = Path("/proc/self/maps").read_text()
    gomps = {line.split()[-1] for line in maps.splitlines() if "libgomp" in line}
    assert len(gomps) == 1, gomps
    if grouped.openmp_runtime() is not None:
        assert gomps == {str(grouped.openmp_runtime().resolve())}


def test_the_build_is_cached_under_the_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    grouped.library.cache_clear()
    try:
        grouped.library()
        built = list((tmp_path / "edgerun" / "kernels").glob("moe_cpu_grouped-*.so"))
        assert len(built) == 1
        mtime = built[0].stat().st_mtime_ns
        grouped.library.cache_clear()
        grouped.library()  # the same key: loaded, not rebuilt
        assert built[0].stat().st_mtime_ns == mtime
    finally:
        grouped.library.cache_clear()


def test_no_compiler_is_a_named_refusal_and_torchs_kernels_run(monkeypatch):
    monkeypatch.setattr(grouped, "compiler", lambda: None)
    grouped.library.cache_clear()
    try:
        layout = case("int4", 64, 32, 1)[5]
        result = probe_cpu_grouped(layout, top_k=2)
        assert not result.selected and result.name == "cpu_grouped[int4 g32]"
        assert result.reason.startswith("BuildError: no C compiler found")
        out = resolve(KernelPolicy(experts="cpu_grouped"), torch.device("cpu"), [layout], top_k=2)
        assert out.moe.impl == "cpu"
        assert out.fallbacks == {
            "expert_kernel_grouped": f"cpu_grouped[int4 g32] not selected: {result.reason}"
        }
    finally:
        grouped.library.cache_clear()


def test_a_compile_error_is_a_named_refusal(monkeypatch, tmp_path):
    bad = tmp_path / "moe_cpu_grouped.c"
    bad.write_text("this is not C\n")
    monkeypatch.setattr(grouped, "SOURCE", bad)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    grouped.library.cache_clear()
    try:
        with pytest.raises(grouped.BuildError, match="failed on moe_cpu_grouped.c"):
            grouped.library()
    finally:
        grouped.library.cache_clear()


@pytest.mark.parametrize("quant", ["int4", "int8"])
@pytest.mark.parametrize("T", [1, 5])
def test_slots_past_the_pool_read_the_far_rows_bits(quant, T):
    """Slots from the pool's S on are rows of another allocation (the cache's spill rows, where a
    miss left unheld is read): the same bits as one pool holding them all, the grouped C kernel
    and torch's CPU kernels alike; a slot past both is refused."""
    from edgerun.kernels import moe_cpu
    from edgerun.kernels.moe_reference import FarTier

    x, pool, slots, ids, w, layout, gs = case(quant, 64, 32, T)
    S = 5  # slots 0-4 in the pool, 5-11 in the far rows
    near, far = pool[:S].clone(), FarTier(pool[S:].clone())
    assert 0 < int((slots >= S).sum()) < slots.numel()
    assert torch.equal(
        grouped.moe_grouped(x, near, slots, ids, w, layout, gs, far=far),
        grouped.moe_grouped(x, pool, slots, ids, w, layout, gs),
    )
    xb = x.bfloat16()
    want = moe_cpu.moe_cpu(xb, pool, slots, ids, w, layout, gs, {})
    assert torch.equal(moe_cpu.moe_cpu(xb, near, slots, ids, w, layout, gs, {}, far=far), want)
    with pytest.raises(ValueError, match="outside the pool's 0..11"):
        grouped.moe_grouped(x, near, slots + 12, ids, w, layout, gs, far=far)
