"""The W4A8 GEMV (kernels/qlinear_w4a8.py) on a CUDA device at Qwen3.6-35B-A3B's dense shapes:
every claim of w4a8_cases.check (x's words exact, x quantized inside == given, fp32 within its
rounding bound of the exact terms, bf16 rounded once, W4A16 within int8's error), bit-for-bit
repeats, and a CUDA graph's replay equal to the eager call.

Skipped without CUDA (CI has none): interpreted_qlinear_w4a8.py checks the same on the CPU."""

import pytest
import torch
from w4a8_cases import check, make

from edgerun.kernels import qlinear_w4a8 as M

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (none on this machine)")
SHAPES = [(248320, 2048), (12352, 2048), (2048, 4096), (1024, 2048), (2048, 512)]
CONFIGS = [
    M.W4A8Config(16, 512, 2),
    M.W4A8Config(32, 512, 4),
    M.W4A8Config(8, 1024, 4),
    M.W4A8Config(4, 512, 2),
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"r{c.block_r}-k{c.block_k}-w{c.num_warps}")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_w4a8_on_cuda(shape, config):
    R, C = shape
    if C % config.block_k:
        pytest.skip(f"{C} columns are not a multiple of the tile's {config.block_k}")
    check(R, C, config, "cuda", seed=R + C)
    w, x = make(R, C, "cuda", 1)
    xq = M.quantize_x(x)
    first = M.w4a8_gemv(x, w, xq, config=config)
    assert torch.equal(first, M.w4a8_gemv(x, w, xq, config=config)), "a repeat differs"
    out = torch.empty_like(first)
    graph = torch.cuda.CUDAGraph()
    M.w4a8_gemv(x, w, None, out=out, config=config)  # compiled before the capture
    with torch.cuda.graph(graph):
        M.w4a8_gemv(x, w, None, out=out, config=config)
    out.zero_()
    graph.replay()
    assert torch.equal(out, first), "the graph's replay differs from the eager call"
