"""Where a streamed decode step's time goes, layer by layer, on the host's clock: for every MoE
layer that looks up its experts on the host, the wait for its router (the GPU), the books, the
reads' set-up, the prefetch it issues, the wait for the prefetches it claims and for its own
reads, and what runs between one layer's lookup and the next (the GPU's segment, the host's
launches). With prefetch on and off, at the read depth and pieces asked for, from one bundle.

    python benchmarks/stream_timeline.py --model BUNDLE --quota 91 [--device cuda] [--prefetch on,off]
        [--read-depth 2] [--read-pieces 2] [--staging 10] [--tokens 24] [--warm 8] [--json out.json]

The engine itself runs unchanged; the timestamps come from wrappers around ``lookup`` (the
graphs' and the model path's), ``ExpertCache._claim`` / ``_read`` / ``prefetch`` and the
futures ``_read`` waits for, so the figures include the wrappers' own cost (a few microseconds
a call). Per configuration: decode tok/s over the timed tokens, then the mean milliseconds a
layer of each phase over every streamed layer of every timed token (the first ``--warm`` tokens
untimed), and the disk's busy share over the timed tokens (a read in flight, the pool's own
clock). What the phases are:

  router     from the step's previous lookup returning (or the token's start) to this lookup's
             call: the GPU's segment (the previous layer's experts, this layer's mixer and router)
             and the host's launches, ending when the router's ids reach the host
  books      lookup's call to ``_read``: the slot table's books, the claim of prefetched reads
             (wrong guesses dropped), the copy stream's ordering
  submit     ``_read``'s start to the prefetch call: the misses' reads queued, scale updates
  prefetch   the next layer's predicted reads staged (0 with prefetch off)
  claimed    waiting for, and placing, this layer's reads a prefetch started
  demand     waiting for this layer's own reads (issued at ``submit``)
  rest       from the last wait to lookup's return (slot tensors, bookkeeping)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import edgerun.engine.graphs as G
import edgerun.engine.streaming as S
from edgerun.bench.decode import release
from edgerun.cache.expert_cache import ExpertCache
from edgerun.engine.policy import KernelPolicy
from edgerun.engine.runner import Runner
from edgerun.engine.sampler import SamplingParams
from edgerun.engine.setup import cache_config

PHASES = ("router", "books", "submit", "prefetch", "claimed", "demand", "rest")


class Clock:
    """Timestamps of one run's lookups: per layer lookup, the marks its wrappers leave."""

    def __init__(self) -> None:
        self.on = False
        self.last = None  # when the previous lookup returned (the router phase starts there)
        self.marks: dict = {}
        self.layers: list[dict[str, float]] = []  # one per timed lookup: phase -> seconds

    def mark(self, name: str) -> None:
        if self.on:
            self.marks[name] = time.perf_counter()


def phases(m: dict[str, float], t0: float, t1: float) -> dict[str, float]:
    """One lookup's phases (seconds, router excepted) from its marks (see the module's doc)."""
    pf = m.get("prefetch", 0.0)
    out = dict.fromkeys(PHASES, 0.0)
    out["prefetch"] = pf
    read = m.get("read")
    if read is None:  # no miss: the lookup was books (and the prefetch it issued)
        out["books"] = t1 - t0 - pf
        return out
    ws = m.get("wait_start", read)
    cd = m.get("claimed_done", ws)
    dd = m.get("demand_done", cd)
    out.update(books=read - t0, submit=ws - read - pf, claimed=cd - ws, demand=dd - cd, rest=t1 - dd)
    return out


def instrument(clock: Clock):
    """Wrap the lookup path; returns a function that undoes it."""
    undo = []

    def patch(owner, name, make):
        old = getattr(owner, name)
        setattr(owner, name, make(old))
        undo.append((owner, name, old))

    def wrap_lookup(old):
        def lookup(cache, layer, rows, device, then=None):
            t0 = time.perf_counter()
            clock.marks = {"call": t0}
            try:
                return old(cache, layer, rows, device, then=then)
            finally:
                t1 = time.perf_counter()
                if clock.on and clock.last is not None:
                    clock.layers.append({**phases(clock.marks, t0, t1), "router": t0 - clock.last})
                clock.last = t1

        return lookup

    patch(G, "lookup", wrap_lookup)
    patch(S, "lookup", wrap_lookup)

    def wrap_read(old):
        def _read(self, layer, table, fills, target, staged=None, then=None):
            clock.mark("read")
            staged = staged or {}

            def queued():
                clock.mark("queued")
                if then is not None:
                    then()
                clock.mark("wait_start")

            # the claimed reads are waited for first, then the layer's own (ExpertCache._read)
            claimed = {f.expert for f in fills if f.expert in staged}
            waits = {"claimed": len(claimed), "demand": len(fills) - len(claimed)}
            counted = {"n": 0}
            for fut in staged.values():
                _timed(fut, clock, counted, waits)
            result = old(self, layer, table, fills, target, staged=staged, then=queued)
            clock.mark("demand_done")
            return result

        return _read

    def _timed(fut, clock, counted, waits):
        real = fut.result

        def result(*a, **k):
            out = real(*a, **k)
            counted["n"] += 1
            if counted["n"] == waits["claimed"]:
                clock.mark("claimed_done")
            return out

        fut.result = result

    patch(ExpertCache, "_read", wrap_read)

    def wrap_prefetch(old):
        def prefetch(self, layer, experts, *ahead):
            t = time.perf_counter()  # two calls a lookup (two ahead): both counted
            try:
                return old(self, layer, experts, *ahead)
            finally:
                if clock.on:
                    clock.marks["prefetch"] = clock.marks.get("prefetch", 0.0) + time.perf_counter() - t

        return prefetch

    patch(ExpertCache, "prefetch", wrap_prefetch)

    def restore():
        for owner, name, old in reversed(undo):
            setattr(owner, name, old)

    return restore


def busy_seconds(cache) -> float:
    return sum(r.stats.wall_seconds for r in cache.readers.values())


def run(ns, prefetch: bool) -> dict:
    cache = cache_config(
        ns.model, quota=ns.quota, prefetch=prefetch, read_depth=ns.read_depth, read_pieces=ns.read_pieces
    )
    if ns.staging is not None:  # staging buffers: prefetch may hold all but top_k of them
        cache = dataclasses.replace(cache, staging=ns.staging)
    cache = dataclasses.replace(cache, prefetch_ahead=ns.prefetch_ahead)
    device = torch.device(ns.device)
    runner = Runner.load(
        ns.model,
        device=ns.device,
        dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
        cache=cache,
        max_context=1 << (ns.prompt + ns.tokens + ns.warm).bit_length(),
        kernels=KernelPolicy(graphs="on" if device.type == "cuda" else "off"),
    )
    clock = Clock()
    restore = instrument(clock)
    prompt = torch.randint(
        0, runner.args.vocab_size, (ns.prompt,), generator=torch.Generator().manual_seed(1)
    )
    params = SamplingParams(max_tokens=ns.warm + ns.tokens, ignore_eos=True)
    n, t_start, busy0 = 0, None, 0.0
    try:
        for ev in runner.generate(runner.request(prompt.tolist(), params)):
            if ev.token_id is None:
                continue
            n += 1
            if n == ns.warm:  # timed from here: the next tokens' lookups
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t_start, busy0 = time.perf_counter(), busy_seconds(runner.cache)
                clock.on, clock.last = True, None
    finally:
        restore()
    wall = time.perf_counter() - t_start
    layers = clock.layers
    out = {
        "prefetch": prefetch,
        "prefetch_depth": runner.cache.prefetch_depth,
        "prefetch_ahead": runner.cache.prefetch_ahead,
        "reads": sorted({(r.depth, r.pieces, r.backend) for r in runner.cache.readers.values()}),
        "tokens": n - ns.warm,
        "tok_s": (n - ns.warm) / wall,
        "lookups_per_token": len(layers) / max(n - ns.warm, 1),
        "disk_busy": (busy_seconds(runner.cache) - busy0) / wall,
        "ms_per_layer": {p: 1e3 * statistics.fmean(x[p] for x in layers) if layers else 0.0 for p in PHASES},
    }
    t = runner.cache.totals()
    out["misses"], out["prefetch_issued"], out["prefetch_useful"] = (
        t.misses,
        t.prefetch_issued,
        t.prefetch_useful,
    )
    release(runner)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True, help="an edgerun bundle")
    p.add_argument("--quota", type=int, required=True, help="expert slots a layer")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--prefetch", default="off,on")
    p.add_argument("--read-depth", type=int, default=None)
    p.add_argument("--read-pieces", type=int, default=None)
    p.add_argument("--staging", type=int, default=None, help="staging buffers (default 2 x top_k)")
    p.add_argument(
        "--prefetch-ahead", type=int, default=1, choices=(1, 2), help="layers prefetch reads ahead"
    )
    p.add_argument("--prompt", type=int, default=8)
    p.add_argument("--tokens", type=int, default=24, help="timed tokens")
    p.add_argument("--warm", type=int, default=8, help="untimed tokens first")
    p.add_argument("--json", type=Path, default=None)
    ns = p.parse_args(argv)
    rows = [run(ns, {"on": True, "off": False}[v]) for v in ns.prefetch.split(",")]
    print("| prefetch | reads (depth, pieces, reader) | tok/s | lookups a token | disk busy | "
          + " | ".join(f"{ph} ms" for ph in PHASES) + " |")  # fmt: skip
    print("| --- | --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in PHASES) + " |")
    for r in rows:
        ms = r["ms_per_layer"]
        print(
            f"| {'on' if r['prefetch'] else 'off'} | {r['reads']} | {r['tok_s']:.2f} | {r['lookups_per_token']:.1f} | "
            f"{100 * r['disk_busy']:.0f}% | " + " | ".join(f"{ms[ph]:.3f}" for ph in PHASES) + " |"
        )
    if ns.json:
        ns.json.write_text(json.dumps({"argv": sys.argv, "rows": rows}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
