"""Block reads from expert files: O_DIRECT, several in flight, through owned staging buffers.

Every read takes a page-aligned staging buffer from a queue, owns it for the whole read and the
copy out, and puts it back. Offsets, lengths and buffers are checked for alignment before the
system call, so a misaligned request says which of the three is wrong instead of EINVAL.
``mode="buffered"`` reads through the page cache for filesystems without O_DIRECT (tmpfs);
``mode="auto"`` tries O_DIRECT and falls back to buffered reads, recording the fallback and
its reason (never silently).

``reader`` picks who reads: ``preadv`` (one blocking read per Python pool thread), ``io_uring``
(the same threads submit to one ring; ``edgerun.cache.uring``, optional dependency ``liburing``)
or ``native`` (C threads that read, check and copy without the GIL; ``edgerun.cache.native``,
built at first use with the system compiler). ``io_uring`` or ``native`` where it cannot run is
an error naming why; ``auto`` takes native where it runs, else preadv with the reason recorded as
the ``native_reader`` fallback, counted per read.

Two ways in: :meth:`BlockReader.fetch` / :meth:`BlockReader.stage` with a :class:`Target` (where
the block goes, declared: every backend, the engine's path), and ``submit`` / ``read_into`` with a
Python ``sink`` (any backend; with ``native`` the sink runs in the thread that takes the result).

A read given a ``check`` runs it on the bytes before they are handed on (before the sink's copy,
or before a read into caller memory counts as done). A block that fails it is read once more,
through a fresh descriptor and past the page cache; failing again, the error propagates. Short
reads, I/O errors and a file that cannot be opened are :class:`StorageError` s, named.
"""

from __future__ import annotations

import copy
import errno
import mmap
import os
import queue
import stat
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

from edgerun.cache import native as N
from edgerun.errors import ChecksumError, EdgerunError, StorageError

ALIGN = 4096
MODES = ("direct", "buffered", "auto")
READERS = ("preadv", "io_uring", "native", "auto")


class ReadError(EdgerunError, OSError):
    pass


class AlignmentError(ReadError, ValueError):
    pass


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """Anonymous mapping: page-aligned, as O_DIRECT needs (``torch.empty`` is not)."""
    return mmap.mmap(-1, max(nbytes, ALIGN), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def buffer_address(buf) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def direct_supported(path: Path) -> bool:
    """Whether ``path``'s filesystem opens it with O_DIRECT (tmpfs, for one, does not)."""
    try:
        os.close(os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0)))
        return True
    except OSError:
        return False


def disk_of(path: Path) -> tuple[str, str] | None:
    """(block device name, its kind: virtio | nvme | other) holding ``path``, from sysfs (a
    partition answers for its disk); None where sysfs does not say (not Linux, an overlay or
    network filesystem)."""
    try:
        st = os.stat(path)
        dev = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}").resolve(strict=True)
    except OSError:
        return None
    if (dev / "partition").exists():
        dev = dev.parent
    try:
        driver = (dev / "device" / "driver").resolve(strict=True).name
    except OSError:
        driver = ""
    name = dev.name
    kind = (
        "virtio"
        if driver == "virtio_blk" or name.startswith("vd")
        else "nvme"
        if name.startswith("nvme")
        else "other"
    )
    return name, kind


def check_alignment(offset: int, length: int, address: int, what: str) -> None:
    problems = []
    if offset % ALIGN:
        problems.append(f"offset {offset} is not a multiple of {ALIGN}")
    if length % ALIGN:
        problems.append(f"length {length} is not a multiple of {ALIGN}")
    if address % ALIGN:
        problems.append(f"buffer address {address:#x} is not {ALIGN}-byte aligned")
    if problems:
        raise AlignmentError(f"O_DIRECT read of {what}: " + "; ".join(problems))


# counted per read they serve
READ_FALLBACKS = ("direct_read", "io_uring", "native_reader", "pageable_staging", "unchecked_blocks")
_EVERY_READ = ("direct_read", "io_uring", "native_reader", "read_pieces")  # the rest count staged reads only


@dataclass(frozen=True)
class Target:
    """Where a block read goes. ``direct``: the read lands in ``row`` itself (page-aligned host
    memory: a mapped slot, a host tier row); ``host``: copied into ``row`` (host memory);
    ``device``: copied into ``row`` (device memory) asynchronously on ``stream``, the staging
    buffer's next read waiting for that copy (its fence). ``row``: a uint8 tensor of one block."""

    kind: str
    row: object
    stream: object = None


def copy_out(view: memoryview, to: Target):
    """A staging buffer's bytes into ``to`` (host or device); returns the copy's fence or None."""
    import torch

    src = torch.frombuffer(view, dtype=torch.uint8)
    if to.kind != "device":
        to.row.copy_(src)
        return None
    with torch.cuda.stream(to.stream):
        to.row.copy_(src, non_blocking=True)
        done = torch.cuda.Event()
        done.record(to.stream)
    return done


@dataclass
class ReadStats:
    reads: int = 0
    bytes: int = 0
    seconds: float = 0.0  # summed per-read wall time (reads overlap: see wall_seconds)
    wall_seconds: float = 0.0  # time with at least one read in flight
    depth_seconds: float = 0.0  # requests at the disk integrated over time (a piece each)
    rereads: int = 0  # blocks read again after failing their check
    wasted_faults: int = 0  # staged reads dropped unclaimed that failed (nothing used their bytes)
    fallbacks: dict[str, str] = field(default_factory=dict)  # kind -> reason
    fallback_reads: dict[str, int] = field(default_factory=dict)  # kind -> reads it served

    @property
    def bandwidth(self) -> float:
        return self.bytes / self.wall_seconds if self.wall_seconds else 0.0


@dataclass
class Staged:
    """A block in a staging buffer its holder owns (``BlockReader.stage``): ``view`` holds the
    checked bytes until ``release`` hands the buffer back."""

    view: memoryview
    _release: Callable[[object], None]

    def release(self, fence=None) -> None:
        """Hand the buffer back; ``fence`` (see :class:`BlockReader`): an asynchronous copy out of
        it still in flight, which the buffer's next read waits for."""
        self.view.release()
        self._release(fence)

    def place(self, to: Target) -> None:
        """Copy the block to ``to`` and hand the buffer back (fenced by the copy)."""
        fence = None
        try:
            fence = copy_out(self.view, to)
        finally:
            self.release(fence)


class BlockReader:
    """Reads fixed-size blocks ``index`` of ``path`` (at ``index * block_bytes``) into caller
    memory. ``submit`` returns a Future; ``sink(staging_view)`` consumes the bytes while the
    staging buffer is still owned by the read. A sink that copies out asynchronously (a CUDA
    copy from page-locked staging) returns a *fence*, anything with ``synchronize()`` (the copy's
    event): the buffer goes back at once, and its next read waits for the fence first, so no
    thread waits for a copy it only started (the consumer orders its own use after the copies)."""

    def __init__(
        self,
        block_bytes: int,
        staging: int = 4,
        mode: str = "auto",
        depth: int | None = None,
        reader: str = "preadv",
        pieces: int = 1,
    ) -> None:
        if mode not in MODES:
            raise ReadError(f"read_mode {mode!r} is not one of {', '.join(MODES)}")
        if reader not in READERS:
            raise ReadError(f"reader {reader!r} is not one of {', '.join(READERS)}")
        if block_bytes <= 0 or block_bytes % ALIGN:
            raise AlignmentError(f"block_bytes {block_bytes} is not a positive multiple of {ALIGN}")
        if staging < 1:
            raise ReadError(f"staging buffer count must be >= 1, got {staging}")
        if depth is not None and depth < 1:
            raise ReadError(f"read depth (reads in flight) must be >= 1, got {depth}")
        if not 1 <= pieces <= 64:
            raise ReadError(f"read pieces (parts a block is read in at once) must be 1..64, got {pieces}")
        self.block_bytes = block_bytes
        self.mode = mode
        self._buffers = [aligned_buffer(block_bytes) for _ in range(staging)]
        self._pinned: list[mmap.mmap] = []
        # free staging buffers, each with the fence of its last copy out (None: nothing pending)
        self._free: queue.Queue[tuple[mmap.mmap, object]] = queue.Queue()
        for b in self._buffers:
            self._free.put((b, None))
        # reads in flight: one per staging buffer, or fewer where the disk is faster shallow
        # (calibrate with edgerun.tools.calibrate.read_bandwidth)
        self.depth = min(depth or staging, staging)
        self._stats = ReadStats()
        self._uring = None
        self._native = None  # the C pool (reader native), started at the first read
        self._native_start = threading.Lock()
        self._native_why = None
        self._cuda_device = None  # set by pin(): the native pool copies to this device
        if reader in ("native", "auto"):
            self._native_why = N.unavailable()
            if self._native_why is not None:
                if reader == "native":
                    raise ReadError(f"reader native: {self._native_why} (set reader: preadv or auto)")
                self._stats.fallbacks["native_reader"] = f"{self._native_why}; reading with preadv"
            reader = "native" if self._native_why is None else "preadv"
        if reader == "io_uring":
            from edgerun.cache.uring import UringReads, UringUnavailable

            try:
                self._uring = UringReads(self.depth)
            except UringUnavailable as exc:
                raise ReadError(f"reader io_uring: {exc} (set reader: preadv or auto)") from exc
        # who reads: preadv / io_uring in Python threads, or the C pool
        self.backend = "native" if reader == "native" else "preadv" if self._uring is None else "io_uring"
        # parts of a block read at once (the native pool's threads); the other readers read whole blocks
        self.pieces = N.parts(block_bytes, pieces) if self.backend == "native" else 1
        if pieces > 1 and self.backend != "native":
            self._stats.fallbacks["read_pieces"] = (
                f"read_pieces {pieces} needs the native reader; {self.backend} reads whole blocks"
            )
        self._pool = ThreadPoolExecutor(max_workers=self.depth, thread_name_prefix="edgerun-read")
        self._fds: dict[tuple[Path, bool], int] = {}
        self._retired: list[int] = []  # replaced by a fresh open; a read in flight may still use one
        self._lock = threading.Lock()
        self._inflight = 0
        self._busy_since = 0.0
        self._depth_since = 0.0  # the last change of _inflight (reads in flight x time: ReadStats)
        self.staged = 0  # staged reads submitted and not yet released (see ``stage``)
        # a reader dropped without close() still unregisters its page-locked buffers before they
        # are unmapped (else a later mapping at the same address could not be registered) and
        # closes its files
        self._natives: list = []  # the C pool, when started (closed before the buffers go)
        self._finalizer = weakref.finalize(
            self, _release, self._pinned, self._fds, self._retired, self._uring, self._natives
        )

    @property
    def staging_bytes(self) -> int:
        return len(self._buffers) * self.block_bytes

    def _fd(self, path: Path, fresh: bool = False) -> tuple[int, bool]:
        """(fd, direct) for path, opening it on first use (``fresh``: again, in case the file was
        replaced since: the same descriptor number then reads the new file, so re-opens leave no
        descriptor behind; a read already in the kernel ends on the old file)."""
        with self._lock:
            direct = self.mode != "buffered" and "direct_read" not in self._stats.fallbacks
            key = (path, direct)
            replaced = self._fds.pop(key) if fresh and key in self._fds else None
            if key in self._fds:
                return self._fds[key], direct
            try:
                fd, got = self._open_checked(path, direct, fresh)
            except BaseException:
                if replaced is not None:
                    self._retired.append(replaced)  # closed with the reader
                raise
            if replaced is not None:
                if got == direct:  # the old number now reads the new file
                    os.dup2(fd, replaced)
                    os.close(fd)
                    fd = replaced
                else:  # O_DIRECT refused this time: the old descriptor is retired
                    self._retired.append(replaced)
            key = (path, got)
            if key in self._fds:  # opened plain after a refused O_DIRECT, and one was open already
                os.close(fd)
                return self._fds[key], got
            self._fds[key] = fd
            return fd, got

    def _open_checked(self, path: Path, direct: bool, fresh: bool) -> tuple[int, bool]:
        """A new descriptor of ``path``, a regular file, and whether it reads O_DIRECT. A file put
        where the expert file was (``fresh``: opened again after a failed check; the bundle's
        paths were checked at load) may be a FIFO, which would block the open, or a symbolic link
        out of the bundle: neither is waited on nor followed."""
        flags = os.O_RDONLY | os.O_NONBLOCK | (os.O_NOFOLLOW if fresh else 0)
        try:
            try:
                fd = os.open(path, flags | (getattr(os, "O_DIRECT", 0) if direct else 0))
            except OSError as exc:
                if not (direct and exc.errno == errno.EINVAL):
                    raise
                reason = f"{path}: filesystem does not support O_DIRECT"
                if self.mode == "direct":
                    raise ReadError(f"{reason} (set read_mode: buffered or auto)") from exc
                self._stats.fallbacks["direct_read"] = reason
                direct = False
                fd = os.open(path, flags)
        except ReadError:
            raise
        except OSError as exc:
            why = "a symbolic link (not followed)" if exc.errno == errno.ELOOP else exc.strerror
            raise StorageError(f"cannot open expert file {path}: {why}") from exc
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise StorageError(f"cannot open expert file {path}: not a regular file")
        return fd, direct

    @property
    def stats(self) -> ReadStats:
        """The reads' counters (with the native reader: its C pool's, plus this side's re-reads)."""
        if self._native is None:
            return self._stats
        reads, nbytes, faults, _, seconds, wall, depth = self._native.stats()
        st = self._stats
        return replace(
            st,
            reads=reads,
            bytes=nbytes,
            seconds=seconds,
            wall_seconds=st.wall_seconds + wall,
            depth_seconds=st.depth_seconds + depth,
            wasted_faults=st.wasted_faults + faults,
        )

    def fetch(
        self,
        path: Path,
        index: int,
        num_blocks: int,
        to: Target,
        check: Callable[[memoryview], object] | None = None,
        expect: int | None = None,
    ):
        """Read block ``index`` to ``to`` (see :class:`Target`): a future whose ``result()`` is the
        bytes read, once the block is there (direct, host) or its copy is queued (device).
        ``check`` as in ``read_into``; ``expect``: the block's xxh3-64 as an integer, which the
        native reader checks in C (``check`` then runs only on a re-read)."""
        if self.backend == "native":
            self._check_index(path, index, num_blocks)
            if to.kind == "direct":
                return self._native_submit(
                    Path(path), index, "direct", check, expect, dest=to.row.numpy().data
                )
            return self._native_submit(Path(path), index, to.kind, check, expect, to=to)
        if to.kind == "direct":
            return self.submit(path, index, None, num_blocks, dest=to.row.numpy().data, check=check)
        return self.submit(path, index, partial(copy_out, to=to), num_blocks, check=check)

    # ---- the native reader (edgerun.cache.native) ----------------------------------------------

    def _pool_native(self):
        with self._native_start:  # two threads' first reads start one pool, not one each
            return self._start_native()

    def _start_native(self):
        if self._native is None:
            addrs = [buffer_address(b) for b in self._buffers]
            try:
                if self._cuda_device is not None:
                    import torch

                    with torch.cuda.device(self._cuda_device):  # the pool copies in this device's context,
                        torch.cuda.synchronize()  # current on this thread from here (the runtime makes it so)
                        self._native = N.NativePool(
                            self.depth * self.pieces, self.block_bytes, addrs, cuda=True, pieces=self.pieces,
                            spare=self.depth,
                        )  # fmt: skip
                else:
                    self._native = N.NativePool(
                        self.depth * self.pieces, self.block_bytes, addrs, cuda=False, pieces=self.pieces,
                        spare=self.depth,
                    )  # fmt: skip
            except N.NativeUnavailable as exc:
                raise ReadError(f"reader native: {exc} (set reader: preadv)") from exc
            self._natives.append(self._native)
        return self._native

    def _native_submit(
        self, path: Path, index: int, kind: str, check, expect, to: Target | None = None, dest=None, sink=None
    ) -> _NativeRead:
        """Queue one read in the C pool: ``kind`` direct (into ``dest``, a writable memoryview),
        host / device (to ``to``), or stage (a staging buffer held until placed or released)."""
        pool = self._pool_native()
        pool._open()  # a closed reader refuses before it opens a file
        code = N.KINDS.get(kind, N.TO_STAGE)
        offset = index * self.block_bytes
        fd, direct = self._fd(path)
        dst, stream = 0, 0
        if dest is not None:
            dst = buffer_address(dest)
            if direct:
                check_alignment(offset, self.block_bytes, dst, f"{path} block {index}")
        elif to is not None:
            dst = to.row.data_ptr()
            if kind == "device":
                if not pool.cuda:
                    raise ReadError(f"{path} block {index}: copies to the device need pin() first")
                stream = to.stream.cuda_stream
        if check is not None and expect is None and code in (N.TO_HOST, N.TO_DEVICE):
            raise ReadError(f"{path} block {index}: a check without its checksum cannot run before the copy")
        expect = expect if check is not None else None
        # a check only Python can run: the read counts once that check has passed
        ticket = pool.submit(fd, offset, code, dst, stream, expect, count=check is None or expect is not None)
        with self._lock:
            for k in self._stats.fallbacks:  # counted per read issued
                if k in _EVERY_READ or (k == "pageable_staging" and code != N.TO_DIRECT):
                    self._stats.fallback_reads[k] = self._stats.fallback_reads.get(k, 0) + 1
        return _NativeRead(self, ticket, path, index, code, (dst, stream), dest, check, expect, sink)

    def _native_settle(self, r: _NativeRead):
        """Wait for a native read; a block failing its check is read again here (fresh
        descriptor) and checked again, as ``_read_checked`` does; errors are named as there."""
        pool = self._native
        held = r.code == N.TO_STAGE
        result, err, got, buf, dt = pool.wait(r.ticket, release=not held)
        offset = r.index * self.block_bytes
        view = r.dest if r.code == N.TO_DIRECT else None
        try:
            if result == N.OK and r.check is not None and r.expect is None:  # a check C cannot run
                if view is None:
                    view = memoryview(self._buffers[buf])[: self.block_bytes]
                try:
                    r.check(view)
                    pool.count(got, dt)
                except ChecksumError:
                    result = N.BAD_SUM
            if result == N.BAD_SUM:
                if view is None:
                    view = memoryview(self._buffers[buf])[: self.block_bytes]
                with self._lock:
                    self._stats.rereads += 1
                n, dt = self._reread(r.path, r.index, view, "its checksum failed")
                r.check(view)  # failing twice: the block is damaged where it is stored
                pool.count(n, dt)
                result = N.OK
            if result == N.IO_ERROR:
                raise StorageError(
                    f"{r.path}: reading block {r.index} at offset {offset}: {OSError(err, os.strerror(err))}"
                )
            if result == N.SHORT:
                raise self._short_read(r.path, r.index, got)
            if result == N.CUDA_ERROR:
                raise StorageError(
                    f"{r.path} block {r.index}: the copy to the device failed (CUresult {err})"
                )
        except BaseException:
            if buf >= 0:
                if view is not None and r.code != N.TO_DIRECT:
                    view.release()
                pool.place(r.ticket)  # the buffer goes back
            view = None  # the traceback keeps this frame: no export of the caller's memory may outlive it
            if held and r.sink is None:
                self._unstage()
            raise
        if buf >= 0 and view is not None and r.code != N.TO_DIRECT:
            view.release()
        if held:
            return _NativeStaged(self, r.ticket, buf, counted=r.sink is None)
        if buf >= 0:  # re-read into its buffer: handed on as the read would have
            pool.place(r.ticket, r.code, *r.where)
        return self.block_bytes

    def read_into(
        self,
        path: Path,
        index: int,
        sink: Callable[[memoryview], None] | None,
        num_blocks: int,
        dest: memoryview | None = None,
        check: Callable[[memoryview], object] | None = None,
    ) -> int:
        """Blocking read of block ``index`` (bounds-checked against ``num_blocks``): into an owned
        staging buffer handed to ``sink``, or, with ``dest`` (page-aligned, block_bytes long),
        straight into the caller's memory (a unified-memory slot) with no staging copy. ``check``
        (raising :class:`ChecksumError`) sees the bytes first; see the module docstring."""
        self._check_index(path, index, num_blocks)
        if dest is not None and len(dest) != self.block_bytes:
            raise ReadError(
                f"{path} block {index}: destination holds {len(dest)} bytes, a block is {self.block_bytes}"
            )
        if self.backend == "native":
            kind = "direct" if dest is not None else "stage"
            return self._native_submit(Path(path), index, kind, check, None, dest=dest, sink=sink).result()
        buf = self._take() if dest is None else None  # owned until returned below
        fence = None
        try:
            view = memoryview(buf)[: self.block_bytes] if dest is None else dest
            n, dt = self._read_checked(Path(path), index, view, check)
            if sink is not None:
                fence = sink(view)
            self._account(n, dt, staged=dest is None)
            return n
        finally:
            if buf is not None:
                self._free.put((buf, fence))

    def stage(
        self,
        path: Path,
        index: int,
        num_blocks: int,
        check: Callable[[memoryview], object] | None = None,
        expect: int | None = None,
    ) -> Future:
        """Read block ``index`` into a staging buffer that stays owned past the read: a Future of
        :class:`Staged`, whose holder places the bytes (``place``) or releases the buffer (a read
        issued before it is known where the block goes). Every staged buffer held is one fewer
        for other reads: :attr:`staged` counts them, from submission to release (or
        :meth:`drop`). ``expect``: as in :meth:`fetch`."""
        self._check_index(path, index, num_blocks)
        with self._lock:
            self.staged += 1
        if self.backend == "native":
            try:
                return self._native_submit(Path(path), index, "stage", check, expect)
            except BaseException:
                self._unstage()
                raise
        return self._pool.submit(self._stage, Path(path), index, check)

    def _take(self) -> mmap.mmap:
        """A free staging buffer, once the last copy out of it (its fence) has completed."""
        buf, fence = self._free.get()
        if fence is not None:
            fence.synchronize()
        return buf

    def _stage(self, path: Path, index: int, check) -> Staged:
        buf = self._take()
        view = memoryview(buf)[: self.block_bytes]
        try:
            n, dt = self._read_checked(path, index, view, check)
            self._account(n, dt, staged=True)
        except BaseException:
            view.release()  # the error's traceback keeps the frame: no export may outlive the read
            self._free.put((buf, None))
            self._unstage()
            raise
        return Staged(view, partial(self._unhold, buf))

    def drop(self, future: Future) -> bool:
        """A staged read nobody will claim: cancelled if it has not started (True), else its
        buffer goes back once it is done (False); a failure is counted in ``wasted_faults``."""
        if isinstance(future, _NativeRead):
            return future.drop()
        if future.cancel():
            self._unstage()
            return True
        future.add_done_callback(self._dropped)
        return False

    def _dropped(self, future: Future) -> None:
        if future.exception() is None:
            future.result().release()
            return
        with self._lock:
            self._stats.wasted_faults += 1

    def _unhold(self, buf: mmap.mmap, fence=None) -> None:
        self._free.put((buf, fence))
        self._unstage()

    def _unstage(self) -> None:
        with self._lock:
            self.staged -= 1

    def _check_index(self, path: Path, index: int, num_blocks: int) -> None:
        if not 0 <= index < num_blocks:
            raise ReadError(f"{path}: block {index} requested, file holds blocks 0..{num_blocks - 1}")

    def _read_checked(self, path: Path, index: int, view: memoryview, check) -> tuple[int, float]:
        """Read block ``index`` into ``view`` and run ``check`` on it; a block failing its check is
        read once more and checked again (see the module docstring)."""
        n, dt = self._pread(path, index, view)
        if check is not None:
            try:
                check(view)
            except ChecksumError as exc:
                with self._lock:
                    self._stats.rereads += 1
                self._reread(path, index, view, str(exc))
                check(view)  # failing twice: the block is damaged where it is stored
        return n, dt

    def _short_read(self, path: Path, index: int, got: int) -> StorageError:
        return StorageError(
            f"{path}: short read of expert {index}'s block at offset {index * self.block_bytes}: "
            f"{got} of {self.block_bytes} bytes (the file is shorter than the bundle says)"
        )

    def _reread(self, path: Path, index: int, view: memoryview, why: str) -> tuple[int, float]:
        """Block ``index`` read again through a fresh descriptor after ``why`` (a failed check);
        a re-read that fails says both."""
        try:
            return self._pread(path, index, view, again=True)
        except StorageError as exc:
            raise StorageError(
                f"expert {index}'s block of {path} was read again because {why}, and: {exc}"
            ) from exc

    def _account(self, n: int, dt: float, staged: bool) -> None:
        with self._lock:
            st = self.stats
            st.reads += 1
            st.bytes += n
            st.seconds += dt
            for kind in st.fallbacks:  # direct_read / io_uring: every read; pageable_staging: staged
                if kind in _EVERY_READ or staged:
                    st.fallback_reads[kind] = st.fallback_reads.get(kind, 0) + 1

    def _pread(self, path: Path, index: int, view: memoryview, again: bool = False) -> tuple[int, float]:
        """One read of block ``index`` into ``view``: (bytes, seconds). ``again``: through a fresh
        descriptor (the file may have been replaced), past the page cache."""
        offset = index * self.block_bytes
        fd, direct = self._fd(path, fresh=again)
        if direct:
            check_alignment(offset, self.block_bytes, buffer_address(view), f"{path} block {index}")
        self._begin()
        t0 = time.perf_counter()
        try:
            if again and not direct:
                os.posix_fadvise(fd, offset, self.block_bytes, os.POSIX_FADV_DONTNEED)
            n = self._read_all(fd, view, offset, direct)
        except OSError as exc:
            raise StorageError(f"{path}: reading block {index} at offset {offset}: {exc}") from exc
        finally:
            dt = time.perf_counter() - t0
            self._end()
        if n != self.block_bytes:
            raise self._short_read(path, index, n)
        return n, dt

    def _read_all(self, fd: int, view: memoryview, offset: int, direct: bool) -> int:
        """Bytes read into ``view`` from ``offset``: a short read is continued until the view is
        full or the file ends (or, with O_DIRECT, until a count that is not aligned: the end)."""
        got, want = 0, len(view)
        address = buffer_address(view) if self._uring is not None else 0
        while got < want:
            if self._uring is not None:
                n = self._uring.read(fd, address + got, want - got, offset + got)
            elif not got:
                n = os.preadv(fd, [view], offset)
            else:
                with view[got:] as rest:
                    n = os.preadv(fd, [rest], offset + got)
            got += n
            if n == 0 or (direct and n % ALIGN):
                break
        return got

    def submit(
        self,
        path: Path,
        index: int,
        sink: Callable[[memoryview], None] | None,
        num_blocks: int,
        dest: memoryview | None = None,
        check: Callable[[memoryview], object] | None = None,
    ) -> Future:
        if self.backend == "native":  # the read in C; a sink runs where the result is taken
            self._check_index(path, index, num_blocks)
            kind = "direct" if dest is not None else "stage"
            return self._native_submit(Path(path), index, kind, check, None, dest=dest, sink=sink)
        return self._pool.submit(self.read_into, path, index, sink, num_blocks, dest, check)

    def _begin(self) -> None:
        with self._lock:
            now = self._depth_tick()
            if self._inflight == 0:
                self._busy_since = now
            self._inflight += 1

    def _end(self) -> None:
        with self._lock:
            now = self._depth_tick()
            self._inflight -= 1
            if self._inflight == 0:
                self._stats.wall_seconds += now - self._busy_since

    def _depth_tick(self) -> float:
        """(lock held) The reads in flight so far integrated over time, up to now (returned)."""
        now = time.perf_counter()
        self._stats.depth_seconds += self._inflight * (now - self._depth_since)
        self._depth_since = now
        return now

    def pin(self, device=None) -> str | None:
        """Page-lock the staging buffers for the CUDA driver (cudaHostRegister), so copies from
        them to device memory run asynchronously; the native pool's copies go to ``device`` (None:
        the current one). Returns None, or why they stay pageable."""
        import torch

        self._cuda_device = torch.cuda.current_device() if device is None else torch.device(device)
        cudart = torch.cuda.cudart()
        for b in self._buffers:
            err = cudart.cudaHostRegister(buffer_address(b), len(b), 0)
            if int(err) != 0:
                cudart.cudaGetLastError()  # clear it, or the next CUDA call reports it as its own
                reason = f"cudaHostRegister failed ({err}): staging buffers stay pageable"
                self._stats.fallbacks["pageable_staging"] = reason
                return reason
            self._pinned.append(b)
        return None

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for pool in self._natives:  # its reads end, its copies complete
            pool.close()
        while not self._free.empty():  # copies out of staging still in flight end before it goes
            _, fence = self._free.get_nowait()
            if fence is not None:
                fence.synchronize()
        self._finalizer()  # after the pool: no read is left in the ring
        for b in self._buffers:
            b.close()
        self._buffers.clear()


class _NativeRead:
    """A read in the native reader's C pool, as a Future: ``result()`` waits (once) and returns
    the bytes read, a :class:`_NativeStaged` (a staged read), or the sink's return."""

    def __init__(
        self, reader: BlockReader, ticket, path, index, code, where, dest, check, expect, sink
    ) -> None:
        self.reader, self.ticket, self.path, self.index, self.code = reader, ticket, path, index, code
        self.where, self.dest, self.check, self.expect, self.sink = where, dest, check, expect, sink
        self._state: tuple | None = None  # (value, error) once settled

    def result(self):
        if self._state is None:
            try:
                value = self.reader._native_settle(self)
                self.dest = None  # not held past the read (the caller may unmap it)
                if self.sink is not None and isinstance(value, _NativeStaged):
                    fence = None
                    try:
                        fence = self.sink(value.view)
                    finally:
                        value.release(fence)
                    value = self.reader.block_bytes
                elif self.sink is not None:  # a direct read with a sink: the sink sees it in place
                    self.sink(self.dest)
                self._state = (value, None)
            except BaseException as exc:
                self.dest = None
                # a copy to raise again: the exception itself holds this frame, and so this read
                self._state = (None, copy.copy(exc))
                raise
        value, error = self._state
        if error is not None:
            raise error
        return value

    def __del__(self) -> None:
        # never waited for (a caller that failed between submitting and waiting): its record is
        # freed, and its buffer given back, when the read ends
        if getattr(self, "_state", True) is None:
            self.reader._native.drop(self.ticket)

    def done(self) -> bool:
        """Whether the read has ended (as ``Future.done``: ``result()`` would not wait)."""
        return self._state is not None or self.reader._native.done(self.ticket)

    def drop(self) -> bool:
        """Nobody will claim it: cancelled if queued (True), else its buffer goes back once done."""
        if self._state is not None:
            value, _ = self._state
            if isinstance(value, _NativeStaged):
                value.release()
            return False
        self._state = (None, ReadError(f"{self.path} block {self.index}: the read was dropped"))
        cancelled = self.reader._native.drop(self.ticket)
        if self.code == 0 and self.sink is None:  # a staged read: its buffer is no longer held
            self.reader._unstage()
        return cancelled


class _NativeStaged:
    """A staged block in one of the native reader's staging buffers (see :class:`Staged`)."""

    def __init__(self, reader: BlockReader, ticket: int, buf: int, counted: bool) -> None:
        self.view = memoryview(reader._buffers[buf])[: reader.block_bytes]
        self._reader, self._ticket, self._counted, self._held = reader, ticket, counted, True

    def place(self, to: Target) -> None:
        device = to.kind == "device"
        stream = to.stream.cuda_stream if device else 0
        self._end(N.TO_DEVICE if device else N.TO_HOST, to.row.data_ptr(), stream)

    def release(self, fence=None) -> None:
        if fence is not None:
            fence.synchronize()  # a copy a Python sink queued out of the buffer
        self._end(0, 0, 0)

    def _end(self, kind: int, dst: int, stream: int) -> None:
        if not self._held:
            return
        self._held = False
        self.view.release()
        try:
            self._reader._native.place(self._ticket, kind, dst, stream)
        finally:
            if self._counted:
                self._reader._unstage()


def _release(pinned: list[mmap.mmap], fds: dict, retired: list[int], uring=None, natives=()) -> None:
    for pool in natives:  # its threads end and its copies complete before the buffers go
        pool.close()
    if uring is not None:
        uring.close()
    if pinned:
        import torch

        for b in pinned:
            torch.cuda.cudart().cudaHostUnregister(buffer_address(b))
        pinned.clear()
    for fd in [*fds.values(), *retired]:
        os.close(fd)
    fds.clear()
    retired.clear()
