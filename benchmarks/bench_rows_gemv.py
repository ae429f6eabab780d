"""Micro-benchmark: ``qgemv`` over N = 1..8 rows (a batch step, a verify window) per tile shape,
unrolled against rolled steps, and whether each row of an N-row call is the one-row call's row.

    PYTHONPATH=... python3 benchmarks/bench_rows_gemv.py [--reps 20] [--tokens 1,2,4,8] [--planes] [--json out.json]

A batch step and a speculative verify window run every projection once for all their rows
(``qgemv`` without ``alone``), and a row's bits must be what the same request's one-row step
computes: the tile (GemvConfig) decides the reduction order, so it is fixed per weight for every
row count, and only how a program walks its steps may change with N (``rolled``: a loop whose
next step's words are read one step ahead, instead of every step unrolled). This bench times,
for each candidate tile, N = 1 unrolled (the one-row step) and N > 1 unrolled and rolled, and
checks each N-row call's rows against N = 1 unrolled with ``torch.equal``.

``--planes`` also times the nibble-plane tensor-core GEMV (kernels/qlinear_planes.py, the
shape's epilogue) for N up to 16 per tile (rows a program, warps, column split; by default the
shape's tile and its neighbours), with the same row check against its own one-row call and its
error against ``qlinear_ref``.

Timing as in bench_dense_gemv: CALLS calls in one CUDA graph, replayed --reps times with L2
evicted before each replay; per call, median and range.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests")]
from bench_dense_gemv import CALLS, graph_times, nbytes, weight_copies  # noqa: E402
from bench_moe_kernel import copy_bandwidth  # noqa: E402

from edgerun.kernels import qlinear_triton as K  # noqa: E402
from edgerun.kernels.qlinear_reference import random_norm, random_qweight  # noqa: E402

# (name, R, C, epilogue): Qwen3.6-35B-A3B's dense projections at int4 g32
SHAPES = [  # (name, R, C, epilogue[, RMSNorm prologue kind])
    ("lm_head", 248320, 2048, "none"),
    ("deltanet in_proj", 12352, 2048, "none"),
    ("out_proj", 2048, 4096, "residual"),
    ("shared gate_up", 1024, 2048, "silu_mul"),
    ("shared down", 2048, 512, "residual"),
    ("lm_head+norm", 248320, 2048, "none", "unit"),  # the decoder's final norm in the prologue
    ("in_proj+norm", 12352, 2048, "none", "unit"),  # the layer's input norm in the prologue
]
TILES = [
    (16, 256, 2),
    (16, 256, 4),
    (8, 256, 2),
    (32, 256, 4),
    (16, 128, 2),
    (2, 512, 4),
    (4, 512, 4),
    (8, 512, 4),
]


def case(name, R, C, epilogue, tiles, tokens, reps, flush, save, kind=None, act="bf16") -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(R + C)
    norm = random_norm(kind, C, g, "cuda", torch.bfloat16) if kind else None
    w0 = dataclasses.replace(random_qweight("int4", R, C, 32, g, "cuda", torch.bfloat16), act=act)
    ws = weight_copies(w0)
    width = R // 2 if epilogue == "silu_mul" else R
    xs = torch.randn(max(tokens), C, generator=g, device="cuda").bfloat16()
    resid = torch.randn(max(tokens), width, generator=g, device="cuda").bfloat16()
    rows = []
    for tile in tiles:
        cfg = K.GemvConfig(*tile)
        alone = None
        for N in tokens:
            for rolled in (False,) if N == 1 else (False, True):
                x = xs[:N]
                outs = [resid[:N].clone() for _ in ws]

                def call(i, x=x, outs=outs, cfg=cfg, rolled=rolled):
                    o = outs[i % len(ws)]
                    return K.qgemv(
                        x, ws[i % len(ws)], epilogue=epilogue, out=o, config=cfg, rolled=rolled, norm=norm
                    )

                t = graph_times([lambda i=i: call(i) for i in range(CALLS)], reps, flush)
                outs[0].copy_(resid[:N])  # the residual epilogue added into it on every replay
                y = call(0)
                torch.cuda.synchronize()
                if N == 1:
                    alone = [
                        call_one(xs[j : j + 1], w0, epilogue, resid[j : j + 1], cfg, norm)
                        for j in range(max(tokens))
                    ]
                same = all(torch.equal(y[j], alone[j][0]) for j in range(N))
                med = statistics.median(t)
                rows.append(
                    dict(shape=name, R=R, C=C, epilogue=epilogue, act=act, tile=list(tile), tokens=N, rolled=rolled,
                         median_s=med, min_s=min(t), max_s=max(t), bytes=nbytes(w0), rows_equal_one_row=same)
                )  # fmt: skip
                print(
                    f"{name:<17}{str(tile):<15}{N:>3}{'rolled' if rolled else 'unrolled':>10}"
                    f"{med * 1e6:>9.1f}{min(t) * 1e6:>8.1f}{max(t) * 1e6:>8.1f}{nbytes(w0) / med / 1e9:>7.0f}"
                    f"{'  rows == one-row' if same else '  ROWS DIFFER'}",
                    flush=True,
                )
                save(rows)
    return rows


def plane_tiles(R: int, C: int, given: str | None) -> list:
    """``given`` ("block_r,warps,split,stages,prefetch;..."), or the weight's default tile and its
    neighbours: L2 prefetch before the grid sync, 64-row programs, 8 warps, the split doubled
    (while a program keeps a whole step) and halved."""
    from dataclasses import replace

    from edgerun.kernels.qlinear_planes import PlanesConfig, planes_config

    if given:
        return [
            PlanesConfig(*(int(v) for v in t.split(","))) for t in given.split(";")
        ]  # block_r, warps, split, stages, prefetch
    d = planes_config(R, C, 32)
    out = [d, replace(d, prefetch=4), planes_config(R, C, 32, 64, 4), planes_config(R, C, 32, 128, 8)]
    out += [replace(d, split=d.split * 2)] if C % (d.split * 2 * 128) == 0 else []
    return out + ([replace(d, split=d.split // 2)] if d.split > 1 else [])


def planes_case(name, R, C, epilogue, tiles, tokens, reps, flush, save, kind=None) -> list[dict]:
    """``qgemv_planes`` (kernels/qlinear_planes.py) per tile and N, with the shape's epilogue:
    time, the error against ``qlinear_ref``, and each N-row call's rows against its one-row call."""
    from edgerun.kernels.dense_probe import rel_err
    from edgerun.kernels.qlinear_planes import planes_counters, planes_weight, qgemv_planes
    from edgerun.kernels.qlinear_reference import qlinear_ref

    g = torch.Generator(device="cuda").manual_seed(R + C)
    norm = random_norm(kind, C, g, "cuda", torch.bfloat16) if kind else None
    w0 = random_qweight("int4", R, C, 32, g, "cuda", torch.bfloat16)
    ws = [planes_weight(w) for w in weight_copies(w0)]
    count = planes_counters(ws[0], "cuda")
    width = R // 2 if epilogue == "silu_mul" else R
    xs = torch.randn(max(tokens), C, generator=g, device="cuda").bfloat16()
    resid = torch.randn(max(tokens), width, generator=g, device="cuda").bfloat16()
    rows = []
    for cfg in tiles:
        tile = (cfg.block_r, cfg.num_warps, cfg.split, cfg.num_stages, cfg.prefetch)
        one = None

        def run(x, k, out, cfg=cfg):
            return qgemv_planes(x, ws[k], None, epilogue, out, norm=norm, config=cfg, count=count)

        for N in tokens:
            outs = [resid[:N].clone() for _ in ws]
            t = graph_times(
                [lambda i=i, x=xs[:N], o=outs: run(x, i % len(ws), o[i % len(ws)]) for i in range(CALLS)],
                reps,
                flush,
            )
            y = run(xs[:N], 0, resid[:N].clone())
            if N == 1:
                one = [run(xs[j : j + 1], 0, resid[j : j + 1].clone()) for j in range(max(tokens))]
            same = all(torch.equal(y[j], one[j][0]) for j in range(N))
            err = rel_err(y, qlinear_ref(xs[:N], w0, None, epilogue, resid[:N].clone(), norm=norm))
            med = statistics.median(t)
            rows.append(
                dict(shape=name, R=R, C=C, epilogue=epilogue, kernel="planes", tile=list(tile), tokens=N,
                     median_s=med, min_s=min(t), max_s=max(t), bytes=nbytes(w0), rows_equal_one_row=same,
                     rel_err=err)
            )  # fmt: skip
            print(
                f"{name:<17}{'planes ' + str(tile):<15}{N:>3}{'mma':>10}{med * 1e6:>9.1f}"
                f"{min(t) * 1e6:>8.1f}{max(t) * 1e6:>8.1f}{nbytes(w0) / med / 1e9:>7.0f}"
                f"{'  rows == one-row' if same else '  ROWS DIFFER'}  err {err:.1e}",
                flush=True,
            )
            save(rows)
    return rows


def call_one(x, w, epilogue, resid, cfg, norm=None):
    out = resid.clone()
    return K.qgemv(x, w, epilogue=epilogue, out=out, config=cfg, rolled=False, norm=norm)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--tokens", default="1,2,4,8")
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    ap.add_argument("--tiles", default=";".join(",".join(map(str, t)) for t in TILES))
    ap.add_argument("--planes", action="store_true", help="also time qgemv_planes (no epilogue), N up to 16")
    ap.add_argument(
        "--plane-tiles", help="block_r,warps,split;... (default: each shape's tile and neighbours)"
    )
    ap.add_argument("--only-planes", action="store_true", help="time qgemv_planes only")
    ap.add_argument("--plane-first", type=int, help="time only the first K of each shape's planes tiles")
    ap.add_argument("--act", choices=["bf16", "int8"], default="bf16", help="int8: W4A8 (x quantized per 32)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    tokens = [int(n) for n in a.tokens.split(",")]
    tiles = [tuple(int(v) for v in t.split(",")) for t in a.tiles.split(";")]
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    copy_bw = copy_bandwidth()
    name = torch.cuda.get_device_name()
    print(
        f"{name}; torch {torch.__version__}; copy {copy_bw / 1e12:.2f} TB/s; int4 g32, {a.act} x; us per call"
    )
    print(
        f"{'shape':<17}{'tile':<15}{'N':>3}{'steps':>10}{'median':>9}{'min':>8}{'max':>8}{'GB/s':>7}",
        flush=True,
    )
    out: list[dict] = []

    def save(rows: list[dict]) -> None:  # after every row: a run cut short keeps what it measured
        if a.json:
            every = out + rows
            a.json.write_text(
                json.dumps(dict(device=name, torch=torch.__version__, copy_bw=copy_bw, rows=every), indent=1)
            )

    for s in SHAPES:
        if s[0] not in a.shapes.split(","):
            continue
        if not a.only_planes:
            kind = s[4] if len(s) > 4 else None
            out += case(*s[:4], tiles, tokens, a.reps, lambda _i: flush.zero_(), save, kind, a.act)
        if a.planes or a.only_planes:
            ptokens = sorted(set(tokens) | {16})
            tiles_p = plane_tiles(s[1], s[2], a.plane_tiles)[: a.plane_first]
            out += planes_case(*s[:4], tiles_p, ptokens, a.reps, lambda _i: flush.zero_(), save, *s[4:])


if __name__ == "__main__":
    main()
