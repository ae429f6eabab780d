"""What a sampled token costs: the host sampler against the draw on the GPU, per token, at the
demo's vocabulary and at Qwen3's and Qwen3.6's; then the demo model's decode rate, greedy and
sampled, with each.

    python benchmarks/bench_sampling.py [--vocab 4096,151936,248320] [--repeats 5] [--out F.json]

Part 1, one row of random bf16 logits on the GPU, per token, median (range) over repeats of 50:
- host: ``Sampler.probs`` + ``draw`` (the CPU sampler: the logits copied to the host, sorted
  there when the request filters), the path every sampled token took before the device draw;
- device: ``Sampler.device_draw`` on the GPU's logits (the draw on the device, one read back of the
  token), as a batch's row or a host-driven step draws;
- device, in a graph: the draw replayed from a CUDA graph, GPU time only (the decode step's
  draw, which the host never waits for).
Sampling settings: T 0.8; T 0.8 top-p 0.95 (``make demo``); T 0.7 top-p 0.8 top-k 20 (Qwen3's
generation_config).

Part 2, the demo model on the GPU (CUDA graphs), 6 prompts x 96 tokens a repeat, decode tok/s
(tokens after the first over the decode time): greedy; sampled (T 0.8, top-p 0.95), pipelined
with the draw in the step's graph (``Runner.generate``); and sampled the way every sampled token
was decoded before, each step's logits to the host sampler (a host loop over ``decode_step``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from edgerun.bench.speculative import PROMPTS  # the demo's prompts, as bench speculative runs them

SETTINGS = {
    "T0.8": dict(temperature=0.8),
    "T0.8 p0.95": dict(temperature=0.8, top_p=0.95),
    "T0.7 p0.8 k20": dict(temperature=0.7, top_p=0.8, top_k=20),
}


def _med(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def per_token(vocab: int, kw: dict, repeats: int, n: int = 50, device: str = "cuda") -> dict:
    from edgerun.engine.sampler import Sampler, SamplingParams
    from edgerun.kernels import sample_triton as S

    g = torch.Generator(device=device).manual_seed(vocab)
    logits = (torch.randn(vocab, device=device, generator=g) * 4).to(torch.bfloat16)
    params = SamplingParams(max_tokens=1, seed=1, **kw)
    out = {}
    s = Sampler(params)
    fns = {"host": lambda: s.draw(s.probs(logits))}
    if device == "cuda":
        fns["device"] = lambda: s.device_draw(logits)
    else:  # the host sampler as it was: the whole vector sorted
        fns["host, whole vector sorted"] = lambda: s.draw(s.probs_reference(logits))
    for name, fn in fns.items():
        fn()
        times = []
        for _ in range(repeats):
            if device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(n):
                fn()
            times.append((time.perf_counter() - t) / n * 1e6)
        out[name] = _med(times)
    if device != "cuda":  # a smoke run of the parts above
        return out
    buffers = S.SampleBuffers(1, vocab, logits.device, logits.dtype)
    buffers.set([s.row()])
    counter = torch.zeros(1, dtype=torch.int64, device="cuda")
    token = torch.zeros(1, dtype=torch.int64, device="cuda")
    chosen = torch.zeros(1, dtype=logits.dtype, device="cuda")
    rows = logits[None]

    def draw():
        S.sample(rows, buffers, counter, 1, token, chosen, s.sort)

    draw()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            draw()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / n)
    out["device, in a graph"] = _med(times)
    return out


def decode_rates(repeats: int, max_tokens: int = 96) -> dict:
    from edgerun.engine.runner import Runner
    from edgerun.engine.sampler import Sampler, SamplingParams

    runner = Runner.load(None, device="cuda")
    prompts = [runner.tokenizer.encode(t) for t in PROMPTS]
    sampled = dict(temperature=0.8, top_p=0.95)

    def generate(params):
        steps, seconds = 0, 0.0
        for ids in prompts:
            stats = list(runner.generate(runner.request(ids, params)))[-1].stats
            steps += stats.generated_tokens - 1
            seconds += stats.decode_s
        return steps / seconds

    def host_loop(params):
        steps, seconds = 0, 0.0
        for i, ids in enumerate(prompts):
            s = Sampler(SamplingParams(max_tokens=max_tokens, seed=i, **sampled))
            state = runner.new_state(len(ids) + max_tokens)
            token = s.draw(s.probs(runner.prefill(state, ids)))
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(max_tokens - 1):
                token = s.draw(s.probs(runner.decode_step(state, token)))
            seconds += time.perf_counter() - t
            steps += max_tokens - 1
        return steps / seconds

    configs = {
        "greedy": lambda: generate(SamplingParams(max_tokens=max_tokens, ignore_eos=True)),
        "sampled, drawn on the device": lambda: generate(
            SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=0, **sampled)
        ),
        "sampled, host sampler each step": lambda: host_loop(None),
    }
    runs = {k: [] for k in configs}
    for fn in configs.values():
        fn()  # warm-up: compiles, captures
    for _ in range(repeats):
        for k, fn in configs.items():
            runs[k].append(fn())
    return {k: _med(v) for k, v in runs.items()} | {"sampled_tokens": dict(runner.sampled)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", default="4096,151936,248320")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--device",
        default="cuda",
        help="cpu: part 1's host sampler only, against the whole-vector sort it replaced",
    )
    ns = ap.parse_args()
    name = torch.cuda.get_device_name() if ns.device == "cuda" else "cpu"
    result = {"device": name, "per_token_us": {}, "demo_decode_tok_s": None}
    print(f"{result['device']}; microseconds a token, median (range) of {ns.repeats} x 50")
    if ns.device == "cuda":
        print(
            "| vocab | setting | host sampler | device draw (one read back) | device draw in a graph (GPU) |"
        )
        print("| ---: | --- | ---: | ---: | ---: |")
    else:
        print("| vocab | setting | host sampler | host sampler, whole vector sorted |")
        print("| ---: | --- | ---: | ---: |")
    for v in (int(x) for x in ns.vocab.split(",") if x):  # --vocab "": part 2 only
        for name, kw in SETTINGS.items():
            r = per_token(v, kw, ns.repeats, device=ns.device)
            result["per_token_us"][f"{v} {name}"] = r
            cells = " | ".join(f"{r[k]['median']:.1f} ({r[k]['min']:.1f}-{r[k]['max']:.1f})" for k in r)
            print(f"| {v:,} | {name} | {cells} |", flush=True)
    if ns.device == "cuda":
        rates = decode_rates(ns.repeats)
        result["demo_decode_tok_s"] = rates
        print(f"\ndemo decode tok/s, median (range) of {ns.repeats}:")
        for k, r in rates.items():
            if k != "sampled_tokens":
                print(f"  {k}: {r['median']:.1f} ({r['min']:.1f}-{r['max']:.1f})")
        print(f"  sampled tokens by where drawn: {rates['sampled_tokens']}")
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
