"""Micro-benchmark of the W4A8 GEMV experiment (kernels/qlinear_w4a8.py) against the int4 decode
GEMV the engine runs (``qgemv``, W4A16), one row of x, at Qwen3.6-35B-A3B's dense shapes.

    PYTHONPATH=... python3 -P benchmarks/bench_w4a8_gemv.py [--reps 15] [--json out.json]   # a GPU
    PYTHONPATH=... python3 -P benchmarks/bench_w4a8_gemv.py --sass                          # any machine

Timing as benchmarks/bench_dense_gemv.py: 20 calls in one CUDA graph, weights cycled over enough
copies to fill twice the L2, L2 evicted before each replay; µs a call, median and range. Rows:
``qgemv`` (the engine's default tile); W4A8 with x quantized beforehand (``quantize_x`` outside
the graph: what a producer that writes x quantized would give); W4A8 quantizing its slice of x in
the kernel; ``quantize_x`` + W4A8 as two launches. Each W4A8 tile's output is checked against
its reference (tests/kernels/w4a8_cases.py's bound) and its relative error against W4A16 shown.
``--sass``: SASS instructions a weight value of each tile (compiled for sm_90 on the CPU, as
benchmarks/sass_mma_gemv.py counts ``qgemv``'s 4.3).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests"), str(ROOT / "tests" / "kernels")]

from edgerun.kernels import qlinear_w4a8 as M  # noqa: E402

SHAPES = {
    "in_proj": (12352, 2048),
    "out_proj": (2048, 4096),
    "shared gate_up": (1024, 2048),
    "lm_head": (248320, 2048),
}
TILES = [
    (16, 512, 2),
    (32, 512, 4),
    (16, 1024, 4),
    (8, 1024, 4),
    (4, 1024, 4),
    (32, 1024, 8),
    (64, 512, 4),
    (8, 2048, 4),
]


def sass() -> None:
    import sass_mma_gemv as S

    S.POINTERS.update(xe="*i32", xo="*i32", xs="*fp32", xb="*i32")
    print(
        f"{'C':>6} {'tile (rows, cols a step, warps)':<32}{'x given':>10}{'x inside':>10}  (SASS a weight value)"
    )
    for C in (2048, 4096):
        for br, bk, nw in TILES:
            if C % bk:
                continue
            per = []
            for inside in (False, True):
                const = dict(C=C, BLOCK_R=br, BLOCK_K=bk, QUANT_X=inside, PDL=True, INTERPRET=False)
                per.append(sum(S.sass_ops(M._w4a8_kernel, const, nw).values()) / (br * C / (32 * nw)))
            print(f"{C:>6} {str((br, bk, nw)):<32}{per[0]:>10.2f}{per[1]:>10.2f}")


def bench_shape(label: str, reps: int, flush, copy_bw: float, fmt) -> dict:
    import torch
    from bench_dense_gemv import CALLS, graph_times, nbytes, weight_copies
    from w4a8_cases import FP32_TERMS, make

    from edgerun.kernels import qlinear_triton as K
    from edgerun.kernels.dense_probe import rel_err
    from edgerun.kernels.qlinear_reference import qlinear_ref

    R, C = SHAPES[label]
    w0, x = make(R, C, "cuda", R)
    weights = weight_copies(w0)
    outs = [torch.empty(R, dtype=torch.bfloat16, device="cuda") for _ in weights]
    xq = M.quantize_x(x)

    def series(call) -> list[float]:  # call(weight, out): CALLS of them in one graph, cycling the copies
        return graph_times([lambda i=i: call(weights[i % len(weights)], outs[i % len(weights)]) for i in range(CALLS)],
                           reps, flush)  # fmt: skip

    ideal = nbytes(w0) / copy_bw  # at the copy's rate (read + write bytes), as the decode bound counts
    row = dict(shape=label, R=R, C=C, bytes=nbytes(w0), ideal_s=ideal, tiles={})
    row["qgemv"] = series(lambda w, out: K.qgemv(x[None], w, out=out[None]))
    print(
        f"\n{label} [{R}, {C}], {nbytes(w0) / 1e6:.1f} MB (its bytes at the copy's rate: {ideal * 1e6:.2f} us)"
    )
    print(f"  qgemv W4A16 (engine tile {K.gemv_config('int4', R, C).__dict__}): {fmt(row['qgemv'])}")
    a16 = qlinear_ref(x[None], w0, exact_weight=True)[0]
    terms = M.w4a8_terms(x, w0)
    exact, bound = terms.sum(1), FP32_TERMS * 2.0**-24 * terms.abs().sum(1)
    del terms
    for br, bk, nw in TILES:
        if C % bk:
            continue
        cfg = M.W4A8Config(br, bk, nw)
        y = M.w4a8_gemv(x, w0, xq, out=torch.empty(R, dtype=torch.float32, device="cuda"), config=cfg)
        ok = bool(((y.double() - exact).abs() <= bound).all())
        given = series(lambda w, out, cfg=cfg: M.w4a8_gemv(x, w, xq, out=out, config=cfg))
        inside = series(lambda w, out, cfg=cfg: M.w4a8_gemv(x, w, None, out=out, config=cfg))
        pair = series(lambda w, out, cfg=cfg: M.w4a8_gemv(x, w, M.quantize_x(x), out=out, config=cfg))
        err = rel_err(M.w4a8_gemv(x, w0, xq, config=cfg), a16)
        print(
            f"  W4A8 {str((br, bk, nw)):<16} x given {fmt(given)}  inside {fmt(inside)}  quantize_x + it {fmt(pair)}"
            f"  ref {'ok' if ok else 'MISMATCH'}  rel err vs W4A16 {err:.4f}"
        )
        row["tiles"][f"{br},{bk},{nw}"] = dict(given=given, inside=inside, pair=pair, ref_ok=ok, rel_err=err)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--sass", action="store_true")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    if a.sass:
        return sass()

    import torch
    from bench_dense_gemv import CALLS
    from bench_moe_kernel import copy_bandwidth

    name = torch.cuda.get_device_name()
    copy_bw = copy_bandwidth()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    report = dict(device=name, torch=torch.__version__, copy_bw=copy_bw, reps=a.reps, calls=CALLS, cases=[])
    print(
        f"\n{name}; torch {torch.__version__}; device copy {copy_bw / 1e12:.2f} TB/s; us a call, median (range)"
    )

    def fmt(ts):
        return f"{statistics.median(ts) * 1e6:7.2f} ({min(ts) * 1e6:.2f}-{max(ts) * 1e6:.2f})"

    for label in a.shapes.split(","):
        report["cases"].append(bench_shape(label, a.reps, lambda _i: flush.zero_(), copy_bw, fmt))
    if a.json:
        a.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
