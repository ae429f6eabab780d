"""``qgemv`` (kernels/qlinear_triton.py) under Triton's CPU interpreter, on small shapes.

Not collected on its own: test_interpret.py runs this file in a child process with
TRITON_INTERPRET=1 set before Triton is imported (Triton reads it at import). Tolerances:

- fp32: the kernel sums in another order than the reference (group sums, then the scale, then
  slots of a step) and does not round q * scale before the product (the reference does, in fp32):
  a few fp32 ulps of the largest partial sums, about 4e-7 of the output's scale seen; 1e-5 leaves
  a margin of 25 and still catches any wrong weight, scale or token (O(1) of the scale).
- bf16 / fp16: within the probe's TOLERANCE of ``qlinear_ref`` (kernels/qlinear_reference.py says
  why), and bit-equal to the exact-weight reference (``exact_weight=True``: what the kernel
  computes, rounded where the kernel rounds) but for rare one-ulp flips from the fp32 order: a
  kernel that rounded anywhere the reference does not would differ in most elements. Against
  ``qlinear_ref`` itself int8 differs in about a third of the elements (the reference rounds
  every dequantized weight to bf16), so the bit check is against the exact-weight reference.
"""

import dataclasses
import os

import pytest
import torch

from edgerun.kernels import qlinear_triton as K
from edgerun.kernels.dense_probe import rel_err
from edgerun.kernels.qlinear_reference import (
    TOLERANCE,
    Mismatch,
    epilogue_inputs,
    probe_cases,
    qlinear_ref,
    random_qweight,
)
from edgerun.kernels.qweight import QWeight, concat_rows

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="run by test_interpret.py")
TOL = {**TOLERANCE, torch.float32: 1e-5}
# (scheme, group): plain, int8 with one scale per row (None: group C) and per 16 columns, int4 g32, g16
SCHEMES = [("plain", None), ("int8", None), ("int8", 16), ("int4", 32), ("int4", 16)]
SMALL = K.GemvConfig(block_r=8, row_bytes=32, num_warps=4)  # 2 (int4) to 16 (fp32) steps at C = 128


def scheme_id(s) -> str:
    return s[0] + (f"-g{s[1]}" if s[1] else "")


def run_both(x, w, bias=None, epilogue="none", residual=None, gate=None, config=None):
    """(kernel output, qlinear_ref, exact-weight reference) on the same inputs."""
    fresh = (lambda: None) if residual is None else residual.clone
    got = K.qgemv(x, w, bias, epilogue, fresh(), gate, config=config)
    ref = qlinear_ref(x, w, bias, epilogue, fresh(), gate)
    exact = qlinear_ref(x, w, bias, epilogue, fresh(), gate, exact_weight=True)
    return got, ref, exact


def assert_matches(got, ref, exact) -> None:
    assert got.dtype == ref.dtype and got.shape == ref.shape
    assert rel_err(got, ref) < TOL[ref.dtype]
    if ref.dtype == torch.float32:
        assert rel_err(got, exact) < TOL[torch.float32]
    else:  # one-ulp flips: a few in 10^3 at C = 2048, so at most 1% (or 2 of a small output)
        assert int((got != exact).sum()) <= max(2, got.numel() // 100)


@pytest.mark.parametrize("epilogue", ["none", "silu_mul", "residual", "gated"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scheme", SCHEMES, ids=scheme_id)
def test_matches_reference_and_repeats(scheme, dtype, epilogue):
    # R = 38: not a multiple of the 8-row tile (silu_mul: 19 output columns, 4 a program)
    R, C = 38 if epilogue == "silu_mul" else 37, 128
    g = torch.Generator().manual_seed(R + len(epilogue))
    w = random_qweight(scheme[0], R, C, scheme[1] or C, g, dtype=dtype)
    bias = (torch.randn(R, generator=g) * 0.1).to(dtype) if epilogue != "gated" else None
    for N in (1, 3):
        x = torch.randn(N, C, generator=g).to(dtype)
        residual, gate = epilogue_inputs(epilogue, w, N, g, "cpu", dtype)
        got, ref, exact = run_both(x, w, bias, epilogue, residual, gate, SMALL)
        assert_matches(got, ref, exact)
        again = K.qgemv(
            x, w, bias, epilogue, None if residual is None else residual.clone(), gate, config=SMALL
        )
        assert torch.equal(got, again)


@pytest.mark.parametrize("scheme", SCHEMES, ids=scheme_id)
def test_default_tile_strided_x_and_out(scheme):
    # the tile gemv_config picks; x rows and out rows strided (columns contiguous)
    R, C = 45, 512
    g = torch.Generator().manual_seed(1)
    w = random_qweight(scheme[0], R, C, scheme[1] or C, g)
    x = torch.randn(2, C + 64, generator=g).bfloat16()[:, 32 : 32 + C]
    out = torch.zeros(2, R + 3, dtype=torch.bfloat16)[:, :R]
    assert K.qgemv(x, w, out=out) is out
    assert_matches(out, qlinear_ref(x, w), qlinear_ref(x, w, exact_weight=True))


@pytest.mark.parametrize("scheme", ["int8", "plain"])
def test_the_tiny_tile_of_a_router_sized_weight(scheme):
    # 257 rows of 1,024 columns: at least TINY_BYTES, and FEW's 8-row tile would leave SMs idle
    R, C = 257, 1024
    assert K.gemv_config(scheme, R, C) == K.TINY[scheme]
    g = torch.Generator().manual_seed(5)
    w = random_qweight(scheme, R, C, C, g)
    for N in (1, 2):
        x = torch.randn(N, C, generator=g).bfloat16()
        got = K.qgemv(x, w)
        assert_matches(got, qlinear_ref(x, w), qlinear_ref(x, w, exact_weight=True))
        assert torch.equal(got, K.qgemv(x, w))


def test_row_scales_of_concatenated_int4():
    # two int4 tensors of different global scales in one GEMV: each row keeps its own
    g = torch.Generator().manual_seed(2)
    a = random_qweight("int4", 20, 128, 32, g)
    b = random_qweight("int4", 13, 128, 32, g)
    b = QWeight("int4", b.weight, b.scales, b.row_scale * 64, 32)
    w = concat_rows([a, b])
    assert w.row_scale[0] * 64 == w.row_scale[-1]
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 128, generator=g).to(dtype)
        assert_matches(*run_both(x, w, config=SMALL))


def test_fp16():
    g = torch.Generator().manual_seed(3)
    w = random_qweight("int4", 24, 128, 32, g)
    x = torch.randn(2, 128, generator=g).half()
    assert_matches(*run_both(x, w, epilogue="silu_mul"))


def test_probe_cases_pass():
    cases = [
        ("int4", 257, 512, 32, "none"),
        ("int4", 64, 512, 16, "silu_mul"),
        ("int8", 40, 512, 512, "residual"),
        ("plain", 40, 512, 0, "gated"),
    ]
    assert probe_cases(cases, "cpu", torch.bfloat16) < TOLERANCE[torch.bfloat16]


def test_probe_refuses_a_wrong_kernel(monkeypatch):
    real = K.qgemv
    monkeypatch.setattr(K, "qgemv", lambda x, w, *a, **k: real(x * 1.5, w, *a, **k))
    with pytest.raises(Mismatch, match="int4 \\[64, 128\\].*max error"):
        probe_cases([("int4", 64, 128, 32, "none")], "cpu", torch.float32)


@pytest.mark.parametrize(
    "scheme, alone",
    [(("plain", None), False), (("int4", 32), False), (("int4", 32), True)],
    ids=["plain-shared", "int4-shared", "int4-alone"],
)
def test_rows_alone_are_the_one_row_calls(scheme, alone):
    """Each row of an N-row call equals the row alone, bit for bit, whether the rows run by
    programs of their own (``alone``) or in one pass, each in accumulators of its own (the
    interpreter checks the arithmetic; the device's compiled code is checked on CUDA and by the
    batch's start-up probe)."""
    from edgerun.kernels.qlinear_reference import random_qweight, rows_alone_mismatch

    gen = torch.Generator().manual_seed(21)
    w = random_qweight(scheme[0], 64, 128, scheme[1] or 128, gen, "cpu", torch.bfloat16)
    assert rows_alone_mismatch(K.qgemv, w, 3, gen, "cpu", torch.bfloat16, alone=alone) is None


@pytest.mark.parametrize("epilogue", ["none", "silu_mul", "residual"])
@pytest.mark.parametrize("scheme", SCHEMES, ids=scheme_id)
def test_rolled_rows_are_the_unrolled_one_row_calls(scheme, epilogue):
    """Calls of 2+ rows loop over their steps (``rolled``, each step's words read one ahead),
    the one-row call unrolls them: every row of a rolled call equals the unrolled one-row call's
    row bit for bit, RMSNorm prologue included (the interpreter checks the arithmetic; the
    device's compiled code is checked on CUDA and by the batch's start-up probe)."""
    gen = torch.Generator().manual_seed(22)
    w = random_qweight(scheme[0], 32, 128, scheme[1] or 128, gen, "cpu", torch.bfloat16)
    x = torch.randn(3, 128, generator=gen).bfloat16()
    width = 16 if epilogue == "silu_mul" else 32
    resid = torch.randn(3, width, generator=gen).bfloat16()
    norm = (torch.randn(128, generator=gen).bfloat16(), 1e-6, True)

    def call(rows, rolled, out):
        return K.qgemv(rows, w, None, epilogue, out, config=SMALL, norm=norm, rolled=rolled)

    got = call(x, True, resid.clone() if epilogue == "residual" else None)
    for j in range(3):
        one = call(x[j : j + 1], False, resid[j : j + 1].clone() if epilogue == "residual" else None)
        assert torch.equal(got[j : j + 1], one), f"row {j}"


def test_bad_inputs_name_the_tensor():
    g = torch.Generator().manual_seed(4)
    w = random_qweight("int4", 16, 64, 32, g)
    x = torch.randn(2, 64, generator=g).bfloat16()
    cases = [
        (dict(x=torch.randn(2, 64, 2)), "x must be \\[N, C\\]"),
        (dict(x=torch.randn(64, 2).bfloat16().t()), "x must be \\[N, C\\] with contiguous rows"),
        (dict(x=torch.randn(9, 64).bfloat16()), "at most 8"),
        (dict(x=torch.randn(2, 32).bfloat16()), "does not match the weight's 64 columns"),
        (dict(w=QWeight("int4", w.weight, w.scales.float(), w.row_scale, 32)), "scales must be torch.uint8"),
        (dict(w=QWeight("plain", torch.randn(16, 64))), "plain weight .* must have x's dtype"),
        (dict(bias=torch.randn(15).bfloat16()), "bias must be torch.bfloat16 \\[16\\]"),
        (dict(bias=torch.randn(16)), "bias must be torch.bfloat16"),
        (dict(epilogue="gelu"), "epilogue 'gelu' is not one of"),
        (dict(epilogue="residual"), "needs out"),
        (dict(out=torch.empty(2, 8, dtype=torch.bfloat16)), "out must be torch.bfloat16 \\[2, 16\\]"),
        (dict(epilogue="silu_mul", out=torch.empty(2, 16, dtype=torch.bfloat16)), "out must be .*\\[2, 8\\]"),
        (dict(epilogue="gated"), "needs gate .*got None"),
        (dict(epilogue="gated", gate=torch.randn(2, 1)), "needs gate torch.bfloat16 \\[2, 1\\]"),
        (dict(w=random_qweight("int4", 15, 64, 32, g), epilogue="silu_mul"), "odd 15 rows"),
    ]
    for kwargs, msg in cases:
        args = {"x": x, "w": w, **kwargs}
        with pytest.raises(ValueError, match=msg):
            K.qgemv(**args)
    with pytest.raises(ValueError, match="block_r must be a power of two"):
        K.GemvConfig(block_r=3)


def test_unsupported_weights():
    g = torch.Generator().manual_seed(5)
    assert K.unsupported(random_qweight("int4", 4, 64, 32, g)) is None
    assert K.unsupported(random_qweight("int8", 4, 1000, 1000, g)) is None  # one scale per row
    q, s = torch.zeros(4, 48, dtype=torch.int8), torch.ones(4, 4)
    assert "group 12 is not a power of two" in K.unsupported(QWeight("int8", q, s, group=12))
    q, s = torch.zeros(4, 1002, dtype=torch.int8), torch.ones(4, 1)
    assert "not a multiple of 4" in K.unsupported(QWeight("int8", q, s, group=1002))
    assert "float64" in K.unsupported(QWeight("plain", torch.zeros(4, 8, dtype=torch.float64)))
    with pytest.raises(ValueError, match="cannot run this weight: int4 group 4"):
        w = QWeight(
            "int4",
            torch.zeros(4, 4, dtype=torch.uint8),
            torch.zeros(4, 2, dtype=torch.uint8),
            torch.ones(4),
            4,
        )
        K.qgemv(torch.randn(1, 8), w)


@pytest.mark.parametrize("kind", ["unit", "plain"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_prologue_matches_a_separate_norm(kind, dtype):
    """RMSNorm in the GEMV's prologue (and the normalised x written out) against rms_norm_ref
    then the GEMV's reference: fp32 within 1e-5 (summation order), bf16 within the probe's
    tolerance (a rounded normalised value may land an ulp away); 3 tokens, rows of 2 programs'
    tiles and of the normalised-x slices."""
    from edgerun.kernels.dense_reference import rms_norm_ref
    from edgerun.kernels.qlinear_reference import random_norm

    g = torch.Generator().manual_seed(11)
    for scheme, group, epilogue in (("int4", 32, "none"), ("int8", 16, "silu_mul"), ("plain", 0, "none")):
        w = random_qweight(scheme, 48, 128, group, g, dtype=dtype)
        x = (torch.randn(3, 128, generator=g) * 3).to(dtype)
        norm = random_norm(kind, 128, g, "cpu", dtype)
        normed = torch.empty_like(x)
        got = K.qgemv(x, w, None, epilogue, norm=norm, norm_out=normed, config=SMALL)
        want = qlinear_ref(rms_norm_ref(x, *norm), w, None, epilogue, exact_weight=True)
        assert rel_err(got, want) < TOL[dtype]
        assert rel_err(normed, rms_norm_ref(x, *norm)) < TOL[dtype]
        assert torch.equal(got, K.qgemv(x, w, None, epilogue, norm=norm, config=SMALL))  # norm_out or not
    cases = [("int4", 40, 256, 32, "none", kind), ("int8", 16, 256, 256, "silu_mul", kind)]
    assert probe_cases(cases, "cpu", dtype) < TOLERANCE[dtype]


@pytest.mark.parametrize("rows", [1, 3, 5])
def test_norm_weights_read_early_are_the_same_bits(rows, monkeypatch):
    """``EARLY_NORMS``: the norm's weights at a program's first step read before its wait (a
    tile of one step, as the router's; one of 16 steps) give the GEMV's output and the normalised
    x of the launch that reads them in the step, bit for bit: one row, three, and five (rolled,
    which reads them in its loop either way)."""
    from edgerun.kernels import launch
    from edgerun.kernels.qlinear_reference import random_norm

    g = torch.Generator().manual_seed(13)
    one_step = K.GemvConfig(block_r=8, row_bytes=64, num_warps=4, rolled_from=4)
    for scheme, group, cols, epilogue, cfg in (
        ("int4", 32, 128, "none", one_step),
        ("int8", 16, 512, "silu_mul", dataclasses.replace(SMALL, rolled_from=4)),
    ):
        w = random_qweight(scheme, 40, cols, group, g, dtype=torch.bfloat16)
        x = (torch.randn(rows, cols, generator=g) * 3).bfloat16()
        norm = random_norm("unit", cols, g, "cpu", torch.bfloat16)
        runs = []
        for early in (False, True):
            monkeypatch.setattr(launch, "EARLY_NORMS", early)
            normed = torch.empty_like(x)
            runs.append((K.qgemv(x, w, None, epilogue, norm=norm, norm_out=normed, config=cfg), normed))
        assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


def test_norm_prologue_refuses_mismatched_inputs():
    g = torch.Generator().manual_seed(12)
    w = random_qweight("int4", 16, 64, 32, g)
    x = torch.randn(1, 64).bfloat16()
    with pytest.raises(ValueError, match="norm weight must be torch.bfloat16 \\[64\\]"):
        K.qgemv(x, w, norm=(torch.ones(64), 1e-6, False))
    with pytest.raises(ValueError, match="norm_out must not be x"):
        K.qgemv(x, w, norm=(torch.ones(64).bfloat16(), 1e-6, False), norm_out=x)
    with pytest.raises(ValueError, match="norm_out is the normalised x: it needs norm"):
        K.qgemv(x, w, norm_out=torch.empty_like(x))


@pytest.mark.parametrize("scheme,group", [s for s in SCHEMES if s[0] != "plain"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequantize_weight_is_the_references_bits(scheme, group, dtype):
    from edgerun.kernels.qweight import dequantize

    # 37 rows: a tail program; every e4m3 scale code but NaN for int4 (subnormals included)
    w = random_qweight(scheme, 37, 128, group or 128, torch.Generator().manual_seed(5))
    if scheme == "int4":
        codes = (torch.arange(w.scales.numel()) % 0x7F).to(torch.uint8).reshape(w.scales.shape)
        w = QWeight("int4", w.weight, codes, w.row_scale, w.group)
    got = K.dequantize_weight(w, dtype)
    assert got.dtype == dtype and torch.equal(got, dequantize(w).to(dtype))
