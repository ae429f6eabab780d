"""`convert` and `verify` subcommands. ``edgerun.cli`` adds them with ``add_*_arguments`` and runs
them with ``run_*``; ``python -m edgerun.bundle.cli convert|verify ...`` runs them alone.

Building the parser imports no torch (``edgerun plan`` shares it): the converter and the reader
are imported by the ``run_*`` functions."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from edgerun.bundle.dense_layout import add_dense_arguments
from edgerun.bundle.layout import QUANTS
from edgerun.errors import EdgerunError
from edgerun.flags import EXIT_NO, EXIT_OK, EXIT_USAGE
from edgerun.models.providers import ProviderPolicy, add_provider_arguments
from edgerun.progress import add_progress_argument

PROG = "edgerun "  # every message starts "edgerun COMMAND:"


def add_convert_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "src",
        nargs="?",
        help="Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json), or a "
        "GGUF file (the first of a split set: NAME-00001-of-0000N.gguf)",
    )
    p.add_argument("dst", nargs="?", help="bundle directory to create (or to resume)")
    p.add_argument(
        "--list-gguf-support",
        action="store_true",
        help="print the GGUF architectures and tensor types convert reads, and exit",
    )
    p.add_argument("--quant", choices=QUANTS, default="bf16", help="routed-expert format (default bf16)")
    p.add_argument(
        "--group",
        type=int,
        default=None,
        help="quantization group size along the input dimension (int8: 0 = per row, the default; "
        "int4: 16 or 32, default 32)",
    )
    p.add_argument("--rotate", action="store_true", help="Hadamard-rotate each group before quantizing")
    p.add_argument(
        "--dense-dtype",
        choices=("bf16", "fp16", "fp32"),
        default=None,
        help="cast resident floating tensors to this dtype (default: keep each tensor's source dtype)",
    )
    add_dense_arguments(p)
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="read safetensors headers only; print the bundle's layout and sizes (with -v every "
        "tensor's classification)",
    )
    p.add_argument(
        "-v", "--verbose", dest="tensors", action="store_true", help="--dry-run: list every source tensor"
    )
    add_progress_argument(p)
    add_provider_arguments(p)


def gguf_support() -> str:
    from edgerun.bundle import gguf_source as G

    archs = ", ".join(f"{a} (as {m})" for a, m in G.ARCHITECTURES.items())
    return (
        f"GGUF architectures: {archs}\n"
        f"GGUF tensor types: {', '.join(G.QUANT_TYPES)} (lossless: {', '.join(G.LOSSLESS)}; the others "
        "are dequantized, then stored in the bundle's --quant / --dense formats)\n"
        f"GGUF tokenizers: byte-level BPE (tokenizer.ggml.model 'gpt2'), pre-tokenizer "
        f"{', '.join(G.PRE_TOKENIZERS)}"
    )


def run_convert(ns: argparse.Namespace) -> int:
    if ns.list_gguf_support:
        print(gguf_support())
        return 0
    if ns.src is None or ns.dst is None:
        if getattr(ns, "_parser", None) is not None:  # the usage first, as argparse's errors
            ns._parser.print_usage(sys.stderr)
        print(f"{PROG}convert: error: the arguments src and dst are required", file=sys.stderr)
        return EXIT_USAGE
    from edgerun.bundle.convert import ConvertOptions, convert, dry_run_report, plan_conversion

    options = ConvertOptions(
        quant=ns.quant,
        group=ns.group,
        rotate=ns.rotate,
        dense_dtype=ns.dense_dtype,
        dense=ns.dense,
        lm_head=ns.lm_head,
        dense_group=ns.dense_group,
    )
    try:
        providers = ProviderPolicy.from_namespace(ns)
        if ns.dry_run:
            plan = plan_conversion(ns.src, options, providers)
            print(dry_run_report(plan, tensors=ns.tensors))
            plan.check()
            return 0
        convert(ns.src, ns.dst, options, log=sys.stderr, tty=ns.progress, providers=providers)
    except EdgerunError as exc:
        print(f"{PROG}convert: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:
        print(f"{PROG}convert: error: {exc}", file=sys.stderr)
        return EXIT_NO
    return EXIT_OK


def add_verify_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dst", help="bundle directory")
    p.add_argument("--deep", action="store_true", help="also hash every file and block against the manifest")
    add_progress_argument(p)
    add_provider_arguments(p)


def run_verify(ns: argparse.Namespace) -> int:
    from edgerun.bundle.verify import verify_bundle

    if not Path(ns.dst).exists():  # nothing to verify: bad input (exit 2), not a failed bundle
        print(f"{PROG}verify: error: {ns.dst}: no such file or directory", file=sys.stderr)
        return EXIT_USAGE
    try:
        report = verify_bundle(
            ns.dst, deep=ns.deep, providers=ProviderPolicy.from_namespace(ns), progress=ns.progress
        )
    except (EdgerunError, OSError) as exc:
        print(f"{PROG}verify: FAILED: {exc}", file=sys.stderr)
        return EXIT_NO
    print(report.summary())
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m edgerun.bundle.cli")
    sub = parser.add_subparsers(dest="command", required=True)
    add_convert_arguments(sub.add_parser("convert", help="convert a checkpoint into a bundle"))
    add_verify_arguments(sub.add_parser("verify", help="check a bundle"))
    ns = parser.parse_args(argv)
    return run_convert(ns) if ns.command == "convert" else run_verify(ns)


if __name__ == "__main__":
    sys.exit(main())
