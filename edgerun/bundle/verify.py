"""`edgerun verify`: the reader's cheap checks (structure, sizes, alignment, manifest/model
consistency), and with ``deep`` every byte hashed against the manifest. A damaged file is named
with the part that is damaged: the expert block (and its offset) or the dense tensor."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from edgerun.bundle import format as F
from edgerun.bundle.reader import Bundle, BundleError
from edgerun.models.providers import ProviderPolicy

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
            f"experts, block_bytes {rec.block_bytes}, {total / 2**30:.3f} GiB; {hashes}"
        )


def verify_bundle(
    root: str | Path, deep: bool = False, providers: ProviderPolicy | None = None
) -> VerifyReport:
    """``providers``: which installed architecture providers may serve the bundle's model_type
    (its tensor inventory is checked against the architecture)."""
    b = Bundle.open(root, providers=providers)
    hashed = 0
    if deep:
        m = b.manifest
        parts: dict[str, list[tuple[str, int, int, str]]] = {n: [] for n in m.files}
        for rec in m.layers:
            parts[rec.file] = [
                (f"expert {e}'s block", e * rec.block_bytes, (e + 1) * rec.block_bytes, h)
                for e, h in enumerate(rec.block_blake2b)
            ]
        parts[m.dense_file] = [
            (f"tensor {e.name!r}", e.start, e.end, m.dense_tensors[e.name]) for e in b.dense.values()
        ]
        for name, rec in m.files.items():
            hashed += _check_file(b.root / name, rec, name, parts[name])
    return VerifyReport(b.root, b.manifest, deep, hashed)


def _check_file(path: Path, rec: F.FileRecord, name: str, parts: list[tuple[str, int, int, str]]) -> int:
    """Hash ``path`` in one sequential pass; each part (label, start, end, blake2b-128) is checked
    as it passes, so the first damaged part is named before the whole-file hash is compared."""
    whole = F.new_hash()
    buf = bytearray(CHUNK)
    pos = 0
    with open(path, "rb", buffering=0) as f:

        def feed(end: int, part=None) -> None:
            nonlocal pos
            while pos < end:
                n = f.readinto(memoryview(buf)[: min(CHUNK, end - pos)])
                if not n:
                    raise BundleError(f"{path}: ends at byte {pos}, expected {end}")
                view = memoryview(buf)[:n]
                whole.update(view)
                if part is not None:
                    part.update(view)
                pos += n

        for label, start, end, want in sorted(parts, key=lambda p: p[1]):
            feed(start)
            h = F.new_hash(F.PART_DIGEST)
            feed(end, h)
            if h.hexdigest() != want:
                raise BundleError(
                    f"{path}: {label} (bytes [{start}, {end})) fails its {F.HASH} check: the file is damaged there"
                )
        feed(rec.bytes)
    got = whole.hexdigest()
    if got != rec.blake2b:
        raise BundleError(
            f"{path}: {F.HASH} {got[:16]}... does not match {F.MANIFEST} key 'files[{name!r}].blake2b' "
            f"({rec.blake2b[:16]}...): the file is damaged"
        )
    return pos
