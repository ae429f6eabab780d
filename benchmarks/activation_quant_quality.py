"""What int8 activations cost in quality: perplexity of a bundle whose int4 products take x
quantized to int8 per group of 32 columns, as the W4A8 kernels quantize it
(``qlinear_w4a8.quantized_values_ref``: s = max|x| / 127, q = floor(x * 127 / max|x| + 0.5); the
products then exact), or per ``--group`` G columns by the same rule.

    python benchmarks/activation_quant_quality.py BUNDLE --text tests/data/kjv_heldout.txt \
        [--max-tokens 8192] [--group 32] [--mode none|experts|dense|all]

The bundle runs on the CPU in fp32 through the torch reference paths (``KernelPolicy(experts=
"reference", dense="torch")``; the W4A8 kernels run on CUDA only), with ``qlinear_ref`` and the
reference expert FFN wrapped to quantize their input first: ``experts``, the input of the
experts' gate_up (what ``--expert-act int8`` quantizes); ``dense``, every int4 projection's (a
superset of ``--dense-act int8``'s, which takes the projections of 16 rows a program only: none
on the demo); ``all``, both and the experts' down input h too. ``none`` is the bundle as it runs
(the quality probe's figure, ``edgerun.tools.quality``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F


def quantize_rows(x: torch.Tensor, group: int) -> torch.Tensor:
    """x with each group of ``group`` columns replaced by its int8 quantization, dequantized (the
    kernels' rule; exact at 32, their group)."""
    from edgerun.kernels.qlinear_w4a8 import GROUP, quantized_values_ref

    if group == GROUP:
        return quantized_values_ref(x).to(x.dtype)
    g = x.float().reshape(*x.shape[:-1], x.shape[-1] // group, group)
    amax = g.abs().amax(-1, keepdim=True)
    q = torch.floor(g * torch.where(amax > 0, 127.0 / amax, 0.0) + 0.5).clamp(-127, 127)
    return (q * (amax / 127)).reshape(x.shape).to(x.dtype)


def patch(mode: str, group: int, counts: dict) -> None:
    """Wraps the reference paths so that int4 products see quantized inputs (``mode``: see the
    module's docstring)."""
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
        h = F.silu(g) * u
        return F.linear(quantize_rows(h, group) if mode == "all" else h, down.to(x.dtype))[:n]

    if mode in ("dense", "all"):
        R.qlinear_ref = qlinear
    if mode in ("experts", "all"):  # combine_experts binds its ffn as a default argument
        defaults = list(M.combine_experts.__defaults__)
        defaults[-1] = ffn
        M.combine_experts.__defaults__ = tuple(defaults)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--text", type=Path, required=True)
    ap.add_argument("--max-tokens", type=int, default=8192)
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--mode", choices=("none", "experts", "dense", "all"), default="all")
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
        f"perplexity {ppl:.4f}; calls with x quantized: {counts}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
