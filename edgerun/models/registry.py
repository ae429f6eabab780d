"""Architectures by HF ``model_type``. Entries are import strings, so discovering what is
available imports neither torch nor model code."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import Any

from edgerun.errors import ConfigError
from edgerun.models.args import ModelArgs, read_config

# model_type -> module implementing MODEL_TYPES, model_args(cfg, source), Model, tensor_specs(args)
BUILTIN: dict[str, str] = {
    "qwen3_moe": "edgerun.models.qwen3_moe",
    "qwen3_5_moe": "edgerun.models.qwen3_5_moe",
    "qwen3_5_moe_text": "edgerun.models.qwen3_5_moe",
}


def architecture(model_type: str | None, source: str = "config.json") -> ModuleType:
    if not model_type:
        raise ConfigError(f"{source}: required key 'model_type' is missing")
    target = BUILTIN.get(model_type)
    if target is None:
        known = ", ".join(sorted(BUILTIN))
        raise ConfigError(f"{source}: model_type {model_type!r} is not supported (supported: {known})")
    return importlib.import_module(target)


def load_args(config: str | Path | dict[str, Any]) -> tuple[ModuleType, ModelArgs]:
    """Resolve an HF config (path to a dir / config.json, or a dict) to (architecture, args)."""
    if isinstance(config, dict):
        cfg, source = config, "config"
    else:
        p = Path(config)
        cfg = read_config(p)
        source = str(p / "config.json" if p.is_dir() else p)
    arch = architecture(cfg.get("model_type"), source)
    return arch, arch.model_args(cfg, source)
