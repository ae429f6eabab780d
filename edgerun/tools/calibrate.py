"""Calibration: the bounds a decode benchmark reports its rates against.

``read_bandwidth``: what the disk gives the expert cache. Whole blocks at random block-aligned
offsets, read with O_DIRECT into page-aligned buffers by N threads that each keep one read in
flight (queue depth N), for a fixed time per depth; with ``pieces`` > 1, the engine's native
reader reads each block as that many parts at once (``read_pieces``), N blocks in flight.
``device_copy_bandwidth``: device-to-device
and pinned host-to-device copy rates. Rates are decimal GB/s (1e9 bytes per second).
"""

from __future__ import annotations

import bisect
import errno
import os
import random
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from edgerun.cache.reader import (
    ALIGN,
    AlignmentError,
    ReadError,
    aligned_buffer,
    buffer_address,
    check_alignment,
)
from edgerun.errors import EdgerunError


class DeviceUnavailable(EdgerunError, RuntimeError):
    """No device to measure (no torch, no CUDA, or not a CUDA device): nothing was measured."""


def _open(path: Path, direct: bool) -> int:
    flags = os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0)
    try:
        return os.open(path, flags)
    except OSError as exc:
        if direct and exc.errno == errno.EINVAL:
            raise ReadError(
                f"{path}: the filesystem does not support O_DIRECT (tmpfs?); pass direct=False to "
                f"measure buffered reads instead (they include page-cache hits)"
            ) from exc
        raise ReadError(f"cannot open {path}: {exc.strerror}") from exc


def read_bandwidth(
    path: str | Path | Sequence[str | Path],
    block_bytes: int,
    queue_depths: Sequence[int] = (1, 4, 8, 16, 32),
    seconds_per_depth: float = 2.0,
    direct: bool = True,
    seed: int = 0,
    pieces: int = 1,
) -> list[dict[str, Any]]:
    """Random whole-block reads of ``path`` (or of several files, every block equally likely, as
    the expert cache reads a bundle's expert files), one result per queue depth, in order:
    {queue_depth, pieces, reads, bytes, seconds, gb_per_s, median_read_ms, direct, block_bytes}.
    ``pieces`` > 1: each block read as that many parts at once by the native reader's C pool (as
    the engine reads with ``read_pieces``; a ReadError where that reader cannot run).

    Block k is the ``block_bytes`` at ``k * block_bytes``; a file's partial last block is never
    read. ``direct=False`` reads through the page cache (each file's cached pages are dropped
    before each depth, but a block read twice is then a cache hit); refused, never silently
    substituted, when O_DIRECT is unavailable."""
    if block_bytes <= 0 or block_bytes % ALIGN:
        raise AlignmentError(
            f"block_bytes {block_bytes} is not a positive multiple of {ALIGN}: O_DIRECT reads need "
            f"aligned lengths (a bundle's block_bytes always is one)"
        )
    if not queue_depths or any(d < 1 for d in queue_depths):
        raise ValueError(f"queue depths must be >= 1, got {list(queue_depths)}")
    if seconds_per_depth <= 0:
        raise ValueError(f"seconds_per_depth must be positive, got {seconds_per_depth}")
    paths = [Path(path)] if isinstance(path, (str, Path)) else [Path(p) for p in path]
    if not paths:
        raise ValueError("no file to read")
    starts = [0]  # first global block index of each file
    for p in paths:
        try:
            size = p.stat().st_size
        except OSError as exc:
            raise ReadError(f"cannot read {p}: {exc.strerror}") from exc
        if size < block_bytes:
            raise ReadError(
                f"{p}: {size} bytes, smaller than one block of {block_bytes} bytes: nothing to read"
            )
        starts.append(starts[-1] + size // block_bytes)
    if pieces > 1:
        return [
            _one_depth_pooled(paths, starts, block_bytes, depth, pieces, seconds_per_depth, direct, seed)
            for depth in queue_depths
        ]
    fds = []
    try:
        for p in paths:
            fds.append(_open(p, direct))
        return [
            _one_depth(paths, fds, starts, block_bytes, depth, seconds_per_depth, direct, seed)
            for depth in queue_depths
        ]
    finally:
        for fd in fds:
            os.close(fd)


def _closed_loop(
    paths: list[Path],
    starts: list[int],
    block_bytes: int,
    depth: int,
    seconds: float,
    direct: bool,
    tag: str,
    read: Callable[[int, int, memoryview], None],
    pieces: int = 1,
) -> dict[str, Any]:
    """``depth`` threads, each with one page-aligned buffer, read random whole blocks back to back
    for ``seconds`` (started together): ``read(file, block, view)`` reads block ``block`` of
    ``paths[file]`` into ``view``. The result row of :func:`read_bandwidth`."""
    clock: dict[str, float] = {}
    barrier = threading.Barrier(depth, action=lambda: clock.setdefault("start", time.perf_counter()))

    def one(i: int) -> tuple[int, list[float], float]:
        buf = aligned_buffer(block_bytes)
        view = memoryview(buf)[:block_bytes]
        rnd = random.Random(f"{tag}/{i}")
        times: list[float] = []
        try:
            try:
                barrier.wait()
            except threading.BrokenBarrierError:
                return 0, times, time.perf_counter()  # another reader failed; its error is raised
            deadline = clock["start"] + seconds
            while (now := time.perf_counter()) < deadline:
                k = rnd.randrange(starts[-1])
                f = bisect.bisect_right(starts, k) - 1
                read(f, k - starts[f], view)
                times.append(time.perf_counter() - now)
            return len(times), times, time.perf_counter()
        except BaseException:
            barrier.abort()
            raise
        finally:
            view.release()
            buf.close()

    with ThreadPoolExecutor(depth, thread_name_prefix="edgerun-calibrate") as pool:
        runs = [f.result() for f in [pool.submit(one, i) for i in range(depth)]]
    reads = sum(n for n, _, _ in runs)
    elapsed = max(end for _, _, end in runs) - clock["start"]
    nbytes = reads * block_bytes
    return {
        "queue_depth": depth,
        "pieces": pieces,
        "reads": reads,
        "bytes": nbytes,
        "seconds": elapsed,
        "gb_per_s": nbytes / elapsed / 1e9,
        "median_read_ms": statistics.median(t for _, ts, _ in runs for t in ts) * 1e3 if reads else None,
        "direct": direct,
        "block_bytes": block_bytes,
    }


def _one_depth(
    paths: list[Path],
    fds: list[int],
    starts: list[int],
    block_bytes: int,
    depth: int,
    seconds: float,
    direct: bool,
    seed: int,
) -> dict[str, Any]:
    if not direct:
        for fd in fds:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def read(f: int, index: int, view: memoryview) -> None:
        offset = index * block_bytes
        if direct:
            check_alignment(offset, block_bytes, buffer_address(view), f"{paths[f]} block {index}")
        try:
            got = os.preadv(fds[f], [view], offset)
        except OSError as exc:
            raise ReadError(
                f"{paths[f]}: read of {block_bytes} bytes at offset {offset} failed: {exc}"
            ) from exc
        if got != block_bytes:
            raise ReadError(f"{paths[f]}: short read at offset {offset}: {got} of {block_bytes} bytes")

    return _closed_loop(paths, starts, block_bytes, depth, seconds, direct, f"{seed}/{depth}", read)


def _one_depth_pooled(
    paths: list[Path],
    starts: list[int],
    block_bytes: int,
    depth: int,
    pieces: int,
    seconds: float,
    direct: bool,
    seed: int,
) -> dict[str, Any]:
    """``depth`` threads each keep one block in flight through the native pool, which reads it as
    ``pieces`` parts at once (depth x pieces requests at the disk)."""
    from edgerun.cache.reader import BlockReader

    reader = BlockReader(
        block_bytes, staging=depth, mode="direct" if direct else "buffered", depth=depth,
        reader="native", pieces=pieces,
    )  # fmt: skip
    if not direct:
        for p in paths:
            fd = _open(p, False)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)

    def read(f: int, index: int, view: memoryview) -> None:
        reader.read_into(paths[f], index, None, starts[f + 1] - starts[f], dest=view)

    try:
        tag = f"{seed}/{depth}/{pieces}"
        row = _closed_loop(paths, starts, block_bytes, depth, seconds, direct, tag, read, reader.pieces)
    finally:
        reader.close()
    if reader.stats.fallbacks:
        raise ReadError(f"read pieces calibration: {'; '.join(reader.stats.fallbacks.values())}")
    return row


def burst_seconds(
    paths: Sequence[Path],
    block_bytes: int,
    sizes: Sequence[int] = (1, 2, 3, 4, 5, 6, 8),
    depth: int = 4,
    pieces: int = 1,
    idle: float = 0.002,
    repeats: int = 15,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """What a streamed layer's reads cost: ``j`` random blocks submitted at once to the native
    reader (``depth`` in flight, ``pieces`` parts each, O_DIRECT) after the disk idled ``idle``
    seconds, timed from the submit until the last one has landed; per j the median and the
    range over ``repeats`` bursts (interleaved over the sizes). A layer's misses are such a burst:
    issued after its router, waited for before its experts run, with the host's and the GPU's
    work between one layer's last read and the next layer's first. Steady back-to-back reads
    (``read_bandwidth``) do not pay the ramp-up of a burst after idle."""
    from edgerun.cache.reader import BlockReader

    paths = [Path(p) for p in paths]
    counts = [os.stat(p).st_size // block_bytes for p in paths]
    reader = BlockReader(
        block_bytes, staging=max(sizes), mode="direct", depth=depth, reader="native", pieces=pieces
    )
    bufs = [aligned_buffer(block_bytes) for _ in range(max(sizes))]
    views = [memoryview(b)[:block_bytes] for b in bufs]
    rnd = random.Random(f"burst/{seed}")
    times: dict[int, list[float]] = {j: [] for j in sizes}
    try:
        reader.read_into(paths[0], 0, None, counts[0], dest=views[0])  # the pool started, files open
        for _ in range(repeats):
            for j in sizes:
                picks = [(f := rnd.randrange(len(paths)), rnd.randrange(counts[f])) for _ in range(j)]
                time.sleep(idle)
                t0 = time.perf_counter()
                futures = [
                    reader.submit(paths[f], k, None, counts[f], dest=views[i])
                    for i, (f, k) in enumerate(picks)
                ]
                for fut in futures:
                    fut.result()
                times[j].append(time.perf_counter() - t0)
    finally:
        reader.close()
        for v in views:
            v.release()
        for b in bufs:
            b.close()
    return [
        {
            "reads": j,
            "depth": depth,
            "pieces": reader.pieces,
            "idle_s": idle,
            "median_s": statistics.median(ts),
            "min_s": min(ts),
            "max_s": max(ts),
            "gb_per_s": j * block_bytes / statistics.median(ts) / 1e9,
        }
        for j, ts in times.items()
    ]


def median_of_rounds(rounds: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row a read shape from several rounds of the same shapes in the same order (each round
    a :func:`read_bandwidth` call per pieces count, one after the other, so the disk's drift over
    the calibration reaches every shape alike): the row of the round at the median rate, its
    ``gb_per_s`` that median, with ``gb_per_s_rounds`` (every round's rate, in order) and
    ``gb_per_s_range`` [min, max]. A steady rate, where the best of many short windows is biased
    up by a noisy disk's bursts (docs/benchmarks.md, forty-eighth session)."""
    if not rounds or not rounds[0]:
        raise ValueError("no calibration rounds")
    shape = [(r["queue_depth"], r.get("pieces", 1)) for r in rounds[0]]
    for i, rows in enumerate(rounds[1:], 1):
        got = [(r["queue_depth"], r.get("pieces", 1)) for r in rows]
        if got != shape:
            raise ValueError(f"calibration round {i} read shapes {got}, round 0 {shape}: not the same shapes")
    merged = []
    for k in range(len(shape)):
        ranked = sorted((rows[k] for rows in rounds), key=lambda r: r["gb_per_s"])
        mid = ranked[(len(ranked) - 1) // 2]  # the lower median for an even count: a rate a round read at
        rates = [rows[k]["gb_per_s"] for rows in rounds]
        merged.append({**mid, "gb_per_s_rounds": rates, "gb_per_s_range": [min(rates), max(rates)]})
    return merged


def read_rounds(
    paths: Sequence[str | Path],
    block_bytes: int,
    rounds: int = 3,
    seconds_per_depth: float = 2.0,
    pieces: Sequence[int] = (1,),
) -> tuple[list[dict[str, Any]], float]:
    """The storage bound's calibration: ``rounds`` rounds of every read shape in turn (whole blocks
    at the default queue depths; each ``pieces`` count > 1 at depths 1, 2, 4 and 8, as the engine
    reads split blocks), merged by :func:`median_of_rounds`; with the best single window of any
    shape (GB/s), the bound such a calibration gave before it had rounds."""
    if rounds < 1:
        raise ValueError(f"calibration rounds must be >= 1, got {rounds}")
    done = []
    for _ in range(rounds):
        rows = read_bandwidth(paths, block_bytes, seconds_per_depth=seconds_per_depth)
        for n in sorted({n for n in pieces if n > 1}):  # the disk read the way those runs read it
            rows += read_bandwidth(
                paths, block_bytes, queue_depths=(1, 2, 4, 8), seconds_per_depth=seconds_per_depth, pieces=n
            )
        done.append(rows)
    return median_of_rounds(done), max(r["gb_per_s"] for rows in done for r in rows)


def add_arguments(ap: Any) -> None:
    """A benchmark's ``--calibrate-seconds`` and ``--calibrate-rounds`` (:func:`read_rounds`)."""
    ap.add_argument("--calibrate-seconds", type=float, default=2.0, help="seconds a read shape a round")
    ap.add_argument(
        "--calibrate-rounds",
        type=int,
        default=3,
        help="calibration rounds (every read shape once a round); a shape's rate is its median round, "
        "the storage bound the best shape's",
    )


def check_arguments(ap: Any, ns: Any) -> None:
    """Refuse (``ap.error``, by name) calibration arguments :func:`read_rounds` cannot take."""
    if ns.calibrate_rounds < 1 or ns.calibrate_seconds <= 0:
        ap.error(
            f"--calibrate-rounds must be >= 1 and --calibrate-seconds > 0, got {ns.calibrate_rounds} "
            f"and {ns.calibrate_seconds}"
        )


def best(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The result with the highest GB/s (the disk's bound for the expert cache)."""
    if not results:
        raise ValueError("no calibration results")
    return max(results, key=lambda r: r["gb_per_s"])


def device_copy_bandwidth(device: Any = "cuda", nbytes: int = 1 << 30, repeats: int = 5) -> dict[str, Any]:
    """Copy rates on a CUDA device, timed with CUDA events over ``repeats`` copies of ``nbytes``
    each (after one warm-up copy): median and [min, max] GB/s.

    ``d2d``: device memory to device memory; its GB/s counts the bytes read plus the bytes written
    (2 x nbytes per copy), as memory-bandwidth figures are quoted. ``h2d_pinned``: from page-locked
    host memory to the device; its GB/s counts the bytes moved (nbytes per copy).

    Raises ``DeviceUnavailable`` (nothing measured, the message says why) without torch, without
    CUDA, or for a non-CUDA ``device``; refuses, with the numbers, sizes the device cannot hold."""
    try:
        import torch
    except ImportError as exc:
        raise DeviceUnavailable("device copy bandwidth: torch is not installed; nothing measured") from exc
    if not torch.cuda.is_available():
        raise DeviceUnavailable(
            f"device copy bandwidth: no CUDA device (torch {torch.__version__}, CUDA build "
            f"{torch.version.cuda}); nothing measured"
        )
    dev = torch.device(device)
    if dev.type != "cuda":
        raise DeviceUnavailable(f"device copy bandwidth measures a CUDA device, got {str(dev)!r}")
    if nbytes <= 0 or repeats < 1:
        raise ValueError(f"nbytes and repeats must be positive, got {nbytes} and {repeats}")
    free, total = torch.cuda.mem_get_info(dev)
    if 2 * nbytes > free:
        raise EdgerunError(
            f"device copy bandwidth needs 2 x {nbytes:,d} bytes of device memory; {dev} has {free:,d} "
            f"of {total:,d} free (pass a smaller nbytes)"
        )
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def rates(copy, moved: int) -> list[float]:
        copy()  # warm-up
        out = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            copy()
            end.record()
            end.synchronize()
            out.append(moved / (start.elapsed_time(end) / 1e3) / 1e9)
        return out

    with torch.cuda.device(dev):
        d2d = rates(lambda: dst.copy_(src), 2 * nbytes)
        h2d = rates(lambda: dst.copy_(host, non_blocking=True), nbytes)
    return {
        "device": f"{dev} ({torch.cuda.get_device_name(dev)})",
        "nbytes": nbytes,
        "repeats": repeats,
        "d2d_gb_per_s": statistics.median(d2d),
        "d2d_gb_per_s_range": [min(d2d), max(d2d)],
        "h2d_pinned_gb_per_s": statistics.median(h2d),
        "h2d_pinned_gb_per_s_range": [min(h2d), max(h2d)],
    }


CALIBRATION_EXPERTS = 32  # distinct experts a timed CPU step reads: 50 MiB of int4 blocks, past CPU caches


def cpu_expert_seconds(
    layout: Any, tokens: int = 1, experts: int = CALIBRATION_EXPERTS, repeats: int = 5
) -> dict[str, Any]:
    """The CPU expert kernels (kernels/moe_cpu.py) on ``layout``'s experts, on this machine's
    cores at torch's thread count: a step of ``tokens`` tokens, each routed to the same
    ``experts`` random experts (host memory, repacked once before timing), timed ``repeats`` times
    after one warm-up: seconds per expert (median and range) and ``gb_per_s``, the expert bytes
    per second computed (block_bytes / seconds per expert: the device profile's
    cpu_expert_bandwidth when ``tokens`` is 1). Refused, with the reason, for a layout the CPU
    kernels do not take."""
    import torch

    from edgerun.kernels.cpu_layout import unsupported
    from edgerun.kernels.moe_cpu import moe_cpu
    from edgerun.kernels.moe_reference import layout_dims, random_pool

    why = unsupported(layout)
    if why:
        raise EdgerunError(f"CPU expert time: {why}")
    if tokens < 1 or experts < 1 or repeats < 1:
        raise ValueError(f"tokens, experts and repeats must be positive, got {tokens}, {experts}, {repeats}")
    g = torch.Generator().manual_seed(0)
    pool, gscales = random_pool(layout, experts, generator=g)
    D, _ = layout_dims(layout)
    x = torch.randn(tokens, D, generator=g).to(torch.bfloat16)
    ids = torch.arange(experts).expand(tokens, experts)
    weights = torch.full((tokens, experts), 1.0 / experts)
    packed: dict = {}
    times = []
    for r in range(repeats + 1):  # the first repacks and warms up
        start = time.perf_counter()
        moe_cpu(x, pool, ids, ids, weights, layout, gscales, packed, out_dtype=torch.float32)
        if r:
            times.append((time.perf_counter() - start) / experts)
    per = statistics.median(times)
    return {
        "tokens": tokens,
        "experts": experts,
        "threads": torch.get_num_threads(),
        "block_bytes": layout.block_bytes,
        "seconds_per_expert": per,
        "seconds_per_expert_range": [min(times), max(times)],
        "gb_per_s": layout.block_bytes / per / 1e9,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m edgerun.tools.calibrate cpu-experts BUNDLE_DIR``: the CPU expert kernels on the
    bundle's first MoE layer's layout here, as JSON, and the device profile line it gives."""
    import argparse
    import json

    p = argparse.ArgumentParser(prog="python -m edgerun.tools.calibrate")
    sub = p.add_subparsers(dest="what", required=True)
    c = sub.add_parser("cpu-experts", help="the CPU expert kernels' time per expert on this machine")
    c.add_argument("bundle", type=Path)
    c.add_argument("--tokens", type=int, default=1)
    c.add_argument(
        "--experts", type=int, default=32, help="distinct experts a step reads (more than fit a CPU cache)"
    )
    ns = p.parse_args(argv)
    from edgerun.bundle.reader import Bundle

    bundle = Bundle.open(ns.bundle)
    result = cpu_expert_seconds(bundle.layouts[bundle.args.moe_layers[0]], ns.tokens, ns.experts)
    print(json.dumps(result, indent=1))
    print(
        f"cpu_expert_bandwidth: {result['gb_per_s']:.1f}GB/s   # device profile (discrete), tokens {ns.tokens}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
