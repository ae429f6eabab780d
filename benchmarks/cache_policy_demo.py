"""The cache's policies in the engine, on the trained demo model streamed from an int4 bundle on
this machine's CPU: for each quota and policy (lfu-bypass, the default; lfu; lru), the demo's
greedy decode of held-out prompts (the first 8 words of every 18th line of
tests/data/kjv_heldout.txt, 24 prompts, 96 tokens each, one engine for all of them as a server
keeps one) counted by the cache: misses (expert reads) per token, of them passed (read into a
spill row, not held), and bytes read; beside them the simulator's misses replaying the route
trace recorded in the same run (they must be equal); tokens (prompt and generated) a second of
wall time, the median and range of --repeats runs.

    python benchmarks/cache_policy_demo.py [--quota 3 4 5 6] [--repeats 3] [--workdir /tmp/cpd]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from edgerun.bundle.convert import ConvertOptions, convert
from edgerun.cache.policy import CACHE_POLICIES
from edgerun.config import CacheConfig
from edgerun.engine.runner import DEMO_MODEL, Runner
from edgerun.engine.sampler import SamplingParams
from edgerun.engine.trace import RouteRecorder
from edgerun.tools.routes import read_trace
from edgerun.tools.simulate import simulate

HELDOUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "kjv_heldout.txt"


def prompts() -> list[str]:
    lines = [ln for ln in HELDOUT.read_text().splitlines() if ln.strip()]
    return [" ".join(ln.split()[:8]) for ln in lines[::18][:24]]


def run(bundle: Path, quota: int, policy: str, texts: list[str], tokens: int, trace: Path | None) -> dict:
    runner = Runner.load(bundle, device="cpu", cache=CacheConfig(quota, policy=policy, read_mode="direct"))
    rec = RouteRecorder(runner.model, runner.args, trace, "demo") if trace else None
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    before = runner.cache.totals()
    n = decode_s = 0.0
    for text in texts:
        t0 = time.perf_counter()
        ids = runner.tokenizer.encode(text)
        out = runner.generate_ids(ids, params)
        decode_s += time.perf_counter() - t0
        n += len(ids) + len(out)
    if rec is not None:
        rec.close()
    t = runner.cache.totals()
    runner.cache.close()
    return {
        "tokens": n,
        "misses": t.misses - before.misses,
        "passed": t.passed - before.passed,
        "bytes": t.bytes_read - before.bytes_read,
        "tok_s": n / decode_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quota", type=int, nargs="+", default=[3, 4, 5, 6])
    ap.add_argument("--policy", nargs="+", default=list(CACHE_POLICIES), choices=CACHE_POLICIES)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/cache-policy-demo"))
    ns = ap.parse_args()
    torch.manual_seed(0)
    bundle = ns.workdir / "demo-int4"
    if not (bundle / "manifest.json").is_file():
        convert(DEMO_MODEL, bundle, ConvertOptions(quant="int4"))
    texts = prompts()
    print(
        f"{len(texts)} prompts, {ns.tokens} tokens each; this machine's CPU, {torch.get_num_threads()} threads"
    )
    print(
        "| quota | policy | misses/token | passed/token | MiB read | simulated misses/token | tokens/s, prompt + generated, median (range) |"
    )
    print("| ---: | --- | ---: | ---: | ---: | ---: | --- |")
    for quota in ns.quota:
        for policy in ns.policy:
            trace = ns.workdir / f"trace-{quota}-{policy}.jsonl"
            runs = [
                run(bundle, quota, policy, texts, ns.tokens, trace if i == 0 else None)
                for i in range(ns.repeats)
            ]
            first = runs[0]
            assert all(r["misses"] == first["misses"] for r in runs), (
                "greedy decode: the same misses every run"
            )
            sim = simulate(read_trace(trace), quota, policy).total_misses
            rates = [r["tok_s"] for r in runs]
            print(
                f"| {quota} | {policy} | {first['misses'] / first['tokens']:.3f} | {first['passed'] / first['tokens']:.3f} "
                f"| {first['bytes'] / 2**20:.1f} | {sim / first['tokens']:.3f} | {statistics.median(rates):.1f} "
                f"({min(rates):.1f}-{max(rates):.1f}) |",
                flush=True,
            )


if __name__ == "__main__":
    main()
