"""Open a bundle: validate it cheaply (before any tensor is allocated), read single expert
blocks, and load the whole model with its experts resident.

``Bundle.open`` checks the manifest (format, version, schema), that its model config yields the
block layout it records, that ``dense.safetensors`` holds exactly the resident tensors that config
and the manifest's dense quantization imply (a quantized weight's parts with their dtypes and
shapes), and every file's size: a broken or mismatched bundle is refused with a message naming the
file and the offset or key. Whole-file hashes are `verify --deep`'s job (they read every byte);
every expert block read is checked against its ``block_xxh3`` checksum before use, a sidecar
against its file hash.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

from edgerun.bundle import dense_layout as DL
from edgerun.bundle import format as F
from edgerun.bundle.layout import BlockLayout, expert_block_layout
from edgerun.bundle.quant import dequantize_block
from edgerun.errors import ChecksumError, EdgerunError, StorageError
from edgerun.models import args as A
from edgerun.models.args import ModelArgs
from edgerun.models.checkpoint import LoadReport, load_entries, set_parameter
from edgerun.models.inventory import mtp_specs
from edgerun.models.providers import ProviderError, ProviderPolicy, Resolution
from edgerun.models.registry import resolve_config
from edgerun.safetensors_io import DTYPES, TensorEntry, read_header

__all__ = ["Bundle", "BundleError", "DenseQuant", "dequantize_block", "load_bundle_model"]
BundleError = F.BundleError


@dataclass(frozen=True)
class DenseQuant:
    """Where one quantized resident weight [R, C] is in dense.safetensors (format v2), as
    ``edgerun.bundle.quant`` reads it back: int8: ``weight`` I8 [R, C], ``scales`` F32 [R, C /
    group], value = q * scale; int4: ``weight`` U8 [R, C / 2] (column 2j in the low nibble of byte
    j), ``scales`` U8 [R, C / group] (e4m3 codes), ``global_`` F32 [1], value = q * (e4m3(code) *
    global) (``dequantize_int4``)."""

    scheme: str  # int8 | int4
    group: int  # columns per scale: C for int8 per row (the manifest's group_size 0)
    weight: TensorEntry
    scales: TensorEntry
    global_: TensorEntry | None  # int4 only


@dataclass
class Bundle:
    root: Path
    manifest: F.Manifest
    arch: ModuleType
    args: ModelArgs
    dense: dict[str, TensorEntry]  # dense.safetensors header: every stored tensor by its stored name
    layouts: dict[int, BlockLayout]  # MoE layer -> block layout
    provider: Resolution | None = None  # which provider supplied the architecture
    dense_quant: dict[str, DenseQuant] = field(default_factory=dict)  # canonical weight name; {}: all plain

    @classmethod
    def open(cls, root: str | Path, *, providers: ProviderPolicy | None = None) -> Bundle:
        """Validate ``root`` (cheap checks only: no payload is read) and return the bundle.
        ``providers``: which installed architecture providers may serve the bundle's model_type
        (default: built-in architectures only)."""
        root = Path(root)
        m = F.read_manifest(root)
        mpath = root / F.MANIFEST
        try:
            arch, args, resolution = resolve_config(m.config, providers)
        except ProviderError as exc:  # the user's policy refused it: the bundle is not at fault
            raise ProviderError(f"{mpath}: {exc}") from exc
        except EdgerunError as exc:
            raise BundleError(f"{mpath}: key 'model_config' is not a usable model config: {exc}") from exc
        if args.model_type != m.model_type:
            raise BundleError(
                f"{mpath}: key 'model.model_type' is {m.model_type!r} but its config describes {args.model_type!r}"
            )
        _check_paths(root, m)
        _check_tokenizer(root, m)
        layouts = {rec.layer: _check_layer_record(mpath, m, rec, args) for rec in m.layers}
        if sorted(layouts) != list(args.moe_layers):
            raise BundleError(
                f"{mpath}: key 'layers' lists MoE layers {sorted(layouts)}, but the model config has "
                f"MoE layers {list(args.moe_layers)}"
            )
        dense, dense_quant = _check_dense(root, m, arch, args)
        for rec in m.layers:
            _check_expert_files(root, rec)
        _check_file_sizes(root, m)
        return cls(root, m, arch, args, dense, layouts, resolution, dense_quant)

    @property
    def unchecked(self) -> str | None:
        """Why some expert blocks are read without a checksum (an older bundle), or None."""
        layers = [r.layer for r in self.manifest.layers if r.block_xxh3 is None]
        if not layers:
            return None
        return (
            f"{self.root / F.MANIFEST} has no block_xxh3 for {len(layers)} of {len(self.manifest.layers)} MoE "
            "layers (an older bundle): their expert blocks are used unchecked; convert it again to check them"
        )

    def expert_path(self, layer: int) -> Path:
        return self.root / self.manifest.layer(layer).file

    def block_offset(self, layer: int, expert: int) -> int:
        rec = self.manifest.layer(layer)
        if not 0 <= expert < rec.num_experts:
            raise IndexError(f"expert {expert} is out of range for layer {layer} ({rec.num_experts} experts)")
        return expert * rec.block_bytes

    def check_block(self, layer: int, expert: int, data: bytes | memoryview) -> bool:
        """Whether ``data`` was checked (False: the manifest has no checksums for ``layer``, an
        older bundle); a block that does not match its checksum is refused, named."""
        want = self.manifest.layer(layer).block_xxh3
        if want is None:
            return False
        got = F.block_checksum(data)
        if got != want[expert]:
            offset = self.block_offset(layer, expert)
            raise ChecksumError(
                f"{self.expert_path(layer)}: layer {layer} expert {expert}'s block (bytes [{offset}, "
                f"{offset + len(data)})) fails its checksum: xxh3 {got}, the manifest records {want[expert]}"
            )
        return True

    def read_block(self, layer: int, expert: int) -> torch.Tensor:
        """One expert's block (uint8 [block_bytes]): one read at ``expert * block_bytes``, checked
        against its checksum; a mismatch is read once more from the device before it is refused."""
        try:
            buf = self._read_block(layer, expert)
            self.check_block(layer, expert, buf)
        except ChecksumError:
            buf = self._read_block(layer, expert, again=True)
            self.check_block(layer, expert, buf)
        return torch.frombuffer(buf, dtype=torch.uint8)

    def _read_block(self, layer: int, expert: int, again: bool = False) -> bytearray:
        path, size = self.expert_path(layer), self.layouts[layer].block_bytes
        offset = self.block_offset(layer, expert)
        buf = bytearray(size)
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                if again:  # from the device, not the page cache
                    os.posix_fadvise(fd, offset, size, os.POSIX_FADV_DONTNEED)
                got = os.preadv(fd, [buf], offset)
            finally:
                os.close(fd)
        except OSError as exc:
            raise StorageError(f"{path}: reading expert {expert}'s block at offset {offset}: {exc}") from exc
        if got != size:
            raise StorageError(
                f"{path}: short read of expert {expert} at offset {offset}: {got} of {size} bytes"
            )
        return buf

    def global_scales(self, layer: int) -> torch.Tensor | None:
        """The layer's per-tensor scales, fp32 [E, 2] (gate_up, down), checked against the
        sidecar's file hash; None without a sidecar."""
        rec = self.manifest.layer(layer)
        if rec.sidecar is None:
            return None
        path = self.root / rec.sidecar.file
        raw = bytearray(path.read_bytes())
        h = F.new_hash()
        h.update(raw)
        if h.hexdigest() != self.manifest.files[rec.sidecar.file].blake2b:
            raise ChecksumError(
                f"{path}: layer {layer}'s sidecar ({len(raw)} bytes) does not match its {F.HASH} in "
                f"{F.MANIFEST} (key 'files[{rec.sidecar.file!r}]')"
            )
        return torch.frombuffer(raw, dtype=torch.float32).view(rec.sidecar.shape)

    def expert(
        self, layer: int, expert: int, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [2I, D], down [D, I]) of one expert, read and dequantized."""
        scales = self.global_scales(layer)
        return dequantize_block(
            self.layouts[layer],
            self.read_block(layer, expert),
            None if scales is None else scales[expert],
            dtype,
        )


def load_bundle_model(
    root: str | Path | Bundle,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    experts: bool = True,
    *,
    providers: ProviderPolicy | None = None,
) -> tuple[nn.Module, ModelArgs, LoadReport]:
    """The model ``load_model`` would build, from a bundle: dense weights from dense.safetensors,
    routed experts dequantized from their blocks (``dequantize_block``, the streaming path's own
    dequantizer). ``dtype`` None: the source checkpoint's dtype. ``experts=False`` leaves them on
    the meta device for a caller that streams them. The bundle is validated before anything is
    allocated. ``providers`` applies when ``root`` is a path (an open Bundle already resolved)."""
    b = root if isinstance(root, Bundle) else Bundle.open(root, providers=providers)
    dtype = dtype or DTYPES[b.manifest.dtype]
    # quantized weights load as stored (QLinear modules), the other tensors as today
    parts = {e.name for q in b.dense_quant.values() for e in (q.weight, q.scales, q.global_) if e is not None}
    plain = {n: e for n, e in b.dense.items() if n not in parts}
    model, report = load_entries(
        b.arch, b.args, plain, dtype=dtype, device=device, experts=False, quantized=b.dense_quant
    )
    report.files = 1 + len(b.manifest.layers)
    report.provider = b.provider
    report.expert_layout = f"bundle {b.manifest.quant.scheme}, dense {b.manifest.dense_quant.scheme.label()}"
    if experts:
        from edgerun.progress import iterate

        E, I, D = b.args.num_experts, b.args.moe_intermediate_size, b.args.hidden_size
        for layer in iterate(b.args.moe_layers, len(b.args.moe_layers), "dequantize experts", "layer"):
            gate_up = torch.empty(E, 2 * I, D, dtype=dtype)
            down = torch.empty(E, D, I, dtype=dtype)
            scales = b.global_scales(layer)
            for e in range(E):
                gu, dn = dequantize_block(
                    b.layouts[layer], b.read_block(layer, e), None if scales is None else scales[e], dtype
                )
                gate_up[e].copy_(gu)
                down[e].copy_(dn)
            prefix = f"model.layers.{layer}.mlp.experts"
            for name, value in ((f"{prefix}.gate_up_proj", gate_up), (f"{prefix}.down_proj", down)):
                set_parameter(model, name, value.to(device))
                report.tensors += 1
                report.bytes += value.nbytes
    return model, b.args, report


# --------------------------------------------------------------------------------------------
# Cheap checks (Bundle.open), in the order a damaged bundle is most usefully described


def _check_paths(root: Path, m: F.Manifest) -> None:
    """Every path the manifest names stays inside the bundle, also through a symbolic link (so
    nothing outside it is read, or passes for part of it), and no file serves two roles."""
    roles = [m.dense_file, *m.tokenizer_files]
    for rec in m.layers:
        roles.append(rec.file)
        if rec.sidecar is not None:
            roles.append(rec.sidecar.file)
    inside = root.resolve()
    seen: dict[Path, str] = {}
    for i, n in enumerate([*roles, *m.files]):
        p = Path(n)
        if p.is_absolute() or ".." in p.parts or n == F.MANIFEST:
            raise BundleError(f"{root / F.MANIFEST}: path {n!r} does not name a file inside the bundle")
        real = (root / p).resolve()
        if not real.is_relative_to(inside):
            raise BundleError(
                f"{root / F.MANIFEST}: path {n!r} leads outside the bundle (to {real}, through a symbolic link)"
            )
        if i < len(roles):  # ``files`` lists them all again, on purpose
            if real in seen:
                twice = f"{n!r} twice" if n == seen[real] else f"{n!r} and {seen[real]!r}, one file,"
                raise BundleError(
                    f"{root / F.MANIFEST}: names {twice} for two roles (each layer's experts and scales, "
                    "the dense file and each tokenizer file are files of their own)"
                )
            seen[real] = n


def _check_tokenizer(root: Path, m: F.Manifest) -> None:
    for n in F.TOKENIZER_REQUIRED:
        if n not in m.tokenizer_files:
            raise BundleError(f"{root / F.MANIFEST}: key 'tokenizer.files' does not list {n}: no tokenizer")
    for n in m.tokenizer_files:
        if not (root / n).is_file():
            raise BundleError(f"missing tokenizer file {root / n} (listed in {F.MANIFEST} 'tokenizer.files')")


def _check_layer_record(mpath: Path, m: F.Manifest, rec: F.LayerRecord, args: ModelArgs) -> BlockLayout:
    """block_bytes aligned; the recorded layout is the one the config and quantization give."""
    where = f"layers[layer {rec.layer}]"
    if not F.is_aligned(rec.block_bytes):
        raise BundleError(
            f"{mpath}: key '{where}.block_bytes' is {rec.block_bytes}, not a positive multiple of 4096: "
            f"blocks of {rec.file} would not be O_DIRECT-aligned"
        )
    try:
        want = expert_block_layout(args, m.quant.scheme, m.quant.group_size, m.quant.rotation)
    except EdgerunError as exc:
        raise BundleError(f"{mpath}: key 'quant' does not fit the model config: {exc}") from exc
    if rec.num_experts != args.num_experts:
        raise BundleError(
            f"{mpath}: key '{where}.num_experts' is {rec.num_experts}, the model config has {args.num_experts}"
        )
    if rec.block_bytes != want.block_bytes:
        raise BundleError(
            f"{mpath}: key '{where}.block_bytes' is {rec.block_bytes}, but {m.quant.scheme} "
            f"(group {m.quant.group_size}) blocks of this model are {want.block_bytes} bytes"
        )
    if rec.components != want.components:
        got = {c.name: c for c in rec.components}
        for c in want.components:
            if got.get(c.name) != c:
                raise BundleError(
                    f"{mpath}: key '{where}.components' records {c.name} as {got.get(c.name)}, "
                    f"the format gives {c}"
                )
        raise BundleError(f"{mpath}: key '{where}.components' lists components the format does not have")
    if len(rec.block_blake2b) != rec.num_experts:
        raise BundleError(
            f"{mpath}: key '{where}.block_blake2b' has {len(rec.block_blake2b)} hashes for {rec.num_experts} blocks"
        )
    sums = rec.block_xxh3
    if sums is not None and (
        len(sums) != rec.num_experts or not all(isinstance(h, str) and len(h) == 16 for h in sums)
    ):
        raise BundleError(
            f"{mpath}: key '{where}.block_xxh3' must hold {rec.num_experts} checksums of 16 hex digits, "
            f"one a block; it has {len(sums)}"
        )
    want_sidecar = m.quant.scheme == "int4"
    if want_sidecar != (rec.sidecar is not None):
        raise BundleError(
            f"{mpath}: key '{where}.sidecar' is {'missing' if want_sidecar else 'present'}; "
            f"{m.quant.scheme} {'needs' if want_sidecar else 'has no'} per-tensor scales"
        )
    if rec.sidecar is not None:
        shape, nbytes = (args.num_experts, 2), args.num_experts * 2 * 4
        if rec.sidecar.dtype != F.SIDECAR_DTYPE or rec.sidecar.shape != shape or rec.sidecar.nbytes != nbytes:
            raise BundleError(
                f"{mpath}: key '{where}.sidecar' is {rec.sidecar}; expected fp32 {list(shape)} ({nbytes} bytes)"
            )
    return want


def _check_dense(
    root: Path, m: F.Manifest, arch: ModuleType, args: ModelArgs
) -> tuple[dict[str, TensorEntry], dict[str, DenseQuant]]:
    """dense.safetensors holds exactly the resident tensors the manifest's config implies: each
    plain one under its name with its shape, each quantized one (``dense.quant``) as its parts
    with the dtypes and shapes its scheme and group give."""
    path = root / m.dense_file
    if not path.is_file():
        raise BundleError(f"missing {path} (the bundle's resident weights)")
    try:
        entries, _ = read_header(path)
    except EdgerunError as exc:
        raise BundleError(str(exc)) from exc
    specs = [s for s in arch.tensor_specs(args) if s.category != A.EXPERT]
    if "mtp.fc.weight" in entries:  # convert carried the MTP head: all of it
        specs += mtp_specs(args)
    shapes = {s.name: s.shape for s in specs}
    quant = _check_dense_quant(root / F.MANIFEST, m.dense_quant, specs)
    other = f"{root / F.MANIFEST} describes another model than {path}"
    for spec in specs:
        if spec.name in quant:
            _check_quantized_parts(path, spec, *quant[spec.name], entries)
            continue
        e = entries.get(spec.name)
        if e is None:
            raise BundleError(
                f"{other}: the manifest's config implies tensor {spec.name!r}, which the file lacks"
            )
        if tuple(e.shape) != tuple(spec.shape):
            raise BundleError(
                f"{other}: tensor {spec.name!r} is {list(e.shape)} in the file, {list(spec.shape)} by the manifest's config"
            )
    parts = {p.name for n, (sch, g) in quant.items() for p in DL.quantized_parts(n, shapes[n], sch, g)}
    extra = sorted(set(entries) - set(shapes) - parts)
    if extra:
        base = extra[0].removesuffix(DL.SCALES).removesuffix(DL.GLOBAL)
        if base in shapes:
            raise BundleError(
                f"{path}: holds tensor {extra[0]!r}, a quantized weight's part, but {root / F.MANIFEST} key "
                f"'dense.quant.tensors' does not record {base!r} as quantized"
            )
        raise BundleError(f"{other}: the file holds tensor {extra[0]!r}, which the manifest's config lacks")
    found = F.inventory_fingerprint([(e.name, e.dtype, e.shape) for e in entries.values()])
    if found != m.inventory:
        raise BundleError(
            f"{other}: key 'model.inventory' is {m.inventory[:16]}..., the file's tensor inventory "
            f"(names, dtypes, shapes) hashes to {found[:16]}..."
        )
    if set(m.dense_tensors) != set(entries):
        raise BundleError(f"{root / F.MANIFEST}: key 'dense.tensors' does not list the file's tensors")
    out = {
        name: DenseQuant(
            scheme,
            group or shapes[name][1],
            entries[name],
            entries[name + DL.SCALES],
            entries.get(name + DL.GLOBAL),
        )
        for name, (scheme, group) in quant.items()
    }
    return entries, out


def _check_dense_quant(
    mpath: Path, q: F.DenseQuantRecord, specs: list[A.TensorSpec]
) -> dict[str, tuple[str, int]]:
    """``dense.quant`` against the model: every name it lists is a linear weight of the model of
    the role its scheme is for, its group divides the weight's columns, and every weight of a
    quantized role is listed. Returns name -> (scheme, group)."""
    by_name = {s.name: s for s in specs}
    out = {}
    for name, t in q.tensors.items():
        spec = by_name.get(name)
        if spec is None or DL.role(name, spec.shape) is None:
            what = "a tensor the model lacks" if spec is None else "not a linear weight --dense quantizes"
            raise BundleError(
                f"{mpath}: key 'dense.quant.tensors' lists {name!r}: {what} (quantized weights are the "
                "attention, DeltaNet, shared-expert and dense-MLP projections, and an untied lm_head)"
            )
        try:
            DL.check_weight(name, spec.shape, t.scheme, t.group_size)
        except EdgerunError as exc:
            raise BundleError(f"{mpath}: key 'dense.quant.tensors[{name!r}]': {exc}") from exc
        out[name] = (t.scheme, t.group_size)
    for spec in specs:
        which = DL.role(spec.name, spec.shape)
        scheme = None if which is None else q.scheme.for_role(which)[0]
        if scheme not in (None, DL.PLAIN) and spec.name not in out:
            raise BundleError(
                f"{mpath}: key 'dense.quant.{which}' is {scheme!r}, but 'dense.quant.tensors' does not list "
                f"the model's {which} weight {spec.name!r}"
            )
    if q.lm_head != DL.PLAIN and DL.LM_HEAD_WEIGHT not in by_name:
        raise BundleError(
            f"{mpath}: key 'dense.quant.lm_head' is {q.lm_head!r}, but the model ties its lm_head to the "
            "embedding table, which stays plain"
        )
    return out


def _check_quantized_parts(
    path: Path, spec: A.TensorSpec, scheme: str, group: int, entries: dict[str, TensorEntry]
) -> None:
    """Each stored part of one quantized weight is in the file with its dtype and shape."""
    for p in DL.quantized_parts(spec.name, spec.shape, scheme, group):
        e = entries.get(p.name)
        want = f"{p.dtype} {list(p.shape)}"
        why = f"the manifest records {spec.name!r} {list(spec.shape)} as {DL.scheme_label(scheme, group)}"
        if e is None:
            raise BundleError(f"{path}: lacks tensor {p.name!r} ({want}): {why}")
        if e.dtype != p.dtype or tuple(e.shape) != p.shape:
            raise BundleError(
                f"{path}: tensor {p.name!r} is {e.dtype} {list(e.shape)}, expected {want}: {why}"
            )


def _check_expert_files(root: Path, rec: F.LayerRecord) -> None:
    path = root / rec.file
    if not path.is_file():
        raise BundleError(f"missing expert file {path} (layer {rec.layer})")
    size, want = path.stat().st_size, rec.file_bytes
    if size < want:
        e = size // rec.block_bytes
        raise BundleError(
            f"{path}: truncated expert file: {size} bytes, expected {want} ({rec.num_experts} blocks of "
            f"{rec.block_bytes}); expert {e}'s block at offset {e * rec.block_bytes} is incomplete"
        )
    if size > want:
        raise BundleError(
            f"{path}: {size - want} bytes past the last block (offset {want}); expected {want} bytes"
        )
    if rec.sidecar is not None:
        sc = root / rec.sidecar.file
        if not sc.is_file():
            raise BundleError(f"missing sidecar {sc} (layer {rec.layer}'s per-tensor scales)")
        n = sc.stat().st_size
        if n != rec.sidecar.nbytes:
            raise BundleError(
                f"{sc}: {'truncated' if n < rec.sidecar.nbytes else 'oversized'} sidecar: {n} bytes, expected "
                f"{rec.sidecar.nbytes} ({rec.num_experts} experts x 2 fp32 global scales); "
                f"the first bad offset is {min(n, rec.sidecar.nbytes)}"
            )


def _check_file_sizes(root: Path, m: F.Manifest) -> None:
    """Every data file has a hash record, and every recorded file exists with its recorded size."""
    data = [m.dense_file, *m.tokenizer_files]
    for rec in m.layers:
        data.append(rec.file)
        if rec.sidecar is not None:
            data.append(rec.sidecar.file)
    for n in data:
        if n not in m.files:
            raise BundleError(f"{root / F.MANIFEST}: key 'files' has no record (size, hash) for {n}")
    for n, rec in m.files.items():
        p = root / n
        if not p.is_file():
            raise BundleError(f"missing {p} (listed in {F.MANIFEST} 'files')")
        size = p.stat().st_size
        if size != rec.bytes:
            raise BundleError(
                f"{p}: {size} bytes, {F.MANIFEST} records {rec.bytes} (key 'files[{n!r}].bytes')"
            )
