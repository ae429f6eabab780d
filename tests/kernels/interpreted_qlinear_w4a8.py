"""The W4A8 GEMV (kernels/qlinear_w4a8.py) under Triton's CPU interpreter, on small shapes
(``dp4a`` and the LOP3 as integer operations there). Not collected on its own: test_interpret.py
runs it with TRITON_INTERPRET=1. Claims and tolerances: w4a8_cases.py."""

import dataclasses
import os

import pytest
import torch
from w4a8_cases import A8_REL_ERR, check

from edgerun.kernels import qlinear_triton as K
from edgerun.kernels import qlinear_w4a8 as M
from edgerun.kernels.dense_probe import rel_err
from edgerun.kernels.qlinear_reference import (
    TOLERANCE,
    epilogue_inputs,
    qlinear_ref,
    random_norm,
    random_qweight,
    rows_alone_mismatch,
)
from edgerun.kernels.qlinear_triton import qgemv

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="run by test_interpret.py")


@pytest.mark.parametrize(
    "config", [M.W4A8Config(16, 256, 2), M.W4A8Config(8, 512, 4), M.W4A8Config(4, 128, 1)]
)
def test_w4a8_matches_its_reference(config):
    """40 rows (the last tile past the end), 512 columns: every claim of w4a8_cases.check."""
    check(40, 512, config, "cpu", seed=3, block=128)


def test_w4a8_refuses_what_it_cannot_run():
    w, x = __import__("w4a8_cases").make(8, 256, "cpu", 0)
    with pytest.raises(ValueError, match="not a multiple of the tile's 512"):
        M.w4a8_gemv(x, w, config=M.W4A8Config(8, 512, 2))
    with pytest.raises(ValueError, match="one row of 256 columns"):
        M.w4a8_gemv(x[None], w)
    with pytest.raises(ValueError, match="int4 with groups of 32"):
        M.w4a8_gemv(x, type(w)("int4", w.weight, w.scales, w.row_scale, 64))
    assert torch.is_tensor(M.w4a8_gemv(x, w, config=M.W4A8Config(8, 256, 2)))


TILE = K.GemvConfig(16, 128, 2)  # 4 steps of 128 columns a row: the step loop runs


def _a8(w):
    return dataclasses.replace(w, act="int8")


def _run(fn, w, x, b, epilogue, residual, gate, norm):
    out = None if residual is None else residual.clone()
    return fn(x, w, b, epilogue, out, gate, norm=norm)


@pytest.mark.parametrize("epilogue", ["none", "silu_mul", "residual", "gated"])
def test_qgemv_runs_an_int8_activation_weight_as_its_reference(epilogue):
    """``qgemv`` on a weight whose ``act`` is int8 (W4A8: QUANT 3) against ``qlinear_ref``, which
    quantizes x the same way and multiplies exactly: the only differences are fp32 sums and the
    one rounding to bf16, so the probe's TOLERANCE holds with room (0 in practice); against the
    same weight with bf16 activations the error is int8's (w4a8_cases.A8_REL_ERR). Every norm
    kind, 1 and 3 rows, a bias, rows past the last tile (R = 40)."""
    g = torch.Generator().manual_seed(11)
    w = _a8(random_qweight("int4", 40, 256, 32, g, "cpu", torch.bfloat16))
    for kind, bias, n in (("none", False, 1), ("unit", True, 3), ("plain", False, 2)):
        x = (torch.randn(n, w.cols, generator=g) * 3).bfloat16()
        residual, gate = epilogue_inputs(epilogue, w, n, g, "cpu", torch.bfloat16)
        norm = random_norm(kind, w.cols, g, "cpu", torch.bfloat16)
        b = torch.randn(w.rows, generator=g).bfloat16() if bias else None

        args = (x, b, epilogue, residual, gate, norm)
        got = _run(lambda *a, **k: qgemv(*a, config=TILE, **k), w, *args)
        assert rel_err(got, _run(qlinear_ref, w, *args)) <= TOLERANCE[torch.bfloat16], (kind, n)
        # silu_mul multiplies two outputs, each within int8's error: about twice it
        limit = A8_REL_ERR * (2 if epilogue == "silu_mul" else 1)
        assert rel_err(got, _run(qlinear_ref, dataclasses.replace(w, act="bf16"), *args)) < limit, (kind, n)


def test_qgemv_int8_activation_rows_equal_the_row_alone():
    """Each row of an N-row call (N = 1..3) in one pass over the weight is the one-row call's
    bits: x is quantized row by row, so a batch's step and a verify window keep a row's bits
    (every epilogue, a norm). (``alone``, each row by programs of its own, is the one-row call by
    construction; interpreted_qlinear.py runs it.)"""
    g = torch.Generator().manual_seed(5)
    w = _a8(random_qweight("int4", 40, 256, 32, g, "cpu", torch.bfloat16))
    assert rows_alone_mismatch(K.qgemv, w, 3, g, "cpu", torch.bfloat16, alone=False) is None


def test_int8_activations_are_refused_where_they_do_not_run():
    """int8 activations need int4 g32; the nibble-plane, MMA and CPU GEMVs say they run on qgemv only."""
    from edgerun.kernels import qlinear_cpu, qlinear_mma, qlinear_planes
    from edgerun.kernels.qweight import concat_rows

    g = torch.Generator().manual_seed(0)
    w = random_qweight("int4", 32, 256, 32, g, "cpu", torch.bfloat16)
    with pytest.raises(ValueError, match="int8 activations need an int4 weight in groups of 32"):
        dataclasses.replace(random_qweight("int4", 32, 256, 64, g, "cpu", torch.bfloat16), act="int8").check(
            "w"
        )
    with pytest.raises(ValueError, match="act 'fp8' is not one of bf16, int8"):
        dataclasses.replace(w, act="fp8").check("w")
    with pytest.raises(ValueError, match="cannot concatenate rows of int8 activations with rows of bf16"):
        concat_rows([w, _a8(w)])
    assert concat_rows([_a8(w), _a8(w)]).act == "int8"
    for why in (
        qlinear_planes.planes_unsupported(_a8(w), torch.bfloat16),
        qlinear_mma.mma_unsupported(_a8(w), torch.bfloat16),
        qlinear_cpu.unsupported(_a8(w)),
    ):
        assert why == "int8 activations (W4A8) run on qgemv only"


def test_the_start_up_probe_runs_int8_activations_against_their_reference():
    """``probe_cases`` with ``act`` int8 (what ``--dense-act int8`` runs at load): each case's weight
    takes int8 activations, against the reference that quantizes x the same way, norm prologue
    included, within a quarter of the tolerance (fp32 sums and one rounding are all that differ);
    a weight that cannot take int8 activations is refused by name."""
    from edgerun.kernels.qlinear_reference import probe_cases

    cases = [("int4", 48, 256, 32, "none"), ("int4", 48, 256, 32, "none", "unit")]
    worst = probe_cases(cases, "cpu", torch.bfloat16, act="int8")
    assert worst <= TOLERANCE[torch.bfloat16] / 4
    with pytest.raises(ValueError, match="int8 activations need an int4 weight in groups of 32"):
        probe_cases([("int4", 48, 256, 64, "none")], "cpu", torch.bfloat16, act="int8")


@pytest.mark.parametrize("rows, alone", [(1, False), (3, False), (3, True)])
def test_norm_q_out_is_the_normalised_x_quantized(rows, alone):
    """``qgemv``'s ``norm_q_out`` (the router's launch storing its normalised x quantized for the
    experts' gate_up): the bits ``quantize_x`` gives on ``norm_out`` and ``quantize_rows_ref`` on
    it (torch.equal), a router-sized plain weight's outputs unchanged by it, and with a paired
    second GEMV (the shared expert's gate_up: ``also``) too; refused without a norm, naming it."""
    g = torch.Generator().manual_seed(rows)
    w = random_qweight("plain", 20, 256, 0, g, "cpu", torch.bfloat16)
    x = (torch.randn(rows, w.cols, generator=g) * 3).bfloat16()
    norm = random_norm("unit", w.cols, g, "cpu", torch.bfloat16)

    def run(**kw):
        normed, q = torch.empty_like(x), M.quantize_x(torch.zeros_like(x))
        y = qgemv(x, w, norm=norm, norm_out=normed, norm_q_out=q, alone=alone, **kw)
        return y, normed, q

    y, normed, q = run()
    assert torch.equal(y, qgemv(x, w, norm=norm, alone=alone))
    for got, want, ref in zip(q, M.quantize_x(normed), M.quantize_rows_ref(normed)):
        assert torch.equal(got, want) and torch.equal(got, ref)
    if rows == 1:
        w2 = random_qweight("int4", 32, 256, 32, g, "cpu", torch.bfloat16)
        mid = torch.empty(1, 16, dtype=torch.bfloat16)
        _, normed2, q2 = run(also=(w2, "silu_mul", mid))
        assert torch.equal(normed2, normed) and all(torch.equal(a, b) for a, b in zip(q2, q))
    with pytest.raises(ValueError, match="norm_q_out is the normalised x quantized: it needs norm"):
        qgemv(x, w, norm_q_out=q)
    with pytest.raises(ValueError, match=rf"norm_q_out scales must be \[{rows}, 8\]"):
        qgemv(x, w, norm=norm, norm_q_out=(q[0], q[1], q[2][:, :1], q[3]))
