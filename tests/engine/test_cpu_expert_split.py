"""CPU experts (edgerun/engine/cpu_experts.py) on the CPU, both halves on CPU tensors: a far
layer's step split between the "GPU" kernels (the reference over device slots + far tier) and the
CPU kernels over the host tier's rows, against ``moe_experts_ref`` over the same slot table.

Tolerances, as the module docstring states them: with the reference on both halves the split
only regroups each element's fp32 sum of A terms, so it is within 2 (A - 1) 2^-24 sum |terms| of
one pass, and rounded to bf16 once, equal or one bf16 step apart; with the CPU kernels on the CPU
half, within the probe's tolerance of the reference."""

from types import SimpleNamespace

import pytest
import torch

from edgerun.budget.cpu_split import SplitCosts
from edgerun.bundle.layout import expert_block_layout
from edgerun.engine import cpu_experts as C
from edgerun.errors import ConfigError
from edgerun.kernels.moe_cpu import moe_cpu
from edgerun.kernels.moe_reference import FarTier, moe_experts_ref, random_pool
from edgerun.kernels.probe import TOLERANCE
from hf_fixtures import tiny_moe_args

E, Q, A = 8, 3, 4
HELD = {5: 0, 1: 1, 6: 2}  # expert -> device slot


def _layer(quant="int4", group=32, seed=0):
    """A far layer: the host tier holds every expert (row_of[e]), the device slots HELD's."""
    layout = expert_block_layout(tiny_moe_args(64, 32, experts=E, top_k=A), quant, group, "none")
    g = torch.Generator().manual_seed(seed)
    rows, far_scales = random_pool(layout, E, generator=g)
    row_of = torch.randperm(E, generator=g)
    pool = torch.zeros(Q, layout.block_bytes, dtype=torch.uint8)
    for e, s in HELD.items():
        pool[s] = rows[row_of[e]]
    scales = None
    if far_scales is not None:
        dev = torch.ones(Q, 2)
        for e, s in HELD.items():
            dev[s] = far_scales[row_of[e]]
        scales = torch.cat([dev, far_scales])
    table = torch.tensor([HELD.get(e, Q + int(row_of[e])) for e in range(E)])
    return SimpleNamespace(
        layout=layout, rows=rows, far_scales=far_scales, row_of=row_of, pool=pool, scales=scales, table=table
    )


def _step(T, seed):
    g = torch.Generator().manual_seed(100 + seed)
    x = torch.randn(T, 64, generator=g)
    ids = torch.rand(T, E, generator=g).argsort(dim=1)[:, :A]
    weights = torch.rand(T, A, generator=g).softmax(dim=-1)
    return x, ids, weights


def _gpu(L, x, ids, seen=None):
    def run(slots, weights, out_dtype=None):
        if seen is not None:
            seen.append((slots.clone(), weights.clone()))
        return moe_experts_ref(
            x, L.pool, slots, ids, weights, L.layout, L.scales, out_dtype, far=FarTier(L.rows)
        )

    return run


def _cpu_ref(L):
    return lambda x, ids, w: moe_experts_ref(x, L.rows, L.row_of[ids], ids, w, L.layout, L.far_scales)


def _far_experts_mask(ids, chosen):
    return torch.isin(ids, torch.tensor(sorted(chosen), dtype=torch.int64))


@pytest.mark.parametrize("T", [1, 3, 7])
def test_reference_halves_regroup_the_sum_within_the_stated_bound(T):
    L = _layer()
    x, ids, weights = _step(T, T)
    slots = L.table[ids]
    full = moe_experts_ref(x, L.pool, slots, ids, weights, L.layout, L.scales, far=FarTier(L.rows))
    far = sorted(set(ids.flatten().tolist()) - set(HELD))
    on_cpu = _far_experts_mask(ids, far[::2])  # every other far expert on the CPU
    assert on_cpu.any() and (~on_cpu).any()
    got = C.split_experts(x, slots, weights, (ids, weights), on_cpu, _gpu(L, x, ids), _cpu_ref(L))
    terms = torch.zeros_like(full)
    for a in range(A):  # sum over a of |w_a y_a|, each term alone
        w = torch.zeros_like(weights)
        w[:, a] = weights[:, a]
        terms += moe_experts_ref(x, L.pool, slots, ids, w, L.layout, L.scales, far=FarTier(L.rows)).abs()
    assert ((got - full).abs() <= 2 * (A - 1) * 2**-24 * terms).all()
    # rounded once to bf16: equal or adjacent (one step of the last place)
    a, b = got.bfloat16().view(torch.int16).int(), full.bfloat16().view(torch.int16).int()
    assert ((a - b).abs() <= 1).all()


@pytest.mark.parametrize("quant, group", [("int4", 32), ("int8", None)])
@pytest.mark.parametrize("T", [1, 5])
def test_cpu_kernels_half_is_within_the_probe_tolerance(quant, group, T):
    L = _layer(quant, group, seed=T)
    x, ids, weights = _step(T, T)
    slots = L.table[ids]
    full = moe_experts_ref(x, L.pool, slots, ids, weights, L.layout, L.scales, far=FarTier(L.rows))
    on_cpu = torch.tensor([[e not in HELD for e in row] for row in ids.tolist()])  # every far pair
    packed = {}

    def cpu(xc, ic, wc):
        return moe_cpu(
            xc, L.rows, L.row_of[ic], ic, wc, L.layout, L.far_scales, packed, out_dtype=torch.float32
        )

    got = C.split_experts(x, slots, weights, (ids, weights), on_cpu, _gpu(L, x, ids), cpu)
    assert got.dtype == torch.float32
    assert float((got - full).abs().max() / full.abs().max()) < TOLERANCE
    assert set(packed) == {int(L.row_of[e]) for e in ids[on_cpu].tolist()}  # only the CPU pairs' rows


def test_the_gpu_half_reads_no_far_block_for_a_cpu_pair():
    L = _layer()
    x, ids, weights = _step(6, 1)
    slots = L.table[ids]
    on_cpu = torch.tensor([[e not in HELD for e in row] for row in ids.tolist()])
    seen = []
    C.split_experts(x, slots, weights, (ids, weights), on_cpu, _gpu(L, x, ids, seen), _cpu_ref(L), filler=2)
    ((s, w),) = seen
    assert (s[on_cpu] == 2).all() and (w[on_cpu] == 0).all()  # a device slot, weight 0
    assert torch.equal(s[~on_cpu], slots[~on_cpu]) and torch.equal(w[~on_cpu], weights[~on_cpu])
    assert (s < Q).all()  # nothing left for the far tier: every far pair went to the CPU


def test_no_cpu_pair_is_the_gpu_step_bit_for_bit():
    L = _layer()
    x, ids, weights = _step(4, 2)
    slots = L.table[ids]
    none = torch.zeros_like(ids, dtype=torch.bool)

    def cpu(*a):
        raise AssertionError("the CPU half ran with no CPU pair")

    got = C.split_experts(x, slots, weights, (ids, weights), none, _gpu(L, x, ids), cpu)
    assert torch.equal(got, _gpu(L, x, ids)(slots, weights))


def test_cpu_pairs_pads_rows_with_other_cpu_experts_at_weight_zero():
    ids = torch.tensor([[0, 3, 4], [1, 2, 5], [3, 4, 6]])
    w = torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.3, 0.1], [0.7, 0.2, 0.1]])
    on_cpu = torch.isin(ids, torch.tensor([3, 4, 6]))
    rows, ic, wc = C.cpu_pairs(ids, w, on_cpu)
    assert rows.tolist() == [0, 2]  # row 1 has no CPU pair
    assert ic.tolist() == [[3, 4, 6], [3, 4, 6]]  # row 0 padded with 6, each id once a row
    assert torch.equal(wc, torch.stack([torch.stack([w[0, 1], w[0, 2], torch.tensor(0.0)]), w[2]]))
    with pytest.raises(ValueError, match="whole experts|mark experts"):
        half = on_cpu.clone()
        half[2, 0] = False  # expert 3 on the CPU in row 0, on the GPU in row 2
        C.split_experts(torch.zeros(3, 64), ids, w, (ids, w), half, None, None)


class _Cache(SimpleNamespace):
    def count_cpu_pairs(self, layer, n):
        self.counted = getattr(self, "counted", 0) + n


def _cache(L):
    args = SimpleNamespace(num_experts=E, num_experts_per_tok=A, hidden_size=64)
    return _Cache(
        bundle=SimpleNamespace(args=args, layouts={0: L.layout}),
        tier={0: SimpleNamespace(slot_of={e: int(L.row_of[e]) for e in range(E)})},
        tier_mem={0: L.rows},
        slots={0: SimpleNamespace(quota=Q, slot_of=dict(HELD))},
        slot_scales={0: L.scales},
        far={0: FarTier(L.rows)},
    )


def test_layer_step_on_computes_every_far_pair_on_the_cpu_and_counts_them():
    L = _layer()
    cache = _cache(L)
    x, ids, weights = _step(3, 3)
    split = C.CpuExperts(cache, 0, "on", None)
    out = split.step(x, ids, weights, L.table, _gpu(L, x, ids))
    full = moe_experts_ref(x, L.pool, L.table[ids], ids, weights, L.layout, L.scales, far=FarTier(L.rows))
    far_pairs = sum(e not in HELD for e in ids.flatten().tolist())
    assert cache.counted == far_pairs > 0
    assert out.dtype == x.dtype and float((out - full).abs().max() / full.abs().max()) < TOLERANCE


def test_layer_step_auto_follows_the_costs():
    L = _layer()
    x, ids, weights = _step(1, 4)
    far = [e for e in ids[0].tolist() if e not in HELD]
    slow = SplitCosts(far_pair_seconds=1e-6, cpu_expert_seconds=1e-3)
    cache = _cache(L)
    assert C.CpuExperts(cache, 0, "auto", slow).step(x, ids, weights, L.table, _gpu(L, x, ids)) is None
    assert not hasattr(cache, "counted")  # the all-GPU step runs: nothing counted
    even = SplitCosts(far_pair_seconds=1e-4, cpu_expert_seconds=1e-4)
    chosen = C.CpuExperts(cache, 0, "auto", even).choose(ids)
    assert int(chosen.sum()) == len(far) // 2  # the two sides balanced


def test_attach_says_what_it_chose_and_refuses_what_cannot_run():
    L = _layer()
    layer = SimpleNamespace(mlp=SimpleNamespace(experts=SimpleNamespace(split=None)))
    model = SimpleNamespace(model=SimpleNamespace(layers=[layer]))
    cache = _cache(L)
    fast = SplitCosts(far_pair_seconds=1e-3, cpu_expert_seconds=1e-4)
    slow = SplitCosts(far_pair_seconds=1e-5, cpu_expert_seconds=1e-3)
    assert C.attach(model, cache, "auto", lambda i: slow).startswith(
        "CPU experts auto: none, PCIe outruns the CPU"
    )
    assert layer.mlp.experts.split is None and cache.cpu_split == {}
    text = C.attach(model, cache, "auto", lambda i: fast)
    assert "split between CPU and GPU in 1 of 1 far layers" in text
    assert isinstance(layer.mlp.experts.split, C.CpuExperts)
    costly = SplitCosts(far_pair_seconds=1e-4, cpu_expert_seconds=5e-5, cpu_fixed_seconds=1e-3)
    assert "none, the split's fixed cost outweighs" in C.attach(model, _cache(L), "auto", lambda i: costly)
    assert C.attach(model, _cache(L), "off") == "CPU experts off"
    with pytest.raises(ConfigError, match="not one of"):
        C.attach(model, cache, "sometimes")
    with pytest.raises(ConfigError, match="needs a far tier"):
        C.attach(model, SimpleNamespace(far={}), "on")
    assert C.attach(model, SimpleNamespace(far={}), "auto") == ""
    rotated = _cache(L)
    rotated.bundle.layouts[0] = expert_block_layout(
        tiny_moe_args(64, 32, experts=E, top_k=A), "int4", 16, "hadamard"
    )
    with pytest.raises(ConfigError, match="unrotated"):
        C.attach(model, rotated, "on")
    assert "CPU experts off (" in C.attach(model, rotated, "auto")


def test_calibrate_cpu_experts_prints_the_profile_line(cpu_kernel_bundles, capsys):
    from edgerun.tools.calibrate import main

    bundle = next(iter(cpu_kernel_bundles.values()))
    assert main(["cpu-experts", str(bundle), "--experts", "2"]) == 0
    out = capsys.readouterr().out
    assert '"seconds_per_expert"' in out and "cpu_expert_bandwidth: " in out


def test_calibrate_measures_positive_costs_here():
    c = C.calibrate(_cache(_layer()), 0, torch.device("cpu"), repeats=1)
    assert c.far_pair_seconds > 0 and c.cpu_expert_seconds > 0 and c.cpu_fixed_seconds >= 0
    assert c.gpu_seconds == 0
