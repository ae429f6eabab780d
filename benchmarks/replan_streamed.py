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

    python benchmarks/replan_streamed.py [--rows 'docs/bench/stream_*/*.json'] [--planner]

Prints, per model, how many rows are within 15% of the measured decode rate, the mean error and
the mean absolute error, then the rows outside 15% under either.

``--planner``: instead, each row planned again by today's planner (``edgerun plan`` of the bench's
geometry, Qwen3.6-35B-A3B with int4 dense, at the row's quota, staging and read shape, with the
call's calibration: best median rate, a read alone at the row's pieces, device copy and PCIe) and
set beside the model of the way it decoded: with prefetch, ``tok_s_prefetch``; without,
``tok_s_layered``; where the row has the disk's reads around it, at their mean too; and at the
disk's rate while busy in the row (a diagnostic of the model's structure, not a prediction).
"""

from __future__ import annotations

import argparse
import glob
import json
import re
import statistics
from functools import cache
from types import SimpleNamespace

from edgerun.budget.planner import layer_read_seconds
from edgerun.cache.native import parts

EXPERTS, TOP_K, LAYERS = 256, 8, 40  # the bench's Qwen3.6-35B-A3B geometry
MODEL = "configs/models/qwen3.6-35b-a3b.json"  # that geometry, for the planner


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


@cache
def model_input():
    """The bench's geometry as the planner takes it, read once for every row."""
    from edgerun.budget import inputs

    return inputs.from_config_file(MODEL)


def replan(row: dict, reads: list[dict], copy: dict, gb_s: float):
    """The row planned again (a :class:`~edgerun.budget.planner.Prediction`): its quota, staging
    and read shape, the disk at ``gb_s`` (GB/s; a read alone scaled from the calibration's by as
    much as ``gb_s`` is from the best median rate)."""
    from edgerun.budget.planner import PlanOptions, plan
    from edgerun.bundle.dense_layout import DenseScheme
    from edgerun.config import device_profile_from_dict

    block = reads[0]["block_bytes"]
    split = parts(block, (row.get("read_pieces") or [1])[0])
    same = [r for r in reads if r["pieces"] == split] or [r for r in reads if r["pieces"] == 1]
    best = max(r["gb_per_s"] for r in reads)
    single = next((r["gb_per_s"] for r in same if r["queue_depth"] == 1), best) * gb_s / best
    dev = device_profile_from_dict(
        {
            "name": "replanned",
            "memory_kind": "discrete",
            "memory_cap": 80 * 2**30,
            "os_reserve": 0,
            "cuda_context": 0,
            "pinned_limit": 256 * 2**20,  # as the bench's plans: page-locked staging only, no host tier
            "host_memory_cap": 128 * 2**30,
            "host_reserve": 8 * 2**30,
            "memory_bandwidth": copy["d2d_gb_per_s"] * 1e9,
            "pcie_bandwidth": copy["h2d_pinned_gb_per_s"] * 1e9,
            "storage_read_bandwidth": gb_s * 1e9,
            "storage_read_single": single * 1e9,
            "read_depth": row["read_depth"][0],
            "compute_capability": "9.0",
        }
    )
    model = model_input()
    staging = re.search(r"staging (\d+)", row["config"])
    options = PlanOptions(
        dense=DenseScheme.resolve("int4", None, None, model.args.tie_word_embeddings),
        staging_buffers=int(staging.group(1)) if staging else None,
        quota=row["quota"],
    )
    return plan(model.args, model.specs, model.experts, dev, 64, 1, options, model_name=model.name).prediction


def replanned(pattern: str) -> None:
    """Every streamed row against today's planner, by the model of the way it decoded."""
    errs: dict[str, list[float]] = {}
    for f in sorted(glob.glob(pattern)):
        d = json.load(open(f))
        if not isinstance(d, dict) or "configs" not in d or "storage_read" not in d:
            continue
        reads, best = d["storage_read"], max(r["gb_per_s"] for r in d["storage_read"])
        for c in d["configs"]:
            if c.get("bound_kind") != "storage" or not c.get("read_depth") or "decode_tps" not in c:
                continue
            model = "prefetch" if c.get("prefetch_depth") else "layered"
            measured = c["decode_tps"]["median"]
            # the calibration's rate (the prediction), the disk's right before and after the row (a
            # prediction free of the disk's drift), and its rate while busy in the row itself (not a
            # prediction: the model's structure apart from the disk's rate)
            at = [("calibration", best)]
            at += [("around", statistics.fmean(c["storage_around"]))] if c.get("storage_around") else []
            at += [("busy", c["busy_gbs"]["median"])] if c.get("busy_gbs") else []
            line = []
            for name, gb_s in at:
                pr = replan(c, reads, d["device_copy"], gb_s)
                e = (pr.tok_s_prefetch if model == "prefetch" else pr.tok_s_layered) / measured - 1
                errs.setdefault(f"{model}, {name}", []).append(e)
                line.append(f"{name} {100 * e:+.0f}%")
            print(f"  {f}: {c['config']}: measured {measured:.2f}, {model}: {', '.join(line)}")
    for key, es in errs.items():
        print(
            f"{key}: {sum(abs(e) <= 0.15 for e in es)} of {len(es)} rows within 15%, mean "
            f"{100 * statistics.mean(es):+.1f}%, range {100 * min(es):+.0f}% to {100 * max(es):+.0f}%"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="docs/bench/stream_*/*.json")
    ap.add_argument("--planner", action="store_true", help="each row planned again by today's planner")
    ns = ap.parse_args()
    if ns.planner:
        replanned(ns.rows)
        return 0
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
