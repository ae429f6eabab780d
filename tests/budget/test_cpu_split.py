"""The CPU-experts choice (edgerun/budget/cpu_split.py): how many of a step's far experts go to
the CPU so that both sides finish together, or none when the GPU's PCIe reads are faster, from
the calibrated costs; and what ``edgerun plan`` says of it."""

import pytest

from edgerun.budget.cpu_split import SplitCosts, cpu_experts, decode_share, plan_note, step_seconds

US = 1e-6


def test_equal_costs_split_the_far_experts_evenly():
    c = SplitCosts(far_pair_seconds=100 * US, cpu_expert_seconds=100 * US)
    assert cpu_experts(dict.fromkeys([3, 9, 12, 40], 1), c) == [3, 9]  # 2 | 2: each side 200 us
    assert cpu_experts(dict.fromkeys([3, 9, 12], 1), c) == [3]  # max(200, 100) beats max(100, 200) on k


def test_a_cpu_slower_than_pcie_takes_none_or_what_balances():
    c = SplitCosts(far_pair_seconds=30 * US, cpu_expert_seconds=120 * US)
    # 6 far experts: none takes 180 us, one on the CPU max(150, 120) = 150: a slower CPU still helps
    assert cpu_experts(dict.fromkeys(range(6), 1), c) == [0]
    assert cpu_experts({7: 1}, c) == []  # one far expert: 30 us on the GPU against 120 on the CPU


def test_the_fixed_cost_of_splitting_can_make_none_best():
    c = SplitCosts(far_pair_seconds=100 * US, cpu_expert_seconds=80 * US, cpu_fixed_seconds=50 * US)
    assert cpu_experts({5: 1}, c) == []  # 130 us on the CPU against 100 on the GPU
    assert cpu_experts(dict.fromkeys(range(4), 1), c) == [
        0,
        1,
    ]  # max(200, 210) against 300 (k 1) and 290 (k 3)
    assert step_seconds([1, 1, 1, 1], 2, c) == pytest.approx(210 * US)
    assert step_seconds([1, 1, 1, 1], 1, c) == pytest.approx(300 * US)


def test_experts_with_more_tokens_move_first_and_their_tokens_cost():
    c = SplitCosts(far_pair_seconds=100 * US, cpu_expert_seconds=100 * US, cpu_token_seconds=10 * US)
    far = {2: 1, 8: 3, 5: 3, 1: 1}  # 8 pairs on the GPU: 800 us
    # moving order 5, 8 (3 tokens, by id), then 1, 2: k = 2 -> max(200, 240) = 240
    assert cpu_experts(far, c) == [5, 8]
    assert step_seconds([3, 3, 1, 1], 2, c) == pytest.approx(240 * US)
    assert cpu_experts({}, c) == []


def test_the_gpus_own_part_counts_against_its_side():
    busy = SplitCosts(far_pair_seconds=100 * US, cpu_expert_seconds=100 * US, gpu_seconds=400 * US)
    assert cpu_experts(dict.fromkeys(range(4), 1), busy) == [0, 1, 2, 3]  # GPU 400 vs CPU 400


def test_bad_costs_and_steps_are_refused_by_name():
    with pytest.raises(ValueError, match="far_pair_seconds must be positive"):
        SplitCosts(far_pair_seconds=0, cpu_expert_seconds=1)
    with pytest.raises(ValueError, match="cpu_fixed_seconds must be >= 0"):
        SplitCosts(far_pair_seconds=1, cpu_expert_seconds=1, cpu_fixed_seconds=-1)
    with pytest.raises(ValueError, match="a far expert with no token"):
        cpu_experts({3: 0}, SplitCosts(1, 1))


def test_rates_become_seconds_per_block():
    c = SplitCosts.from_rates(1_600_000, 50e9, 20e9)
    assert c.far_pair_seconds == pytest.approx(32 * US) and c.cpu_expert_seconds == pytest.approx(80 * US)


def test_decode_share_and_the_plan_note():
    fast_pcie = SplitCosts.from_rates(1_600_000, 50e9, 10e9)
    assert decode_share(8, 256, 64, fast_pcie) == (6, 1)  # 6 far: 5 x 32 us vs 160 us on the CPU
    assert decode_share(8, 256, 256, fast_pcie) == (0, 0)
    blocks, q = (1_600_000,) * 2, (64, 64)
    assert plan_note(8, 256, q, (), blocks, 50e9, 10e9) is None  # no host tier
    assert plan_note(8, 256, q, (128, 128), blocks, 50e9, 10e9) is None  # not every expert: no far tier
    note = plan_note(8, 256, q, (256, 256), blocks, 50e9, 1e9)
    assert "none, PCIe outruns the CPU (CPU 1.0 GB/s of experts, PCIe 50.0 GB/s)" in note
    note = plan_note(8, 256, q, (256, 256), blocks, 8e9, 30e9)
    assert "5 of a decode step's ~6 far experts per layer computed on the CPU" in note
    assert "no cpu_expert_bandwidth" in plan_note(8, 256, q, (256, 256), blocks, 50e9, 0)
