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
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            t = (
                torch.zeros(spec.shape)
                if args.norm_unit_offset and "linear_attn.norm" not in name
                else torch.ones(spec.shape)
            )
        elif name.endswith("A_log"):
            t = torch.empty(spec.shape).uniform_(0.0, 2.0, generator=g)
        elif name.endswith("dt_bias"):
            t = torch.ones(spec.shape)
        else:
            t = torch.randn(spec.shape, generator=g) * 0.02
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
