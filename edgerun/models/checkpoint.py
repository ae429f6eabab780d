"""Load a Hugging Face checkpoint directory into an edgerun model.

Handles the layouts real checkpoints use: per-expert tensors (what ``save_pretrained`` writes),
experts fused on disk (``mlp.experts.gate_up_proj`` [E, 2I, D] / ``down_proj`` [E, D, I], as the
published Qwen3.5/3.6 checkpoints ship), the multimodal ``model.language_model.`` prefix with
vision tensors skipped, MTP tensors left unloaded (``load_mtp`` attaches the head where speculative
decoding asks for it), and sharded checkpoints with an index file.
The model is built on the meta device and every parameter is assigned once: no double allocation.
"""

from __future__ import annotations

import json
import logging
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

from edgerun.errors import CheckpointError
from edgerun.kernels.qweight import QWeight
from edgerun.models.args import ModelArgs, TensorSpec
from edgerun.models.layers import QLinear, Rotary
from edgerun.models.providers import ProviderPolicy, Resolution
from edgerun.models.registry import resolve_config
from edgerun.safetensors_io import DTYPES, MappedFiles, TensorEntry, read_header

log = logging.getLogger("edgerun.load")

FLOAT_DTYPES = ("F32", "F16", "BF16")
# Known groups that a text model does not load: name pattern -> group label for the load log.
IGNORED = (
    (re.compile(r"^(model\.)?visual\."), "vision"),
    (re.compile(r"^mtp\."), "mtp"),
    (re.compile(r"^model\.mtp\."), "mtp"),
    (re.compile(r"\.rotary_emb\.inv_freq$"), "rotary buffers"),
)
PER_EXPERT = re.compile(
    r"^((?:model|mtp)\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$"
)
FUSED = re.compile(r"^((?:model|mtp)\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
MTP_NAME = re.compile(r"^(model\.)?mtp\.")


@dataclass
class LoadReport:
    tensors: int = 0
    bytes: int = 0
    ignored: Counter = field(default_factory=Counter)
    expert_layout: str = "none"  # per-expert | fused | none
    prefix: str = "model."
    files: int = 0
    provider: Resolution | None = None  # which provider supplied the architecture

    def summary(self) -> str:
        ign = ", ".join(f"{n} {g}" for g, n in sorted(self.ignored.items())) or "none"
        return (
            f"loaded {self.tensors} tensors ({self.bytes / 2**20:.1f} MiB) from {self.files} file(s); "
            f"experts {self.expert_layout}; prefix {self.prefix!r}; skipped: {ign}"
        )


def _weight_map(ckpt: Path) -> tuple[Path, dict[str, str]] | None:
    """The sharded checkpoint's index (its path, tensor -> shard file name), or None unsharded."""
    index = ckpt / "model.safetensors.index.json"
    if not index.is_file():
        return None
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{index}: not a valid safetensors index (needs 'weight_map')") from exc
    return index, weight_map


def checkpoint_files(ckpt: Path) -> list[Path]:
    found = _weight_map(ckpt)
    if found is not None:
        index, weight_map = found
        files = sorted({ckpt / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index}: lists shard(s) that do not exist: {', '.join(missing)}")
        return files
    files = sorted(ckpt.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{ckpt}: no *.safetensors files (and no model.safetensors.index.json)")
    return files


def read_entries(ckpt: Path) -> tuple[dict[str, TensorEntry], int]:
    entries: dict[str, TensorEntry] = {}
    files = checkpoint_files(ckpt)
    for f in files:
        found, _ = read_header(f)
        for name, e in found.items():
            if name in entries:
                raise CheckpointError(f"tensor {name!r} appears in both {entries[name].file} and {f}")
            entries[name] = e
    index = _weight_map(ckpt)
    if index is not None:  # the index and the shards must agree: either one damaged is named
        path, weight_map = index
        for name, fname in weight_map.items():
            if name not in entries:
                raise CheckpointError(f"{path}: lists tensor {name!r} in {fname}, which does not hold it")
            if (ckpt / fname).resolve() != Path(entries[name].file).resolve():
                raise CheckpointError(
                    f"{path}: lists tensor {name!r} in {fname}, but it is in {Path(entries[name].file).name}"
                )
        for name, e in entries.items():
            if name not in weight_map:
                raise CheckpointError(f"{path}: does not list tensor {name!r} (in {Path(e.file).name})")
    return entries, len(files)


def canonical_name(name: str, mtp: bool = False) -> tuple[str | None, str | None]:
    """(canonical name, None) for a text-model tensor, or (None, group) for a known-ignored one.
    ``mtp``: the MTP head's tensors are taken too (as ``mtp.*``)."""
    if mtp and MTP_NAME.match(name):
        return name.removeprefix("model."), None
    for pattern, group in IGNORED:
        if pattern.search(name):
            return None, group
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model.") :], None
    if name.startswith("language_model.model."):
        return "model." + name[len("language_model.model.") :], None
    if name.startswith("language_model.lm_head."):
        return name[len("language_model.") :], None
    return name, None


@dataclass
class Plan:
    """Where each canonical parameter comes from."""

    direct: dict[str, TensorEntry] = field(default_factory=dict)
    per_expert: dict[str, dict[tuple[int, str], TensorEntry]] = field(default_factory=dict)
    report: LoadReport = field(default_factory=LoadReport)


def classify(entries: dict[str, TensorEntry], args: ModelArgs, mtp: bool = False) -> Plan:
    plan = Plan()
    layouts = set()
    for name, e in entries.items():
        canon, group = canonical_name(name, mtp)
        if canon is None:
            plan.report.ignored[group] += 1
            continue
        if name.startswith("model.language_model."):
            plan.report.prefix = "model.language_model."
        if canon == "lm_head.weight" and args.tie_word_embeddings:
            plan.report.ignored["tied lm_head"] += 1
            continue
        part = "mtp" if canon.startswith("mtp.") else "model"  # the MTP head may be laid out apart
        m = PER_EXPERT.match(canon)
        if m:
            layouts.add((part, "per-expert"))
            plan.per_expert.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = e
            continue
        if FUSED.match(canon):
            layouts.add((part, "fused"))
        plan.direct[canon] = e
    for part in ("model", "mtp"):
        if len({kind for p, kind in layouts if p == part}) > 1:
            raise CheckpointError(
                f"checkpoint mixes per-expert and fused expert tensors ({part}); expected one layout"
            )
    main = {kind for p, kind in layouts if p == "model"} or {kind for _, kind in layouts}
    plan.report.expert_layout = main.pop() if main else "none"
    return plan


def source_dtype(entries: dict[str, TensorEntry]) -> str:
    """The checkpoint's floating dtype code: the most common one among its tensors."""
    counts = Counter(e.dtype for e in entries.values() if e.dtype in FLOAT_DTYPES)
    return counts.most_common(1)[0][0] if counts else "F32"


def _float(e: TensorEntry, files: MappedFiles, label: str) -> torch.Tensor:
    if e.dtype not in FLOAT_DTYPES:
        raise CheckpointError(
            f"{e.file}: tensor {label!r} has dtype {e.dtype}; expected one of {', '.join(FLOAT_DTYPES)}"
        )
    return files.tensor(e)


def _check_shape(label: str, e: TensorEntry, want: tuple[int, ...]) -> None:
    if tuple(e.shape) != tuple(want):
        raise CheckpointError(f"{e.file}: tensor {label!r} has shape {list(e.shape)}, expected {list(want)}")


def _stack_experts(
    prefix: str, parts: dict[tuple[int, str], TensorEntry], args: ModelArgs, files: MappedFiles, dtype
) -> dict[str, torch.Tensor]:
    E, I, D = args.num_experts, args.moe_intermediate_size, args.hidden_size
    gate_up = torch.empty(E, 2 * I, D, dtype=dtype)
    down = torch.empty(E, D, I, dtype=dtype)
    want = {"gate_proj": (I, D), "up_proj": (I, D), "down_proj": (D, I)}
    for e, part in parts:
        if e >= E:
            raise CheckpointError(
                f"{parts[(e, part)].file}: tensor '{prefix}.{e}.{part}.weight' is expert {e}, "
                f"but num_experts is {E}"
            )
    for e in range(E):
        for part, shape in want.items():
            label = f"{prefix}.{e}.{part}.weight"
            entry = parts.get((e, part))
            if entry is None:
                raise CheckpointError(f"missing tensor {label!r}")
            _check_shape(label, entry, shape)
            src = _float(entry, files, label)
            if part == "gate_proj":
                gate_up[e, :I].copy_(src)
            elif part == "up_proj":
                gate_up[e, I:].copy_(src)
            else:
                down[e].copy_(src)
    return {f"{prefix}.gate_up_proj": gate_up, f"{prefix}.down_proj": down}


def set_parameter(model: nn.Module, name: str, value: torch.Tensor) -> None:
    *path, leaf = name.split(".")
    mod = model
    for p in path:
        mod = getattr(mod, p)
    setattr(mod, leaf, nn.Parameter(value, requires_grad=False))


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent), leaf, module)


def _quantized_linear(name: str, shape, q, old: nn.Module, files: MappedFiles, device) -> QLinear:
    """The QLinear of weight ``name`` [R, C] from its stored parts ``q`` (bundle.reader.DenseQuant,
    checked against the manifest when the bundle was opened); a bias already loaded is kept."""
    R, _ = shape
    row_scale = None
    if q.global_ is not None:
        row_scale = files.tensor(q.global_).reshape(1).to(torch.float32).expand(R).contiguous()
    w = QWeight(
        q.scheme,
        files.tensor(q.weight).to(device),
        files.tensor(q.scales).reshape(R, -1).to(device),
        None if row_scale is None else row_scale.to(device),
        q.group,
    )
    try:
        w.check(name)
    except ValueError as exc:
        raise CheckpointError(f"{q.weight.file}: {exc}") from exc
    bias = getattr(old, "bias", None)
    return QLinear(w, None if bias is None or bias.is_meta else bias)


def load_model(
    ckpt: str | Path,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    experts: bool = True,
    providers: ProviderPolicy | None = None,
) -> tuple[nn.Module, ModelArgs, LoadReport]:
    """Build the model for ``ckpt`` and load its weights. ``dtype`` None keeps the checkpoint's
    floating dtype (the most common one). ``experts=False`` leaves routed experts unloaded (on the
    meta device) for a caller that streams them. ``providers``: which installed architecture
    providers may serve the checkpoint (default: built-in architectures only)."""
    ckpt = Path(ckpt)
    arch, args, resolution = resolve_config(ckpt, providers)
    entries, n_files = read_entries(ckpt)
    model, report = load_entries(arch, args, entries, dtype=dtype, device=device, experts=experts)
    report.files = n_files
    report.provider = resolution
    log.info("%s: %s", ckpt, report.summary())
    return model, args, report


def load_entries(
    arch: ModuleType,
    args: ModelArgs,
    entries: dict[str, TensorEntry],
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    experts: bool = True,
    quantized: dict | None = None,
) -> tuple[nn.Module, LoadReport]:
    """``quantized`` (a bundle's ``dense_quant``: canonical weight name -> its stored parts):
    those linear weights load as they are stored, into QLinear modules, never dequantized;
    ``entries`` then holds the other tensors."""
    quantized = quantized or {}
    plan = classify(entries, args)
    specs = {s.name: s for s in arch.tensor_specs(args)}
    if dtype is None:
        dtype = DTYPES[source_dtype(entries)]

    unknown = sorted(n for n in plan.direct if n not in specs)
    if unknown:
        e = plan.direct[unknown[0]]
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        raise CheckpointError(f"{e.file}: unknown tensor {e.name!r}{more} for model_type {args.model_type!r}")
    stacked_prefixes = {n.rsplit(".", 1)[0] for n, s in specs.items() if s.category == "experts"}
    stray = sorted(set(plan.per_expert) - stacked_prefixes)
    if stray:
        raise CheckpointError(f"unknown tensor group {stray[0]!r}: that layer has no routed experts")

    files = MappedFiles()
    with torch.device("meta"):
        model = arch.Model(args)
    report = plan.report
    skip = {"experts"} if not experts else set()
    _assign(model, specs, plan, args, files, dtype, device, report, quantized, skip)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.fuse()
    model.rotary = Rotary(args.rotary_dim, args.rope_theta).to(device)
    model.eval()
    return model, report


def _assign(
    model: nn.Module,
    specs: dict[str, TensorSpec],
    plan: Plan,
    args: ModelArgs,
    files: MappedFiles,
    dtype: torch.dtype,
    device,
    report: LoadReport,
    quantized: dict,
    skip: set[str],
) -> None:
    """Every parameter ``specs`` lists (but those of the categories in ``skip``), from ``plan``:
    quantized weights as stored, per-expert tensors stacked, the rest cast to ``dtype``."""
    from edgerun.progress import iterate

    for name, spec in iterate(specs.items(), len(specs), "load weights", "tensor"):
        if spec.category in skip:
            continue
        prefix = name.rsplit(".", 1)[0]
        if name in quantized:
            module = _quantized_linear(
                name, spec.shape, quantized[name], model.get_submodule(prefix), files, device
            )
            _set_module(model, prefix, module)
            report.tensors += 1
            report.bytes += sum(t.nbytes for t in module.qweight().tensors())
            continue
        if name in plan.direct:
            e = plan.direct[name]
            _check_shape(e.name, e, spec.shape)
            value = _float(e, files, e.name).to(dtype)
        elif prefix in plan.per_expert:
            stacked = _stack_experts(prefix, plan.per_expert.pop(prefix), args, files, dtype)
            for n, v in stacked.items():
                set_parameter(model, n, v.to(device))
                report.tensors += 1
                report.bytes += v.nbytes
            continue
        elif not model.get_parameter(name).is_meta:
            continue  # the other half of a stacked expert pair
        else:
            raise CheckpointError(f"missing tensor {name!r} (expected shape {list(spec.shape)})")
        set_parameter(model, name, value.to(device))
        report.tensors += 1
        report.bytes += value.nbytes


def load_mtp(
    model: nn.Module,
    args: ModelArgs,
    entries: dict[str, TensorEntry],
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    source: str = "the checkpoint",
) -> LoadReport:
    """Attach the MTP head (``model.mtp``, models/base.py MtpHead) from ``entries``: an HF
    checkpoint's tensors or a bundle's dense ones. Refused, naming what is missing, when the
    config declares no MTP layer or ``source`` holds no (or not all) of its tensors."""
    from edgerun.models.base import MtpHead
    from edgerun.models.inventory import mtp_specs

    specs = {s.name: s for s in mtp_specs(args)}
    if not specs:
        raise CheckpointError(f"{source}: the config declares no MTP layer (mtp_num_hidden_layers is 0)")
    own = {n: e for n, e in entries.items() if MTP_NAME.match(n)}
    if not own:
        raise CheckpointError(
            f"{source}: holds no MTP tensors (mtp.*); the config declares {len(specs)} of them"
        )
    plan = classify(own, args, mtp=True)
    unknown = sorted(n for n in plan.direct if n not in specs)
    if unknown:
        raise CheckpointError(f"{plan.direct[unknown[0]].file}: unknown MTP tensor {unknown[0]!r}")
    if dtype is None:
        dtype = DTYPES[source_dtype(own)]
    holder = nn.Module()
    with torch.device("meta"):
        holder.mtp = MtpHead(args)
    report = LoadReport()
    _assign(holder, specs, plan, args, MappedFiles(), dtype, device, report, {}, set())
    holder.mtp.fuse()
    model.mtp = holder.mtp.eval()
    return report
