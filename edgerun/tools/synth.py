"""Synthetic checkpoints: a real HF layout (config.json, fused-expert safetensors, tokenizer)
with random weights, at any geometry. For benchmarks of the streaming path, where the bytes
moved matter and the text does not; every output derived from one says "random weights"."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from edgerun.models.registry import load_args


def init_rule(name: str, shape: tuple[int, ...], unit_offset: bool, matrix_std: float) -> tuple[str, float]:
    """How a synthetic tensor is drawn: ("const", value), ("uniform", high) on [0, high) or
    ("normal", std). Norms at their neutral value (zero under a (1 + w) offset; the DeltaNet's
    gated norm has none), DeltaNet decay parameters in their usual range, 1-D others (biases)
    zero, matrices N(0, matrix_std)."""
    if name.endswith("norm.weight"):
        return "const", 0.0 if unit_offset and "linear_attn.norm" not in name else 1.0
    if name.endswith("A_log"):
        return "uniform", 2.0
    if name.endswith("dt_bias"):
        return "const", 1.0
    if len(shape) == 1:
        return "const", 0.0
    return "normal", matrix_std


def synthesize_checkpoint(
    config: dict,
    out: str | Path,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    tokenizer_from: Path | None = None,
) -> Path:
    """Write a checkpoint for ``config`` (an HF config dict) with N(0, 0.02) weights, norms at
    their neutral value, DeltaNet decay parameters in their usual range, experts fused."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    arch, args = load_args(config)
    g = torch.Generator().manual_seed(seed)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for spec in arch.tensor_specs(args):
        name = spec.name
        kind, value = init_rule(name, spec.shape, args.norm_unit_offset, matrix_std=0.02)
        if kind == "const":
            t = torch.full(spec.shape, value)
        elif kind == "uniform":
            t = torch.empty(spec.shape).uniform_(0.0, value, generator=g)
        else:
            t = torch.randn(spec.shape, generator=g) * value
        t = t.to(dtype).contiguous()
        if size + t.nbytes > 2 << 30 and shards[-1]:  # 2 GiB shards, like published checkpoints
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out / fname), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, fname))
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map})
        )
    (out / "config.json").write_text(json.dumps(config, indent=1))
    if tokenizer_from is not None:
        for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            if (tokenizer_from / f).is_file():
                shutil.copy(tokenizer_from / f, out / f)
    return out
