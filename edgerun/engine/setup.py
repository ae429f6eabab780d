"""What every entry point (``generate``, ``serve``, ``trace``, ``bench``) sets up the same way:
the device, dtype, threads and kernel policy (:func:`runtime`), and the expert cache's settings
from a quota or a device plan (:func:`cache_config`), re-planned after loading against the bytes
the engine actually holds (:func:`replan`). Importing this module does not import torch."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from edgerun.budget.planner import PLANNED_DTYPES
from edgerun.config import CacheConfig
from edgerun.engine.policy import KernelPolicy, cpu_expert_kernel
from edgerun.errors import ConfigError, DeviceUnavailable, EdgerunError

DTYPES = ("auto", "float32", "bfloat16", "float16")
# oneDNN's primitive cache and ideep's computation cache keep a primitive for every shape a CPU
# matmul has seen, 1,024 of each by default: in bf16, where prompts of every length bring new
# shapes, a long-running daemon's memory grew by about 4 MiB a request (the demo: 265 -> 833 MiB
# RSS over 80 prompts of 1-700 tokens, still rising). 128 of each bounds it (flat at 547 MiB from
# the 16th request), decode's shapes stay cached and its rate did not change (docs/benchmarks.md,
# 2026-12-05). A value the user set wins.
SHAPE_CACHES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
SHAPE_CACHE_ENTRIES = 128
# CPU threads when none are asked for: a model of at most this many parameters decodes fastest
# on one thread, idle or beside other busy processes (the demo, 8M: 149 tok/s against 135 on two
# threads idle, 94 against 20 loaded; benchmarks/threads_under_load.py, docs/benchmarks.md); a
# larger one gets torch's default, one per core, with OpenMP's idle threads sleeping (cli.main)
SMALL_MODEL_PARAMS = 100_000_000


@dataclass(frozen=True)
class Runtime:
    device: str  # cpu | cuda
    dtype: Any  # torch.dtype, or None: the checkpoint's (cuda; on cpu runtime() names one)
    kernels: KernelPolicy
    threads: int | None = None  # as asked; None: chosen at load (SMALL_MODEL_PARAMS)

    def load(self, model_dir: Path | None, progress: bool | None = None, **kw):
        """The :class:`~edgerun.engine.runner.Runner` of ``model_dir`` on this device, dtype and
        kernel policy (``kw``: the rest of ``Runner.load``'s options). Loading draws bars on stderr
        (weights, experts read in) on a terminal, or as ``progress`` says."""
        import torch

        from edgerun.engine.runner import Runner
        from edgerun.progress import showing

        with showing(progress):
            runner = Runner.load(model_dir, device=self.device, dtype=self.dtype, kernels=self.kernels, **kw)
        if self.device == "cpu" and self.threads is None:
            n = sum(p.numel() for p in runner.model.parameters())
            if n <= SMALL_MODEL_PARAMS and torch.get_num_threads() > 1:
                torch.set_num_threads(1)
                runner.threads_note = "a small model decodes fastest on one thread; --threads sets it"
        return runner


def default_dtype(device: str) -> str:
    """``--dtype auto``'s compute dtype on ``device``: on the cpu the one this CPU's bf16 hardware
    calls for (``kernels/cpu_features.py``, which the start-up line quotes with its reason); on
    cuda "auto", the checkpoint's own. Pure: no torch."""
    if device != "cpu":
        return "auto"
    from edgerun.kernels import cpu_features

    return cpu_features.read().default_dtype()


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
    profile: Path | None = None,
    window_rows: str = "auto",
    dense_act: str = "bf16",
    expert_act: str = "bf16",
) -> Runtime:
    """Resolve the device (cuda when available), the compute dtype (``auto``: on the cpu by this
    CPU's bf16 hardware, :func:`default_dtype`; on cuda the checkpoint's), torch's CPU threads (set
    here, process-wide) and the kernel request, refusing what cannot run: a CUDA-only kernel or
    graph request on the CPU, or a device ``profile`` of another kind of device (its plan would
    size memory this process does not have)."""
    for name in SHAPE_CACHES:  # read lazily by oneDNN and ideep: before this process's first CPU op
        os.environ.setdefault(name, str(SHAPE_CACHE_ENTRIES))
    import torch

    asked = device
    device = device or default_device()
    if device == "cuda" and not torch.cuda.is_available():
        raise DeviceUnavailable("device cuda: no CUDA device is available (use --device cpu)")
    if device == "cuda":  # a later prompt chunk's attention mask imports torch._dynamo: now, not in
        import torch.nn.attention.bias  # noqa: F401  (a request's prefill; models/layers.causal_attention)
    why = "--device cpu" if asked else "no CUDA device is available"
    if device == "cpu":
        for flag, value in (("--expert-kernel", experts), ("--dense-kernel", dense)):
            if value == "triton":
                raise ConfigError(
                    f"{flag} triton: Triton kernels run on CUDA, and this runs on the cpu ({why}); "
                    f"use {flag} auto"
                )
        if graphs == "on":
            raise ConfigError(f"--graphs on: CUDA graphs need CUDA, and this runs on the cpu ({why})")
        for flag, value in (("--dense-act", dense_act), ("--expert-act", expert_act)):
            if value == "int8":
                raise ConfigError(
                    f"{flag} int8: int8 activations run in the Triton kernels on CUDA, and this runs on the cpu ({why})"
                )
    if profile is not None:
        from edgerun.config import load_device_profile

        dp = load_device_profile(profile)
        if dp.has_cuda != (device == "cuda"):
            kind = f"a CUDA device (sm {dp.compute_capability})" if dp.has_cuda else "a machine without CUDA"
            raise ConfigError(
                f"device profile {profile} ({dp.name}) describes {kind}, but this runs on the {device}"
                + (f" ({why})" if device == "cpu" else "")
                + ": its plan would size memory this process does not have; give the profile of this "
                "machine (configs/cpu.yaml is one without CUDA)"
            )
    dtype = dtype or "auto"
    if dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    dtype = default_dtype(device) if dtype == "auto" else dtype
    if threads is not None:
        if threads < 1:
            raise ConfigError(f"threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    kernels = KernelPolicy(
        experts=experts or "auto",
        dense=dense or "auto",
        graphs=graphs or "auto",
        window_rows=window_rows,
        dense_act=dense_act or "bf16",
        expert_act=expert_act or "bf16",
    )
    return Runtime(device, None if dtype == "auto" else getattr(torch, dtype), kernels, threads)


def cache_config(
    bundle: Path | None,
    *,
    quota: int | None = None,
    profile: Path | None = None,
    context: int | None = None,
    batch: int = 1,
    host_quota: int | None = None,
    read_mode: str | None = None,
    read_depth: int | None = None,
    reader: str | None = None,
    read_pieces: int | None = None,
    prefetch: bool | None = None,
    prefetch_ahead: int | None = None,
    policy: str | None = None,
    pool: str | None = None,
    tier_reads: str | None = None,
    cpu_experts: str | None = None,
    warm: Mapping[int, Any] | None = None,
    trace: Path | None = None,
    providers=None,
    model: Path | None = None,
    draft_tokens: int = 0,
    prefill_lanes: int | None = None,
    dtype: str | None = None,
    expert_kernel: str = "auto",
) -> CacheConfig | None:
    """How the routed experts of ``bundle`` are held: None (resident), or the cache's settings
    from the plan of ``bundle`` on the device ``profile`` (with ``quota``: that quota, checked
    against the plan; with ``trace``: per-layer quotas from the route trace's miss curves, and
    its misses predicted) or else from a fixed ``quota``. The profile's memory kind also picks where
    CUDA slots live unless ``pool`` says. Streaming-only settings without streaming are refused
    by name (``model``: the resident model's path, for the message), as is a plan that does
    not fit. ``draft_tokens``: speculative decoding's K, which the plan counts. Pure: no torch."""
    if bundle is None or (quota is None and profile is None):
        if quota is not None:
            raise ConfigError(
                f"--quota streams routed experts from an edgerun bundle; {model or 'the demo model'} is "
                "not one: make one with `edgerun convert`, then pass it as --model"
            )
        for flag, value in (
            ("--host-quota", host_quota),
            ("--slot-pool", pool),
            ("--tier-reads", tier_reads),
            ("--cpu-experts", cpu_experts),
            ("--read-mode", read_mode),
            ("--read-depth", read_depth),
            ("--reader", reader),
            ("--read-pieces", read_pieces),
            ("--cache-policy", policy),
            ("--prefetch" if prefetch else "--no-prefetch", prefetch),
            ("--prefetch-ahead", prefetch_ahead),
            ("--warm", warm),
            ("--trace", trace),
        ):
            if value is not None:
                where = "with --quota or --profile" if bundle is not None else "(--model BUNDLE_DIR)"
                raise ConfigError(
                    f"{flag} sets up expert streaming, but the experts of {bundle or model or 'the demo model'} "
                    f"are held resident here: it applies to a bundle's experts streamed {where}"
                )
        return None
    if trace is not None and profile is None:
        raise ConfigError(
            f"--trace {trace} sizes per-layer quotas in a device plan: give --profile too "
            "(with a fixed --quota alone there is nothing to size)"
        )
    if profile is not None and host_quota is not None:
        raise ConfigError(
            "give --host-quota or a device profile, not both (the profile's plan sizes the host tier)"
        )
    if prefetch_ahead is not None:  # reading ahead asks for prefetch (off by default on CUDA)
        if prefetch is False:
            raise ConfigError(
                f"--prefetch-ahead {prefetch_ahead} reads experts ahead, which --no-prefetch turns off: "
                "drop one of them"
            )
        prefetch = True
    unified = False
    if profile is not None:
        from edgerun.config import load_device_profile

        unified = not load_device_profile(profile).discrete
    base = CacheConfig(
        quotas=quota or 1,
        host_quotas=host_quota,
        read_mode=read_mode or "auto",
        read_depth=read_depth,
        reader=reader or "auto",
        read_pieces=read_pieces,
        prefetch=prefetch,
        prefetch_ahead=prefetch_ahead or 1,
        policy=policy,
        pool=pool,
        tier_reads=tier_reads,
        cpu_experts=cpu_experts or "off",
        unified_memory=unified,
        warm=warm,
        draft_tokens=draft_tokens,
        prefill_lanes=prefill_lanes,
        dtype=dtype,
    )
    if profile is None:
        return base
    # the kernel --expert-kernel resolves to, as `edgerun plan` counts it: its probe runs at
    # load, and the re-plan after it (replan) counts what then really runs
    return _planned(
        dataclasses.replace(base, profile=Path(profile), context=context, trace=trace, batch=batch),
        bundle,
        providers,
        quota,
        expert_kernel=cpu_expert_kernel(expert_kernel),
    )


class Planned(NamedTuple):
    """What :func:`plan_experts` settled: how the experts are held, the plan's start-up summary,
    and the lanes a CUDA batch's prompts prefill in (the plan's count where a plan was made)."""

    cache: CacheConfig | None  # None: every expert resident
    summary: str | None  # None: no plan
    prefill_lanes: int | None  # None: neither asked nor planned (config.default_prefill_lanes)


def plan_experts(
    model: Path | None,
    device: str,
    dtype: str | None = None,
    *,
    quota: int | None = None,
    profile: Path | None = None,
    context: int | None = None,
    batch: int = 1,
    providers=None,
    **streaming,
) -> Planned:
    """How a model run on ``device`` (cpu | cuda) in ``dtype`` (a name of :data:`DTYPES`) holds
    its experts, with the plan's summary and the batch's prefill lanes: a bundle streams with
    ``quota`` and/or the ``profile`` plan (:func:`cache_config`; ``streaming``: its other
    settings); any other model is held whole, and with a profile it is planned whole first and
    refused, naming what would fit, when it does not fit. ``streaming["prefill_lanes"]``: the
    lanes asked for; None: the plan's, or without a plan None (the device's default, once known)."""
    from edgerun.bundle.format import MANIFEST, check_finished

    if model is not None:
        check_finished(model)
    bundle = model if model is not None and (Path(model) / MANIFEST).is_file() else None
    dtype_asked = None if (dtype or "auto") == "auto" else PLANNED_DTYPES.get(dtype, dtype)
    cache = cache_config(
        bundle,
        quota=quota,
        profile=profile,
        context=context,
        batch=batch,
        providers=providers,
        model=model,
        dtype=dtype_asked,
        **streaming,
    )
    lanes_asked = streaming.get("prefill_lanes")
    if cache is not None:
        return Planned(cache, cache.summary, cache.prefill_lanes)
    if profile is None:
        return Planned(None, None, lanes_asked)
    # runtime()'s dtype: on the cpu by this CPU's hardware, the checkpoint's (planned as bf16) on cuda
    planned = dtype_asked or PLANNED_DTYPES.get(default_dtype(device), "bf16")
    draft = streaming.get("draft_tokens", 0)
    summary, lanes = resident_plan(
        model, profile, context, device, planned, providers, batch, draft, lanes_asked
    )
    return Planned(None, summary, lanes if device == "cuda" else 1)


def resident_plan(
    model: Path | None,
    profile: Path,
    context: int | None,
    device: str,
    dtype: str,
    providers=None,
    batch: int = 1,
    draft_tokens: int = 0,
    prefill_lanes: int | None = None,
) -> tuple[str, int]:
    """(the start-up summary, the prefill lanes counted) of a model held whole (every expert
    resident) on ``profile``, or a refusal naming what would fit: a bundle streamed within the
    profile's plan (``draft_tokens``: speculative decoding's K, whose MTP head and state the plans
    count; ``prefill_lanes``: a batch's lanes asked, None: as many as fit, up to the default).
    Pure: no torch."""
    from edgerun.budget.cli import plan_resident

    p, streamed = plan_resident(
        model, profile, context, device=device, dtype=dtype, providers=providers, batch=batch,
        draft_tokens=draft_tokens, prefill_lanes=prefill_lanes,
    )  # fmt: skip
    if not p.fits:
        name = model or "the demo model"
        fewer = p.refusal.max_batch if batch > 1 and p.refusal.max_batch else None
        text = (
            f"{name} with every expert resident ({p.num_experts} per layer, {p.quant}): {p.refusal.message} "
            + (
                f"It fits decoding {fewer} request(s) at once (--batch {fewer}); or stream"
                if fewer
                else "Stream"
            )
            + f" the experts from a bundle instead: "
            f"`edgerun convert {name} BUNDLE_DIR --quant int4`, then --model BUNDLE_DIR --profile {profile}"
        )
        if streamed is not None and streamed.fits:
            text += (
                f" (planned: quota {min(streamed.quotas)} per layer at context {streamed.context}, "
                f"{streamed.prediction.tok_s:.1f} tok/s predicted)"
            )
        elif streamed is not None:
            text += f" (an int4 bundle does not fit either: {streamed.refusal.message})"
        raise EdgerunError(text)
    free = sum(pool.headroom for pool in p.pools)
    return (
        f"plan {p.device}, context {p.context}"
        + (f", batch {p.batch}" if p.batch > 1 else "")
        + (f" (prompts in {p.prefill_lanes} lanes)" if p.prefill_lanes > 1 else "")
        + f": every expert resident ({p.quant}), "
        f"{free / 2**30:.2f} GiB headroom"
    ), p.prefill_lanes


def _planned(
    config: CacheConfig,
    bundle: Path,
    providers,
    fixed: int | None = None,
    resident: Mapping[str, int] | None = None,
    expert_kernel: str = "cpu",
):
    """``config`` with the quotas, budget and host tier of the plan of ``bundle`` on its profile
    (``fixed``: the quota asked for, which the plan checks and which stays one number;
    ``expert_kernel``: the CPU expert kernel whose bytes it counts, :func:`plan_kernel`)."""
    from edgerun.budget.cli import plan_for_bundle

    p = plan_for_bundle(
        bundle,
        config.profile,
        config.context,
        config.batch,
        providers=providers,
        resident=resident,
        quota=fixed,
        trace=config.trace,
        draft_tokens=config.draft_tokens,
        prefill_lanes=config.prefill_lanes,
        tier_reads=config.tier_reads,
        expert_kernel=expert_kernel,
        dense_dtype=config.dtype,
        cache_policy=config.policy,
    )
    if not p.fits:
        raise EdgerunError(p.refusal.message)
    pred = p.prediction
    summary = (
        f"plan {p.device}, context {p.context}"
        + (f", batch {p.batch}" if p.batch > 1 else "")
        + (f" (prompts in {p.prefill_lanes} lanes)" if p.prefill_lanes > 1 else "")
        + f": quota {'/'.join(map(str, sorted(set(p.quotas))))} per layer"
        + (" (as asked)" if fixed else f" (from route trace {config.trace})" if config.trace else "")
        + f", predicted {pred.misses_per_token:.2f} misses/token, {pred.tok_s:.1f} tok/s bound ({pred.model} routing)"
    )
    host = dict(zip(p.moe_layers, p.host_quotas)) if p.host_quotas else None
    if host and pred.far_reads_per_token:
        summary += f", every expert in the pinned host tier, {pred.far_reads_per_token:.2f} read in place over PCIe/token"
    elif host:
        summary += f", pinned host tier {'/'.join(map(str, sorted(set(p.host_quotas))))} per layer"
    return dataclasses.replace(
        config,
        quotas=fixed or dict(zip(p.moe_layers, p.quotas)),
        host_quotas=host,
        budget=sum(
            it.nbytes for it in p.items if it.name in ("expert_slots", "pinned_staging", "spill_rows")
        ),
        summary=summary,
        prefill_lanes=p.prefill_lanes,
    )


def read_warm(path: Path | None) -> dict[int, list[int]] | None:
    """A warm-set file (``edgerun trace --frequencies``): per-layer expert use counts; None: none."""
    if path is None:
        return None
    import json

    try:
        raw = json.loads(Path(path).read_text())
        return {int(layer): counts for layer, counts in raw["frequencies"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise ConfigError(
            f"{path}: not a warm-set file (expects {{'frequencies': {{layer: [counts]}}}}): {exc}"
        ) from exc


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
    expert_kernel: str = "cpu",
) -> CacheConfig:
    """A planned config re-planned against the resident bytes loading measured (the estimate
    assumed the planner's dense dtype) and the CPU expert kernel that will run (``expert_kernel``,
    :func:`plan_kernel`); ``log`` hears the difference. Fixed quotas pass as they are. Refused,
    naming the numbers, if the measured model no longer fits."""
    if config.profile is None:
        return config
    fixed = config.quotas if isinstance(config.quotas, int) else None
    new = _planned(config, bundle, providers, fixed, resident, expert_kernel)
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


def plan_kernel(asked: str, layouts, top_k: int) -> str:
    """The CPU expert kernel a plan counts the bytes of for the request ``asked``: the grouped
    kernel only where its probe, run here as ``Runner.set_kernels`` will run it, passes on every
    layout (a refused one runs torch's kernels, which hold a repacked copy of each int4 slot);
    else what ``asked`` resolves to (``engine/policy.cpu_expert_kernel``)."""
    from edgerun.engine.policy import cpu_expert_kernel

    kernel = cpu_expert_kernel(asked)
    if kernel == "cpu_grouped":
        from edgerun.kernels.probe import probe_cpu_grouped

        if not all(probe_cpu_grouped(layout, top_k).selected for layout in layouts):
            return "cpu"
    return kernel


def resident_weight_bytes(model_dir: Path, dtype: str, mtp: bool = False) -> tuple[int, int]:
    """(resident bytes but the routed experts, the routed experts' bytes) of ``model_dir`` (an HF
    checkpoint or a bundle) loaded whole in ``dtype`` (a ``DTYPE_BYTES`` name): a bundle's
    dense weights as it stores them, every routed expert stacked in ``dtype`` (a bundle's
    dequantized); with ``mtp``, the MTP head's tensors too. From the config or manifest only.
    Pure: no torch."""
    from edgerun.budget import inputs
    from edgerun.budget.planner import DTYPE_BYTES, resident_bytes
    from edgerun.bundle.format import MANIFEST
    from edgerun.models.args import EXPERT

    model_dir = Path(model_dir)
    src = (
        inputs.from_bundle(model_dir)
        if (model_dir / MANIFEST).is_file()
        else inputs.from_checkpoint(model_dir)
    )
    if mtp:
        src = inputs.with_mtp(src, 1)
    dense = sum(resident_bytes(src.specs, dtype, src.dense).values())
    experts = sum(math.prod(s.shape) for s in src.specs if s.category == EXPERT) * DTYPE_BYTES[dtype]
    return dense, experts


def check_resident_fits(
    model_dir: Path, device: str, dtype: str, mtp: bool = False, free: int | None = None
) -> None:
    """Refuse, before anything is allocated, a model held whole (no expert cache) whose weights
    alone exceed the memory free on ``device`` (``free``: that, default measured: the CUDA
    device's free memory, or the host's available memory), naming both and what would fit: its
    experts streamed from a bundle. A model whose config cannot be read is left to the loader,
    which names what is wrong."""
    from edgerun.bundle.format import MANIFEST
    from edgerun.config import format_bytes as b

    try:
        dense, experts = resident_weight_bytes(model_dir, dtype, mtp)
    except (EdgerunError, ValueError, TypeError, KeyError, OSError):  # the loader names what is wrong
        return
    if free is None:
        free = _free_memory(device)
    if dense + experts <= free:
        return
    where = "the GPU" if device.startswith("cuda") else "this host"
    text = (
        f"{model_dir}: held whole in {dtype} its weights take {b(dense + experts)} ({b(dense)} resident + "
        f"{b(experts)} routed experts), more than the {b(free)} free on {where}: stream its routed "
        "experts from a bundle with a quota that fits ("
    )
    if (Path(model_dir) / MANIFEST).is_file():
        text += f"--model {model_dir} --profile configs/<your device>.yaml, or --quota N)"
    else:
        text += (
            f"`edgerun convert {model_dir} BUNDLE_DIR --quant int4`, then --model BUNDLE_DIR "
            "--profile configs/<your device>.yaml, or --quota N)"
        )
    raise ConfigError(text)


def _free_memory(device: str) -> int:
    """What a load may allocate on ``device``: a discrete GPU's free memory; on a GPU that shares
    the host's memory (Jetson) the larger of that and what the host could free (available memory
    and free swap: the CUDA driver there does not count page cache or swap as free, so its figure
    alone would refuse models that load); the host's available memory for the CPU."""
    import psutil

    host = psutil.virtual_memory().available
    if not device.startswith("cuda"):
        return host
    import torch

    dev = torch.device(device)
    free = torch.cuda.mem_get_info(dev)[0]
    if torch.cuda.get_device_properties(dev).is_integrated:
        return max(free, host + psutil.swap_memory().free)
    return free
