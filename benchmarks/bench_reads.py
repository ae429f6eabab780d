"""Expert-block reads, preadv threads against io_uring, at the bundle's read pattern: random whole
blocks of Qwen3.6-35B-A3B's int4 expert (hidden 2048, width 512, groups of 32: the block size the
bundle layout gives, 1,671,168 bytes), O_DIRECT (the page cache plays no part), queue depths 1..64.

Backends (each a closed loop keeping exactly ``depth`` blocks in flight):
  preadv        the engine's BlockReader, reader preadv: a thread per read in flight
  io_uring      the engine's BlockReader, reader io_uring: the same threads, one shared ring
  io_uring-raw  one thread, one ring, ``depth`` reads submitted and reaped in batches, no pool:
                what a reader built around the ring alone could reach (not an engine path)
  native        the engine's BlockReader, reader native (the C pool), whole blocks into staging
                (a prefetch's read: the buffer handed back once the block is there)
  native-xN     the same, each block read as N pieces at once (read_pieces N: depth x N requests)
  native-sum    native, each block's xxh3-64 checked in C and copied to host memory (fetch)
  native-dev    native, checked and copied to device memory on a stream (CUDA): the engine's
                demand read, end to end
Each row also gives the requests the disk had in flight on average while busy (the reader's own
clock), which shows whether a closed loop at a depth really kept that many.

``--idle-ms 0,2,10`` runs another study instead: one read at a time, each after the disk idled
that long (the engine's pattern without prefetch: a layer's reads start after its router, the
host's and the GPU's work between layers), per reader (preadv, native); per gap the median and
p90 time of a read. A read after idle can take longer than one of a back-to-back stream, which
the calibration's rate at depth 1 measures.

Per cell: GB/s (bytes over the cell's wall time), per-block latency (submit to completion)
median and p99, and the process's CPU seconds per GB read (all threads: what the reads cost the
cores the engine computes on); interleaved rounds (each starts at the next backend, so none always goes first
at a depth), GB/s as median (range), latencies pooled over rounds.

    pip install --no-deps --target /tmp/pylib .whl/liburing-*.whl    # io_uring's optional binding
    PYTHONPATH=$PWD:/tmp/pylib python3 benchmarks/bench_reads.py --dir /tmp/rd [--size-gb 4]
        [--depths 1,2,4,8,16,32,64] [--seconds 0.8] [--rounds 3] [--json out.json] [--keep]

Writes ``--dir``/bench_reads.bin (``--size-gb``, reused when its size matches; removed unless
``--keep``); the directory must be on the disk under test and accept O_DIRECT. Needs only the
standard library and edgerun on PYTHONPATH (no torch).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edgerun.bundle.layout import expert_block_layout  # noqa: E402
from edgerun.cache.reader import ALIGN, BlockReader, aligned_buffer, buffer_address  # noqa: E402
from edgerun.cache.uring import unavailable  # noqa: E402

CONFIG = ROOT / "configs" / "models" / "qwen3.6-35b-a3b.json"


def block_bytes() -> int:
    text = json.loads(CONFIG.read_text())["text_config"]
    args = SimpleNamespace(
        hidden_size=text["hidden_size"], moe_intermediate_size=text["moe_intermediate_size"]
    )
    return expert_block_layout(args, "int4", 32).block_bytes


def make_file(path: Path, nbytes: int) -> None:
    """A file of ``nbytes`` (random 64 MiB pattern, repeated), flushed and out of the page cache."""
    if path.exists() and path.stat().st_size == nbytes:
        print(f"reusing {path} ({nbytes / 2**30:.2f} GiB)", flush=True)
    else:
        t0 = time.perf_counter()
        chunk = pattern()
        with open(path, "wb") as f:
            left = nbytes
            while left:
                left -= f.write(chunk[: min(left, len(chunk))])
            f.flush()
            os.fsync(f.fileno())
        dt = time.perf_counter() - t0
        print(f"wrote {path} ({nbytes / 2**30:.2f} GiB) in {dt:.1f} s", flush=True)
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # O_DIRECT skips it anyway; belt and braces
    os.close(fd)


def pattern() -> bytes:
    """The test file's 64 MiB pattern (repeated): the same every run, so blocks' sums can be
    computed without reading the file."""
    return random.Random(64).randbytes(64 << 20)


def block_sums(bb: int, n_blocks: int) -> list[int]:
    """Each block's xxh3-64 (what a bundle's manifest holds), from the pattern."""
    import xxhash

    chunk = pattern()
    P = len(chunk)
    twice = chunk + chunk[: bb + 1]
    return [xxhash.xxh3_64(twice[(k * bb) % P : (k * bb) % P + bb]).intdigest() for k in range(n_blocks)]


def reader_for(backend: str, bb: int, depth: int, n_blocks: int, sums: list[int] | None, queue: int = 1):
    """(BlockReader, submit(path, index) -> Future) of a backend of :func:`run_reader`; a native
    reader has ``queue`` x ``depth`` staging buffers (as many reads may be queued at it)."""
    if not backend.startswith("native"):
        r = BlockReader(bb, staging=depth, mode="direct", depth=depth, reader=backend)
        return r, lambda path, k: r.submit(path, k, None, n_blocks)
    kind = backend.split("-", 1)[1] if "-" in backend else ""
    pieces = int(kind[1:]) if kind.startswith("x") else 1
    r = BlockReader(bb, staging=queue * depth, mode="direct", depth=depth, reader="native", pieces=pieces)
    depth *= queue
    if kind not in ("sum", "dev"):
        return r, lambda path, k: r.submit(path, k, None, n_blocks)
    import torch

    from edgerun.cache.reader import Target

    if kind == "dev":
        r.pin("cuda")
        stream = torch.cuda.Stream("cuda")
        rows = torch.empty(depth, bb, dtype=torch.uint8, device="cuda")
        to = [Target("device", rows[i], stream) for i in range(depth)]
    else:
        rows = torch.empty(depth, bb, dtype=torch.uint8)
        to = [Target("host", rows[i]) for i in range(depth)]
    turn = iter(range(1 << 62))  # rows in turn: at most depth reads are in flight
    return r, lambda path, k: r.fetch(path, k, n_blocks, to[next(turn) % depth], None, sums[k])


def release(got) -> None:
    """A staged block (a native read into staging, a prefetch's): its buffer handed back."""
    if hasattr(got, "release"):
        got.release()


def run_reader(
    backend: str, path: Path, bb: int, n_blocks: int, depth: int, seconds: float, rng, sums=None, queue=1
) -> dict:
    """The engine's BlockReader with ``depth`` reads in flight (a completion submits the next); a
    native reader is kept ``queue`` x ``depth`` reads deep (its pool reads ``depth`` at a time, the
    rest wait queued, as a streamed layer's misses and prefetches do)."""
    r, submit = reader_for(backend, bb, depth, n_blocks, sums, queue)
    lat: list[float] = []
    lock = threading.Lock()
    done = threading.Event()
    state = {"stop": False, "inflight": 0, "reads": 0, "error": None}
    release(submit(path, 0).result())  # open the file and start the pool outside the timing

    def issue() -> None:
        t = time.perf_counter()
        with lock:
            k = rng.randrange(n_blocks)
        fut = submit(path, k)
        fut.add_done_callback(lambda f, t=t: finished(f, t))

    def loop() -> None:  # the native reader's futures take no callbacks: a thread per read in flight
        while not state["stop"] and (t := time.perf_counter()) < deadline:
            with lock:
                k = rng.randrange(n_blocks)
            try:
                release(submit(path, k).result())
            except Exception as exc:  # noqa: BLE001 - reported after the run
                state["error"], state["stop"] = exc, True
                return
            with lock:
                lat.append(time.perf_counter() - t)
                state["reads"] += 1

    def finished(fut, t) -> None:
        now = time.perf_counter()
        with lock:
            state["inflight"] -= 1
            if fut.exception() is not None:
                state["error"], state["stop"] = fut.exception(), True
            else:
                lat.append(now - t)
                state["reads"] += 1
            again = not state["stop"] and now < deadline
            if again:
                state["inflight"] += 1
            elif state["inflight"] == 0:
                done.set()
        if again:
            issue()

    c0, t0 = time.process_time(), time.perf_counter()
    before = dataclasses.replace(r.stats)  # a copy: a Python reader's stats object is its live one
    deadline = t0 + seconds
    if backend.startswith("native"):
        threads = [threading.Thread(target=loop) for _ in range(depth * queue)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    else:
        with lock:
            state["inflight"] = depth
        for _ in range(depth):
            issue()
        done.wait()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    after = r.stats
    r.close()
    if state["error"] is not None:
        raise state["error"]
    busy = after.wall_seconds - before.wall_seconds
    return {
        "reads": state["reads"],
        "bytes": state["reads"] * bb,
        "wall": wall,
        "cpu": cpu,
        "lat": lat,
        # requests at the disk on average while one was (the reader's own clock)
        "busy_depth": (after.depth_seconds - before.depth_seconds) / busy if busy else None,
    }


def run_raw_uring(path: Path, bb: int, n_blocks: int, depth: int, seconds: float, rng) -> dict:
    """One thread: ``depth`` reads in one ring, each completion replaced at once."""
    import liburing as L

    ring = L.Ring()
    L.io_uring_queue_init(depth, ring)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    bufs = [aligned_buffer(bb) for _ in range(depth)]
    # Iovec keeps its buffer exported for good: build each over a ctypes view, once (edgerun/cache/uring.py)
    import ctypes

    iovs = [L.Iovec([memoryview((ctypes.c_char * bb).from_address(buffer_address(b)))]) for b in bufs]
    started = [0.0] * depth
    lat: list[float] = []
    cqe = L.Cqe()

    def prep(slot: int) -> None:
        sqe = L.io_uring_get_sqe(ring)
        L.io_uring_prep_readv(sqe, fd, iovs[slot], rng.randrange(n_blocks) * bb)
        sqe.user_data = slot
        started[slot] = time.perf_counter()

    c0, t0 = time.process_time(), time.perf_counter()
    deadline = t0 + seconds
    for s in range(depth):
        prep(s)
    inflight = L.io_uring_submit(ring)
    reads = 0
    while inflight:
        L.io_uring_wait_cqe(ring, cqe)  # holds the GIL: fine with one thread, not in the engine
        it, seen, now = L.io_uring_cqe_iter_init(ring), 0, time.perf_counter()
        while L.io_uring_cqe_iter_next(it, cqe):
            c = cqe[0]
            slot = c.user_data
            if c.res != bb:
                raise OSError(f"{path}: read of {bb} bytes returned {c.res}")
            lat.append(now - started[slot])
            reads += 1
            seen += 1
            if now < deadline:
                prep(slot)
            else:
                inflight -= 1
        L.io_uring_cq_advance(ring, seen)
        if inflight:
            L.io_uring_submit(ring)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    L.io_uring_queue_exit(ring)
    os.close(fd)
    for b in bufs:
        b.close()
    return {"reads": reads, "bytes": reads * bb, "wall": wall, "cpu": cpu, "lat": lat}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run_idle(
    backends: list[str], path: Path, bb: int, n_blocks: int, gaps: list[float], reads: int, rng
) -> list:
    """Depth 1, each read after ``gap`` seconds idle: rows of backend, gap, median and p90 ms,
    the gaps interleaved and each backend's reads alternating with the others'."""
    import torch

    from edgerun.cache.reader import Target

    readers = {b: BlockReader(bb, staging=1, mode="direct", depth=1, reader=b) for b in backends}
    row = torch.empty(bb, dtype=torch.uint8)
    times: dict[tuple[str, float], list[float]] = {}
    for r in readers.values():
        r.fetch(path, 0, n_blocks, Target("host", row)).result()  # open the file, start the pool
    for _ in range(reads):
        for gap in gaps:
            for b, r in readers.items():
                time.sleep(gap)
                t = time.perf_counter()
                r.fetch(path, rng.randrange(n_blocks), n_blocks, Target("host", row)).result()
                times.setdefault((b, gap), []).append(time.perf_counter() - t)
    for r in readers.values():
        r.close()
    return [
        {
            "backend": b,
            "idle_ms": gap * 1e3,
            "median_ms": statistics.median(x) * 1e3,
            "p90_ms": pct(x, 0.9) * 1e3,
        }
        for (b, gap), x in times.items()
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, required=True, help="scratch directory on the disk under test")
    p.add_argument("--size-gb", type=float, default=4.0, help="test file size, GiB (default 4)")
    p.add_argument("--depths", default="1,2,4,8,16,32,64")
    p.add_argument("--seconds", type=float, default=0.8, help="per cell (default 0.8)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved, each starting at another backend")
    p.add_argument(
        "--backends", default="preadv,io_uring,io_uring-raw", help="(with --idle-ms: preadv,native)"
    )
    p.add_argument(
        "--queue", type=int, default=1, help="native backends: reads kept queued, x depth (default 1)"
    )
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--keep", action="store_true", help="keep the test file for another run")
    p.add_argument("--idle-ms", default=None, help="instead: single reads after these idle gaps (0,2,10)")
    p.add_argument("--idle-reads", type=int, default=40, help="reads per backend and gap (default 40)")
    ns = p.parse_args()
    if ns.idle_ms is not None:
        ns.backends = ",".join(b for b in ns.backends.split(",") if b in ("preadv", "native"))
    bb = block_bytes()
    depths = [int(d) for d in ns.depths.split(",")]
    backends = ns.backends.split(",")
    why = unavailable()
    if why and any(b.startswith("io_uring") for b in backends):
        print(f"io_uring backends skipped: {why}", flush=True)
        backends = [b for b in backends if not b.startswith("io_uring")]
    ns.dir.mkdir(parents=True, exist_ok=True)
    path = ns.dir / "bench_reads.bin"
    n_blocks = int(ns.size_gb * 2**30) // bb
    if n_blocks < 64:
        raise SystemExit(f"--size-gb {ns.size_gb} holds {n_blocks} blocks of {bb}; give at least 64")
    make_file(path, n_blocks * bb)
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
    except OSError as exc:
        raise SystemExit(f"{path}: no O_DIRECT on this filesystem ({exc}); give a --dir on the NVMe") from exc
    assert bb % ALIGN == 0
    print(
        f"block {bb:,} bytes (Qwen3.6-35B-A3B int4 g32 expert), {n_blocks} blocks, O_DIRECT, "
        f"{ns.rounds} rounds x {ns.seconds} s per cell; backends {', '.join(backends)}",
        flush=True,
    )
    rng = random.Random(0)
    if ns.idle_ms is not None:
        gaps = [float(g) / 1e3 for g in ns.idle_ms.split(",")]
        try:
            rows = run_idle(backends, path, bb, n_blocks, gaps, ns.idle_reads, rng)
        finally:
            if not ns.keep:
                path.unlink()
        print(f"\n{'backend':<8} {'idle ms':>7} {'read ms median':>14} {'p90':>6}")
        for row in rows:
            print(f"{row['backend']:<8} {row['idle_ms']:7.0f} {row['median_ms']:14.2f} {row['p90_ms']:6.2f}")
        if ns.json:
            ns.json.write_text(
                json.dumps({"meta": {"block_bytes": bb, "idle": True}, "rows": rows}, indent=1)
            )
        return 0
    cells: dict[tuple[str, int], list[dict]] = {}
    sums = block_sums(bb, n_blocks) if any(b in ("native-sum", "native-dev") for b in backends) else None
    try:
        for k in range(ns.rounds):
            for depth in depths:
                for backend in backends[k % len(backends) :] + backends[: k % len(backends)]:
                    run = run_raw_uring if backend == "io_uring-raw" else None
                    res = (
                        run(path, bb, n_blocks, depth, ns.seconds, rng)
                        if run
                        else run_reader(backend, path, bb, n_blocks, depth, ns.seconds, rng, sums, ns.queue)
                    )
                    cells.setdefault((backend, depth), []).append(res)
    finally:
        if not ns.keep:
            path.unlink()
    rows = []
    print(
        f"\n{'depth':>5} {'backend':<13} {'GB/s median (range)':<22} {'lat med ms':>10} {'p99 ms':>8} "
        f"{'CPU s/GB':>8} {'in flight':>9}"
    )
    for depth in depths:
        for backend in backends:
            runs = cells[backend, depth]
            gbs = [r["bytes"] / r["wall"] / 1e9 for r in runs]
            lat = [x for r in runs for x in r["lat"]]
            row = {
                "backend": backend,
                "depth": depth,
                "gb_per_s": statistics.median(gbs),
                "gb_per_s_range": [min(gbs), max(gbs)],
                "lat_median_ms": statistics.median(lat) * 1e3,
                "lat_p99_ms": pct(lat, 0.99) * 1e3,
                "reads": sum(r["reads"] for r in runs),
                # CPU time of this process (every thread) per GB read: what the reads cost the cores
                "cpu_s_per_gb": sum(r["cpu"] for r in runs) / (sum(r["bytes"] for r in runs) / 1e9),
                "busy_depth": None,
            }
            if all(r.get("busy_depth") is not None for r in runs):
                row["busy_depth"] = statistics.median(r["busy_depth"] for r in runs)
            rows.append(row)
            inflight = "-" if row["busy_depth"] is None else f"{row['busy_depth']:.2f}"
            print(
                f"{depth:>5} {backend:<13} {row['gb_per_s']:6.2f} ({min(gbs):.2f}-{max(gbs):.2f}){'':<8} "
                f"{row['lat_median_ms']:10.2f} {row['lat_p99_ms']:8.2f} {row['cpu_s_per_gb']:8.3f} {inflight:>9}",
                flush=True,
            )
    if ns.json:
        meta = {"block_bytes": bb, "blocks": n_blocks, "seconds": ns.seconds, "rounds": ns.rounds}
        ns.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
