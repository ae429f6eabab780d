"""What a chain of decode-sized kernels can reach: the floor under edgerun's decode step.

    PYTHONPATH=... python3 benchmarks/launch_floor.py [--layers 40] [--reps 20] [--json out.json]

A decode step at Qwen3.6-35B-A3B's geometry is ~255 dependent launches, most reading 2-14 MB of
weights. This times the same chain of byte sizes (``STEP``: a DeltaNet layer's six launches, an
attention layer's seven, the lm_head) run by a kernel that does nothing but read: each program
sums its share of the weight bytes, waits for the previous kernel (PDL), reads 4 KB that the
previous kernel wrote (the x a GEMV needs) and writes one value. No instruction a weight value
beyond the load and one add, so the chain's time is what launches, dependencies and bandwidth
cost: an upper bound on what any kernel-per-launch design of this step can reach. Each variant
is one CUDA graph of the whole chain, replayed --reps times (CUDA events, median and range):
- ``plain``: PDL off (each launch waits for the last to end);
- ``pdl-after``: PDL, every weight read after the wait;
- ``pdl-first``: PDL, the first step of weights read before the wait (edgerun's GEMV today);
- ``pdl-all``: PDL, every weight read before the wait;
- ``--variants first-aheadK`` (K = 1, 2, 3): pdl-first, and each launch first asks the L2 for
  launch i + K's weights (``cp.async.bulk.prefetch.L2``, at most ``--cap-mb``); ``first-dep`` /
  ``dep-aheadK``: the same with each step's loads waiting for the last step's values, as a GEMV's
  do (docs/benchmarks.md, "An L2 prefetch of later launches' weights: lost").
Tiles: bytes a program reads (16 KB in 4 KB steps over 4 warps by default; ``--tiles``).
Also per size (``--sizes``): 40 launches of one size in a chain, µs a launch, so that a kernel of
the decode step can be set against the floor for its bytes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

MB = 1 << 20
# bytes of each launch of a layer (weights, scales; the DeltaNet state read and written), from
# `edgerun bench decode --layers 40 --dense int4` (1.729 GB a token) and docs/benchmarks.md's
# table of a DeltaNet layer's launches
DELTANET = [13.4, 4.2, 4.5, 2.2, 9.5, 4.5]  # in_proj+conv, delta rule, out_proj, router, gate_up, down
ATTENTION = [10.0, 0.2, 0.1, 4.5, 2.2, 9.5, 4.5]  # qkv+gate, attend, combine, o_proj, router, gate_up, down
LM_HEAD = 270.0
X_WORDS = 1024  # 4 KB of x each program reads after its wait


@triton.jit
def _prefetch_l2(ptr, nbytes):
    """Asks the L2 for ``nbytes`` from ``ptr`` (widened to whole 16-byte units, as the
    instruction needs; torch allocations are 512-byte aligned, so they stay inside it): one
    ``cp.async.bulk.prefetch.L2`` (sm_90) from thread 0 of the program. Nothing waits for it,
    and nothing computed depends on it: a hint to the memory system only."""
    lo = ptr.to(tl.int64, bitcast=True)
    start = lo // 16 * 16
    size = ((lo + nbytes + 15) // 16 * 16 - start).to(tl.int32)
    if nbytes > 0:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
            "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r",
            [start, size],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


@triton.jit(do_not_specialize=["zero"])
def _read_kernel(w, xin, xout, NPROG, pf, pf_chunk, pf_bytes, zero, WORDS: tl.constexpr, STEP: tl.constexpr,
                 BEFORE: tl.constexpr, PDL: tl.constexpr, PF: tl.constexpr, DEP: tl.constexpr):  # fmt: skip
    """Program p sums words [p * WORDS, (p + 1) * WORDS) of w, STEP words a step, the first
    BEFORE steps read before the PDL wait; then adds 4 KB of xin (the previous launch's output)
    and writes one int to xout[p]. PF: first, program p asks the L2 for its share (pf_chunk
    words) of ``pf``'s first pf_bytes, a later launch's weights. DEP: each step's addresses
    depend on the last step's values (``zero`` is a runtime 0), so a program waits a load's
    latency a step, as a GEMV whose loads follow its products does."""
    p = tl.program_id(0)
    if PF:
        off = p.to(tl.int64) * pf_chunk
        _prefetch_l2(pf + off, tl.minimum(pf_chunk * 4, pf_bytes - off * 4))
    base = w + p.to(tl.int64) * WORDS
    offs = tl.arange(0, STEP)
    acc = tl.zeros([STEP], dtype=tl.int32)
    for i in tl.static_range(0, WORDS // STEP):
        if i < BEFORE:
            if DEP:
                acc += tl.load(base + i * STEP + offs + (acc & zero))
            else:
                acc += tl.load(base + i * STEP + offs)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    for i in tl.static_range(0, WORDS // STEP):
        if i >= BEFORE:
            if DEP:
                acc += tl.load(base + i * STEP + offs + (acc & zero))
            else:
                acc += tl.load(base + i * STEP + offs)
    xs = tl.load(xin + tl.arange(0, 1024))
    tl.store(xout + p, tl.sum(acc, axis=0) + tl.sum(xs, axis=0))


class Chain:
    """Buffers for a chain of launches of the given byte sizes (MB), run by ``_read_kernel``."""

    def __init__(self, sizes_mb: list[float], prog_bytes: int):
        self.launches = []
        for mb in sizes_mb:
            progs = max(1, round(mb * MB / prog_bytes))
            w = torch.randint(-5, 5, (progs * prog_bytes // 4,), dtype=torch.int32, device="cuda")
            self.launches.append((w, progs))
        most = max(p for _, p in self.launches)
        self.bufs = [torch.zeros(max(most, X_WORDS), dtype=torch.int32, device="cuda") for _ in range(2)]
        self.bytes = sum(w.numel() * 4 for w, _ in self.launches)

    def run(self, prog_bytes: int, step_bytes: int, warps: int, before: int, pdl: bool, ahead: int = 0,
            dep: bool = False, cap_mb: float = 24.0) -> None:  # fmt: skip
        """The chain; ``ahead`` k > 0: launch i also prefetches into L2 the first ``cap_mb`` MB
        of launch i + k's weights (the next step's first launches past the end)."""
        words, step = prog_bytes // 4, step_bytes // 4
        n = len(self.launches)
        for i, (w, progs) in enumerate(self.launches):
            xin, xout = self.bufs[i % 2], self.bufs[(i + 1) % 2]
            extra = {"launch_pdl": True} if pdl else {}
            pf, nb = w, 0
            if ahead:
                pf = self.launches[(i + ahead) % n][0]
                nb = min(pf.numel() * 4, int(cap_mb * MB)) // 16 * 16
            chunk = -(-nb // (16 * progs)) * 4  # words a program: whole 16-byte units
            _read_kernel[(progs,)](w, xin, xout, progs, pf, chunk, nb, 0, WORDS=words, STEP=step, BEFORE=before,
                                   PDL=pdl, PF=ahead > 0, DEP=dep, num_warps=warps, **extra)  # fmt: skip


def graph_time(fn, reps: int) -> list[float]:
    """Seconds per replay of fn captured in one CUDA graph (L2 flushed before each replay)."""
    flush = torch.empty(256 * MB, dtype=torch.uint8, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for i in range(reps + 3):
        flush.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        if i >= 3:
            times.append(a.elapsed_time(b) / 1e3)
    return times


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    ts = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return 2 * nbytes / statistics.median(ts)


VARIANTS = {"plain": (False, "none"), "pdl-after": (True, "none"), "pdl-first": (True, "first"),
            "pdl-all": (True, "all")}  # fmt: skip
# --ahead variants: pdl-first with launch i prefetching launch i + k's weights into L2 (k = the
# number), and "dep" ones whose steps wait for each other's loads (DEP)
AHEAD = {"first-ahead1": (1, False), "first-ahead2": (2, False), "first-ahead3": (3, False),
         "first-dep": (0, True), "dep-ahead1": (1, True), "dep-ahead2": (2, True), "dep-ahead3": (3, True)}  # fmt: skip


def time_variant(chain: Chain, tile: tuple[int, int, int], variant: str, reps: int) -> list[float]:
    """Seconds per replay of the chain's graph, its launches on ``tile`` (program bytes, step
    bytes, warps) as ``variant`` (``VARIANTS``) reads."""
    prog, step, warps = tile
    if variant in AHEAD:
        ahead, dep = AHEAD[variant]
        return graph_time(lambda: chain.run(prog, step, warps, 1, True, ahead, dep, CAP_MB[0]), reps)
    pdl, before = VARIANTS[variant]
    n_before = {"none": 0, "first": 1, "all": prog // step}[before]
    return graph_time(lambda: chain.run(prog, step, warps, n_before, pdl), reps)


CAP_MB = [24.0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=40, help="layers, every 4th an attention layer (Qwen3.6)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--tiles", default="16384,4096,4;8192,4096,2;32768,8192,8;16384,16384,4",
                    help="'program bytes,step bytes,warps;...'")  # fmt: skip
    ap.add_argument("--sizes", default="0.5,2.2,4.5,9.5,13.4", help="MB: per-size chains of 40 launches")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"of {','.join([*VARIANTS, *AHEAD])}")
    ap.add_argument(
        "--cap-mb", type=float, default=24.0, help="the most MB of a launch an ahead variant prefetches"
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    CAP_MB[0] = args.cap_mb
    names = args.variants.split(",")
    if not torch.cuda.is_available():
        print("launch_floor: needs a CUDA GPU", file=sys.stderr)
        return 2
    tiles = [tuple(int(v) for v in t.split(",")) for t in args.tiles.split(";")]
    sizes = []
    for i in range(args.layers):
        sizes += ATTENTION if i % 4 == 3 else DELTANET
    sizes.append(LM_HEAD)
    bw = copy_bandwidth()
    dev = torch.cuda.get_device_name()
    print(f"{dev}: device copy {bw / 1e9:.0f} GB/s (read + write); {len(sizes)} launches a step")
    out = {"device": dev, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "copy_gbs": bw / 1e9,
           "launches": len(sizes), "step": [], "sizes": []}  # fmt: skip
    for prog, step, warps in tiles:
        chain = Chain(sizes, prog)
        bound = chain.bytes / bw
        for name in names:
            t = time_variant(chain, (prog, step, warps), name, args.reps)
            med = statistics.median(t)
            row = {"tile": [prog, step, warps], "variant": name, "us": med * 1e6, "us_range": [min(t) * 1e6, max(t) * 1e6],
                   "bytes": chain.bytes, "of_bound": bound / med}  # fmt: skip
            out["step"].append(row)
            print(f"step  tile {prog >> 10} KB/{step >> 10} KB/{warps}w {name:12s} {med * 1e6:8.1f} us "
                  f"({min(t) * 1e6:.1f}-{max(t) * 1e6:.1f})  {chain.bytes / 1e6:.0f} MB  "
                  f"{bound / med:5.1%} of the copy bound ({bound * 1e6:.0f} us)")  # fmt: skip
    for mb in (float(s) for s in args.sizes.split(",") if s):
        chain = Chain([mb] * 40, tiles[0][0])
        for name in names:
            t = time_variant(chain, tiles[0], name, args.reps)
            per = statistics.median(t) / 40
            ideal = chain.bytes / 40 / bw
            out["sizes"].append(
                {"mb": mb, "variant": name, "us_per_launch": per * 1e6, "ideal_us": ideal * 1e6}
            )
            print(
                f"size {mb:5.1f} MB {name:10s} {per * 1e6:6.2f} us a launch (bytes at the copy rate {ideal * 1e6:.2f})"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
