"""The native reader (reader: native, edgerun/cache/native_reads.c): reads that finish while
Python holds the GIL, blocks checked in C against their xxh3 (a failure read again and refused by
name, its buffer given back), staged reads placed or dropped without losing a buffer, the target
kinds, and auto's counted fallback to preadv where it cannot be built."""

import ctypes
import os
import time

import pytest
import torch

from edgerun.bundle.format import block_checksum
from edgerun.cache import native
from edgerun.cache.reader import BlockReader, ReadError, Target, aligned_buffer
from edgerun.errors import ChecksumError

BB = 8192  # expert_file's blocks (conftest.py)

if native.unavailable():
    pytest.skip(f"the native reader cannot run here: {native.unavailable()}", allow_module_level=True)


def sums(data: bytes) -> list[int]:
    return [int(block_checksum(data[i * BB : (i + 1) * BB]), 16) for i in range(len(data) // BB)]


def checker(data: bytes, i: int):
    def check(view):
        if bytes(view) != data[i * BB : (i + 1) * BB]:
            raise ChecksumError(f"block {i} damaged")

    return check


def test_reads_complete_while_python_holds_the_gil(expert_file):
    """Eight reads one after another (depth 1) all end while the main thread holds the GIL for
    half a second in a C call that keeps it (ctypes.PyDLL): nothing of a native read waits for
    the interpreter. (Python reader threads could not run a line in that time.)"""
    path, data = expert_file
    r = BlockReader(BB, staging=2, mode="buffered", depth=1, reader="native")
    rows = torch.zeros(8, BB, dtype=torch.uint8)
    want = sums(data)
    futures = [r.fetch(path, i, 16, Target("host", rows[i]), checker(data, i), want[i]) for i in range(8)]
    ctypes.PyDLL(None).usleep(500_000)  # the GIL held throughout
    reads = r._native.stats()[0]  # the C pool's count, read before any future is waited for
    assert reads == 8
    assert [f.result() for f in futures] == [BB] * 8
    assert all(bytes(rows[i].numpy()) == data[i * BB : (i + 1) * BB] for i in range(8))
    r.close()


@pytest.mark.parametrize("kind", ["host", "direct"])
def test_a_block_failing_its_checksum_in_c_is_read_again_then_refused(expert_file, kind):
    """C compares each block with the checksum it was given; a mismatch is read again in Python
    through a fresh descriptor and checked there, as the other readers do: a block that passes
    then is delivered (one re-read), one that fails again is refused by name and its staging
    buffer goes back (one buffer: a lost one would stall the next read)."""
    path, data = expert_file
    r = BlockReader(BB, staging=1, mode="buffered", depth=1, reader="native")
    want = sums(data)
    mem = aligned_buffer(BB)
    row = torch.frombuffer(mem, dtype=torch.uint8, count=BB)
    to = Target(kind, row)
    # wrong checksum given to C, the block itself good: the re-read's check passes
    assert r.fetch(path, 3, 16, to, checker(data, 3), want[4]).result() == BB
    assert bytes(mem) == data[3 * BB : 4 * BB]
    assert r.stats.rereads == 1 and r.stats.reads == 1
    with pytest.raises(ChecksumError, match="block 5 damaged"):
        r.fetch(path, 6, 16, to, checker(data, 5), want[5]).result()  # damaged both times
    assert r.stats.rereads == 2 and r.stats.reads == 1
    assert r.fetch(path, 9, 16, to, checker(data, 9), want[9]).result() == BB  # the buffer came back
    assert bytes(mem) == data[9 * BB : 10 * BB] and r.stats.reads == 2
    r.close()
    del row
    mem.close()


def test_staged_reads_placed_or_dropped_give_every_buffer_back(expert_file):
    path, data = expert_file
    r = BlockReader(BB, staging=3, mode="buffered", depth=2, reader="native")
    want = sums(data)
    rows = torch.zeros(2, BB, dtype=torch.uint8)
    for round_ in range(5):
        staged = [
            r.stage(path, (round_ + i) % 16, 16, checker(data, (round_ + i) % 16), want[(round_ + i) % 16])
            for i in range(3)
        ]
        assert r.staged == 3
        first = staged[0].result()
        assert bytes(first.view) == data[(round_ % 16) * BB : (round_ % 16 + 1) * BB]
        first.place(Target("host", rows[0]))
        assert bytes(rows[0].numpy()) == data[(round_ % 16) * BB : (round_ % 16 + 1) * BB]
        staged[1].result().release()
        r.drop(staged[2])  # queued, in flight or done: either way its buffer comes back
        assert r.staged == 0
    futures = [r.fetch(path, i, 16, Target("host", rows[i % 2])) for i in range(6)]
    assert [f.result() for f in futures] == [BB] * 6  # every buffer free again
    deadline = time.monotonic() + 5
    while r._native.stats()[3] and time.monotonic() < deadline:  # the dropped reads end
        time.sleep(0.01)
    assert r.stats.reads >= 6 + 5 * 2
    r.close()


def test_a_device_copy_needs_pin(expert_file):
    path, _ = expert_file
    r = BlockReader(BB, staging=1, mode="buffered", reader="native")
    with pytest.raises(ReadError, match="copies to the device need pin"):
        r.fetch(path, 0, 16, Target("device", torch.zeros(BB, dtype=torch.uint8), None))
    r.close()


def test_auto_where_it_cannot_build_is_preadv_and_a_counted_fallback(expert_file, monkeypatch):
    path, data = expert_file
    monkeypatch.setattr(native, "unavailable", lambda: "no C compiler found (sysconfig CC, cc, gcc)")
    with pytest.raises(
        ReadError, match=r"reader native: no C compiler found .*\(set reader: preadv or auto\)"
    ):
        BlockReader(BB, staging=1, reader="native")
    r = BlockReader(BB, staging=2, mode="buffered", reader="auto")
    assert r.backend == "preadv" and "no C compiler found" in r.stats.fallbacks["native_reader"]
    got = []
    for i in (4, 9):
        r.read_into(path, i, lambda v: got.append(bytes(v)), 16)
    assert got == [data[4 * BB : 5 * BB], data[9 * BB : 10 * BB]]
    assert r.stats.fallback_reads["native_reader"] == 2  # every read it served
    r.close()


def test_auto_is_the_native_reader_where_it_builds():
    r = BlockReader(BB, staging=1, reader="auto")
    assert r.backend == "native" and "native_reader" not in r.stats.fallbacks
    r.close()


def test_a_read_nobody_waits_for_is_freed_and_a_closed_reader_refuses_by_name(expert_file):
    """A read dropped on the floor (its future garbage) gives its record and buffer back when it
    ends: a reader with one staging buffer still serves the next read. After close, a read is
    refused with an error, never a call into the freed pool; the counters stay readable."""
    import gc

    path, data = expert_file
    r = BlockReader(BB, staging=1, mode="buffered", depth=1, reader="native")
    rows = torch.zeros(2, BB, dtype=torch.uint8)
    for i in range(3):
        r.stage(path, i, 16)  # staged and forgotten: holds the only buffer until it is freed
        r._unstage()  # (the count the cache would have released on drop)
        gc.collect()
    assert r.fetch(path, 7, 16, Target("host", rows[0])).result() == BB
    assert bytes(rows[0].numpy()) == data[7 * BB : 8 * BB]
    reads = r.stats.reads
    r.close()
    assert r.stats.reads == reads >= 1
    with pytest.raises(RuntimeError, match="the pool is closed"):
        r.fetch(path, 1, 16, Target("host", rows[1]))


def test_two_threads_first_reads_start_one_pool(expert_file, monkeypatch):
    """Two threads whose first reads race start one C pool between them: with a pool each, one
    thread's ticket was waited for in the other's pool ("ticket 0 is not outstanding"). The
    pool's start is slowed so both threads are inside it together."""
    import threading

    path, data = expert_file
    started = []
    real = native.NativePool

    def slow(*a, **kw):
        time.sleep(0.2)
        started.append(real(*a, **kw))
        return started[-1]

    monkeypatch.setattr(native, "NativePool", slow)
    r = BlockReader(BB, staging=2, mode="buffered", depth=2, reader="native")
    rows = torch.zeros(2, BB, dtype=torch.uint8)
    got = [None, None]

    def read(i):
        got[i] = r.fetch(path, 5 + i, 16, Target("host", rows[i])).result()

    threads = [threading.Thread(target=read, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [BB, BB] and len(started) == 1
    assert [bytes(rows[i].numpy()) for i in range(2)] == [data[(5 + i) * BB : (6 + i) * BB] for i in range(2)]
    r.close()


def test_a_read_a_lookup_waits_for_goes_before_queued_prefetches(expert_file):
    """One thread, one staging buffer: a prefetch (staged) queued before a lookup's own read does
    not take the buffer first. In ticket order it would, and hold it (a staged read keeps its
    buffer until claimed), and the lookup's read would wait for a claim that comes after it."""
    path, data = expert_file
    want = sums(data)
    r = BlockReader(BB, staging=1, mode="buffered", depth=1, reader="native")
    held = r.stage(path, 0, 16, None, want[0]).result()  # holds the only buffer
    busy = r.stage(path, 1, 16, None, want[1])  # the thread takes it and waits for the buffer
    time.sleep(0.05)  # (taken or not, ticket order would read the guess below before the lookup's read)
    guess = r.stage(path, 2, 16, None, want[2])
    row = torch.zeros(BB, dtype=torch.uint8)
    needed = r.fetch(path, 3, 16, Target("host", row), None, want[3])
    held.release()
    busy.result().release()  # the buffer comes back once more: to the lookup's read
    deadline = time.monotonic() + 5
    while not needed.done() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert needed.done(), "the lookup's read waited behind a prefetch queued before it"
    assert needed.result() == BB and bytes(row.numpy()) == data[3 * BB : 4 * BB]
    assert bytes(guess.result().view) == data[2 * BB : 3 * BB]  # then the prefetch runs
    guess.result().release()
    r.close()


def test_spare_threads_check_blocks_but_never_add_requests_at_the_disk(tmp_path):
    """The pool's threads beyond depth x pieces (one spare a read in flight) check and copy a
    finished block while the next read starts; they never put more requests at the disk: 24
    checked reads queued at once (depth 2, 2 pieces: 4 requests at most) all land with their own
    bytes, counted once each, and the pool's peak of requests in flight stays 4 (with its 2 spare
    threads free to read, a broken gate shows 6 where reads wait for a disk: O_DIRECT, which
    ``auto`` takes where the filesystem has it), its mean while busy at most 4."""
    bb, n = 1 << 20, 24  # blocks big enough that reads overlap
    data = os.urandom(bb * n)
    path = tmp_path / "L00.bin"
    path.write_bytes(data)
    want = [int(block_checksum(data[i * bb : (i + 1) * bb]), 16) for i in range(n)]
    r = BlockReader(bb, staging=n, mode="auto", depth=2, reader="native", pieces=2)
    rows = torch.zeros(n, bb, dtype=torch.uint8)
    futures = [r.fetch(path, i, n, Target("host", rows[i]), None, want[i]) for i in range(n)]
    assert [f.result() for f in futures] == [bb] * n
    assert all(bytes(rows[i].numpy()) == data[i * bb : (i + 1) * bb] for i in range(n))
    assert r._native.stats()[0] == n
    assert 1 <= r._native.peak() <= 4
    st = r.stats
    assert 0 < st.depth_seconds <= 4 * st.wall_seconds * (1 + 1e-9)
    r.close()
