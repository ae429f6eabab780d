"""Calibration (edgerun.tools.calibrate): raw block reads per queue depth at block-aligned
offsets, bad inputs refused by name, O_DIRECT refused (not replaced) where unsupported, and the
device copy measurement skipping cleanly without CUDA."""

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from edgerun.cache.reader import AlignmentError, ReadError
from edgerun.tools import calibrate as C

BLOCK = 16384


@pytest.fixture()
def blocks_file(tmp_path):
    p = tmp_path / "L00.bin"
    p.write_bytes(os.urandom(BLOCK * 8 + BLOCK // 2))  # 8 whole blocks and a partial one
    return p


def _read(path, **kw):
    """Direct reads where the filesystem has O_DIRECT; else the refusal, then buffered reads."""
    try:
        return C.read_bandwidth(path, BLOCK, **kw)
    except ReadError as exc:
        assert "does not support O_DIRECT" in str(exc) and "direct=False" in str(exc)
        results = C.read_bandwidth(path, BLOCK, direct=False, **kw)
        assert all(not r["direct"] for r in results)
        return results


def test_results_per_depth_at_block_aligned_offsets(blocks_file, monkeypatch):
    offsets = []
    preadv = os.preadv

    def recording(fd, buffers, offset):
        offsets.append(offset)
        return preadv(fd, buffers, offset)

    monkeypatch.setattr(C.os, "preadv", recording)
    results = _read(blocks_file, queue_depths=(1, 3), seconds_per_depth=0.1)
    assert [r["queue_depth"] for r in results] == [1, 3]
    for r in results:
        assert r["reads"] > 0 and r["bytes"] == r["reads"] * BLOCK and r["block_bytes"] == BLOCK
        assert 0.1 <= r["seconds"] < 5 and r["gb_per_s"] == pytest.approx(r["bytes"] / r["seconds"] / 1e9)
        assert r["median_read_ms"] > 0
    assert sum(r["reads"] for r in results) == len(offsets)
    assert {o % BLOCK for o in offsets} == {0} and max(offsets) <= 7 * BLOCK  # never the partial block
    assert len(set(offsets)) > 1  # random, not one block over and over
    assert C.best(results) == max(results, key=lambda r: r["gb_per_s"])


def test_several_files_and_buffered_reads(blocks_file, tmp_path):
    other = tmp_path / "L01.bin"
    other.write_bytes(os.urandom(BLOCK * 2))
    (r,) = C.read_bandwidth([blocks_file, other], BLOCK, (2,), 0.05, direct=False)
    assert r["reads"] > 0 and not r["direct"]


def test_no_o_direct_is_refused_not_replaced(blocks_file, monkeypatch):
    real_open = os.open

    def without_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(C.os, "open", without_direct)
    with pytest.raises(ReadError, match=r"L00.bin: the filesystem does not support O_DIRECT .* direct=False"):
        C.read_bandwidth(blocks_file, BLOCK, (1,), 0.05)
    (r,) = C.read_bandwidth(blocks_file, BLOCK, (1,), 0.05, direct=False)
    assert r["reads"] > 0 and not r["direct"]


def test_tmpfs_reads_directly_or_refuses_clearly():
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm (tmpfs) on this machine")
    path = shm / f"edgerun-calibrate-{os.getpid()}.bin"
    path.write_bytes(os.urandom(BLOCK * 2))
    try:
        results = _read(path, queue_depths=(1,), seconds_per_depth=0.05)  # tmpfs has O_DIRECT on Linux >= 6.6
        assert results[0]["reads"] > 0
    finally:
        path.unlink()


@pytest.mark.parametrize("block_bytes", [1000, 4096 + 512, 0, -4096])
def test_unaligned_block_size_is_refused(blocks_file, block_bytes):
    with pytest.raises(AlignmentError, match=f"block_bytes {block_bytes} is not a positive multiple of 4096"):
        C.read_bandwidth(blocks_file, block_bytes, (1,), 0.05)


def test_file_smaller_than_a_block_is_refused(tmp_path):
    small = tmp_path / "small.bin"
    small.write_bytes(b"\0" * 4096)
    with pytest.raises(ReadError, match=r"small.bin: 4096 bytes, smaller than one block of 16384 bytes"):
        C.read_bandwidth(small, BLOCK, (1,), 0.05)
    with pytest.raises(ReadError, match="cannot read .*missing.bin"):
        C.read_bandwidth(tmp_path / "missing.bin", BLOCK, (1,), 0.05)
    with pytest.raises(ValueError, match="queue depths must be >= 1"):
        C.read_bandwidth(small, BLOCK, (0,), 0.05)


def test_median_of_rounds_keeps_each_shape_its_median_round():
    def rows(*rates):
        return [{"queue_depth": d, "pieces": n, "gb_per_s": g, "reads": 10 * g} for (d, n), g in
                zip([(1, 1), (4, 1), (2, 2)], rates, strict=True)]  # fmt: skip

    merged = C.median_of_rounds([rows(1.0, 3.0, 2.0), rows(2.0, 1.0, 2.5), rows(1.5, 2.0, 1.0)])
    assert [r["gb_per_s"] for r in merged] == [1.5, 2.0, 2.0]
    assert [r["reads"] for r in merged] == [15.0, 20.0, 20.0]  # the median round's own row
    assert merged[1]["gb_per_s_rounds"] == [3.0, 1.0, 2.0] and merged[1]["gb_per_s_range"] == [1.0, 3.0]
    # the best shape by its median, not the best window (depth 4's 3.0 in round 0)
    assert C.best(merged)["queue_depth"] == 4 and C.best(merged)["gb_per_s"] == 2.0
    # two rounds: the lower of the two, never an average no round read at
    assert [r["gb_per_s"] for r in C.median_of_rounds([rows(1.0, 3.0, 2.0), rows(2.0, 1.0, 2.5)])] == [
        1.0, 1.0, 2.0,
    ]  # fmt: skip
    with pytest.raises(ValueError, match="round 1 read shapes"):
        C.median_of_rounds([rows(1.0, 3.0, 2.0), rows(1.0, 3.0, 2.0)[:2]])
    with pytest.raises(ValueError, match="no calibration rounds"):
        C.median_of_rounds([])


def test_importing_calibrate_does_not_import_torch():
    code = "import sys, edgerun.tools.calibrate; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_device_copy_bandwidth():
    try:
        r = C.device_copy_bandwidth("cuda", nbytes=64 << 20, repeats=3)
    except C.DeviceUnavailable as exc:
        assert "no CUDA device" in str(exc) or "torch is not installed" in str(exc)
        pytest.skip(f"{exc}")
    assert r["nbytes"] == 64 << 20 and r["repeats"] == 3
    for key in ("d2d_gb_per_s", "h2d_pinned_gb_per_s"):
        low, high = r[f"{key}_range"]
        assert 0 < low <= r[key] <= high
    with pytest.raises(C.DeviceUnavailable, match="measures a CUDA device, got 'cpu'"):
        C.device_copy_bandwidth("cpu")


def test_cpu_expert_seconds_times_the_cpu_kernels_on_a_layout():
    from edgerun.bundle.layout import expert_block_layout
    from hf_fixtures import tiny_moe_args

    layout = expert_block_layout(tiny_moe_args(64, 32, experts=8, top_k=2), "int4", 32, "none")
    r = C.cpu_expert_seconds(layout, tokens=2, experts=3, repeats=2)
    assert (r["tokens"], r["experts"], r["block_bytes"]) == (2, 3, layout.block_bytes)
    lo, hi = r["seconds_per_expert_range"]
    assert 0 < lo <= r["seconds_per_expert"] <= hi
    assert r["gb_per_s"] == pytest.approx(layout.block_bytes / r["seconds_per_expert"] / 1e9)
    rotated = expert_block_layout(tiny_moe_args(64, 32, experts=8, top_k=2), "int4", 16, "hadamard")
    with pytest.raises(C.EdgerunError, match="CPU expert time: .*unrotated"):
        C.cpu_expert_seconds(rotated)
    with pytest.raises(ValueError, match="must be positive"):
        C.cpu_expert_seconds(layout, tokens=0)


def test_pieces_read_through_the_native_pool(blocks_file, monkeypatch):
    """``pieces`` > 1 reads each block as parts at once in the engine's native pool: a result per
    depth that names its pieces (a 4-page block in 2 or 4 parts; 8 asked for is 4, one page each);
    where the native reader cannot run, a ReadError names why, not whole-block reads instead."""
    from edgerun.cache import native

    if native.unavailable():
        pytest.skip(f"the native reader cannot run here: {native.unavailable()}")
    for pieces, parts in ((2, 2), (8, 4)):
        results = _read(blocks_file, queue_depths=(1, 2), seconds_per_depth=0.05, pieces=pieces)
        assert [(r["queue_depth"], r["pieces"]) for r in results] == [(1, parts), (2, parts)]
        assert all(r["reads"] > 0 and r["bytes"] == r["reads"] * BLOCK for r in results)
    monkeypatch.setattr(native, "unavailable", lambda: "no C compiler found")
    with pytest.raises(ReadError, match="reader native: no C compiler found"):
        C.read_bandwidth(blocks_file, BLOCK, (1,), 0.05, direct=False, pieces=2)


def test_bursts_of_reads_after_idle(blocks_file, tmp_path):
    """A burst per size, timed from the submit until its last block landed: sizes in order, the
    median inside the range, GB/s from the median; bursts of more reads take longer."""
    from edgerun.cache import native
    from edgerun.cache.reader import direct_supported

    if native.unavailable():
        pytest.skip(f"the native reader cannot run here: {native.unavailable()}")
    if not direct_supported(blocks_file):
        pytest.skip(f"{tmp_path}'s filesystem refuses O_DIRECT")
    rows = C.burst_seconds([blocks_file], BLOCK, sizes=(1, 4), depth=1, pieces=2, idle=0.001, repeats=5)
    assert [(r["reads"], r["depth"], r["pieces"]) for r in rows] == [(1, 1, 2), (4, 1, 2)]
    for r in rows:
        assert r["min_s"] <= r["median_s"] <= r["max_s"]
        assert r["gb_per_s"] == pytest.approx(r["reads"] * BLOCK / r["median_s"] / 1e9)
    assert rows[1]["min_s"] > rows[0]["min_s"]  # four reads one at a time: more than one read's time
