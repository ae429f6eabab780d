"""Micro-benchmark: the tensor-core GEMV (``qgemv_mma``, kernels/qlinear_mma.py) against ``qgemv``
(kernels/qlinear_triton.py) in one pass over all rows (shared) and with each row by programs of
its own (alone), for N = 1, 2, 4, 8, 16 rows of x at Qwen3.6-35B-A3B's dense shapes, int4 g32.

    PYTHONPATH=... python3 benchmarks/bench_mma_gemv.py [--reps 5] [--tokens 1,2,4,8,16] [--sweep] [--json out.json]

Each cell times CALLS = 20 calls captured in one CUDA graph and replayed --reps times, a 256 MB
memset evicting L2 before each replay (outside the timed region): us per call, median (the
calls cycle over enough weight copies to fill twice the L2; bench_dense_gemv.py's method).
``qgemv`` takes at most 8 rows: N = 16 has no qgemv cells. ``err``: qgemv_mma's max error
against ``qlinear_ref`` relative to the output's scale, at each N. ``--sweep`` also times
a few MmaConfig tiles for qgemv_mma at the smallest and largest N (about a minute more).
About a minute on an H200 without it, most of it compiling.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests")]
from bench_dense_gemv import CALLS, graph_times, weight_copies  # noqa: E402

from edgerun.kernels import qlinear_mma as MMA  # noqa: E402
from edgerun.kernels import qlinear_triton as K  # noqa: E402
from edgerun.kernels.dense_probe import rel_err  # noqa: E402
from edgerun.kernels.qlinear_reference import qlinear_ref, random_qweight  # noqa: E402

# (R, C, epilogue): lm_head, a DeltaNet layer's qkv/z/a/b in one GEMV, o_proj, shared gate/up
SHAPES = [(248320, 2048, "none"), (12352, 2048, "none"), (2048, 4096, "none"), (1024, 2048, "silu_mul")]


def bench_shape(R, C, epilogue, tokens, reps, flush, sweep) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(R + C)
    w0 = random_qweight("int4", R, C, 32, g, "cuda", torch.bfloat16)
    weights = weight_copies(w0)
    width = R // 2 if epilogue == "silu_mul" else R
    xs = torch.randn(max(tokens), C, generator=g, device="cuda").bfloat16()
    rows = []
    for N in tokens:
        x = xs[:N]
        outs = [torch.empty(N, width, dtype=torch.bfloat16, device="cuda") for _ in weights]

        def us(call, x=x, outs=outs):  # call(x, w, out) on each weight copy in turn
            n = len(weights)
            calls = [lambda i=i: call(x, weights[i % n], outs[i % n]) for i in range(CALLS)]
            return statistics.median(graph_times(calls, reps, flush)) * 1e6

        row = dict(R=R, C=C, epilogue=epilogue, tokens=N)
        row["mma_us"] = us(lambda x, w, o: MMA.qgemv_mma(x, w, epilogue=epilogue, out=o))
        row["err"] = rel_err(outs[0], qlinear_ref(x, w0, epilogue=epilogue))
        if N <= K.MAX_TOKENS:
            row["shared_us"] = us(lambda x, w, o: K.qgemv(x, w, epilogue=epilogue, out=o))
            row["alone_us"] = us(lambda x, w, o: K.qgemv(x, w, epilogue=epilogue, out=o, alone=True))
        row["sweep_us"] = {
            f"r{c.block_r} k{c.block_k} w{c.num_warps}": us(
                lambda x, w, o, c=c: MMA.qgemv_mma(x, w, epilogue=epilogue, out=o, config=c)
            )
            for c in (sweep if N in (1, max(tokens)) else [])
        }
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tokens", default="1,2,4,8,16", help="comma-separated N (rows of x), at most 16")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    tokens = [int(n) for n in a.tokens.split(",")]
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    name = torch.cuda.get_device_name()
    print(f"\n{name}; torch {torch.__version__}; int4 g32, bf16 x; graph of {CALLS} calls, L2 flushed;")
    print(f"median of {a.reps} replays, us per call; x = qgemv's time over qgemv_mma's")
    hdr = (
        f"{'R':>7}{'C':>6} {'epilogue':<9}{'N':>3}{'mma':>9}{'shared':>9}{'alone':>9}"
        f"{'vs shared':>11}{'vs alone':>10}{'mma/N=1':>9}{'err':>9}"
    )
    print(hdr)
    print("-" * len(hdr))
    report = dict(device=name, torch=torch.__version__, reps=a.reps, calls=CALLS, rows=[])
    for R, C, epilogue in SHAPES:
        rows = bench_shape(
            R, C, epilogue, tokens, a.reps, lambda _i: flush.zero_(), MMA.SWEEP_TILES if a.sweep else []
        )
        one = rows[0]["mma_us"]
        for r in rows:
            sh, al = r.get("shared_us"), r.get("alone_us")
            cells = [f"{v:>9.1f}" if v else f"{'-':>9}" for v in (r["mma_us"], sh, al)]
            ratios = [
                f"{v / r['mma_us']:>{n}.2f}x" if v else f"{'-':>{n + 1}}" for v, n in ((sh, 10), (al, 9))
            ]
            print(
                f"{R:>7}{C:>6} {epilogue:<9}{r['tokens']:>3}{''.join(cells)}{''.join(ratios)}"
                f"{r['mma_us'] / one:>8.2f}x{r['err']:>9.1e}"
            )
            if r["sweep_us"]:
                print("    mma tiles us:", "  ".join(f"{k}: {v:.1f}" for k, v in r["sweep_us"].items()))
        report["rows"] += rows
    if a.json:
        a.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
