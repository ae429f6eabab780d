"""``qgemv`` on a CUDA device at the real model's dense shapes: against ``qlinear_ref``, bit-for-bit
repeats, every epilogue, CUDA-graph replay equal to eager, and the probe cases.

Skipped without CUDA (CI has none); run on the GPU machine before resolving. Tolerances: the
probe's TOLERANCE against ``qlinear_ref`` (kernels/qlinear_reference.py says why); against the
exact-weight reference (fp32 weights, products and sums, one rounding: what the kernel computes)
a bf16 output must also be bit-equal but for rare one-ulp flips from the fp32 summation order.
"""

import pytest
import torch

from edgerun.kernels.dense_probe import rel_err
from edgerun.kernels.qlinear_reference import (
    TOLERANCE,
    epilogue_inputs,
    probe_cases,
    qlinear_ref,
    random_qweight,
)
from edgerun.kernels.qweight import QWeight, concat_rows

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (none on this machine)")
SHAPES = [(12352, 2048), (2048, 4096), (1024, 2048), (257, 2048), (248320, 2048)]
SCHEMES = [("int4", 32), ("int8", None)]  # int8 None: one scale per row


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def check(got, x, w, bias, epilogue, residual, gate):
    """Within TOLERANCE of qlinear_ref; in bf16 also mostly bit-equal to the exact-weight one."""
    ref = qlinear_ref(x, w, bias, epilogue, None if residual is None else residual.clone(), gate)
    assert got.dtype == ref.dtype and got.shape == ref.shape
    assert rel_err(got, ref) < TOLERANCE[x.dtype]
    exact = qlinear_ref(
        x, w, bias, epilogue, None if residual is None else residual.clone(), gate, exact_weight=True
    )
    if x.dtype == torch.float32:
        assert rel_err(got, exact) < 1e-5
    else:
        assert (got != exact).float().mean() < 0.01


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: f"{s[0]}-g{s[1] or 'row'}")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_real_shapes_match_and_repeat(shape, scheme):
    from edgerun.kernels.qlinear_triton import qgemv

    R, C = shape
    w = random_qweight(scheme[0], R, C, scheme[1] or C, gen(R), "cuda")
    for N in (1, 3):
        x = torch.randn(N, C, generator=gen(N), device="cuda").bfloat16()
        got = qgemv(x, w)
        check(got, x, w, None, "none", None, None)
        assert torch.equal(got, qgemv(x, w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("epilogue", ["none", "silu_mul", "residual", "gated"])
@pytest.mark.parametrize("scheme", [("int4", 32), ("int8", None), ("int8", 128), ("plain", None)], ids=str)
def test_epilogues(scheme, epilogue, dtype):
    from edgerun.kernels.qlinear_triton import qgemv

    R, C = 1024, 2048
    g = gen(7)
    w = random_qweight(scheme[0], R, C, scheme[1] or C, g, "cuda", dtype)
    for N in (1, 8):
        x = torch.randn(N, C, generator=g, device="cuda").to(dtype)
        bias = (torch.randn(R, generator=g, device="cuda") * 0.1).to(dtype)
        residual, gate = epilogue_inputs(epilogue, w, N, g, "cuda", dtype)
        out = None if residual is None else residual.clone()
        got = qgemv(x, w, bias, epilogue, out, gate)
        check(got, x, w, bias, epilogue, residual, gate)


@pytest.mark.parametrize("scheme", [("int4", 32), ("int8", None), ("plain", None)], ids=str)
def test_a_tokens_row_does_not_depend_on_the_batch(scheme):
    from edgerun.kernels.qlinear_triton import qgemv

    g = gen(9)
    w = random_qweight(scheme[0], 12352, 2048, scheme[1] or 2048, g, "cuda")
    x = torch.randn(8, 2048, generator=g, device="cuda").bfloat16()
    full = qgemv(x, w)
    for n in (1, 3, 5):
        assert torch.equal(qgemv(x[:n], w), full[:n])


def test_row_scales_of_concatenated_weights():
    from edgerun.kernels.qlinear_triton import qgemv

    g = gen(3)
    a = random_qweight("int4", 8192, 2048, 32, g, "cuda")
    b = random_qweight("int4", 4160, 2048, 32, g, "cuda")
    b = QWeight("int4", b.weight, b.scales, b.row_scale * 8, 32)  # another global scale
    w = concat_rows([a, b])
    x = torch.randn(1, 2048, generator=g, device="cuda").bfloat16()
    check(qgemv(x, w), x, w, None, "none", None, None)


def test_graph_replay_equals_eager():
    from edgerun.kernels.qlinear_triton import qgemv

    g = gen(5)
    w = random_qweight("int4", 12352, 2048, 32, g, "cuda")
    x = torch.randn(2, 2048, generator=g, device="cuda").bfloat16()
    residual = torch.randn(2, 12352, generator=g, device="cuda").bfloat16()
    out = residual.clone()

    def step():
        return qgemv(x, w), qgemv(x, w, epilogue="silu_mul"), qgemv(x, w, epilogue="residual", out=out)

    side = torch.cuda.Stream()  # compile outside the capture, on a side stream (torch's recipe)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for i in range(3):
        x.copy_(torch.randn(2, 2048, generator=gen(10 + i), device="cuda"))
        out.copy_(residual)
        graph.replay()
        replayed = [t.clone() for t in captured]
        out.copy_(residual)
        eager = step()
        assert all(torch.equal(r, e) for r, e in zip(replayed, eager))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_probe_cases(dtype):
    cases = [
        ("int4", 12352, 2048, 32, "none"),
        ("int4", 1024, 2048, 32, "silu_mul"),
        ("int8", 2048, 4096, 4096, "residual"),
        ("int8", 257, 2048, 2048, "gated"),
        ("plain", 248320, 2048, 0, "none"),
    ]
    assert probe_cases(cases, "cuda", dtype) < TOLERANCE[dtype]


@pytest.mark.parametrize("alone", [True, False], ids=["alone", "shared"])
@pytest.mark.parametrize(
    "shape", [(12352, 2048), (257, 2048), (1024, 2048), (2048, 4096)], ids=lambda s: f"{s[0]}x{s[1]}"
)
@pytest.mark.parametrize("scheme", [("int4", 32), ("int8", None), ("plain", None)], ids=lambda s: s[0])
def test_rows_alone_are_the_one_row_calls(shape, scheme, alone):
    """A batch's step: each row of a call of N = 1..8 rows equals the row alone, bit for bit,
    whether computed by programs of its own (``alone``) or in one pass over all rows, each in
    accumulators of its own (the compiled code must keep a row's operations whatever N is)."""
    from edgerun.kernels.qlinear_reference import rows_alone_mismatch
    from edgerun.kernels.qlinear_triton import qgemv

    R, C = shape
    w = random_qweight(scheme[0], R, C, scheme[1] or C, gen(R), "cuda", torch.bfloat16)
    assert rows_alone_mismatch(qgemv, w, 8, gen(7), "cuda", torch.bfloat16, alone=alone) is None
