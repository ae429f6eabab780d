"""Block reads from expert files: O_DIRECT, several in flight, through owned staging buffers.

Every read takes a page-aligned staging buffer from a queue, owns it for the whole read and the
copy out, and puts it back. Offsets, lengths and buffers are checked for alignment before the
system call, so a misaligned request says which of the three is wrong instead of EINVAL.
``mode="buffered"`` reads through the page cache for filesystems without O_DIRECT (tmpfs);
``mode="auto"`` tries O_DIRECT and falls back to buffered reads, recording the fallback and
its reason (never silently).

``reader`` picks the system call: ``preadv`` (the default: one blocking read per pool thread) or
``io_uring`` (the same threads submit to one ring; ``edgerun.cache.uring``, optional dependency
``liburing``). ``io_uring`` where it cannot run is an error naming why; ``auto`` takes io_uring
where it runs, else preadv with the reason recorded as the ``io_uring`` fallback, counted per read.

A read given a ``check`` runs it on the bytes before they are handed on (before the sink's copy,
or before a read into caller memory counts as done). A block that fails it is read once more,
through a fresh descriptor and past the page cache; failing again, the error propagates. Short
reads, I/O errors and a file that cannot be opened are :class:`StorageError` s, named.
"""

from __future__ import annotations

import errno
import mmap
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from edgerun.errors import ChecksumError, EdgerunError, StorageError

ALIGN = 4096
MODES = ("direct", "buffered", "auto")
READERS = ("preadv", "io_uring", "auto")


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
READ_FALLBACKS = ("direct_read", "io_uring", "pageable_staging", "unchecked_blocks")
_EVERY_READ = ("direct_read", "io_uring")  # the rest count staged reads only


@dataclass
class ReadStats:
    reads: int = 0
    bytes: int = 0
    seconds: float = 0.0  # summed per-read wall time (reads overlap: see wall_seconds)
    wall_seconds: float = 0.0  # time with at least one read in flight
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
        self.stats = ReadStats()
        self._uring = None
        if reader != "preadv":
            from edgerun.cache.uring import UringReads, UringUnavailable

            try:
                self._uring = UringReads(self.depth)
            except UringUnavailable as exc:
                if reader == "io_uring":
                    raise ReadError(f"reader io_uring: {exc} (set reader: preadv or auto)") from exc
                self.stats.fallbacks["io_uring"] = f"{exc}; reading with preadv"
        self.backend = "preadv" if self._uring is None else "io_uring"  # the system call reads use
        self._pool = ThreadPoolExecutor(max_workers=self.depth, thread_name_prefix="edgerun-read")
        self._fds: dict[tuple[Path, bool], int] = {}
        self._retired: list[int] = []  # replaced by a fresh open; a read in flight may still use one
        self._lock = threading.Lock()
        self._inflight = 0
        self._busy_since = 0.0
        self.staged = 0  # staged reads submitted and not yet released (see ``stage``)
        # a reader dropped without close() still unregisters its page-locked buffers before they
        # are unmapped (else a later mapping at the same address could not be registered) and
        # closes its files
        self._finalizer = weakref.finalize(
            self, _release, self._pinned, self._fds, self._retired, self._uring
        )

    @property
    def staging_bytes(self) -> int:
        return len(self._buffers) * self.block_bytes

    def _fd(self, path: Path, fresh: bool = False) -> tuple[int, bool]:
        """(fd, direct) for path, opening it on first use (``fresh``: again, in case the file was
        replaced since)."""
        with self._lock:
            direct = self.mode != "buffered" and "direct_read" not in self.stats.fallbacks
            key = (path, direct)
            if fresh and key in self._fds:
                self._retired.append(self._fds.pop(key))
            if key in self._fds:
                return self._fds[key], direct
            flags = os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0)
            try:
                fd = os.open(path, flags)
            except OSError as exc:
                if direct and exc.errno == errno.EINVAL:
                    reason = f"{path}: filesystem does not support O_DIRECT"
                    if self.mode == "direct":
                        raise ReadError(f"{reason} (set read_mode: buffered or auto)") from exc
                    self.stats.fallbacks["direct_read"] = reason
                    direct = False
                    key = (path, False)
                    if key in self._fds:
                        return self._fds[key], False
                    fd = os.open(path, os.O_RDONLY)
                else:
                    raise StorageError(f"cannot open expert file {path}: {exc.strerror}") from exc
            self._fds[key] = fd
            return fd, direct

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
    ) -> Future:
        """Read block ``index`` into a staging buffer that stays owned past the read: a Future of
        :class:`Staged`, whose holder copies the bytes out and releases the buffer (a read issued
        before it is known where the block goes). Every staged buffer held is one fewer for
        other reads: :attr:`staged` counts them, from submission to release (or :meth:`drop`)."""
        self._check_index(path, index, num_blocks)
        with self._lock:
            self.staged += 1
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
            self.stats.wasted_faults += 1

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
            except ChecksumError:
                with self._lock:
                    self.stats.rereads += 1
                self._pread(path, index, view, again=True)
                check(view)  # failing twice: the block is damaged where it is stored
        return n, dt

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
            raise StorageError(
                f"{path}: short read of block {index} at offset {offset}: {n} of {self.block_bytes} bytes"
            )
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
        return self._pool.submit(self.read_into, path, index, sink, num_blocks, dest, check)

    def _begin(self) -> None:
        with self._lock:
            if self._inflight == 0:
                self._busy_since = time.perf_counter()
            self._inflight += 1

    def _end(self) -> None:
        with self._lock:
            self._inflight -= 1
            if self._inflight == 0:
                self.stats.wall_seconds += time.perf_counter() - self._busy_since

    def pin(self) -> str | None:
        """Page-lock the staging buffers for the CUDA driver (cudaHostRegister), so copies from
        them to device memory run asynchronously. Returns None, or why they stay pageable."""
        import torch

        cudart = torch.cuda.cudart()
        for b in self._buffers:
            err = cudart.cudaHostRegister(buffer_address(b), len(b), 0)
            if int(err) != 0:
                cudart.cudaGetLastError()  # clear it, or the next CUDA call reports it as its own
                reason = f"cudaHostRegister failed ({err}): staging buffers stay pageable"
                self.stats.fallbacks["pageable_staging"] = reason
                return reason
            self._pinned.append(b)
        return None

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        while not self._free.empty():  # copies out of staging still in flight end before it goes
            _, fence = self._free.get_nowait()
            if fence is not None:
                fence.synchronize()
        self._finalizer()  # after the pool: no read is left in the ring
        for b in self._buffers:
            b.close()
        self._buffers.clear()


def _release(pinned: list[mmap.mmap], fds: dict, retired: list[int], uring=None) -> None:
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
