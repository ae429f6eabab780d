"""`edgerun convert`: a Hugging Face checkpoint or a GGUF file -> a bundle (format v2), streaming
and restartable.

Planning reads safetensors headers (or the GGUF header, through ``gguf_source``) only: that is all
`--dry-run` does. Conversion then reads one
dense tensor (in chunks; a quantized one in blocks of rows) or one expert at a time with
positional reads, not a memory map, so what was read sits in the page cache rather than in the
process: peak RSS is about one expert's working set plus the interpreter, whatever the model's
size. Every output file is written under a
temporary name and renamed when complete; a journal in DST records each finished file's hash, so a
killed conversion resumes, re-hashes the files it finished and skips them. The manifest is written
last: a directory without one is an unfinished bundle.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import re
import shutil
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, TextIO

import numpy as np
import torch

from edgerun.bundle import dense_layout as DL
from edgerun.bundle import format as F
from edgerun.bundle import gguf_source as G
from edgerun.bundle.layout import BlockLayout, expert_block_layout
from edgerun.bundle.quant import (
    dequantize_block,
    dequantize_int4,
    dequantize_int8,
    int4_global_scale,
    int4_max_group_scale,
    quantize_expert,
    quantize_int4,
    quantize_int8,
)
from edgerun.errors import CheckpointError, ConfigError
from edgerun.models import args as A
from edgerun.models.args import ModelArgs, read_config
from edgerun.models.checkpoint import (
    FLOAT_DTYPES,
    MTP_NAME,
    canonical_name,
    checkpoint_files,
    classify,
    read_entries,
    source_dtype,
)
from edgerun.models.inventory import mtp_specs
from edgerun.models.providers import ProviderPolicy
from edgerun.models.registry import load_args
from edgerun.safetensors_io import DTYPES, ITEMSIZE, TensorEntry

JOURNAL = F.CONVERT_JOURNAL
CHUNK = 64 << 20  # dense tensors are copied in chunks of this many source bytes
QCHUNK = 16 << 20  # a quantized dense weight is read in blocks of rows of about this many source bytes
DENSE_DTYPES = {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}
PARTS = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ConvertOptions:
    quant: str = "bf16"
    group: int | None = None  # None: the scheme's default (int8: per row; int4: 32)
    rotate: bool = False
    dense_dtype: str | None = None  # bf16 | fp16 | fp32; None keeps each resident tensor's dtype
    dense: str = "bf16"  # linear weights: bf16 (plain, at the dense dtype) | int8 | int4
    lm_head: str | None = None  # an untied lm_head's scheme; None: as ``dense`` (a tied one stays plain)
    dense_group: int | None = None  # None: each scheme's default (int4 32, int8 0 = per row)


@dataclass(frozen=True)
class Row:
    """One source tensor as convert sees it (the --dry-run listing)."""

    name: str
    kind: str  # resident | expert | ignored | unknown
    detail: str  # category, "layer L expert e part", or the ignored group
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Resident:
    name: str  # canonical name, as stored in dense.safetensors
    entry: TensorEntry
    dtype: str  # output dtype code (of a plain tensor)
    category: str
    scheme: str = DL.PLAIN  # int8 | int4: stored as DL.quantized_parts
    group: int = 0

    @property
    def parts(self) -> list[tuple[str, str, tuple[int, ...], int]]:
        """(stored name, dtype code, shape, nbytes) of what dense.safetensors holds for it."""
        if self.scheme == DL.PLAIN:
            return [
                (self.name, self.dtype, self.entry.shape, math.prod(self.entry.shape) * ITEMSIZE[self.dtype])
            ]
        return [
            (p.name, p.dtype, p.shape, p.nbytes)
            for p in DL.quantized_parts(self.name, self.entry.shape, self.scheme, self.group)
        ]

    @property
    def nbytes(self) -> int:
        return sum(p[3] for p in self.parts)


@dataclass(frozen=True)
class StackedEntry:
    """A tensor the checkpoint stores in pieces, read as their concatenation in order: the MTP
    head's per-expert experts stacked as the bundle stores them (``gate_up_proj`` [E, 2I, D] from
    each expert's gate then up, ``down_proj`` [E, D, I]). Has what :class:`Source` and the plan
    read of a ``TensorEntry``."""

    name: str  # the stacked tensor's canonical name
    file: Path  # the first piece's (for messages)
    dtype: str
    shape: tuple[int, ...]
    pieces: tuple[TensorEntry, ...]

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.pieces)


def missing_experts(prefix: str, parts: dict[tuple[int, str], TensorEntry], E: int) -> str | None:
    """The problem of per-expert tensors under ``prefix`` that lack some of E experts' gate / up /
    down (the first missing named, and how many more), or None."""
    missing = [f"{prefix}.{x}.{p}.weight" for x in range(E) for p in PARTS if (x, p) not in parts]
    if not missing:
        return None
    more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
    return f"missing tensor {missing[0]!r}{more}"


def stacked_mtp_experts(
    prefix: str, parts: dict[tuple[int, str], TensorEntry], E: int, I: int, D: int, problems: list[str]
) -> dict[str, StackedEntry]:
    """The MTP head's per-expert tensors under ``prefix`` (``mtp.layers.N.mlp.experts``) as the
    two stacked tensors {canonical name: entry}; a missing, extra, misshapen or mixed-dtype piece
    is a problem named (and nothing returned)."""
    before = len(problems)
    for (x, part), e in sorted(parts.items()):
        if x >= E:
            problems.append(f"{e.file}: unknown tensor {e.name!r} (num_experts is {E})")
        elif tuple(e.shape) != ((D, I) if part == "down_proj" else (I, D)):
            want = [D, I] if part == "down_proj" else [I, D]
            problems.append(f"{e.file}: tensor {e.name!r} has shape {list(e.shape)}, expected {want}")
    missing = missing_experts(prefix, parts, E)
    if missing:
        problems.append(missing)
    dtypes = sorted({e.dtype for e in parts.values()})
    if len(dtypes) > 1:
        problems.append(f"{prefix}.*: the MTP head's experts mix dtypes {', '.join(dtypes)}; expected one")
    if len(problems) > before:
        return {}
    first = parts[(0, "gate_proj")]
    gate_up = tuple(parts[(x, p)] for x in range(E) for p in ("gate_proj", "up_proj"))
    down = tuple(parts[(x, "down_proj")] for x in range(E))
    return {
        f"{prefix}.gate_up_proj": StackedEntry(
            f"{prefix}.gate_up_proj", first.file, dtypes[0], (E, 2 * I, D), gate_up
        ),
        f"{prefix}.down_proj": StackedEntry(f"{prefix}.down_proj", first.file, dtypes[0], (E, D, I), down),
    }


@dataclass(frozen=True)
class ExpertSource:
    """Where one MoE layer's experts are in the checkpoint: fused [E, 2I, D] / [E, D, I] tensors, or
    per-expert gate/up/down tensors keyed by (expert, part)."""

    layer: int
    fused: tuple[TensorEntry, TensorEntry] | None
    per_expert: dict[tuple[int, str], TensorEntry] | None

    @property
    def nbytes(self) -> int:
        parts = self.fused if self.fused else self.per_expert.values()
        return sum(e.nbytes for e in parts)


@dataclass
class ConversionPlan:
    """Everything convert will do, decided from headers alone."""

    src: Path
    arch: ModuleType
    args: ModelArgs
    config: dict[str, Any]
    options: ConvertOptions
    layout: BlockLayout
    rows: list[Row]
    resident: list[Resident]
    experts: list[ExpertSource]
    tokenizer: list[str]
    source_dtype: str
    source: dict[str, Any]
    dense: DL.DenseScheme = DL.DenseScheme()
    problems: list[str] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)  # the checkpoint's weight files
    generated: dict[str, bytes] = field(default_factory=dict)  # tokenizer files made, not copied (GGUF)

    def tokenizer_bytes(self, name: str) -> bytes:
        return self.generated[name] if name in self.generated else (self.src / name).read_bytes()

    @property
    def dense_header(self) -> bytes:
        return F.safetensors_header([p for r in self.resident for p in r.parts])

    def file_sizes(self) -> dict[str, int]:
        """Exact size of every file the bundle will hold, except the manifest."""
        sizes = {F.DENSE: len(self.dense_header) + sum(r.nbytes for r in self.resident)}
        for x in self.experts:
            sizes[F.expert_file(x.layer)] = self.args.num_experts * self.layout.block_bytes
            if self.layout.quant == "int4":
                sizes[F.sidecar_file(x.layer)] = self.args.num_experts * 2 * 4
        for name in self.tokenizer:
            sizes[name] = len(self.tokenizer_bytes(name))
        return sizes

    def manifest_estimate(self) -> int:
        """Upper bound of manifest.json's size: hashes and components dominate."""
        blocks = len(self.experts) * self.args.num_experts
        stored = sum(len(r.parts) for r in self.resident)
        quantized = sum(r.scheme != DL.PLAIN for r in self.resident)
        return 64 * 1024 + len(json.dumps(self.config)) + 48 * blocks + 120 * stored + 200 * quantized

    def sizes_by_category(self) -> dict[str, int]:
        out: Counter[str] = Counter()
        for r in self.resident:
            out[r.category] += r.nbytes
        files = self.file_sizes()
        out["experts"] = sum(v for k, v in files.items() if k.endswith(".bin"))
        out["expert scales (sidecars)"] = sum(v for k, v in files.items() if k.endswith(".scales"))
        out["dense header"] = len(self.dense_header)
        out["tokenizer"] = sum(files[n] for n in self.tokenizer)
        out["manifest (estimate)"] = self.manifest_estimate()
        return {k: v for k, v in out.items() if v}

    def check(self) -> None:
        if self.problems:
            more = f"\n  ... and {len(self.problems) - 10} more" if len(self.problems) > 10 else ""
            raise CheckpointError(f"{self.src}: cannot convert:\n  " + "\n  ".join(self.problems[:10]) + more)

    def key(self) -> dict[str, Any]:
        """What a resumed conversion must share with the one that started: any change restarts."""
        mtimes = {f.name: os.stat(f).st_mtime_ns for f in self.files}
        return {
            "format_version": F.FORMAT_VERSION,
            "source": self.source,
            "source_mtime_ns": mtimes,
            "quant": quant_key(quant_record(self.layout, 0.0)),
            "dense_dtype": self.options.dense_dtype or "source",
            "dense_quant": self.dense.key(),
        }


def quant_key(q: F.QuantRecord) -> dict[str, Any]:
    return {"scheme": q.scheme, "group_size": q.group_size, "rotation": q.rotation}


def quant_record(layout: BlockLayout, rel_rmse: float) -> F.QuantRecord:
    vr = F.VALUE_RANGES[layout.quant]
    return F.QuantRecord(
        scheme=layout.quant,
        bits=F.QUANT_BITS[layout.quant],
        group_size=layout.group_size,
        value_range=None if vr is None else tuple(vr),
        scale_format=F.SCALE_FORMATS[layout.quant],
        rotation=layout.rotation,
        rel_rmse=rel_rmse,
    )


def _header_hash(path: Path) -> str:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return F.part_hash(f.read(n))


def plan_conversion(
    src: str | Path, options: ConvertOptions, providers: ProviderPolicy | None = None
) -> ConversionPlan:
    """Classify every source tensor and size the bundle, reading only safetensors headers (or a
    GGUF file's header: ``src`` ending in .gguf).
    Problems (unknown or missing tensors, wrong shapes) are collected, not raised: see ``check``.
    ``providers``: which installed architecture providers may serve the checkpoint's model_type
    (default: built-in architectures only)."""
    src = Path(src)
    gguf = G.open_gguf(src) if G.is_gguf(src) else None
    config = gguf.config if gguf else read_config(src)
    arch, args = load_args(config if gguf else src, providers)
    if not args.moe_layers:
        raise ConfigError(f"{src}: the model has no MoE layers; a bundle streams routed experts")
    if options.dense_dtype is not None and options.dense_dtype not in DENSE_DTYPES:
        raise ConfigError(f"dense dtype {options.dense_dtype!r} is not one of {', '.join(DENSE_DTYPES)}")
    layout = expert_block_layout(args, options.quant, options.group, "hadamard" if options.rotate else "none")
    dense = DL.DenseScheme.resolve(
        options.dense, options.lm_head, options.dense_group, args.tie_word_embeddings
    )
    entries = gguf.entries if gguf else read_entries(src)[0]
    # the MTP head rides along in the dense part (plain, resident) when the source has it
    mtp = not gguf and args.mtp_num_hidden_layers > 0 and any(MTP_NAME.match(n) for n in entries)
    cp = classify(entries, args, mtp=mtp)
    specs = {s.name: s for s in arch.tensor_specs(args) + (mtp_specs(args) if mtp else [])}
    targets = DL.dense_targets(specs.values(), dense)
    E, I, D = args.num_experts, args.moe_intermediate_size, args.hidden_size
    expert_layer = {n.rsplit(".", 1)[0]: s.layer for n, s in specs.items() if s.category == A.EXPERT}
    problems: list[str] = list(gguf.problems) if gguf else []
    rows: dict[str, Row] = {}

    def row(e: TensorEntry | StackedEntry, kind: str, detail: str) -> None:
        if not isinstance(e, StackedEntry):  # its pieces have rows of their own
            rows[e.name] = Row(e.name, kind, detail, e.dtype, e.shape)

    def want_float(e: TensorEntry) -> None:
        if e.dtype not in FLOAT_DTYPES:
            problems.append(
                f"{e.file}: tensor {e.name!r} has dtype {e.dtype}; expected one of {', '.join(FLOAT_DTYPES)}"
            )

    def want_shape(e: TensorEntry, shape: tuple[int, ...]) -> None:
        if tuple(e.shape) != tuple(shape):
            problems.append(f"{e.file}: tensor {e.name!r} has shape {list(e.shape)}, expected {list(shape)}")

    src_dtype = source_dtype(entries)
    out_dtype = DENSE_DTYPES.get(options.dense_dtype or "")

    resident: dict[str, Resident] = {}
    fused: dict[str, dict[str, TensorEntry]] = {}
    direct: dict[str, TensorEntry | StackedEntry] = dict(cp.direct)
    for prefix in [p for p in cp.per_expert if p.startswith("mtp.")]:  # stacked, as the runtime loads them
        parts = cp.per_expert.pop(prefix)
        for e in parts.values():
            row(e, "resident", f"{prefix} stacked")
            want_float(e)
        direct.update(stacked_mtp_experts(prefix, parts, E, I, D, problems))
    for canon, e in direct.items():
        spec = specs.get(canon)
        if spec is None:
            row(e, "unknown", "-")
            problems.append(f"{e.file}: unknown tensor {e.name!r} for model_type {args.model_type!r}")
            continue
        want_shape(e, spec.shape)
        want_float(e)
        if spec.category == A.EXPERT:
            prefix, leaf = canon.rsplit(".", 1)
            fused.setdefault(prefix, {})[leaf] = e
            row(e, "expert", f"layer {spec.layer} all experts ({leaf})")
        else:
            dtype = out_dtype if out_dtype and e.dtype in FLOAT_DTYPES else e.dtype
            scheme, group = targets.get(canon, (DL.PLAIN, 0))
            resident[canon] = Resident(canon, e, dtype, spec.category, scheme, group)
            quant = f" {DL.scheme_label(scheme, group)}" if scheme != DL.PLAIN else ""
            row(e, "resident", spec.category + quant)
    for prefix, parts in cp.per_expert.items():
        layer = expert_layer.get(prefix)
        for (x, part), e in parts.items():
            if layer is None or x >= E:
                row(e, "unknown", "-")
                why = "that layer has no routed experts" if layer is None else f"num_experts is {E}"
                problems.append(f"{e.file}: unknown tensor {e.name!r} ({why})")
            else:
                row(e, "expert", f"layer {layer} expert {x} {part}")
                want_shape(e, (D, I) if part == "down_proj" else (I, D))
                want_float(e)
    for name, e in entries.items():
        if e.name not in rows:
            canon, group = canonical_name(name)
            row(e, "ignored", group or "tied lm_head")

    experts = []
    for prefix, layer in sorted(expert_layer.items(), key=lambda kv: kv[1]):
        if prefix in fused:
            f = fused[prefix]
            if "gate_up_proj" not in f or "down_proj" not in f:
                other = "down_proj" if "gate_up_proj" in f else "gate_up_proj"
                problems.append(f"missing tensor '{prefix}.{other}'")
                continue
            if prefix in cp.per_expert:
                problems.append(f"layer {layer} has both fused and per-expert expert tensors")
            experts.append(ExpertSource(layer, (f["gate_up_proj"], f["down_proj"]), None))
        elif prefix in cp.per_expert:
            parts = cp.per_expert[prefix]
            missing = missing_experts(prefix, parts, E)
            if missing:
                problems.append(missing)
                continue
            experts.append(ExpertSource(layer, None, parts))
        else:
            problems.append(f"missing tensors for the routed experts of layer {layer} ({prefix}.*)")
    ordered = []
    for name, spec in specs.items():
        if spec.category == A.EXPERT:
            continue
        if name in resident:
            ordered.append(resident[name])
        else:
            problems.append(f"missing tensor {name!r} (expected shape {list(spec.shape)})")

    if gguf:
        generated, files, headers = gguf.tokenizer, gguf.files, gguf.header_hashes
        tokenizer, config_hash = list(generated), gguf.config_hash
    else:
        generated, files = {}, checkpoint_files(src)
        tokenizer = [n for n in F.TOKENIZER_REQUIRED + F.TOKENIZER_OPTIONAL if (src / n).is_file()]
        headers, config_hash = {f.name: _header_hash(f) for f in files}, F.file_hash(src / "config.json")
    for n in F.TOKENIZER_REQUIRED:
        if n not in tokenizer:
            problems.append(f"{src}: no {n}; a bundle carries its tokenizer")
    source = {
        "path": str(src.resolve()),
        "config_blake2b": config_hash,
        "files": [
            {"name": f.name, "bytes": f.stat().st_size, "header_blake2b": headers[f.name]} for f in files
        ],
    }
    return ConversionPlan(
        src=src,
        arch=arch,
        args=args,
        config=config,
        options=options,
        layout=layout,
        rows=[rows[n] for n in sorted(rows)],
        resident=ordered,
        experts=experts,
        tokenizer=tokenizer,
        source_dtype=src_dtype,
        source=source,
        dense=dense,
        problems=problems,
        files=files,
        generated=generated,
    )


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def natural_key(name: str) -> tuple:
    """Sort key that orders numbers by value: layers.2 before layers.10."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


def dry_run_report(plan: ConversionPlan, tensors: bool = False) -> str:
    """The summary (tensor kinds, the bundle's layout and sizes) first; then, with ``tensors``,
    every source tensor's classification, in natural order (layer 2 before layer 10). Unknown
    tensors are always listed: they stop the conversion."""
    kinds = Counter(r.kind for r in plan.rows)
    lines = [
        f"{len(plan.rows)} source tensors in {plan.src}: "
        + ", ".join(f"{kinds[k]} {k}" for k in ("resident", "expert", "ignored", "unknown"))
    ]
    lay, args = plan.layout, plan.args
    q = quant_record(lay, 0.0)
    lines.append(
        f"bundle: {args.model_type}, experts {q.scheme} (group {q.group_size}, rotation {q.rotation}), "
        f"dense dtype {plan.options.dense_dtype or 'source'}, dense linear weights {plan.dense.label()}"
    )
    quantized = [r for r in plan.resident if r.scheme != DL.PLAIN]
    if quantized:
        plain = sum(math.prod(r.entry.shape) * ITEMSIZE[r.dtype] for r in quantized)
        lines.append(
            f"  {len(quantized)} dense weights quantized: {sum(r.nbytes for r in quantized):,d} bytes stored "
            f"(weights + scales; plain: {plain:,d})"
        )
    lines.append(
        f"  block_bytes {lay.block_bytes} ({lay.block_bytes // 4096} x 4096; payload {lay.payload_bytes}), "
        f"{len(plan.experts)} MoE layers x {args.num_experts} experts"
    )
    for c in lay.components:
        lines.append(
            f"    {c.name:<15} {c.dtype:<9} {str(list(c.shape)):<14} offset {c.offset:>9} bytes {c.nbytes}"
        )
    sizes = plan.sizes_by_category()
    for k, v in sizes.items():
        lines.append(f"  {k:<26} {v:>16,d} bytes  {_gib(v)}")
    total = sum(sizes.values())
    lines.append(f"  {'total':<26} {total:>16,d} bytes  {_gib(total)}")
    rows = sorted(
        plan.rows if tensors else [r for r in plan.rows if r.kind == "unknown"],
        key=lambda r: natural_key(r.name),
    )
    if rows:
        lines.append("tensors:" if tensors else "unknown tensors (-v lists every tensor):")
    elif not tensors:
        lines.append("(-v lists every tensor)")
    for r in rows:
        shape = ",".join(map(str, r.shape))
        lines.append(f"  {r.kind:<9} {r.detail:<36} {r.name} {r.dtype} [{shape}]")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Progress


class Progress:
    """Convert's feedback: on a terminal (or ``tty``) a tqdm bar of bytes with the rate, the ETA
    and the tensor or layer being written; otherwise plain log lines (one per finished file);
    nothing without a stream."""

    def __init__(self, total: int, stream: TextIO | None, tty: bool | None = None) -> None:
        from edgerun.progress import byte_bar, shown

        self.stream = stream
        self.tty = stream is not None and shown(stream, tty)
        self.bar = byte_bar(total, "convert", stream, self.tty) if self.tty else None

    def advance(self, n: int, what: str) -> None:
        if self.bar is not None:
            self.bar.set_description_str(what, refresh=False)
            self.bar.update(n)

    def log(self, msg: str) -> None:
        if self.stream is None:
            return
        msg = "edgerun convert: " + msg  # every message names its command (docs/cli.md)
        if self.bar is not None:
            self.bar.write(msg, file=self.stream)
        else:
            self.stream.write(msg + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# --------------------------------------------------------------------------------------------
# Reading the source


class Source:
    """Positional reads of checkpoint tensors (no mmap: RSS stays bounded)."""

    def __init__(self) -> None:
        self.fds: dict[Path, int] = {}
        self.gguf = G.GGUFTensors()

    def read(self, e: TensorEntry, offset: int = 0, nbytes: int | None = None) -> torch.Tensor:
        """Bytes [offset, offset + nbytes) of tensor ``e`` as a flat tensor of its dtype (a GGUF
        tensor's dequantized, in its canonical layout)."""
        n = e.nbytes - offset if nbytes is None else nbytes
        if isinstance(e, StackedEntry):  # the pieces' bytes that overlap [offset, offset + n)
            out, at = [], 0
            for piece in e.pieces:
                lo, hi = max(offset, at), min(offset + n, at + piece.nbytes)
                if lo < hi:
                    out.append(self.read(piece, lo - at, hi - lo))
                at += piece.nbytes
            return torch.cat(out) if out else torch.empty(0, dtype=DTYPES[e.dtype])
        if isinstance(e, G.GGUFEntry):
            return self.gguf.read(e, offset, n)
        fd = self.fds.get(e.file)
        if fd is None:
            fd = self.fds[e.file] = os.open(e.file, os.O_RDONLY)
        buf = bytearray(n)
        got = os.preadv(fd, [buf], e.start + offset) if n else 0
        if got != n:
            raise CheckpointError(f"{e.file}: short read of tensor {e.name!r} at byte {e.start + offset}")
        if n == 0:
            return torch.empty(0, dtype=DTYPES[e.dtype])
        return torch.frombuffer(buf, dtype=DTYPES[e.dtype])

    def expert(self, x: ExpertSource, e: int, args: ModelArgs) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert ``e`` of one layer in the checkpoint's dtype: (gate_up [2I, D], down [D, I])."""
        I, D = args.moe_intermediate_size, args.hidden_size
        if x.fused:
            gu, dn = x.fused
            n_gu, n_dn = gu.nbytes // args.num_experts, dn.nbytes // args.num_experts
            return (
                self.read(gu, e * n_gu, n_gu).view(2 * I, D),
                self.read(dn, e * n_dn, n_dn).view(D, I),
            )
        p = x.per_expert
        gate = self.read(p[(e, "gate_proj")]).view(I, D)
        up = self.read(p[(e, "up_proj")]).view(I, D)
        return torch.cat([gate, up]), self.read(p[(e, "down_proj")]).view(D, I)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()
        self.gguf.close()


# --------------------------------------------------------------------------------------------
# Writing


class _Writer:
    """A file written under ``name.tmp``, hashed as it is written, fsynced and renamed on commit
    (the directory fsynced after the rename)."""

    def __init__(self, final: Path) -> None:
        self.final = final
        self.tmp = final.with_name(final.name + ".tmp")
        self.f = open(self.tmp, "wb")  # noqa: SIM115 (closed in commit)
        self.hash = F.new_hash()
        self.size = 0

    def write(self, data: memoryview | bytes) -> None:
        self.f.write(data)
        self.hash.update(data)
        self.size += len(data)

    def commit(self) -> F.FileRecord:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        F.publish(self.tmp, self.final)
        return F.FileRecord(self.size, self.hash.hexdigest())


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


class Journal:
    """DST/.convert-journal.json: the conversion's key and each finished file's record."""

    def __init__(self, dst: Path, key: dict[str, Any], done: dict[str, dict[str, Any]]) -> None:
        self.path, self.key, self.done = dst / JOURNAL, key, done

    def finish(self, name: str, record: F.FileRecord, **extra: Any) -> None:
        self.done[name] = {"bytes": record.bytes, "blake2b": record.blake2b, **extra}
        self.save()

    def save(self) -> None:
        F.write_atomic(self.path, json.dumps({"key": self.key, "done": self.done}, indent=1).encode())


def _existing_ancestor(p: Path) -> Path:
    p = p.resolve()
    while not p.exists():
        p = p.parent
    return p


def _open_destination(plan: ConversionPlan, dst: Path, progress: Progress) -> Journal | F.Manifest:
    """A journal to continue (finished files re-hashed; damaged ones dropped), or the manifest of a
    bundle this same conversion already completed. Refuses a directory that holds anything else."""
    key = plan.key()
    if (dst / F.MANIFEST).exists():
        m = F.read_manifest(dst)
        same = (
            m.source == plan.source
            and quant_key(m.quant) == key["quant"]
            and m.dense_dtype == key["dense_dtype"]
            and m.dense_quant.scheme == plan.dense
        )
        if not same:
            raise F.BundleError(
                f"{dst}: already holds a complete bundle of another source or quantization "
                f"({m.source.get('path')}, {m.quant.scheme} group {m.quant.group_size} rotation "
                f"{m.quant.rotation}, dense {m.dense_quant.scheme.label()}); choose another directory or remove it"
            )
        return m
    if (dst / JOURNAL).exists():
        try:
            doc = json.loads((dst / JOURNAL).read_text())
            old_key, done = doc["key"], doc["done"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise F.BundleError(
                f"{dst / JOURNAL}: unreadable conversion journal ({exc}); remove {dst}"
            ) from exc
        if old_key != key:
            changed = sorted(k for k in key if key.get(k) != old_key.get(k))
            raise F.BundleError(
                f"{dst}: holds an unfinished conversion with a different {', '.join(changed)}; "
                f"rerun with the same source and options, or remove {dst}"
            )
        kept = {}
        for name, rec in done.items():
            path = dst / name
            if "blocks" in rec and "xxh3" not in rec:
                progress.log(
                    f"{name}: finished by an older edgerun, without block checksums; converting it again"
                )
            elif (
                path.is_file() and path.stat().st_size == rec["bytes"] and F.file_hash(path) == rec["blake2b"]
            ):
                kept[name] = rec
            else:
                progress.log(f"{name}: missing or changed since it was finished; converting it again")
        return Journal(dst, key, kept)
    if dst.exists() and any(dst.iterdir()):
        raise F.BundleError(
            f"{dst}: exists, is not empty and holds no unfinished conversion; refusing to write"
        )
    return Journal(dst, key, {})


@contextmanager
def destination(plan: ConversionPlan, dst: Path, progress: Progress) -> Iterator[Journal | F.Manifest]:
    """The destination, held for one writer: an exclusive lock on the directory itself (flock;
    released by the kernel if the process dies), so a second conversion into it is refused; then
    what ``_open_destination`` finds. For a conversion to do, the free space is checked and the
    journal saved before anything is written. A directory this call created is removed again if
    it is refused before writing."""
    created = not dst.exists()
    dst.mkdir(parents=True, exist_ok=True)
    fd = os.open(dst, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise F.BundleError(
            f"{dst}: another conversion is writing into it (it holds the directory's lock); wait for "
            "it to finish or choose another directory"
        ) from None
    started = False
    try:
        state = _open_destination(plan, dst, progress)
        if isinstance(state, Journal):
            _check_space(plan, dst, state)
            (dst / F.EXPERT_DIR).mkdir(parents=True, exist_ok=True)
            state.save()
            started = True
        yield state
    finally:
        os.close(fd)  # releases the lock
        if created and not started:
            shutil.rmtree(dst, ignore_errors=True)


def finish(plan: ConversionPlan, journal: Journal, src: Path, dst: Path) -> F.Manifest:
    """Copy the tokenizer files, write the manifest (which makes the bundle complete) and drop
    the journal."""
    files = {n: F.FileRecord(r["bytes"], r["blake2b"]) for n, r in journal.done.items()}
    for name in plan.tokenizer:
        w = _Writer(dst / name)
        w.write(plan.tokenizer_bytes(name))
        files[name] = w.commit()
    manifest = _manifest(plan, journal, files)
    F.write_atomic(dst / F.MANIFEST, manifest.dumps().encode())
    os.unlink(journal.path)
    return manifest


def _check_space(plan: ConversionPlan, dst: Path, journal: Journal) -> None:
    sizes = plan.file_sizes()
    total = sum(sizes.values()) + plan.manifest_estimate()
    done = sum(sizes[n] for n in journal.done if n in sizes)
    need = total - done
    root = _existing_ancestor(dst)
    tmp = sum(p.stat().st_size for p in dst.rglob("*.tmp")) if dst.exists() else 0
    free = shutil.disk_usage(root).free + tmp
    if need > free:
        raise F.BundleError(
            f"not enough free space for {dst}: the bundle needs {need:,d} more bytes ({_gib(need)}; "
            f"total {_gib(total)}, {_gib(done)} already converted) but {root} has {free:,d} bytes free "
            f"({_gib(free)})"
        )


def convert(
    src: str | Path,
    dst: str | Path,
    options: ConvertOptions,
    log: TextIO | None = None,
    tty: bool | None = None,
    on_block: Callable[[int, int], None] | None = None,
    providers: ProviderPolicy | None = None,
) -> F.Manifest:
    """Convert checkpoint ``src`` into bundle ``dst``; returns the manifest written. Progress goes
    to ``log`` (None: silent) as a bar when it is a terminal (or ``tty``), as lines otherwise.
    ``on_block(layer, expert)`` runs after each block is written (tests use it to kill a run).
    ``providers``: as for :func:`plan_conversion`."""
    src, dst = Path(src), Path(dst)
    plan = plan_conversion(src, options, providers)
    plan.check()
    todo = sum(r.entry.nbytes for r in plan.resident) + sum(x.nbytes for x in plan.experts)
    bar = Progress(todo, log, tty)
    with destination(plan, dst, bar) as state:
        if isinstance(state, F.Manifest):
            bar.log(f"{dst}: already a complete bundle of this source and quantization; nothing to do")
            return state
        journal = state
        if journal.done:
            kept = ", ".join(sorted(journal.done, key=natural_key))
            bar.log(
                f"{dst}: resuming an unfinished conversion: {len(journal.done)} file(s) finished before "
                f"and re-hashed intact are kept ({kept})"
            )
        reader = Source()
        try:
            if F.DENSE not in journal.done:
                _write_dense(plan, dst, journal, reader, bar)
            else:
                bar.advance(sum(r.entry.nbytes for r in plan.resident), "dense (done before)")
            for x in plan.experts:
                name = F.expert_file(x.layer)
                if name in journal.done and (
                    plan.layout.quant != "int4" or F.sidecar_file(x.layer) in journal.done
                ):
                    bar.advance(x.nbytes, f"layer {x.layer} (done before)")
                    continue
                _write_layer(plan, x, dst, journal, reader, bar, on_block)
        finally:
            reader.close()
        manifest = finish(plan, journal, src, dst)
    bar.close()
    bar.log(
        f"{dst}: bundle complete: {len(plan.experts)} expert files, block_bytes {plan.layout.block_bytes}, "
        f"pooled expert rel. RMS error {manifest.quant.rel_rmse:.6f}"
    )
    return manifest


def _write_dense(plan: ConversionPlan, dst: Path, journal: Journal, reader: Source, bar: Progress) -> None:
    w = _Writer(dst / F.DENSE)
    w.write(plan.dense_header)
    tensor_hashes, errors = {}, {}
    for r in plan.resident:
        if r.scheme != DL.PLAIN:
            errors[r.name] = _write_quantized(r, w, tensor_hashes, reader, bar)
            continue
        h = F.new_hash(F.PART_DIGEST)
        step = CHUNK // ITEMSIZE[r.entry.dtype] * ITEMSIZE[r.entry.dtype]
        for off in range(0, r.entry.nbytes, step):
            t = reader.read(r.entry, off, min(step, r.entry.nbytes - off))
            data = _bytes(t.to(DTYPES[r.dtype]))
            w.write(data)
            h.update(data)
            bar.advance(t.nbytes, f"dense {r.name}")
        tensor_hashes[r.name] = h.hexdigest()
    journal.finish(F.DENSE, w.commit(), tensors=tensor_hashes, quant=errors)
    quant = f", {len(errors)} quantized ({plan.dense.label()})" if errors else ""
    bar.log(f"{F.DENSE}: {len(plan.resident)} resident tensors{quant}, {_gib(w.size)}")


def _write_quantized(
    r: Resident, w: _Writer, hashes: dict[str, str], reader: Source, bar: Progress
) -> dict[str, float]:
    """Quantize one dense weight [R, C] in blocks of rows and write its parts (weight, scales,
    int4 global) in file order; only the scales wait in memory until the weight is written.
    Returns its squared error and norm (``err2``, ``ref2``), measured on the bytes written. int4
    reads the source twice: the global scale is the whole tensor's."""
    e = r.entry
    R, C = e.shape
    row_bytes = C * ITEMSIZE[e.dtype]
    rows = max(1, QCHUNK // row_bytes)

    def blocks() -> Iterator[torch.Tensor]:
        for r0 in range(0, R, rows):
            n = min(rows, R - r0)
            x = reader.read(e, r0 * row_bytes, n * row_bytes).view(n, C).float()
            if not torch.isfinite(x).all():
                bad = r0 + int((~torch.isfinite(x)).any(1).nonzero()[0])
                raise CheckpointError(f"{e.file}: tensor {e.name!r} has a non-finite value in row {bad}")
            yield x

    gscale = 0.0
    if r.scheme == "int4":
        gscale = int4_global_scale(max((int4_max_group_scale(x) for x in blocks()), default=0.0))
    h = F.new_hash(F.PART_DIGEST)
    scales, err2, ref2 = [], 0.0, 0.0
    for x in blocks():
        if r.scheme == "int4":
            q, s, _ = quantize_int4(x, r.group, gscale)
            got = dequantize_int4(q, s, gscale)
        else:
            q, s = quantize_int8(x, r.group)
            got = dequantize_int8(q, s)
        data = _bytes(q)
        w.write(data)
        h.update(data)
        scales.append(s)
        err2 += _sum_squares(got - x)
        ref2 += _sum_squares(x)
        bar.advance(x.shape[0] * row_bytes, f"dense {e.name}")
    hashes[r.name] = h.hexdigest()
    tail = [(r.name + DL.SCALES, torch.cat(scales))]
    if r.scheme == "int4":
        tail.append((r.name + DL.GLOBAL, torch.tensor([gscale], dtype=torch.float32)))
    for name, t in tail:
        data = _bytes(t)
        w.write(data)
        hashes[name] = F.part_hash(data)
    return {"err2": err2, "ref2": ref2}


def _write_layer(
    plan: ConversionPlan,
    x: ExpertSource,
    dst: Path,
    journal: Journal,
    reader: Source,
    bar: Progress,
    on_block: Callable[[int, int], None] | None,
) -> None:
    lay, args = plan.layout, plan.args
    name = F.expert_file(x.layer)
    w = _Writer(dst / name)
    sidecar = torch.zeros(args.num_experts, 2, dtype=torch.float32) if lay.quant == "int4" else None
    blocks, checksums, err2, ref2 = [], [], 0.0, 0.0
    for e in range(args.num_experts):
        gate_up, down = reader.expert(x, e, args)
        block, gscales = quantize_expert(lay, gate_up, down)
        data = _bytes(block)
        w.write(data)
        blocks.append(F.part_hash(data))
        checksums.append(F.block_checksum(data))
        if sidecar is not None:
            sidecar[e] = gscales
        # The error is measured on the bytes written, through the reader's own dequantizer.
        for ref, got in zip((gate_up, down), dequantize_block(lay, block, gscales, torch.float32)):
            ref = ref.float()
            err2 += _sum_squares(got - ref)
            ref2 += _sum_squares(ref)
        bar.advance(gate_up.nbytes + down.nbytes, f"layer {x.layer} expert {e}")
        if on_block is not None:
            on_block(x.layer, e)
    if sidecar is not None:
        s = _Writer(dst / F.sidecar_file(x.layer))
        s.write(_bytes(sidecar))
        journal.finish(F.sidecar_file(x.layer), s.commit())
    journal.finish(name, w.commit(), blocks=blocks, xxh3=checksums, err2=err2, ref2=ref2)
    bar.log(
        f"{name}: layer {x.layer}, {args.num_experts} blocks of {lay.block_bytes} bytes, "
        f"rel. RMS error {_rel(err2, ref2):.6f}"
    )


def _sum_squares(t: torch.Tensor) -> float:
    """fp64 sum of squares with numpy's single-threaded pairwise sum: the same bits whatever the
    thread count, so a resumed conversion writes the same manifest."""
    a = t.numpy().astype(np.float64)
    return float(np.sum(a * a))


def _rel(err2: float, ref2: float) -> float:
    return math.sqrt(err2 / ref2) if ref2 else 0.0


def _manifest(plan: ConversionPlan, journal: Journal, files: dict[str, F.FileRecord]) -> F.Manifest:
    lay, args = plan.layout, plan.args
    layers, err2, ref2 = [], 0.0, 0.0
    for x in plan.experts:
        rec = journal.done[F.expert_file(x.layer)]
        err2, ref2 = err2 + rec["err2"], ref2 + rec["ref2"]
        sidecar = None
        if lay.quant == "int4":
            sidecar = F.Sidecar(
                F.sidecar_file(x.layer), F.SIDECAR_DTYPE, (args.num_experts, 2), args.num_experts * 8
            )
        layers.append(
            F.LayerRecord(
                layer=x.layer,
                file=F.expert_file(x.layer),
                num_experts=args.num_experts,
                block_bytes=lay.block_bytes,
                components=lay.components,
                sidecar=sidecar,
                block_blake2b=tuple(rec["blocks"]),
                rel_rmse=_rel(rec["err2"], rec["ref2"]),
                block_xxh3=tuple(rec["xxh3"]),
            )
        )
    dense = [(name, dtype, shape) for r in plan.resident for name, dtype, shape, _ in r.parts]
    return F.Manifest(
        model_type=args.model_type,
        config=plan.config,
        dtype=DENSE_DTYPES.get(plan.options.dense_dtype or "", plan.source_dtype),
        inventory=F.inventory_fingerprint(dense),
        source=plan.source,
        quant=quant_record(lay, _rel(err2, ref2)),
        dense_file=F.DENSE,
        dense_dtype=plan.options.dense_dtype or "source",
        dense_tensors=journal.done[F.DENSE]["tensors"],
        layers=tuple(layers),
        tokenizer_files=tuple(plan.tokenizer),
        files=dict(sorted(files.items())),
        dense_quant=_dense_quant_record(plan, journal.done[F.DENSE].get("quant", {})),
    )


def _dense_quant_record(plan: ConversionPlan, errors: dict[str, dict[str, float]]) -> F.DenseQuantRecord:
    """Manifest ``dense.quant`` from each quantized weight's error (``err2``, ``ref2``)."""
    tensors = {
        r.name: F.DenseTensorQuant(r.scheme, r.group, _rel(errors[r.name]["err2"], errors[r.name]["ref2"]))
        for r in plan.resident
        if r.scheme != DL.PLAIN
    }
    err2 = sum(errors[n]["err2"] for n in tensors)
    ref2 = sum(errors[n]["ref2"] for n in tensors)
    d = plan.dense
    return F.DenseQuantRecord(d.linear, d.lm_head, d.linear_group, _rel(err2, ref2), tensors)
