"""Bundle format v2 (v1 still read): file names, the manifest schema (parse + validate +
serialise), hashing and a streaming safetensors header writer. docs/bundle-format.md is the
specification; this module is its executable form. No torch here: the planner and `verify` read
manifests without it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from edgerun.bundle import dense_layout as DL
from edgerun.bundle.layout import ALIGN, Component
from edgerun.errors import ConfigError, EdgerunError
from edgerun.models.args import ConfigReader, read_json

FORMAT_NAME = "edgerun-bundle"
FORMAT_VERSION = 2  # what convert writes
READ_VERSIONS = (1, 2)  # v1: no dense.quant (every resident tensor plain)
MANIFEST = "manifest.json"
DENSE = "dense.safetensors"
EXPERT_DIR = "experts"
TOKENIZER_REQUIRED = ("tokenizer.json",)
TOKENIZER_OPTIONAL = (
    "tokenizer_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "special_tokens_map.json",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
)
HASH = "blake2b"
FILE_DIGEST = 32  # blake2b-256 for whole files
PART_DIGEST = 16  # blake2b-128 for one expert block or one dense tensor
SIDECAR_DTYPE = "fp32"
QUANT_BITS = {"bf16": 16, "int8": 8, "int4": 4}
SCALE_FORMATS = {
    "bf16": "none",
    "int8": "fp32 per row (group 0) or per group, in the block",
    "int4": "fp8_e4m3 per group in the block x fp32 power-of-two per tensor in the sidecar",
}
VALUE_RANGES = {"bf16": None, "int8": [-127, 127], "int4": [-7, 7]}


class BundleError(EdgerunError, ValueError):
    """A bundle is missing, damaged, or does not match what its manifest says."""


CONVERT_JOURNAL = ".convert-journal.json"  # what `edgerun convert` keeps in DST until it finishes


def check_finished(path: str | Path) -> None:
    """Refuse, by name, a bundle directory a conversion has not finished (its journal is there,
    its manifest is not yet), instead of taking it for something else."""
    path = Path(path)
    if not (path / MANIFEST).is_file() and (path / CONVERT_JOURNAL).is_file():
        raise BundleError(
            f"{path}: an unfinished bundle: a conversion into it stopped before writing {MANIFEST} "
            f"({CONVERT_JOURNAL} is there); run the same `edgerun convert SRC {path}` again to finish "
            "it (it resumes where it stopped)"
        )


def expert_file(layer: int) -> str:
    return f"{EXPERT_DIR}/L{layer:02d}.bin"


def sidecar_file(layer: int) -> str:
    return f"{EXPERT_DIR}/L{layer:02d}.scales"


# --------------------------------------------------------------------------------------------
# Hashing


def new_hash(digest: int = FILE_DIGEST) -> Any:
    return hashlib.blake2b(digest_size=digest)


def part_hash(data: bytes | memoryview) -> str:
    return hashlib.blake2b(data, digest_size=PART_DIGEST).hexdigest()


def file_hash(path: Path, chunk: int = 16 << 20) -> str:
    """blake2b-256 of a whole file, read in chunks (bounded memory)."""
    h = new_hash()
    buf = bytearray(chunk)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def block_checksum(data: bytes | memoryview) -> str:
    """xxh3-64 of one expert block, 16 hex digits: what a reader checks every block it reads
    against (``block_xxh3``), at tens of GB/s where blake2b manages about one."""
    return xxhash.xxh3_64_hexdigest(data)


new_block_checksum = xxhash.xxh3_64  # the same, fed in pieces: update(), hexdigest()


def fingerprint(obj: Any) -> str:
    """blake2b-256 of the canonical JSON of ``obj`` (sorted keys, no spaces)."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=FILE_DIGEST).hexdigest()


def inventory_fingerprint(dense: list[tuple[str, str, tuple[int, ...]]]) -> str:
    """Fingerprint of the resident tensor inventory: sorted (name, safetensors dtype, shape)."""
    return fingerprint(sorted([n, d, list(s)] for n, d, s in dense))


# --------------------------------------------------------------------------------------------
# Streaming safetensors writing: the header first, then each tensor's bytes in header order.


def safetensors_header(tensors: list[tuple[str, str, tuple[int, ...], int]]) -> bytes:
    """(name, dtype code, shape, nbytes) in file order -> the header bytes (8-byte length + JSON,
    space-padded so the data starts on a 64-byte boundary: a mapped file's tensors then start as
    aligned as the bytes before them allow, which the CPU's int8 kernel needs). Tensors follow
    back to back."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape, nbytes in tensors:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 64)
    return len(text).to_bytes(8, "little") + text


# --------------------------------------------------------------------------------------------
# Manifest


@dataclass(frozen=True)
class FileRecord:
    bytes: int
    blake2b: str


@dataclass(frozen=True)
class Sidecar:
    file: str
    dtype: str  # fp32
    shape: tuple[int, int]  # [num_experts, 2]: gate_up, down global scales
    nbytes: int


@dataclass(frozen=True)
class LayerRecord:
    layer: int
    file: str
    num_experts: int
    block_bytes: int
    components: tuple[Component, ...]
    sidecar: Sidecar | None
    block_blake2b: tuple[str, ...]
    rel_rmse: float  # sqrt(sum err^2 / sum w^2) over this layer's experts
    block_xxh3: tuple[str, ...] | None = None  # block_checksum of each block; None: an older bundle

    @property
    def file_bytes(self) -> int:
        return self.num_experts * self.block_bytes


@dataclass(frozen=True)
class QuantRecord:
    scheme: str  # bf16 | int8 | int4
    bits: int
    group_size: int  # 0: per row (int8) / none (bf16)
    value_range: tuple[int, int] | None
    scale_format: str
    rotation: str  # none | hadamard
    rel_rmse: float  # pooled over every expert of every layer


@dataclass(frozen=True)
class DenseTensorQuant:
    """One quantized dense weight (manifest ``dense.quant.tensors[name]``)."""

    scheme: str  # int8 | int4
    group_size: int  # 0: one scale per row (int8)
    rel_rmse: float  # sqrt(sum err^2 / sum w^2) of this weight, on the bytes written


@dataclass(frozen=True)
class DenseQuantRecord:
    """Manifest ``dense.quant`` (version 2): how the resident linear weights are stored."""

    linear: str  # bf16 (plain) | int8 | int4: the attention / DeltaNet / shared-expert / dense-MLP linears
    lm_head: str  # the same for an untied lm_head (bf16 when tied: the embedding table stays plain)
    group_size: int  # the linear weights' group (int8 0: per row; 0 when bf16)
    rel_rmse: float  # pooled over every quantized dense weight
    tensors: dict[str, DenseTensorQuant]  # canonical weight name -> record, every quantized weight

    @property
    def scheme(self) -> DL.DenseScheme:
        head = self.tensors.get(DL.LM_HEAD_WEIGHT)
        return DL.DenseScheme(self.linear, self.group_size, self.lm_head, head.group_size if head else 0)

    @classmethod
    def plain(cls) -> DenseQuantRecord:
        """What a version 1 manifest implies: nothing quantized."""
        return cls(DL.PLAIN, DL.PLAIN, 0, 0.0, {})

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "tensors": {n: asdict(t) for n, t in self.tensors.items()}}


@dataclass(frozen=True)
class Manifest:
    model_type: str
    config: dict[str, Any]  # key 'model_config': the source's config.json, as read
    dtype: str  # default load dtype (safetensors code): --dense-dtype, else the source's most common
    inventory: str  # inventory_fingerprint of dense.safetensors
    source: dict[str, Any]  # identity of the source checkpoint (informational + resume key)
    quant: QuantRecord
    dense_file: str
    dense_dtype: str  # "source" (each tensor keeps its checkpoint dtype) or the safetensors code cast to
    dense_tensors: dict[str, str]  # stored name -> blake2b-128 of its bytes, in file order
    layers: tuple[LayerRecord, ...]
    tokenizer_files: tuple[str, ...]
    files: dict[str, FileRecord] = field(default_factory=dict)  # every file but the manifest
    dense_quant: DenseQuantRecord = field(default_factory=DenseQuantRecord.plain)  # v1: all plain
    format: str = FORMAT_NAME
    version: int = FORMAT_VERSION

    def layer(self, index: int) -> LayerRecord:
        for rec in self.layers:
            if rec.layer == index:
                return rec
        raise KeyError(f"layer {index} has no routed experts in this bundle")

    def to_json(self) -> dict[str, Any]:
        def comp(c: Component) -> dict[str, Any]:
            return {
                "name": c.name,
                "dtype": c.dtype,
                "shape": list(c.shape),
                "offset": c.offset,
                "nbytes": c.nbytes,
            }

        return {
            "format": self.format,
            "version": self.version,
            "model": {"model_type": self.model_type, "dtype": self.dtype, "inventory": self.inventory},
            "model_config": self.config,
            "source": self.source,
            "quant": {**asdict(self.quant), "value_range": _list(self.quant.value_range)},
            "dense": {
                "file": self.dense_file,
                "dtype": self.dense_dtype,
                "tensors": self.dense_tensors,
                **({"quant": self.dense_quant.to_json()} if self.version >= 2 else {}),
            },
            "layers": [
                {
                    "layer": r.layer,
                    "file": r.file,
                    "num_experts": r.num_experts,
                    "block_bytes": r.block_bytes,
                    "components": [comp(c) for c in r.components],
                    "sidecar": None
                    if r.sidecar is None
                    else {**asdict(r.sidecar), "shape": list(r.sidecar.shape)},
                    "rel_rmse": r.rel_rmse,
                    "block_blake2b": list(r.block_blake2b),
                    **({} if r.block_xxh3 is None else {"block_xxh3": list(r.block_xxh3)}),
                }
                for r in self.layers
            ],
            "tokenizer": {"files": list(self.tokenizer_files)},
            "files": {k: asdict(v) for k, v in self.files.items()},
        }

    def dumps(self) -> str:
        doc = self.to_json()
        doc[MANIFEST_HASH] = manifest_fingerprint(doc)
        return json.dumps(doc, indent=1) + "\n"


# the manifest's own hash (of its canonical JSON without this key): a manifest edited or damaged
# into another valid one (a rotation, a norm's eps, a layer's file) no longer passes for the
# bundle convert wrote. Bundles written before it have none, and are read as they were.
MANIFEST_HASH = "manifest_blake2b"


def manifest_fingerprint(doc: dict[str, Any]) -> str:
    """``fingerprint`` of ``doc`` as JSON gives it back (tuples as lists), without its own hash."""
    return fingerprint(json.loads(json.dumps({k: v for k, v in doc.items() if k != MANIFEST_HASH})))


def _list(x: Any) -> Any:
    return None if x is None else list(x)


def _obj(d: Any, path: Path, where: str) -> ConfigReader:
    """Typed access to one manifest object; errors name the file and the key path."""
    if not isinstance(d, dict):
        raise BundleError(f"{path}: key {where!r} must be an object, got {d!r}")
    return ConfigReader(d, f"{path} [{where}]" if where else str(path))


def _ints(r: ConfigReader, key: str, low: int = 0) -> tuple[int, ...]:
    value = r.require(key, list)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= low for v in value):
        raise BundleError(f"{r.source}: key {key!r} must be a list of integers >= {low}, got {value!r}")
    return tuple(value)


_HEX = re.compile(r"[0-9a-f]+")


def _is_hex(h: Any, digits: int) -> bool:
    return isinstance(h, str) and len(h) == digits and _HEX.fullmatch(h) is not None


def _hex(r: ConfigReader, key: str, digits: int) -> str:
    value = r.require(key, str)
    if not _is_hex(value, digits):
        raise BundleError(f"{r.source}: key {key!r} must be {digits} hex digits, got {value[:40]!r}")
    return value


def _hexes(r: ConfigReader, key: str, digits: int) -> tuple[str, ...]:
    value = r.require(key, list)
    for i, h in enumerate(value):
        if not _is_hex(h, digits):
            raise BundleError(
                f"{r.source}: key '{key}[{i}]' must be {digits} hex digits, got {str(h)[:40]!r}"
            )
    return tuple(value)


def _strings(r: ConfigReader, key: str) -> tuple[str, ...]:
    value = r.require(key, list)
    if not all(isinstance(v, str) and v for v in value):
        raise BundleError(f"{r.source}: key {key!r} must be a list of file names, got {str(value)[:60]}")
    return tuple(value)


def _finite(r: ConfigReader, key: str) -> float:
    value = r.require(key, float)
    if not math.isfinite(value):
        raise BundleError(f"{r.source}: key {key!r} must be a finite number, got {value}")
    return value


def check_identity(doc: Any, path: Path) -> int:
    """A parsed manifest's format name, version (returned) and own hash, checked before any other
    key: a future version is refused by its number, not by a missing key."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        got = doc.get("format") if isinstance(doc, dict) else None
        raise BundleError(f"{path}: key 'format' is {got!r}, expected {FORMAT_NAME!r}: not an edgerun bundle")
    version = doc.get("version")
    if type(version) is not int or version not in READ_VERSIONS:
        raise BundleError(
            f"{path}: unknown bundle format version {version!r} (this edgerun reads versions "
            f"{', '.join(map(str, READ_VERSIONS))})"
        )
    recorded = doc.get(MANIFEST_HASH)
    if recorded is not None and recorded != manifest_fingerprint(doc):
        raise BundleError(
            f"{path}: its contents do not match its key {MANIFEST_HASH!r}: the manifest was edited or "
            "damaged after convert wrote it"
        )
    return version


def read_manifest(bundle: str | Path) -> Manifest:
    """Parse and schema-check ``bundle/manifest.json``. The format name and version are checked
    first, so a future version is refused by its number, not by a missing key."""
    path = Path(bundle) / MANIFEST
    if not path.is_file():
        raise BundleError(f"{Path(bundle)}: not a bundle (no {MANIFEST})")
    doc = read_json(path, BundleError)
    version = check_identity(doc, path)
    try:
        return _parse(doc, path, version)
    except ConfigError as exc:
        raise BundleError(str(exc)) from exc


def _parse(doc: dict[str, Any], path: Path, version: int) -> Manifest:
    top = _obj(doc, path, "")
    q = _obj(top.require("quant", dict), path, "quant")
    scheme = q.require("scheme", str)
    if scheme not in QUANT_BITS:
        raise BundleError(f"{q.source}: key 'scheme' is {scheme!r}, expected one of {', '.join(QUANT_BITS)}")
    quant = QuantRecord(
        scheme=scheme,
        bits=q.require("bits"),
        group_size=q.require("group_size"),
        value_range=None if q.cfg.get("value_range") is None else _ints(q, "value_range", low=-(2**31)),
        scale_format=q.require("scale_format", str),
        rotation=q.require("rotation", str),
        rel_rmse=_finite(q, "rel_rmse"),
    )
    if quant.bits != QUANT_BITS[scheme]:
        raise BundleError(
            f"{q.source}: key 'bits' is {quant.bits}, but {scheme!r} has {QUANT_BITS[scheme]} bits"
        )

    layers = []
    for i, raw in enumerate(top.require("layers", list)):
        rec = _obj(raw, path, f"layers[{i}]")
        comps = []
        for j, c in enumerate(rec.require("components", list)):
            cr = _obj(c, path, f"layers[{i}].components[{j}]")
            comps.append(
                Component(
                    cr.require("name", str),
                    cr.require("dtype", str),
                    _ints(cr, "shape"),
                    cr.require("offset"),
                    cr.require("nbytes"),
                )
            )
        sidecar = None
        if rec.cfg.get("sidecar") is not None:
            sc = _obj(rec.cfg["sidecar"], path, f"layers[{i}].sidecar")
            shape = _ints(sc, "shape")
            if len(shape) != 2:
                raise BundleError(f"{sc.source}: key 'shape' must have two entries, got {list(shape)}")
            sidecar = Sidecar(sc.require("file", str), sc.require("dtype", str), shape, sc.require("nbytes"))
        layers.append(
            LayerRecord(
                layer=rec.require("layer"),
                file=rec.require("file", str),
                num_experts=rec.require("num_experts"),
                block_bytes=rec.require("block_bytes"),
                components=tuple(comps),
                sidecar=sidecar,
                block_blake2b=_hexes(rec, "block_blake2b", 2 * PART_DIGEST),
                rel_rmse=_finite(rec, "rel_rmse"),
                block_xxh3=None if rec.cfg.get("block_xxh3") is None else _hexes(rec, "block_xxh3", 16),
            )
        )
    files = {}
    for name, raw in top.require("files", dict).items():
        fr = _obj(raw, path, f"files[{name!r}]")
        files[name] = FileRecord(fr.require("bytes"), _hex(fr, "blake2b", 2 * FILE_DIGEST))
    model = _obj(top.require("model", dict), path, "model")
    dense = _obj(top.require("dense", dict), path, "dense")
    if version >= 2:
        dense_quant = _parse_dense_quant(_obj(dense.require("quant", dict), path, "dense.quant"), path)
    elif "quant" in dense.cfg:
        raise BundleError(f"{dense.source}: key 'quant' is a version 2 key, but 'version' is {version}")
    else:
        dense_quant = DenseQuantRecord.plain()
    return Manifest(
        model_type=model.require("model_type", str),
        config=top.require("model_config", dict),
        dtype=model.require("dtype", str),
        inventory=model.require("inventory", str),
        source=top.require("source", dict),
        quant=quant,
        dense_file=dense.require("file", str),
        dense_dtype=dense.require("dtype", str),
        dense_tensors=dense.require("tensors", dict),
        layers=tuple(layers),
        tokenizer_files=_strings(_obj(top.require("tokenizer", dict), path, "tokenizer"), "files"),
        files=files,
        dense_quant=dense_quant,
        version=version,
    )


def _parse_dense_quant(q: ConfigReader, path: Path) -> DenseQuantRecord:
    """``dense.quant``, checked as far as the manifest alone allows (the reader checks the names
    and shapes against the model): scheme names, group sizes, and that each tensor's scheme and
    group are the ones the top-level keys give for its role."""
    linear, lm_head = q.require("linear", str), q.require("lm_head", str)
    for key, scheme in (("linear", linear), ("lm_head", lm_head)):
        if scheme not in DL.SCHEMES:
            raise BundleError(
                f"{q.source}: key {key!r} is {scheme!r}, expected one of {', '.join(DL.SCHEMES)}"
            )
    group = q.require("group_size")
    _check_dense_group(q.source, "group_size", linear, group)
    tensors = {}
    for name, raw in q.require("tensors", dict).items():
        t = _obj(raw, path, f"dense.quant.tensors[{name!r}]")
        rec = DenseTensorQuant(
            t.require("scheme", str), t.require("group_size"), t.require("rel_rmse", float)
        )
        which = DL.LM_HEAD if name == DL.LM_HEAD_WEIGHT else DL.LINEAR
        want = lm_head if which == DL.LM_HEAD else linear
        if rec.scheme != want or want == DL.PLAIN:
            raise BundleError(
                f"{t.source}: key 'scheme' is {rec.scheme!r}, but the {which} weights are {want!r} "
                f"(key 'dense.quant.{which}')"
            )
        _check_dense_group(t.source, "group_size", rec.scheme, rec.group_size)
        if name != DL.LM_HEAD_WEIGHT and rec.group_size != group:
            raise BundleError(
                f"{t.source}: key 'group_size' is {rec.group_size}, but the linear weights' group is {group} "
                "(key 'dense.quant.group_size')"
            )
        tensors[name] = rec
    return DenseQuantRecord(linear, lm_head, group, q.require("rel_rmse", float), tensors)


def _check_dense_group(source: str, key: str, scheme: str, group: int) -> None:
    why = DL.group_error(scheme, group)
    if why is not None:
        raise BundleError(f"{source}: key {key!r} is {group}, but {why}")


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary name, fsync, then rename (and fsync the
    directory, which makes the rename itself durable)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    publish(tmp, path)


def publish(tmp: Path, path: Path) -> None:
    """Rename ``tmp`` (written and fsynced) to ``path`` and fsync the directory: after a crash
    the new name holds the whole file or the old state stands, never a lost or partial rename."""
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_aligned(n: int) -> bool:
    return n > 0 and n % ALIGN == 0
