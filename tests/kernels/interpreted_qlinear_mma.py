"""``qgemv_mma`` (kernels/qlinear_mma.py) under Triton's CPU interpreter, on small shapes.

Not collected on its own: test_interpret.py runs this file in a child process with
TRITON_INTERPRET=1 set before Triton is imported. Tolerances, as for ``qgemv``
(interpreted_qlinear.py): within the probe's TOLERANCE of ``qlinear_ref``, because the kernel
rounds where the reference rounds (the weight tile is exact, or rounded as the reference rounds
it for grouped int8; products are exact in fp32; y rounded once, each epilogue where torch
rounds) and otherwise differs only in the fp32 summation order; and bit-equal to the reference
that computes what the kernel computes (fp32 sums of exact products, one rounding) but for
rare one-ulp flips from that order. Row independence is equality: torch.equal.
"""

import os

import pytest
import torch

from edgerun.kernels import qlinear_mma as K
from edgerun.kernels.dense_probe import rel_err
from edgerun.kernels.dense_reference import rms_norm_ref
from edgerun.kernels.qlinear_reference import (
    TOLERANCE,
    epilogue_inputs,
    qlinear_ref,
    random_norm,
    random_qweight,
    rows_alone_mismatch,
)
from edgerun.kernels.qweight import QWeight, dequantize

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="run by test_interpret.py")
SMALL = K.MmaConfig(block_r=16, block_k=32, num_warps=4)  # 3 programs, 4 steps at R = 37, C = 128


def scheme_id(s) -> str:
    return s[0] + (f"-g{s[1]}" if s[1] else "")


def same_sums_ref(x, w, bias=None, epilogue="none", residual=None, gate=None, norm=None):
    """The reference computing what the kernel computes: exact weights (grouped int8: rounded to
    x.dtype, as the kernel's tile is), fp32 sums, one rounding, then the epilogue."""
    if norm is not None:
        x = rms_norm_ref(x, *norm)
    grouped_int8 = w.scheme == "int8" and w.group != w.cols
    return qlinear_ref(x, w, bias, epilogue, residual, gate, exact_weight=not grouped_int8)


def assert_close_and_mostly_equal(got, x, w, bias=None, epilogue="none", residual=None, gate=None, norm=None):
    fresh = (lambda: None) if residual is None else residual.clone
    ref = qlinear_ref(x, w, bias, epilogue, fresh(), gate, norm=norm)
    assert got.dtype == ref.dtype and got.shape == ref.shape
    assert rel_err(got, ref) < TOLERANCE[x.dtype]
    same = same_sums_ref(x, w, bias, epilogue, fresh(), gate, norm)
    assert int((got != same).sum()) <= max(2, got.numel() // 100)  # one-ulp flips from the order


# every epilogue over int4 g32; each other scheme with one (the epilogue code is the scheme's too)
CASES = [(("int4", 32), e) for e in ("none", "silu_mul", "residual", "gated")] + [
    (("int4", 16), "none"),
    (("int8", None), "silu_mul"),
    (("int8", 16), "residual"),
    (("plain", None), "gated"),
    (("plain", None), "none"),
]


@pytest.mark.parametrize("scheme, epilogue", CASES, ids=[f"{scheme_id(s)}-{e}" for s, e in CASES])
def test_matches_reference_and_repeats(scheme, epilogue):
    # R = 37 / 38: not a multiple of the 16-row tile (silu_mul: 19 output columns, 8 a program)
    R, C = 38 if epilogue == "silu_mul" else 37, 128
    g = torch.Generator().manual_seed(R + len(epilogue))
    dtype = torch.bfloat16
    w = random_qweight(scheme[0], R, C, scheme[1] or C, g, dtype=dtype)
    bias = (torch.randn(R, generator=g) * 0.1).to(dtype) if epilogue != "gated" else None
    for N in (1, 16):
        x = torch.randn(N, C, generator=g).to(dtype)
        residual, gate = epilogue_inputs(epilogue, w, N, g, "cpu", dtype)
        fresh = (lambda: None) if residual is None else residual.clone
        got = K.qgemv_mma(x, w, bias, epilogue, fresh(), gate, config=SMALL)
        assert_close_and_mostly_equal(got, x, w, bias, epilogue, residual, gate)
        assert torch.equal(got, K.qgemv_mma(x, w, bias, epilogue, fresh(), gate, config=SMALL))


@pytest.mark.parametrize("scheme", [("int4", 32), ("plain", None)], ids=scheme_id)
def test_default_tile_fp16_strided_x_and_out(scheme):
    R, C = 45, 512  # mma_config's FEW tile: one 512-column step
    g = torch.Generator().manual_seed(1)
    w = random_qweight(scheme[0], R, C, scheme[1] or C, g, dtype=torch.float16)
    x = torch.randn(3, C + 64, generator=g).half()[:, 32 : 32 + C]
    out = torch.zeros(3, R + 3, dtype=torch.float16)[:, :R]
    assert K.qgemv_mma(x, w, out=out) is out
    assert_close_and_mostly_equal(out, x, w)


@pytest.mark.parametrize("config", [K.MANY, K.MID], ids=["many", "mid"])
def test_large_tiles(config):
    # the lm_head (128 rows a program) and mid-size (64) tiles: 2 programs, C = 128 in 1 to 2 steps
    g = torch.Generator().manual_seed(2)
    w = random_qweight("int4", 130, 128, 32, g)
    x = torch.randn(3, 128, generator=g).bfloat16()
    got = K.qgemv_mma(x, w, config=config)
    assert_close_and_mostly_equal(got, x, w)
    for r in range(3):
        assert torch.equal(got[r], K.qgemv_mma(x[r : r + 1], w, config=config)[0])


def test_int4_dequantizes_exactly_to_bf16_and_fp16():
    """The module docstring's claim, over every q in [-8, 7] and every e4m3 code but NaN:
    q * e4m3 is exact in bf16 and fp16 (the kernel's tile), and so is q * e4m3 * 2^k in bf16
    for the row scales the quantizer writes; in fp16 a small 2^k is not (why the kernel applies
    the row scale to the fp32 sum)."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    e4m3 = codes.view(torch.float8_e4m3fn).float()
    vals = torch.arange(-8, 8).float()[:, None] * e4m3[None, :]
    for dtype in (torch.bfloat16, torch.float16):
        assert torch.equal(vals.to(dtype).float(), vals)
    for k in (-30, -14, 0, 10):  # a real checkpoint's row scales: about 2^-14
        assert torch.equal((vals * 2.0**k).bfloat16().float(), vals * 2.0**k)
    for k in (-15, 0, 4):  # q * e4m3 is a multiple of 2^-9 under 3584: fp16 holds it times 2^-15..2^4
        assert torch.equal((vals * 2.0**k).half().float(), vals * 2.0**k)
    for k in (-16, 5):
        assert not torch.equal((vals * 2.0**k).half().float(), vals * 2.0**k)


def test_fp16_small_row_scale_is_exact():
    # row_scale about 2^-33: the folded fp16 weight would be inexact (subnormal); the kernel's is not
    g = torch.Generator().manual_seed(6)
    w = random_qweight("int4", 40, 128, 32, g)
    w = QWeight("int4", w.weight, w.scales, w.row_scale * 2.0**-20, 32)
    exact = dequantize(w)
    assert not torch.equal(exact.half().float(), exact)
    x = (torch.randn(4, 128, generator=g) * 4096).half()
    got = K.qgemv_mma(x, w, config=SMALL)
    same = qlinear_ref(x, w, exact_weight=True)
    assert rel_err(got, same) < TOLERANCE[torch.float16]
    assert int((got != same).sum()) <= 2


@pytest.mark.parametrize(
    "scheme, rows",
    [(("int4", 32), 5), (("int8", 16), 3), (("plain", None), 3)],
    ids=["int4-5", "int8-3", "plain-3"],
)
def test_rows_alone_are_the_one_row_calls(scheme, rows):
    """Each row of an N = 1..rows row call equals the row alone (N = 1), bit for bit, with every
    epilogue and the norm prologue (its normalised x too): one kernel for every N."""
    gen = torch.Generator().manual_seed(21)
    w = random_qweight(scheme[0], 32, 128, scheme[1] or 128, gen, "cpu", torch.bfloat16)

    def gemv(*args, alone, **kwargs):  # rows_alone_mismatch's gemv; qgemv_mma has no other path
        return K.qgemv_mma(*args, config=SMALL, **kwargs)

    assert rows_alone_mismatch(gemv, w, rows, gen, "cpu", torch.bfloat16) is None


def test_sixteen_rows_each_the_row_alone_in_any_position():
    g = torch.Generator().manual_seed(22)
    w = random_qweight("int4", 37, 128, 32, g)
    x = torch.randn(16, 128, generator=g).bfloat16()
    full = K.qgemv_mma(x, w, config=SMALL)
    flipped = K.qgemv_mma(x.flip(0), w, config=SMALL)
    for r in range(16):
        assert torch.equal(full[r], K.qgemv_mma(x[r : r + 1], w, config=SMALL)[0])
    assert torch.equal(flipped, full.flip(0))


@pytest.mark.parametrize("kind", ["unit", "plain"])
def test_norm_prologue_matches_a_separate_norm(kind):
    g = torch.Generator().manual_seed(11)
    for scheme, group, epilogue in (("int4", 32, "none"), ("int8", 16, "silu_mul"), ("plain", 0, "residual")):
        w = random_qweight(scheme, 48, 160 if scheme == "int4" else 128, group, g)
        C = w.cols
        x = (torch.randn(3, C, generator=g) * 3).bfloat16()
        norm = random_norm(kind, C, g, "cpu", torch.bfloat16)
        residual, gate = epilogue_inputs(epilogue, w, 3, g, "cpu", torch.bfloat16)
        normed = torch.empty_like(x)
        fresh = (lambda: None) if residual is None else residual.clone
        got = K.qgemv_mma(x, w, None, epilogue, fresh(), gate, norm=norm, norm_out=normed, config=SMALL)
        assert_close_and_mostly_equal(got, x, w, None, epilogue, residual, gate, norm)
        assert rel_err(normed, rms_norm_ref(x, *norm)) < TOLERANCE[torch.bfloat16]
        again = K.qgemv_mma(x, w, None, epilogue, fresh(), gate, norm=norm, config=SMALL)
        assert torch.equal(got, again)  # norm_out or not


def test_bad_inputs_name_the_tensor():
    g = torch.Generator().manual_seed(4)
    w = random_qweight("int4", 16, 64, 32, g)
    x = torch.randn(12, 64, generator=g).bfloat16()
    cases = [
        (dict(x=torch.randn(17, 64).bfloat16()), "x has 17 rows; qgemv_mma takes at most 16"),
        (dict(x=torch.randn(2, 64)), "x dtype torch.float32 is not bf16 or fp16 .*use qgemv"),
        (dict(x=torch.randn(2, 64, 2)), "x must be \\[N, C\\]"),
        (dict(out=torch.empty(11, 16, dtype=torch.bfloat16)), "out must have x's 12 rows"),
        (dict(epilogue="gated", gate=torch.randn(3, 1).bfloat16()), "gate must have x's 12 rows"),
        (dict(epilogue="residual"), "needs out"),
        (dict(bias=torch.randn(15).bfloat16()), "bias must be torch.bfloat16 \\[16\\]"),
        (dict(x=torch.randn(2, 24).bfloat16(), w=random_qweight("int4", 4, 24, 8, g)), "24 columns .* of 16"),
        (dict(w=QWeight("plain", torch.randn(16, 64))), "plain weight .* must have x's dtype"),
    ]
    for kwargs, msg in cases:
        with pytest.raises(ValueError, match=msg):
            K.qgemv_mma(**{"x": x, "w": w, **kwargs})
    with pytest.raises(ValueError, match="block_r and block_k must be >= 16"):
        K.MmaConfig(block_r=8)
