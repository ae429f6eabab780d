"""What every entry point (``generate``, ``serve``, ``trace``, ``bench``) sets up the same way:
the device, dtype, threads and kernel policy (:func:`runtime`), and the expert cache's settings
from a quota or a device plan (:func:`cache_config`), re-planned after loading against the bytes
the engine actually holds (:func:`replan`). Importing this module does not import torch."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgerun.config import CacheConfig
from edgerun.engine.policy import KernelPolicy
from edgerun.errors import ConfigError, EdgerunError

DTYPES = ("auto", "float32", "bfloat16", "float16")
# CPU threads when none are asked for: a model of at most this many parameters decodes fastest
# on one thread, idle or beside other busy processes (the demo, 8M: 149 tok/s against 135 on two
# threads idle, 94 against 20 loaded; benchmarks/threads_under_load.py, docs/benchmarks.md); a
# larger one gets torch's default, one per core, with OpenMP's idle threads sleeping (cli.main)
SMALL_MODEL_PARAMS = 100_000_000


@dataclass(frozen=True)
class Runtime:
    device: str  # cpu | cuda
    dtype: Any  # torch.dtype, or None: float32 on cpu, the checkpoint's on cuda
    kernels: KernelPolicy
    threads: int | None = None  # as asked; None: chosen at load (SMALL_MODEL_PARAMS)

    def load(self, model_dir: Path | None, **kw):
        """The :class:`~edgerun.engine.runner.Runner` of ``model_dir`` on this device, dtype and
        kernel policy (``kw``: the rest of ``Runner.load``'s options)."""
        import torch

        from edgerun.engine.runner import Runner

        runner = Runner.load(model_dir, device=self.device, dtype=self.dtype, kernels=self.kernels, **kw)
        if self.device == "cpu" and self.threads is None:
            n = sum(p.numel() for p in runner.model.parameters())
            if n <= SMALL_MODEL_PARAMS and torch.get_num_threads() > 1:
                torch.set_num_threads(1)
                runner.threads_note = "a small model decodes fastest on one thread; --threads sets it"
        return runner


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def runtime(
    device: str | None = None,
    dtype: str | None = "auto",
    threads: int | None = None,
    experts: str | None = "auto",
    dense: str | None = "auto",
    graphs: str | None = "auto",
) -> Runtime:
    """Resolve the device (cuda when available), the compute dtype, torch's CPU threads (set
    here, process-wide) and the kernel request, refusing what cannot run."""
    import torch

    device = device or default_device()
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device cuda: no CUDA device is available (use cpu)")
    dtype = dtype or "auto"
    if dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if threads is not None:
        if threads < 1:
            raise ConfigError(f"threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    kernels = KernelPolicy(experts=experts or "auto", dense=dense or "auto", graphs=graphs or "auto")
    return Runtime(device, None if dtype == "auto" else getattr(torch, dtype), kernels, threads)


def cache_config(
    bundle: Path | None,
    *,
    quota: int | None = None,
    profile: Path | None = None,
    context: int | None = None,
    host_quota: int | None = None,
    read_mode: str | None = None,
    read_depth: int | None = None,
    pool: str | None = None,
    warm: Mapping[int, Any] | None = None,
    providers=None,
) -> CacheConfig | None:
    """How the routed experts are held: None (resident), or the cache's settings from a fixed
    ``quota`` or else from the plan of ``bundle`` on the device ``profile`` (whose memory kind
    also picks where CUDA slots live unless ``pool`` says). Streaming-only settings without
    streaming are refused by name, as is a plan that does not fit. Pure: no torch."""
    if quota is None and profile is None:
        for flag, value in (
            ("--host-quota", host_quota),
            ("--slot-pool", pool),
            ("--read-depth", read_depth),
            ("--warm", warm),
        ):
            if value is not None:
                raise ConfigError(
                    f"{flag} sets up expert streaming: give it with --quota or --profile (serve: --device)"
                )
        return None
    if bundle is None:
        raise ConfigError(
            "expert streaming (a quota or a device profile's plan) needs an edgerun bundle: pass one "
            "(generate: --model BUNDLE_DIR; serve: --bundle DIR), made with `edgerun convert`"
        )
    if quota is None and host_quota is not None:
        raise ConfigError(
            "give --host-quota or a device profile, not both (the profile's plan sizes the host tier)"
        )
    unified = False
    if profile is not None:
        from edgerun.config import load_device_profile

        unified = not load_device_profile(profile).discrete
    base = CacheConfig(
        quotas=quota or 1,
        host_quotas=host_quota,
        read_mode=read_mode or "auto",
        read_depth=read_depth,
        pool=pool,
        unified_memory=unified,
        warm=warm,
    )
    if quota is not None:
        return base
    return _planned(dataclasses.replace(base, profile=Path(profile), context=context), bundle, providers)


def _planned(config: CacheConfig, bundle: Path, providers, resident: Mapping[str, int] | None = None):
    """``config`` with the quotas, budget and host tier of the plan of ``bundle`` on its profile."""
    from edgerun.budget.cli import plan_for_bundle

    p = plan_for_bundle(bundle, config.profile, config.context, providers=providers, resident=resident)
    if not p.fits:
        raise EdgerunError(p.refusal.message)
    pred = p.prediction
    summary = (
        f"plan {p.device}, context {p.context}: quota {'/'.join(map(str, sorted(set(p.quotas))))} per layer, "
        f"predicted {pred.misses_per_token:.2f} misses/token, {pred.tok_s:.1f} tok/s bound ({pred.model} routing)"
    )
    host = dict(zip(p.moe_layers, p.host_quotas)) if p.host_quotas else None
    if host:
        summary += f", pinned host tier {'/'.join(map(str, sorted(set(p.host_quotas))))} per layer"
    return dataclasses.replace(
        config,
        quotas=dict(zip(p.moe_layers, p.quotas)),
        host_quotas=host,
        budget=p.item("expert_slots").nbytes + p.item("pinned_staging").nbytes,
        summary=summary,
    )


def measured_resident(model) -> dict[str, int]:
    """Bytes per planner category of the weights a loaded model holds (routed experts, which
    the cache holds, and unloaded meta tensors excluded)."""
    from edgerun.models import args as A
    from edgerun.models.inventory import categorize

    out: dict[str, int] = {}
    for name, p in model.named_parameters():
        cat = categorize(name)
        if cat != A.EXPERT and p.device.type != "meta":
            out[cat] = out.get(cat, 0) + p.numel() * p.element_size()
    return out


def replan(
    config: CacheConfig,
    bundle: Path,
    resident: Mapping[str, int],
    providers=None,
    log: Callable[[str], None] | None = None,
) -> CacheConfig:
    """A planned config re-planned against the resident bytes loading measured (the estimate
    assumed the planner's dense dtype); ``log`` hears the difference. Fixed quotas pass as
    they are. Refused, naming the numbers, if the measured model no longer fits."""
    if config.profile is None:
        return config
    new = _planned(config, bundle, providers, resident)
    if log is not None:
        measured = sum(resident.values())
        change = (
            "quotas unchanged"
            if new.quotas == config.quotas and new.host_quotas == config.host_quotas
            else f"quotas {_quotas(config.quotas)} -> {_quotas(new.quotas)}"
        )
        log(
            f"re-planned with the measured resident weights ({measured / 2**20:.1f} MiB): {change}, "
            f"expert cache budget {config.budget / 2**20:.1f} -> {new.budget / 2**20:.1f} MiB"
        )
    return new


def _quotas(q) -> str:
    values = sorted(set(q.values())) if isinstance(q, Mapping) else [q]
    return "/".join(map(str, values))
