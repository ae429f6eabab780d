"""One token's routed-expert step on the CPU kernels (kernels/moe_cpu.py) at Qwen3-30B-A3B's
expert geometry (hidden 2048, width 768, int4 g32, top-8 of 64 slots, random weights, every slot
packed): the decode path (``one_row``) against the same step through ``combine_experts`` (the
path prefill and steps in parts take; it sorts, gathers and scatters per expert) and against the
int4 kernel calls alone (the floor for torch's kernels), and the grouped C kernel
(``cpu_grouped``, kernels/moe_cpu_grouped.c: one call for the layer, from the slots' own bytes). Milliseconds per layer,
CPU time (``time.process_time``, so other processes on a shared machine count less; all threads')
and wall time, interleaved rounds, median (range); checks that the two paths give the same bits.
``--tokens T`` (> 1): a prompt's step of T tokens instead, through ``combine_experts`` (torch's
kernels, an expert's tokens as one GEMM) and ``cpu_grouped`` (an expert's tokens in tiles).

    python benchmarks/bench_cpu_moe_step.py [--rounds 6] [--steps 50] [--threads 1] [--tokens 1]
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import torch

from edgerun.bundle.layout import expert_block_layout
from edgerun.kernels import moe_cpu, moe_cpu_grouped
from edgerun.kernels.moe_reference import moe_experts_ref, random_pool

D, I, E, A = 2048, 768, 64, 8  # hidden, expert width, slots, top-k


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tokens", type=int, default=1, help="tokens a step (1: decode)")
    ns = p.parse_args()
    torch.set_num_threads(ns.threads)
    layout = expert_block_layout(SimpleNamespace(hidden_size=D, moe_intermediate_size=I), "int4", 32)
    gen = torch.Generator().manual_seed(0)
    pool, gscales = random_pool(layout, E, generator=gen)
    packed: dict = {}
    moe_cpu.pack_slots(layout, pool, gscales, range(E), packed)
    T = ns.tokens
    x = torch.randn(T, D, generator=gen)
    steps = [
        (
            torch.rand(T, E, generator=gen).argsort(dim=1)[:, :A],
            torch.randn(T, A, generator=gen).softmax(-1),
        )
        for _ in range(ns.steps)
    ]  # expert e in slot e

    def one_row(ids, w):
        return moe_cpu.moe_cpu(x, pool, ids, ids, w, layout, gscales, packed)

    def combine(ids, w):  # one part covering every expert: the combine_experts path
        acc = torch.zeros(x.shape)
        return moe_cpu.moe_cpu(
            x, pool, ids, ids, w, layout, gscales, packed, acc=acc, expert_range=(0, 10**6)
        )

    def grouped(ids, w):  # kernels/moe_cpu_grouped.c: one C call, from the bundle's bytes
        return moe_cpu_grouped.moe_grouped(x, pool, ids, ids, w, layout, gscales)

    def kernels_only(ids, w):
        mm, xb = torch.ops.aten._weight_int4pack_mm_for_cpu, x.to(moe_cpu.ACT)
        for e in ids[0].tolist():
            (gw, gs), (dw, ds) = packed[e]
            mm(mm(xb, gw, 32, gs)[:, :I], dw, 32, ds)

    paths = {
        "combine_experts": combine,
        "one_row": one_row,
        "int4 kernel calls only": kernels_only,
        "cpu_grouped": grouped,
    }
    if T > 1:  # one_row and the bare calls are one token's
        paths = {k: paths[k] for k in ("combine_experts", "cpu_grouped")}
    ms: dict[str, list[float]] = {k: [] for k in paths}
    wall: dict[str, list[float]] = {k: [] for k in paths}
    for _ in range(ns.rounds):
        for name, f in paths.items():
            t, w0 = time.process_time(), time.perf_counter()
            for ids, w in steps:
                f(ids, w)
            ms[name].append((time.process_time() - t) / len(steps) * 1e3)
            wall[name].append((time.perf_counter() - w0) / len(steps) * 1e3)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {T} token(s) a step; "
        "ms per layer, median (range), CPU time | wall time:"
    )
    for name, v in ms.items():
        w = wall[name]
        print(
            f"  {name:24s} {statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})"
            f" | {statistics.median(w):.2f} ({min(w):.2f}-{max(w):.2f})"
        )
    if T == 1:
        same = all(torch.equal(one_row(i, w), combine(i, w)) for i, w in steps)
        print(f"one_row == combine_experts bit for bit on {len(steps)} steps: {same}")
    ref = [moe_experts_ref(x, pool, i, i, w, layout, gscales) for i, w in steps[:4]]
    err = max(float((grouped(i, w) - r).abs().max() / r.abs().max()) for (i, w), r in zip(steps, ref))
    print(f"cpu_grouped max error vs the fp32 reference on 4 steps: {err:.1e} of the output's scale")


if __name__ == "__main__":
    main()
