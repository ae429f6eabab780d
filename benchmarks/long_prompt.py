#!/usr/bin/env python3
"""A long prompt against the plan's memory: prefill N tokens (chunked as serve chunks them), one
token of decode, and the peak memory the engine held beside what `edgerun plan` says the same
model, context and options hold (its items less the OS reserve and the CUDA context, which are not
the engine's allocations).

  python benchmarks/long_prompt.py [--model DIR] [--tokens 32766] [--device cuda|cpu]
      [--profile configs/jetson_thor.yaml] [--prefill-chunk 512] [--quota N] [--json OUT]

The default model is the shipped demo (max_position_embeddings 32768). On CUDA the peak is
torch.cuda.max_memory_allocated over the request, against every planned item; on the CPU it is
the growth of the process's peak RSS over the request (coarse: allocator caching counts),
against the plan's per-request items (KV, DeltaNet state, activation workspace). Prints one JSON
record; exit 1 when the peak exceeds the plan.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import resource
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
EXCLUDED = ("os_reserve", "cuda_context")  # the plan's items that are not the engine's allocations


def planned(model: Path, bundle: bool, profile: str, context: int, chunk: int, quota: int | None) -> dict:
    from edgerun.budget.cli import main as plan_main

    args = [
        "--profile",
        profile,
        "--model",
        str(model),
        "--context",
        str(context),
        "--prefill-chunk",
        str(chunk),
    ]
    if quota is not None:
        args += ["--quota", str(quota)]
    if not bundle:  # a checkpoint is held as it is: its experts in bf16
        args += ["--quant", "bf16"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = plan_main(args + ["--format", "json"])
    if rc != 0:
        raise SystemExit(f"edgerun plan {' '.join(args)} refused (rc {rc}):\n{out.getvalue()}")
    plan = json.loads(out.getvalue())
    items = {it["name"]: it["nbytes"] for it in plan["items"] if it["name"] not in EXCLUDED}
    return {"items": items, "engine_bytes": sum(items.values()), "quotas": plan["quotas"]}


def rss_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def where_memory_goes(runner, prompt: list[int]) -> dict:
    """Another prefill of the prompt, eager, in MiB: what the new state allocated, and per module
    kind the largest transient (its peak during a call above what was allocated when it began)."""
    mib = 2**20
    kinds: dict[str, float] = {}
    began: dict[int, int] = {}
    mods = {}
    for layer in runner.model.model.layers:
        mixer = getattr(layer, "self_attn", None) or layer.linear_attn
        mods[mixer] = type(mixer).__name__
        mods[layer.mlp] = type(layer.mlp).__name__
    mods[runner.model.lm_head] = "lm_head"

    def pre(m, _args):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        began[id(m)] = torch.cuda.memory_allocated()

    def post(m, _args, _out):
        torch.cuda.synchronize()
        k = mods[m]
        kinds[k] = max(kinds.get(k, 0.0), (torch.cuda.max_memory_allocated() - began.pop(id(m))) / mib)

    hooks = [m.register_forward_pre_hook(pre) for m in mods] + [m.register_forward_hook(post) for m in mods]
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    state = runner.new_state(len(prompt) + 2)
    out = {"state_mib": (torch.cuda.memory_allocated() - base) / mib}
    with runner.eager_prefill():  # hooks see the eager forward only
        runner.prefill(state, prompt)
    for h in hooks:
        h.remove()
    out["module_transient_mib"] = {k: round(v, 1) for k, v in kinds.items()}
    return out


def peak_owners(snapshot: dict, start: int, top: int = 12) -> dict:
    """From a CUDA memory-history snapshot recording since before load, whose first ``start``
    events came before the request: the allocations live when the request began, and those live
    when the request's allocations peaked, in MiB, each by the innermost three frames of edgerun's
    own code that made it."""
    mine = ("edgerun/", "kernels/", "benchmarks/")
    live: dict[int, tuple[int, str]] = {}
    cur = peak = 0
    before: dict[int, tuple[int, str]] = {}
    at_peak: dict[int, tuple[int, str]] = {}
    for n, ev in enumerate(snapshot["device_traces"][0]):
        if n == start:
            before, peak = dict(live), cur
        if ev["action"] == "alloc":
            frames = [f for f in ev.get("frames") or [] if any(m in f["filename"] for m in mine)]
            where = " < ".join(
                f"{f['filename'].split('/edgerun/')[-1]}:{f['line']} {f['name']}" for f in frames[:3]
            )
            live[ev["addr"]] = (ev["size"], where or "(no edgerun frame)")
            cur += ev["size"]
            if n >= start and cur > peak:
                peak, at_peak = cur, dict(live)
        elif ev["action"] == "free_requested" and ev["addr"] in live:
            cur -= live.pop(ev["addr"])[0]

    def owners(blocks: dict[int, tuple[int, str]]) -> dict:
        by: dict[str, int] = {}
        for size, where in blocks.values():
            by[where] = by.get(where, 0) + size
        ranked = sorted(by.items(), key=lambda kv: -kv[1])
        out = {w: round(n / 2**20, 1) for w, n in ranked[:top]}
        out["(the rest)"] = round(sum(n for _, n in ranked[top:]) / 2**20, 1)
        return out

    return {"live_before_request_mib": owners(before), "live_at_request_peak_mib": owners(at_peak)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ROOT / "edgerun" / "demo")
    ap.add_argument("--tokens", type=int, default=32766, help="prompt tokens (the context: 2 more)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--profile", default=None, help="device profile to plan against (default: thor on CUDA, cpu)"
    )
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--quota", type=int, default=None, help="a bundle's expert quota (default: the plan's)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--phases",
        action="store_true",
        help="CUDA: also each module kind's largest transient over another, eager prefill",
    )
    ap.add_argument(
        "--owners",
        action="store_true",
        help="CUDA: record allocation history from before load and name the code holding memory at the peak",
    )
    ns = ap.parse_args(argv)

    from edgerun.engine.policy import KernelPolicy
    from edgerun.engine.runner import Runner
    from edgerun.engine.sampler import SamplingParams
    from edgerun.engine.setup import cache_config

    cuda = ns.device == "cuda"
    profile = ns.profile or str(ROOT / "configs" / ("jetson_thor.yaml" if cuda else "cpu.yaml"))
    context = ns.tokens + 2  # the prompt and two tokens (the first is the TTFT)
    bundle = (ns.model / "manifest.json").exists()
    plan = planned(ns.model, bundle, profile, context, ns.prefill_chunk, ns.quota)
    cache = cache_config(ns.model, quota=ns.quota or min(plan["quotas"])) if bundle else None
    if ns.owners and cuda:
        torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    t0 = time.perf_counter()
    runner = Runner.load(
        ns.model,
        device=ns.device,
        dtype=torch.bfloat16 if cuda else None,
        cache=cache,
        max_context=context,
        kernels=KernelPolicy(),
        prefill_chunk=ns.prefill_chunk,
    )
    load_s = time.perf_counter() - t0
    vocab = runner.args.vocab_size
    prompt = torch.randint(3, vocab, (ns.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        start = len(torch.cuda.memory._snapshot()["device_traces"][0]) if ns.owners else 0
    rss0 = rss_peak_bytes()
    t0 = time.perf_counter()
    first = None
    tokens = []
    for ev in runner.generate(runner.request(prompt, params)):
        if ev.token_id is not None:
            first = first or time.perf_counter() - t0
            tokens.append(ev.token_id)
    total_s = time.perf_counter() - t0
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        measure = "torch.cuda.max_memory_allocated (weights, cache, state, workspace, graph pools)"
    else:  # coarse: what the request added to the process's peak RSS, against the plan's per-request items
        peak = rss_peak_bytes() - rss0
        measure = "growth of the process's peak RSS over the request (allocator caches included)"
        plan["engine_bytes"] = sum(
            plan["items"].get(k, 0) for k in ("kv_cache", "deltanet_state", "activation_workspace")
        )
    owners = None
    if ns.owners and cuda:
        owners = peak_owners(torch.cuda.memory._snapshot(), start)
        torch.cuda.memory._record_memory_history(enabled=None)
    phases = where_memory_goes(runner, prompt) if ns.phases and cuda else None
    rec = {
        "owners": owners,
        "phases": phases,
        "model": str(ns.model),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "tokens": ns.tokens,
        "prefill_chunk": ns.prefill_chunk,
        "load_s": round(load_s, 2),
        "ttft_s": round(first, 3),
        "prefill_tok_s": round(ns.tokens / first, 1),
        "generated": tokens,
        "peak_bytes": peak,
        "peak_measure": measure,
        "allocated_before_request": before if cuda else None,
        "rss_before_request": rss0,
        "plan_profile": profile,
        "plan_engine_bytes": plan["engine_bytes"],
        "plan_items": plan["items"],
        "peak_over_plan": round(peak / plan["engine_bytes"], 3),
        "prefill_chunks": runner.prefill_counts(),
        "kernels": runner.kernel_summary(),
        "fallbacks": runner.fallbacks(),
        "total_s": round(total_s, 3),
    }
    text = json.dumps(rec, indent=1)
    print(text)
    if ns.json:
        ns.json.write_text(text)
    return 0 if peak <= plan["engine_bytes"] else 1


if __name__ == "__main__":
    sys.exit(main())
