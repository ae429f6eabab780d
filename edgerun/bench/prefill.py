"""Prefill on a CUDA GPU at the real Qwen3.6-35B-A3B geometry: time to first token for long
prompts, resident and streamed, each against its bound measured in the same run.

  edgerun bench prefill --dir /tmp/edgerun-bench [--prompt 512,1024] [--layers 8] [--dense int4]

1. The bundle ``edgerun bench decode`` builds (random weights, int4 experts, ``--dense`` linear
   weights), synthesized on local disk once.
2. Calibration (streamed budgets only): raw O_DIRECT read bandwidth over the expert files.
3. For each configuration and prompt length: a random prompt of that many tokens, one warm-up
   request, then ``--repeats`` requests of ``max_tokens=1`` (the whole prompt in one chunk unless
   ``--chunk``); time to first token (request to the first token, as ``edgerun generate``
   reports it) and prefill tok/s, median and range; the peak device memory.
4. Bounds: resident TTFT against nothing but itself (the GPU's compute; the peer kit compares it
   with llama.cpp in the same run); a streamed TTFT against max(every expert read once at the
   calibrated storage rate, the resident TTFT of the same prompt).
5. ``--profile``: one more prefill of the first prompt under torch.profiler: device time per
   kernel family, kernels launched, and device time against wall time (how host-bound it is).

Writes bench_prefill.json and bench_prefill.md to --out (default: the --dir).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from edgerun.bench.decode import GiB, med, prepare, quota_for, release
from edgerun.bundle.dense_layout import add_dense_arguments
from edgerun.engine.policy import KernelPolicy
from edgerun.engine.runner import Runner
from edgerun.engine.sampler import SamplingParams
from edgerun.engine.setup import cache_config
from edgerun.flags import add_renamed
from edgerun.tools import calibrate


def ttft(runner: Runner, prompt: list[int]) -> float:
    """Seconds from the request to its first token (prefill of the whole prompt + one sample)."""
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for ev in runner.generate(runner.request(prompt, params)):
        if ev.token_id is not None:
            return time.perf_counter() - t0
    raise RuntimeError("the request produced no token")


def profile_prefill(runner: Runner, prompt: list[int]) -> dict:
    """One prefill under torch.profiler: device time per kernel (top 20), kernels launched,
    device time against wall time."""
    from torch.profiler import ProfilerActivity, profile

    state = runner.new_state(len(prompt) + 1)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        runner.prefill(state, prompt)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    rows, host = [], []
    for e in prof.key_averages():
        if e.self_cpu_time_total > 0:
            host.append((e.key, e.self_cpu_time_total, e.count))
        if e.device_type == torch.autograd.DeviceType.CUDA:
            t = getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)
            if t > 0:
                rows.append((e.key, t, e.count))
    rows.sort(key=lambda r: -r[1])
    gpu_us = sum(r[1] for r in rows)
    return {
        "wall_ms": wall * 1e3,
        "gpu_ms": gpu_us / 1e3,
        "kernels": sum(r[2] for r in rows),
        "top": [{"kernel": k[:90], "ms": round(t / 1e3, 3), "count": c} for k, t, c in rows[:20]],
        "host_top": [
            {"op": k[:90], "self_ms": round(t / 1e3, 3), "count": c}
            for k, t, c in sorted(host, key=lambda r: -r[1])[:25]
        ],
    }


def host_split(runner: Runner, prompt: list[int]) -> dict[str, float]:
    """Host milliseconds spent issuing each part of one prefill (forward hooks, no syncs: when
    the host is the bottleneck the GPU trails it, so issue time is the part's share of the wall)."""
    parts = {}
    for layer in runner.model.model.layers:
        mixer = getattr(layer, "self_attn", None) or layer.linear_attn
        parts[mixer] = type(mixer).__name__
        parts[layer.mlp] = "mlp (all)"
        for name in ("gate", "experts", "shared_expert"):
            if hasattr(layer.mlp, name):
                parts[getattr(layer.mlp, name)] = f"mlp.{name}"
    spent: dict[str, float] = {}
    began: dict[int, float] = {}

    def pre(m, _args):
        began[id(m)] = time.perf_counter()

    def post(m, _args, _out):
        key = parts[m]
        spent[key] = spent.get(key, 0.0) + (time.perf_counter() - began.pop(id(m))) * 1e3

    hooks = [m.register_forward_pre_hook(pre) for m in parts] + [m.register_forward_hook(post) for m in parts]
    state = runner.new_state(len(prompt) + 1)
    with runner.eager_prefill():  # a replayed graph runs no hooks: this is the eager forward's split
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        runner.prefill(state, prompt)
        issued = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
    spent["total issued"] = issued
    spent["total wall"] = (time.perf_counter() - t0) * 1e3
    for h in hooks:
        h.remove()
    return {k: round(v, 2) for k, v in spent.items()}


def run_config(name, bundle_dir, quota, prompts, repeats, chunk, profile, eager_too=False) -> dict:
    t0 = time.perf_counter()
    longest = max(len(p) for p in prompts)
    runner = Runner.load(
        bundle_dir,
        device="cuda",
        dtype=torch.bfloat16,
        cache=cache_config(Path(bundle_dir), quota=quota),
        max_context=longest + 1,
        kernels=KernelPolicy(),
        prefill_chunk=chunk or longest,
    )
    rec = {"config": name, "quota": quota, "load_s": time.perf_counter() - t0, "prompts": []}
    for prompt in prompts:
        torch.cuda.reset_peak_memory_stats()
        ttft(runner, prompt)  # warm-up: Triton compiles, cuBLAS picks its kernels, the cache fills
        before = runner.cache.totals() if runner.cache is not None else None
        chunks = runner.prefill_counts()
        times = [ttft(runner, prompt) for _ in range(repeats)]
        row = {
            "tokens": len(prompt),
            "ttft_s": med(times),
            "prefill_tps": len(prompt) / med(times)["median"],
            "peak_device_bytes": torch.cuda.max_memory_allocated(),
            "prefill_chunks": {k: n - chunks[k] for k, n in runner.prefill_counts().items()},
        }
        if before is not None:
            after = runner.cache.totals()
            row["bytes_read_per_request"] = (after.bytes_read - before.bytes_read) / repeats
        if eager_too:  # the same prompt with every chunk eager: what the prefill graphs gain
            with runner.eager_prefill():
                ttft(runner, prompt)
                row["eager_ttft_s"] = med([ttft(runner, prompt) for _ in range(repeats)])
        rec["prompts"].append(row)
        print(
            f"[{name}] {len(prompt)} tokens: ttft {row['ttft_s']}, {row['prefill_tps']:.0f} tok/s, "
            f"chunks {row['prefill_chunks']}" + (f", eager ttft {row['eager_ttft_s']}" if eager_too else ""),
            flush=True,
        )
    rec["kernels"] = runner.kernel_summary()
    rec["fallbacks"] = runner.fallbacks()
    if profile:
        rec["host_ms"] = host_split(runner, prompts[0])
        print(f"[{name}] host ms issuing each part: {rec['host_ms']}")
        rec["profile"] = profile_prefill(runner, prompts[0])
        p = rec["profile"]
        print(
            f"[{name}] profile: wall {p['wall_ms']:.1f} ms, gpu {p['gpu_ms']:.1f} ms, {p['kernels']} kernels"
        )
        for t in p["top"]:
            print(f"   {t['ms']:9.3f} ms  {t['count']:6d}  {t['kernel']}")
        print(f"[{name}] host time by op (self):")
        for t in p["host_top"]:
            print(f"   {t['self_ms']:9.3f} ms  {t['count']:6d}  {t['op']}")
    release(runner)
    return rec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="edgerun bench prefill", description=" ".join(__doc__.split("\n\n")[0].split())
    )
    ap.add_argument("--dir", type=Path, required=True, help="local disk for the bundle")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--prompt", default="512,1024", help="prompt lengths, comma-separated")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=None, help="prefill chunk (default: the whole prompt)")
    ap.add_argument("--budgets", default="resident", help="resident and/or device budgets in GiB")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers (default: all 40)")
    ap.add_argument(
        "--torch-profile",
        dest="profile",
        action="store_true",
        help="torch.profiler over one prefill of the first prompt",
    )
    # the old spelling: everywhere else --profile names a device profile
    add_renamed(ap, "--profile", "--torch-profile", "profile", nargs=0, const=True)
    ap.add_argument(
        "--eager-too",
        action="store_true",
        help="also time each prompt with the prefill graphs off (same run)",
    )
    calibrate.add_arguments(ap)
    add_dense_arguments(ap)
    ns = ap.parse_args(argv)
    calibrate.check_arguments(ap, ns)
    prepared = prepare(ns, "prefill")
    if prepared is None:
        return 2
    out_dir, bundle_dir, synth_s, bundle = prepared
    a = bundle.args
    block = bundle.layouts[a.moe_layers[0]].block_bytes
    lengths = [int(t) for t in ns.prompt.split(",")]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, a.vocab_size, (n,), generator=g).tolist() for n in lengths]
    result = {
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "bundle": str(bundle_dir),
        "geometry": {
            "layers": a.num_hidden_layers,
            "experts": a.num_experts,
            "top_k": a.num_experts_per_tok,
            "dense": bundle.manifest.dense_quant.scheme.label(),
        },
        "configs": [],
    }
    print(
        f"bundle {bundle_dir} (synthesized in {synth_s:.0f} s), dense {result['geometry']['dense']}",
        flush=True,
    )
    specs = ns.budgets.split(",")
    storage_bw = None
    if any(s != "resident" for s in specs):
        paths = [bundle.expert_path(layer) for layer in a.moe_layers]
        reads, result["storage_best_window"] = calibrate.read_rounds(
            paths, block, ns.calibrate_rounds, ns.calibrate_seconds
        )
        storage_bw = calibrate.best(reads)["gb_per_s"] * 1e9
        result["storage_gb_per_s"] = storage_bw / 1e9
        print(
            f"storage bound: {storage_bw / 1e9:.2f} GB/s (the best shape's median of {ns.calibrate_rounds} "
            f"round(s); the best single window {result['storage_best_window']:.2f})",
            flush=True,
        )
    resident_ttft: dict[int, float] = {}
    for spec in specs:
        if spec == "resident":
            name, quota = "resident", a.num_experts
        else:
            name = f"{float(spec):g} GiB"
            context = max(lengths) + 1
            quota, how = quota_for(int(float(spec) * GiB), bundle_dir, context, ns.chunk or max(lengths))
            if quota < a.num_experts_per_tok:
                result["configs"].append({"config": name, "refused": how})
                continue
        rec = run_config(
            name,
            bundle_dir,
            quota,
            prompts,
            ns.repeats,
            ns.chunk,
            ns.profile and spec == specs[0],
            ns.eager_too,
        )
        for row in rec["prompts"]:
            if spec == "resident":
                resident_ttft[row["tokens"]] = row["ttft_s"]["median"]
            elif storage_bw:
                read_all = len(a.moe_layers) * a.num_experts * block / storage_bw
                bound = max(read_all, resident_ttft.get(row["tokens"], 0.0))
                row["bound_s"] = {
                    "read_every_expert_s": read_all,
                    "resident_s": resident_ttft.get(row["tokens"]),
                }
                row["ratio_to_bound"] = row["ttft_s"]["median"] / bound
        result["configs"].append(rec)
        (out_dir / "bench_prefill.json").write_text(json.dumps(result, indent=1, default=str))
    (out_dir / "bench_prefill.md").write_text(markdown(result))
    print(markdown(result))
    return 0


def markdown(result: dict) -> str:
    lines = [
        f"Prefill, {result['device']}, {result['date']}, {result['geometry']['layers']} layers, "
        f"dense {result['geometry']['dense']}",
        "",
        "| config | prompt | TTFT median (range) | prefill tok/s | chunks graph/eager | eager TTFT | peak device MiB "
        "| TTFT / bound |",
        "| --- | ---: | --- | ---: | --- | --- | ---: | ---: |",
    ]

    def ms(t: dict) -> str:
        return f"{t['median'] * 1e3:.1f} ms ({t['min'] * 1e3:.1f}-{t['max'] * 1e3:.1f})"

    for c in result["configs"]:
        if "refused" in c:
            lines.append(f"| {c['config']} | | refused: {c['refused']} | | | | | |")
            continue
        for r in c["prompts"]:
            ratio = f"{r['ratio_to_bound']:.2f}" if "ratio_to_bound" in r else ""
            chunks = r.get("prefill_chunks", {})
            lines.append(
                f"| {c['config']} | {r['tokens']} | {ms(r['ttft_s'])} | {r['prefill_tps']:,.0f} "
                f"| {chunks.get('graph', 0)}/{chunks.get('eager', 0)} | "
                f"{ms(r['eager_ttft_s']) if 'eager_ttft_s' in r else ''} "
                f"| {r['peak_device_bytes'] / 2**20:,.0f} | {ratio} |"
            )
    return "\n".join(lines) + "\n"
