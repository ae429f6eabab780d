"""CPU experts: a far layer's step (every expert in the pinned host tier, the GPU reading the ones
its device slots lack in place over PCIe) with some far experts computed on the CPU instead, from
the same host memory, by the CPU expert kernels (kernels/moe_cpu.py), concurrently with the GPU.

Shape legend: T = tokens, A = top_k, D = hidden, Tc = tokens with a CPU pair, Ac = their most.

:func:`split_experts` is the step, device-agnostic (CI runs both halves on CPU tensors): the GPU
half is launched first with the CPU pairs masked out (slot pointed at a device slot, router
weight 0, so no far block is read for them; a CUDA launch is asynchronous), then the CPU half
runs, then the two fp32 partial sums are added and the caller rounds once.

Tolerance against the all-GPU path. Both sum the same A router-weighted terms per element in fp32
and round once to the activations' dtype; the split only regroups the sum (G + C instead of one
pass) and computes C's terms with the CPU kernels. Each order of an fp32 sum of A terms is within
(A - 1) * 2^-24 * sum |terms| of the exact sum (the standard bound for recursive summation), so
the two are within twice that of each other, which the final rounding to bf16 (2^-9 relative)
can turn into at most one unit in the last place. The CPU kernels' terms differ from the reference's within their probe's tolerance
(kernels/probe.py: 2e-2 of the output's scale; they round x and h to bf16). So the split's output
is within TOLERANCE * max |ref| + one bf16 ulp of the all-GPU output; with the reference on both
halves (the fp32 test) only the regrouping bound remains (tests/engine/test_cpu_expert_split.py).

:class:`CpuExperts` is one layer's choice and CPU half; ``attach`` gives each far layer one from
the calibration (``budget/cpu_split.py``) and says what it chose.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Callable

import torch

from edgerun.budget.cpu_split import MODES, SplitCosts, cpu_experts, decode_share
from edgerun.errors import ConfigError
from edgerun.kernels.cpu_layout import unsupported
from edgerun.kernels.moe_cpu import moe_cpu


def cpu_pairs(ids: torch.Tensor, weights: torch.Tensor, on_cpu: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The CPU half's rows: (rows int64 [Tc], ids [Tc, Ac], weights [Tc, Ac]) of the tokens with
    a CPU pair (host tensors [T, A] in). A row short of Ac pairs is padded with other CPU experts
    of the step at router weight 0 (their product adds nothing; each is computed anyway)."""
    chosen = sorted(set(ids[on_cpu].tolist()))
    rows, out_ids, out_w = [], [], []
    for t in range(ids.shape[0]):
        mine = on_cpu[t].nonzero().flatten().tolist()
        if mine:
            rows.append(t)
            out_ids.append([int(ids[t, a]) for a in mine])
            out_w.append([weights[t, a] for a in mine])
    width = max((len(r) for r in out_ids), default=0)
    for r, w in zip(out_ids, out_w):
        pad = [e for e in chosen if e not in r][: width - len(r)]
        r += pad
        w += [weights.new_zeros(())] * len(pad)
    W = torch.stack([torch.stack(w) for w in out_w]) if out_w else torch.zeros(0, width, dtype=weights.dtype)
    return (
        torch.tensor(rows, dtype=torch.int64),
        torch.tensor(out_ids, dtype=torch.int64).view(len(rows), width),
        W,
    )


def split_experts(
    x: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    host: tuple[torch.Tensor, torch.Tensor],
    on_cpu: torch.Tensor,
    gpu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    cpu: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    filler: int = 0,
) -> torch.Tensor:
    """One step's routed experts, split: x [T, D], slots and weights [T, A] on x's device; ``host``
    (ids, weights) [T, A] on the host, and ``on_cpu`` bool [T, A] there, the pairs the CPU
    computes (whole experts: every pair of an expert alike). ``gpu(slots, weights)`` -> fp32
    [T, D] (the GPU's kernels over its slots), called with the CPU pairs at slot ``filler`` (a
    device slot) and weight 0; ``cpu(x, ids, weights)`` -> fp32 [Tc, D] for ``cpu_pairs``' rows. Returns the fp32 sum [T, D] on x's device, for the
    caller to round once."""
    ids_h, weights_h = host
    if set(ids_h[on_cpu].tolist()) & set(ids_h[~on_cpu].tolist()):
        raise ValueError("on_cpu must mark experts, every pair of an expert alike (one slot per expert)")
    rows, ids_c, w_c = cpu_pairs(ids_h, weights_h, on_cpu)
    xc = x[rows.to(x.device)].cpu()  # before the GPU half: on one stream it would wait for it
    mask = on_cpu.to(x.device, non_blocking=True)
    out = gpu(slots.masked_fill(mask, filler), weights.masked_fill(mask, 0))
    if rows.numel():
        part = cpu(xc, ids_c, w_c)
        out.index_put_((rows.to(x.device),), part.to(x.device), accumulate=True)  # rows are unique
    return out


class CpuExperts:
    """Layer ``layer``'s CPU experts over its far tier: which of a step's far pairs the CPU
    computes (``mode`` on: every far pair; auto: ``budget.cpu_split.cpu_experts`` under
    ``costs``), and that half on the host tier's rows. Made once every expert is in the tier
    (``ExpertCache.hold_complete_layers``), whose rows a far layer never refills, so the packed
    copies the CPU kernels make of them (``packed``) stay valid."""

    def __init__(self, cache, layer: int, mode: str, costs: SplitCosts | None) -> None:
        if mode == "auto" and costs is None:
            raise ValueError("CpuExperts auto needs calibrated costs")
        self.cache, self.layer, self.mode, self.costs = cache, layer, mode, costs
        E = cache.bundle.args.num_experts
        tier = cache.tier[layer].slot_of
        if len(tier) < E:
            raise ValueError(
                f"layer {layer}: the host tier holds {len(tier)} of {E} experts; read them first"
            )
        self.rows = cache.tier_mem[layer]  # uint8 [E, block_bytes], pinned host memory
        self.row_of = torch.tensor([tier[e] for e in range(E)], dtype=torch.int64)
        Q = cache.slots[layer].quota
        scales = cache.slot_scales[layer]
        self.scales = None if scales is None else scales[Q:].cpu()  # the far rows' global scales
        self.layout = cache.bundle.layouts[layer]
        self.packed: dict = {}

    def choose(self, ids: torch.Tensor) -> torch.Tensor:
        """The pairs of ``ids`` (host [T, A]) the CPU computes: bool [T, A]."""
        held = self.cache.slots[self.layer].slot_of
        far = torch.tensor([[e not in held for e in row] for row in ids.tolist()], dtype=torch.bool)
        if self.mode == "on" or not far.any():
            return far
        chosen = cpu_experts(Counter(ids[far].tolist()), self.costs)
        return torch.isin(ids, torch.tensor(chosen, dtype=torch.int64)) & far

    def compute(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The CPU half: x [Tc, D], ids / weights [Tc, Ac] (host) -> fp32 [Tc, D]."""
        return moe_cpu(
            x, self.rows, self.row_of[ids], ids, weights, self.layout, self.scales, self.packed,
            out_dtype=torch.float32,
        )  # fmt: skip

    def step(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        table: torch.Tensor,
        gpu: Callable[..., torch.Tensor],
    ) -> torch.Tensor | None:
        """The layer's step split per ``choose`` ([T, D] in x's dtype, rounded once), counted in
        the cache's ``cpu_pairs``; None when the CPU takes no pair (the caller runs the all-GPU
        step). ``gpu(slots, weights, out_dtype)`` runs the GPU's kernels over the layer's pools."""
        host = ids.cpu(), weights.cpu()
        on_cpu = self.choose(host[0])
        n = int(on_cpu.sum())
        if not n:
            return None
        self.cache.count_cpu_pairs(self.layer, n)
        slots = table[ids]
        out = split_experts(
            x, slots, weights, host, on_cpu, lambda s, w: gpu(s, w, torch.float32), self.compute
        )
        return out.to(x.dtype)


def calibrate(cache, layer: int, device: torch.device, repeats: int = 5) -> SplitCosts:
    """Layer ``layer``'s costs measured here: the CPU kernels on its layout for a one-token step
    (``CALIBRATION_EXPERTS`` distinct experts, more than a CPU cache holds); a block's PCIe read
    as a pinned host->device copy of top_k of its tier's rows; the split's fixed cost as its
    transfers (routing and activations back, mask and result up) with their syncs. Not counted:
    the GPU's device-slot part (the CPU must beat the PCIe reads alone) and what the layer's
    step loses by leaving its CUDA graph."""
    from edgerun.tools.calibrate import CALIBRATION_EXPERTS, cpu_expert_seconds

    layout, args = cache.bundle.layouts[layer], cache.bundle.args
    k = args.num_experts_per_tok
    per_expert = cpu_expert_seconds(layout, 1, CALIBRATION_EXPERTS, repeats)["seconds_per_expert"]
    rows = cache.tier_mem[layer][:k]
    dst = torch.empty_like(rows, device=device)
    ids, x = (
        torch.zeros(1, k, dtype=torch.int64, device=device),
        torch.zeros(1, args.hidden_size, device=device),
    )
    mask, part = torch.zeros(1, k, dtype=torch.bool), torch.zeros(1, args.hidden_size)

    def timed(fn) -> float:
        fn()  # warm-up
        out = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            out.append(time.perf_counter() - start)
        return statistics.median(out)

    pair = timed(lambda: dst.copy_(rows, non_blocking=True)) / k
    fixed = timed(lambda: (ids.cpu(), x.cpu(), mask.to(device), part.to(device)))
    return SplitCosts(far_pair_seconds=pair, cpu_expert_seconds=per_expert, cpu_fixed_seconds=fixed)


def _why_none(costs: SplitCosts) -> str:
    if costs.cpu_expert_seconds >= costs.far_pair_seconds:
        return "PCIe outruns the CPU"
    return "the split's fixed cost outweighs what the CPU saves"


def attach(model, cache, mode: str, calibrated: Callable[[int], SplitCosts] | None = None) -> str:
    """Give each far layer's ``StreamingExperts`` a :class:`CpuExperts` under ``mode`` (auto: those
    layers whose calibrated decode step moves any expert to the CPU) and return what was chosen,
    for the start-up line. ``calibrated(layer)``: the costs (default :func:`calibrate`)."""
    if mode not in MODES:
        raise ConfigError(f"cpu_experts {mode!r} is not one of {', '.join(MODES)}")
    far = sorted(cache.far)
    if mode == "off":
        return "CPU experts off" if far else ""
    if not far:
        if mode == "on":
            raise ConfigError(
                "--cpu-experts on needs a far tier: a pinned host tier holding every expert of a layer, "
                "read in place (--host-quota = the number of experts, --tier-reads in-place, CUDA)"
            )
        return ""
    why = unsupported(cache.bundle.layouts[far[0]])
    if why:
        if mode == "on":
            raise ConfigError(f"--cpu-experts on: {why}")
        return f"CPU experts off ({why})"
    E, k = cache.bundle.args.num_experts, cache.bundle.args.num_experts_per_tok
    if calibrated is None:  # measured once per block layout (a layer's costs depend on nothing else)
        measured: dict = {}

        def calibrated(layer: int) -> SplitCosts:
            layout = cache.bundle.layouts[layer]
            if layout not in measured:
                measured[layout] = calibrate(cache, layer, torch.device(cache.device))
            return measured[layout]

    chosen, first = {}, None
    for layer in far:
        costs = calibrated(layer) if mode == "auto" else None
        if costs is not None:
            first = first or (layer, costs)
            if not decode_share(k, E, cache.slots[layer].quota, costs)[1]:
                continue
        chosen[layer] = CpuExperts(cache, layer, mode, costs)
        model.model.layers[layer].mlp.experts.split = chosen[layer]
    cache.cpu_split = chosen
    if mode == "on":
        return f"CPU experts on: every far expert of a decode step on the CPU in {len(chosen)} layers (eager steps)"
    layer, c = first
    rates = (
        f" (layer {layer}: CPU {c.cpu_expert_seconds * 1e6:.0f} us an expert, PCIe {c.far_pair_seconds * 1e6:.0f} "
        f"us a block, {c.cpu_fixed_seconds * 1e6:.0f} us to split)"
    )
    if not chosen:
        return f"CPU experts auto: none, {_why_none(c)}{rates}"
    return (
        f"CPU experts auto: decode steps split between CPU and GPU in {len(chosen)} of {len(far)} far layers"
        f"{rates} (eager steps)"
    )
