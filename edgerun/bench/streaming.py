"""Streaming vs resident on this machine's CPU, with the disk's own read bandwidth as the bound.

For the demo model (trained) and a larger synthetic model (random weights, int4 experts):
  1. calibration: raw O_DIRECT read bandwidth over the expert files (several reads in flight);
  2. a route trace of a fixed greedy generation; misses/token at two quotas under the cache's
     policy (counted by the cache, and simulated, prefetches too), LRU and Belady (simulated);
     beside them the planner's prediction (configs/cpu.yaml with (1) as its storage bandwidth,
     the run's own trace) of misses/token and decode tok/s, with its error against the measured;
  3. decode tok/s resident vs streaming (O_DIRECT), prefetch off and on: the time lookups waited
     for reads per token (prompt and generated), bytes over that wait against (1) (over 100%
     when prefetched reads finished before they were asked for), prefetch issued/useful/wasted;
  4. page-cache growth (the expert files' resident pages, by mincore) for one streaming run with
     direct vs buffered reads.
Every rate is the median of --repeats runs, with the range.

  edgerun bench streaming --workdir /tmp/edgerun-bench [--repeats 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import time
from pathlib import Path

import torch

from edgerun.budget.cli import plan_for_bundle
from edgerun.bundle.convert import ConvertOptions, convert
from edgerun.bundle.reader import Bundle
from edgerun.cache.reader import BlockReader
from edgerun.config import load_device_profile
from edgerun.engine.runner import DEMO_MODEL, Runner
from edgerun.engine.sampler import SamplingParams
from edgerun.engine.setup import cache_config
from edgerun.engine.trace import RouteRecorder
from edgerun.tools.routes import read_trace
from edgerun.tools.simulate import simulate
from edgerun.tools.synth import synthesize_checkpoint

CPU_PROFILE = Path(__file__).resolve().parents[2] / "configs" / "cpu.yaml"

SYNTH = {
    "model_type": "qwen3_5_moe_text",
    "vocab_size": 4096,
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "num_experts": 64,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 256,
    "shared_expert_intermediate_size": 256,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 2,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "eos_token_id": 0,
}
PROMPT = "And God said, Let there be light: and there was light. And God saw the light, that it was good"


def cached_bytes(paths: list[Path]) -> int:
    """Bytes of these files in the page cache (mincore), immune to other processes' I/O."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    page, total = mmap.PAGESIZE, 0
    for p in paths:
        size = p.stat().st_size
        fd = os.open(p, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            vec = (ctypes.c_ubyte * ((size + page - 1) // page))()
            if libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore failed on {p}")
            libc.munmap(addr, size)
        finally:
            os.close(fd)
        total += sum(b & 1 for b in vec) * page
    return total


def evict(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def calibrate(bundle: Bundle, inflight: int) -> float:
    """Bytes/s reading every block of every expert file once with O_DIRECT."""
    bb = next(iter(bundle.layouts.values())).block_bytes
    reader = BlockReader(bb, staging=inflight, mode="direct")
    t0 = time.perf_counter()
    futures = []
    for layer in bundle.args.moe_layers:
        path = bundle.expert_path(layer)
        futures += [
            reader.submit(path, e, lambda v: None, bundle.args.num_experts)
            for e in range(bundle.args.num_experts)
        ]
    for f in futures:
        f.result()
    dt = time.perf_counter() - t0
    reader.close()
    return reader.stats.bytes / dt


def decode_rate(runner: Runner, ids: list[int], n: int) -> float:
    events = list(runner.generate(runner.request(ids, SamplingParams(max_tokens=n, ignore_eos=True))))
    return events[-1].stats.decode_tps


def med(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} [{min(xs):.2f}..{max(xs):.2f}]"


def predicted(bundle_dir: Path, quota: int, trace_path: Path, context: int, storage_bw: float):
    """The planner's prediction for this run: the bundle at ``quota`` on the CPU profile with
    the disk's calibrated read bandwidth, replaying the run's own route trace."""
    profile = dataclasses.replace(load_device_profile(CPU_PROFILE), storage_read_bandwidth=storage_bw)
    return plan_for_bundle(bundle_dir, profile, context, quota=quota, trace=trace_path).prediction


def error(predicted: float, measured: float) -> str:
    return f"{predicted / measured - 1:+.0%}" if measured else "n/a"


def bench(name: str, bundle_dir: Path, quotas: list[int], tokens: int, repeats: int, workdir: Path) -> None:
    bundle = Bundle.open(bundle_dir)
    args = bundle.args
    files = [bundle.expert_path(layer) for layer in args.moe_layers]
    bb = next(iter(bundle.layouts.values())).block_bytes
    print(
        f"\n## {name}: {args.num_hidden_layers} layers, {args.num_experts} experts top-{args.num_experts_per_tok}, "
        f"block {bb} B ({bundle.manifest.quant.scheme}), expert files {sum(f.stat().st_size for f in files) / 2**20:.1f} MiB"
    )
    cal = [calibrate(bundle, 2 * args.num_experts_per_tok) for _ in range(repeats)]
    print(f"calibration O_DIRECT read: {med([c / 1e9 for c in cal])} GB/s")

    resident = Runner.load(bundle_dir, device="cpu")
    ids = resident.tokenizer.encode(PROMPT)
    res_rates = [decode_rate(resident, ids, tokens) for _ in range(repeats)]
    print(f"resident decode: {med(res_rates)} tok/s")
    del resident

    for quota in quotas:
        trace_path = workdir / f"{name}-q{quota}.jsonl"
        runs: dict[bool, list] = {False: [], True: []}
        for r in range(repeats):  # off and on alternate, so a change in the machine's load hits both
            for prefetch in (False, True):
                runner = Runner.load(
                    bundle_dir,
                    device="cpu",
                    cache=cache_config(Path(bundle_dir), quota=quota, read_mode="direct", prefetch=prefetch),
                )
                first = r == 0 and not prefetch
                rec = RouteRecorder(runner.model, args, trace_path, name) if first else None
                rate = decode_rate(runner, ids, tokens)
                if rec:
                    rec.close()
                cache = runner.cache
                runs[prefetch].append((rate, cache.totals(), cache.policy, cache.prefetch_depth))
                runner.cache.close()
        trace = read_trace(trace_path)
        policy = runs[False][0][2]
        lru, opt = simulate(trace, quota, "lru"), simulate(trace, quota, "belady")
        pred = predicted(bundle_dir, quota, trace_path, len(ids) + tokens, statistics.median(cal))
        n = len(trace.tokens)
        for prefetch, done in runs.items():
            counted = {t.misses for _, t, _, _ in done}
            if len(counted) != 1:
                raise RuntimeError(f"quota {quota}: runs counted different misses {sorted(counted)}")
            t, depth = done[-1][1], done[-1][3]
            sim = simulate(trace, quota, policy, prefetch_depth=depth)
            sim_pf = [sim.prefetch_total(k) for k in ("issued", "useful", "wasted")] if depth else [0, 0, 0]
            if (sim.total_misses, sim_pf) != (
                t.misses,
                [t.prefetch_issued, t.prefetch_useful, t.prefetch_wasted],
            ):
                raise RuntimeError(f"quota {quota}: the simulator's replay differs from the cache's counters")
            rates = [rate for rate, _, _, _ in done]
            bws = [t.read_bandwidth / 1e9 for _, t, _, _ in done]
            waits = [t.read_seconds * 1e3 / (len(ids) + tokens) for _, t, _, _ in done]
            print(
                f"quota {quota}, prefetch {'on' if prefetch else 'off'}: misses/token counted "
                f"{t.misses / n:.2f} ({t.misses} misses over {n} tokens, {policy}) = simulated, LRU "
                f"{lru.misses_per_token:.2f} ({lru.total_misses}), Belady {opt.misses_per_token:.2f} "
                f"({opt.total_misses}); decode {med(rates)} tok/s; read wait {med(waits)} ms/token; "
                f"bytes / wait {med(bws)} GB/s (= {statistics.median(bws) * 1e9 / statistics.median(cal):.0%} "
                "of calibration)"
                + (
                    f"; prefetch {t.prefetch_issued} issued, {t.prefetch_useful} useful "
                    f"({t.prefetch_useful / max(t.misses, 1):.0%} of misses), {t.prefetch_wasted} wasted "
                    "(= simulated)"
                    if prefetch
                    else ""
                )
            )
            print(
                f"  planner predicted: {pred.misses_per_token:.2f} misses/token (error "
                f"{error(pred.misses_per_token, t.misses / n)}), {pred.tok_s:.1f} tok/s bound "
                f"(error {error(pred.tok_s, statistics.median(rates))} against the median)"
            )

    for mode in ("direct", "buffered"):
        evict(files)
        before = cached_bytes(files)
        runner = Runner.load(
            bundle_dir, device="cpu", cache=cache_config(Path(bundle_dir), quota=quotas[0], read_mode=mode)
        )
        decode_rate(runner, ids, tokens)
        read = runner.cache.totals().bytes_read
        runner.cache.close()
        grew = cached_bytes(files) - before
        print(
            f"page cache growth, {mode} reads: {grew / 2**20:+.1f} MiB while reading {read / 2**20:.1f} MiB of experts"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="edgerun bench streaming", description=" ".join(__doc__.split("\n\n")[0].split())
    )
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/edgerun-bench"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=None)
    ns = ap.parse_args(argv)
    if ns.threads:
        torch.set_num_threads(ns.threads)
    w = ns.workdir
    shutil.rmtree(w, ignore_errors=True)
    w.mkdir(parents=True)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cores; workdir {w}"
    )
    convert(DEMO_MODEL, w / "demo-int4", ConvertOptions("int4", 32))
    bench("demo (trained), int4 g32", w / "demo-int4", [4, 8], ns.tokens, ns.repeats, w)
    synthesize_checkpoint(SYNTH, w / "synth-hf", tokenizer_from=DEMO_MODEL)
    convert(w / "synth-hf", w / "synth-int4", ConvertOptions("int4", 32))
    shutil.rmtree(w / "synth-hf")
    bench("synthetic (random weights), int4 g32", w / "synth-int4", [8, 32], ns.tokens, ns.repeats, w)
    return 0
