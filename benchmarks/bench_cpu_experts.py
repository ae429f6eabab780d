"""CPU decode tok/s: the reference expert path (dequantize every active expert to fp32) against the
CPU kernels (kernels/moe_cpu.py), resident (every expert cached) and streamed (a small quota), in
interleaved rounds, one torch thread; prints the median and range and whether the greedy tokens
of the two paths agree.

    python benchmarks/bench_cpu_experts.py BUNDLE [--quota 16] [--tokens 32] [--rounds 3] [--dtype bfloat16]
    python benchmarks/bench_cpu_experts.py DIR --make-qwen3-30b   # Qwen3-30B-A3B per-layer geometry, 4 layers
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from edgerun.config import CacheConfig
from edgerun.engine.policy import KernelPolicy
from edgerun.engine.runner import Runner

QWEN3_30B = dict(  # Qwen3-30B-A3B's config.json, cut to 4 layers (random weights)
    model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
    moe_intermediate_size=768, num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4,
    head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, rms_norm_eps=1e-6,
    rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=False, eos_token_id=151645,
)  # fmt: skip


def decode(runner: Runner, prompt: list[int], n: int) -> tuple[list[int], float]:
    state = runner.new_state(len(prompt) + n)
    with torch.inference_mode():
        got = [int(runner.prefill(state, prompt).argmax())]
        t0 = time.perf_counter()
        for _ in range(n - 1):
            got.append(int(runner.decode_step(state, got[-1]).argmax()))
    return got, (n - 1) / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("bundle", type=Path)
    p.add_argument("--make-qwen3-30b", action="store_true", help="write the synthetic bundle first")
    p.add_argument("--quota", type=int, default=16)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the dense weights'")
    ns = p.parse_args()
    torch.set_num_threads(1)
    if ns.make_qwen3_30b:
        from edgerun.tools.synth_bundle import synth_bundle

        synth_bundle(ns.bundle, QWEN3_30B, "int4")
    runners = {}
    for kernel in ("reference", "cpu"):
        for quota in ("all", ns.quota):
            q = 10**6 if quota == "all" else quota
            runners[(kernel, quota)] = r = Runner.load(
                ns.bundle,
                device="cpu",
                dtype=getattr(torch, ns.dtype),
                cache=CacheConfig(q),
                kernels=KernelPolicy(experts=kernel),
            )
            print(f"{kernel} quota {quota}: {r.kernel_summary()}; fallbacks {r.fallbacks()}", flush=True)
    vocab = next(iter(runners.values())).args.vocab_size
    prompt = [(7 * i + 3) % vocab for i in range(16)]
    rates: dict = {k: [] for k in runners}
    tokens: dict = {}
    for i in range(ns.rounds + 1):  # interleaved: every configuration once per round; round 0 warms up
        for key, r in runners.items():
            got, rate = decode(r, prompt, ns.tokens)
            if i:
                rates[key].append(rate)
            if tokens.setdefault(key, got) != got:
                raise SystemExit(f"{key}: two rounds decoded different tokens")
    for key, rs in rates.items():
        print(
            f"{key[0]:9s} quota {key[1]!s:>4}: decode {statistics.median(rs):7.2f} tok/s "
            f"(range {min(rs):.2f}-{max(rs):.2f}, {ns.rounds} rounds, {ns.tokens} tokens)"
        )
    for kernel in ("reference", "cpu"):
        same = tokens[(kernel, "all")] == tokens[(kernel, ns.quota)]
        print(f"{kernel}: streamed == resident tokens: {same}")
    agree = sum(a == b for a, b in zip(tokens[("reference", "all")], tokens[("cpu", "all")]))
    print(f"cpu vs reference greedy tokens: {agree}/{ns.tokens} equal")


if __name__ == "__main__":
    main()
