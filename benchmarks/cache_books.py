"""What the expert cache's bookkeeping costs per token at the Qwen3.6-35B-A3B geometry (issue 15).

A decode token looks up every MoE layer's experts once: 40 layers x top-8 of 256 experts. This
times that bookkeeping alone, on a synthetic Zipf(0.8) routing stream (hits and misses mixed):

- ``books``: ``LayerSlots.assign`` per layer (the policy's eviction choice, slots, generations,
  the references a step gets);
- ``cache``: ``ExpertCache.get_many`` per layer, as the streaming layer calls it, on a fake
  bundle whose reader does nothing (no bytes move: the books plus the cache's own per-lookup
  work); ``+prefetch`` also calls ``ExpertCache.prefetch`` for the next layer after each lookup
  with a prediction of its experts (6 of its 8 right), as the decode prefetcher does.

    python benchmarks/cache_books.py [--quota 64 128] [--policy lfu-bypass lfu lru] [--tokens 400] [--rounds 5]
    python benchmarks/cache_books.py --check TRACE.jsonl [--quota 3 4 6 8 12]

Prints misses per token and microseconds per token (all 40 layers), median [range] over rounds,
in the CPU time of the timing thread (``time.thread_time``): on a VM shared with other work the
wall time also counts the waits for a core.
``--check`` replays a route trace's lookups (as ``edgerun simulate`` does) through the cache's
books and through ``cache.policy_reference`` (the definition), LRU, LFU and LFU with bypass at
every decay a study fits, and says whether every lookup's hits, misses, evictions and passed
misses were identical.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from concurrent.futures import Future
from functools import partial
from types import SimpleNamespace

from edgerun.cache.expert_cache import ExpertCache
from edgerun.cache.slots import LayerSlots
from edgerun.config import CacheConfig

LAYERS, EXPERTS, TOP_K = 40, 256, 8  # Qwen3.6-35B-A3B: MoE layers, routed experts, active


def zipf_routes(tokens: int, layers=LAYERS, experts=EXPERTS, top_k=TOP_K, seed=0) -> list[list[list[int]]]:
    """routes[token][layer]: ``top_k`` distinct experts drawn Zipf(0.8) (each layer's own stream)."""
    rng = random.Random(seed)
    weights = [1.0 / (i + 1) ** 0.8 for i in range(experts)]
    perm = [rng.sample(range(experts), experts) for _ in range(layers)]  # each layer's hot experts differ
    out = []
    for _ in range(tokens):
        row = []
        for layer in range(layers):
            drawn = dict.fromkeys(rng.choices(range(experts), weights, k=3 * top_k))
            row.append([perm[layer][e] for e in list(drawn)[:top_k]])
        out.append(row)
    return out


def predictions(routes: list[list[list[int]]], experts=EXPERTS, seed=1) -> list[list[list[int]]]:
    """Each token-layer's experts with the last two replaced by others (a prediction 6/8 right)."""
    rng = random.Random(seed)
    out = []
    for row in routes:
        pred = []
        for ids in row:
            others = [e for e in rng.sample(range(experts), 12) if e not in ids][:2]
            pred.append(ids[:-2] + others)
        out.append(pred)
    return out


class _NullReader:
    """A ``BlockReader`` that reads nothing: every read is done at once, no bytes move."""

    def __init__(self) -> None:
        self.stats = SimpleNamespace(fallbacks={}, fallback_reads={}, rereads=0, wasted_faults=0)
        self._future: Future = Future()  # one done read for all: making futures is the reader's cost
        self._future.set_result(SimpleNamespace(place=lambda to: None, release=lambda fence=None: None))

    def _done(self, *args, **kwargs) -> Future:
        return self._future

    submit = fetch = stage = _done

    def drop(self, future: Future) -> bool:
        return True

    def close(self) -> None:
        pass


def null_cache(quota: int, policy: str, prefetch: bool) -> ExpertCache:
    """An ``ExpertCache`` of the real geometry over a fake bundle (4 KiB blocks, no checksums,
    no scales) whose reads do nothing."""
    block = SimpleNamespace(block_bytes=4096)
    bundle = SimpleNamespace(
        args=SimpleNamespace(moe_layers=tuple(range(LAYERS)), num_experts=EXPERTS, num_experts_per_tok=TOP_K),
        layouts=dict.fromkeys(range(LAYERS), block),
        unchecked="",
        global_scales=lambda layer: None,
        manifest=SimpleNamespace(layer=lambda layer: SimpleNamespace(block_xxh3=None)),
        expert_path=lambda layer: f"L{layer:02d}.bin",
    )
    config = CacheConfig(quotas=quota, policy=policy, prefetch=prefetch, staging=4 * TOP_K)
    cache = ExpertCache(bundle, config)
    for r in cache.readers.values():
        r.close()
    cache.readers = {4096: _NullReader()}
    return cache


def time_books(routes, quota: int, policy: str, warm: int) -> tuple[float, int]:
    """(seconds, misses) of the lookups after the first ``warm`` tokens, through fresh books."""
    spill = [0] * TOP_K if policy == "lfu-bypass" else None  # the cache's spill rows, shared
    books = [LayerSlots(layer, quota, TOP_K, policy, spill) for layer in range(LAYERS)]
    for row in routes[:warm]:
        for table, ids in zip(books, row):
            table.assign(ids)
    before = sum(b.counters.misses for b in books)
    t0 = time.thread_time()
    for row in routes[warm:]:
        for table, ids in zip(books, row):
            table.assign(ids)
    return time.thread_time() - t0, sum(b.counters.misses for b in books) - before


def time_cache(routes, preds, quota: int, policy: str, warm: int) -> tuple[float, int]:
    """The same through ``ExpertCache.get_many`` (and ``prefetch`` of the next layer, if ``preds``)."""
    cache = null_cache(quota, policy, prefetch=preds is not None)

    def run(rows, pred_rows) -> None:
        get, fetch = cache.get_many, cache.prefetch
        for t, row in enumerate(rows):
            for layer, ids in enumerate(row):
                get(layer, ids)
                if pred_rows is not None and layer + 1 < LAYERS:
                    fetch(layer + 1, pred_rows[t][layer + 1])

    run(routes[:warm], preds and preds[:warm])
    before = cache.totals().misses
    t0 = time.thread_time()
    run(routes[warm:], preds and preds[warm:])
    seconds = time.thread_time() - t0
    misses = cache.totals().misses - before
    cache.close()
    return seconds, misses


def check(path: str, quotas: list[int]) -> bool:
    """Whether the books decide every lookup of the trace at path as the reference does."""
    # imported here: the timings also run against a checkout from before the reference existed
    # (PYTHONPATH=that checkout), for a before/after in one sitting
    from edgerun.cache import policy_reference
    from edgerun.cache.policy import BypassLFUSet, LFUSet, LRUSet
    from edgerun.tools.routes import read_trace
    from edgerun.tools.simulate import DECAYS, layer_accesses

    trace = read_trace(path)
    same = True
    for quota in quotas:
        lookups = [layer_accesses(trace, pos, quota) for pos in range(len(trace.header.moe_layers))]
        k = trace.header.top_k
        for name, fast, ref in (
            [("lru", LRUSet, policy_reference.LRUSet)]
            + [
                (f"lfu {d:g}", partial(LFUSet, decay=d), partial(policy_reference.LFUSet, decay=d))
                for d in DECAYS
            ]
            + [
                (
                    f"lfu-bypass {d:g}",
                    partial(BypassLFUSet, decay=d, spill=k),
                    partial(policy_reference.BypassLFUSet, decay=d, spill=k),
                )
                for d in DECAYS
            ]
        ):
            n = evicted = 0
            for steps in lookups:
                a, b = fast(quota), ref(quota)
                for ids in steps:
                    got, want = a.access(ids), b.access(ids)
                    if got != want or a.passed != b.passed:
                        print(f"quota {quota} {name}: lookup {n} differs: {got} != {want}")
                        same = False
                        break
                    n += 1
                    evicted += len(got.evictions)
            print(f"quota {quota} {name}: {n} lookups, {evicted} evictions", flush=True)
    print("identical" if same else "DIFFERENT")
    return same


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quota", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--policy", nargs="+", default=["lfu-bypass", "lfu", "lru"])
    ap.add_argument("--tokens", type=int, default=400, help="timed tokens per round")
    ap.add_argument("--warm", type=int, default=200, help="tokens replayed first, untimed (cache full)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--check", metavar="TRACE", help="compare the books' decisions with the reference's on a trace"
    )
    ns = ap.parse_args()
    if ns.check:
        raise SystemExit(0 if check(ns.check, ns.quota) else 1)
    routes = zipf_routes(ns.warm + ns.tokens)
    preds = predictions(routes)
    print(
        f"{LAYERS} layers x top-{TOP_K} of {EXPERTS} experts, {ns.tokens} tokens after {ns.warm}, {ns.rounds} rounds"
    )
    print("| quota | policy | path | misses/token | us/token, median [range] |")
    print("| --- | --- | --- | --- | --- |")
    for quota in ns.quota:
        for policy in ns.policy:
            for path in ("books", "cache", "cache+prefetch"):
                times, missed = [], 0
                for _ in range(ns.rounds):
                    if path == "books":
                        seconds, missed = time_books(routes, quota, policy, ns.warm)
                    else:
                        p = preds if path == "cache+prefetch" else None
                        seconds, missed = time_cache(routes, p, quota, policy, ns.warm)
                    times.append(seconds / ns.tokens * 1e6)
                print(
                    f"| {quota} | {policy} | {path} | {missed / ns.tokens:.2f} | "
                    f"{statistics.median(times):.0f} [{min(times):.0f}-{max(times):.0f}] |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
