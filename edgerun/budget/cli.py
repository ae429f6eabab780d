"""``edgerun plan``: say where every byte goes on a device, or refuse and say what would fit.

Exit status: 0 the plan fits, 1 it does not (the refusal names what would), 2 bad input."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from pathlib import Path

from edgerun.budget import inputs
from edgerun.budget.planner import DTYPE_BYTES, PlanOptions, plan
from edgerun.budget.report import FORMATS, render
from edgerun.bundle.dense_layout import DenseScheme, add_dense_arguments
from edgerun.bundle.layout import QUANTS
from edgerun.config import load_device_profile
from edgerun.errors import EdgerunError
from edgerun.models.providers import ProviderPolicy, add_provider_arguments
from edgerun.tools.routes import read_trace

EXIT_FITS, EXIT_REFUSED, EXIT_ERROR = 0, 1, 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device", required=True, metavar="PROFILE", help="device profile YAML (configs/*.yaml)"
    )
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--bundle", metavar="DIR", help="an edgerun bundle (reads manifest.json)")
    src.add_argument(
        "--checkpoint",
        metavar="PATH",
        help="an HF checkpoint directory (reads config.json only) or a GGUF file (reads its header only)",
    )
    src.add_argument(
        "--config", metavar="FILE", help="a bare HF config.json: plan before downloading weights"
    )
    parser.add_argument(
        "--context", type=int, default=4096, help="tokens per sequence, prompt + output (4096)"
    )
    parser.add_argument("--batch", type=int, default=1, help="sequences decoded together (1)")
    parser.add_argument(
        "--trace", metavar="FILE", help="route trace (JSONL) to size quotas and predict misses"
    )
    parser.add_argument("--format", choices=FORMATS, default="table")
    parser.add_argument(
        "--quant", choices=QUANTS, default=None, help="expert quantization without a bundle (int4)"
    )
    parser.add_argument("--group-size", type=int, default=None, help="quantization group (int4 default 32)")
    add_dense_arguments(parser, default=None, what=" (without a bundle; a bundle's manifest says)")
    parser.add_argument("--dense-dtype", choices=tuple(DTYPE_BYTES), default="bf16")
    parser.add_argument("--kv-dtype", choices=tuple(DTYPE_BYTES), default="bf16")
    parser.add_argument(
        "--quota", type=int, default=None, help="exact expert slots per layer (default: most that fit)"
    )
    parser.add_argument("--staging-buffers", type=int, default=None, help="pinned read buffers (2 x top_k)")
    parser.add_argument("--prefill-chunk", type=int, default=512, help="tokens per prefill forward (512)")
    parser.add_argument("--no-cuda-graphs", action="store_true", help="plan no CUDA graph pool")
    add_provider_arguments(parser)


def run(ns: argparse.Namespace) -> int:
    try:
        device = load_device_profile(ns.device)
        providers = ProviderPolicy.from_namespace(ns)
        if ns.bundle:
            if any(v is not None for v in (ns.quant, ns.group_size, ns.dense, ns.lm_head, ns.dense_group)):
                raise EdgerunError(
                    "--quant / --group-size / --dense / --lm-head / --dense-group do not apply to --bundle: "
                    "its manifest says"
                )
            model = inputs.from_bundle(ns.bundle, providers)
        elif ns.checkpoint:
            model = inputs.from_checkpoint(ns.checkpoint, ns.quant or "int4", ns.group_size, providers)
        else:
            model = inputs.from_config_file(ns.config, ns.quant or "int4", ns.group_size, providers)
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
        )
        trace = read_trace(ns.trace) if ns.trace else None
        result = plan(
            model.args,
            model.specs,
            model.experts,
            device,
            ns.context,
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
        print(f"edgerun plan: {result.refusal.message}", file=sys.stderr)
        return EXIT_REFUSED
    return EXIT_FITS


def plan_for_bundle(
    bundle: str | Path,
    profile: str | Path,
    context: int | None = None,
    batch: int = 1,
    providers: ProviderPolicy | None = None,
    resident: Mapping[str, int] | None = None,
):
    """The plan the engine sizes its expert cache by (default options; context None: the
    model's maximum, capped at 4096). ``resident``: bytes per category that loading measured,
    in place of the estimate from the tensor inventory."""
    model = inputs.from_bundle(bundle, providers)
    context = context or min(4096, model.args.max_position_embeddings)
    return plan(
        model.args,
        model.specs,
        model.experts,
        load_device_profile(profile),
        context,
        batch,
        PlanOptions(dense=model.dense or DenseScheme()),
        None,
        model_name=model.name,
        resident=resident,
        notes=model.notes,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="edgerun plan", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
