"""Decode variants A/B in one load: the 40-layer resident step, each variant re-captured and timed alike.

    PYTHONPATH=... python3 -P benchmarks/ab_decode.py --dir /tmp/bd --variant base: \\
        --variant ahead1:edgerun.kernels.qlinear_triton.L2_AHEAD=1 [--rounds 2] [--json out.json]

A variant is ``NAME:module.attr=value[;module.attr=value...]`` (an empty list: the tree as it is):
module attributes an experiment reads at launch time; ``module.attr.field=value`` replaces one
field of a dataclass attribute (a kernel's default tile), ``module.attr.key.field=value`` one
field of a dict attribute's entry (``qlinear_triton.FEW.int4.block_r=8``). The bundle (``edgerun bench decode``'s
synthetic Qwen3.6-35B-A3B geometry, int4 dense and experts by default) is built or reused in
--dir and loaded once, every expert held; for each variant in turn, round after round, the
attributes are set (the others' put back), the decoder re-made (``set_kernels``: its graphs
re-captured), a short eager run lets launch-order experiments learn the step, and then each of
--prompts prompts of --prompt random ids decodes --decode greedy tokens from one CUDA graph a
step (timed; one untimed prompt first). Every variant's tokens must equal the first variant's,
or its row says where they part. Decode tok/s: median (range) over its prompts and rounds.
Same load, same machine, alternating: the comparison METHOD.md asks for.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from edgerun.bench.decode import build_bundle, chain_layers, dense_bytes, one_run, profile_steps, state_bytes
from edgerun.bundle.dense_layout import add_dense_arguments
from edgerun.bundle.reader import Bundle
from edgerun.engine.policy import KernelPolicy
from edgerun.engine.runner import Runner
from edgerun.engine.setup import cache_config
from edgerun.tools import calibrate


def parse_variant(text: str) -> tuple[str, list[tuple[object, str, object]]]:
    """``NAME:mod.attr=value;...`` -> (name, [(module, attr, value)]); values are Python literals
    (numbers, True/False/None, quoted strings), else taken as strings."""
    import ast

    name, _, body = text.partition(":")
    sets = []
    for item in filter(None, body.split(";")):
        target, eq, raw = item.partition("=")
        parts = target.strip().split(".")
        module, rest = None, []
        for i in range(len(parts) - 1, 0, -1):  # the longest importable prefix is the module
            try:
                module, rest = importlib.import_module(".".join(parts[:i])), parts[i:]
                break
            except ImportError:
                continue
        if not eq or module is None or len(rest) not in (1, 2, 3) or not hasattr(module, rest[0]):
            raise SystemExit(f"--variant {text!r}: {item!r} is not module.attr[.key][.field]=value")
        try:
            value = ast.literal_eval(raw.strip())
        except (ValueError, SyntaxError):
            value = raw.strip()
        if len(rest) > 1:  # a field of a dataclass attribute, or (three names) of a dict
            # attribute's entry: a copy with it replaced (after this variant's earlier fields of
            # the same attribute)
            earlier = [v for m, a, v in sets if m is module and a == rest[0]]
            whole = earlier[-1] if earlier else getattr(module, rest[0])
            try:
                if len(rest) == 2:
                    value = dataclasses.replace(whole, **{rest[1]: value})
                else:
                    value = {**whole, rest[1]: dataclasses.replace(whole[rest[1]], **{rest[2]: value})}
            except (TypeError, KeyError) as e:
                raise SystemExit(
                    f"--variant {text!r}: {item!r} is not module.attr[.key][.field]=value ({e})"
                ) from None
        sets.append((module, rest[0], value))
    return name or "base", sets


def layer_table(rows: dict) -> str:
    """The profiled step of each variant by place in a layer (``chain_layers``): µs the step waits
    for each place's launch, the median over the layers of that kind, one column a variant (its
    own layer kinds matched to the first profiled variant's by their kernel names)."""
    profiled = {name: r["profile"]["chain_steps"] for name, r in rows.items() if r.get("profile")}
    if not profiled:
        return ""
    tables = {name: chain_layers(steps) for name, steps in profiled.items()}
    names = list(tables)
    lines = [
        "",
        f"| layer kind | place | kernel | {' | '.join(names)} |",
        "| --- | ---: | --- |" + " ---: |" * len(names),
    ]
    first = tables[names[0]]
    for row in first:
        key = (row["at"], row["kernel"], row["n"])
        cells = []
        for name in names:
            match = [
                r for r in tables[name] if (r["at"], r["kernel"], r["n"]) == key and r["kind"] == row["kind"]
            ]
            cells.append(f"{match[0]['median']:.2f}" if match else "")
        lines.append(f"| {row['kind']} | {row['at']} | {row['kernel'][:24]} | {' | '.join(cells)} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", type=Path, required=True, help="where the bundle is built or found")
    ap.add_argument("--layers", type=int, default=40)
    add_dense_arguments(ap, default="int4")
    ap.add_argument("--variant", action="append", required=True, help="NAME:module.attr=value;... (repeat)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--dense-act", default="int8")
    ap.add_argument("--expert-act", default="int8")
    ap.add_argument("--profile", action="store_true", help="also a torch.profiler step per variant")
    ap.add_argument("--json", type=Path, default=None)
    ns = ap.parse_args()
    if not torch.cuda.is_available():
        print("ab_decode: needs a CUDA GPU", file=sys.stderr)
        return 2
    variants = [parse_variant(v) for v in ns.variant]
    original = {(m, a): getattr(m, a) for _, sets in variants for m, a, _ in sets}
    bundle_dir, _ = build_bundle(ns.dir, ns.layers, ns.dense, ns.lm_head, ns.dense_group)
    bundle = Bundle.open(bundle_dir)
    args = bundle.args
    capacity = 1 << (ns.prompt + ns.decode - 1).bit_length()
    copy = calibrate.device_copy_bandwidth("cuda")["d2d_gb_per_s"]
    # the memory bound as bench decode computes it: dense, the routed experts' blocks, the
    # recurrent state and the KV cache at the mean position, over the device copy
    block = bundle.layouts[args.moe_layers[0]].block_bytes
    _, dense_tok = dense_bytes(bundle)
    _, rec_tok, kv_pos = state_bytes(bundle, capacity)
    per_token = dense_tok + args.num_experts_per_tok * len(args.moe_layers) * block + rec_tok
    per_token += kv_pos * (ns.prompt + ns.decode / 2)
    bound = copy * 1e9 / per_token
    t0 = time.perf_counter()
    runner = Runner.load(
        bundle_dir,
        device="cuda",
        dtype=torch.bfloat16,
        cache=cache_config(Path(bundle_dir), quota=args.num_experts),
        max_context=capacity,
        kernels=KernelPolicy(graphs="off", dense_act=ns.dense_act, expert_act=ns.expert_act),
        prefill_chunk=ns.prompt,
    )
    print(f"{torch.cuda.get_device_name()}: loaded in {time.perf_counter() - t0:.0f} s; device copy "
          f"{copy:.0f} GB/s; {per_token / 1e6:.0f} MB a token: memory bound {bound:.0f} tok/s", flush=True)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, args.vocab_size, (ns.prompt,), generator=g).tolist() for _ in range(ns.prompts + 1)
    ]
    rows: dict[str, dict] = {name: {"tps": [], "tokens": None, "span_us": []} for name, _ in variants}
    reference = None
    for rnd in range(ns.rounds):
        for name, sets in variants:
            if rows[name].get("error"):
                continue
            try:
                for (m, a), v in original.items():
                    setattr(m, a, v)
                for m, a, v in sets:
                    setattr(m, a, v)
                policy = dict(dense_act=ns.dense_act, expert_act=ns.expert_act)
                runner.set_kernels(KernelPolicy(graphs="off", **policy))
                one_run(runner, prompts[0], 8)  # eager: experiments that learn the step's launch order
                runner.set_kernels(KernelPolicy(graphs="on", **policy))
                state = runner.new_state(capacity)
                for _ in range(2):
                    runner.decode_step(state, 0)
                one_run(runner, prompts[0], 16)  # untimed
                runs = [one_run(runner, p, ns.decode) for p in prompts[1:]]
                row = rows[name]
                row["tps"] += [r["decode_tps"] for r in runs]
                tokens = [r["tokens"] for r in runs]
                if reference is None:
                    reference = tokens
                row["tokens"] = row["tokens"] or ("same" if tokens == reference else "differ")
                if tokens != reference:
                    row["tokens"] = "differ"
                row["fallbacks"] = runner.fallbacks()
                row["choices"] = dict(runner.kernels.choices)
                if rnd == 0:
                    print(
                        f"{name}: {runner.kernels.describe()}; fallbacks: {row['fallbacks'] or 'none'}",
                        flush=True,
                    )
                if ns.profile and rnd == 0:
                    prof = profile_steps(runner, capacity)
                    row["profile"] = {
                        k: prof[k]
                        for k in ("kernels_per_step", "span_us", "chain_us", "chain_steps", "last_step")
                    }
                print(
                    f"round {rnd} {name:14s} " + " ".join(f"{r['decode_tps']:.1f}" for r in runs), flush=True
                )
            except Exception as e:  # a variant that cannot run is named; the others still run
                rows[name]["error"] = f"{type(e).__name__}: {e}"[:300]
                print(f"round {rnd} {name:14s} failed: {rows[name]['error']}", flush=True)

    for (m, a), v in original.items():
        setattr(m, a, v)
    base = statistics.median(rows[variants[0][0]]["tps"])
    print(f"\n| variant | decode tok/s median (range) | of the bound ({bound:.0f}) | against {variants[0][0]} | "
          "tokens | span µs |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | --- | ---: |")
    for name, _ in variants:
        r = rows[name]
        if not r["tps"]:
            print(f"| {name} | failed: {r.get('error', 'no runs')} | | | | |")
            continue
        med = statistics.median(r["tps"])
        span = r.get("profile", {}).get("span_us", "")
        print(f"| {name} | {med:.1f} ({min(r['tps']):.1f}-{max(r['tps']):.1f}) | {med / bound:.1%} | {med / base - 1:+.1%} | "
              f"{r['tokens']} | {span} |")  # fmt: skip
    print(layer_table(rows))
    if ns.json:
        out = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "command": " ".join(sys.argv), "copy_gbs": copy, "bytes_per_token": per_token, "bound_tps": bound, "variants": ns.variant, "rows": rows}  # fmt: skip
        ns.json.write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
