"""Micro-benchmark: the dense decode GEMV over stored weights (``qgemv``, kernels/qlinear_triton.py)
against torch's bf16 ``F.linear`` (cuBLAS), at Qwen3.6-35B-A3B's dense shapes.

    PYTHONPATH=... python3 benchmarks/bench_dense_gemv.py [--reps 50] [--tokens 1,4] [--sweep] [--json out.json]

Each row times CALLS = 20 calls captured in one CUDA graph and replayed (device time, no Python),
per call: median and min/max over --reps replays, CUDA events. The 20 calls cycle over enough
copies of the weight to fill twice the L2, and before each replay (outside the timed region) a
256 MB memset evicts L2 and keeps the clocks up, so the weights come from HBM, as in a decode
step where every layer's weights are read once. *eager*: one ``qgemv`` call from Python (launch
and argument checks included).

Bandwidth = weight bytes a call reads (weight + scales + row scales; bf16 for torch) / median,
against a device-to-device copy measured in the same run (bytes read + written) and the H200's
4.8 TB/s datasheet peak. ``--sweep`` also times a few tile shapes (GemvConfig) per case.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests")]  # bench_moe_kernel's helpers need tests/
from bench_moe_kernel import PEAK, copy_bandwidth, timed  # noqa: E402

from edgerun.kernels import qlinear_triton as K  # noqa: E402
from edgerun.kernels.dense_probe import rel_err  # noqa: E402
from edgerun.kernels.qlinear_reference import qlinear_ref, random_qweight  # noqa: E402
from edgerun.kernels.qweight import QWeight  # noqa: E402

# (R, C): qkv/z/a/b of a DeltaNet layer in one GEMV, o_proj, a 1024-row projection (shared
# gate/up), the shared expert's down, router + shared gate, lm_head
SHAPES = [(12352, 2048), (2048, 4096), (1024, 2048), (2048, 512), (257, 2048), (248320, 2048)]
SCHEMES = [("int4", 32), ("int8", None), ("plain", None)]  # int8 None: one scale per row (group C)
CALLS = 20
SWEEP = [
    K.GemvConfig(*c)
    for c in (
        (4, 512, 2),
        (8, 512, 4),
        (8, 1024, 4),
        (16, 512, 4),
        (16, 256, 2),
        (32, 512, 4),
        (32, 256, 4),
        (8, 256, 1),
        # a whole row of C = 2048 int4 (1 KB) or C = 4096 in one step: with PDL every weight load
        # of a program is issued before it waits for the previous kernel
        (2, 1024, 2),
        (4, 1024, 4),
        (8, 1024, 8),
        (2, 2048, 4),
        (4, 2048, 8),
    )
]


def nbytes(w: QWeight) -> int:
    return sum(t.numel() * t.element_size() for t in w.tensors())


def copies_for(one: int) -> int:
    """Weight copies the graph cycles over: enough to fill twice the L2, at most CALLS."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    return max(1, min(CALLS, math.ceil(2 * l2 / one)))


def weight_copies(w0: QWeight) -> list[QWeight]:
    """w0 and clones of it, as many as ``copies_for`` its bytes: the calls of a graph cycle over
    them, so each call reads its weight from HBM, not L2."""
    tensors = (w0.weight, w0.scales, w0.row_scale)
    return [w0] + [
        QWeight(w0.scheme, *(t.clone() if t is not None else None for t in tensors), w0.group, w0.act)
        for _ in range(copies_for(nbytes(w0)) - 1)
    ]


def graph_times(calls, reps: int, flush) -> list[float]:
    """Seconds per call: ``calls`` (CALLS closures) captured in one graph, replayed ``reps`` times."""
    side = torch.cuda.Stream()  # compile and warm up outside the capture (torch's recipe)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    return [t / len(calls) for t in timed(graph.replay, reps, flush)]


def bench_case(scheme, group, R, C, N, reps, flush, configs) -> dict:
    g = torch.Generator(device="cuda").manual_seed(R + C)
    w0 = random_qweight(scheme, R, C, group or C, g, "cuda", torch.bfloat16)
    weights = weight_copies(w0)
    x = torch.randn(N, C, generator=g, device="cuda").bfloat16()
    outs = [torch.empty(N, R, dtype=torch.bfloat16, device="cuda") for _ in weights]

    def calls(cfg=None):
        return [
            lambda i=i: K.qgemv(x, weights[i % len(weights)], out=outs[i % len(weights)], config=cfg)
            for i in range(CALLS)
        ]

    t_graph = graph_times(calls(), reps, flush)
    err = rel_err(outs[0], qlinear_ref(x, w0))
    t_eager = timed(lambda: K.qgemv(x, w0, out=outs[0]), reps, flush)

    dense = [torch.randn(R, C, generator=g, device="cuda").bfloat16()]
    dense += [dense[0].clone() for _ in range(copies_for(R * C * 2) - 1)]
    dense_out = torch.empty(N, R, dtype=torch.bfloat16, device="cuda")
    t_torch = graph_times(
        [lambda i=i: torch.mm(x, dense[i % len(dense)].t(), out=dense_out) for i in range(CALLS)], reps, flush
    )
    # torch.mm(out=) is what F.linear runs for a 2-D input without bias; checked once here
    assert torch.equal(F.linear(x, dense[0]), torch.mm(x, dense[0].t()))
    sweep = {
        f"r{c.block_r} b{c.row_bytes} w{c.num_warps}": statistics.median(graph_times(calls(c), reps, flush))
        for c in configs
    }
    return dict(
        bytes=nbytes(w0), bf16_bytes=R * C * 2, err=err, graph=t_graph, eager=t_eager, torch=t_torch, sweep=sweep,
        config=K.gemv_config(scheme, R, C).__dict__,
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--tokens", default="1", help="comma-separated N (rows of x) to run, e.g. 1,4,8")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--schemes", default=",".join(s for s, _ in SCHEMES), help="comma-separated subset")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    name = torch.cuda.get_device_name()
    copy_bw = copy_bandwidth()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    report = dict(device=name, torch=torch.__version__, copy_bw=copy_bw, reps=a.reps, calls=CALLS, cases=[])
    print(f"\n{name}; torch {torch.__version__}; device copy {copy_bw / 1e12:.2f} TB/s (read+write)")
    print(f"graph of {CALLS} calls, {a.reps} replays; per call; bf16 activations")
    hdr = (
        f"{'scheme':<8}{'R':>7}{'C':>6}{'N':>3}{'MB':>8}{'graph us':>10}{'min':>7}{'GB/s':>7}{'% copy':>8}"
        f"{'eager us':>10}{'torch bf16 us':>15}{'GB/s':>7}{'speed-up':>10}{'err':>9}"
    )
    print(hdr)
    print("-" * len(hdr))
    for N in (int(n) for n in a.tokens.split(",")):
        for scheme, group in (sg for sg in SCHEMES if sg[0] in a.schemes.split(",")):
            for R, C in SHAPES:
                r = bench_case(
                    scheme, group, R, C, N, a.reps, lambda _i: flush.zero_(), SWEEP if a.sweep else []
                )
                med, tmed = statistics.median(r["graph"]), statistics.median(r["torch"])
                bw, tbw = r["bytes"] / med, r["bf16_bytes"] / tmed
                print(
                    f"{scheme:<8}{R:>7}{C:>6}{N:>3}{r['bytes'] / 1e6:>8.2f}{med * 1e6:>10.1f}{min(r['graph']) * 1e6:>7.1f}"
                    f"{bw / 1e9:>7.0f}{100 * bw / copy_bw:>7.1f}%{statistics.median(r['eager']) * 1e6:>10.1f}"
                    f"{tmed * 1e6:>15.1f}{tbw / 1e9:>7.0f}{tmed / med:>9.2f}x{r['err']:>9.1e}"
                )
                if r["sweep"]:
                    best = min(r["sweep"], key=r["sweep"].get)
                    print(
                        "    sweep us:",
                        "  ".join(f"{k}: {v * 1e6:.1f}" for k, v in r["sweep"].items()),
                        f"(best {best})",
                    )
                report["cases"].append(
                    dict(
                        scheme=scheme, group=group or C, R=R, C=C, tokens=N, bytes=r["bytes"], max_rel_err=r["err"],
                        config=r["config"], median_s=med, min_s=min(r["graph"]), max_s=max(r["graph"]), bytes_per_s=bw,
                        eager_median_s=statistics.median(r["eager"]), torch_bf16_median_s=tmed, torch_bytes_per_s=tbw,
                        sweep_median_s=r["sweep"],
                    )
                )  # fmt: skip
    print(f"\nGB/s against the copy ({copy_bw / 1e9:.0f} GB/s) and the {PEAK / 1e12:.1f} TB/s datasheet peak")
    if a.json:
        a.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
