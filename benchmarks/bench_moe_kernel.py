"""Micro-benchmark: the routed-expert step of T decode tokens (1: one sequence; 4: a batch step
of four), Triton kernels vs the torch reference, on the real geometry (Qwen3.6-35B-A3B: D 2048,
I 512, A 8 of a pool of all 256 experts).

    PYTHONPATH=... python3 benchmarks/bench_moe_kernel.py [--reps 100] [--tokens 1,4] [--json out.json]

Times with CUDA events after a warm-up, median and min/max over --reps calls. Every call routes
each token to a fresh set of 8 slots of the 256 (64 routings in rotation), and before each call (outside
the timed region) a 256 MB memset evicts L2 (60 MB) and keeps the GPU's clocks up, so the
blocks come from HBM. Rows:

- triton graph: one captured ``moe_gemv`` (sort, 2 kernels) replayed: device time, no Python;
- triton eager: ``moe_gemv`` called from Python (launch overhead included);
- grouped graph (``--grouped``): one captured ``moe_grouped`` (the prefill's grouped GEMM) on
  the same tokens, to place ``gemv_max_tokens``;
- reference: ``moe_experts_ref`` (dequantize_block + torch matmul per expert), bf16;
- triton graph a8 (int4 g32 unrotated): the graph with x given quantized to int8 per 32 columns
  (``moe_gemv``'s ``xq``, as the router's launch would store it): W4A8 gate_up products; its
  error against the bf16 reference is int8 x's (about 0.5%), not the kernel's.

Bandwidth = payload bytes of the distinct blocks the step must read (weights + scales; padding not
counted; T = 4 tokens route to about 30.5 distinct experts) / median time, against a device-to-device copy measured in the same run (bytes read +
written) and the H200's 4.8 TB/s datasheet peak. A sweep of the GEMV tile shapes follows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "tests" / d) for d in ("kernels", "")]
from moe_cases import fmt_id, layout_for, random_step, rel_err  # noqa: E402

from edgerun.kernels import moe_triton as K  # noqa: E402
from edgerun.kernels.moe_reference import moe_experts_ref, random_pool  # noqa: E402
from edgerun.kernels.qlinear_w4a8 import quantize_rows_ref  # noqa: E402

D, I, A, S = 2048, 512, 8, 256
PEAK = 4.8e12
FORMATS = [("int4", 32, "none"), ("int4", 32, "hadamard"), ("int8", None, "none"), ("bf16", None, "none")]
SWEEP = "4,512,2,8 4,512,2,32 8,256,2,16 8,256,2,32 4,512,4,32"  # block_r, row_bytes, num_warps, down_rows


def timed(fn, reps: int, before=None, warmup: int = 5) -> list[float]:
    """Seconds per call, from CUDA events around each call (``before`` runs outside the timing)."""
    for i in range(warmup):
        if before:
            before(i)
        fn()
    torch.cuda.synchronize()
    times = []
    for i in range(reps):
        if before:
            before(i)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return times


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / statistics.median(timed(lambda: dst.copy_(src), 20))


def bench_format(fmt, T: int, reps: int, configs: list, reference: bool, grouped: bool = False) -> dict:
    layout = layout_for(fmt, hidden=D, inter=I)
    g = torch.Generator(device="cuda").manual_seed(0)
    pool, gscales = random_pool(layout, S, generator=g, device="cuda")
    identity = torch.arange(S, device="cuda")
    steps = [
        random_step(layout, T, A, S, g, "cuda", torch.bfloat16, pool, gscales, identity) for _ in range(64)
    ]
    x, _, slots, ids, w, _, _ = (t.clone() if torch.is_tensor(t) else t for t in steps[0])

    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    a8 = K.a8_unsupported(layout) is None
    xqs = [quantize_rows_ref(st[0].float()) for st in steps] if a8 else None
    xq = [t.clone() for t in xqs[0]] if a8 else None

    def load(i):  # the next routing, into the static inputs the graph reads; then evict L2
        s = steps[i % len(steps)]
        x.copy_(s[0]), slots.copy_(s[2]), ids.copy_(s[3]), w.copy_(s[4])
        if a8:
            for t, v in zip(xq, xqs[i % len(steps)]):
                t.copy_(v)
        flush.zero_()

    def gemv(cfg=K.DEFAULT_GEMV):
        return K.moe_gemv(x, pool, slots, ids, w, layout, gscales, config=cfg)

    def graph_times(cfg, step=None):
        step = step or (lambda: gemv(cfg))
        for i in range(3):
            load(i)
            step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        load(5)
        graph.replay()
        ref = moe_experts_ref(x.float(), pool, slots, ids, w, layout, gscales)
        err = rel_err(out, ref)
        return timed(graph.replay, reps, load), err

    distinct = statistics.mean(len(set(st[2].flatten().tolist())) for st in steps)
    payload = distinct * layout.payload_bytes
    rows = {}
    t_graph, err = graph_times(K.DEFAULT_GEMV)
    rows["triton graph"] = t_graph
    rows["triton eager"] = timed(gemv, reps, load)
    if grouped:  # the prefill kernel on the same tokens: where the GEMV stops paying (gemv_max_tokens)
        rows["grouped graph"], _ = graph_times(
            None, lambda: K.moe_grouped(x, pool, slots, ids, w, layout, gscales)
        )
    errs = {"triton graph": err}
    if a8:
        rows["triton graph a8"], errs["triton graph a8"] = graph_times(
            None, lambda: K.moe_gemv(x, pool, slots, ids, w, layout, gscales, xq=tuple(xq))
        )
    if reference:
        rows["reference"] = timed(
            lambda: moe_experts_ref(x, pool, slots, ids, w, layout, gscales), reps, load
        )
    kernels = profile(gemv, load)
    if a8:
        a8_kernels = profile(lambda: K.moe_gemv(x, pool, slots, ids, w, layout, gscales, xq=tuple(xq)), load)
        kernels |= {f"{k} (a8)": v for k, v in a8_kernels.items()}
    sweep = {}
    for cfg in configs:
        sweep[f"r{cfg.block_r} b{cfg.row_bytes} w{cfg.num_warps} d{cfg.down_rows}"] = statistics.median(
            graph_times(cfg)[0]
        )
    return dict(
        layout=layout, payload=payload, distinct=distinct, rows=rows, err=err, errs=errs, sweep=sweep,
        kernels=kernels,
    )  # fmt: skip


def profile(step, load) -> dict:
    """Device µs a kernel of one ``step`` (torch.profiler, mean of 20 calls, each after ``load``)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for i in range(20):
            load(i)
            step()
        torch.cuda.synchronize()
    return {
        e.key: e.device_time_total / e.count
        for e in prof.key_averages()
        if e.device_time_total > 0 and e.count >= 20
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument(
        "--sweep", default=SWEEP, help="tiles: block_r,row_bytes,num_warps,down_rows separated by spaces"
    )
    ap.add_argument("--tokens", default="1", help="token counts T, comma-separated")
    ap.add_argument(
        "--formats", default=",".join(map(fmt_id, FORMATS)), help="of " + ",".join(map(fmt_id, FORMATS))
    )
    ap.add_argument("--no-reference", action="store_true", help="skip the (slow) torch reference path")
    ap.add_argument("--grouped", action="store_true", help="time the prefill's grouped GEMM too")
    a = ap.parse_args()
    name = torch.cuda.get_device_name()
    copy_bw = copy_bandwidth()
    configs = [] if a.no_sweep else [K.GemvConfig(*map(int, c.split(","))) for c in a.sweep.split()]
    chosen = [f for f in FORMATS if fmt_id(f) in a.formats.split(",")]
    results = {
        (fmt, T): bench_format(fmt, T, a.reps, configs, not a.no_reference, a.grouped)
        for T in map(int, a.tokens.split(","))
        for fmt in chosen
    }
    report = dict(device=name, torch=torch.__version__, copy_bw=copy_bw, reps=a.reps, formats=[])
    print(f"\n{name}; torch {torch.__version__}; device copy {copy_bw / 1e12:.2f} TB/s (read+write)")
    print(f"A={A}, D={D}, I={I}, pool {S} slots, {a.reps} reps; default tile {K.DEFAULT_GEMV}")
    hdr = f"{'format':<22}{'path':<16}{'median us':>10}{'min us':>9}{'max us':>9}{'GB/s':>8}{'% copy':>8}{'% 4.8T':>8}"
    print(hdr)
    print("-" * len(hdr))
    for (fmt, T), r in results.items():
        label = f"{fmt_id(fmt)} T={T}"
        entry = dict(
            format=fmt_id(fmt),
            tokens=T,
            payload_bytes=r["payload"],
            distinct_experts=r["distinct"],
            max_rel_err=r["err"],
            max_rel_err_by_path=r["errs"],
            sweep=r["sweep"],
            paths={},
        )
        entry["kernels_us"] = r["kernels"]
        for path, ts in r["rows"].items():
            med = statistics.median(ts)
            bw = r["payload"] / med
            entry["paths"][path] = dict(median_s=med, min_s=min(ts), max_s=max(ts), bytes_per_s=bw)
            print(
                f"{label:<22}{path:<16}{med * 1e6:>10.1f}{min(ts) * 1e6:>9.1f}{max(ts) * 1e6:>9.1f}"
                f"{bw / 1e9:>8.0f}{100 * bw / copy_bw:>7.1f}%{100 * bw / PEAK:>7.1f}%"
            )
        print(
            f"{'':<22}(max error {', '.join(f'{k} {v:.1e}' for k, v in r['errs'].items())} of the output's scale; {r['distinct']:.1f} experts, "
            f"{r['payload'] / 1e6:.1f} MB read)"
        )
        report["formats"].append(entry)
    print("\nDevice time per kernel of one moe_gemv call (torch profiler, mean of 20, us)")
    for (fmt, T), r in results.items():
        print(
            f"{fmt_id(fmt) + f' T={T}':<20}", "  ".join(f"{k[:40]}: {v:.1f}" for k, v in r["kernels"].items())
        )
    if not a.no_sweep:
        print(
            "\nGEMV tile sweep (graph replay, median us): r = h columns/program, b = row bytes/step, w = warps, d = down rows/program"
        )
        for (fmt, T), r in results.items():
            print(
                f"{fmt_id(fmt) + f' T={T}':<20}",
                "  ".join(f"{k}: {v * 1e6:.1f}" for k, v in r["sweep"].items()),
            )
    if a.json:
        a.json.write_text(json.dumps(report, indent=1))
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
