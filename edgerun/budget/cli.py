"""``edgerun plan``: say where every byte goes on a device, or refuse and say what would fit.

Exit status: 0 the plan fits, 1 it does not (the refusal names what would), 2 bad input."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from pathlib import Path

from edgerun.budget import inputs
from edgerun.budget.planner import (
    DTYPE_BYTES,
    ExpertSource,
    PlanOptions,
    held_mtp_delta,
    plan,
    resident_bytes,
    runtime_dtype,
)
from edgerun.budget.report import FORMATS, render
from edgerun.bundle.dense_layout import DenseScheme, add_dense_arguments
from edgerun.bundle.layout import QUANTS
from edgerun.config import DEFAULT_PREFILL_LANES, DeviceProfile, load_device_profile
from edgerun.engine.policy import EXPERT_KERNELS
from edgerun.errors import EdgerunError
from edgerun.flags import (
    EXIT_NO,
    EXIT_OK,
    EXIT_USAGE,
    add_device_arguments,
    add_model_argument,
    add_renamed,
    add_speculative_arguments,
    check_device_arguments,
    parse_context,
    positive_int,
    speculative_config,
)
from edgerun.models import args as A
from edgerun.models.providers import ProviderPolicy, add_provider_arguments
from edgerun.tools.routes import read_trace

DEMO_MODEL = Path(__file__).resolve().parents[1] / "demo"  # what generate and serve run by default
EXIT_FITS, EXIT_REFUSED, EXIT_ERROR = EXIT_OK, EXIT_NO, EXIT_USAGE
DEFAULT_CONTEXT = 4096  # tokens, when --context is not given and the model allows as many


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_device_arguments(
        parser, "device profile YAML (configs/*.yaml) to plan against", device=False, required=True
    )
    add_model_argument(
        parser,
        "what to plan, read as metadata only: an edgerun bundle dir (its manifest.json), an HF "
        "checkpoint dir (its config.json), a GGUF file (its header) or a bare config.json (plan "
        "before downloading weights)",
        "--bundle",
        "--checkpoint",
        "--config",
    )
    parser.add_argument(
        "--context",
        type=parse_context,
        default=None,
        help="tokens per sequence, prompt + output: 4096 or 32k (default: 4096, or the model's "
        "maximum when smaller)",
    )
    parser.add_argument("--batch", type=int, default=1, help="sequences decoded together (1)")
    parser.add_argument(
        "--prefill-lanes",
        type=positive_int,
        default=None,
        help="a CUDA batch's prompts prefilled at once (serve's; default: up to "
        f"{DEFAULT_PREFILL_LANES} where every expert is held in VRAM and their pools fit beside it, else 1)",
    )
    parser.add_argument(
        "--trace", metavar="FILE", help="route trace (JSONL) to size quotas and predict misses"
    )
    parser.add_argument(
        "--quant", choices=QUANTS, default=None, help="expert quantization without a bundle (int4)"
    )
    parser.add_argument(
        "--group",
        dest="group_size",
        type=int,
        default=None,
        help="expert quantization group (int4 default 32)",
    )
    add_renamed(parser, "--group-size", "--group", "group_size", type=int)  # convert's spelling now
    parser.add_argument(
        "--format", choices=FORMATS, default="table", help="table (default), or json / yaml for machines"
    )
    add_dense_arguments(parser, default=None, what=" (without a bundle; a bundle's manifest says)")
    parser.add_argument(
        "--dense-dtype",
        choices=tuple(DTYPE_BYTES),
        default=None,
        help="plain resident tensors' and activations' dtype (default: the engine's on the device: "
        "bf16 on CUDA, this CPU's compute dtype on a profile without CUDA)",
    )
    parser.add_argument(
        "--kv-dtype",
        choices=tuple(DTYPE_BYTES),
        default=None,
        help="KV cache dtype (default: --dense-dtype's)",
    )
    parser.add_argument(
        "--quota", type=int, default=None, help="exact expert slots per layer (default: most that fit)"
    )
    parser.add_argument("--staging-buffers", type=int, default=None, help="pinned read buffers (2 x top_k)")
    parser.add_argument("--prefill-chunk", type=int, default=512, help="tokens per prefill forward (512)")
    parser.add_argument("--no-cuda-graphs", action="store_true", help="plan no CUDA graph pool")
    parser.add_argument(
        "--tier-reads",
        choices=("in-place", "copy"),
        default="in-place",
        help="discrete GPUs: a pinned host tier holding every expert is read in place over PCIe (in-place), "
        "or its experts are copied into VRAM slots on a miss (copy)",
    )
    parser.add_argument(
        "--expert-kernel",
        choices=EXPERT_KERNELS,
        default="auto",
        help="the routed-expert kernel the plan counts the bytes of on a CPU device (auto: what the engine "
        "picks where its probe passes; cpu: torch's kernels, a repacked copy beside each int4 slot; "
        "cpu_grouped: none)",
    )
    add_speculative_arguments(parser)
    add_provider_arguments(parser)


def model_input(path: str | Path, quant: str | None, group: int | None, providers) -> inputs.ModelInput:
    """What ``--model`` names, by what is there: a bundle, a GGUF file or a checkpoint dir, or a
    bare config.json."""
    from edgerun.bundle import gguf_source
    from edgerun.bundle.format import check_finished

    path = Path(path)
    check_finished(path)
    if (path / "manifest.json").is_file():
        if quant is not None or group is not None:
            raise EdgerunError(f"--quant / --group-size do not apply to the bundle {path}: its manifest says")
        return inputs.from_bundle(path, providers)
    if path.is_dir() and not (path / "config.json").is_file():
        raise EdgerunError(
            f"{path}: neither an edgerun bundle (no manifest.json) nor an HF checkpoint (no config.json)"
        )
    if path.is_dir() or gguf_source.is_gguf(path):
        return inputs.from_checkpoint(path, quant or "int4", group, providers)
    return inputs.from_config_file(path, quant or "int4", group, providers)


def run(ns: argparse.Namespace) -> int:
    try:
        check_device_arguments(ns)
        if ns.model is None:
            raise EdgerunError(
                "--model PATH is required: a bundle, an HF checkpoint, a GGUF file or a config.json"
            )
        device = load_device_profile(ns.profile)
        providers = ProviderPolicy.from_namespace(ns)
        model = model_input(ns.model, ns.quant, ns.group_size, providers)
        spec = speculative_config(ns)
        if spec is not None:
            model = inputs.with_mtp(model, spec.draft_tokens)
        if model.dense is not None and any(v is not None for v in (ns.dense, ns.lm_head, ns.dense_group)):
            raise EdgerunError(
                f"--dense / --lm-head / --dense-group do not apply to the bundle {ns.model}: its manifest says"
            )
        context = ns.context or min(DEFAULT_CONTEXT, model.args.max_position_embeddings)
        dense = model.dense or DenseScheme.resolve(
            ns.dense or "bf16", ns.lm_head, ns.dense_group, model.args.tie_word_embeddings
        )
        options = PlanOptions(
            dense_dtype=ns.dense_dtype,
            dense=dense,
            kv_dtype=ns.kv_dtype,
            staging_buffers=ns.staging_buffers,
            prefill_chunk=ns.prefill_chunk,
            cuda_graphs=not ns.no_cuda_graphs,
            quota=ns.quota,
            draft_tokens=spec.draft_tokens if spec is not None else 0,
            tier_reads=ns.tier_reads,
            expert_kernel=ns.expert_kernel,
            prefill_lanes=ns.prefill_lanes,
        )
        trace = read_trace(ns.trace) if ns.trace else None
        result = plan(
            model.args,
            model.specs,
            model.experts,
            device,
            context,
            ns.batch,
            options,
            trace,
            model_name=model.name,
            notes=model.notes,
        )
    except EdgerunError as exc:
        print(f"edgerun plan: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    sys.stdout.write(render(result, ns.format))
    if not result.fits:
        if ns.format != "table":  # the table states the refusal; JSON and YAML are for programs
            print(f"edgerun plan: {result.refusal.message}", file=sys.stderr)
        return EXIT_REFUSED
    return EXIT_FITS


def plan_for_bundle(
    bundle: str | Path,
    profile: str | Path | DeviceProfile,
    context: int | None = None,
    batch: int = 1,
    providers: ProviderPolicy | None = None,
    resident: Mapping[str, int] | None = None,
    quota: int | None = None,
    trace: str | Path | None = None,
    draft_tokens: int = 0,
    tier_reads: str | None = None,
    expert_kernel: str = "cpu",
    prefill_lanes: int | None = None,
    dense_dtype: str | None = None,
    cache_policy: str | None = None,
):
    """The plan the engine sizes its expert cache by (default options; context None: the
    model's maximum, capped at 4096; ``quota``: exactly this many slots per layer, checked;
    ``trace``: a route trace whose miss curves size per-layer quotas and predict misses).
    ``resident``: bytes per category that loading measured, in place of the estimate from the
    tensor inventory. ``draft_tokens``: speculative decoding with the MTP head (its bytes, which
    loading has not measured yet, and its verify windows' quota floor). ``expert_kernel``: the CPU
    expert kernel that will run (engine/setup.plan_kernel); by default torch's, whose repacked copy
    of each int4 slot is the most a CPU kernel holds. ``dense_dtype``: the engine's compute dtype
    (fp32 | bf16 | fp16) when asked for; None: the device's (planner.runtime_dtype).
    ``cache_policy``: the expert cache's (None: its default), whose spill rows the plan counts."""
    model = inputs.from_bundle(bundle, providers)
    device = profile if isinstance(profile, DeviceProfile) else load_device_profile(profile)
    if draft_tokens:
        model = inputs.with_mtp(model, draft_tokens)
        if resident is not None and A.MTP not in resident:  # the head loads after the re-plan
            width = dense_dtype or runtime_dtype(device)
            head = resident_bytes(model.specs, width)[A.MTP]
            if device.has_cuda:  # its routed experts held as blocks (engine/streaming.HeldExperts)
                head += held_mtp_delta(model.specs, model.experts, width)
            resident = {**resident, A.MTP: head}
    return plan(
        model.args,
        model.specs,
        model.experts,
        device,
        context or min(DEFAULT_CONTEXT, model.args.max_position_embeddings),
        batch,
        PlanOptions(
            dense=model.dense or DenseScheme(),
            quota=quota,
            draft_tokens=draft_tokens,
            tier_reads=tier_reads or PlanOptions.tier_reads,
            expert_kernel=expert_kernel,
            prefill_lanes=prefill_lanes,
            dense_dtype=dense_dtype,
            cache_policy=cache_policy,
        ),
        read_trace(trace) if trace is not None else None,
        model_name=model.name,
        resident=resident,
        notes=model.notes,
    )


def plan_resident(
    model: str | Path | None,
    profile: str | Path,
    context: int | None = None,
    *,
    device: str = "cpu",
    dtype: str = "fp32",
    providers: ProviderPolicy | None = None,
    batch: int = 1,
    draft_tokens: int = 0,
    prefill_lanes: int | None = None,
):
    """(plan, streamed): the plan of an HF checkpoint (None: the shipped demo model) loaded
    whole, every expert resident in ``dtype`` (bf16, fp16 or fp32: what torch computes in), and,
    when that does not fit, the plan of the same model converted to an int4 bundle and streamed
    (None when it fits). ``draft_tokens``: speculative decoding with the MTP head (planned too);
    ``prefill_lanes``: a batch's prompts prefilled at once (None: PlanOptions' default)."""
    path = Path(model) if model is not None else DEMO_MODEL
    device_profile = load_device_profile(profile)

    def source(quant: str) -> inputs.ModelInput:
        m = inputs.from_checkpoint(path, quant, None, providers)
        return inputs.with_mtp(m, draft_tokens) if draft_tokens else m

    src = source("bf16")
    context = context or min(DEFAULT_CONTEXT, src.args.max_position_embeddings)
    scale = DTYPE_BYTES[dtype] / DTYPE_BYTES["bf16"]
    experts = ExpertSource(
        dtype, 0, tuple(int(b * scale) for b in src.experts.block_bytes), f"{path} (resident)"
    )
    options = PlanOptions(
        dense_dtype=dtype,
        kv_dtype=dtype,  # the engine's KV follows its compute dtype
        quota=src.args.num_experts,
        staging_buffers=1,  # nothing is read at run time; the planner wants one buffer per layout
        cuda_graphs=device == "cuda",
        draft_tokens=draft_tokens,
        prefill_lanes=prefill_lanes,
        # a checkpoint loaded whole holds its head's experts as the model's: stacked, or on CUDA as
        # bf16 blocks (engine/streaming.hold_resident_experts): the same bytes where an expert's
        # weights fill whole 4 KiB pages (Qwen3.6, Qwen3-30B, the demo), and an 8-byte slot an expert
        mtp_held=False,
    )
    args = (src.args, src.specs, experts, device_profile, context, batch, options, None)
    whole = plan(*args, model_name=src.name, notes=src.notes)
    if whole.fits:
        return whole, None
    int4 = source("int4")
    streamed = plan(
        int4.args,
        int4.specs,
        int4.experts,
        device_profile,
        context,
        batch,
        PlanOptions(
            dense_dtype=dtype,  # the bundle runs in the dtype the checkpoint would
            cuda_graphs=device == "cuda",
            draft_tokens=draft_tokens,
            prefill_lanes=prefill_lanes,
        ),
        None,
        model_name=int4.name,
    )
    return whole, streamed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="edgerun plan", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
