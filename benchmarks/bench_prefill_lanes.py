"""Prompts that arrive together at a batch: their first tokens with the prompts prefilled one
after another (``--prefill-lanes 1``) against at once in lanes (``engine/graphs.PrefillLanes``),
in process, on CUDA, and whether each request's first tokens are the same either way.

    PYTHONPATH=... python3 benchmarks/bench_prefill_lanes.py BUNDLE [--prompts 4] [--lanes 1,2,4]
        [--tokens 11] [--repeats 5] [--json out.json]

Each round starts ``--prompts`` requests of ``--tokens``-token prompts (distinct random ids, the
same in every configuration) in one engine round, as the daemon's worker admits them, and
advances their generators round by round (``tests/engine/test_batch.together``) until each has
its first token: the time is from the first request to the last first token, median
(range) over ``--repeats`` rounds after a warm-up round (which captures each lane's graphs).
Then a round of two tokens each checks that the rows decode after, with identical ids in every
configuration (asserted).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from edgerun.config import CacheConfig
from edgerun.engine.policy import KernelPolicy
from edgerun.engine.runner import Runner

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "tests" / d) for d in ("engine", "")]
from test_batch import together  # noqa: E402  (the daemon worker's order: a generator a round)


def first_tokens(runner: Runner, prompts: list[list[int]]) -> float:
    """Seconds until every prompt, all joining in one round, has its first token."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    together(runner, prompts, [1] * len(prompts), [0] * len(prompts))
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--lanes", default="1,2,4")
    ap.add_argument("--tokens", type=int, default=11)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quota", type=int, default=256)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    runner = Runner.load(
        a.bundle,
        device="cuda",
        dtype=torch.bfloat16,
        cache=CacheConfig(a.quota),
        kernels=KernelPolicy(),
        max_context=2048,
    )
    g = torch.Generator().manual_seed(0)
    vocab = runner.args.vocab_size
    prompts = [torch.randint(0, vocab, (a.tokens,), generator=g).tolist() for _ in range(a.prompts)]
    report = dict(
        device=torch.cuda.get_device_name(), bundle=str(a.bundle), prompts=a.prompts, tokens=a.tokens
    )
    ids = None
    for lanes in map(int, a.lanes.split(",")):
        runner.enable_batch(max(a.prompts, 2), lanes=lanes)
        first_tokens(runner, prompts)  # warm-up: captures, compiles
        times = [first_tokens(runner, prompts) for _ in range(a.repeats)]
        got = together(runner, prompts, [2] * len(prompts), [0] * len(prompts))  # and a step after
        assert ids is None or got == ids, f"lanes {lanes}: tokens differ from the first configuration's"
        ids = got
        med = statistics.median(times)
        report[f"lanes_{lanes}"] = dict(median_s=med, min_s=min(times), max_s=max(times))
        print(
            f"{a.prompts} prompts of {a.tokens} tokens, lanes {lanes}: last first token after "
            f"{med * 1e3:.1f} ms ({min(times) * 1e3:.1f}-{max(times) * 1e3:.1f}); {runner.kernel_summary()[-60:]}",
            flush=True,
        )
    print("token ids identical in every configuration")
    if a.json:
        a.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
