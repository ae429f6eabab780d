"""O_DIRECT block reader: right bytes with several reads in flight, alignment errors named,
bounds, buffered mode, and the recorded fallback where O_DIRECT is unsupported. The tests taking
``backend`` run for the Python reader threads (preadv) and the C pool (native) alike."""

import os
from pathlib import Path

import pytest

from edgerun.cache import native
from edgerun.cache.reader import (
    AlignmentError,
    BlockReader,
    ReadError,
    aligned_buffer,
    buffer_address,
    check_alignment,
    direct_supported,
)
from edgerun.errors import ChecksumError, StorageError

BB = 8192  # expert_file's blocks (conftest.py)
_NATIVE = native.unavailable()
BACKENDS = pytest.mark.parametrize(
    "backend",
    [
        "preadv",
        pytest.param(
            "native", marks=pytest.mark.skipif(bool(_NATIVE), reason=f"no native reader: {_NATIVE}")
        ),
    ],
)


@BACKENDS
@pytest.mark.parametrize("mode", ["direct", "buffered", "auto"])
def test_concurrent_reads_return_the_right_blocks(expert_file, mode, backend):
    path, data = expert_file
    if mode == "direct" and not direct_supported(path):
        pytest.skip(f"{path.parent}: no O_DIRECT on this filesystem")
    r = BlockReader(BB, staging=3, mode=mode, reader=backend)
    assert r.backend == backend
    got = {}
    order = [13, 2, 15, 0, 7, 7, 9, 1]
    futures = [r.submit(path, i, lambda v, i=i: got.__setitem__(i, bytes(v)), 16) for i in order]
    for f in futures:
        f.result()
    assert all(got[i] == data[i * BB : (i + 1) * BB] for i in order)
    assert r.stats.reads == len(order) and r.stats.bytes == len(order) * BB
    r.close()


def test_each_misalignment_is_named():
    with pytest.raises(AlignmentError, match=r"offset 100 is not a multiple of 4096$"):
        check_alignment(100, 4096, 8192, "f")
    with pytest.raises(AlignmentError, match=r"length 5000 is not a multiple of 4096$"):
        check_alignment(4096, 5000, 8192, "f")
    with pytest.raises(AlignmentError, match=r"buffer address 0x2001 is not 4096-byte aligned$"):
        check_alignment(4096, 4096, 0x2001, "f")
    with pytest.raises(AlignmentError, match=r"block_bytes 5000 is not a positive multiple of 4096"):
        BlockReader(5000)


def test_staging_buffers_are_page_aligned():
    buf = aligned_buffer(BB)
    assert buffer_address(buf) % 4096 == 0
    buf.close()


@BACKENDS
def test_out_of_range_block_quotes_the_request(expert_file, backend):
    path, _ = expert_file
    r = BlockReader(BB, staging=1, mode="buffered", reader=backend)
    with pytest.raises(ReadError, match=r"block 16 requested, file holds blocks 0..15"):
        r.read_into(path, 16, lambda v: None, 16)
    r.close()


@BACKENDS
def test_short_file_is_a_short_read(expert_file, tmp_path, backend):
    path, data = expert_file
    short = tmp_path / "short.bin"
    short.write_bytes(data[: BB * 3 + 100])
    r = BlockReader(BB, staging=1, mode="buffered", reader=backend)
    with pytest.raises(
        StorageError, match=r"short read of expert 3's block at offset 24576: 100 of 8192 bytes"
    ):
        r.read_into(short, 3, lambda v: None, 16)
    r.close()


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm (tmpfs) here")
def test_tmpfs_direct_refused_auto_falls_back_visibly(tmp_path):
    shm = Path("/dev/shm") / f"edgerun-test-{os.getpid()}.bin"
    shm.write_bytes(os.urandom(BB * 2))
    try:
        if direct_supported(shm):
            pytest.skip("this tmpfs accepts O_DIRECT")
        with pytest.raises(ReadError, match=r"does not support O_DIRECT \(set read_mode: buffered or auto\)"):
            BlockReader(BB, 1, "direct").read_into(shm, 0, lambda v: None, 2)
        r = BlockReader(BB, 1, "auto")
        r.read_into(shm, 1, lambda v: None, 2)
        assert "does not support O_DIRECT" in r.stats.fallbacks["direct_read"]
        r.close()
    finally:
        shm.unlink()


def test_read_depth_bounds_reads_in_flight(expert_file):
    import threading
    import time

    path, data = expert_file
    r = BlockReader(BB, staging=6, mode="buffered", depth=2)
    assert r.depth == 2
    inflight, peak, lock = [0], [0], threading.Lock()

    def sink(view, i):
        with lock:
            inflight[0] += 1
            peak[0] = max(peak[0], inflight[0])
        time.sleep(0.02)  # hold the read open so overlapping ones would be seen
        assert bytes(view) == data[i * BB : (i + 1) * BB]
        with lock:
            inflight[0] -= 1

    futs = [r.submit(path, i, lambda v, i=i: sink(v, i), 16) for i in range(8)]
    for f in futs:
        f.result()
    assert peak[0] == 2
    r.close()
    with pytest.raises(ReadError, match="read depth"):
        BlockReader(BB, staging=2, depth=0)


@BACKENDS
def test_direct_read_into_caller_memory(expert_file, backend):
    path, data = expert_file
    r = BlockReader(BB, staging=1, mode="buffered", reader=backend)
    dest = aligned_buffer(2 * BB)
    r.read_into(path, 3, None, 16, dest=memoryview(dest)[BB : 2 * BB])
    assert bytes(dest[BB : 2 * BB]) == data[3 * BB : 4 * BB]
    with pytest.raises(ReadError, match="destination holds"):
        r.read_into(path, 3, None, 16, dest=memoryview(dest)[:100])
    r.close()


@BACKENDS
@pytest.mark.parametrize("mode", ["direct", "buffered"])
@pytest.mark.parametrize("into", ["staging", "dest"])
def test_a_block_failing_its_check_is_read_again_then_refused(expert_file, tmp_path, mode, into, backend):
    """The check sees the bytes before the sink (or before a read into caller memory is done); a
    failure is read again through a fresh descriptor (a file replaced since is seen), and one
    that fails again is raised without the sink ever seeing the bytes."""
    path, data = expert_file
    if mode == "direct" and not direct_supported(path):
        pytest.skip(f"{path.parent}: no O_DIRECT on this filesystem")
    good = data[5 * BB : 6 * BB]
    path.write_bytes(data[: 5 * BB] + bytes(BB) + data[6 * BB :])  # block 5 zeroed in place
    r = BlockReader(BB, staging=1, mode=mode, reader=backend)
    dest = aligned_buffer(BB)
    sunk = []

    def read(check):
        if into == "dest":
            r.read_into(path, 5, None, 16, dest=memoryview(dest), check=check)
            sunk.append(bytes(dest))
        else:
            r.read_into(path, 5, lambda v: sunk.append(bytes(v)), 16, check=check)

    def check(view):
        if bytes(view) != good:
            raise ChecksumError("block 5 damaged")

    with pytest.raises(ChecksumError, match="block 5 damaged"):
        read(check)
    assert sunk == [] and r.stats.rereads == 1 and r.stats.reads == 0

    def repair_then_check(view):  # the file is replaced (renamed over) after the first read
        if not repaired:
            repaired.append(1)
            tmp = tmp_path / "new.bin"
            tmp.write_bytes(data)
            os.replace(tmp, path)
        check(view)

    repaired = []
    read(repair_then_check)
    assert sunk == [good] and r.stats.rereads == 2 and r.stats.reads == 1
    with pytest.raises(StorageError, match=r"cannot open expert file .*missing"):
        r.read_into(tmp_path / "missing", 0, lambda v: None, 16)
    r.close()
    dest.close()


class _Fence:
    """A copy out of a staging buffer still in flight: records when it is waited for."""

    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def synchronize(self) -> None:
        self.log.append(("wait", self.name))


@BACKENDS
def test_a_sinks_fence_is_waited_for_before_its_buffer_is_read_into_again(expert_file, backend):
    """A sink that copies out asynchronously returns a fence: the read hands its buffer back at
    once, and the buffer's next read, staged or not, waits for that fence before it overwrites
    the bytes (one staging buffer, so every read reuses it); close waits for a fence left."""
    path, data = expert_file
    log: list = []
    r = BlockReader(BB, staging=1, mode="buffered", depth=1, reader=backend)

    def sink(name):
        def consume(view):
            log.append(("read", name, bytes(view) == data[name * BB : (name + 1) * BB]))
            return _Fence(log, name)

        return consume

    r.read_into(path, 3, sink(3), 16)
    r.read_into(path, 5, sink(5), 16)
    staged = r.stage(path, 7, 16).result()
    assert bytes(staged.view) == data[7 * BB : 8 * BB]
    staged.release(_Fence(log, 7))
    r.close()
    assert log == [("read", 3, True), ("wait", 3), ("read", 5, True), ("wait", 5), ("wait", 7)]


def test_reopening_a_replaced_file_leaves_no_descriptor_behind(tmp_path):
    """An expert file replaced under a running reader is opened again after a failed check: the
    same descriptor number then reads the new file, so replacements do not pile up open (and
    disk-pinning) descriptors; a FIFO put there instead is refused, not waited on."""
    f = tmp_path / "L00.bin"
    f.write_bytes(b"a" * 8192 * 4)
    r = BlockReader(8192, staging=1, mode="buffered")
    fd, _ = r._fd(f)
    before = len(os.listdir("/proc/self/fd"))
    for i in range(4):
        new = tmp_path / "new.bin"
        new.write_bytes(bytes([98 + i]) * 8192 * 4)
        os.replace(new, f)
        assert r._fd(f, fresh=True)[0] == fd and os.pread(fd, 4, 0) == bytes([98 + i]) * 4
    assert len(os.listdir("/proc/self/fd")) == before and r._retired == []
    f.unlink()
    os.mkfifo(f)
    with pytest.raises(StorageError, match="not a regular file"):
        r._fd(f, fresh=True)
    r.close()
