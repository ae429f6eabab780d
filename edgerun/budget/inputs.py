"""What the planner plans: a model's arguments, tensor inventory and expert block sizes, read from
a bare ``config.json``, an HF checkpoint directory or an edgerun bundle. Only metadata is read:
a user can plan before downloading the weights."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from edgerun.budget.planner import ExpertSource, expert_source_from_layout
from edgerun.bundle import dense_layout as DL
from edgerun.bundle import gguf_source
from edgerun.bundle.layout import ALIGN
from edgerun.errors import ConfigError
from edgerun.models import args as A
from edgerun.models.args import ModelArgs, TensorSpec
from edgerun.models.providers import ProviderPolicy
from edgerun.models.registry import architecture


@dataclass(frozen=True)
class ModelInput:
    name: str
    args: ModelArgs
    specs: tuple[TensorSpec, ...]
    experts: ExpertSource
    notes: tuple[str, ...]
    dense: DL.DenseScheme | None = None  # a bundle's dense quantization (its manifest's); None: not a bundle


def _from_config(
    cfg: dict[str, Any],
    source: str,
    name: str,
    quant: str,
    group: int | None,
    providers: ProviderPolicy | None,
) -> ModelInput:
    arch = architecture(cfg.get("model_type"), source, providers)
    args = arch.model_args(cfg, source)
    experts = expert_source_from_layout(args, quant, group)
    notes = []
    if args.mtp_num_hidden_layers:
        notes.append(f"MTP head ({args.mtp_num_hidden_layers} layer) is not loaded and not planned")
    if isinstance(cfg.get("vision_config"), dict):
        notes.append("vision tower is not loaded and not planned (text only)")
    return ModelInput(name, args, tuple(arch.tensor_specs(args)), experts, tuple(notes))


def from_config_file(
    path: str | Path,
    quant: str = "int4",
    group_size: int | None = None,
    providers: ProviderPolicy | None = None,
) -> ModelInput:
    """A bare ``config.json`` (or any JSON file holding an HF config). ``providers``: which
    installed architecture providers may serve its ``model_type`` (default: built-ins only)."""
    path = Path(path)
    cfg = A.read_config(path)
    name = path.parent.name if path.name == "config.json" else path.stem
    return _from_config(cfg, str(path), name, quant, group_size, providers)


def from_checkpoint(
    path: str | Path,
    quant: str = "int4",
    group_size: int | None = None,
    providers: ProviderPolicy | None = None,
) -> ModelInput:
    """An HF checkpoint directory (only its ``config.json`` is read) or a GGUF file (only its
    header: metadata and tensor shapes)."""
    path = Path(path)
    if gguf_source.is_gguf(path):
        cfg = gguf_source.hf_config(path)
        return _from_config(cfg, str(path), path.name.removesuffix(".gguf"), quant, group_size, providers)
    if not path.is_dir():
        raise ConfigError(f"{path}: not a directory (for a bare config.json use --config)")
    cfg = A.read_config(path)
    return _from_config(cfg, str(path / "config.json"), path.name, quant, group_size, providers)


def from_bundle(path: str | Path, providers: ProviderPolicy | None = None) -> ModelInput:
    """An edgerun bundle: the model config, quantization, per-layer block sizes and dense
    quantization come from its ``manifest.json`` (keys read: ``model_config``, ``quant`` {scheme,
    group_size}, ``layers`` [{layer, block_bytes}], ``dense.quant`` {linear, lm_head, group_size,
    tensors} (version 2; absent: every resident tensor plain))."""
    path = Path(path)
    mpath = path / "manifest.json"
    if not mpath.is_file():
        raise ConfigError(
            f"{path}: no manifest.json, so this is not an edgerun bundle "
            "(plan an HF checkpoint with --checkpoint, or a bare config with --config)"
        )
    try:
        m = json.loads(mpath.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise ConfigError(f"{mpath}: manifest is not valid JSON ({type(exc).__name__}: {exc})") from exc
    from edgerun.bundle.format import check_identity

    check_identity(m, mpath)  # the version this edgerun reads, the manifest's own hash
    cfg = m.get("model_config", m.get("config"))
    if not isinstance(cfg, dict):
        raise ConfigError(f"{mpath}: manifest key 'model_config' (the HF config) is missing or not an object")
    scheme, group = _manifest_quant(m.get("quant"), mpath)
    probe = _from_config(cfg, f"{mpath} model_config", path.name, scheme, group, providers)
    moe = probe.args.moe_layers
    expected = probe.experts.block_bytes[0] if moe else 0
    blocks = _manifest_blocks(m, moe, mpath)
    name = m.get("model_name") or m.get("name") or path.name
    experts = ExpertSource(scheme, probe.experts.group_size, blocks, str(mpath))
    notes = list(probe.notes)
    if any(b != expected for b in blocks):
        notes.append(
            f"manifest block_bytes differ from the v1 layout for {scheme} ({expected} B); the manifest's are used"
        )
    dense = _manifest_dense(m.get("dense"), mpath)
    return ModelInput(str(name), probe.args, probe.specs, experts, tuple(notes), dense)


def _manifest_dense(d: Any, mpath: Path) -> DL.DenseScheme:
    q = d.get("quant") if isinstance(d, dict) else None
    if q is None:
        return DL.DenseScheme()
    try:
        if not isinstance(q, dict):
            raise ConfigError("must be an object {linear, lm_head, group_size, tensors}")
        linear, head = (
            DL.check_scheme(q.get("linear"), "linear"),
            DL.check_scheme(q.get("lm_head"), "lm_head"),
        )
        record = (q.get("tensors") or {}).get(DL.LM_HEAD_WEIGHT) or {}
        return DL.DenseScheme(
            linear,
            DL.check_group(linear, q.get("group_size"), "group_size"),
            head,
            DL.check_group(head, record.get("group_size"), "lm_head group_size"),
        )
    except (ConfigError, AttributeError, TypeError) as exc:
        raise ConfigError(f"{mpath}: manifest key 'dense.quant' is not usable: {exc}") from exc


def _manifest_quant(q: Any, mpath: Path) -> tuple[str, int | None]:
    if isinstance(q, str):
        return q, None
    if not isinstance(q, dict):
        raise ConfigError(f"{mpath}: manifest key 'quant' ({{scheme, group_size}}) is missing")
    scheme = q.get("scheme", q.get("name", q.get("type")))
    if not isinstance(scheme, str):
        raise ConfigError(f"{mpath}: manifest key 'quant.scheme' is missing")
    group = q.get("group_size")
    if group is not None and (not isinstance(group, int) or isinstance(group, bool)):
        raise ConfigError(f"{mpath}: manifest key 'quant.group_size' must be an integer, got {group!r}")
    return scheme, group


def _manifest_blocks(m: dict[str, Any], moe: tuple[int, ...], mpath: Path) -> tuple[int, ...]:
    layers = m.get("layers")
    if layers is None and isinstance(m.get("experts"), dict):
        layers = m["experts"].get("layers")
    by_layer: dict[int, Any] = {}
    if isinstance(layers, list):
        for entry in layers:
            if not isinstance(entry, dict) or not isinstance(entry.get("layer"), int):
                raise ConfigError(f"{mpath}: every entry of 'layers' needs an integer 'layer', got {entry!r}")
            by_layer[entry["layer"]] = entry.get("block_bytes")
    elif layers is not None:
        raise ConfigError(f"{mpath}: manifest key 'layers' must be a list of {{layer, block_bytes}}")
    default = m.get("block_bytes")
    out = []
    for i in moe:
        b = by_layer.get(i, default)
        if b is None:
            raise ConfigError(f"{mpath}: no block_bytes for MoE layer {i}")
        if not isinstance(b, int) or isinstance(b, bool) or b <= 0 or b % ALIGN:
            raise ConfigError(
                f"{mpath}: layer {i} block_bytes must be a positive multiple of {ALIGN}, got {b!r}"
            )
        out.append(b)
    return tuple(out)


def with_mtp(model: ModelInput, draft_tokens: int) -> ModelInput:
    """``model`` decoding speculatively with its MTP head: the head's tensors resident (category
    ``mtp``, plain: convert carries them so), refused when the config declares none."""
    from edgerun.models.inventory import mtp_specs

    specs = mtp_specs(model.args)
    if not specs:
        raise ConfigError(
            f"{model.name}: --speculative mtp: the config declares no MTP layer (mtp_num_hidden_layers)"
        )
    notes = [n for n in model.notes if not n.startswith("MTP head")]
    notes.append(
        f"MTP head planned ({model.args.mtp_num_hidden_layers} layer, resident), {draft_tokens} draft token(s) "
        f"a step: a verify window keeps {draft_tokens + 1} DeltaNet states per layer"
    )
    return replace(model, specs=model.specs + tuple(specs), notes=tuple(notes))
