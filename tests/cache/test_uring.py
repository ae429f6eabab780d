"""io_uring reads (reader: io_uring): the same bytes as preadv on a bundle's expert files, the same
errors (file and offset named), short reads continued, and io_uring that cannot run refused by name."""

import os
import sys
from pathlib import Path

import pytest

from edgerun.bundle.reader import Bundle
from edgerun.cache.reader import BlockReader, ReadError, aligned_buffer, direct_supported
from edgerun.cache.uring import unavailable
from edgerun.errors import StorageError
from edgerun.tools.synth_bundle import synth_bundle, tiny_config

WHY = unavailable()
needs_uring = pytest.mark.skipif(WHY is not None, reason=f"io_uring reads cannot run here: {WHY}")
BB = 8192  # expert_file's blocks (conftest.py)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return Bundle.open(synth_bundle(tmp_path_factory.mktemp("uring") / "b", tiny_config(), threads=1))


def _read_all(bundle, reader: str, mode: str, into: str) -> dict:
    """Every block of every expert file, read concurrently (depth 4) by one backend."""
    out = {}
    bbs = {lay.block_bytes for lay in bundle.layouts.values()}
    readers = {bb: BlockReader(bb, staging=4, mode=mode, reader=reader) for bb in bbs}
    dests = []
    try:
        futures = []
        for layer, lay in bundle.layouts.items():
            r, n = readers[lay.block_bytes], bundle.args.num_experts
            path = bundle.expert_path(layer)
            for e in reversed(range(n)):  # not in file order
                if into == "dest":
                    buf = aligned_buffer(lay.block_bytes)
                    dests.append(buf)
                    fut = r.submit(path, e, None, n, dest=memoryview(buf)[: lay.block_bytes])
                    futures.append((layer, e, fut, buf))
                else:
                    sink = lambda v, k=(layer, e): out.__setitem__(k, bytes(v))  # noqa: E731
                    futures.append((layer, e, r.submit(path, e, sink, n), None))
        for layer, e, fut, buf in futures:
            fut.result()
            if buf is not None:
                out[layer, e] = bytes(buf[: bundle.layouts[layer].block_bytes])
        assert {r.backend for r in readers.values()} == {reader}
        assert sum(r.stats.reads for r in readers.values()) == len(out)
    finally:
        for r in readers.values():
            r.close()
        for b in dests:
            b.close()
    return out


@needs_uring
@pytest.mark.parametrize("into", ["staging", "dest"])
@pytest.mark.parametrize("mode", ["direct", "buffered"])
def test_io_uring_reads_equal_preadv_reads_on_a_bundle(bundle, mode, into):
    if mode == "direct" and not direct_supported(bundle.expert_path(next(iter(bundle.layouts)))):
        pytest.skip("no O_DIRECT on the temporary directory's filesystem")
    want = _read_all(bundle, "preadv", mode, into)
    got = _read_all(bundle, "io_uring", mode, into)
    assert len(want) == bundle.args.num_experts * len(bundle.layouts)
    assert got == want
    layer = next(iter(bundle.layouts))
    bb = bundle.layouts[layer].block_bytes
    with open(bundle.expert_path(layer), "rb") as f:
        assert want[layer, 3] == f.read(bb * 4)[-bb:]


@needs_uring
@pytest.mark.parametrize("reader", ["preadv", "io_uring"])
def test_truncated_file_is_a_short_read_naming_file_and_offset(expert_file, tmp_path, reader):
    path, data = expert_file
    short = tmp_path / "short.bin"
    short.write_bytes(data[: BB * 3 + 4096 + 100])  # aligned part, then an unaligned tail
    for mode in ("direct", "buffered") if direct_supported(short) else ("buffered",):
        r = BlockReader(BB, staging=1, mode=mode, reader=reader)
        with pytest.raises(
            StorageError, match=rf"{short}: short read of expert 3's block at offset 24576: 4196 of 8192"
        ):
            r.read_into(short, 3, lambda v: None, 16)
        with pytest.raises(
            StorageError, match=rf"{short}: short read of expert 5's block at offset 40960: 0 of 8192"
        ):
            r.read_into(short, 5, lambda v: None, 16)  # wholly past the end
        r.close()


@needs_uring
def test_a_short_read_is_continued(expert_file):
    """A read that returns part of a block (as io_uring may) is continued, not refused."""
    path, data = expert_file
    fd = os.open(path, os.O_RDONLY)
    buf = aligned_buffer(BB)
    calls = []
    r = BlockReader(BB, staging=1, mode="buffered", reader="io_uring")
    real = r._uring.read

    def halves(fd, address, length, offset):
        calls.append((length, offset))
        return real(fd, address, min(length, 4096), offset)

    r._uring.read = halves
    view = memoryview(buf)[:BB]
    assert r._read_all(fd, view, 2 * BB, direct=True) == BB
    assert bytes(view) == data[2 * BB : 3 * BB] and calls == [(BB, 2 * BB), (4096, 2 * BB + 4096)]
    view.release()
    r.close()
    os.close(fd)
    buf.close()


@needs_uring
@pytest.mark.parametrize("reader", ["preadv", "io_uring"])
def test_an_io_error_names_the_file_block_and_offset(tmp_path, reader):
    """The kernel's error from the read itself, not from opening the file: /proc/self/mem is a
    regular file whose bytes at an unmapped address (16 KiB) fail with EIO. (A directory or a
    FIFO is refused at the open: only a regular file is read.)"""
    r = BlockReader(BB, staging=1, mode="buffered", reader=reader)
    mem = Path("/proc/self/mem")
    with pytest.raises(
        StorageError, match=r"/proc/self/mem: reading block 2 at offset 16384: .*Input/output error"
    ):
        r.read_into(mem, 2, lambda v: None, 4)
    with pytest.raises(StorageError, match=rf"cannot open expert file {tmp_path}: not a regular file"):
        r.read_into(tmp_path, 2, lambda v: None, 4)
    fifo = tmp_path / "f"
    os.mkfifo(fifo)
    with pytest.raises(StorageError, match=r"f: not a regular file"):  # not a wait for a writer
        r.read_into(fifo, 2, lambda v: None, 4)
    r.close()


@needs_uring
def test_a_misaligned_io_uring_read_is_the_kernels_einval(expert_file):
    """Below the reader's own alignment check: the ring reports O_DIRECT's EINVAL as an OSError."""
    import errno

    from edgerun.cache.uring import UringReads

    path, _ = expert_file
    if not direct_supported(path):
        pytest.skip("no O_DIRECT on the temporary directory's filesystem")
    ring = UringReads(1)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buf = aligned_buffer(BB)
    from edgerun.cache.reader import buffer_address

    with pytest.raises(OSError) as exc:
        ring.read(fd, buffer_address(buf), BB, 100)
    assert exc.value.errno == errno.EINVAL
    assert ring.read(fd, buffer_address(buf), BB, BB) == BB  # the ring still serves reads
    ring.close()
    os.close(fd)
    buf.close()


def test_io_uring_that_cannot_run_is_refused(expert_file, monkeypatch):
    monkeypatch.setitem(sys.modules, "liburing", None)  # as if the optional package were missing
    with pytest.raises(
        ReadError, match=r"reader io_uring: the liburing package is not installed.*reader: preadv or auto"
    ):
        BlockReader(BB, staging=1, reader="io_uring")
    with pytest.raises(ReadError, match="reader 'uring' is not one of preadv, io_uring, native, auto"):
        BlockReader(BB, reader="uring")


@needs_uring
def test_a_binding_that_crashes_is_refused_by_name_and_this_process_lives(expert_file, monkeypatch):
    """The ring is first set up in a child process: a binding that dies there (SIGILL, as
    liburing 2026.3.30 does on some kernels) is refused by name, and the reader says so, instead
    of taking this process (a daemon, the test run) down with it."""
    import types

    from edgerun.cache import uring

    monkeypatch.setitem(sys.modules, "liburing", types.ModuleType("liburing"))  # importable
    monkeypatch.setattr(uring, "_PROBE", "import os, signal\nos.kill(os.getpid(), signal.SIGILL)\n")
    uring._child_probe.cache_clear()
    try:
        with pytest.raises(uring.UringUnavailable, match=r"crashed setting up a ring \(SIGILL"):
            uring.UringReads(1)
        with pytest.raises(ReadError, match=r"reader io_uring: .*crashed.*SIGILL"):
            BlockReader(BB, staging=2, mode="buffered", reader="io_uring")
    finally:
        uring._child_probe.cache_clear()


@needs_uring
def test_a_failed_completion_thread_fails_reads_instead_of_leaving_them_waiting(expert_file):
    import errno

    from edgerun.cache.reader import buffer_address
    from edgerun.cache.uring import UringReads

    path, _ = expert_file
    ring = UringReads(2)
    L = ring._L
    with ring._lock:  # a completion nobody submitted: the completion thread cannot place it
        sqe = L.io_uring_get_sqe(ring._ring)
        L.io_uring_prep_nop(sqe)
        sqe.user_data = 10**9
        L.io_uring_submit(ring._ring)
    ring._reaper.join(10)
    assert not ring._reaper.is_alive()
    fd, buf = os.open(path, os.O_RDONLY), aligned_buffer(BB)
    with pytest.raises(OSError, match="io_uring completion thread failed: KeyError") as exc:
        ring.read(fd, buffer_address(buf), BB, 0)
    assert exc.value.errno == errno.EIO
    ring.close()
    os.close(fd)
    buf.close()
