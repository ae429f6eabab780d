"""What int8 activations would cost in quality: perplexity of a bundle whose int4 products take x
quantized to int8 per group of G columns (symmetric, round to nearest, fp32 scale), as a W4A8
integer dot-product kernel would compute them (exact integer sums, one scale per group).

    python benchmarks/activation_quant_quality.py BUNDLE --text tests/data/kjv_heldout.txt \
        [--max-tokens 8192] [--group 32] [--mode none|dense|all]

A measurement of numerics only (no such kernel exists in edgerun): the bundle runs on the CPU in
fp32 through the torch reference paths (``KernelPolicy(experts="reference", dense="torch")``),
with ``qlinear_ref`` (every int4 projection) and, for ``all``, the reference expert FFN (both of
an int4 expert's products) wrapped to quantize their input first. ``none`` is the bundle as it
runs (the quality probe's figure, ``edgerun.tools.quality``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F


def quantize_rows(x: torch.Tensor, group: int) -> torch.Tensor:
    """x with each group of ``group`` columns replaced by its int8 quantization, dequantized."""
    shape = x.shape
    g = x.float().reshape(*shape[:-1], shape[-1] // group, group)
    scale = g.abs().amax(-1, keepdim=True) / 127
    q = torch.where(scale > 0, torch.round(g / torch.where(scale > 0, scale, 1)), 0) * scale
    return q.reshape(shape).to(x.dtype)


def patch(mode: str, group: int, counts: dict) -> None:
    """Wraps the reference paths so that int4 products see quantized inputs (``mode`` dense: the
    projections; all: the experts' too)."""
    import edgerun.kernels.moe_reference as M
    import edgerun.kernels.qlinear_reference as R

    linear = R.qlinear_ref

    def qlinear(x, w, bias=None, epilogue="none", out=None, gate=None, *, norm=None, norm_out=None, **kw):
        if norm is not None:  # the norm first, as qlinear_ref would, then the quantization
            x = R.rms_norm_ref(x, *norm)
            if norm_out is not None:
                norm_out.copy_(x)
        if w.scheme == "int4":
            x = quantize_rows(x, group)
            counts["projections"] += 1
        return linear(x, w, bias, epilogue, out, gate, **kw)

    def ffn(x, gate_up, down):
        counts["experts"] += 1
        n = x.shape[0]
        if n % M.ROW_TILE:
            x = F.pad(x, (0, 0, 0, M.ROW_TILE - n % M.ROW_TILE))
        g, u = F.linear(quantize_rows(x, group), gate_up.to(x.dtype)).chunk(2, dim=-1)
        return F.linear(quantize_rows(F.silu(g) * u, group), down.to(x.dtype))[:n]

    if mode in ("dense", "all"):
        R.qlinear_ref = qlinear
    if mode == "all":  # combine_experts binds its ffn as a default argument
        defaults = list(M.combine_experts.__defaults__)
        defaults[-1] = ffn
        M.combine_experts.__defaults__ = tuple(defaults)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--text", type=Path, required=True)
    ap.add_argument("--max-tokens", type=int, default=8192)
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--mode", choices=("none", "dense", "all"), default="all")
    args = ap.parse_args()
    from tokenizers import Tokenizer

    from edgerun.engine.policy import KernelPolicy
    from edgerun.engine.runner import Runner
    from edgerun.tools.quality import perplexity

    counts = {"projections": 0, "experts": 0}
    patch(args.mode, args.group, counts)
    ids = Tokenizer.from_file(str(args.bundle / "tokenizer.json")).encode(args.text.read_text()).ids
    ids = ids[: args.max_tokens]
    run = Runner.load(
        args.bundle,
        device="cpu",
        dtype=torch.float32,
        kernels=KernelPolicy(experts="reference", dense="torch"),
    )
    ppl = perplexity(run.model, ids, context=256)
    print(
        f"{args.bundle}: x int8 per {args.group} before int4 products ({args.mode}): {len(ids)} tokens, "
        f"perplexity {ppl:.3f}; calls with x quantized: {counts}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
