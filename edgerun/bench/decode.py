"""Decode on a CUDA GPU at the real Qwen3.6-35B-A3B geometry: resident vs streamed experts, each
rate against its bound measured in the same run.

  edgerun bench decode --dir /tmp/edgerun-bench [--decode 48] [--repeats 2] [--dense int4]

1. A bundle of the real geometry (40 layers, 256 experts top-8, hidden 2048, expert width 512,
   vocab 248,320) with *random weights*, int4 g32 experts, resident linear weights as ``--dense``
   / ``--lm-head`` say (bf16 by default), written straight to local disk by
   ``edgerun.tools.synth_bundle`` (no checkpoint, no convert). Random routing has no locality, so
   miss rates are worse than a trained model's: a pessimistic workload for streaming.
2. Calibration: raw O_DIRECT read bandwidth of that disk over the expert files (whole blocks at
   random offsets, several queue depths; the best is the storage bound), and device copy
   bandwidth (the memory bound).
3. For each configuration, a 1K-token random prompt then ``--decode`` greedy tokens:
   (a) every expert resident in device slots, (b) an 8 GiB and (c) a 16 GiB device budget for
   dense weights + decode state + expert slots + a fixed allowance for activations/workspaces;
   the expert quota per layer is what is left, divided evenly. Time to first token (prefill of
   the 1K prompt + the first token) and decode tok/s (median and range over ``--repeats``
   graph-mode runs), misses/token and read GB/s during decode.
4. Bounds: streaming decode against storage bandwidth / (misses per token x block bytes);
   resident decode against device bandwidth / bytes each token must read (dense weights as
   stored, quantized ones with their scales, but the embedding table, of which one row; the top-k
   experts' blocks; DeltaNet state read and written; KV so far).
5. Eager and graph-captured decoding must give identical tokens; a configuration where they
   differ prints no rate.

Writes a JSON record and a markdown table to --out (default: the --dir).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

from edgerun.bundle.dense_layout import PLAIN, DenseScheme, add_dense_arguments
from edgerun.bundle.reader import Bundle
from edgerun.cache.expert_cache import read_shape
from edgerun.cache.policy import CACHE_POLICIES
from edgerun.cache.reader import disk_of
from edgerun.config import CacheConfig
from edgerun.engine.policy import DENSE_ACTS, EXPERT_ACTS, KernelPolicy
from edgerun.engine.runner import Runner
from edgerun.engine.sampler import SamplingParams
from edgerun.engine.setup import cache_config
from edgerun.models.layers import DeltaState, KVCache
from edgerun.tools import calibrate
from edgerun.tools.synth_bundle import qwen36_config, synth_bundle, with_layers

GiB = 2**30


def build_bundle(
    root: Path,
    layers: int | None,
    dense: str = PLAIN,
    lm_head: str | None = None,
    dense_group: int | None = None,
) -> tuple[Path, float]:
    cfg = qwen36_config()
    if layers:
        cfg = with_layers(cfg, layers)
    text = cfg.get("text_config", cfg)
    layers = text["num_hidden_layers"]
    scheme = DenseScheme.resolve(dense, lm_head, dense_group, bool(text.get("tie_word_embeddings", False)))
    tag = "" if not scheme.quantized else "-dense-" + scheme.label().replace(", ", "-").replace(" ", "")
    path = root / f"qwen36-int4-{layers}l{tag}"
    if (path / "manifest.json").is_file():
        return path, 0.0
    t0 = time.perf_counter()
    synth_bundle(  # a bar of the bytes written on a terminal (the synthesis is the bench's longest step)
        path, cfg, quant="int4", seed=0, dense=dense, lm_head=lm_head, dense_group=dense_group, log=sys.stderr
    )
    return path, time.perf_counter() - t0


def dense_bytes(bundle: Bundle) -> tuple[int, int]:
    """(all dense bytes, dense bytes one token reads: every stored dense tensor (a quantized
    weight's values, scales and global) but the embedding table, of which it reads one row)."""
    total = sum(e.nbytes for e in bundle.dense.values())
    embed = sum(e.nbytes for n, e in bundle.dense.items() if n.startswith("model.embed_tokens"))
    row = embed // bundle.args.vocab_size
    return total, total - embed + row


def state_bytes(bundle: Bundle, capacity: int) -> tuple[int, int, int]:
    """(decode state bytes at ``capacity``, recurrent bytes per token (read + write), KV bytes
    per cached position (read by each new token)), from a meta-device model (no memory)."""
    with torch.device("meta"):
        model = bundle.arch.Model(bundle.args)
    one = model.new_state(1, 1, device="meta", dtype=torch.bfloat16)
    rec = sum(2 * (e.recurrent.nbytes + e.conv.nbytes) for e in one.layers if isinstance(e, DeltaState))
    kv_pos = sum(e.k.nbytes + e.v.nbytes for e in one.layers if isinstance(e, KVCache))
    return model.new_state(1, capacity, device="meta", dtype=torch.bfloat16).nbytes(), rec, kv_pos


# cuBLAS / cuDNN / Triton workspaces torch allocates (not the CUDA context's own)
LIBRARY_WORKSPACE = 256 * 2**20


def plan_for(
    budget: int,
    bundle_dir: Path,
    context: int,
    prefill_chunk: int = 512,
    far: bool = False,
    bandwidths: tuple[float, float, float] = (4.8e12, 50e9, 2e9),
    reads: dict | None = None,
    staging: int | None = None,
):
    """The planner's plan of ``bundle_dir`` in ``budget`` bytes of device memory, as torch counts
    it (``max_memory_allocated``: no OS reserve, no CUDA context, library workspaces counted):
    every planned item (dense weights, KV and DeltaNet state at ``context``, the prefill and graph
    workspaces, the slots). ``far``: every expert in a pinned host tier the GPU reads in place (a
    discrete GPU whose host RAM holds them), else VRAM slots behind storage; ``bandwidths``
    (device memory, PCIe, storage reads; B/s) are what its prediction assumes: a benchmark
    passes the ones it measured in the same run; ``reads``: the profile's read-model keys
    (``storage_read_single``, ``read_depth``) from the same run's calibration; ``staging``: the
    pinned read buffers (None: the planner's default, 2 * top_k)."""
    from edgerun.budget import inputs
    from edgerun.budget.planner import PlanOptions, plan
    from edgerun.bundle.dense_layout import DenseScheme
    from edgerun.config import device_profile_from_dict

    model = inputs.from_bundle(bundle_dir)
    dev = device_profile_from_dict(
        {
            "name": f"{budget / GiB:g} GiB of an H200",
            "memory_kind": "discrete",
            "memory_cap": budget,
            "os_reserve": 0,
            "cuda_context": LIBRARY_WORKSPACE,
            # the host tier only where asked (``far``): else VRAM slots straight behind storage, as
            # the runs the prediction stands beside (page-locked staging only)
            "pinned_limit": 64 * GiB if far else 256 * 2**20,
            "host_memory_cap": 128 * GiB,
            "host_reserve": 8 * GiB,
            "memory_bandwidth": bandwidths[0],
            "storage_read_bandwidth": bandwidths[2],
            "pcie_bandwidth": bandwidths[1],
            "compute_capability": "9.0",
            **(reads or {}),
        }
    )
    options = PlanOptions(
        dense=model.dense or DenseScheme(),
        prefill_chunk=prefill_chunk,
        tier_reads="in-place" if far else "copy",
        staging_buffers=staging,
    )
    return plan(model.args, model.specs, model.experts, dev, context, 1, options, None, model_name=model.name)


def quota_for(
    budget: int,
    bundle_dir: Path,
    context: int,
    prefill_chunk: int = 512,
    far: bool = False,
    bandwidths: tuple[float, float, float] = (4.8e12, 50e9, 2e9),
) -> tuple[int, str]:
    """The planner's quota per layer for ``budget`` bytes of device memory (:func:`plan_for`).
    (quota, how: the plan's refusal when not even top_k fits; with ``far``, its prediction)."""
    return planned_quota(budget, bundle_dir, context, prefill_chunk, far, bandwidths)[:2]


def planned_quota(
    budget: int,
    bundle_dir: Path,
    context: int,
    prefill_chunk: int = 512,
    far: bool = False,
    bandwidths: tuple[float, float, float] = (4.8e12, 50e9, 2e9),
    reads: dict | None = None,
    staging: int | None = None,
):
    """:func:`quota_for`'s (quota, how) and the plan they came from (None: no plan was made)."""
    if budget <= LIBRARY_WORKSPACE:
        why = f"a budget of {budget:,} B does not cover the library workspaces ({LIBRARY_WORKSPACE:,} B)"
        return 0, why, None
    p = plan_for(budget, bundle_dir, context, prefill_chunk, far, bandwidths, reads, staging)
    if not p.fits:
        return 0, p.refusal.message, p
    quota = min(p.quotas)
    how = f"planned: {quota} slots a layer in {budget / GiB:g} GiB"
    if far:
        pr = p.prediction
        how += (
            f", every other expert read in place over PCIe ({pr.far_reads_per_token:.1f} blocks/token); predicted "
            f"{pr.tok_s:.1f} tok/s bound (memory {pr.memory_bound_tok_s:.1f}, PCIe {pr.pcie_bound_tok_s:.1f}), "
            f"{pr.tok_s_serial:.1f} with no overlap"
        )
    return quota, how, p


def one_run(runner: Runner, prompt: list[int], decode: int) -> dict:
    params = SamplingParams(max_tokens=decode, ignore_eos=True)
    cache = runner.cache
    tokens, first = [], None
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    stats = None
    for ev in runner.generate(runner.request(prompt, params)):
        if ev.token_id is not None:
            tokens.append(ev.token_id)
            if first is None:
                first = time.perf_counter() - t0
                before = cache.totals() if cache else None
                disk = disk_counters(cache) if cache else None
        stats = ev.stats or stats
    out = {"tokens": tokens, "ttft_s": first, "decode_tps": stats.decode_tps, "decode_s": stats.decode_s}
    if cache is not None:
        after = cache.totals()
        steps = max(len(tokens) - 1, 1)
        out["misses_per_token"] = (after.misses - before.misses) / steps
        out["passed_per_token"] = (after.passed - before.passed) / steps  # of them, left unheld
        out["bytes_read"] = after.bytes_read - before.bytes_read
        out["read_gbs"] = out["bytes_read"] / stats.decode_s / 1e9 if stats.decode_s else 0.0
        out["read_wait_s"] = after.read_seconds - before.read_seconds
        out["far_per_token"] = (after.far_reads - before.far_reads) / steps
        # prefetch_bytes: what the prefetches read, useful and wasted (a wrong guess dropped before
        # its read started cost nothing)
        for key in ("prefetch_issued", "prefetch_useful", "prefetch_wasted", "prefetch_bytes"):
            out[f"{key}_per_token"] = (getattr(after, key) - getattr(before, key)) / steps
        busy, read, depth = (b - a for a, b in zip(disk, disk_counters(cache), strict=True))
        # the disk's side: the share of decode time with a read in flight (demand or prefetch), what
        # it read while busy (every block, wasted prefetches included), and how many requests (a
        # piece each) it had on average while busy
        out["disk_busy"] = busy / stats.decode_s if stats.decode_s else 0.0
        out["busy_gbs"] = read / busy / 1e9 if busy else 0.0
        out["busy_depth"] = depth / busy if busy else 0.0
    return out


def disk_counters(cache) -> tuple[float, int, float]:
    """(seconds with at least one read in flight, bytes read, requests in flight integrated over
    time) over the cache's readers so far."""
    disk = cache.disk_time()
    return disk["busy"], sum(r.stats.bytes for r in cache.readers.values()), disk["requests"]


def profile_steps(runner: Runner, capacity: int, steps: int = 3) -> dict:
    """Where a replayed decode step spends its GPU time: kernels per step and the heaviest
    kernels by device time (torch.profiler, CUPTI)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    state = runner.new_state(capacity)
    runner.decode_step(state, 0)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            runner.decode_step(state, 0)
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t > 0:
            rows.append((e.key, t / steps, e.count / steps))
    rows.sort(key=lambda r: -r[1])
    # the last step's kernels in launch order (which projection a GEMV is shows only there)
    kernels = sorted(
        (e for e in prof.events() if getattr(e, "device_type", None) == DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )
    last = kernels[len(kernels) - len(kernels) // steps :]
    return {
        "kernels_per_step": sum(r[2] for r in rows),
        "gpu_us_per_step": sum(r[1] for r in rows),
        "top": [{"kernel": k[:80], "us_per_step": round(t, 1), "per_step": c} for k, t, c in rows[:15]],
        "last_step": [[e.name[:40], round(e.time_range.elapsed_us(), 2)] for e in last],
        **chain_costs([(e.name, e.time_range.start, e.time_range.end) for e in last]),
    }


def chain_costs(kernels: list[tuple[str, float, float]]) -> dict:
    """What each kernel adds to a step's span: (name, start, end) in launch order -> the span
    (first start to last end, us) and, per kernel name, the sum over its launches of how far
    its end lies past the latest end before it. With PDL a kernel starts before its
    predecessor ends, so its duration double counts the overlap; these increments add up to
    the span, each kernel charged with what the step waits for it; ``chain_steps``: each
    launch's increment in launch order."""
    span = max(e for _, _, e in kernels) - kernels[0][1] if kernels else 0.0
    costs: dict[str, float] = {}
    steps = []  # (name, its increment) in launch order: which projection costs what
    done = kernels[0][1] if kernels else 0.0
    for name, _, end in kernels:
        inc = max(end - done, 0.0)
        costs[name[:40]] = costs.get(name[:40], 0.0) + inc
        steps.append([name[:40], round(inc, 2)])
        done = max(done, end)
    order = sorted(costs.items(), key=lambda kv: -kv[1])
    return {"span_us": round(span, 1), "chain_us": {k: round(v, 1) for k, v in order}, "chain_steps": steps}


def chain_layers(steps: list, end: str = "_down_kernel") -> list[dict]:
    """``chain_steps`` by place in a layer: the chain cut after each launch named ``end`` (a MoE
    layer's last), the pieces grouped by their sequence of kernel names (a DeltaNet layer's, an
    attention layer's; the step's head and tail are pieces of their own), and each place of a
    group summarised over its pieces. Rows in chain order of the groups' first pieces: ``kind``
    (the group's number and size), ``at`` (the place), ``kernel``, ``n``, median / min / max /
    total µs. Which projection a GEMV launch is shows in its place."""
    pieces, cur = [], []
    for name, inc in steps:
        cur.append((name, inc))
        if name == end:
            pieces.append(cur)
            cur = []
    if cur:
        pieces.append(cur)
    groups: dict[tuple, list] = {}
    for piece in pieces:
        groups.setdefault(tuple(n for n, _ in piece), []).append([v for _, v in piece])
    rows = []
    for g, (names, members) in enumerate(groups.items()):
        for at, name in enumerate(names):
            vals = [m[at] for m in members]
            rows.append({"kind": f"{g} (x{len(members)})", "at": at, "kernel": name, "n": len(vals),
                         "median": round(statistics.median(vals), 2), "min": min(vals), "max": max(vals),
                         "total": round(sum(vals), 1)})  # fmt: skip
    return rows


def med(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def run_config(
    name, bundle_dir, bundle, quota, capacity, prompt, decode, timed, warm_all, depth, host_quota=None,
    cpu_experts=None, prefetch=None, reader=None, staging=None, pieces=1, dense_act="bf16", expert_act="bf16",
    policy=None,
) -> dict:  # fmt: skip
    """One configuration: an eager run of ``prompt``, the same with graphs (their tokens must be
    identical), then a timed graph run of each of the ``timed`` prompts: a prompt of its own each,
    so a run does not find the experts of the last one's tokens in the cache (the same greedy
    tokens again would route to the same experts and measure hits)."""
    t0 = time.perf_counter()
    cache = cache_config(
        Path(bundle_dir),
        quota=quota,
        read_depth=depth,
        host_quota=host_quota,
        cpu_experts=cpu_experts,
        prefetch=None if prefetch is None else bool(prefetch),
        prefetch_ahead=prefetch or None,
        reader=reader,
        policy=policy,
    )
    if staging is not None:
        cache = dataclasses.replace(cache, staging=staging)
    cache = dataclasses.replace(cache, read_pieces=pieces) if cache is not None else None
    runner = Runner.load(  # warm_all: quota = every expert, all read in at load (one graph a step)
        bundle_dir,
        device="cuda",
        dtype=torch.bfloat16,
        cache=cache,
        max_context=capacity,
        kernels=KernelPolicy(graphs="off", dense_act=dense_act, expert_act=expert_act),
        prefill_chunk=len(prompt),
    )
    rec = {"config": name, "quota": quota, "load_s": time.perf_counter() - t0}
    if runner.cache is not None:  # who read: the C pool, or Python threads (and any fallback's reason)
        rec["reader"] = sorted({r.backend for r in runner.cache.readers.values()})
        rec["read_depth"] = sorted({r.depth for r in runner.cache.readers.values()})
        rec["read_pieces"] = sorted({r.pieces for r in runner.cache.readers.values()})
    if runner.cache is not None and runner.cache.cpu_split_text:  # --cpu-experts auto's choice (far tier)
        rec["cpu_experts"] = runner.cache.cpu_split_text
    eager = one_run(runner, prompt, decode)
    runner.set_kernels(KernelPolicy(graphs="on", dense_act=dense_act, expert_act=expert_act))
    state = runner.new_state(capacity)  # the decoder at the runs' size: warm-up step + capture, untimed
    for _ in range(2):
        runner.decode_step(state, 0)
    check = one_run(runner, prompt, decode)
    graph_runs = [one_run(runner, p, decode) for p in timed]
    rec["kernels"] = runner.kernel_summary()
    rec["fallbacks"] = runner.fallbacks()
    rec["decode_steps"] = runner.decode_counts()
    same = check["tokens"] == eager["tokens"]
    # the CPU-expert split is not bit-exact (engine/cpu_experts.py states its tolerance), and
    # which pairs it computes follows the device set, which rebalances between runs: its tokens
    # may differ from run to run, so the rate is printed and the column says why it is no check
    split = bool(runner.cache and runner.cache.cpu_split)
    rec["tokens_identical"] = "n/a (CPU experts)" if split else same
    same = same or split
    rec["eager_decode_tps"] = eager["decode_tps"]
    rec["peak_device_bytes"] = torch.cuda.max_memory_allocated()
    rec["ttft_s"] = med([r["ttft_s"] for r in graph_runs])
    rec["decode_tps"] = med([r["decode_tps"] for r in graph_runs])
    if runner.cache is not None:
        keys = ("misses_per_token", "passed_per_token", "read_gbs", "read_wait_s", "far_per_token")
        rec["cache_policy"] = runner.cache.slot_policy
        for key in keys + ("disk_busy", "busy_gbs", "busy_depth"):
            rec[key] = med([r[key] for r in graph_runs])
        for key in ("prefetch_issued", "prefetch_useful", "prefetch_wasted", "prefetch_bytes"):
            rec[f"{key}_per_token"] = med([r[f"{key}_per_token"] for r in graph_runs])
        rec["prefetch_depth"] = runner.cache.prefetch_depth
        rec["prefetch_ahead"] = runner.cache.prefetch_ahead
    if warm_all:
        rec["profile"] = profile_steps(runner, capacity)
    if not same:
        diverge = next(i for i, (a, b) in enumerate(zip(eager["tokens"], check["tokens"])) if a != b)
        rec["refused"] = f"eager and graph tokens differ from token {diverge}: no rate printed"
    release(runner)
    return rec


def prepare(ns: argparse.Namespace, name: str) -> tuple[Path, Path, float, Bundle] | None:
    """A GPU benchmark's set-up from its options (--dir, --out, --layers, the dense ones): (out
    dir, bundle dir, seconds synthesizing it, the open bundle); None, said, without CUDA."""
    if not torch.cuda.is_available():
        print(f"edgerun bench {name}: needs a CUDA device, and torch sees none", file=sys.stderr)
        return None
    ns.dir.mkdir(parents=True, exist_ok=True)
    out_dir = ns.out or ns.dir
    out_dir.mkdir(parents=True, exist_ok=True)
    bundle_dir, synth_s = build_bundle(ns.dir, ns.layers, ns.dense, ns.lm_head, ns.dense_group)
    return out_dir, bundle_dir, synth_s, Bundle.open(bundle_dir)


def release(runner: Runner) -> None:
    """A configuration's runner gone before the next loads: its cache's readers closed, its
    device memory back to the allocator's pool and out of it."""
    if runner.cache is not None:
        runner.cache.close()
    runner.cache = runner.decoder = runner.model = None
    gc.collect()
    torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="edgerun bench decode", description=" ".join(__doc__.split("\n\n")[0].split())
    )
    ap.add_argument("--dir", type=Path, required=True, help="local disk for the bundle")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--decode", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument(
        "--budgets",
        default="resident,16,8",
        help="resident, device budgets in GiB (slots behind storage), hostN: N device slots a layer and "
        "every expert in a pinned host tier the GPU reads in place, and/or farG: a G GiB device budget "
        "planned with that tier (a discrete GPU such as the 12 GB RTX 5070: far12); :auto|on|off after "
        "either sets --cpu-experts (host64:off)",
    )
    ap.add_argument(
        "--layers", type=int, default=None, help="fewer layers (a quick check, not the benchmark)"
    )
    calibrate.add_arguments(ap)
    add_dense_arguments(ap)
    ap.add_argument(
        "--read-depth",
        default=None,
        help="streamed reads in flight (default: the engine's on this disk, cache.expert_cache.read_shape); "
        "a list (2,4) runs each streamed budget with each",
    )
    ap.add_argument(
        "--prefetch",
        default="on,off",
        help="for each streamed budget, a run with decode prefetch on and/or off (on,off | on | off); "
        "on2: on, reading two layers ahead (--prefetch-ahead 2)",
    )
    ap.add_argument(
        "--reader",
        default="auto",
        help="who reads streamed experts (auto | native | preadv | io_uring); a list (native,preadv) "
        "runs each streamed budget with each",
    )
    ap.add_argument(
        "--cache-policy",
        default=None,
        help="streamed budgets: the expert cache's policy (lfu-bypass | lfu | lru; default the cache's); "
        "a list (lfu,lfu-bypass) runs each streamed budget with each",
    )
    ap.add_argument(
        "--staging",
        default=None,
        help="staging buffers (default 2 x top_k; prefetch may hold all but top_k of them); a list "
        "(10,16) runs each streamed budget with each",
    )
    ap.add_argument(
        "--read-pieces",
        default=None,
        help="the native reader reads each block as this many parts at once (default: the engine's on "
        "this disk, cache.expert_cache.read_shape); a list (1,2,4) runs each streamed budget with each, "
        "and the calibration measures each (its storage bound: the best of all)",
    )
    ap.add_argument(
        "--dense-act",
        choices=DENSE_ACTS,
        default="bf16",
        help="int8: the int4 projections of many rows take x quantized to int8 per 32 columns in decode (W4A8)",
    )
    ap.add_argument(
        "--expert-act",
        choices=EXPERT_ACTS,
        default="bf16",
        help="int8: the routed experts' gate_up takes x quantized to int8 per 32 columns (W4A8)",
    )
    ns = ap.parse_args(argv)
    # 0: off; 1: on (one layer ahead); 2: on, two layers ahead
    prefetches = []
    for v in ns.prefetch.split(","):
        if v not in ("on", "off", "on2"):
            ap.error(f"--prefetch takes a list of on, off and on2, got {v!r}")
        prefetches.append({"off": 0, "on": 1, "on2": 2}[v])
    readers = ns.reader.split(",")
    stagings = [int(v) for v in ns.staging.split(",")] if ns.staging else [None]
    policies = ns.cache_policy.split(",") if ns.cache_policy else [None]
    calibrate.check_arguments(ap, ns)
    for v in policies:
        if v not in (None, *CACHE_POLICIES):
            ap.error(f"--cache-policy takes a list of {', '.join(CACHE_POLICIES)}, got {v!r}")
    prepared = prepare(ns, "decode")
    if prepared is None:
        return 2
    out_dir, bundle_dir, synth_s, bundle = prepared
    a = bundle.args
    block = bundle.layouts[a.moe_layers[0]].block_bytes
    result = {
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "bundle": str(bundle_dir),
        "synth_seconds": synth_s,
        "geometry": {
            "layers": a.num_hidden_layers,
            "experts": a.num_experts,
            "top_k": a.num_experts_per_tok,
            "hidden": a.hidden_size,
            "expert_width": a.moe_intermediate_size,
            "vocab": a.vocab_size,
            "block_bytes": block,
            "dense": bundle.manifest.dense_quant.scheme.label(),
        },
    }
    print(
        f"bundle {bundle_dir} (synthesized in {synth_s:.0f} s), block {block:,} B, "
        f"dense {bundle.manifest.dense_quant.scheme.label()}",
        flush=True,
    )

    paths = [bundle.expert_path(layer) for layer in a.moe_layers]
    # unless told, the engine's own reads on this disk (cache.expert_cache.read_shape)
    disk = disk_of(paths[0])
    engine_depth, engine_pieces = read_shape(CacheConfig(quotas=1), torch.device("cuda"), disk and disk[1])
    piece_counts = [int(v) for v in ns.read_pieces.split(",")] if ns.read_pieces else [engine_pieces]
    read_depths = (
        [int(v) for v in ns.read_depth.split(",")]
        if ns.read_depth
        else [engine_depth or 2 * a.num_experts_per_tok]
    )
    result["disk"] = disk
    # every shape once a round, its median round; beside it the best single window of any shape
    reads, result["storage_best_window"] = calibrate.read_rounds(
        paths, block, ns.calibrate_rounds, ns.calibrate_seconds, piece_counts
    )
    storage = calibrate.best(reads)
    copy = calibrate.device_copy_bandwidth("cuda")
    result["storage_read"] = reads
    result["device_copy"] = copy
    storage_bw = storage["gb_per_s"] * 1e9
    device_bw = copy["d2d_gb_per_s"] * 1e9
    for r in reads:
        print(
            f"  O_DIRECT read depth {r['queue_depth']:>2}, {r['pieces']} piece(s): {r['gb_per_s']:.2f} GB/s "
            f"(rounds {', '.join(f'{v:.2f}' for v in r['gb_per_s_rounds'])})",
            flush=True,
        )
    print(
        f"storage bound: {storage_bw / 1e9:.2f} GB/s (depth {storage['queue_depth']}, "
        f"{storage['pieces']} piece(s); the median of {ns.calibrate_rounds} round(s) of "
        f"{ns.calibrate_seconds:g} s, range {storage['gb_per_s_range'][0]:.2f}-"
        f"{storage['gb_per_s_range'][1]:.2f}; the best single window of any shape "
        f"{result['storage_best_window']:.2f})",
        flush=True,
    )
    print(
        f"device copy: {device_bw / 1e9:.0f} GB/s read + write (range {copy['d2d_gb_per_s_range']}), "
        f"pinned host->device {copy['h2d_pinned_gb_per_s']:.1f} GB/s",
        flush=True,
    )

    # the engine reads at its own depth (--read-depth overrides; the calibration's fastest depth of
    # steady reads was not the engine's fastest: docs/benchmarks.md, "Blocks in pieces"); the plan's
    # read model takes a read alone from the calibration of the same pieces count
    def read_model(depth: int, pieces: int) -> dict:
        from edgerun.cache.native import parts

        split = parts(block, pieces)
        rows = [r for r in reads if r["pieces"] == split] or [r for r in reads if r["pieces"] == 1]
        single = next((r["gb_per_s"] for r in rows if r["queue_depth"] == 1), None)
        return {"read_depth": depth, **({"storage_read_single": single * 1e9} if single else {})}

    shapes = list(itertools.product(read_depths, piece_counts))  # each streamed budget reads each way
    result["read_depth"] = read_depths
    # what a layer's misses cost: a burst of j reads after the disk idled, at each read set-up the
    # streamed runs use (the native reader only: the engine's reader on CUDA)
    if any(b not in ("resident",) and not b.startswith("host") for b in ns.budgets.split(",")):
        from edgerun.cache.native import unavailable

        if "native" in readers or ("auto" in readers and unavailable() is None):
            result["bursts"] = [calibrate.burst_seconds(paths, block, depth=d, pieces=n) for d, n in shapes]
            for (d, n), rows in zip(shapes, result["bursts"], strict=True):
                print(
                    f"  a burst of j reads after 2 ms idle, {n} piece(s), depth {d}: "
                    + ", ".join(f"{r['reads']}: {r['median_s'] * 1e3:.2f} ms" for r in rows),
                    flush=True,
                )
    capacity = 1 << (ns.prompt + ns.decode - 1).bit_length()
    g = torch.Generator().manual_seed(0)
    prompt, *timed = (
        torch.randint(0, a.vocab_size, (ns.prompt,), generator=g).tolist() for _ in range(1 + ns.repeats)
    )
    _, dense_tok = dense_bytes(bundle)
    _, rec_tok, kv_pos = state_bytes(bundle, capacity)
    records = []
    pcie_bw = copy["h2d_pinned_gb_per_s"] * 1e9
    bandwidths = (device_bw, pcie_bw, storage_bw)  # the plan predicts with this run's bandwidths

    def row_plan(budget: int, depth: int, pieces: int, staging: int | None, gb_s: float | None = None):
        """A streamed row's plan: its read shape and staging, the disk at ``gb_s`` (None: the
        calibration's bound; a rate measured later scales the read-alone rate by as much)."""
        reads_as = read_model(depth, pieces)
        if gb_s is not None and "storage_read_single" in reads_as:
            reads_as["storage_read_single"] *= gb_s * 1e9 / storage_bw
        bw = bandwidths if gb_s is None else (*bandwidths[:2], gb_s * 1e9)
        return planned_quota(budget, bundle_dir, capacity, bandwidths=bw, reads=reads_as, staging=staging)[2]

    runs = []  # (name, quota, budget, host, cpu, prefetch, a streamed row's plan (row_plan), how, reader)
    for given in ns.budgets.split(","):
        spec, _, cpu = given.partition(":")  # hostN:on / farG:off: --cpu-experts for that tier
        if spec == "resident":
            runs.append(
                (
                    "resident",
                    a.num_experts,
                    None,
                    None,
                    cpu,
                    None,
                    None,
                    None,
                    (readers[0], None, *shapes[0][::-1], None),
                )
            )
        elif spec.startswith("host"):
            quota = int(spec[4:])
            name = f"{quota} device slots + pinned host tier" + (f", CPU experts {cpu}" if cpu else "")
            runs.append(
                (
                    name,
                    quota,
                    None,
                    a.num_experts,
                    cpu,
                    None,
                    None,
                    None,
                    (readers[0], None, *shapes[0][::-1], None),
                )
            )
        elif spec.startswith("far"):
            budget = int(float(spec[3:]) * GiB)
            quota, how = quota_for(budget, bundle_dir, capacity, far=True, bandwidths=bandwidths)
            name = f"{float(spec[3:]):g} GiB + pinned host tier" + (f", CPU experts {cpu}" if cpu else "")
            if quota < a.num_experts_per_tok:
                records.append({"config": name, "refused": how})
                continue
            print(how, flush=True)
            runs.append(
                (
                    name,
                    quota,
                    budget,
                    a.num_experts,
                    cpu,
                    None,
                    None,
                    how,
                    (readers[0], None, *shapes[0][::-1], None),
                )
            )
        else:  # VRAM slots behind storage: with decode prefetch on and/or off, beside the plan's prediction
            budget = int(float(spec) * GiB)
            quota, how, p = planned_quota(
                budget, bundle_dir, capacity, bandwidths=bandwidths, reads=read_model(*shapes[0])
            )
            if quota < a.num_experts_per_tok:
                records.append({"config": f"{float(spec):g} GiB", "refused": how})
                continue
            # each row beside the plan's prediction with the read model of the way it reads and its
            # staging, at the calibration's disk rate (and, once run, at the disk's around the row)
            for pf, reader, staging, (depth, pieces), policy in itertools.product(
                prefetches, readers, stagings, shapes, policies
            ):
                name = f"{float(spec):g} GiB, prefetch {('off', 'on', '2 ahead')[pf]}"
                name += f", {policy}" if len(policies) > 1 else ""
                name += f", reader {reader}" if len(readers) > 1 else ""
                name += f", staging {staging}" if len(stagings) > 1 else ""
                name += f", depth {depth}" if len(read_depths) > 1 else ""
                name += f", {pieces} piece(s)" if len(piece_counts) > 1 else ""
                runs.append(
                    (
                        name,
                        quota,
                        budget,
                        None,
                        cpu,
                        pf,
                        partial(row_plan, budget, depth, pieces, staging),
                        None,
                        (reader, staging, pieces, depth, policy),
                    )
                )

    def disk_now() -> float:
        """The bound's read shape (the calibration's best) for one window, now (GB/s)."""
        row = calibrate.read_bandwidth(
            paths, block, (storage["queue_depth"],), ns.calibrate_seconds, pieces=storage["pieces"]
        )
        return row[0]["gb_per_s"]

    for name, quota, budget, host, cpu, pf, predicted, how, reading in runs:
        print(f"[{name}] quota {quota}/{a.num_experts} per layer", flush=True)
        reader, staging, pieces, depth, policy = reading  # policy: streamed budgets only
        streamed = budget is not None and host is None
        # a streamed row's disk read right before and right after it: a bound of its own minutes
        before = disk_now() if streamed else None
        rec = run_config(
            name, bundle_dir, bundle, quota, capacity, prompt, ns.decode, timed,
            budget is None and host is None, depth, host, cpu or None, pf, reader, staging, pieces, ns.dense_act,
            ns.expert_act, policy=policy,
        )  # fmt: skip
        if streamed:
            rec["storage_around"] = [before, disk_now()]
        rec["budget_bytes"] = budget
        rec["planned"] = how
        rec["prefill_tps"] = ns.prompt / rec["ttft_s"]["median"] if "ttft_s" in rec else None
        mean_pos = ns.prompt + ns.decode / 2
        if budget is None or host is not None:
            per_token = (
                dense_tok + a.num_experts_per_tok * len(a.moe_layers) * block + rec_tok + kv_pos * mean_pos
            )
            rec["bound_kind"] = "memory"
            rec["bytes_per_token"] = per_token
            rec["bound_tps"] = device_bw / per_token
            if host is not None and "far_per_token" in rec:
                # the far pairs' blocks cross PCIe instead of VRAM, overlapped at best: the slower bounds
                far = rec["far_per_token"]["median"] * block
                rec["bound_kind"] = "memory | PCIe"
                rec["bound_tps"] = 1 / max((per_token - far) / device_bw, far / pcie_bw)
        else:
            mpt = rec["misses_per_token"]["median"]
            rec["bound_kind"] = "storage"
            rec["bytes_per_token"] = mpt * block
            rec["bound_tps"] = storage_bw / (mpt * block) if mpt else float("inf")
            # against the best single calibration window instead (the bound before rounds), and
            # against the disk as it read right before and after this row (their mean), GB/s each
            for key, gb_s in (
                ("bound_tps_best_window", result["storage_best_window"]),
                ("bound_tps_around", statistics.fmean(rec["storage_around"])),
            ):
                rec[key] = gb_s * 1e9 / (mpt * block) if mpt else None
        of_row = predicted() if predicted is not None and "decode_tps" in rec else None
        if of_row is not None and of_row.prediction is not None:
            rec["predicted"] = predicted_row(rec, of_row.prediction, pf)
            # the same plan with the disk as it read around the row: the model apart from the disk's drift
            rec["predicted"]["around"] = predicted_row(
                rec, predicted(statistics.fmean(rec["storage_around"])).prediction, pf
            )
        rec["ratio"] = rec["decode_tps"]["median"] / rec["bound_tps"] if "refused" not in rec else None
        records.append(rec)
        print(json.dumps(rec, default=str), flush=True)
        result["configs"] = records  # written after every configuration: a cut-off run keeps its rows
        (out_dir / "bench_decode.json").write_text(json.dumps(result, indent=1, default=str))
        (out_dir / "bench_decode.md").write_text(markdown(result))
    print(markdown(result))
    return 0


def predicted_row(rec: dict, predicted, pf: int) -> dict:
    """The plan's prediction beside a streamed row's measurement, each figure's error; ``row``:
    the model of the way the row decodes (with prefetch: :func:`~edgerun.budget.planner.prefetch_seconds`;
    without: each layer's reads after its router), the one its error is judged by."""
    measured = rec["decode_tps"]["median"]
    mpt = rec["misses_per_token"]["median"]

    def error(tok_s: float) -> float | None:
        return tok_s / measured - 1 if measured and tok_s else None

    row = predicted.tok_s_prefetch if pf else predicted.tok_s_layered
    return {
        "misses_per_token": predicted.misses_per_token,
        "misses_error": predicted.misses_per_token / mpt - 1 if mpt else None,
        "tok_s": predicted.tok_s,
        "tok_s_serial": predicted.tok_s_serial,
        "tok_s_error": error(predicted.tok_s),
        "tok_s_layered": predicted.tok_s_layered,
        "tok_s_layered_error": error(predicted.tok_s_layered),
        "tok_s_prefetch": predicted.tok_s_prefetch,
        "tok_s_prefetch_error": error(predicted.tok_s_prefetch),
        "prefetch_useful_per_token": predicted.prefetch_useful_per_token,
        "prefetch_wasted_per_token": predicted.prefetch_wasted_per_token,
        "row_model": "prefetch" if pf else "layered",
        "row_tok_s": row,
        "row_error": error(row),
    }


def markdown(result: dict) -> str:
    best = max(result["storage_read"], key=lambda r: r["gb_per_s"])
    c = result["device_copy"]
    lines = [
        f"{result['date']}, {result['device']}, torch {result['torch']}; `{result['command']}`",
        "",
        "O_DIRECT block reads (GB/s by queue depth, x pieces a block where split): "
        + ", ".join(
            f"{r['queue_depth']}{'x' + str(r['pieces']) if r.get('pieces', 1) > 1 else ''}: {r['gb_per_s']:.2f}"
            for r in result["storage_read"]
        )
        + f"; storage bound {best['gb_per_s']:.2f} GB/s"
        + (
            f" (each shape its median of {len(best['gb_per_s_rounds'])} rounds; the best single window "
            f"{result['storage_best_window']:.2f})"
            if "gb_per_s_rounds" in best and "storage_best_window" in result
            else ""
        )
        + f". Device copy {c['d2d_gb_per_s']:.0f} GB/s "
        f"(read + write, range {c['d2d_gb_per_s_range'][0]:.0f}-{c['d2d_gb_per_s_range'][1]:.0f}).",
        "",
        "| config | quota/layer | eager == graph | TTFT 1K (s) | decode tok/s median (range) | misses/token | read GB/s | bound tok/s | ratio |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["configs"]:
        if "decode_tps" not in r or "refused" in r:
            lines.append(
                f"| {r['config']} | {r.get('quota', '-')} | {r.get('tokens_identical', '-')} | - | refused: {r.get('refused')} | | | | |"
            )
            continue
        d, t = r["decode_tps"], r["ttft_s"]
        mpt = f"{r['misses_per_token']['median']:.1f}" if "misses_per_token" in r else "-"
        if r.get("far_per_token", {}).get("median"):
            mpt += f" (+{r['far_per_token']['median']:.1f} read in place)"
        rgb = f"{r['read_gbs']['median']:.2f}" if "read_gbs" in r else "-"
        lines.append(
            f"| {r['config']} | {r['quota']} | {r['tokens_identical']} | {t['median']:.2f} | "
            f"{d['median']:.1f} ({d['min']:.1f}-{d['max']:.1f}) | {mpt} | {rgb} | "
            f"{r['bound_tps']:.1f} ({r['bound_kind']}) | {100 * r['ratio']:.0f}% |"
        )
    streamed = [r for r in result["configs"] if r.get("bound_kind") == "storage" and "decode_tps" in r]
    if streamed:
        lines += [
            "",
            "| config | disk busy | read GB/s while busy | requests in flight while busy | "
            "prefetch issued / useful / wasted a token | ratio to the best single window | "
            "ratio to the disk around the row (GB/s before, after) | "
            "planned misses/token (error) | planned tok/s, storage bound (error) | "
            "planned tok/s, the row's model (error) | the same at the disk around the row (error) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in streamed:
            pf = "off"
            if r.get("prefetch_depth"):
                i, u, w = (r[f"prefetch_{k}_per_token"]["median"] for k in ("issued", "useful", "wasted"))
                two = ", 2 ahead" if r.get("prefetch_ahead", 1) > 1 else ""
                pf = f"{i:.1f} / {u:.1f} / {w:.1f}"
                if "prefetch_bytes_per_token" in r:  # the wrong guesses the disk read (not cancelled first)
                    read = r["prefetch_bytes_per_token"]["median"] / result["geometry"]["block_bytes"] - u
                    pf += f" ({max(read, 0.0):.1f} read)"
                pf += f" (depth {r['prefetch_depth']}{two})"
            pr = r.get("predicted") or {}
            m_err, t_err = pr.get("misses_error"), pr.get("tok_s_error")
            rows = [
                (p.get("row_model"), p.get("row_tok_s"), p.get("row_error"))
                for p in (pr, pr.get("around") or {})
            ]
            lines.append(
                f"| {r['config']} | {100 * r['disk_busy']['median']:.0f}% | {r['busy_gbs']['median']:.2f} | "
                + (f"{r['busy_depth']['median']:.2f}" if "busy_depth" in r else "-")
                + f" | {pf} | "
                + (
                    f"{100 * r['decode_tps']['median'] / r['bound_tps_best_window']:.0f}%"
                    if r.get("bound_tps_best_window")
                    else "-"
                )
                + " | "
                + (
                    f"{100 * r['decode_tps']['median'] / r['bound_tps_around']:.0f}% "
                    f"({r['storage_around'][0]:.2f}, {r['storage_around'][1]:.2f})"
                    if r.get("bound_tps_around")
                    else "-"
                )
                + " | "
                + (f"{pr['misses_per_token']:.1f} ({100 * m_err:+.0f}%)" if m_err is not None else "-")
                + " | "
                + (f"{pr['tok_s']:.2f} ({100 * t_err:+.0f}%)" if t_err is not None else "-")
                + " | "
                + " | ".join(
                    f"{tok_s:.2f} ({100 * err:+.0f}%, {kind})" if err is not None else "-"
                    for kind, tok_s, err in rows
                )
                + " |"
            )
    lines += [f"\n{r['config']}: {r['planned']}" for r in result["configs"] if r.get("planned")]
    lines += [
        f"\n{r['config']}: {p['kernels_per_step']:.0f} kernels a step, {p['gpu_us_per_step']:,.0f} GPU us a step "
        "(torch.profiler over replayed steps; with programmatic dependent launch a kernel's time includes its "
        "wait for the one before)"
        + (
            f"; the last step spans {p['span_us']:,.0f} us, of which "
            + ", ".join(f"{k} {v:,.1f}" for k, v in list(p["chain_us"].items())[:8])
            + " (what each kernel adds past the end before it)"
            if p.get("chain_us")
            else ""
        )
        + (
            "; by place in a layer, µs a launch (median over the layers of a kind): "
            + "; ".join(
                f"{kind}: "
                + ", ".join(f"{k['kernel'].strip('_').removesuffix('_kernel')} {k['median']:.2f}" for k in ks)
                for kind, ks in _by_kind(chain_layers(p["chain_steps"]))
            )
            if p.get("chain_steps")
            else ""
        )
        for r in result["configs"]
        if (p := r.get("profile"))
    ]
    return "\n".join(lines) + "\n"


def _by_kind(rows: list[dict]) -> list[tuple[str, list[dict]]]:
    """``chain_layers``' rows by layer kind, in order."""
    kinds: dict[str, list[dict]] = {}
    for r in rows:
        kinds.setdefault(r["kind"], []).append(r)
    return list(kinds.items())
