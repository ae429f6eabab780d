"""`edgerun verify`: the reader's cheap checks (structure, sizes, alignment, manifest/model
consistency), and with ``deep`` every byte hashed against the manifest and every quantized dense
weight's values checked (scales finite and positive, int8 values in range). A damaged file is
named with the part that is damaged: the expert block (and its offset) or the dense tensor."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgerun.bundle import format as F
from edgerun.bundle.quant import E4M3_MAX_BITS, E4M3_MIN_NORMAL_BITS
from edgerun.bundle.reader import Bundle, BundleError, DenseQuant
from edgerun.models.providers import ProviderPolicy
from edgerun.progress import byte_bar
from edgerun.safetensors_io import TensorEntry

CHUNK = 16 << 20


@dataclass(frozen=True)
class VerifyReport:
    root: Path
    manifest: F.Manifest
    deep: bool
    bytes_hashed: int

    def summary(self) -> str:
        m = self.manifest
        q = m.quant
        rec = m.layers[0]
        total = sum(r.bytes for r in m.files.values())
        hashes = (
            f"all {len(m.files)} files hashed ({self.bytes_hashed:,d} bytes)"
            if self.deep
            else "hashes not checked (use --deep)"
        )
        return (
            f"{self.root}: OK: edgerun bundle v{m.version}, {m.model_type}, experts {q.scheme} "
            f"(group {q.group_size}, rotation {q.rotation}), {len(m.layers)} MoE layers x {rec.num_experts} "
            f"experts, block_bytes {rec.block_bytes}, dense {m.dense_quant.scheme.label()}, "
            f"{total / 2**30:.3f} GiB; {hashes}"
        )


def verify_bundle(
    root: str | Path,
    deep: bool = False,
    providers: ProviderPolicy | None = None,
    progress: bool | None = None,
) -> VerifyReport:
    """``providers``: which installed architecture providers may serve the bundle's model_type
    (its tensor inventory is checked against the architecture). ``progress``: a bar of the bytes
    ``deep`` hashes, on stderr (None: when it is a terminal)."""
    F.check_finished(root)
    b = Bundle.open(root, providers=providers)
    hashed = 0
    if deep:
        m = b.manifest
        parts: dict[str, list[tuple[str, int, int, str, str | None]]] = {n: [] for n in m.files}
        for rec in m.layers:
            sums = rec.block_xxh3 or [None] * rec.num_experts
            parts[rec.file] = [
                (f"expert {e}'s block", e * rec.block_bytes, (e + 1) * rec.block_bytes, h, x)
                for e, (h, x) in enumerate(zip(rec.block_blake2b, sums))
            ]
        parts[m.dense_file] = [
            (f"tensor {e.name!r}", e.start, e.end, m.dense_tensors[e.name], None) for e in b.dense.values()
        ]
        with byte_bar(sum(r.bytes for r in m.files.values()), "verify", force=progress) as bar:
            for name, rec in m.files.items():
                bar.set_description_str(f"verify {name}", refresh=False)
                hashed += _check_file(b.root / name, rec, name, parts[name], bar.update)
        for q in b.dense_quant.values():
            _check_dense_values(q)
    return VerifyReport(b.root, b.manifest, deep, hashed)


def _check_dense_values(q: DenseQuant) -> None:
    """What the quantizer never writes, so that every value dequantizes to a finite number: an
    int4 scale code that is not a positive normal e4m3 (zero, subnormal, negative, NaN), a global
    that is not a positive finite power of two, an int8 scale that is negative or not finite, an
    int8 value of -128."""
    if q.scheme == "int4":
        _scan(
            q.scales, np.uint8, lambda c: (c < E4M3_MIN_NORMAL_BITS) | (c > E4M3_MAX_BITS), "e4m3 scale code"
        )
        _scan(
            q.global_,
            np.float32,
            lambda g: ~np.isfinite(g) | (g <= 0) | (np.frexp(g)[0] != 0.5),
            "global scale",
        )
    else:
        _scan(q.scales, np.float32, lambda s: ~np.isfinite(s) | (s < 0), "fp32 scale")
        _scan(q.weight, np.int8, lambda v: v == -128, "int8 value")


def _scan(e: TensorEntry, dtype: type, bad: Callable[[np.ndarray], np.ndarray], what: str) -> None:
    """Read tensor ``e`` in chunks; refuse the first element ``bad`` flags, naming its byte."""
    item = np.dtype(dtype).itemsize
    cols = e.shape[-1] if len(e.shape) > 1 else 1
    step = CHUNK // item
    total = e.nbytes // item
    with open(e.file, "rb") as f:
        for first in range(0, total, step):
            f.seek(e.start + first * item)
            a = np.fromfile(f, dtype=dtype, count=min(step, total - first))
            hits = np.flatnonzero(bad(a))
            if hits.size:
                i = first + int(hits[0])
                value = a[hits[0]]
                shown = f"0x{int(value):02x}" if dtype is np.uint8 else repr(value.item())
                raise BundleError(
                    f"{e.file}: tensor {e.name!r} (bytes [{e.start}, {e.end})): {what} {shown} at byte "
                    f"{e.start + i * item} (row {i // cols}, column {i % cols}) is not one the quantizer writes"
                )


def _check_file(
    path: Path,
    rec: F.FileRecord,
    name: str,
    parts: list[tuple[str, int, int, str, str | None]],
    advance: Callable[[int], object] = lambda n: None,
) -> int:
    """Hash ``path`` in one sequential pass; each part (label, start, end, blake2b-128, and for a
    block its xxh3 checksum or None) is checked as it passes, so the first damaged part is named
    before the whole-file hash is compared."""
    whole = F.new_hash()
    buf = bytearray(CHUNK)
    pos = 0
    with open(path, "rb", buffering=0) as f:

        def feed(end: int, *parts) -> None:
            nonlocal pos
            while pos < end:
                n = f.readinto(memoryview(buf)[: min(CHUNK, end - pos)])
                if not n:
                    raise BundleError(f"{path}: ends at byte {pos}, expected {end}")
                view = memoryview(buf)[:n]
                for h in (whole, *parts):
                    h.update(view)
                pos += n
                advance(n)

        for label, start, end, want, checksum in sorted(parts, key=lambda p: p[1]):
            feed(start)
            h, x = F.new_hash(F.PART_DIGEST), F.new_block_checksum()
            feed(end, h, x)
            if h.hexdigest() != want:
                raise BundleError(
                    f"{path}: {label} (bytes [{start}, {end})) fails its {F.HASH} check: the file is damaged there"
                )
            if checksum is not None and x.hexdigest() != checksum:
                raise BundleError(
                    f"{path}: {label} (bytes [{start}, {end})) matches its {F.HASH} but not its xxh3 "
                    "checksum: the manifest's block_xxh3 is wrong"
                )
        feed(rec.bytes)
    got = whole.hexdigest()
    if got != rec.blake2b:
        raise BundleError(
            f"{path}: {F.HASH} {got[:16]}... does not match {F.MANIFEST} key 'files[{name!r}].blake2b' "
            f"({rec.blake2b[:16]}...): the file is damaged"
        )
    return pos
