"""CPU experts: how many of a step's far experts (read by the GPU in place from the pinned host
tier over PCIe) the CPU computes instead, from host memory, so that both sides finish together.

Plain Python, no torch: the engine calls it each split step with calibrated costs
(``engine/cpu_experts.py``), the planner with a device profile's estimates (``plan_note``).

The model, per MoE layer and step. The GPU's part takes ``gpu_seconds`` (its device-slot pairs)
plus ``far_pair_seconds`` for each (token, expert) pair it reads over PCIe (the decode kernels
read an expert's block once per pair). The CPU's part, when it has any expert, takes
``cpu_fixed_seconds`` (reading the step's activations back, the sync, the upload and the add)
plus ``cpu_expert_seconds`` per expert and ``cpu_token_seconds`` per further token of that
expert. The two run concurrently, so the step takes the larger; with no CPU expert it takes the
GPU's alone. Experts move to the CPU in descending token count (the most PCIe reads saved per
expert first), ties by ascending id.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

MODES = ("auto", "off", "on")


@dataclass(frozen=True)
class SplitCosts:
    """Seconds per unit of a layer's step (see the module docstring)."""

    far_pair_seconds: float
    cpu_expert_seconds: float
    cpu_token_seconds: float = 0.0
    cpu_fixed_seconds: float = 0.0
    gpu_seconds: float = 0.0

    def __post_init__(self) -> None:
        for name in ("far_pair_seconds", "cpu_expert_seconds"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SplitCosts.{name} must be positive, got {getattr(self, name)!r}")
        for name in ("cpu_token_seconds", "cpu_fixed_seconds", "gpu_seconds"):
            if getattr(self, name) < 0:
                raise ValueError(f"SplitCosts.{name} must be >= 0, got {getattr(self, name)!r}")

    @classmethod
    def from_rates(
        cls, block_bytes: int, pcie_bandwidth: float, cpu_expert_bandwidth: float, **kw: float
    ) -> SplitCosts:
        """A block read over PCIe at ``pcie_bandwidth`` bytes/s, and computed on the CPU at
        ``cpu_expert_bandwidth`` (expert bytes/s for a one-token step)."""
        return cls(block_bytes / pcie_bandwidth, block_bytes / cpu_expert_bandwidth, **kw)


def step_seconds(tokens: list[int], k: int, c: SplitCosts) -> float:
    """The modelled step with the first ``k`` of ``tokens`` (token counts of the far experts, in
    the order experts move) on the CPU."""
    gpu = c.gpu_seconds + c.far_pair_seconds * sum(tokens[k:])
    if k == 0:
        return gpu
    cpu = c.cpu_fixed_seconds + sum(c.cpu_expert_seconds + (n - 1) * c.cpu_token_seconds for n in tokens[:k])
    return max(gpu, cpu)


def cpu_experts(far: Mapping[int, int], costs: SplitCosts) -> list[int]:
    """The far experts (``far``: expert id -> its tokens this step) the CPU computes: the prefix,
    in moving order, whose modelled step is shortest (the fewest on a tie; none when none wins)."""
    if any(n < 1 for n in far.values()):
        raise ValueError(f"a far expert with no token: {dict(far)}")
    order = sorted(far, key=lambda e: (-far[e], e))
    tokens = [far[e] for e in order]
    best = min(range(len(order) + 1), key=lambda k: (step_seconds(tokens, k, costs), k))
    return sorted(order[:best])


def decode_share(top_k: int, num_experts: int, quota: int, costs: SplitCosts) -> tuple[int, int]:
    """(far experts of a one-token step, of them on the CPU), a decode step whose top_k experts
    are spread uniformly over the layer: (1 - quota / E) of them are far."""
    far = round(top_k * (1 - quota / num_experts))
    return far, len(cpu_experts(dict.fromkeys(range(far), 1), costs))


def plan_note(
    top_k: int,
    num_experts: int,
    quotas: tuple[int, ...],
    host_quotas: tuple[int, ...],
    block_bytes: tuple[int, ...],
    pcie_bandwidth: float,
    cpu_expert_bandwidth: float,
) -> str | None:
    """What ``edgerun plan`` says of CPU experts on a discrete profile: None without a far tier
    (no layer's host tier holds every expert)."""
    far = [i for i, h in enumerate(host_quotas) if h >= num_experts]
    if not far:
        return None
    if not cpu_expert_bandwidth:
        return (
            "CPU experts (--cpu-experts auto): the profile has no cpu_expert_bandwidth, so the engine "
            "measures both sides at start-up and chooses there"
        )
    picks = []
    for i in far:
        costs = SplitCosts.from_rates(block_bytes[i], pcie_bandwidth, cpu_expert_bandwidth)
        n_far, n_cpu = decode_share(top_k, num_experts, quotas[i], costs)
        picks.append((n_far, n_cpu))
    n_far, n_cpu = max(picks, key=lambda p: p[1])
    rates = f"CPU {cpu_expert_bandwidth / 1e9:.1f} GB/s of experts, PCIe {pcie_bandwidth / 1e9:.1f} GB/s"
    if n_cpu == 0:
        return (
            f"CPU experts (--cpu-experts auto): none, PCIe outruns the CPU ({rates}); every expert the "
            "device slots lack is read in place over PCIe"
        )
    return (
        f"CPU experts (--cpu-experts auto): {n_cpu} of a decode step's ~{n_far} far experts per layer "
        f"computed on the CPU beside the GPU's PCIe reads ({rates}; the split's fixed cost not counted), "
        "those layers' steps eager; the engine's start-up measurement decides"
    )
