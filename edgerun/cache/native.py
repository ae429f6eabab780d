"""Block reads in C threads that never take the GIL (``reader: native``; edgerun/cache/native_reads.c).

Python's reader threads (``preadv``) hold the GIL to check a block, to queue its copy and to
count it, and each time they want it back they wait for the thread holding it: with the engine's
main thread busy between layers, a 26 us checksum took 379 us on an H200 host (docs/benchmarks.md).
Here a pool of POSIX threads reads, checks (xxh3-64: the function xxhash's own module exports, the
same code the manifest's checksums came from) and hands each block on: into caller memory, by
memcpy into host memory, or by an asynchronous copy on the caller's CUDA stream (the driver API,
found in ``libcuda.so.1``), fenced per staging buffer. Python submits a job and waits for its
ticket; ctypes releases the GIL for every call.

The contract is :class:`~edgerun.cache.reader.BlockReader`'s: the reader calls into this module
and keeps what needs Python (opening files, alignment checks, the re-read of a block that failed
its check, the error messages).
"""

from __future__ import annotations

import ctypes
import functools
import importlib
from pathlib import Path

from edgerun.kernels.cbuild import BuildError, build, compiler

SOURCE = Path(__file__).with_name("native_reads.c")
FLAGS = ("-O2", "-fPIC", "-shared", "-std=gnu99", "-pthread")

TO_STAGE, TO_HOST, TO_DEVICE, TO_DIRECT = 0, 1, 2, 3
KINDS = {"host": TO_HOST, "device": TO_DEVICE, "direct": TO_DIRECT}
OK, BAD_SUM, IO_ERROR, SHORT, CUDA_ERROR, NO_JOB = range(6)


class NativeUnavailable(Exception):
    """The native reader cannot run here; the message says why."""


class _CudaApi(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_void_p)
        for name in ("memcpy_htod", "ev_create", "ev_record", "ev_sync", "ev_destroy", "ctx_get", "ctx_set")
    ]


@functools.cache
def library() -> ctypes.CDLL:
    """The built pool (compiled at first use, cached: kernels/cbuild.py); BuildError says why not."""
    lib = build(SOURCE, compiler(), FLAGS, key="", what="the native block reader")
    p, i64, u64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64, ctypes.c_int
    pi64, pd = ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_double)
    sig = {
        "er_open": ([i32, i32, u64, i32, i32, ctypes.POINTER(u64), p, ctypes.POINTER(_CudaApi)], p),
        "er_submit": ([p, i32, u64, i32, u64, u64, i32, u64, i32], i64),
        "er_wait": ([p, i64, pi64, pd, i32], i32),
        "er_done": ([p, i64], i32),
        "er_place": ([p, i64, i32, u64, u64, ctypes.POINTER(i32)], i32),
        "er_count": ([p, i64, ctypes.c_double], None),
        "er_drop": ([p, i64], i32),
        "er_stats": ([p, pi64, pd], None),
        "er_close": ([p], None),
    }
    for name, (args, res) in sig.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    return lib


@functools.cache
def xxh3_64() -> int:
    """Address of XXH3_64bits in xxhash's extension module (what ``block_checksum`` calls)."""
    mod = importlib.import_module("xxhash._xxhash")
    try:
        return ctypes.cast(ctypes.CDLL(mod.__file__).XXH3_64bits, ctypes.c_void_p).value
    except (OSError, AttributeError) as e:
        raise NativeUnavailable(f"xxhash's module {mod.__file__} exports no XXH3_64bits ({e})") from e


@functools.cache
def cuda_api() -> _CudaApi:
    """The CUDA driver entry points the pool copies with (``libcuda.so.1``)."""
    try:
        cu = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise NativeUnavailable(f"libcuda.so.1 cannot be loaded ({e})") from e
    names = {
        "memcpy_htod": "cuMemcpyHtoDAsync_v2",
        "ev_create": "cuEventCreate",
        "ev_record": "cuEventRecord",
        "ev_sync": "cuEventSynchronize",
        "ev_destroy": "cuEventDestroy_v2",
        "ctx_get": "cuCtxGetCurrent",
        "ctx_set": "cuCtxSetCurrent",
    }
    api = _CudaApi()
    for field, sym in names.items():
        try:
            setattr(api, field, ctypes.cast(getattr(cu, sym), ctypes.c_void_p).value)
        except AttributeError as e:
            raise NativeUnavailable(f"libcuda.so.1 has no {sym}") from e
    return api


@functools.cache
def unavailable() -> str | None:
    """Why the native reader cannot run here (no compiler, a build error, no XXH3_64bits), or None.
    Asked once a process: a failed build is not tried again by every reader that is made."""
    try:
        library()
        xxh3_64()
    except (BuildError, NativeUnavailable) as e:
        return str(e)
    return None


def parts(block: int, pieces: int) -> int:
    """The parts a ``block``-byte read is split into when ``pieces`` are asked for: each a whole
    number of 4 KiB pages (O_DIRECT's unit), the last one shorter where they do not divide."""
    pages = -(-block // 4096)
    return -(-block // min(-(-pages // max(pieces, 1)) * 4096, block))


class NativePool:
    """One C pool: ``threads`` readers over ``buffers`` (addresses of page-aligned staging
    buffers of ``block`` bytes each); ``cuda``: copies to device memory may be asked for (the
    calling thread's current CUDA context is the one the pool copies in). ``pieces``: each block
    read as that many parts at once, by as many threads (``threads`` counts them all: reads in
    flight x pieces); the pool rounds a part up to whole 4 KiB pages, so a small block may take
    fewer (``self.pieces``). ``spare``: threads more than that, which check and hand on a
    finished block while the others read (never more than ``threads`` requests at the disk)."""

    def __init__(
        self, threads: int, block: int, buffers: list[int], cuda: bool, pieces: int = 1, spare: int = 0
    ) -> None:
        lib = library()
        addrs = (ctypes.c_uint64 * len(buffers))(*buffers)
        api = ctypes.byref(cuda_api()) if cuda else None
        self._lib = lib
        self._p = lib.er_open(threads, spare, block, pieces, len(buffers), addrs, xxh3_64(), api)
        self.pieces = parts(block, pieces)
        if not self._p:
            raise NativeUnavailable(
                "the native pool did not start (threads, memory, or with CUDA: no current context)"
            )
        self.cuda = cuda
        self._last = (0, 0, 0, 0, 0.0, 0.0, 0.0)  # the counters at close, what stats() says after it

    def _open(self):
        """The pool's handle; after close, an error naming it (never a call into freed memory)."""
        if not self._p:
            raise RuntimeError("native reader: the pool is closed (the expert cache was closed)")
        return self._p

    def submit(
        self,
        fd: int,
        offset: int,
        kind: int,
        dst: int = 0,
        stream: int = 0,
        expect: int | None = None,
        count=True,
    ) -> int:
        """Queue a read; ``expect``: its xxh3-64, checked in C; ``count``: counted when it ends well
        (False: the caller counts it with :meth:`count` once its own check passed)."""
        t = self._lib.er_submit(
            self._open(), fd, offset, kind, dst, stream, expect is not None, expect or 0, count
        )
        if t < 0:
            raise RuntimeError("native reader: too many reads outstanding")
        return t

    def wait(self, ticket: int, release: bool) -> tuple[int, int, int, int, float]:
        """(result, errno, bytes, buffer index or -1, seconds) of a finished read."""
        out, secs = (ctypes.c_int64 * 4)(), ctypes.c_double()
        if self._lib.er_wait(self._open(), ticket, out, ctypes.byref(secs), int(release)) == NO_JOB:
            raise RuntimeError(f"native reader: ticket {ticket} is not outstanding")
        return out[0], out[1], out[2], out[3], secs.value

    def done(self, ticket: int) -> bool:
        """Whether the read has ended (a ticket no longer outstanding counts as ended)."""
        return not self._p or self._lib.er_done(self._p, ticket) != 0

    def place(self, ticket: int, kind: int = TO_STAGE, dst: int = 0, stream: int = 0) -> None:
        """Hand a finished read's buffer on (``TO_STAGE``: nowhere) and free its ticket."""
        err = ctypes.c_int()
        rc = self._lib.er_place(self._open(), ticket, kind, dst, stream, ctypes.byref(err))
        if rc == CUDA_ERROR:
            raise RuntimeError(f"native reader: the copy to the device failed (CUresult {err.value})")
        if rc == NO_JOB:
            raise RuntimeError(f"native reader: ticket {ticket} is not outstanding")

    def count(self, nbytes: int, seconds: float) -> None:
        self._lib.er_count(self._open(), nbytes, seconds)

    def drop(self, ticket: int) -> bool:
        """Cancelled before it started (True); else freed when it ends. A closed pool: nothing to do."""
        return bool(self._p) and bool(self._lib.er_drop(self._p, ticket))

    def stats(self) -> tuple[int, int, int, int, float, float, float]:
        """(reads, bytes, failed dropped reads, requests in flight, summed read seconds, busy wall
        seconds, requests in flight integrated over time); a piece is a request."""
        if not self._p:
            return self._last
        out, secs = self._counters()
        return out[0], out[1], out[2], out[3], secs[0], secs[1], secs[2]

    def peak(self) -> int:
        """The most requests the pool ever had at the disk at once (0 once closed)."""
        return self._counters()[0][4] if self._p else 0

    def _counters(self):
        """er_stats' two arrays: 5 counts, 3 clocks (see native_reads.c)."""
        out, secs = (ctypes.c_int64 * 5)(), (ctypes.c_double * 3)()
        self._lib.er_stats(self._p, out, secs)
        return out, secs

    def close(self) -> None:
        """Stop the threads (queued reads are dropped, running ones end), wait for the copies out
        of every staging buffer, free the pool. Idempotent."""
        if self._p:
            self._last = self.stats()
            p, self._p = self._p, None
            self._lib.er_close(p)
