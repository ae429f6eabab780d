"""Speculative decoding with the MTP head against plain decoding, on this machine's CPU or GPU.

    edgerun bench speculative [--model DIR] [--draft-tokens 1,2,3] [--max-tokens 96] [--repeats 5]
                              [--warmup 1] [--device cpu|cuda] [--graphs auto|on|off] [--quota Q]

One runner decodes plainly, one per K speculatively (``--speculative mtp --draft-tokens K``),
same model, same threads. ``--warmup`` untimed rounds first run every configuration over the
prompts (kernel builds, graph captures, first reads: not a decode rate). Each repeat then runs
each prompt through every configuration in turn (interleaved a prompt at a time, so load on a
shared machine, or a GPU's changing clocks, hit them alike): greedy, and sampled at
``--temperature`` (seeded). A configuration's decode rate in a repeat is its generated tokens
after the first over its decode time, summed over the prompts; the table gives the median and
range over repeats, the MTP acceptance (accepted / drafted drafts) and tokens per verify step,
and the speed-up: the median rate over plain decoding's median rate in the same run, and paired
(each prompt's rate over plain's for the same prompt in the same repeat: median and range). On CUDA
(``--device cuda``) both decode through the decode step's kernels, replayed from CUDA graphs
(``--graphs``), a verify window of K + 1 rows as one step (``engine/graphs.DecodeGraphs.verify``).
A bundle's experts are dequantized into resident tensors, as ``generate`` holds a bundle without
``--quota`` or ``--profile`` (on CUDA held as bf16 blocks for the expert kernels, as a checkpoint's
are); with ``--quota Q`` they run from the expert cache's slots,
Q a layer, as ``serve`` runs a bundle (every expert: the table-mode kernels, and on CUDA the MTP
head's experts held as blocks too).

Greedy output must equal plain greedy's token for token: a configuration whose tokens differ
prints no rate (``MISMATCH``). Sampled output is not compared (drafting draws from the
generator too); its rate and acceptance are. The MTP configurations verify sampled requests
(``speculative_sampled: verify``, the rejection test on the host) to measure that path; a
server's default decodes them plainly. Greedy continuations of a small model loop, which
a draft predicts easily: the sampled rows are the more realistic acceptance.

Writes ``speculative.json`` and ``speculative.md`` to ``--out`` when given; prints the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

PROMPTS = (
    "And God said",
    "In the beginning",
    "The LORD is my",
    "And it came to pass",
    "Blessed are the",
    "Then Jesus answered",
)


def _ks(text: str) -> list[int]:
    try:
        return [int(k) for k in text.split(",")]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--draft-tokens wants integers like 1,2,3: {exc}") from exc


def run_prompt(runner, ids: list[int], params) -> dict:
    """One prompt through ``runner``: its tokens, decode steps and time, MTP counts, wall span."""
    start = time.time()
    events = list(runner.generate(runner.request(ids, params)))
    stats = events[-1].stats
    return {
        "tokens": [e.token_id for e in events if e.token_id is not None],
        "steps": max(stats.generated_tokens - 1, 0),
        "seconds": stats.decode_s,
        "spec": stats.speculative,
        "when": [start, time.time()],
    }


def total(prompts: list[dict]) -> dict:
    """A configuration's repeat: its prompts' tokens, and their summed steps over summed time."""
    from edgerun.engine.speculative import SpeculativeStats

    spec = SpeculativeStats()
    for r in prompts:
        if r["spec"] is not None:
            spec.add(r["spec"])
    seconds = sum(r["seconds"] for r in prompts)
    rate = sum(r["steps"] for r in prompts) / seconds if seconds else 0.0
    each = [r["steps"] / r["seconds"] if r["seconds"] else 0.0 for r in prompts]
    return {"tokens": [r["tokens"] for r in prompts], "rate": rate, "spec": spec, "each": each}


def summarize(name: str, runs: list[dict], plain: list[dict] | None, identical: bool | None) -> dict:
    """A configuration's row: its rate over repeats, MTP counts, and against ``plain``'s runs (None
    for plain itself) the speed-up: median over median, and paired: each prompt's rate over
    plain's for the same prompt in the same repeat, run just before it (a drift of the machine's
    pace between repeats cancels out), their median and range."""
    rates = [r["rate"] for r in runs]
    spec = runs[0]["spec"].__class__()
    for r in runs:
        spec.add(r["spec"])
    row = {
        "config": name,
        "median": statistics.median(rates),
        "min": min(rates),
        "max": max(rates),
        "identical": identical,
        "acceptance": spec.acceptance if spec.drafted else None,
        "tokens_per_step": spec.tokens_per_step if spec.steps else None,
    }
    row["speedup"] = row["median"] / statistics.median(r["rate"] for r in plain) if plain else None
    row["paired"] = None
    if plain:
        ratios = [a / b for r, q in zip(runs, plain) for a, b in zip(r["each"], q["each"]) if b > 0]
        row["paired"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    return row


def markdown(result: dict) -> str:
    lines = [
        "| sampling | config | decode tok/s, median (range) | acceptance | tok/step | speed-up | output |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mode, rows in result["modes"].items():
        for r in rows:
            ok = {True: "= plain", False: "MISMATCH", None: "-"}[r["identical"]]
            rate = "-" if r["identical"] is False else f"{r['median']:.1f} ({r['min']:.1f} to {r['max']:.1f})"
            acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.0%}"
            tps = "-" if r["tokens_per_step"] is None else f"{r['tokens_per_step']:.2f}"
            up = "-" if r["speedup"] is None or r["identical"] is False else f"{r['speedup']:.2f}x"
            if up != "-" and r["paired"] is not None:
                pr = r["paired"]
                up += f" (paired {pr['median']:.2f}x, {pr['min']:.2f} to {pr['max']:.2f})"
            lines.append(f"| {mode} | {r['config']} | {rate} | {acc} | {tps} | {up} | {ok} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="edgerun bench speculative",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", type=Path, default=None, help="model dir with an MTP head (default: the demo)")
    p.add_argument("--draft-tokens", type=_ks, default=[1, 2, 3], help="the K to run, e.g. 1,2,3")
    p.add_argument("--max-tokens", type=int, default=96, help="tokens generated per prompt")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds of every configuration first")
    p.add_argument(
        "--prompts", type=int, default=len(PROMPTS), help=f"how many of the {len(PROMPTS)} prompts"
    )
    p.add_argument("--temperature", type=float, default=0.8, help="the sampled rows' temperature (0: none)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: as generate picks)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where to decode (default cpu)")
    p.add_argument("--graphs", choices=["auto", "on", "off"], default="auto", help="CUDA graphs (cuda only)")
    p.add_argument(
        "--quota", type=int, default=None,
        help="a bundle's experts through the expert cache, this many slots a layer (default: resident stacked)",
    )  # fmt: skip
    p.add_argument(
        "--window-rows", choices=["auto", "shared", "alone"], default="auto",
        help="a verify window's projections: one GEMV for all rows where probed equal (auto), or each row "
        "by programs of its own (alone); the same bits, a measurement switch (CUDA)",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=None)
    ns = p.parse_args(argv)
    if ns.repeats < 1 or ns.warmup < 0:
        p.error(f"--repeats must be >= 1 and --warmup >= 0 (got {ns.repeats} and {ns.warmup})")

    from edgerun.config import CacheConfig
    from edgerun.engine.sampler import SamplingParams
    from edgerun.engine.setup import runtime
    from edgerun.engine.speculative import SpeculativeConfig

    rt = runtime(ns.device, threads=ns.threads, graphs=ns.graphs, window_rows=ns.window_rows)

    def load(spec=None):
        cache = CacheConfig(ns.quota) if ns.quota else None
        return rt.load(ns.model, progress=False, cache=cache, speculative=spec)

    plain = load()
    runners = {"plain": plain}
    for k in ns.draft_tokens:
        runners[f"MTP K={k}"] = load(SpeculativeConfig("mtp", k, sampled="verify"))
    if plain.tokenizer is None:
        raise SystemExit(f"{ns.model}: no tokenizer.json to encode the prompts with")
    prompts = [plain.tokenizer.encode(t) for t in PROMPTS[: ns.prompts]]
    modes = {"greedy": SamplingParams(max_tokens=ns.max_tokens, ignore_eos=True)}
    if ns.temperature > 0:
        modes[f"T={ns.temperature}"] = SamplingParams(
            max_tokens=ns.max_tokens, temperature=ns.temperature, seed=0, ignore_eos=True
        )

    import torch

    # a prompt at a time through every configuration in turn: a change of the machine's pace (its
    # clocks, other load) within a repeat falls on every configuration alike
    runs = {(m, name): [] for m in modes for name in runners}
    timed = []  # every timed prompt run
    for i in range(ns.warmup + ns.repeats):
        for m, params in modes.items():
            done = {name: [] for name in runners}
            for ids in prompts:
                for name, runner in runners.items():
                    done[name].append(run_prompt(runner, ids, params))
            if i >= ns.warmup:
                for name, prompt_runs in done.items():
                    runs[(m, name)].append(total(prompt_runs))
                    timed += [(m, name, r) for r in prompt_runs]
    result = {
        "model": str(ns.model or "demo"),
        "device": ns.device,
        "threads": torch.get_num_threads(),
        "prompts": len(prompts),
        "max_tokens": ns.max_tokens,
        "repeats": ns.repeats,
        "warmup": ns.warmup,
        "quota": ns.quota,
        "row_step_ms": {name: r.row_step_s * 1e3 for name, r in runners.items() if r.speculative},
        # how each configuration ran: its steps by kind, where its sampled tokens were drawn, and
        # every fallback in force (a rate is only comparable between paths that say the same)
        "runners": {
            name: {
                "decode_steps": r.decode_counts(),
                "sampled_tokens": dict(r.sampled),
                "fallbacks": r.fallbacks(),
                "kernels": r.kernel_summary(),
            }
            for name, r in runners.items()
        },
        "modes": {},
        # every timed prompt run in the order it ran: its wall-clock span (Unix seconds) beside its
        # decode rate, to set against a log of the machine's clocks
        "runs": [
            {
                "mode": m,
                "config": name,
                "start": r["when"][0],
                "end": r["when"][1],
                "rate": r["steps"] / r["seconds"] if r["seconds"] else 0.0,
            }
            for m, name, r in sorted(timed, key=lambda t: t[2]["when"][0])
        ],
    }
    for m in modes:
        base = runs[(m, "plain")]
        want = base[0]["tokens"]
        rows = []
        for name in runners:
            same = None
            if m == "greedy":  # every repeat of every configuration, token for token
                same = all(r["tokens"] == want for r in runs[(m, name)])
            rows.append(summarize(name, runs[(m, name)], None if name == "plain" else base, same))
        result["modes"][m] = rows
    table = markdown(result)
    print(
        f"{result['model']} on {ns.device}, {result['prompts']} prompts x {ns.max_tokens} tokens, "
        f"{ns.repeats} repeats after {ns.warmup} untimed, {result['threads']} thread(s)\n{table}",
        end="",
    )
    for name, how in result["runners"].items():
        fallbacks = "; ".join(f"{k}: {v}" for k, v in how["fallbacks"].items()) or "none"
        print(
            f"  {name}: steps {how['decode_steps']}, sampled tokens drawn {how['sampled_tokens']}, "
            f"fallbacks: {fallbacks}"
        )
    print(f"  kernels (plain): {result['runners']['plain']['kernels']}")
    if ns.out is not None:
        ns.out.mkdir(parents=True, exist_ok=True)
        (ns.out / "speculative.json").write_text(json.dumps(result, indent=1) + "\n")
        (ns.out / "speculative.md").write_text(table)
    mismatched = [r["config"] for r in result["modes"]["greedy"] if r["identical"] is False]
    if mismatched:
        print(f"greedy output differs from plain decoding: {', '.join(mismatched)}", file=sys.stderr)
        return 1
    return 0
