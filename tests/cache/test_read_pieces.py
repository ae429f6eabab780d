"""A block read as several pieces at once (``read_pieces``, the native reader): every byte lands
where a whole-block read puts it, for every target kind and for blocks that do not divide evenly
into pieces of whole pages; a block counts as one read; a damaged piece fails the block's check
(read again, then refused by name); a short file is a short read with the bytes it had; the
other readers read whole blocks and say so."""

import os
from pathlib import Path

import pytest
import torch

from edgerun.bundle.format import block_checksum
from edgerun.cache import native
from edgerun.cache.reader import (
    BlockReader,
    ReadError,
    Target,
    aligned_buffer,
    buffer_address,
    direct_supported,
)
from edgerun.errors import ChecksumError, StorageError

BB = 5 * 4096  # five pages: 2, 3, 4 and 8 pieces all leave a shorter last piece, or fewer pieces
N = 12

if native.unavailable():
    pytest.skip(f"the native reader cannot run here: {native.unavailable()}", allow_module_level=True)


@pytest.fixture()
def blocks(tmp_path):
    data = os.urandom(BB * N)
    p = tmp_path / "L00.bin"
    p.write_bytes(data)
    return p, data


def block(data: bytes, i: int) -> bytes:
    return data[i * BB : (i + 1) * BB]


def want(data: bytes, i: int) -> int:
    return int(block_checksum(block(data, i)), 16)


def checker(data: bytes, i: int):
    def check(view):
        if bytes(view) != block(data, i):
            raise ChecksumError(f"block {i} damaged")

    return check


@pytest.mark.parametrize(("pieces", "parts"), [(1, 1), (2, 2), (3, 3), (4, 3), (8, 5), (64, 5)])
def test_a_pool_splits_a_block_into_whole_pages(pieces, parts):
    """Parts are whole pages, the last may be shorter: five pages in 4 pieces are 2 + 2 + 1 (3
    parts), in 8 or more one page each (5 parts)."""
    buf = aligned_buffer(BB)
    pool = native.NativePool(pieces, BB, [buffer_address(buf)], cuda=False, pieces=pieces)
    assert pool.pieces == parts
    pool.close()
    buf.close()


@pytest.mark.parametrize("pieces", [2, 3, 8])
@pytest.mark.parametrize("kind", ["host", "direct", "stage"])
def test_every_byte_lands_where_a_whole_block_read_puts_it(blocks, pieces, kind):
    """Twelve blocks, two in flight, each in ``pieces`` parts, checked in C against their xxh3:
    the bytes equal the file's, and the reader counts twelve reads (a block, not its parts)."""
    path, data = blocks
    r = BlockReader(BB, staging=3, mode="buffered", depth=2, reader="native", pieces=pieces)
    assert r.pieces == native.parts(BB, pieces) and "read_pieces" not in r.stats.fallbacks
    if kind == "stage":
        got = []
        for i in range(N):
            s = r.stage(path, i, N, checker(data, i), want(data, i)).result()
            got.append(bytes(s.view))
            s.release()
        assert got == [block(data, i) for i in range(N)]
    else:
        mems = [aligned_buffer(BB) for _ in range(N)]
        rows = [torch.frombuffer(m, dtype=torch.uint8, count=BB) for m in mems]
        futures = [
            r.fetch(path, i, N, Target(kind, rows[i]), checker(data, i), want(data, i)) for i in range(N)
        ]
        assert [f.result() for f in futures] == [BB] * N
        assert [bytes(m) for m in mems] == [block(data, i) for i in range(N)]
        del rows
        for m in mems:
            m.close()
    assert r.stats.reads == N and r.stats.bytes == N * BB and r.stats.rereads == 0
    r.close()


def test_direct_io_in_pieces(blocks):
    path, data = blocks
    if not direct_supported(path):
        pytest.skip(f"{path.parent}'s filesystem refuses O_DIRECT")
    r = BlockReader(BB, staging=2, mode="direct", depth=2, reader="native", pieces=4)
    rows = torch.zeros(N, BB, dtype=torch.uint8)
    futures = [
        r.fetch(path, i, N, Target("host", rows[i]), checker(data, i), want(data, i)) for i in range(N)
    ]
    assert [f.result() for f in futures] == [BB] * N
    assert all(bytes(rows[i].numpy()) == block(data, i) for i in range(N))
    assert "direct_read" not in r.stats.fallbacks
    r.close()


def test_a_damaged_piece_fails_the_block_and_is_refused_by_name(blocks, tmp_path):
    """One byte changed in the block's fourth page (its third part of 3 at pieces 4): C's check of
    the whole block fails, the block is read again whole and refused; the buffer comes back."""
    path, data = blocks
    bad = bytearray(data)
    bad[5 * BB + 3 * 4096 + 17] ^= 0xFF
    damaged = tmp_path / "L01.bin"
    damaged.write_bytes(bytes(bad))
    r = BlockReader(BB, staging=1, mode="buffered", depth=1, reader="native", pieces=4)
    row = torch.zeros(BB, dtype=torch.uint8)
    with pytest.raises(ChecksumError, match="block 5 damaged"):
        r.fetch(damaged, 5, N, Target("host", row), checker(data, 5), want(data, 5)).result()
    assert r.stats.rereads == 1
    assert r.fetch(damaged, 6, N, Target("host", row), checker(data, 6), want(data, 6)).result() == BB
    assert bytes(row.numpy()) == block(data, 6)
    r.close()


def test_a_short_file_is_a_short_read_of_the_bytes_it_had(blocks, tmp_path):
    """The file ends 100 bytes into block 3's second page: the first part reads a page and ends
    short, the parts after it read nothing; the error names the block and the 4,196 bytes."""
    path, data = blocks
    short = tmp_path / "short.bin"
    short.write_bytes(data[: BB * 3 + 4096 + 100])
    r = BlockReader(BB, staging=1, mode="buffered", depth=1, reader="native", pieces=3)
    with pytest.raises(
        StorageError, match=rf"short read of expert 3's block at offset {3 * BB}: 4196 of {BB}"
    ):
        r.fetch(short, 3, N, Target("host", torch.zeros(BB, dtype=torch.uint8))).result()
    r.close()


def test_the_other_readers_read_whole_blocks_and_say_so(blocks):
    path, data = blocks
    r = BlockReader(BB, staging=1, mode="buffered", reader="preadv", pieces=4)
    assert r.pieces == 1
    assert (
        r.stats.fallbacks["read_pieces"] == "read_pieces 4 needs the native reader; preadv reads whole blocks"
    )
    got = []
    r.read_into(path, 2, lambda v: got.append(bytes(v)), N)
    assert got == [block(data, 2)] and r.stats.fallback_reads["read_pieces"] == 1
    r.close()
    with pytest.raises(
        ReadError, match=r"read pieces \(parts a block is read in at once\) must be 1..64, got 0"
    ):
        BlockReader(BB, pieces=0)


def test_cuda_reads_a_virtio_disk_two_blocks_in_two_pieces_unless_told():
    """The defaults a cache reads with (cache.expert_cache.read_shape): CUDA from a virtio disk 2 in
    flight in 2 parts (what the GPU machines' virtio disks read fastest); an NVMe drive, a disk
    sysfs does not name, or the CPU: one per staging buffer (None), whole blocks; what the config
    sets wins everywhere."""
    from edgerun.cache.expert_cache import read_shape
    from edgerun.config import CacheConfig

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert read_shape(CacheConfig(quotas=4), cuda, "virtio") == (2, 2)
    for device, disk in ((cuda, "nvme"), (cuda, "other"), (cuda, None), (cpu, "virtio")):
        assert read_shape(CacheConfig(quotas=4), device, disk) == (None, 1)
    told = CacheConfig(quotas=4, read_depth=6, read_pieces=1)
    assert read_shape(told, cuda, "virtio") == read_shape(told, cpu, None) == (6, 1)
    assert read_shape(CacheConfig(quotas=4, read_depth=3), cuda, "virtio") == (3, 2)
    # preadv and io_uring read whole blocks: no default pieces to fall back from
    assert read_shape(CacheConfig(quotas=4, reader="preadv"), cuda, "virtio") == (2, 1)


def test_the_disk_under_a_file_is_named_from_sysfs(tmp_path):
    """disk_of: the block device under a file and its kind, a partition answered for by its disk;
    None for a path sysfs knows nothing of."""
    from edgerun.cache.reader import disk_of

    p = tmp_path / "x.bin"
    p.write_bytes(b"x")
    assert disk_of(tmp_path / "missing") is None
    got = disk_of(p)
    if got is None:
        pytest.skip(f"sysfs does not name the block device under {tmp_path}")
    name, kind = got
    assert kind in ("virtio", "nvme", "other") and Path(f"/sys/block/{name}").exists()
    assert kind != "virtio" or name.startswith("vd") or "virtio" in os.path.realpath(f"/sys/block/{name}")
