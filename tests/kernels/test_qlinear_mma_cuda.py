"""``qgemv_mma`` (kernels/qlinear_mma.py) on a CUDA device at the real model's dense shapes: each row
of an N = 1..16 row call equal to the row alone (torch.equal), accuracy against ``qlinear_ref``,
bit-for-bit repeats, CUDA-graph replay equal to eager.

Skipped without CUDA (CI has none); run on the GPU machine. Tolerances, as for ``qgemv``
(test_qlinear_cuda.py): the probe's TOLERANCE against ``qlinear_ref``, and mostly bit-equal to
the reference computing what the kernel computes (exact weights, fp32 sums, one rounding): the
tensor core's fp32 accumulation differs from it only in order and alignment, one-ulp flips.
"""

import pytest
import torch

from edgerun.kernels.dense_probe import rel_err
from edgerun.kernels.qlinear_reference import (
    TOLERANCE,
    epilogue_inputs,
    qlinear_ref,
    random_qweight,
    rows_alone_mismatch,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (none on this machine)")
# (R, C, epilogue): lm_head, a DeltaNet layer's qkv/z/a/b in one GEMV, o_proj, shared gate/up
SHAPES = [(248320, 2048, "none"), (12352, 2048, "none"), (2048, 4096, "residual"), (1024, 2048, "silu_mul")]
SCHEMES = [("int4", 32), ("int8", None), ("int8", 128), ("plain", None)]  # int8 None: one scale per row


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def shape_id(s) -> str:
    return f"{s[0]}x{s[1]}-{s[2]}"


def scheme_id(s) -> str:
    return s[0] + (f"-g{s[1]}" if s[1] else "")


def check(got, x, w, epilogue, residual, gate):
    fresh = (lambda: None) if residual is None else residual.clone
    ref = qlinear_ref(x, w, None, epilogue, fresh(), gate)
    assert got.dtype == ref.dtype and got.shape == ref.shape
    assert rel_err(got, ref) < TOLERANCE[x.dtype]
    grouped_int8 = w.scheme == "int8" and w.group != w.cols
    same = qlinear_ref(x, w, None, epilogue, fresh(), gate, exact_weight=not grouped_int8)
    assert (got != same).float().mean() < 0.01


@pytest.mark.parametrize("scheme", SCHEMES, ids=scheme_id)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_real_shapes_match_and_repeat(shape, scheme):
    from edgerun.kernels.qlinear_mma import qgemv_mma

    R, C, epilogue = shape
    g = gen(R)
    w = random_qweight(scheme[0], R, C, scheme[1] or C, g, "cuda")
    for N in (1, 5, 16):
        x = torch.randn(N, C, generator=g, device="cuda").bfloat16()
        residual, gate = epilogue_inputs(epilogue, w, N, g, "cuda", torch.bfloat16)
        fresh = (lambda: None) if residual is None else residual.clone
        got = qgemv_mma(x, w, None, epilogue, fresh())
        check(got, x, w, epilogue, residual, gate)
        assert torch.equal(got, qgemv_mma(x, w, None, epilogue, fresh()))


@pytest.mark.parametrize("scheme", SCHEMES, ids=scheme_id)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_rows_of_1_to_16_equal_the_row_alone(shape, scheme):
    """The batched-decode property: row r of an N-row call (N = 1..16, every position) is the
    one-row call's, bit for bit; also with the rows reversed."""
    from edgerun.kernels.qlinear_mma import qgemv_mma

    R, C, epilogue = shape
    g = gen(R + 1)
    w = random_qweight(scheme[0], R, C, scheme[1] or C, g, "cuda")
    x = torch.randn(16, C, generator=g, device="cuda").bfloat16()
    residual, _ = epilogue_inputs(epilogue, w, 16, g, "cuda", torch.bfloat16)

    def call(rows):
        return qgemv_mma(x[rows], w, None, epilogue, None if residual is None else residual[rows].clone())

    alone = torch.cat([call(slice(r, r + 1)) for r in range(16)])
    for n in range(1, 17):
        got = call(slice(0, n))
        bad = [r for r in range(n) if not torch.equal(got[r], alone[r])]
        assert not bad, f"N = {n}: rows {bad} differ from the rows alone"
    assert torch.equal(call(torch.arange(15, -1, -1, device="cuda")), alone.flip(0))


@pytest.mark.parametrize("shape", [(12352, 2048), (1024, 2048)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_every_epilogue_and_the_norm_rows_alone(shape):
    """rows_alone_mismatch (every epilogue, the norm prologue and its normalised x) for N = 1..16."""
    from edgerun.kernels.qlinear_mma import qgemv_mma

    def gemv(*args, alone, **kwargs):  # one kernel for every N: no other path
        return qgemv_mma(*args, **kwargs)

    R, C = shape
    w = random_qweight("int4", R, C, 32, gen(R), "cuda")
    assert rows_alone_mismatch(gemv, w, 16, gen(7), "cuda", torch.bfloat16) is None


@pytest.mark.parametrize("epilogue", ["none", "silu_mul", "residual", "gated"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_epilogues_and_dtypes(epilogue, dtype):
    from edgerun.kernels.qlinear_mma import qgemv_mma

    R, C = 1024, 2048
    g = gen(8)
    w = random_qweight("int4", R, C, 32, g, "cuda", dtype)
    for N in (1, 16):
        x = torch.randn(N, C, generator=g, device="cuda").to(dtype)
        residual, gate = epilogue_inputs(epilogue, w, N, g, "cuda", dtype)
        got = qgemv_mma(x, w, None, epilogue, None if residual is None else residual.clone(), gate)
        check(got, x, w, epilogue, residual, gate)


def test_graph_replay_equals_eager():
    from edgerun.kernels.qlinear_mma import qgemv_mma

    g = gen(5)
    w = random_qweight("int4", 12352, 2048, 32, g, "cuda")
    x = torch.randn(16, 2048, generator=g, device="cuda").bfloat16()
    residual = torch.randn(16, 12352, generator=g, device="cuda").bfloat16()
    out = residual.clone()

    def step():
        return (
            qgemv_mma(x, w),
            qgemv_mma(x[:3], w, epilogue="silu_mul"),
            qgemv_mma(x, w, epilogue="residual", out=out),
        )

    side = torch.cuda.Stream()  # compile outside the capture, on a side stream (torch's recipe)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for i in range(3):
        x.copy_(torch.randn(16, 2048, generator=gen(10 + i), device="cuda"))
        out.copy_(residual)
        graph.replay()
        replayed = [t.clone() for t in captured]
        out.copy_(residual)
        eager = step()
        assert all(torch.equal(r, e) for r, e in zip(replayed, eager))
