"""Micro-benchmark: a MoE layer's router launches as the one-row decode step runs them, and their parts.

    PYTHONPATH=... python3 benchmarks/bench_route.py [--reps 50] [--tiles 8,1024 2,1024 ...] [--json out.json]

At Qwen3.6-35B-A3B's geometry (hidden 2048, 256 experts, top 8, shared expert 512) with its
int4-dense bundle's weights: the router and the shared expert's gate, plain bf16 [257, 2048], in
one ``qgemv`` with the layer's RMSNorm on the way in (``norm_out`` written) and the shared
expert's gate_up, int4 g32 [1024, 2048] with silu_mul, in the same launch (``also``), then
``router_topk`` on its logits: ``SparseMoe.route_shared``'s calls. Then the GEMV's launch alone,
without the shared gate_up, and ``router_topk`` alone, so the time splits into its parts.

``--tiles``: router tiles (block_r,row_bytes; the warps stay the shared gate_up tile's, which the
launch needs) timed in place of ``gemv_config``'s, each over every variant. Each row times
CALLS = 20 calls in one CUDA graph, replayed --reps times, L2 flushed before each replay, the
weights cycled over copies filling twice the L2 (``bench_dense_gemv``'s method): µs per call,
median and range. On a machine without CUDA (``TRITON_INTERPRET=1``) each call runs once, untimed:
a check that the benchmark's calls are valid.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests")]

from edgerun.kernels import qlinear_triton as K  # noqa: E402
from edgerun.kernels.decode_triton import router_topk  # noqa: E402
from edgerun.kernels.qlinear_reference import random_qweight  # noqa: E402

D, E, TOP, SHARED = 2048, 256, 8, 512
CALLS = 20


def variants(x, router, shared, bufs):
    """name -> call(i): call i of a graph, on copy i of each list (cycled; ``bufs``: outputs)."""

    def launch(i, topk=True, also=True):
        b = bufs[i % len(bufs)]
        K.qgemv(
            x, router[i % len(router)], out=b["logits"], norm=(b["norm_w"], 1e-6, True), norm_out=b["normed"],
            also=(shared[i % len(shared)], "silu_mul", b["mid"]) if also else None,
        )  # fmt: skip
        if topk:
            router_topk(b["logits"], E, TOP, True, b["weights"], b["ids"])

    return {
        "the step's (GEMV + shared gate_up, then top-k)": launch,
        "the GEMV's launch alone": lambda i: launch(i, topk=False),
        "without the shared gate_up": lambda i: launch(i, also=False),
        "router GEMV alone": lambda i: launch(i, topk=False, also=False),
        "router_topk alone": lambda i: router_topk(
            bufs[i % len(bufs)]["logits"], E, TOP, True, bufs[i % len(bufs)]["weights"], bufs[i % len(bufs)]["ids"]
        ),
    }  # fmt: skip


@contextmanager
def with_tile(tile):
    """Within: ``gemv_config`` gives the router's shape ``tile`` (block_r, row_bytes; None: its own)."""
    original = K.gemv_config

    def patched(scheme, R, C, act="bf16"):
        cfg = original(scheme, R, C, act)
        if scheme == "plain" and R == E + 1:
            return K.GemvConfig(tile[0], tile[1], cfg.num_warps, cfg.rolled_from)
        return cfg

    K.gemv_config = patched if tile is not None else original
    try:
        yield
    finally:
        K.gemv_config = original


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--tiles", nargs="*", default=[], help="router tiles block_r,row_bytes to time too")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    g = torch.Generator(device=dev).manual_seed(0)
    r0 = random_qweight("plain", E + 1, D, D, g, dev, torch.bfloat16)
    s0 = random_qweight("int4", 2 * SHARED, D, 32, g, dev, torch.bfloat16)
    nbytes = sum(t.numel() * t.element_size() for w in (r0, s0) for t in w.tensors())
    router, shared = [r0], [s0]
    if cuda:  # weight copies filling twice the L2, so each call reads HBM
        from bench_dense_gemv import graph_times, weight_copies

        router, shared = weight_copies(r0), weight_copies(s0)
    x = torch.randn(1, D, generator=g, device=dev).bfloat16()
    bufs = [
        dict(
            logits=torch.empty(1, E + 1, dtype=torch.bfloat16, device=dev),
            normed=torch.empty(1, D, dtype=torch.bfloat16, device=dev),
            norm_w=torch.randn(D, generator=g, device=dev).bfloat16() * 0.1,
            weights=torch.empty(1, TOP, dtype=torch.bfloat16, device=dev),
            ids=torch.empty(1, TOP, dtype=torch.long, device=dev),
            mid=torch.empty(1, SHARED, dtype=torch.bfloat16, device=dev),
        )
        for _ in range(max(len(router), len(shared)))
    ]
    tiles = [None] + [tuple(int(v) for v in t.split(",")) for t in a.tiles]
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev) if cuda else None
    name = torch.cuda.get_device_name() if cuda else "cpu (interpreter: untimed)"
    print(f"{name}; torch {torch.__version__}; router plain [{E + 1}, {D}] + shared gate_up int4 g32 [{2 * SHARED}, {D}], {nbytes / 1e6:.2f} MB")  # fmt: skip
    rows = []
    for tile in tiles:
        with with_tile(tile):
            cfg = K.gemv_config("plain", E + 1, D)
            label = f"tile r{cfg.block_r} b{cfg.row_bytes} w{cfg.num_warps}" + (
                " (default)" if tile is None else ""
            )
            for what, call in variants(x, router, shared, bufs).items():
                if not cuda:
                    call(0)
                    rows.append(dict(tile=label, variant=what))
                    print(f"{label:<28} {what:<42} ran")
                    continue
                t = graph_times(
                    [lambda i=i, call=call: call(i) for i in range(CALLS)],
                    a.reps,
                    lambda _i: flush.zero_(),
                )
                med = statistics.median(t)
                rows.append(dict(tile=label, variant=what, median_us=med * 1e6, min_us=min(t) * 1e6, max_us=max(t) * 1e6))  # fmt: skip
                print(f"{label:<28} {what:<42} {med * 1e6:6.2f} us ({min(t) * 1e6:.2f}-{max(t) * 1e6:.2f})")
    if a.json:
        a.json.write_text(json.dumps(dict(device=name, torch=torch.__version__, rows=rows), indent=1))


if __name__ == "__main__":
    main()
