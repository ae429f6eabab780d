"""Synthetic checkpoints for scale tests, written tensor by tensor (never the whole model in
memory): a qwen3_moe model with fused experts and random bf16 weights, or only headers over a
sparse file (a model of any size, for header-only tests such as ``--dry-run``).

Run as a script to measure convert's peak RSS:
``python tests/bundle/synthetic.py DIR --layers 16 --experts 64 --hidden 256 --inter 128 --quant int4``
builds DIR/src, converts it in a child process into DIR/bundle and prints one JSON line
{"layers", "model_bytes", "expert_bytes", "peak_rss"}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from edgerun.bundle.format import safetensors_header
from edgerun.models.registry import load_args

TOKENIZER = '{"version":"1.0","model":{"type":"WordLevel","vocab":{"a":0},"unk_token":"a"}}'


def qwen3_moe_config(layers: int, experts: int, hidden: int, inter: int, vocab: int = 256) -> dict:
    return {
        "model_type": "qwen3_moe",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "moe_intermediate_size": inter,
        "num_experts": experts,
        "num_experts_per_tok": 2,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
    }


def fused_inventory(config: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Checkpoint names and shapes, experts fused ([E, 2I, D] / [E, D, I]) as published checkpoints ship them."""
    arch, args = load_args(config)
    return [(s.name, s.shape) for s in arch.tensor_specs(args)]


def write_checkpoint(out: Path, config: dict, sparse: bool = False, seed: int = 0) -> int:
    """Write config.json, tokenizer.json and model.safetensors (bf16). ``sparse``: headers only,
    the payload a hole. Returns the payload's size in bytes."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config))
    (out / "tokenizer.json").write_text(TOKENIZER)
    tensors = [(n, "BF16", s, math.prod(s) * 2) for n, s in fused_inventory(config)]
    header = safetensors_header(tensors)
    payload = sum(t[3] for t in tensors)
    with open(out / "model.safetensors", "wb") as f:
        f.write(header)
        if sparse:
            f.truncate(len(header) + payload)
            return payload
        rng = np.random.default_rng(seed)  # numpy: single-threaded, immune to a busy machine
        for _, _, shape, _ in tensors:
            rows = shape[0] if len(shape) == 3 else 1  # write experts one at a time
            n = math.prod(shape) // rows
            for _ in range(rows):
                fp32 = rng.standard_normal(n, dtype=np.float32) * np.float32(0.05)
                f.write((fp32.view(np.uint32) >> 16).astype(np.uint16).tobytes())  # bf16 by truncation
    return payload


# One torch thread: on a shared 2-core machine, spinning OpenMP threads make this 10-80x slower.
CHILD = """
import resource, sys, torch
torch.set_num_threads(1)
from edgerun.bundle.convert import ConvertOptions, convert
convert(sys.argv[1], sys.argv[2], ConvertOptions(quant=sys.argv[3]))
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def measure(root: Path, layers: int, experts: int, hidden: int, inter: int, quant: str) -> dict:
    """Build a checkpoint under ``root``, convert it in a child process; the child's peak RSS."""
    config = qwen3_moe_config(layers, experts, hidden, inter)
    model_bytes = write_checkpoint(root / "src", config)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(root / "src"), str(root / "bundle"), quant],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    expert_bytes = layers * experts * 3 * hidden * inter * 2
    return {
        "layers": layers,
        "model_bytes": model_bytes,
        "expert_bytes": expert_bytes,
        "peak_rss": int(out.stdout.split()[-1]),
    }


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("dir", type=Path)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--inter", type=int, default=128)
    p.add_argument("--quant", default="int4")
    a = p.parse_args()
    print(json.dumps(measure(a.dir, a.layers, a.experts, a.hidden, a.inter, a.quant)))
