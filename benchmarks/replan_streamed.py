"""The planner's layered read model against every streamed row recorded (issue 15), and one
variant of it, recomputed from the rows' JSON without running anything.

Each streamed row of ``edgerun bench decode`` (``docs/bench/stream_*/*.json``) carries the
planner's layered prediction (``predicted.tok_s_layered``), made from that call's calibration: a
layer's misses read ``read_depth`` at a time, a wave of j reads at a rate from
``storage_read_single`` (one read alone, at the row's pieces) up to ``storage_read_bandwidth``
(the call's best calibrated rate) at the full depth (``planner.layer_read_seconds``). The variant
(``--full at-shape``) takes the full-depth rate from the calibration at the row's own depth and
pieces (linear between calibrated depths) instead of the best. Only the 40 streamed layers' read
time changes; the rest of the prediction (memory, host overhead) is the recorded one.

    python benchmarks/replan_streamed.py [--rows 'docs/bench/stream_*/*.json']

Prints, per model, how many rows are within 15% of the measured decode rate, the mean error and
the mean absolute error, then the rows outside 15% under either.
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics
from types import SimpleNamespace

from edgerun.budget.planner import layer_read_seconds
from edgerun.cache.native import parts

EXPERTS, TOP_K, LAYERS = 256, 8, 40  # the bench's Qwen3.6-35B-A3B geometry


def rate_at(reads: list[dict], depth: int, pieces: int) -> float | None:
    """The calibrated rate (B/s) at ``depth`` reads of ``pieces`` parts, linear between depths."""
    pts = sorted((r["queue_depth"], r["gb_per_s"]) for r in reads if r["pieces"] == pieces)
    for d, g in pts:
        if d == depth:
            return g * 1e9
    lo, hi = [p for p in pts if p[0] < depth], [p for p in pts if p[0] > depth]
    if not (lo and hi):
        return None
    (d0, g0), (d1, g1) = lo[-1], hi[0]
    return (g0 + (g1 - g0) * (depth - d0) / (d1 - d0)) * 1e9


def rows(pattern: str):
    """(file, config, measured tok/s, recorded prediction, prediction with the at-shape rate)."""
    for f in sorted(glob.glob(pattern)):
        d = json.load(open(f))
        if not isinstance(d, dict) or "configs" not in d or "storage_read" not in d:
            continue
        reads = d["storage_read"]
        block = reads[0]["block_bytes"]
        best = max(r["gb_per_s"] for r in reads) * 1e9
        for c in d["configs"]:
            pr = c.get("predicted") or {}
            if c.get("bound_kind") != "storage" or not pr.get("tok_s_layered") or not c.get("read_depth"):
                continue
            depth, split = c["read_depth"][0], parts(block, (c.get("read_pieces") or [1])[0])
            same = [r for r in reads if r["pieces"] == split] or [r for r in reads if r["pieces"] == 1]
            single = next((r["gb_per_s"] for r in same if r["queue_depth"] == 1), 0.0) * 1e9
            dev = SimpleNamespace(
                read_depth=depth,
                storage_read_single=single,
                storage_read_bandwidth=best,
                host_read_overhead=3e-4,
            )
            p = 1 - c["quota"] / EXPERTS
            old = layer_read_seconds(TOP_K, p, block, dev)
            dev.storage_read_bandwidth = rate_at(reads, depth, split) or best
            new = layer_read_seconds(TOP_K, p, block, dev)
            t = 1 / pr["tok_s_layered"]
            yield f, c["config"], c["decode_tps"]["median"], 1 / t, 1 / (t + LAYERS * (new - old))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="docs/bench/stream_*/*.json")
    ns = ap.parse_args()
    found = list(rows(ns.rows))
    for name, k in (("recorded (best rate)", 3), ("at-shape rate", 4)):
        errs = [r[k] / r[2] - 1 for r in found]
        print(
            f"{name}: {sum(abs(e) <= 0.15 for e in errs)} of {len(errs)} rows within 15%, mean "
            f"{100 * statistics.mean(errs):+.1f}%, mean absolute {100 * statistics.mean(map(abs, errs)):.1f}%"
        )
    for f, config, meas, old, new in found:
        if abs(old / meas - 1) > 0.15 or abs(new / meas - 1) > 0.15:
            print(
                f"  {f}: {config}: measured {meas:.2f}, {100 * (old / meas - 1):+.0f}% / {100 * (new / meas - 1):+.0f}%"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
