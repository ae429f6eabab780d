"""Where a batch step's GPU time goes: the replayed decode step of 1, 2, 4 and 8 rows over a
batch pool (``RowSteps``, what the daemon runs at ``--batch B``), kernels grouped by family,
device time per step (torch.profiler, CUPTI).

    PYTHONPATH=... python3 benchmarks/profile_batch_step.py BUNDLE [--rows 1,4] [--batch 8] [--json out.json]

Every expert held by default (--quota 256, Qwen3.6's E). Rows are distinct sequences (slots 0..n-1) at position 16 with
distinct tokens, so they route to distinct experts as concurrent requests do. The step is
warmed (captured) first, then ``--steps`` replays are profiled; wall time per step is measured
separately over the same replays with a device sync at the end.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import torch

FAMILIES = [  # (family, substrings of the kernel name), first match wins
    ("projection GEMV", ("_qgemv_kernel",)),
    ("tensor-core GEMV", ("_planes_kernel",)),
    ("expert gate_up", ("_gate_up_kernel",)),
    ("expert down", ("_down_kernel",)),
    ("router top-k", ("topk", "router")),
    ("DeltaNet", ("delta", "conv")),
    ("attention", ("attention", "attn")),
    ("argmax / sampling", ("argmax", "pick")),
    ("embedding", ("embed",)),
    ("copies / fills", ("copy", "fill", "memcpy", "memset", "elementwise")),
]


def family(name: str) -> str:
    low = name.lower()
    for fam, keys in FAMILIES:
        if any(k.lower() in low for k in keys):
            return fam
    return "other"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument(
        "--quota", type=int, default=256, help="expert slots a layer (default 256: every expert held)"
    )
    ap.add_argument("--gemv", choices=("planes", "rows"), default="planes", help="serve's --batch-gemv")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile

    from edgerun.engine.runner import Runner
    from edgerun.engine.setup import cache_config
    from edgerun.models.layers import exact_rows

    cache = cache_config(a.bundle, quota=a.quota, batch=a.batch)
    runner = Runner.load(a.bundle, device="cuda", dtype=torch.bfloat16, cache=cache, max_context=256)
    runner.enable_batch(a.batch, planes=a.gemv == "planes")
    steps = runner.row_steps
    report = {"bundle": str(a.bundle), "device": torch.cuda.get_device_name(), "rows": {}}
    for n in (int(v) for v in a.rows.split(",")):
        slots, positions, tokens = list(range(n)), [16] * n, [1000 + 7919 * i for i in range(n)]
        g = steps.graphs(n)
        with torch.inference_mode(), exact_rows():
            for _ in range(3):  # capture and warm
                g.run_rows(slots, positions, tokens)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(a.steps):
                g.run_rows(slots, positions, tokens)
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / a.steps
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(a.steps):
                    g.run_rows(slots, positions, tokens)
                torch.cuda.synchronize()
        fam_us: dict[str, float] = collections.defaultdict(float)
        fam_n: dict[str, float] = collections.defaultdict(float)
        for e in prof.key_averages():
            t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
            if t > 0:
                f = family(e.key)
                fam_us[f] += t / a.steps
                fam_n[f] += e.count / a.steps
        total = sum(fam_us.values())
        report["rows"][n] = {
            "wall_us": wall * 1e6,
            "gpu_us": total,
            "kernels": sum(fam_n.values()),
            "families": {
                f: {"us": round(fam_us[f], 1), "launches": fam_n[f]}
                for f in sorted(fam_us, key=lambda f: -fam_us[f])
            },
        }
        print(
            f"{n} rows: wall {wall * 1e6:.0f} us a step, GPU {total:.0f} us in {sum(fam_n.values()):.0f} kernels"
        )
        for f in sorted(fam_us, key=lambda f: -fam_us[f]):
            print(f"    {f:<20}{fam_us[f]:>9.1f} us{fam_n[f]:>7.0f} launches")
        other = sorted((e for e in prof.key_averages() if family(e.key) == "other"), key=lambda e: -e.count)
        for e in other[:6]:  # what "other" holds, by launches
            t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
            print(f"      other: {e.key[:60]:<60}{t / a.steps:>8.1f} us{e.count / a.steps:>5.0f} launches")
        sys.stdout.flush()
    if a.json:
        a.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
