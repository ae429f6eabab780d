"""A plan as a readable table, or as JSON / YAML for tools (both load back into the same Plan)."""

from __future__ import annotations

import json
import textwrap

import yaml

from edgerun.budget.planner import Plan
from edgerun.bundle.dense_layout import PLAIN
from edgerun.config import format_bytes

FORMATS = ("table", "json", "yaml")


def to_json(plan: Plan) -> str:
    return json.dumps(plan.to_dict(), indent=2) + "\n"


def to_yaml(plan: Plan) -> str:
    return yaml.safe_dump(plan.to_dict(), sort_keys=False, width=100)


def from_json(text: str) -> Plan:
    return Plan.from_dict(json.loads(text))


def from_yaml(text: str) -> Plan:
    return Plan.from_dict(yaml.safe_load(text))


def _rate(r: float | None) -> str:
    return "unbounded" if r is None else f"{r:.1f}"


def _quotas(q: tuple[int, ...], moe_layers: tuple[int, ...]) -> str:
    if not q:
        return "none"
    if len(set(q)) == 1:
        return f"{q[0]} per layer x {len(q)} layers"
    per = " ".join(f"L{i}:{n}" for i, n in zip(moe_layers, q))
    wrapped = textwrap.fill(per, width=96, initial_indent="    ", subsequent_indent="    ")
    return f"{min(q)}..{max(q)} per layer (sum {sum(q)}):\n{wrapped}"


def to_table(plan: Plan) -> str:
    blocks = set(plan.block_bytes)
    block = format_bytes(plan.block_bytes[0]) if len(blocks) == 1 else "per-layer sizes"
    group = f" g{plan.group_size}" if plan.group_size else ""
    out = [
        f"edgerun plan: {plan.model} ({plan.model_type}) on {plan.device}, {plan.memory_kind} memory",
        f"  context {plan.context}, batch {plan.batch}; experts {plan.quant}{group}, {block} per block "
        f"({plan.expert_origin}); dense {plan.dense_dtype}, KV {plan.kv_dtype}",
    ]
    if plan.dense_quant != PLAIN:
        out.append(
            f"  resident linear weights {plan.dense_quant}; every other resident tensor {plan.dense_dtype}"
        )
    for pool in plan.pools:
        out.append("")
        out.append(f"{pool.name} pool: cap {format_bytes(pool.cap)} ({pool.cap:,} B)")
        out.append(f"  {'item':<22} {'bytes':>17} {'size':>11} {'share':>7}  detail")
        for it in plan.items:
            if it.pool == pool.name:
                share = 100 * it.nbytes / pool.cap
                out.append(
                    f"  {it.name:<22} {it.nbytes:>17,} {format_bytes(it.nbytes):>11} {share:>6.1f}%  {it.detail}"
                )
        out.append(
            f"  {'total':<22} {pool.used:>17,} {format_bytes(pool.used):>11} {100 * pool.used / pool.cap:>6.1f}%"
        )
        label = "headroom" if pool.headroom >= 0 else "OVER BY"
        out.append(f"  {label:<22} {abs(pool.headroom):>17,} {format_bytes(abs(pool.headroom)):>11}")
    out.append("")
    out.append(
        f"expert quota: {_quotas(plan.quotas, plan.moe_layers)} "
        f"(of {plan.num_experts} experts; top_k {plan.top_k}, minimum {plan.min_quota})"
    )
    p = plan.prediction
    far = p is not None and p.far_reads_per_token > 0
    if far:
        out.append(
            f"expert tiers: VRAM slots {_quotas(plan.quotas, plan.moe_layers)}; every other expert in the pinned "
            "host tier, read in place by the GPU over PCIe (no misses, one graph a step); NVMe: read once at load"
        )
    elif plan.host_quotas:
        out.append(
            f"pinned host tier: {_quotas(plan.host_quotas, plan.moe_layers)} (misses copied to VRAM slots)"
        )
    if p is not None:
        misses = f"{p.misses_per_token:.2f} storage reads/token"
        if far:
            misses += f", {p.far_reads_per_token:.2f} expert blocks read in place over PCIe/token"
        elif plan.memory_kind == "discrete":
            misses += f", {p.device_misses_per_token:.2f} PCIe copies/token"
        out.append(f"prediction ({p.model} model): {misses}")
        bounds = f"memory {_rate(p.memory_bound_tok_s)}, storage {_rate(p.storage_bound_tok_s)}"
        if plan.memory_kind == "discrete":
            bounds += f", PCIe {_rate(p.pcie_bound_tok_s)}"
        line = f"  decode tok/s: {p.tok_s:.1f} bound ({bounds}); {p.tok_s_serial:.1f} with no overlap"
        if p.storage_bound_tok_s is not None and p.tok_s_layered:
            line += f"; {p.tok_s_layered:.1f} with each layer's reads after its router"
        if p.storage_bound_tok_s is not None and p.tok_s_prefetch:
            line += f"; {p.tok_s_prefetch:.1f} with prefetch"
        out.append(line)
        if p.storage_bound_tok_s is not None and p.tok_s_prefetch:
            guessed = (
                f"prefetch: {p.prefetch_useful_per_token:.1f} of the misses/token guessed a layer early, "
                f"{p.prefetch_wasted_per_token:.1f} wrong guesses; guesses: {p.guesses}"
            )
            out.append(textwrap.fill(guessed, width=100, initial_indent="  ", subsequent_indent="    "))
        out.append(
            textwrap.fill(f"model: {p.description}", width=100, initial_indent="  ", subsequent_indent="    ")
        )
    for note in plan.notes:
        out.append(textwrap.fill(f"note: {note}", width=100, subsequent_indent="  "))
    if plan.refusal is not None:
        out.append("")
        out.append(textwrap.fill(f"REFUSED: {plan.refusal.message}", width=100, subsequent_indent="  "))
    return "\n".join(out) + "\n"


def render(plan: Plan, fmt: str) -> str:
    if fmt == "json":
        return to_json(plan)
    if fmt == "yaml":
        return to_yaml(plan)
    return to_table(plan)
