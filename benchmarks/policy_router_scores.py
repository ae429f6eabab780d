"""Does the router's whole distribution tell the cache more than the experts it chose? (issue 15)

    python benchmarks/policy_router_scores.py [--text tests/data/kjv_heldout.txt] [--quota 4 6]

LFU with decay counts a lookup's chosen experts (top_k of E). A token's router also scores the
experts it did not choose, and an expert the router nearly chose may be chosen soon. "Soft LFU"
adds ``w`` x the router's softmax probability of every expert to its decayed count at each
lookup, on top of LFU's 1 for each chosen expert (w = 0 is LFU). Measured on the demo's routing
of held-out text (teacher-forced in 512-token sequences, each token a lookup, as
``edgerun trace --text`` records it), under ``edgerun simulate --study``'s protocol: 4
contiguous folds, each scored from a cold cache, the decay (and ``w``) fitted per layer on the
other three folds by their misses. The cache's rules: every miss is read and held after its
lookup; the victims are the held experts outside the lookup with the lowest count (ties: least
recently used). LRU and Belady as the study replays them (``cache.policy.LRUSet``,
``tools.simulate``).

Deterministic: the same numbers on every run (CPU, fp32).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from edgerun.cache.policy import LRUSet
from edgerun.tools.simulate import DECAYS, _belady_misses, replay_set

WEIGHTS = (0.0, 0.1, 0.25, 0.5, 1.0, 2.0)


def routing(text: Path, segment: int = 512) -> tuple[np.ndarray, np.ndarray]:
    """The demo's router over ``text``: (probabilities [L, T, E], chosen ids [L, T, A])."""
    from edgerun.engine.runner import Runner

    runner = Runner.load(None, device="cpu")
    args, E = runner.args, runner.args.num_experts
    probs: dict[int, list] = {i: [] for i in args.moe_layers}
    ids: dict[int, list] = {i: [] for i in args.moe_layers}
    hooks = []
    for i in args.moe_layers:

        def hook(_m, _inputs, out, i=i) -> None:
            probs[i].append(torch.softmax(out[2][:, :E].float(), -1).numpy())
            ids[i].append(out[1].numpy())

        hooks.append(runner.model.model.layers[i].mlp.gate.register_forward_hook(hook))
    tokens = runner.tokenizer.encode(text.read_text())
    with torch.inference_mode():
        for start in range(0, len(tokens), segment):
            part = tokens[start : start + segment]
            runner.prefill(runner.new_state(len(part)), part)
    for h in hooks:
        h.remove()
    return (
        np.stack([np.concatenate(probs[i]) for i in args.moe_layers]),
        np.stack([np.concatenate(ids[i]) for i in args.moe_layers]),
    )


def soft_lfu(ids: np.ndarray, probs: np.ndarray, quota: int, decay: float, w: float) -> int:
    """Misses of soft LFU over lookups ``ids`` [n, A] with router probabilities [n, E]."""
    score = np.zeros(probs.shape[1])
    last = np.full(probs.shape[1], -1)
    held: set[int] = set()
    misses = clock = 0
    for t in range(len(ids)):
        step = list(dict.fromkeys(ids[t].tolist()))
        new = [e for e in step if e not in held]
        misses += len(new)
        excess = len(held) + len(new) - quota
        if excess > 0:
            victims = sorted((e for e in held if e not in step), key=lambda e: (score[e], last[e]))[:excess]
            held.difference_update(victims)
        score *= decay
        if w:
            score += w * probs[t]
        for e in step:
            score[e] += 1.0
            last[e] = clock
            clock += 1
        held.update(new)
    return misses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--text", type=Path, default=Path("tests/data/kjv_heldout.txt"))
    ap.add_argument("--quota", type=int, nargs="+", default=[4, 6])
    ap.add_argument("--folds", type=int, default=4)
    ns = ap.parse_args()
    P, ids = routing(ns.text)
    L, T, _ = P.shape
    cuts = [T * f // ns.folds for f in range(ns.folds + 1)]
    print(f"{T} tokens, {L} MoE layers; misses/token, x LRU, x Belady; fitted: the most common (decay, w)")
    for q in ns.quota:
        total = dict.fromkeys(("lru", "lfu", "soft", "belady"), 0)
        fits: list[tuple[float, float]] = []
        for k in range(ns.folds):
            lo, hi = cuts[k], cuts[k + 1]
            for layer in range(L):
                fit_ids = np.concatenate([ids[layer, :lo], ids[layer, hi:]])
                fit_p = np.concatenate([P[layer, :lo], P[layer, hi:]])
                test_ids, test_p = ids[layer, lo:hi], P[layer, lo:hi]
                total["lru"] += replay_set([r.tolist() for r in test_ids], LRUSet(q))
                total["belady"] += _belady_misses([r.tolist() for r in test_ids], q)
                d = min(DECAYS, key=lambda d: (soft_lfu(fit_ids, fit_p, q, d, 0.0), d))
                total["lfu"] += soft_lfu(test_ids, test_p, q, d, 0.0)
                best = min((soft_lfu(fit_ids, fit_p, q, d, w), d, w) for d in DECAYS for w in WEIGHTS)
                fits.append(best[1:])
                total["soft"] += soft_lfu(test_ids, test_p, q, *best[1:])
        common = max(set(fits), key=fits.count)
        for name, m in total.items():
            fitted = f"  {common}" if name == "soft" else ""
            print(
                f"quota {q:2d} {name:6} {m / T:7.3f}  {m / total['lru']:.3f}  {m / total['belady']:.3f}{fitted}"
            )


if __name__ == "__main__":
    main()
