"""Zero-copy safetensors reading: headers are parsed and checked by hand, payloads are views of
a private memory map (pages are read on first touch, never copied up front).

The header check is strict so a damaged file is refused before any tensor is used: every
tensor's byte range must lie inside the file and match its dtype and shape.
"""

from __future__ import annotations

import json
import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from edgerun.errors import CheckpointError

DTYPES: dict[str, torch.dtype] = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
ITEMSIZE = {
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "F64": 8,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorEntry:
    name: str
    file: Path
    dtype: str  # safetensors dtype code, e.g. "BF16"
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def read_header(path: str | Path) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    """Parse and validate a safetensors header: (entries by name, __metadata__)."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path}: too short for a safetensors header ({size} bytes)")
        (hlen,) = struct.unpack("<Q", raw)
        if hlen > MAX_HEADER or 8 + hlen > size:
            raise CheckpointError(f"{path}: header length {hlen} exceeds the file size {size}")
        try:
            header = json.loads(f.read(hlen))
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
            raise CheckpointError(f"{path}: header is not valid JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header must be a JSON object")
    meta = header.pop("__metadata__", None) or {}
    base = 8 + hlen
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        try:
            dtype, shape, (lo, hi) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry") from exc
        if not (
            isinstance(dtype, str)
            and all(type(d) is int and d >= 0 for d in shape)
            and type(lo) is int
            and type(hi) is int
        ):
            raise CheckpointError(
                f"{path}: tensor {name!r} has a malformed header entry (dtype a string, shape and "
                f"data_offsets whole numbers >= 0; got {json.dumps(info)[:120]})"
            )
        if dtype not in ITEMSIZE:
            raise CheckpointError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
        want = math.prod(shape) * ITEMSIZE[dtype]
        if not (0 <= lo <= hi) or hi - lo != want:
            raise CheckpointError(
                f"{path}: tensor {name!r} spans bytes [{lo}, {hi}) but dtype {dtype} x shape {list(shape)} "
                f"needs {want} bytes"
            )
        if base + hi > size:
            raise CheckpointError(
                f"{path}: tensor {name!r} ends at byte {base + hi}, past the end of the file ({size} bytes)"
            )
        entries[name] = TensorEntry(name, path, dtype, shape, base + lo, base + hi)
    return entries, meta


class MappedFiles:
    """Keeps one private (copy-on-write) map per file; tensors are views into it."""

    def __init__(self) -> None:
        self._maps: dict[Path, mmap.mmap] = {}

    def tensor(self, e: TensorEntry) -> torch.Tensor:
        if e.dtype not in DTYPES:
            raise CheckpointError(
                f"{e.file}: tensor {e.name!r} has dtype {e.dtype}, which edgerun cannot load"
            )
        m = self._maps.get(e.file)
        if m is None:
            with open(e.file, "rb") as f:
                m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            self._maps[e.file] = m
        n = e.nbytes // ITEMSIZE[e.dtype]
        if n == 0:
            return torch.empty(e.shape, dtype=DTYPES[e.dtype])
        t = torch.frombuffer(m, dtype=DTYPES[e.dtype], count=n, offset=e.start)
        return t.view(e.shape)
