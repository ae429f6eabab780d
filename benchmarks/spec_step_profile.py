"""Where a decode step's time goes, plain against speculative (issue 17): kernels and GPU time a
step and a token, from torch.profiler, on CUDA.

    python benchmarks/spec_step_profile.py [--model DIR] [--quota Q] [--ks 0,1,2,3] [--out FILE]

For each K (0: plain decoding) one runner loads the model (a bundle through the expert cache
with ``--quota``, as ``serve`` runs it; else as ``generate`` does) with CUDA graphs on, decodes
one prompt greedily twice to warm up (graph capture, Triton compiles), then profiles a 32-token
and a 96-token request. A step's figures are the difference of the two over the difference of
their steps, so the prefill and the request's fixed costs cancel: kernels a step, GPU time a step
(the sum of the kernels' durations) and a token, tokens a step, and the wall time a token of
three unprofiled 96-token requests (median). Every kernel family is listed, the most GPU time
a step first. ``--device cpu`` runs the same on the CPU's torch ops (no graphs), to
check the script without a GPU. A profile of one prompt, not a benchmark: the rates to quote are
``edgerun bench speculative``'s.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import statistics
from pathlib import Path

PROMPT = "And God said, Let there be light: and there was light."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="model dir with an MTP head (default: the demo)")
    ap.add_argument("--quota", type=int, default=None, help="a bundle's expert slots a layer")
    ap.add_argument("--ks", default="0,1,2,3", help="draft tokens to profile (0: plain decoding)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    ap.add_argument(
        "--timeline", action="store_true",
        help="also list one step's kernels in launch order with their durations (CUDA: a step of the "
        "96-token request's middle, its ends found by the step's two copies to the host)",
    )  # fmt: skip
    ns = ap.parse_args()

    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from edgerun.config import CacheConfig
    from edgerun.engine.sampler import SamplingParams
    from edgerun.engine.setup import runtime
    from edgerun.engine.speculative import SpeculativeConfig

    cuda = ns.device == "cuda"
    rt = runtime(ns.device, graphs="on" if cuda else "auto")
    activity, kind = (
        (ProfilerActivity.CUDA, DeviceType.CUDA) if cuda else (ProfilerActivity.CPU, DeviceType.CPU)
    )

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def request(runner, ids, n: int, profiled: bool = False):
        params = SamplingParams(max_tokens=n, ignore_eos=True)
        sync()
        if not profiled:
            return list(runner.generate(runner.request(ids, params))), []
        with profile(activities=[activity]) as p:
            events = list(runner.generate(runner.request(ids, params)))
            sync()
        return events, [e for e in p.events() if e.device_type == kind]

    result = {}
    for k in (int(x) for x in ns.ks.split(",")):
        spec = SpeculativeConfig("mtp", k) if k else None
        cache = CacheConfig(ns.quota) if ns.quota else None
        runner = rt.load(ns.model, progress=False, cache=cache, speculative=spec)
        ids = runner.tokenizer.encode(PROMPT)
        for _ in range(2):
            request(runner, ids, 96)
        runs = {}
        for n in (32, 96):
            events, kernels = request(runner, ids, n, profiled=True)
            stats = events[-1].stats
            family, time_us = collections.Counter(), collections.Counter()
            for e in kernels:
                family[e.name[:60]] += 1
                time_us[e.name[:60]] += e.time_range.elapsed_us()
            steps = stats.speculative.steps if stats.speculative is not None else stats.generated_tokens
            runs[n] = dict(steps=steps, tokens=stats.generated_tokens, family=family, time_us=time_us)
        if ns.timeline and cuda:
            print_timeline(kernels)
        walls = []
        for _ in range(3):
            events, _ = request(runner, ids, 96)
            stats = events[-1].stats
            walls.append(stats.decode_s / max(stats.generated_tokens - 1, 1))
        a, b = runs[32], runs[96]
        steps = b["steps"] - a["steps"]
        per_step = {name: (b["time_us"][name] - a["time_us"][name]) / steps for name in b["time_us"]}
        row = dict(
            tokens_per_step=(b["tokens"] - a["tokens"]) / steps,
            kernels_per_step=(sum(b["family"].values()) - sum(a["family"].values())) / steps,
            gpu_us_per_step=sum(per_step.values()),
            wall_ms_per_token=statistics.median(walls) * 1e3,
        )
        row["gpu_us_per_token"] = row["gpu_us_per_step"] / row["tokens_per_step"]
        result[k] = row
        print(
            f"{'plain' if k == 0 else f'MTP K={k}'}: {row['tokens_per_step']:.2f} tok/step, "
            f"{row['kernels_per_step']:.1f} kernels and {row['gpu_us_per_step']:.1f} us of GPU time a step, "
            f"{row['gpu_us_per_token']:.1f} us a token; wall {row['wall_ms_per_token']:.3f} ms a token",
            flush=True,
        )
        for name, us in sorted(per_step.items(), key=lambda x: -x[1]):
            count = (b["family"][name] - a["family"][name]) / steps
            print(f"    {us:8.1f} us {count:6.1f} x  {name}")
        del runner
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    if ns.out is not None:
        ns.out.write_text(json.dumps(result, indent=1) + "\n")


def print_timeline(kernels) -> None:
    """One step of a profiled request, in launch order: each kernel's duration and the idle time
    before it. A step ends with its two copies to the host (tokens, chosen logits)."""
    events = sorted(kernels, key=lambda e: e.time_range.start)
    ends = [i for i, e in enumerate(events) if e.name.startswith("Memcpy DtoH")][1::2]
    if len(ends) < 4:
        print("    (no step boundaries found)")
        return
    mid = len(ends) // 2
    step = events[ends[mid - 1] + 1 : ends[mid] + 1]
    total = step[-1].time_range.end - step[0].time_range.start
    print(f"    one step: {len(step)} kernels, {total:.1f} us first start to last end")
    last = step[0].time_range.start
    for e in step:
        gap = e.time_range.start - last
        print(f"    {e.time_range.elapsed_us():7.1f} us  (+{gap:5.1f} idle)  {e.name[:70]}")
        last = max(last, e.time_range.end)


if __name__ == "__main__":
    main()
