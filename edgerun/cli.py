"""edgerun's one entry point: ``edgerun <command> ...``."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from edgerun.engine.setup import DTYPES, read_warm
from edgerun.errors import EdgerunError
from edgerun.flags import (
    EXIT_USAGE,
    add_device_arguments,
    add_model_argument,
    add_speculative_arguments,
    parse_context,
    positive_int,
    prefetch_ahead,
    speculative_config,
)
from edgerun.models.providers import ProviderPolicy, add_provider_arguments
from edgerun.server.cli import (
    add_kernel_arguments,
    add_plan_file_arguments,
    add_prefetch_argument,
    add_read_arguments,
)


def _add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """How the model is loaded and run: shared by generate, trace (and, as flags, by serve)."""
    from edgerun.progress import add_progress_argument

    add_progress_argument(p)
    add_model_argument(
        p,
        "HF checkpoint dir, or bundle dir whose experts stream with --quota or --profile "
        "(default: the shipped demo model)",
    )
    add_device_arguments(
        p,
        "device profile (configs/*.yaml): the model is planned against it and refused if it does not "
        "fit; a bundle streams with the plan's quotas",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="compute dtype (auto: on cpu bfloat16 with AMX, else float32; on cuda the checkpoint's)",
    )
    p.add_argument(
        "--context",
        type=parse_context,
        default=None,
        help="max context length: 4096 or 32k (default: the model's)",
    )
    p.add_argument(
        "--prefill-chunk", type=positive_int, default=512, help="prompt tokens a prefill step takes at once"
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for torch (default: 1 for models up to 100M params, else one per core; idle OpenMP threads sleep)",
    )
    p.add_argument(
        "--quota",
        type=int,
        default=None,
        help="--model is a bundle: stream routed experts through this many cache slots per layer "
        "(with --profile: checked against its plan; default: the plan's)",
    )
    p.add_argument(
        "--host-quota",
        type=int,
        default=None,
        help="--quota on a CUDA device: a pinned host tier of this many experts per layer behind the device slots",
    )
    add_read_arguments(p)
    add_prefetch_argument(p)
    add_kernel_arguments(p)
    add_provider_arguments(p)


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text (in-process; through a running daemon with --socket)")
    p.add_argument("prompt", nargs="?", help="prompt text (omit with --token-ids)")
    _add_engine_arguments(p)
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="nucleus sampling: keep the smallest set of tokens of this mass",
    )
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument(
        "--chat", action="store_true", help="wrap the prompt as a user message in the chat template"
    )
    p.add_argument("--token-ids", default=None, help="prompt as comma-separated token ids instead of text")
    add_plan_file_arguments(p)
    p.add_argument(
        "--socket",
        type=Path,
        default=None,
        help="send the request to a running daemon at this socket instead of loading a model here",
    )
    add_speculative_arguments(p)
    p.add_argument("-q", "--quiet", action="store_true", help="no start-up line")
    p.set_defaults(func=run_generate)


def run_generate(ns: argparse.Namespace) -> int:
    from edgerun.engine.provenance import cache_line, provenance
    from edgerun.engine.sampler import SamplingParams

    if (ns.prompt is None) == (ns.token_ids is None):
        raise EdgerunError("give either a prompt or --token-ids (exactly one)")
    if ns.socket is not None:
        from edgerun.server.client import generate_over_socket

        _refuse_local_flags(ns)
        return generate_over_socket(ns)
    params = SamplingParams(
        max_tokens=ns.max_tokens,
        temperature=ns.temperature,
        top_p=ns.top_p,
        top_k=ns.top_k,
        seed=ns.seed,
        stop=tuple(ns.stop),
        ignore_eos=ns.ignore_eos,
    )
    rt = _runtime(ns)
    providers = ProviderPolicy.from_namespace(ns)
    spec = speculative_config(ns)
    draft = spec.draft_tokens if spec is not None else 0
    cache, plan, _ = _cache_config(
        ns, rt, providers, warm=read_warm(ns.warm), trace=ns.trace, draft_tokens=draft
    )
    prefix = f"edgerun {ns.command}: "
    log = None if ns.quiet else (lambda line: print(prefix + line, file=sys.stderr, flush=True))
    runner = rt.load(
        ns.model,
        progress=ns.progress,
        providers=providers,
        cache=cache,
        log=log,
        max_context=ns.context,
        prefill_chunk=ns.prefill_chunk,
        speculative=spec,
    )
    if not ns.quiet:
        print(
            prefix + provenance(runner, ns.model, str(ns.profile) if ns.profile else None, plan),
            file=sys.stderr,
            flush=True,
        )

    if ns.token_ids is not None:
        try:
            ids = [int(t) for t in ns.token_ids.replace(",", " ").split()]
        except ValueError as exc:
            raise EdgerunError(f"--token-ids must be integers separated by commas: {exc}") from exc
    else:
        if runner.tokenizer is None:
            raise EdgerunError(f"{ns.model}: no tokenizer.json; pass --token-ids")
        if ns.chat:
            ids = runner.tokenizer.encode_chat([{"role": "user", "content": ns.prompt}])
        else:
            ids = runner.tokenizer.encode(ns.prompt)
    request = runner.request(
        ids, params, prompt_field="--token-ids" if ns.token_ids else "prompt", max_tokens_field="--max-tokens"
    )

    warmed = runner.warm_up(request)
    if warmed and not ns.quiet:
        print(prefix + warmed, file=sys.stderr, flush=True)
    stats = None
    for event in runner.generate(request):
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
    if runner.cache is not None:
        # the tokens that ran through the model: the last one generated was never fed back (and
        # a warm-up step whose lookups the cache counted)
        ran = stats.prompt_tokens + max(stats.generated_tokens - 1, 0) + runner.warm_tokens
        print(f"[{cache_line(runner.cache, ran)}]", file=sys.stderr)
    return 0


def _runtime(ns: argparse.Namespace):
    """The runtime of a command that loads a model here (``_add_engine_arguments``' flags)."""
    from edgerun.engine.setup import runtime

    return runtime(
        ns.device, ns.dtype, ns.threads, ns.expert_kernel, ns.dense_kernel, ns.graphs, ns.profile,
        dense_act=ns.dense_act, expert_act=ns.expert_act,
    )  # fmt: skip


# generate's flags that load and run a model here: a daemon (--socket) has its own, so they
# would be ignored
_LOCAL_FLAGS = (
    "model", "device", "dtype", "context", "prefill_chunk", "threads", "quota", "profile", "read_mode",
    "host_quota", "read_depth", "reader", "read_pieces", "prefetch", "prefetch_ahead", "cache_policy", "expert_kernel", "graphs", "dense_kernel", "dense_act", "expert_act", "slot_pool", "tier_reads", "cpu_experts", "warm", "trace",
    "allow_provider", "provider", "allow_override", "speculative", "draft_tokens", "speculative_sampled",
)  # fmt: skip


def _refuse_local_flags(ns: argparse.Namespace) -> None:
    """With --socket, a flag that only matters to a model loaded here is an error, not ignored."""
    parser = ns._parser
    given = {  # one name per setting: the first of its spellings (--device, not --torch-device)
        a.dest: a.option_strings[-1]
        for a in reversed(parser._actions)
        if a.dest in _LOCAL_FLAGS and getattr(ns, a.dest, None) != a.default
    }
    given = [given[dest] for dest in dict.fromkeys(a.dest for a in parser._actions) if dest in given]
    if given:
        raise EdgerunError(
            f"--socket sends the request to a running daemon, which has its own model and settings: "
            f"{', '.join(given)} would be ignored; drop {'it' if len(given) == 1 else 'them'}, or drop --socket"
        )


def _cache_config(ns: argparse.Namespace, rt, providers, warm=None, trace=None, draft_tokens: int = 0):
    """How ``generate`` / ``trace`` hold the experts, with the plan's summary (engine/setup.Planned):
    from --quota and/or the --profile plan, which every model is checked against
    (``draft_tokens``: speculative decoding's K, which the plan counts)."""
    from edgerun.engine.setup import plan_experts

    return plan_experts(
        ns.model,
        rt.device,
        ns.dtype,
        quota=ns.quota,
        profile=ns.profile,
        context=ns.context,
        host_quota=ns.host_quota,
        read_mode=ns.read_mode,
        read_depth=ns.read_depth,
        reader=ns.reader,
        read_pieces=ns.read_pieces,
        prefetch=ns.prefetch,
        prefetch_ahead=ns.prefetch_ahead,
        policy=ns.cache_policy,
        pool=ns.slot_pool,
        tier_reads=ns.tier_reads,
        cpu_experts=ns.cpu_experts,
        warm=warm,
        trace=trace,
        providers=providers,
        draft_tokens=draft_tokens,
        expert_kernel=ns.expert_kernel or "auto",
    )


# Subcommands that live in their own package: (name, module, add-arguments, run, help).
SUBCOMMANDS = (
    (
        "plan",
        "edgerun.budget.cli",
        "add_arguments",
        "run",
        "size resident weights, KV/state and expert quotas against a device profile",
    ),
    (
        "convert",
        "edgerun.bundle.cli",
        "add_convert_arguments",
        "run_convert",
        "HF checkpoint -> expert bundle (bf16, int8, int4)",
    ),
    (
        "verify",
        "edgerun.bundle.cli",
        "add_verify_arguments",
        "run_verify",
        "check a bundle's structure (and hashes with --deep)",
    ),
    (
        "serve",
        "edgerun.server.cli",
        "add_serve_arguments",
        "run_serve",
        "serve the model over a Unix socket (OpenAI-compatible HTTP)",
    ),
    ("chat", "edgerun.server.cli", "add_chat_arguments", "run_chat", "chat with a running daemon"),
)


def _add_package_commands(sub: argparse._SubParsersAction) -> None:
    import importlib

    for name, module, add, run, text in SUBCOMMANDS:
        mod = importlib.import_module(module)  # each defines its flags without torch; runs import it
        p = sub.add_parser(name, help=text)
        getattr(mod, add)(p)
        p.set_defaults(func=getattr(mod, run))


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from edgerun.bench import BENCHES

    p = sub.add_parser(
        "bench",
        help="reproducible benchmarks (decode on a GPU, streaming, the socket)",
        description="\n".join(f"{name}: {text}" for name, (_, text) in BENCHES.items()),
        formatter_class=_RawHelp,
    )
    p.add_argument("name", choices=sorted(BENCHES), help="which benchmark")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its options (edgerun bench NAME --help)")
    p.set_defaults(func=run_bench)


def run_bench(ns: argparse.Namespace) -> int:
    import importlib

    from edgerun.bench import BENCHES

    return importlib.import_module(BENCHES[ns.name][0]).main(ns.args) or 0


def _add_trace(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("trace", help="record which experts each token routes to (JSONL route trace)")
    p.add_argument("prompts", nargs="*", help="prompt texts, generated one after another")
    p.add_argument("--out", type=Path, required=True, help="route trace to write (JSONL)")
    p.add_argument("--frequencies", type=Path, default=None, help="also write a warm-set JSON here")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to decode per prompt")
    p.add_argument(
        "--text",
        type=Path,
        default=None,
        help="instead of prompts: the routes of reading this text file, teacher-forced, each token "
        "its own step as decoding it would be (held-out text for `edgerun simulate --study`)",
    )
    p.add_argument(
        "--segment", type=int, default=512, help="--text: tokens per sequence (a fresh state each)"
    )
    _add_engine_arguments(p)
    p.set_defaults(func=run_trace)


def run_trace(ns: argparse.Namespace) -> int:
    import json

    from edgerun.engine.sampler import SamplingParams
    from edgerun.engine.trace import RouteRecorder
    from edgerun.tools.routes import read_trace
    from edgerun.tools.simulate import frequencies

    if bool(ns.prompts) == (ns.text is not None):
        raise EdgerunError("give either prompts or --text FILE (exactly one)")
    if ns.text is not None and not ns.text.is_file():
        raise EdgerunError(f"--text {ns.text}: no such file")
    if ns.segment is not None and ns.segment < 1:
        raise EdgerunError(f"--segment must be at least 1 token, got {ns.segment}")
    for flag, out in (("--out", ns.out), ("--frequencies", ns.frequencies)):  # before the model runs
        if out is not None and not Path(out).resolve().parent.is_dir():
            raise EdgerunError(f"{flag} {out}: no directory {Path(out).resolve().parent} to write it in")
    rt = _runtime(ns)
    providers = ProviderPolicy.from_namespace(ns)
    cache = _cache_config(ns, rt, providers).cache
    runner = rt.load(
        ns.model,
        progress=ns.progress,
        providers=providers,
        cache=cache,
        max_context=ns.context,
        prefill_chunk=ns.prefill_chunk,
    )
    if runner.tokenizer is None:
        raise EdgerunError(f"{ns.model}: no tokenizer.json to encode the prompts")
    if ns.text is not None:
        rec = RouteRecorder(runner.model, runner.args, ns.out, str(ns.model or "demo"), per_token=True)
        try:
            rec.read_text(runner, runner.tokenizer.encode(ns.text.read_text()), ns.segment)
        finally:
            rec.close()
    else:
        rec = RouteRecorder.for_runner(runner, ns.out, str(ns.model or "demo"))
        try:
            for seq, prompt in enumerate(ns.prompts):
                rec.seq = seq
                runner.generate_ids(runner.tokenizer.encode(prompt), SamplingParams(max_tokens=ns.max_tokens))
        finally:
            rec.close()
    print(f"edgerun trace: {ns.out}: {rec.writer.count} tokens, {rec.step} steps", file=sys.stderr)
    if ns.frequencies:
        freq = frequencies(read_trace(ns.out))
        ns.frequencies.write_text(json.dumps({"frequencies": {str(k): v for k, v in freq.items()}}))
    return 0


def _add_simulate(sub: argparse._SubParsersAction) -> None:
    from edgerun.tools.simulate import POLICIES

    p = sub.add_parser("simulate", help="replay a route trace through cache policies")
    p.add_argument("trace", type=Path)
    p.add_argument("--quota", type=int, nargs="+", required=True, help="slots per layer (one or more)")
    p.add_argument(
        "--policy",
        choices=POLICIES,
        nargs="+",
        default=list(POLICIES),
        help="cache policies to replay (lfu-bypass, the cache's default: LFU with decay that may leave a "
        "miss unheld; lfu: LFU with decay; lru; belady: the optimum when every miss is held)",
    )
    p.add_argument(
        "--prefetch-depth",
        type=int,
        default=0,
        help="replay prefetch too, as the cache with this many prefetch buffers (staging - top_k; "
        "the trace's predicted experts) issues it",
    )
    p.add_argument(
        "--prefetch-ahead",
        type=prefetch_ahead,
        default=1,
        help="with --prefetch-depth: replay the cache reading two layers ahead (2: each layer with half "
        "the buffers; the trace's predicted2 experts) or one (default 1)",
    )
    p.add_argument(
        "--study",
        type=int,
        metavar="FOLDS",
        default=None,
        help="instead: compare LRU, LRU warm-started, LFU with decay, pinned warm set + LRU and Belady, "
        "what each learns fitted on the other folds (leave-one-out over FOLDS contiguous folds), and LRU, "
        "LFU and Belady with the planner's per-layer split of as many slots (/layer), and LFU that may leave a "
        "miss unheld (lfu-bypass, the cache's default) against Belady under the same rule",
    )
    p.set_defaults(func=run_simulate)


def run_simulate(ns: argparse.Namespace) -> int:
    from collections import Counter

    from edgerun.tools.routes import read_trace
    from edgerun.tools.simulate import POLICIES, policy_study, simulate

    if ns.prefetch_depth < 0:
        raise EdgerunError(f"--prefetch-depth must be 0 or more, got {ns.prefetch_depth}")
    if ns.study is not None and (ns.prefetch_depth or ns.policy != list(POLICIES)):
        raise EdgerunError(
            "--study replays its own set of policies without prefetch: drop --policy / --prefetch-depth"
        )
    trace = read_trace(ns.trace)
    E = trace.header.num_experts
    if any(q > E for q in ns.quota):
        print(f"edgerun simulate: quota above the {E} experts a layer has: {E} used", file=sys.stderr)
        ns.quota = list(dict.fromkeys(min(q, E) for q in ns.quota))
    print(
        f"{ns.trace}: {len(trace.tokens)} tokens, {len(trace.header.moe_layers)} MoE layers, "
        f"{trace.header.num_experts} experts, top-{trace.header.top_k}"
    )
    try:
        if ns.study is not None:
            print(
                f"{'policy':19} {'quota':>5} {'misses/token':>13} {'x LRU':>6} {'x LRU/layer':>11} "
                f"{'x Belady, same split':>20} {'x Belady/best':>13}  fitted (most chosen)"
            )
            for quota in ns.quota:
                rows = policy_study(trace, quota, ns.study)
                lru, lru_l, best = (rows[p].misses for p in ("lru", "lru/layer", "belady/best"))
                for r in rows.values():
                    split = r.policy.partition("/")[2]
                    opt = rows[f"belady/{split}" if split and split != "best" else "belady"].misses
                    if "bypass" in r.policy:  # held against the bound of its own rule
                        opt = rows["belady+bypass"].misses
                    fitted = ", ".join(f"{v} x{n}" for v, n in Counter(r.choices).most_common(2))
                    print(
                        f"{r.policy:19} {quota:5d} {r.misses_per_token:13.3f} {r.misses / lru:6.3f} "
                        f"{r.misses / lru_l:11.3f} {r.misses / opt:20.3f} {r.misses / best:13.3f}  {fitted}"
                    )
            return 0
        head = f"{'policy':8} {'quota':>5} {'misses':>8} {'misses/token':>13}"
        print(head + ("  prefetch issued/useful/wasted" if ns.prefetch_depth else ""))
        for quota in ns.quota:
            for policy in ns.policy:
                depth = ns.prefetch_depth if policy != "belady" else 0
                r = simulate(trace, quota, policy, prefetch_depth=depth, prefetch_ahead=ns.prefetch_ahead)
                pf = (
                    "/".join(str(r.prefetch_total(k)) for k in ("issued", "useful", "wasted"))
                    if depth
                    else ""
                )
                print(f"{policy:8} {quota:5d} {r.total_misses:8d} {r.misses_per_token:13.2f}  {pf}".rstrip())
    except ValueError as exc:
        raise EdgerunError(str(exc)) from exc
    return 0


class _Help(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help already states one or there is
    none to state (None, False, a required value)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "default" in text.lower()
            or default is None
            or default is False
            or default == []
            or default == argparse.SUPPRESS
            or not action.option_strings
            or action.required
        ):
            return text
        shown = ",".join(map(str, default)) if isinstance(default, (list, tuple)) else default
        return f"{text} (default: {shown})".strip().replace("%", "%%")


class _RawHelp(_Help, argparse.RawDescriptionHelpFormatter):
    pass


class _Parser(argparse.ArgumentParser):
    """A subcommand's parser: its help shows defaults, and a flag it does not know is reported
    with its own usage (``main`` parses with ``parse_known_args`` and asks the subcommand)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", _Help)
        super().__init__(*args, **kwargs)
        self.set_defaults(_parser=self)


def build_parser() -> argparse.ArgumentParser:
    from edgerun import __version__

    parser = argparse.ArgumentParser(
        prog="edgerun",
        description="Run Mixture-of-Experts models whose experts stream from disk: edgerun COMMAND ... (docs/cli.md).",
    )
    parser.add_argument("--version", action="version", version=f"edgerun {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_generate(sub)
    _add_package_commands(sub)
    _add_trace(sub)
    _add_bench(sub)
    _add_simulate(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    # before torch loads OpenMP: idle OpenMP threads sleep instead of spinning, so a CPU decode
    # does not collapse when other processes share the cores (benchmarks/threads_under_load.py);
    # a value the user set wins
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    parser = build_parser()
    ns, unknown = parser.parse_known_args(argv)
    if unknown:
        getattr(ns, "_parser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    # every message starts ``edgerun COMMAND:`` (docs/cli.md); -v also names the module
    logging.basicConfig(
        level=logging.DEBUG if ns.verbose else logging.WARNING,
        format=f"edgerun {ns.command}: %(message)s" + (" [%(name)s]" if ns.verbose else ""),
    )
    try:
        return ns.func(ns)
    except EdgerunError as exc:
        print(f"edgerun {ns.command}: error: {exc}", file=sys.stderr)
        return getattr(exc, "exit_status", EXIT_USAGE)  # the daemon's failures: 1
    except KeyboardInterrupt:
        try:  # the text so far ends its line; the stats line was not reached
            sys.stdout.write("\n")
            sys.stdout.flush()
            print(f"edgerun {ns.command}: interrupted", file=sys.stderr)
        except OSError:
            pass
        return 130
    except BrokenPipeError:  # `... | head`: whoever read the output has what they wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 141


if __name__ == "__main__":
    sys.exit(main())
