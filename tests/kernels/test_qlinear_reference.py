"""The dense quantized-weight container and the linear reference the GEMV kernel is held to:
``dequantize`` is the bundle's dequantizers, ``concat_rows`` keeps each part's row scale, and
``qlinear_ref``'s epilogues are the model's torch ops. CPU only, no Triton."""

import pytest
import torch
import torch.nn.functional as F

from edgerun.bundle.quant import dequantize_int4, dequantize_int8
from edgerun.kernels.qlinear_reference import epilogue_inputs, qlinear_ref, random_qweight
from edgerun.kernels.qweight import QWeight, concat_rows, dequantize


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_dequantize_is_the_bundles_dequantizer():
    w = random_qweight("int4", 24, 128, 32, gen(1))
    gscale = float(w.row_scale[0])
    assert torch.equal(w.row_scale, torch.full((24,), gscale))
    assert torch.equal(dequantize(w), dequantize_int4(w.weight, w.scales, gscale))
    for group in (16, 128):  # grouped, and one scale per row (group = C)
        w = random_qweight("int8", 24, 128, group, gen(2))
        assert w.scales.shape == (24, 128 // group)
        assert torch.equal(dequantize(w), dequantize_int8(w.weight, w.scales))
    w = random_qweight("plain", 24, 128, 0, gen(3), dtype=torch.bfloat16)
    assert torch.equal(dequantize(w), w.weight.float())


def test_random_weights_are_what_the_quantizers_write():
    w = random_qweight("int4", 64, 256, 32, gen(4))
    w.check()
    assert w.weight.dtype == torch.uint8 and w.scales.dtype == torch.uint8
    assert int(w.scales.min()) >= 0x08 and int(w.scales.max()) <= 0x7E  # e4m3, normal, finite
    rs = float(w.row_scale[0])
    assert rs == 2.0 ** round(torch.tensor(rs).log2().item())  # a power of two
    q = random_qweight("int8", 64, 256, 256, gen(5))
    q.check()
    assert int(q.weight.abs().max()) <= 127
    # close to the normal matrix they quantize (int4: a few % of the weights' scale)
    src = torch.randn(64, 256, generator=gen(4)) * 256**-0.5
    assert (dequantize(w) - src).abs().max() < 0.2 * src.abs().max()


def test_concat_rows_keeps_each_parts_row_scale():
    a = random_qweight("int4", 8, 64, 32, gen(6))
    b = random_qweight("int4", 5, 64, 32, gen(7))
    b = QWeight("int4", b.weight, b.scales, b.row_scale * 4, 32)  # another tensor's global scale
    w = concat_rows([a, b])
    w.check()
    assert w.rows == 13 and torch.equal(w.row_scale, torch.cat([a.row_scale, b.row_scale]))
    assert torch.equal(dequantize(w), torch.cat([dequantize(a), dequantize(b)]))
    assert torch.equal(dequantize(w)[8:], dequantize_int4(b.weight, b.scales, float(b.row_scale[0])))
    with pytest.raises(
        ValueError, match="cannot concatenate int4 \\[4, 128\\] group 32 with int4 \\[8, 64\\]"
    ):
        concat_rows([a, random_qweight("int4", 4, 128, 32, gen(8))])
    with pytest.raises(ValueError, match="group 16"):
        concat_rows([a, random_qweight("int4", 4, 64, 16, gen(9))])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scheme", [("plain", 0), ("int8", 64), ("int8", 16), ("int4", 32)], ids=str)
def test_linear_is_F_linear_on_the_dequantized_weight(scheme, dtype):
    g = gen(10)
    w = random_qweight(scheme[0], 20, 64, scheme[1], g, dtype=dtype)
    x = torch.randn(3, 64, generator=g).to(dtype)
    bias = torch.randn(20, generator=g).to(dtype)
    want = F.linear(x, dequantize(w).to(dtype), bias)
    y = qlinear_ref(x, w, bias)
    assert y.dtype == dtype and torch.equal(y, want)
    out = torch.empty(3, 20, dtype=dtype)
    assert qlinear_ref(x, w, bias, out=out) is out and torch.equal(out, want)
    exact = qlinear_ref(x, w, bias, exact_weight=True)
    assert torch.equal(exact, F.linear(x.float(), dequantize(w), bias.float()).to(dtype))
    if scheme[0] != "int8" or dtype == torch.float32:
        # int4 and plain values are exact in the model dtype: only the fp32 order can differ
        assert (exact != want).float().mean() < 0.05


def test_epilogues_are_the_models_ops():
    g = gen(11)
    gate_w = random_qweight("int4", 12, 64, 32, g)
    up_w = random_qweight("int4", 12, 64, 32, g)
    x = torch.randn(2, 64, generator=g).bfloat16()
    both = concat_rows([gate_w, up_w])
    y = qlinear_ref(x, both)
    # silu_mul over [gate; up] is the MLP's silu(gate(x)) * up(x)
    got = qlinear_ref(x, both, epilogue="silu_mul")
    assert got.shape == (2, 12)
    assert torch.equal(got, F.silu(qlinear_ref(x, gate_w)) * qlinear_ref(x, up_w))
    assert torch.equal(got, F.silu(y[:, :12]) * y[:, 12:])

    residual, _ = epilogue_inputs("residual", both, 2, g, "cpu", torch.bfloat16)
    out = residual.clone()
    assert qlinear_ref(x, both, epilogue="residual", out=out) is out
    assert torch.equal(out, residual + y)

    _, gate = epilogue_inputs("gated", both, 2, g, "cpu", torch.bfloat16)
    assert gate.shape == (2, 1)
    assert torch.equal(qlinear_ref(x, both, epilogue="gated", gate=gate), torch.sigmoid(gate) * y)


def test_reference_errors():
    w = random_qweight("int4", 4, 64, 32, gen(12))
    x = torch.randn(1, 64)
    with pytest.raises(ValueError, match="needs out"):
        qlinear_ref(x, w, epilogue="residual")
    with pytest.raises(ValueError, match="needs gate"):
        qlinear_ref(x, w, epilogue="gated")
    with pytest.raises(ValueError, match="'relu' is not one of"):
        qlinear_ref(x, w, epilogue="relu")
    with pytest.raises(ValueError, match="scheme 'fp8'"):
        random_qweight("fp8", 4, 64, 32, gen(13))
