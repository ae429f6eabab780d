"""The start-up provenance line and the expert-cache summary line: what runs, in words. One
formatter for ``generate``, ``serve`` and the benchmarks."""

from __future__ import annotations

import math
from pathlib import Path

from edgerun.models.inventory import tensor_specs


def cache_line(cache, tokens: int) -> str:
    """The cache's counters; ``tokens``: those that ran through the model (misses/token)."""
    t = cache.totals()
    return (
        f"expert cache: {t.hits} hits, {t.misses} misses ({t.misses / max(tokens, 1):.2f}/token), "
        f"{t.evictions} evictions, "
        + (f"{t.passed} misses left unheld, " if cache.spill_rows else "")
        + f"{t.warm_reads} warm reads, "
        + (f"{t.tier_copies} served from the host tier, " if cache.tier else "")
        + (f"{t.far_reads} read in place from it over PCIe, " if cache.far else "")
        + (f"{t.cpu_pairs} computed from it on the CPU, " if cache.cpu_split else "")
        + f"{t.bytes_read / 2**20:.1f} MiB read "
        f"at {t.read_bandwidth / 1e9:.2f} GB/s"
        + (
            f", prefetch {t.prefetch_issued} issued, {t.prefetch_useful} useful, {t.prefetch_wasted} wasted "
            f"({t.prefetch_bytes / 2**20:.1f} MiB)"
            if cache.prefetch_depth
            else ", prefetch off"
        )
    )


def experts_text(runner) -> str:
    """How the routed experts are held (and any stated adjustment of the cache's settings)."""
    cache = runner.cache
    if cache is None:
        return "experts resident"
    quotas = sorted(set(cache.quotas.values()))
    modes = {r.mode for r in cache.readers.values()}
    backends = {r.backend for r in cache.readers.values()}
    depths = "/".join(str(r.depth) for r in cache.readers.values())
    pieces = "/".join(str(r.pieces) for r in cache.readers.values())
    tier = sorted({t.quota for t in cache.tier.values()})
    far = len(cache.far)
    tier_text = (
        f"pinned host tier {'/'.join(map(str, tier))} ({cache.host_tier_bytes / 2**20:.1f} MiB"
        + (
            f", read in place over PCIe in {far} of {len(cache.tier)} layers: every expert reachable, no misses"
            + (f"; {cache.cpu_split_text}" if cache.cpu_split_text else "")
            if far
            else ", misses copied to device slots"
        )
        + "), "
        if tier
        else ""
    )
    return (
        f"experts streamed (quota {'/'.join(map(str, quotas))} per layer, {cache.slot_policy} eviction, "
        + (f"{cache.spill_rows} spill rows, " if cache.spill_rows else "")
        + f"{cache.pool_kind} slots, {tier_text}"
        f"read {'/'.join(modes)} via {'/'.join(sorted(backends))} depth {depths}, "
        + (f"{pieces} pieces a block, " if any(r.pieces > 1 for r in cache.readers.values()) else "")
        + (
            f"prefetch {cache.prefetch_depth} ahead"
            + (
                f" over the next {cache.prefetch_ahead} layers ({cache.prefetch_share} each), "
                if cache.prefetch_ahead > 1
                else ", "
            )
            if cache.prefetch_depth
            else "prefetch off, "
        )
        + f"cache {cache.footprint_bytes / 2**20:.1f} MiB"
        + (
            f" + {cache.packed_bytes() / 2**20:.1f} MiB packed for the CPU kernels"
            if runner.kernels.moe.impl == "cpu" and cache.packed_bytes()
            else ""
        )
        + "".join(f"; {note}" for note in cache.adjustments)
        + ")"
    )


def provenance(runner, model_dir: Path | None, profile: str | None = None, plan: str | None = None) -> str:
    """What runs, as a few short lines (the first starts ``model``, for the caller to prefix with
    its ``edgerun COMMAND:``; the rest are indented): model and bundle, device, dtype, threads, how experts are held, the kernel policy
    as resolved, every fallback with its reason, what loading did, the architecture's provider,
    and the device profile and the plan when there is one."""
    import torch

    a = runner.args
    # the model's parameters by its tensor inventory: streamed experts and packed int4 bytes
    # would make the modules' own count wrong for a bundle
    n_params = sum(math.prod(spec.shape) for spec in tensor_specs(a))
    dtype = next(runner.model.parameters()).dtype
    fallbacks = "; ".join(f"{k}: {v}" for k, v in runner.fallbacks().items()) or "none"
    lines = [
        f"model {model_dir or 'demo'} ({a.model_type}, {a.num_hidden_layers} layers, "
        f"{a.num_experts} experts top-{a.num_experts_per_tok}, {n_params / 1e6:.1f}M params)",
        f"device {runner.device}, dtype {str(dtype).removeprefix('torch.')}, threads {torch.get_num_threads()}"
        + (f" ({runner.threads_note})" if runner.threads_note else "")
        + (f"; cpu {runner.kernels.cpu}" if runner.kernels.cpu else ""),
        experts_text(runner),
        f"kernels: {runner.kernel_summary()}",
        f"fallbacks: {fallbacks}",
        runner.load_summary,
        "sampling: "
        + (
            "draws on the device, from the logits where they are (in the decode step's graph where it "
            "replays; a speculative request's sampled acceptance on the host)"
            if runner.device.type == "cuda"
            else "on the host"
        ),
        (runner.speculative.describe() + (f"; {runner.window_note}" if runner.window_note else ""))
        if runner.speculative
        else "",
        (
            f"batch: up to {runner.batch.size} requests decode together (multi-row eager steps, "
            f"slots of {runner.batch.max_len} tokens)"
            if runner.batch is not None
            else "batch: one request at a time"
        ),
    ]
    if runner.provider:
        lines.append(runner.provider.describe())
    if profile is not None or plan is not None:
        lines.append(f"device profile {profile or 'none'}" + (f"; {plan}" if plan else ""))
    return "\n  ".join(line for line in lines if line)
