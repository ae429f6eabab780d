"""Architectures by HF ``model_type``. The built-in ones are a provider like any installed one
(see :mod:`edgerun.models.providers`): a table of import strings, so discovering what is
available imports neither torch nor model code. A module is imported only once it is selected."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import Any

from edgerun import __version__
from edgerun.errors import ConfigError
from edgerun.models.args import ModelArgs, read_config
from edgerun.models.providers import (
    API_LEVELS,
    BUILTIN_NAME,
    Provider,
    ProviderError,
    ProviderPolicy,
    Resolution,
    discover,
    select,
)

# model_type -> module implementing MODEL_TYPES, model_args(cfg, source), Model, tensor_specs(args)
BUILTIN: dict[str, str] = {
    "qwen3_moe": "edgerun.models.qwen3_moe",
    "qwen3_5_moe": "edgerun.models.qwen3_5_moe",
    "qwen3_5_moe_text": "edgerun.models.qwen3_5_moe",
}
BUILTIN_PROVIDER = Provider(BUILTIN_NAME, __version__, BUILTIN, (str(API_LEVELS[-1]),), builtin=True)


def resolve(
    model_type: str | None, providers: ProviderPolicy | None = None, source: str = "config.json"
) -> Resolution:
    """Which provider serves ``model_type`` (metadata only; nothing imported)."""
    if not model_type:
        raise ConfigError(f"{source}: required key 'model_type' is missing")
    return select(model_type, BUILTIN_PROVIDER, discover(), providers, source)


def import_architecture(res: Resolution) -> ModuleType:
    """Import the selected module and check it implements the provider API."""
    origin = res.provider.describe()
    try:
        module = importlib.import_module(res.module)
    except Exception as exc:
        if res.provider.builtin:
            raise
        raise ProviderError(
            f"provider {origin}: importing {res.module!r} for model_type {res.model_type!r} failed: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    problems = []
    if res.model_type not in getattr(module, "MODEL_TYPES", ()):
        problems.append(f"MODEL_TYPES does not contain {res.model_type!r}")
    problems += [
        f"no function {f!r}" for f in ("model_args", "tensor_specs") if not callable(getattr(module, f, None))
    ]
    if not res.provider.builtin:  # built-in modules make their Model (torch) on first use only
        from edgerun.models.base import CausalLM

        model = getattr(module, "Model", None)
        if not (isinstance(model, type) and issubclass(model, CausalLM)):
            problems.append("'Model' is not a subclass of edgerun.models.base.CausalLM")
    if problems:
        raise ProviderError(
            f"provider {origin}: module {res.module!r} does not implement provider API {API_LEVELS[-1]}: "
            + "; ".join(problems)
        )
    return module


def architecture(
    model_type: str | None, source: str = "config.json", providers: ProviderPolicy | None = None
) -> ModuleType:
    return import_architecture(resolve(model_type, providers, source))


def resolve_config(
    config: str | Path | dict[str, Any], providers: ProviderPolicy | None = None
) -> tuple[ModuleType, ModelArgs, Resolution]:
    """Resolve an HF config (path to a dir / config.json, or a dict) to (architecture, args,
    provenance). Every refusal happens here, before any model memory is allocated."""
    if isinstance(config, dict):
        cfg, source = config, "config"
    else:
        p = Path(config)
        cfg = read_config(p)
        source = str(p / "config.json" if p.is_dir() else p)
    res = resolve(cfg.get("model_type"), providers, source)
    arch = import_architecture(res)
    args = arch.model_args(cfg, source)
    if not isinstance(args, ModelArgs):
        raise ProviderError(
            f"provider {res.provider.describe()}: {res.module}.model_args returned "
            f"{type(args).__name__}, expected edgerun.models.args.ModelArgs"
        )
    return arch, args, res


def load_args(
    config: str | Path | dict[str, Any], providers: ProviderPolicy | None = None
) -> tuple[ModuleType, ModelArgs]:
    """Resolve an HF config to (architecture, args); see :func:`resolve_config`."""
    arch, args, _ = resolve_config(config, providers)
    return arch, args
