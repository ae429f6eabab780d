"""Cases of the W4A8 GEMV (kernels/qlinear_w4a8.py), shared by its interpreted script (CPU, small
shapes) and its CUDA test (the model's shapes).

What is exact and what is approximate, and why:
- x's int8 words, scales and offsets equal ``quantize_x_ref``'s (torch.equal): the same fp32
  operations, no contraction;
- the kernel with x quantized inside equals the kernel given ``quantize_x``'s output (torch.equal):
  the same values through the same operations;
- the fp32 result agrees with ``w4a8_ref`` (fp64) within FP32_TERMS ulps of fp32 times the sum of
  the groups' |terms| (each group's integer sum is exact; the group's term takes three fp32
  roundings, a scale product, a product and its add, and the sum of G groups adds at most G more);
- the bf16 result is the fp32 result rounded once (torch.equal; truncated under the interpreter,
  whose cast truncates);
- against the W4A16 result (bf16 x, ``qlinear_ref``) the relative error stays under A8_REL_ERR:
  int8 per group of 32 rounds each x value by at most half a step, max|x| / 254, so the dot
  product's relative error is about 1 / (127 sqrt(12)) ~ 0.2-0.6% for random x and weights (0.5%
  measured on the CPU); a broken quantization (a wrong lane, a lost offset) is off by 10-100%.
"""

from __future__ import annotations

import torch

from edgerun.kernels import qlinear_w4a8 as M
from edgerun.kernels.dense_probe import rel_err
from edgerun.kernels.qlinear_reference import qlinear_ref, random_qweight

FP32_TERMS = 8
A8_REL_ERR = 0.015


def make(R: int, C: int, device, seed: int):
    g = torch.Generator(device=device).manual_seed(seed)
    w = random_qweight("int4", R, C, M.GROUP, g, device, torch.bfloat16)
    x = (torch.randn(C, generator=g, device=device) * 3).bfloat16()
    x[32:64] = 0  # an all-zero group: scale 0, values 0
    x[64:96] = torch.linspace(-1e-3, 2e-3, 32, device=device).bfloat16()  # a small one
    return w, x


def check(R: int, C: int, config: M.W4A8Config, device, seed: int, block: int = 512) -> dict:
    """Runs every claim of the module docstring on one weight; returns the errors."""
    w, x = make(R, C, device, seed)
    xq = M.quantize_x(x, block)
    for got, want, what in zip(
        xq, M.quantize_rows_ref(x[None]), ("even-column words", "odd-column words", "scales", "offsets")
    ):
        assert torch.equal(got, want[0]), f"x's {what}"

    y32 = M.w4a8_gemv(x, w, xq, out=torch.empty(R, dtype=torch.float32, device=device), config=config)
    inside = M.w4a8_gemv(x, w, None, out=torch.empty(R, dtype=torch.float32, device=device), config=config)
    assert torch.equal(y32, inside), "x quantized in the kernel against quantize_x's"
    y16 = M.w4a8_gemv(x, w, xq, config=config)
    if device == "cpu":  # Triton's interpreter casts to bf16 by truncation (the GPU rounds to nearest-even)
        once = (y32.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)
    else:
        once = y32.to(torch.bfloat16)
    assert torch.equal(y16, once), "the bf16 result is the fp32 one rounded once"

    terms = M.w4a8_terms(x, w)
    bound = FP32_TERMS * 2.0**-24 * terms.abs().sum(dim=1)
    over = (y32.double() - terms.sum(dim=1)).abs() - bound
    assert float(over.max()) <= 0, f"{int((over > 0).sum())} rows beyond fp32 rounding of the exact terms"

    a16 = qlinear_ref(x[None], w, exact_weight=True)[0]
    err = rel_err(y16, a16)
    assert err < A8_REL_ERR, f"relative error {err:.4f} against W4A16"
    return dict(rel_err_vs_w4a16=err)
