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
  do (docs/benchmarks.md, "An L2 prefetch of later launches' weights: lost");
- ``persist-first`` / ``persist-all`` / ``persist-dep``: no launch per operation at all: one launch
  of ``--persist-per-sm`` programs a multiprocessor (all resident at once) walks the whole chain,
  program p taking tiles p, p + G, ... of each operation; between operations a grid barrier (each
  program arrives at the operation's counter with release semantics, and waits with acquire loads
  for all G before reading the operation's x), the first step (``-all``: the whole first tile) of
  its next tile's weights read before it waits; ``-dep`` as ``first-dep``. The floor of a
  persistent ("megakernel") step with a full barrier between operations, set against the PDL
  chain's; ``persist-free``: the same launch with no barrier (the reads alone).
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

from edgerun.kernels.launch import _load_acquire_t0

MB = 1 << 20
# bytes of each launch of a layer (weights, scales; the DeltaNet state read and written), from
# `edgerun bench decode --layers 40 --dense int4` (1.729 GB a token) and docs/benchmarks.md's
# table of a DeltaNet layer's launches
DELTANET = [13.4, 4.2, 4.5, 2.2, 9.5, 4.5]  # in_proj+conv, delta rule, out_proj, router, gate_up, down
ATTENTION = [10.0, 0.2, 0.1, 4.5, 2.2, 9.5, 4.5]  # qkv+gate, attend, combine, o_proj, router, gate_up, down
LM_HEAD = 270.0
X_WORDS = 1024  # 4 KB of x each program reads after its wait
SYNC_PAD = 32  # int32 counters apart (128 B): each barrier's counter on a line of its own
MAX_SPLIT = 32  # the most counters a barrier is split over


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


@triton.jit
def _load_acquire(c, ONE: tl.constexpr):
    """The int32 at ``c``, loaded with acquire semantics at GPU scope by every thread, or (ONE)
    by thread 0 alone as the decode kernels poll (``launch._load_acquire_t0``), the others given
    2**31 - 1 so that they leave the wait loop at once."""
    if ONE:
        return _load_acquire_t0(c, 2147483647)
    return tl.inline_asm_elementwise(
        "ld.global.acquire.gpu.b32 $0, [$1];", "=r,l", [c], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit(do_not_specialize=["zero"])
def _persistent_kernel(w, op_base, op_tiles, n_ops, counters, xbuf, XMAX, err, spin_limit, zero,
                       WORDS: tl.constexpr, STEP: tl.constexpr, BEFORE: tl.constexpr, DEP: tl.constexpr,
                       PAD: tl.constexpr, WAIT: tl.constexpr, ONE: tl.constexpr, SPLIT: tl.constexpr):  # fmt: skip
    """The whole chain in one launch of G programs (all resident). Operation i's tiles are
    ``op_tiles[i]`` runs of WORDS words from word ``op_base[i]`` of w; program p sums tiles p,
    p + G, ... STEP words a step, adds 4 KB of x (operation i - 1's output, in xbuf row i % 2)
    and stores one int a tile into row (i + 1) % 2; the first BEFORE steps of its first tile are
    read before it waits for every program to have arrived at operation i - 1's counter
    (acquire loads; the arrival: a CTA barrier, then a release atomic). A wait that spins past
    ``spin_limit`` polls gives up and counts itself in ``err`` (programs not all resident: the
    timing is then void, and nothing hangs). ONE: thread 0 alone polls. SPLIT > 1: an
    operation's barrier is SPLIT counters (program p arrives at counter p % SPLIT, so fewer
    atomics queue on one address), a waiter sums them. WAIT False: no barrier (nothing computed is then
    the chain's; the time of the reads alone in one launch)."""
    p = tl.program_id(0)
    G = tl.num_programs(0)
    offs = tl.arange(0, STEP)
    for i in range(n_ops):
        base = w + tl.load(op_base + i)
        n = tl.load(op_tiles + i)
        xin = xbuf + (i % 2) * XMAX
        xout = xbuf + ((i + 1) % 2) * XMAX
        has = p < n
        first = base + p.to(tl.int64) * WORDS
        acc = tl.zeros([STEP], dtype=tl.int32)
        for s in tl.static_range(0, WORDS // STEP):
            if s < BEFORE:
                if DEP:
                    acc += tl.load(first + s * STEP + offs + (acc & zero), mask=has & (offs >= 0), other=0)
                else:
                    acc += tl.load(first + s * STEP + offs, mask=has & (offs >= 0), other=0)
        if WAIT and i > 0:
            if SPLIT == 1:
                c = counters + (i - 1) * PAD
                v = _load_acquire(c, ONE)
                spins = 0
                while (v < G) & (spins < spin_limit):
                    v = _load_acquire(c, ONE)
                    spins += 1
            else:  # the operation's SPLIT counters, each loaded by the threads that own it, summed
                c = counters + ((i - 1) * SPLIT + tl.arange(0, SPLIT)) * PAD
                v = tl.sum(_load_acquire(c, False), axis=0)
                spins = 0
                while (v < G) & (spins < spin_limit):
                    v = tl.sum(_load_acquire(c, False), axis=0)
                    spins += 1
            if spins >= spin_limit:
                tl.atomic_add(err, 1)
            tl.debug_barrier()
        for s in tl.static_range(0, WORDS // STEP):
            if s >= BEFORE:
                if DEP:
                    acc += tl.load(first + s * STEP + offs + (acc & zero), mask=has & (offs >= 0), other=0)
                else:
                    acc += tl.load(first + s * STEP + offs, mask=has & (offs >= 0), other=0)
        xs = tl.sum(tl.load(xin + tl.arange(0, 1024)), axis=0)
        if has:
            tl.store(xout + p, tl.sum(acc, axis=0) + xs)
        for t in range(p + G, n, G):
            tile = base + t.to(tl.int64) * WORDS
            acc = tl.zeros([STEP], dtype=tl.int32)
            for s in tl.static_range(0, WORDS // STEP):
                if DEP:
                    acc += tl.load(tile + s * STEP + offs + (acc & zero))
                else:
                    acc += tl.load(tile + s * STEP + offs)
            tl.store(xout + t, tl.sum(acc, axis=0) + xs)
        tl.debug_barrier()
        tl.atomic_add(counters + (i * SPLIT + p % SPLIT) * PAD, 1, sem="release")


class Chain:
    """Buffers for a chain of launches of the given byte sizes (MB), run by ``_read_kernel``."""

    def __init__(self, sizes_mb: list[float], prog_bytes: int):
        tiles = [max(1, round(mb * MB / prog_bytes)) for mb in sizes_mb]
        words = prog_bytes // 4
        # one buffer, each launch's weights a slice of it (the persistent kernel walks them all)
        self.w = torch.randint(-5, 5, (sum(tiles) * words,), dtype=torch.int32, device="cuda")
        starts = [0]
        for t in tiles:
            starts.append(starts[-1] + t * words)
        self.launches = [(self.w[a : a + t * words], t) for a, t in zip(starts, tiles, strict=False)]
        self.op_base = torch.tensor(starts[:-1], dtype=torch.int64, device="cuda")
        self.op_tiles = torch.tensor(tiles, dtype=torch.int32, device="cuda")
        most = max(tiles)
        self.xmax = max(most, X_WORDS)
        self.bufs = [torch.zeros(self.xmax, dtype=torch.int32, device="cuda") for _ in range(2)]
        self.xbuf = torch.zeros(2 * self.xmax, dtype=torch.int32, device="cuda")
        self.counters = torch.zeros(len(tiles) * MAX_SPLIT * SYNC_PAD, dtype=torch.int32, device="cuda")
        self.err = torch.zeros(1, dtype=torch.int32, device="cuda")
        self.bytes = sum(w.numel() * 4 for w, _ in self.launches)

    def run_persistent(self, prog_bytes: int, step_bytes: int, warps: int, before: int, dep: bool,
                       per_sm: int, wait: bool = True, one: bool = True, split: int = 1, spin_limit: int = 100_000) -> None:  # fmt: skip
        """The chain as one launch of ``per_sm`` programs a multiprocessor (``_persistent_kernel``),
        its barrier counters zeroed first (a memset in the same graph)."""
        self.counters.zero_()
        g = torch.cuda.get_device_properties(0).multi_processor_count * per_sm
        _persistent_kernel[(g,)](self.w, self.op_base, self.op_tiles, len(self.launches), self.counters, self.xbuf,
                                 self.xmax, self.err, spin_limit, 0, WORDS=prog_bytes // 4, STEP=step_bytes // 4,
                                 BEFORE=before, DEP=dep, PAD=SYNC_PAD, WAIT=wait, ONE=one, SPLIT=split,
                                 num_warps=warps)  # fmt: skip

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


# persistent variants: "persist-first/K" etc., K programs a multiprocessor
# ("-free": no barrier at all, the operations' reads overlapping: what one launch streams at)
# "-every": every thread polls the barrier's counter (else thread 0 alone)
# "-sN": persist-first with each barrier split over N counters
PERSIST = {"persist-first": (1, False, True), "persist-all": (-1, False, True), "persist-dep": (1, True, True),
           "persist-free": (1, False, False), "persist-every": (1, False, True), "persist-s8": (1, False, True),
           "persist-s32": (1, False, True), "persist-all-s8": (-1, False, True)}  # fmt: skip


def persist_plan(variant: str, prog: int, step: int) -> tuple[int, bool, int, bool, bool, int] | None:
    """A persistent variant's ``Chain.run_persistent`` arguments after the tile's: (before, dep,
    per_sm, wait, one, split); None for a variant that is not persistent."""
    name, _, per_sm = variant.partition("/")
    if name not in PERSIST:
        return None
    before, dep, wait = PERSIST[name]
    split = int(name.rpartition("-s")[2]) if "-s" in name else 1
    return (
        (prog // step if before < 0 else before),
        dep,
        int(per_sm or 4),
        wait,
        name != "persist-every",
        split,
    )


def time_variant(chain: Chain, tile: tuple[int, int, int], variant: str, reps: int) -> list[float] | None:
    """Seconds per replay of the chain's graph, its launches on ``tile`` (program bytes, step
    bytes, warps) as ``variant`` (``VARIANTS``) reads. None: a persistent variant whose programs
    were not all resident (a barrier gave up; its time would mean nothing)."""
    prog, step, warps = tile
    plan = persist_plan(variant, prog, step)
    if plan is not None:
        chain.err.zero_()
        for b in (*chain.bufs, chain.xbuf):  # both start from the same x: their outputs are then equal
            b.zero_()
        chain.run(prog, step, warps, 0, False)
        chain.run_persistent(prog, step, warps, *plan)
        torch.cuda.synchronize()
        if int(chain.err.item()):
            return None
        # the one launch did the chain's work: its last operation's outputs are the launches'
        n, last = len(chain.launches), chain.launches[-1][1]
        got = chain.xbuf[(n % 2) * chain.xmax :][:last]
        if plan[3] and not torch.equal(got, chain.bufs[n % 2][:last]):
            raise SystemExit(f"{variant}: the persistent chain's last outputs differ from the launches'")
        t = graph_time(lambda: chain.run_persistent(prog, step, warps, *plan), reps)  # the same arguments
        return None if int(chain.err.item()) else t
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
    ap.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"of {','.join([*VARIANTS, *AHEAD])}, and {'/K, '.join(PERSIST)}/K (K programs a multiprocessor)",
    )
    ap.add_argument(
        "--cap-mb", type=float, default=24.0, help="the most MB of a launch an ahead variant prefetches"
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    CAP_MB[0] = args.cap_mb
    names = args.variants.split(",")
    for name in names:
        base, _, k = name.partition("/")
        if not (name in VARIANTS or name in AHEAD or (base in PERSIST and (not k or k.isdigit()))):
            ap.error(f"--variants: {name!r} is none of {', '.join([*VARIANTS, *AHEAD, *PERSIST])}")
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
            if t is None:
                print(f"step  tile {prog >> 10} KB/{step >> 10} KB/{warps}w {name:12s} void: its programs were not all resident")  # fmt: skip
                out["step"].append(
                    {"tile": [prog, step, warps], "variant": name, "void": "programs not all resident"}
                )
                continue
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
            if t is None:
                print(f"size {mb:5.1f} MB {name:10s} void: its programs were not all resident")
                continue
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
