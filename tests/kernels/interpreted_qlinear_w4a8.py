"""The W4A8 GEMV (kernels/qlinear_w4a8.py) under Triton's CPU interpreter, on small shapes
(``dp4a`` and the LOP3 as integer operations there). Not collected on its own: test_interpret.py
runs it with TRITON_INTERPRET=1. Claims and tolerances: w4a8_cases.py."""

import os

import pytest
from w4a8_cases import check

from edgerun.kernels import qlinear_w4a8 as M

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="run by test_interpret.py")


@pytest.mark.parametrize(
    "config", [M.W4A8Config(16, 256, 2), M.W4A8Config(8, 512, 4), M.W4A8Config(4, 128, 1)]
)
def test_w4a8_matches_its_reference(config):
    """40 rows (the last tile past the end), 512 columns: every claim of w4a8_cases.check."""
    check(40, 512, config, "cpu", seed=3, block=128)


def test_w4a8_refuses_what_it_cannot_run():
    import torch

    w, x = __import__("w4a8_cases").make(8, 256, "cpu", 0)
    with pytest.raises(ValueError, match="not a multiple of the tile's 512"):
        M.w4a8_gemv(x, w, config=M.W4A8Config(8, 512, 2))
    with pytest.raises(ValueError, match="one row of 256 columns"):
        M.w4a8_gemv(x[None], w)
    with pytest.raises(ValueError, match="int4 with groups of 32"):
        M.w4a8_gemv(x, type(w)("int4", w.weight, w.scales, w.row_scale, 64))
    assert torch.is_tensor(M.w4a8_gemv(x, w, config=M.W4A8Config(8, 256, 2)))
