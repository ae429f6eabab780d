"""``edgerun serve`` and ``edgerun chat``: argument definitions and entry points.

``edgerun/cli.py`` wires these in as ``edgerun serve`` and ``edgerun chat``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgerun.cache.policy import CACHE_POLICIES
from edgerun.config import DEFAULT_PREFILL_LANES, default_prefill_lanes
from edgerun.engine.policy import DENSE_ACTS, DENSE_KERNELS, EXPERT_ACTS, EXPERT_KERNELS, GRAPH_MODES
from edgerun.engine.setup import DTYPES
from edgerun.flags import (
    add_device_arguments,
    add_model_argument,
    add_speculative_arguments,
    octal_mode,
    parse_context,
    positive_int,
    prefetch_ahead,
    read_pieces,
)
from edgerun.models.providers import ProviderPolicy, add_provider_arguments
from edgerun.server.options import (
    CPU_EXPERTS,
    DEFAULT_BATCH,
    SLOT_POOLS,
    TIER_READS,
    ServeOptions,
    load_serve_config,
)

# flag dest -> ServeOptions field
_FLAGS = (
    "model",
    "served_model_name",
    "profile",
    "quota",
    "host_quota",
    "read_mode",
    "read_depth",
    "reader",
    "read_pieces",
    "prefetch",
    "prefetch_ahead",
    "cache_policy",
    "warm",
    "trace",
    "expert_kernel",
    "graphs",
    "dense_kernel",
    "dense_act",
    "expert_act",
    "slot_pool",
    "tier_reads",
    "cpu_experts",
    "device",
    "dtype",
    "context",
    "prefill_chunk",
    "threads",
    "socket",
    "socket_mode",
    "socket_group",
    "queue_size",
    "batch",
    "batch_gemv",
    "prefill_lanes",
    "request_timeout",
    "grace_period",
    "default_max_tokens",
    "max_body_bytes",
    "speculative",
    "draft_tokens",
    "speculative_sampled",
    "engine_process",
)


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    add_model_argument(
        p,
        "HF checkpoint dir, or bundle dir whose experts stream with --quota or --profile "
        "(default: the shipped demo model)",
        "--bundle",
    )
    add_device_arguments(
        p,
        "device profile YAML: the model is planned against it before the socket is bound, and refused if it does not fit",
    )
    p.add_argument(
        "--quota",
        type=int,
        help="expert slots per MoE layer of a bundle (with --profile: checked against its plan; default: the plan's)",
    )
    p.add_argument(
        "--host-quota",
        type=int,
        help="--quota on a CUDA device: a pinned host tier of this many experts per layer behind the device slots",
    )
    add_read_arguments(p)
    add_prefetch_argument(p)
    add_plan_file_arguments(p)
    add_kernel_arguments(p, default=None)
    p.add_argument("--socket", type=Path, help="Unix socket path (default: see docs/serving.md)")
    p.add_argument("--config", type=Path, help="serve.yaml; flags given here override it")
    p.add_argument("--served-model-name", help="the model id clients send (default: the model dir's name)")
    p.add_argument(
        "--dtype", choices=DTYPES, help="compute dtype (auto: cpu bfloat16 with AMX, else float32)"
    )
    p.add_argument(
        "--context", type=parse_context, help="max context per request: 4096 or 32k (default: the model's)"
    )
    p.add_argument("--prefill-chunk", type=positive_int)
    p.add_argument(
        "--threads",
        type=int,
        help="torch CPU threads (default: 1 for models up to 100M params, else one per core)",
    )
    p.add_argument("--socket-mode", type=octal_mode, help="octal, default 0660")
    p.add_argument("--socket-group", help="group owning the socket")
    p.add_argument("--queue-size", type=int, help="requests that may wait for the engine (default 16)")
    p.add_argument(
        "--batch",
        type=int,
        help=f"requests decoded together (default {DEFAULT_BATCH} on the CPU, 1 on CUDA or with --speculative; "
        "at most 8 on CUDA; with --profile the plan is made for it)",
    )
    p.add_argument(
        "--batch-gemv",
        choices=("planes", "rows"),
        help="a CUDA batch's large int4 projections: planes (default), the tensor-core GEMV whose cost hardly "
        "grows with the rows decoding together; rows, the GEMV a batch-1 daemon runs, faster for one request "
        "and slower for several (docs/benchmarks.md)",
    )
    p.add_argument(
        "--prefill-lanes",
        type=int,
        help="a CUDA batch's prompts arriving together prefill in this many lanes at once (1: one after "
        f"another; default: up to {DEFAULT_PREFILL_LANES} where the plan has room for them beside every expert "
        "held); each lane holds a scratch state, prefill graphs and a cuBLAS workspace of its own",
    )
    p.add_argument("--request-timeout", type=float, help="seconds per request, queueing included")
    p.add_argument("--grace-period", type=float, help="seconds SIGTERM lets running requests finish")
    p.add_argument("--default-max-tokens", type=int)
    p.add_argument("--max-body-bytes", type=int)
    p.add_argument(
        "--engine-process",
        choices=("on", "off"),
        help="on (default): the model and its decode loop in a child process, so clients keeping the "
        "event loop busy cannot slow generation; off: in a thread of the daemon's process",
    )
    p.add_argument(
        "-v",
        "--verbose",
        dest="log_requests",
        action="store_true",
        help="log one line per request on stderr: method, path, status, seconds, client uid",
    )
    add_speculative_arguments(p)
    add_provider_arguments(p)


def add_prefetch_argument(p: argparse.ArgumentParser) -> None:
    """--prefetch / --no-prefetch: shared by serve and generate."""
    p.add_argument(
        "--prefetch",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="streamed experts: read the next layer's predicted experts (and a prefill's next batch) "
        "before the router asks (default: on for CPU slots; off on CUDA, where it pays only while steps miss)",
    )
    p.add_argument(
        "--prefetch-ahead",
        type=prefetch_ahead,
        default=None,
        help="with prefetch: streamed layers a decode step reads ahead, 1 (the next layer's predicted "
        "experts) or 2 (the one after's too, refined a layer later; each layer may hold half the "
        "prefetch buffers); default 1",
    )
    p.add_argument(
        "--cache-policy",
        choices=CACHE_POLICIES,
        default=None,
        help="streamed experts: which experts a layer's slots keep. lfu-bypass (the default): LFU with "
        "decay that holds a miss only if it has been used more than the held expert it would evict, "
        "else reads it into a spill row, uses it and lets it go (the fewest reads measured); lfu: "
        "every miss held, the least used evicted; lru: the least recent evicted",
    )


def add_read_arguments(p: argparse.ArgumentParser) -> None:
    """--read-mode, --read-depth and --reader: how streamed experts are read; shared by serve and
    generate."""
    from edgerun.cache.reader import READERS

    p.add_argument(
        "--read-mode",
        choices=("auto", "direct", "buffered"),
        default=None,
        help="streamed expert reads: O_DIRECT, page cache, or O_DIRECT with a recorded fallback "
        "(default: auto)",
    )
    p.add_argument(
        "--read-depth",
        type=positive_int,
        default=None,
        help="expert reads in flight (default: one per staging buffer; on CUDA from a virtio disk 2); some "
        "disks are faster shallow",
    )
    p.add_argument(
        "--reader",
        choices=READERS,
        default=None,
        help="who reads streamed experts: native (C threads that read, check and copy without the GIL, "
        "built at first use), preadv (Python threads), io_uring (extra edgerun[io_uring]); native and "
        "io_uring are errors where they cannot run; auto: native where it builds, else preadv, a counted "
        "fallback (default: auto)",
    )
    p.add_argument(
        "--read-pieces",
        type=read_pieces,
        default=None,
        help="the native reader reads each expert block as this many parts at once, whole pages each "
        "(1..64; default 1; on CUDA from a virtio disk 2): a disk that serves one large request slowly "
        "(virtio, network) keeps several requests busy; `edgerun bench decode --read-pieces 1,2,4` measures yours",
    )


def add_plan_file_arguments(p: argparse.ArgumentParser) -> None:
    """--warm and --trace: shared by serve and generate."""
    p.add_argument(
        "--warm",
        type=Path,
        default=None,
        help="streamed experts: preload each layer's most used (warm-set JSON from `edgerun trace --frequencies`)",
    )
    p.add_argument(
        "--trace",
        type=Path,
        default=None,
        help="with --profile: per-layer expert quotas from this route trace's miss curves "
        "(`edgerun trace`; as `edgerun plan --trace`), and its misses predicted",
    )


def add_kernel_arguments(p: argparse.ArgumentParser, default: str | None = "auto") -> None:
    """--expert-kernel, --graphs, --slot-pool: shared by serve and generate."""
    p.add_argument(
        "--expert-kernel",
        choices=EXPERT_KERNELS,
        default=default,
        help="routed-expert kernel (auto: Triton on CUDA; on the CPU cpu_grouped, one C call per layer from the "
        "slots' own bytes, else torch's CPU kernels (cpu); each where its start-up probe passes)",
    )
    p.add_argument(
        "--graphs",
        choices=GRAPH_MODES,
        default=default,
        help="CUDA graph capture of decode steps (off: eager)",
    )
    p.add_argument(
        "--dense-kernel",
        choices=DENSE_KERNELS,
        default=default,
        help="decode norms and DeltaNet step (auto: fused Triton where its start-up probe passes)",
    )
    p.add_argument(
        "--dense-act",
        choices=DENSE_ACTS,
        default=None if default is None else "bf16",
        help="int8: the int4 projections of many rows take x quantized to int8 per 32 columns in their decode "
        "GEMV (W4A8: faster; logits move by int8's rounding); needs the Triton dense kernels on CUDA",
    )
    p.add_argument(
        "--expert-act",
        choices=EXPERT_ACTS,
        default=None if default is None else "bf16",
        help="int8: the routed experts' gate_up takes x quantized to int8 per 32 columns (W4A8), stored by the "
        "router's launch; needs the Triton expert kernel on CUDA and int4 experts in groups of 32, unrotated",
    )
    p.add_argument(
        "--slot-pool",
        choices=SLOT_POOLS,
        default=None,
        help="CUDA expert slots in VRAM (device) or pinned host memory the GPU reads (mapped); "
        "default: mapped on unified-memory profiles",
    )
    p.add_argument(
        "--tier-reads",
        choices=TIER_READS,
        default=None,
        help="a pinned host tier holding every expert (discrete GPUs): the GPU reads the experts its "
        "device slots lack in place over PCIe, the step staying one CUDA graph (in-place), or copies "
        "each miss into a slot first (copy); default: in-place where the GPU reads mapped memory",
    )
    p.add_argument(
        "--cpu-experts",
        choices=CPU_EXPERTS,
        default=None,
        help="with a far tier (--tier-reads in-place): compute some of a decode step's far experts on the "
        "CPU from host memory beside the GPU's PCIe reads: as many as the start-up calibration says "
        "finish with the GPU (auto, often none), every one (on), or none (off); such layers' steps run "
        "eagerly; default: off (the split has not been measured on a GPU yet)",
    )


def serve_options(ns: argparse.Namespace) -> ServeOptions:
    opts = ServeOptions()
    if ns.config is not None:
        opts = opts.merged(load_serve_config(ns.config))
    flags = {name: getattr(ns, name, None) for name in _FLAGS}
    if flags["engine_process"] is not None:
        flags["engine_process"] = flags["engine_process"] == "on"
    if any(getattr(ns, k, None) for k in ("allow_provider", "provider", "allow_override")):
        flags["providers"] = ProviderPolicy.from_namespace(ns)
    return opts.merged(flags)


def planned_device(opts: ServeOptions) -> str | None:
    """The device kind serve runs on, known before torch: the option, else the profile's kind;
    None: cuda if available, decided when torch loads."""
    if opts.device is None and opts.profile is not None:
        from edgerun.config import load_device_profile

        return "cuda" if load_device_profile(opts.profile).has_cuda else "cpu"
    return opts.device


def serve_batch(opts: ServeOptions, device: str) -> int:
    """The batch serve runs: the option, else 1 with speculative decoding (the two do not combine
    yet) or on CUDA, DEFAULT_BATCH on the CPU."""
    if opts.batch is not None:
        return opts.batch
    return DEFAULT_BATCH if device == "cpu" and not opts.speculative else 1


def cache_plan(opts: ServeOptions):
    """How the experts are held, the plan's summary and the batch's prefill lanes
    (engine/setup.Planned). Planned before the daemon binds (no torch), so a model that does not
    fit the device profile is refused up front, naming what would (the largest batch, when the
    batch is what does not fit)."""
    from edgerun.engine.setup import plan_experts, read_warm

    device = planned_device(opts) or "cpu"
    return plan_experts(
        opts.model,
        device,
        opts.dtype,
        quota=opts.quota,
        profile=opts.profile,
        context=opts.context,
        host_quota=opts.host_quota,
        batch=serve_batch(opts, device),
        read_mode=opts.read_mode,
        read_depth=opts.read_depth,
        reader=opts.reader,
        read_pieces=opts.read_pieces,
        prefetch=opts.prefetch,
        prefetch_ahead=opts.prefetch_ahead,
        policy=opts.cache_policy,
        pool=opts.slot_pool,
        tier_reads=opts.tier_reads,
        cpu_experts=opts.cpu_experts,
        warm=read_warm(opts.warm),
        trace=opts.trace,
        providers=opts.providers,
        draft_tokens=spec.draft_tokens if (spec := opts.speculative_config()) is not None else 0,
        prefill_lanes=opts.prefill_lanes,
        expert_kernel=opts.expert_kernel,
    )


@dataclass(frozen=True)
class EngineLoader:
    """The engine factory the daemon's engine thread calls: the model with its experts resident,
    or streamed through the expert cache ``cache`` configures. Plain data, so it pickles to the
    engine's own process."""

    opts: ServeOptions
    profile: str | None = None
    cache: Any = None
    plan: str | None = None
    # a batch's prompts prefilled at once (cache_plan's); None: the device's default
    prefill_lanes: int | None = None

    def __call__(self, status: Callable[[str], None]):
        from edgerun.engine.setup import runtime
        from edgerun.server.engine_worker import RunnerEngine

        opts = self.opts
        rt = runtime(
            opts.device,
            opts.dtype,
            opts.threads,
            opts.expert_kernel,
            opts.dense_kernel,
            opts.graphs,
            opts.profile,
            dense_act=opts.dense_act,
            expert_act=opts.expert_act,
        )
        source = opts.model
        name = opts.served_model_name or (source.resolve().name if source else "demo")
        status(f"loading model {source or 'demo'} on {rt.device}")
        runner = rt.load(
            source,
            providers=opts.providers,
            cache=self.cache,
            log=status,
            max_context=opts.context,
            prefill_chunk=opts.prefill_chunk,
            speculative=opts.speculative_config(),
        )
        batch = serve_batch(opts, runner.device.type)
        lanes = self.prefill_lanes
        runner.enable_batch(
            batch,
            planes=opts.batch_gemv == "planes",
            lanes=default_prefill_lanes(runner.device.type, batch) if lanes is None else lanes,
        )
        return RunnerEngine(runner, source, name, self.profile, self.plan)


def run_serve(ns: argparse.Namespace) -> int:
    from edgerun.server import daemon

    opts = serve_options(ns)
    if ns.log_requests:
        import logging

        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("edgerun serve: %(message)s"))
        requests = logging.getLogger("edgerun.server.requests")
        requests.setLevel(logging.INFO)
        requests.addHandler(handler)
        requests.propagate = False
    profile = None
    if opts.profile is not None:
        from edgerun.config import load_device_profile

        profile = load_device_profile(opts.profile).name
    planned = cache_plan(opts)
    loader = EngineLoader(opts, profile, planned.cache, planned.summary, planned.prefill_lanes)
    daemon.hard_exit(daemon.run(opts, loader))
    return 0  # not reached


def add_chat_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("message", nargs="?", help="one message (omit to chat line by line on stdin)")
    p.add_argument("--socket", type=Path, help="the daemon's socket (default: found as the daemon places it)")
    p.add_argument("--system", help="system prompt")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)


def run_chat(ns: argparse.Namespace) -> int:
    from edgerun.server.client import chat

    return chat(ns)
