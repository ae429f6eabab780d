"""edgerun's one entry point: ``edgerun <command> ...``."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from edgerun.errors import EdgerunError
from edgerun.models.providers import ProviderPolicy, add_provider_arguments

DTYPES = {"auto": None, "float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text in-process (no daemon)")
    p.add_argument("prompt", nargs="?", help="prompt text (omit with --token-ids)")
    p.add_argument(
        "--model", type=Path, default=None, help="HF checkpoint dir (default: the shipped demo model)"
    )
    p.add_argument(
        "--device", choices=("cpu", "cuda"), default=None, help="default: cuda if available, else cpu"
    )
    p.add_argument(
        "--dtype",
        choices=tuple(DTYPES),
        default="auto",
        help="compute dtype (auto: float32 on cpu, the checkpoint's dtype on cuda)",
    )
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument(
        "--chat", action="store_true", help="wrap the prompt as a user message in the chat template"
    )
    p.add_argument("--token-ids", default=None, help="prompt as comma-separated token ids instead of text")
    p.add_argument("--context", type=int, default=None, help="max context length (default: the model's)")
    p.add_argument("--prefill-chunk", type=int, default=512)
    p.add_argument("-q", "--quiet", action="store_true", help="no start-up line")
    add_provider_arguments(p)
    p.set_defaults(func=run_generate)


def run_generate(ns: argparse.Namespace) -> int:
    import torch

    from edgerun.engine.runner import Runner, default_device
    from edgerun.engine.sampler import SamplingParams

    if (ns.prompt is None) == (ns.token_ids is None):
        raise EdgerunError("give either a prompt or --token-ids (exactly one)")
    params = SamplingParams(
        max_tokens=ns.max_tokens,
        temperature=ns.temperature,
        top_p=ns.top_p,
        top_k=ns.top_k,
        seed=ns.seed,
        stop=tuple(ns.stop),
        ignore_eos=ns.ignore_eos,
    )
    device = ns.device or default_device()
    if device == "cuda" and not torch.cuda.is_available():
        raise EdgerunError("--device cuda: no CUDA device is available (use --device cpu)")
    dtype = getattr(torch, DTYPES[ns.dtype]) if DTYPES[ns.dtype] else None
    runner = Runner.load(
        ns.model,
        device=device,
        dtype=dtype,
        providers=ProviderPolicy.from_namespace(ns),
        max_context=ns.context,
        prefill_chunk=ns.prefill_chunk,
    )
    if not ns.quiet:
        print(provenance(runner, ns.model), file=sys.stderr, flush=True)

    if ns.token_ids is not None:
        try:
            ids = [int(t) for t in ns.token_ids.replace(",", " ").split()]
        except ValueError as exc:
            raise EdgerunError(f"--token-ids must be integers separated by commas: {exc}") from exc
    else:
        if runner.tokenizer is None:
            raise EdgerunError(f"{ns.model}: no tokenizer.json; pass --token-ids")
        text = ns.prompt
        if ns.chat:
            text = runner.tokenizer.apply_chat_template([{"role": "user", "content": ns.prompt}])
        ids = runner.tokenizer.encode(text)

    stats = None
    for event in runner.generate(ids, params):
        if event.text:
            sys.stdout.write(event.text)
            sys.stdout.flush()
        elif runner.tokenizer is None and event.token_id is not None:
            sys.stdout.write(f"{event.token_id} ")
            sys.stdout.flush()
        stats = event.stats or stats
    sys.stdout.write("\n")
    sys.stdout.flush()
    print(f"[{stats.line()}]", file=sys.stderr)
    return 0


def provenance(runner, model_dir: Path | None) -> str:
    import torch

    a = runner.args
    n_params = sum(p.numel() for p in runner.model.parameters())
    dtype = next(runner.model.parameters()).dtype
    return (
        f"edgerun: model {model_dir or 'demo'} ({a.model_type}, {a.num_hidden_layers} layers, "
        f"{a.num_experts} experts top-{a.num_experts_per_tok}, {n_params / 1e6:.1f}M params) "
        f"device {runner.device} dtype {str(dtype).removeprefix('torch.')} threads {torch.get_num_threads()} "
        f"experts resident (no streaming); fallbacks: none; {runner.load_summary}"
        + (f"; {runner.provider.describe()}" if runner.provider else "")
    )


def _add_plan(sub: argparse._SubParsersAction) -> None:
    from edgerun.budget import cli as plan_cli

    p = sub.add_parser(
        "plan", help="size resident weights, KV/state and expert quotas against a device profile"
    )
    plan_cli.add_arguments(p)
    p.set_defaults(func=plan_cli.run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edgerun", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_plan(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if ns.verbose else logging.WARNING, format="%(name)s: %(message)s"
    )
    try:
        return ns.func(ns)
    except EdgerunError as exc:
        print(f"edgerun {ns.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
