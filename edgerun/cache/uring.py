"""io_uring reads for :class:`~edgerun.cache.reader.BlockReader` (``reader: io_uring``).

One ring per reader, through the PyPI ``liburing`` binding (optional: ``pip install
'edgerun[io_uring]'``). The reader's threads keep their contract (staging ownership, checks,
sinks); only the system call changes: a thread submits its read to the shared ring and sleeps
until a completion thread, woken by an eventfd the ring signals (``os.eventfd_read`` releases the
GIL; the binding's ``io_uring_wait_cqe`` does not), hands it the result.

Two habits of the binding (liburing 2026.3.30) shape the code: ``io_uring_prep_read`` takes only a
``bytearray``, so reads go through ``io_uring_prep_readv`` with an ``Iovec``; and an ``Iovec`` never
releases the buffer it was built from, so each is built once per destination address over a
small ctypes view of it (never over the caller's buffer, which could then not be released or
unmapped), and kept for the reader's life: one per staging buffer and cache slot read into.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import itertools
import os
import signal
import subprocess
import sys
import threading


class UringUnavailable(Exception):
    """io_uring cannot be used here; the message says why."""


# what the child runs: the binding's ring set up and torn down, as ``UringReads`` does
_PROBE = "import liburing as L\nr = L.Ring()\nL.io_uring_queue_init(1, r)\nL.io_uring_queue_exit(r)\n"
PROBE_TIMEOUT_S = 60.0


@functools.cache
def _child_probe() -> str | None:
    """Why setting up a ring would kill this process, found in a child process; None when the
    child survived it (an error it raised, such as io_uring_setup's, is raised again here with
    its own message). The binding is compiled code: on some hosts it dies in ``Ring()`` itself
    (liburing 2026.3.30 on a 6.18 kernel: an invalid-opcode trap, SIGILL), which in-process
    would take the daemon or the test run with it. Once per process."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return f"the liburing binding did not set up a ring in {PROBE_TIMEOUT_S:.0f} s (in a child process)"
    if done.returncode >= 0:
        return None
    sig = -done.returncode
    name = signal.Signals(sig).name if sig in signal.valid_signals() else f"signal {sig}"
    return f"the liburing binding crashed setting up a ring ({name}, in a child process)"


class _Pending:
    __slots__ = ("done", "res")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.res = 0


class UringReads:
    """``read(fd, address, length, offset)`` through one io_uring of ``depth`` entries: at most
    ``depth`` reads in flight (the reader's threads bound it; a full ring is an error, not a wait)."""

    def __init__(self, depth: int) -> None:
        try:
            import liburing
        except ImportError as exc:
            raise UringUnavailable(
                f"the liburing package is not installed ({exc}; pip install 'edgerun[io_uring]')"
            ) from exc
        why = _child_probe()
        if why:
            raise UringUnavailable(why)
        self._L = L = liburing
        self._ring = L.Ring()
        try:
            L.io_uring_queue_init(max(depth, 1), self._ring)
        except OSError as exc:
            raise UringUnavailable(
                f"io_uring_setup refused: {exc} (kernel.io_uring_disabled, a seccomp filter such as "
                "a container's, or a kernel before 5.1)"
            ) from exc
        self._efd = os.eventfd(0, os.EFD_CLOEXEC)
        L.io_uring_register_eventfd(self._ring, self._efd)
        self._lock = threading.Lock()
        self._tags = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._iovecs: dict[tuple[int, int], object] = {}  # (address, length) -> Iovec, see above
        self._closing = False
        self._broken = ""  # why the completion thread stopped, if it failed
        self._reaper = threading.Thread(target=self._reap, name="edgerun-uring", daemon=True)
        self._reaper.start()

    def read(self, fd: int, address: int, length: int, offset: int) -> int:
        """Bytes read into ``address`` from ``offset`` of ``fd`` (0 at end of file); an I/O error
        is an ``OSError`` with the kernel's errno."""
        L = self._L
        p = _Pending()
        with self._lock:
            if self._broken:
                raise OSError(errno.EIO, self._broken)
            iov = self._iovecs.get((address, length))
            if iov is None:
                view = memoryview((ctypes.c_char * length).from_address(address))
                iov = self._iovecs[(address, length)] = L.Iovec([view])
            sqe = L.io_uring_get_sqe(self._ring)
            if sqe is None:
                raise OSError(f"io_uring submission queue full ({len(self._pending)} reads in flight)")
            tag = next(self._tags)
            L.io_uring_prep_readv(sqe, fd, iov, offset)
            sqe.user_data = tag
            self._pending[tag] = p
            try:
                L.io_uring_submit(self._ring)
            except OSError:
                del self._pending[tag]
                raise
        p.done.wait()
        if p.res < 0:
            raise OSError(-p.res, self._broken or os.strerror(-p.res))
        return p.res

    def _reap(self) -> None:
        try:
            self._reap_until_closed()
        except BaseException as exc:  # no read may wait forever on a dead completion thread
            with self._lock:
                self._broken = f"io_uring completion thread failed: {type(exc).__name__}: {exc}"
                pending, self._pending = self._pending, {}
            for p in pending.values():
                p.res = -errno.EIO
                p.done.set()

    def _reap_until_closed(self) -> None:
        L = self._L
        cqe = L.Cqe()
        while not self._closing:
            os.eventfd_read(self._efd)  # sleeps (GIL released) until the ring posts completions
            it = L.io_uring_cqe_iter_init(self._ring)
            seen = 0
            while L.io_uring_cqe_iter_next(it, cqe):
                c = cqe[0]
                tag = c.user_data
                try:
                    res = c.res
                except OSError as exc:  # the binding raises a negative result as its errno
                    res = -(exc.errno or 5)
                seen += 1
                with self._lock:
                    p = self._pending.pop(tag)
                p.res = res
                p.done.set()
            L.io_uring_cq_advance(self._ring, seen)

    def close(self) -> None:
        """After every read has returned (the reader's pool is shut down first)."""
        if self._closing:
            return
        self._closing = True
        os.eventfd_write(self._efd, 1)
        self._reaper.join()
        self._L.io_uring_queue_exit(self._ring)
        os.close(self._efd)
        self._iovecs.clear()


def unavailable() -> str | None:
    """Why io_uring reads cannot run here, or None: a ring is set up and torn down."""
    try:
        UringReads(1).close()
    except UringUnavailable as exc:
        return str(exc)
    return None
