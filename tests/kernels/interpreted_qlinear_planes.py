"""``qgemv_planes`` (kernels/qlinear_planes.py) under Triton's CPU interpreter, on small shapes.

Not collected on its own: test_interpret.py runs this file in a child process with
TRITON_INTERPRET=1 set before Triton is imported. Tolerances as for ``qgemv``
(interpreted_qlinear.py): within the probe's TOLERANCE of ``qlinear_ref``, because the products
are exact (q s and x are bf16) and only the fp32 summation order differs (the MMA's, then the
split's partial sums in order), y rounded once and each epilogue where torch rounds. Where the
claim is equality (a row against the one-row call, the normalised x against ``qgemv``'s, the
prefill dequantization against the reference's) the tests use torch.equal.
"""

import os

import pytest
import torch

from edgerun.kernels import qlinear_planes as P
from edgerun.kernels.dense_probe import rel_err
from edgerun.kernels.qlinear_reference import (
    TOLERANCE,
    epilogue_inputs,
    qlinear_ref,
    random_norm,
    random_qweight,
)
from edgerun.kernels.qlinear_triton import qgemv
from edgerun.kernels.qweight import dequantize

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="run by test_interpret.py")
EPILOGUES = ("none", "silu_mul", "residual", "gated")


def call(x, w, pw, count, cfg, epilogue, residual, gate, norm, bias=None):
    out = None if residual is None else residual.clone()
    no = None if norm is None else torch.empty_like(x)
    y = P.qgemv_planes(x, pw, bias, epilogue, out, gate, norm, no, config=cfg, count=count)
    return y, no


@pytest.mark.parametrize("split", [1, 2, 4])
@pytest.mark.parametrize("epilogue", EPILOGUES)
def test_planes_match_the_reference(epilogue, split):
    """Every epilogue, with and without a bias and an RMSNorm prologue of each kind, 1 and 3 rows,
    rows past the last tile's end (R = 40: 16-row tiles), the columns in ``split`` parts; the
    normalised x it writes is ``qgemv``'s, bit for bit (the same device code); the split
    counters are back at 0 after every call."""
    g = torch.Generator().manual_seed(7 + split)
    w = random_qweight("int4", 40, 256, 16, g, "cpu", torch.bfloat16)
    pw = P.planes_weight(w)
    count = P.planes_counters(pw, "cpu")
    cfg = P.PlanesConfig(block_r=16, num_warps=1, split=split)
    for kind, bias, n in (("none", False, 1), ("unit", True, 3), ("plain", False, 2)):
        x = (torch.randn(n, w.cols, generator=g) * 3).bfloat16()
        residual, gate = epilogue_inputs(epilogue, w, n, g, "cpu", torch.bfloat16)
        norm = random_norm(kind, w.cols, g, "cpu", torch.bfloat16)
        b = torch.randn(w.rows, generator=g).bfloat16() if bias else None
        got, normed = call(x, w, pw, count, cfg, epilogue, residual, gate, norm, b)
        ref_out = None if residual is None else residual.clone()
        ref_no = None if norm is None else torch.empty_like(x)
        want = qlinear_ref(x, w, b, epilogue, ref_out, gate, norm=norm, norm_out=ref_no)
        assert got.shape == want.shape and got.dtype == torch.bfloat16
        assert rel_err(got, want) < TOLERANCE[torch.bfloat16], (kind, bias, n)
        if norm is not None:
            rows_no = torch.empty_like(x)
            qgemv(
                x,
                w,
                b,
                epilogue,
                None if residual is None else residual.clone(),
                gate,
                norm=norm,
                norm_out=rows_no,
            )
            assert torch.equal(normed, rows_no)
        assert not count.any(), "a split call left its counters set"


@pytest.mark.parametrize("split", [1, 2])
def test_rows_are_the_one_row_calls(split):
    """Each row of a 5-row call equals the one-row call on that row, bit for bit, for every
    epilogue with a norm prologue: a request's tokens do not depend on its batch's other rows."""
    g = torch.Generator().manual_seed(35)
    w = random_qweight("int4", 32, 256, 32, g, "cpu", torch.bfloat16)
    pw = P.planes_weight(w)
    count = P.planes_counters(pw, "cpu")
    cfg = P.PlanesConfig(block_r=16, num_warps=1, split=split)
    x = torch.randn(5, 256, generator=g).bfloat16()
    norm = random_norm("unit", 256, g, "cpu", torch.bfloat16)
    for epilogue in EPILOGUES:
        residual, gate = epilogue_inputs(epilogue, w, 5, g, "cpu", torch.bfloat16)
        got, _ = call(x, w, pw, count, cfg, epilogue, residual, gate, norm)
        for j in range(5):
            one, _ = call(
                x[j : j + 1], w, pw, count, cfg, epilogue,
                None if residual is None else residual[j : j + 1], None if gate is None else gate[j : j + 1], norm,
            )  # fmt: skip
            assert torch.equal(got[j], one[0]), f"{epilogue}: row {j}"


def test_exact_weights_but_for_rare_flips():
    """The products are exact: the exact-weight reference's bits but for rare one-ulp flips from
    the summation order (a weight decoded or scaled wrongly would differ in most elements)."""
    g = torch.Generator().manual_seed(3)
    w = random_qweight("int4", 48, 512, 32, g, "cpu", torch.bfloat16)
    pw = P.planes_weight(w)
    x = torch.randn(4, 512, generator=g).bfloat16()
    got = P.qgemv_planes(x, pw, config=P.PlanesConfig(16, 1, 1))
    exact = qlinear_ref(x, w, exact_weight=True)
    assert int((got != exact).sum()) <= max(2, got.numel() // 100)


@pytest.mark.parametrize("group", [16, 32, 64])
def test_dequantize_planes_is_the_reference_dequantization(group):
    g = torch.Generator().manual_seed(group)
    w = random_qweight("int4", 37, 8 * group, group, g, "cpu", torch.bfloat16)
    assert torch.equal(P.dequantize_planes(P.planes_weight(w), torch.bfloat16), dequantize(w).bfloat16())
