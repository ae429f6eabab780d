"""What a speculative verify window of N rows costs against a one-row decode step, at Qwen3.6-35B-A3B's
real geometry (issue 17): from these ratios c_K and an acceptance rate, the speed-up MTP can give
on the real model follows (docs/benchmarks.md), where the demo's random-free acceptance is not
the real model's.

    python benchmarks/bench_verify_window.py --dir /tmp/vw [--layers 40] [--dense int4]
        [--quota 256,64] [--rows 2,3,4] [--calls 10] [--out FILE]

The bundle is ``edgerun bench decode``'s synthetic one (random weights, int4 experts; ``--dense``
its dense weights), made in --dir if it is not there. For each quota (256: every expert held in
the cache, one graph a step; less: streamed, misses read from disk between graph segments) a
runner loads with graphs on, runs the start-up check of verify windows (every row of windows of
2..max rows equal to its one-row step, ``torch.equal``: the line it prints says how the
projections take a window's rows), then for each sample: a new sequence, a 16-token prompt, 8
greedy steps, then one timed call (device-synced wall time): a one-row step, or a window of N
rows (``DecodeGraphs.window(N).run_window``, as a speculative step verifies). Median (range) of
--calls samples after 3 untimed ones, per row count, and each window's ratio to the one-row step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

PROMPT = list(range(1, 17))


@torch.inference_mode()
def sample(runner, n: int, most: int) -> float:
    """One timed call after a fresh prompt and 8 steps: a one-row step (n = 1) or a window of n."""
    from edgerun.models.layers import verify_window

    decoder = runner.decoder
    state = decoder.reset()
    runner.prefill(state, PROMPT)
    for t in range(8):
        decoder.step(20 + t)
    tokens = list(range(40, 40 + n))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    if n == 1:
        decoder.step(tokens[0])
    else:
        w = decoder.window(n, most)
        with verify_window():
            w.run_window(tokens)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, required=True, help="where the synthetic bundle is (or is made)")
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--dense", default="int4", help="the bundle's dense weights (bench decode's --dense)")
    ap.add_argument("--quota", default="256,64", help="expert slots a layer, one run each")
    ap.add_argument("--rows", default="2,3,4", help="window rows (K + 1)")
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--out", type=Path, default=None)
    ns = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_verify_window: needs a CUDA device, and torch sees none", file=sys.stderr)
        return 2

    from edgerun.bench.decode import build_bundle
    from edgerun.engine.policy import KernelPolicy
    from edgerun.engine.runner import Runner
    from edgerun.engine.setup import cache_config

    ns.dir.mkdir(parents=True, exist_ok=True)
    bundle, synth_s = build_bundle(ns.dir, ns.layers, ns.dense)
    rows = [int(r) for r in ns.rows.split(",")]
    most = max(rows)
    result = {
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": torch.cuda.get_device_name(),
        "bundle": str(bundle),
        "synth_seconds": synth_s,
        "runs": [],
    }
    print(f"bundle {bundle} ({synth_s:.0f} s to make), {torch.cuda.get_device_name()}", flush=True)
    for quota in (int(q) for q in ns.quota.split(",")):
        runner = Runner.load(
            bundle,
            device="cuda",
            dtype=torch.bfloat16,
            cache=cache_config(bundle, quota=quota),  # as bench decode's (every expert: all read at load)
            kernels=KernelPolicy(graphs="on"),
            max_context=256,
        )
        runner.new_state(256)  # the decoder (static state, graphs) the samples run on
        line = runner._probe_windows(most - 1)
        run = {"quota": quota, "probe": line, "kernels": runner.kernel_summary(), "ms": {}}
        print(f"quota {quota}: {line}", flush=True)
        for n in [1, *rows]:
            for _ in range(3):
                sample(runner, n, most)
            times = [sample(runner, n, most) * 1e3 for _ in range(ns.calls)]
            run["ms"][n] = {"median": statistics.median(times), "min": min(times), "max": max(times)}
        one = run["ms"][1]["median"]
        for n, t in run["ms"].items():
            ratio = "" if n == 1 else f", {t['median'] / one:.2f}x the one-row step"
            print(f"  {n} row(s): {t['median']:.3f} ms ({t['min']:.3f}-{t['max']:.3f}){ratio}", flush=True)
        run["fallbacks"] = runner.fallbacks()
        result["runs"].append(run)
        if runner.cache is not None:
            runner.cache.close()
        del runner
        torch.cuda.empty_cache()
    if ns.out is not None:
        ns.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
