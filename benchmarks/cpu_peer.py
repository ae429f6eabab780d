"""edgerun against llama.cpp on this machine's CPU, same model, same run (issue 22's peer).

    python benchmarks/cpu_peer.py --work /tmp/cpupeer --llama-build /tmp/llcpu \
        [--llama-src ../shared/peers/gpu/llama.cpp] [--layers 4] [--experts 64] [--rounds 3] [--tokens 64] \
        [--dense int4] [--threads 1] [--quota 16]

1. A random-weight Hugging Face checkpoint of Qwen3-30B-A3B's per-layer geometry (qwen3_moe:
   hidden 2048, expert width 768, top-8, vocab 151,936), cut to ``--layers`` layers and
   ``--experts`` experts, bf16, written by transformers (a test dependency, not the runtime's),
   with the demo model's tokenizer files (the embedding keeps the real vocab).
2. llama.cpp's own converter (through the peer kit's ``convert_gguf.py``, which only names the
   demo tokenizer's pre-tokenizer) to a bf16 GGUF, then ``llama-quantize`` to Q4_K_M.
3. ``edgerun convert --quant int4`` (int4 g32 experts; ``--dense`` as given) of the same checkpoint.
4. Interleaved rounds at ``--threads`` (default 1): ``llama-bench -t N`` (tg ``--tokens``, pp
   ``--prompt``) and ``edgerun generate --threads N`` with every expert cached (or streamed at
   ``--quota``), greedy, ``--ignore-eos``; edgerun's prefill and decode tok/s from its stats line.
   The load average at the start is printed (and kept in ``--json``): the VM is shared.

Prints the median (range) of each and the ratios; ``--json`` writes them. The llama.cpp build is
CPU-only (``cmake -DGGML_CUDA=OFF``; ``llama-bench`` and ``llama-quantize``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KIT = ROOT.parent / "shared" / "peers" / "gpu"
QWEN3_30B = dict(  # Qwen3-30B-A3B's config.json, cut by the flags (random weights)
    model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048,
    intermediate_size=6144, moe_intermediate_size=768, num_attention_heads=32, num_key_value_heads=4,
    head_dim=128, num_experts_per_tok=8, norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=1000000.0,
    max_position_embeddings=40960, tie_word_embeddings=False, eos_token_id=151645, bos_token_id=151643,
)  # fmt: skip


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    print("+", " ".join(map(str, cmd)), flush=True)
    res = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    if res.returncode:
        raise SystemExit(
            f"failed ({res.returncode}): {' '.join(map(str, cmd))}\n{res.stdout[-2000:]}{res.stderr[-3000:]}"
        )
    return res


def make_checkpoint(out: Path, layers: int, experts: int) -> None:
    if (out / "config.json").is_file():
        return
    import torch
    import transformers as tf

    cfg = dict(QWEN3_30B, num_hidden_layers=layers, num_experts=experts)
    torch.manual_seed(0)
    model = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**cfg)).to(torch.bfloat16)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ROOT / "edgerun" / "demo" / name, out / name)


def llama_bench(bench: Path, gguf: Path, tokens: int, prompt: int, threads: int) -> tuple[float, float]:
    """(tg tok/s, pp tok/s) of one llama-bench run."""
    res = run([bench, "-m", gguf, "-t", threads, "-n", tokens, "-p", prompt, "-r", 1, "-o", "json"])
    rows = json.loads(res.stdout)
    tg = next(r["avg_ts"] for r in rows if r["n_gen"] > 0)
    pp = next(r["avg_ts"] for r in rows if r["n_prompt"] > 0)
    return tg, pp


def edgerun_generate(bundle: Path, quota: int, tokens: int, prompt: int, threads: int) -> tuple[float, float]:
    """(decode tok/s, prefill tok/s) from edgerun generate's stats line."""
    ids = ",".join(str(3 + i % 4000) for i in range(prompt))
    res = run([
        sys.executable, "-m", "edgerun.cli", "generate", "--model", bundle, "--quota", quota, "--threads", threads,
        "--token-ids", ids, "--max-tokens", tokens, "--ignore-eos", "-q",
    ])  # fmt: skip
    m = re.search(r"prefill ([\d.]+) tok/s, decode ([\d.]+) tok/s", res.stderr)
    if not m:
        raise SystemExit(f"no stats line in edgerun's stderr:\n{res.stderr[-2000:]}")
    return float(m.group(2)), float(m.group(1))


def med(xs: list[float]) -> str:
    return f"{statistics.median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--llama-build", type=Path, required=True, help="a CPU build dir holding bin/llama-bench")
    ap.add_argument("--llama-src", type=Path, default=KIT / "llama.cpp")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dense", default="bf16", help="edgerun convert --dense")
    ap.add_argument("--threads", type=int, default=1, help="both systems' CPU threads")
    ap.add_argument(
        "--quota", type=int, default=None, help="edgerun's expert slots per layer (default: every expert)"
    )
    ap.add_argument("--json", type=Path, default=None)
    ns = ap.parse_args()
    bench = ns.llama_build / "bin" / "llama-bench"
    quantize = ns.llama_build / "bin" / "llama-quantize"
    ns.work.mkdir(parents=True, exist_ok=True)
    hf = ns.work / f"hf-{ns.layers}l-{ns.experts}e"
    make_checkpoint(hf, ns.layers, ns.experts)
    bf16 = ns.work / f"{hf.name}-bf16.gguf"
    q4 = ns.work / f"{hf.name}-Q4_K_M.gguf"
    if not q4.is_file():
        env_src = {"PEERKIT_LLAMA_SRC": str(ns.llama_src), "PATH": "/usr/bin:/bin"}
        run([sys.executable, KIT / "convert_gguf.py", hf, "--outtype", "bf16", "--outfile", bf16],
            env={**os.environ, **env_src})  # fmt: skip
        run([quantize, bf16, q4, "Q4_K_M"])
        bf16.unlink()
    bundle = ns.work / f"{hf.name}-int4-dense-{ns.dense}"
    if not (bundle / "manifest.json").is_file():
        run(
            [
                sys.executable,
                "-m",
                "edgerun.cli",
                "convert",
                hf,
                bundle,
                "--quant",
                "int4",
                "--dense",
                ns.dense,
            ]
        )
    rows: dict[str, list[float]] = {k: [] for k in ("llama_tg", "llama_pp", "er_tg", "er_pp")}
    load = os.getloadavg()[0]  # the VM is shared: say how busy it was
    print(f"load average {load:.2f} at the start, {os.cpu_count()} cores, {ns.threads} thread(s)")
    for r in range(ns.rounds):
        t0 = time.perf_counter()
        tg, pp = llama_bench(bench, q4, ns.tokens, ns.prompt, ns.threads)
        rows["llama_tg"].append(tg)
        rows["llama_pp"].append(pp)
        tg, pp = edgerun_generate(bundle, ns.quota or ns.experts, ns.tokens, ns.prompt, ns.threads)
        rows["er_tg"].append(tg)
        rows["er_pp"].append(pp)
        print(
            f"round {r + 1}: { ({k: round(v[-1], 1) for k, v in rows.items()}) } in {time.perf_counter() - t0:.0f} s"
        )
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "model": f"qwen3_moe {ns.layers} layers, {ns.experts} experts (Qwen3-30B-A3B per-layer geometry)",
        "edgerun": f"int4 g32 experts, dense {ns.dense}, "
        + (f"streamed, quota {ns.quota}" if ns.quota else "every expert cached")
        + f", {ns.threads} thread(s)",
        "llama.cpp": f"Q4_K_M, {ns.threads} thread(s) (llama-bench)",
        "load_average_at_start": load,
        **{k: {"median": statistics.median(v), "min": min(v), "max": max(v)} for k, v in rows.items()},
    }
    print(f"decode tg{ns.tokens}: llama.cpp {med(rows['llama_tg'])}, edgerun {med(rows['er_tg'])}, "
          f"ratio {statistics.median(rows['er_tg']) / statistics.median(rows['llama_tg']):.3f}")  # fmt: skip
    print(f"prefill pp{ns.prompt}: llama.cpp {med(rows['llama_pp'])}, edgerun {med(rows['er_pp'])}, "
          f"ratio {statistics.median(rows['er_pp']) / statistics.median(rows['llama_pp']):.3f}")  # fmt: skip
    if ns.json:
        ns.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
