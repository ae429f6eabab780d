"""Quantizers and the block dequantizer: exact where the format is exact (bit patterns authored
by hand), within the quantization grid otherwise."""

import math

import pytest
import torch

from edgerun.bundle import quant as Q
from edgerun.bundle.layout import expert_block_layout
from hf_fixtures import tiny_moe_args


def tiny_args(hidden=32, inter=16):
    return tiny_moe_args(hidden, inter)


# --------------------------------------------------------------------------------------------
# int4 bit patterns, by hand


def test_int4_nibble_order_and_twos_complement():
    # columns 0..5 = -1, 7, 1, -7, 0, -8: column 2j -> low nibble of byte j, 2j+1 -> high nibble
    q = torch.tensor([[-1, 7, 1, -7, 0, -8]], dtype=torch.int8)
    packed = Q.pack_int4(q)
    assert packed.tolist() == [[0x7F, 0x91, 0x80]]
    assert torch.equal(Q.unpack_int4(torch.tensor([[0x7F, 0x91, 0x80]], dtype=torch.uint8)), q)


def test_e4m3_scale_codes():
    bits = torch.tensor([0x08, 0x38, 0x39, 0x40, 0x7E], dtype=torch.uint8)
    assert Q.e4m3_value(bits).tolist() == [2.0**-6, 1.0, 1.125, 2.0, 448.0]
    assert torch.equal(Q.e4m3_bits(Q.e4m3_value(bits)), bits)


def test_int4_dequantize_hand_authored():
    # one row, two groups of 4: bytes [0x7F, 0x91] -> [-1, 7, 1, -7]; [0x10, 0xF0] -> [0, 1, 0, -1]
    packed = torch.tensor([[0x7F, 0x91, 0x10, 0xF0]], dtype=torch.uint8)
    codes = torch.tensor([[0x38, 0x7E]], dtype=torch.uint8)  # e4m3 1.0 and 448.0
    g = 2.0**-4
    out = Q.dequantize_int4(packed, codes, g)
    want = [-1 * g, 7 * g, 1 * g, -7 * g, 0.0, 448 * g, 0.0, -448 * g]
    assert out.tolist() == [want]


def test_int4_quantize_recovers_hand_authored_weights_exactly():
    # Every group holds a +-7 and the largest code is 448, so the quantizer must choose the same
    # global scale, codes and values: the round trip is bit-exact.
    g, gscale = 16, 2.0**-12
    codes = torch.tensor([[0x7E, 0x38], [0x08, 0x5A]], dtype=torch.uint8)  # 448, 1, 2^-6, 20
    q = torch.randint(-7, 8, (2, 32), generator=torch.Generator().manual_seed(0), dtype=torch.int8)
    q[:, 0::16] = 7
    w = Q.dequantize_int4(Q.pack_int4(q), codes, gscale)
    packed, got_codes, got_g = Q.quantize_int4(w, g)
    assert got_g == gscale
    assert torch.equal(got_codes, codes)
    assert torch.equal(packed, Q.pack_int4(q))
    assert torch.equal(Q.dequantize_int4(packed, got_codes, got_g), w)


def test_int4_scales_power_of_two_global_normal_codes():
    # Groups spanning 2^-30 .. 1 in magnitude, plus an all-zero group.
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 64, generator=g) * (
        2.0 ** -torch.randint(0, 30, (64, 4), generator=g).float()
    ).repeat_interleave(16, 1)
    w[3, :16] = 0
    packed, codes, gscale = Q.quantize_int4(w, 16)
    assert gscale == 2.0 ** round(math.log2(gscale))  # a power of two ...
    ideal_max = float(w.abs().amax()) / 7
    assert 224 < ideal_max / gscale <= 448  # ... putting the largest group scale in e4m3's top binade
    assert (
        int(codes.min()) >= Q.E4M3_MIN_NORMAL_BITS and int(codes.max()) <= Q.E4M3_MAX_BITS
    )  # normal, finite
    out = Q.dequantize_int4(packed, codes, gscale)
    assert torch.equal(out[3, :16], torch.zeros(16))


def test_int4_error_within_grid():
    w = torch.randn(128, 256, generator=torch.Generator().manual_seed(2))
    for g in (16, 32):
        packed, codes, gscale = Q.quantize_int4(w, g)
        out = Q.dequantize_int4(packed, codes, gscale)
        step = (Q.e4m3_value(codes) * gscale).repeat_interleave(g, 1)
        q = out / step
        assert torch.equal(q, q.round()) and q.abs().max() <= 7  # on the grid
        inside = w.abs() <= 7 * step
        assert ((out - w).abs()[inside] <= step[inside] / 2 * (1 + 1e-6)).all()
        clipped = ~inside  # the scale search may clip a group's largest value to +-7 steps
        assert torch.equal(out[clipped].abs(), 7 * step[clipped])
        rel = (out - w).norm() / w.norm()
        assert rel < 0.1, rel


# --------------------------------------------------------------------------------------------
# int8


@pytest.mark.parametrize("g", [0, 16])
def test_int8_exact_for_representable_weights(g):
    # scale = absmax / 127 is exact when every group holds +-127 steps of a power of two
    q = torch.randint(-127, 128, (8, 32), generator=torch.Generator().manual_seed(3), dtype=torch.int8)
    q[:, 0::16] = -127
    scales = 2.0 ** -torch.arange(8, dtype=torch.float32)[:, None].expand(8, 32 // (g or 32))
    w = Q.dequantize_int8(q, scales.contiguous())
    got_q, got_s = Q.quantize_int8(w, g)
    assert torch.equal(got_q, q) and torch.equal(got_s, scales)


@pytest.mark.parametrize("g", [0, 16])
def test_int8_error_within_grid(g):
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(4))
    q, s = Q.quantize_int8(w, g)
    out = Q.dequantize_int8(q, s)
    step = s.repeat_interleave(128 // s.shape[1], 1)
    assert ((out - w).abs() <= step / 2 * (1 + 1e-6)).all()
    assert q.abs().max() <= 127


def test_all_zero_weights_stay_zero():
    z = torch.zeros(4, 32)
    assert torch.equal(Q.dequantize_int8(*Q.quantize_int8(z, 0)), z)
    assert torch.equal(Q.dequantize_int4(*Q.quantize_int4(z, 16)), z)


# --------------------------------------------------------------------------------------------
# Hadamard rotation


@pytest.mark.parametrize("g", [16, 32])
def test_hadamard_orthonormal_symmetric(g):
    h = Q.hadamard(g)
    assert torch.equal(h, h.T)
    assert torch.equal(h.abs(), torch.full((g, g), g**-0.5))
    assert torch.allclose(h @ h, torch.eye(g), atol=1e-6)
    w = torch.randn(8, 4 * g)
    assert torch.allclose(Q.rotate_groups(Q.rotate_groups(w, g), g), w, atol=1e-6)


def test_rotation_helps_outliers():
    # One large outlier per group: rotation spreads it over the group, so the grid is finer.
    g = torch.Generator().manual_seed(5)
    w = torch.randn(128, 256, generator=g) * 0.02
    w[:, 7::32] = 1.0
    plain = Q.dequantize_int4(*Q.quantize_int4(w, 32))
    rotated = Q.rotate_groups(Q.dequantize_int4(*Q.quantize_int4(Q.rotate_groups(w, 32), 32)), 32)
    assert (rotated - w).norm() < 0.5 * (plain - w).norm()


# --------------------------------------------------------------------------------------------
# Blocks


def test_int4_block_hand_authored():
    # hidden 32, expert width 16, groups of 16: gate_up [32, 32] and down [32, 16].
    lay = expert_block_layout(tiny_args(), "int4", 16)
    assert lay.block_bytes == 4096
    raw = torch.zeros(lay.block_bytes, dtype=torch.uint8)
    c = {x.name: x for x in lay.components}
    gu_w, gu_s, dn_w, dn_s = (
        c[n] for n in ("gate_up.weight", "gate_up.scales", "down.weight", "down.scales")
    )
    raw[gu_w.offset] = 0x7F  # gate_up[0, 0] = -1, gate_up[0, 1] = 7
    raw[gu_w.offset + 16 * 31 + 15] = 0x90  # gate_up[31, 31] = -7 (high nibble), [31, 30] = 0
    raw[gu_s.offset : gu_s.offset + gu_s.nbytes] = 0x38  # every code 1.0
    raw[gu_s.offset] = 0x40  # gate_up row 0, group 0: 2.0
    raw[dn_w.offset + 8 * 5 + 3] = 0x01  # down[5, 6] = 1
    raw[dn_s.offset : dn_s.offset + dn_s.nbytes] = 0x7E  # 448
    gscales = torch.tensor([2.0**-3, 2.0**-8])
    gate_up, down = Q.dequantize_block(lay, raw, gscales)
    want_gu = torch.zeros(32, 32)
    want_gu[0, 0], want_gu[0, 1], want_gu[31, 31] = -1 * 2 * 2**-3, 7 * 2 * 2**-3, -7 * 2**-3
    want_dn = torch.zeros(32, 16)
    want_dn[5, 6] = 448 * 2**-8
    assert torch.equal(gate_up, want_gu) and torch.equal(down, want_dn)


@pytest.mark.parametrize(
    "quant,group,rotation",
    [
        ("bf16", None, "none"),
        ("int8", 0, "none"),
        ("int8", 16, "hadamard"),
        ("int4", 16, "none"),
        ("int4", 32, "hadamard"),
    ],
)
def test_block_round_trip(quant, group, rotation):
    args = tiny_args(64, 32)
    lay = expert_block_layout(args, quant, group, rotation)
    g = torch.Generator().manual_seed(6)
    gate_up, down = torch.randn(64, 64, generator=g), torch.randn(64, 32, generator=g)
    if quant == "bf16":
        gate_up, down = gate_up.bfloat16(), down.bfloat16()
    block, gscales = Q.quantize_expert(lay, gate_up, down)
    assert block.numel() == lay.block_bytes and lay.block_bytes % 4096 == 0
    assert not block[lay.payload_bytes + 64 :].any()  # padding is zero
    out = Q.dequantize_block(lay, block, gscales)
    # every form of the raw bytes gives the same answer
    for raw in (bytes(block.numpy()), bytearray(block.numpy()), block.clone()):
        again = Q.dequantize_block(lay, raw, gscales)
        assert all(torch.equal(a, b) for a, b in zip(out, again))
    if quant == "bf16":
        assert out[0].dtype == torch.bfloat16 and torch.equal(out[0], gate_up) and torch.equal(out[1], down)
        return
    for ref, got in zip((gate_up, down), out):
        want = Q.rotate_groups(ref, lay.group_size) if rotation == "hadamard" else ref
        if quant == "int8":
            exp = Q.dequantize_int8(*Q.quantize_int8(want, lay.group_size))
        else:
            exp = Q.dequantize_int4(*Q.quantize_int4(want, lay.group_size))
        if rotation == "hadamard":
            exp = Q.rotate_groups(exp, lay.group_size)
        assert torch.equal(got, exp)
        assert (got - ref).norm() / ref.norm() < (0.01 if quant == "int8" else 0.12)
    assert Q.dequantize_block(lay, block, gscales, torch.bfloat16)[0].dtype == torch.bfloat16


def test_block_misuse_is_refused():
    lay = expert_block_layout(tiny_args(), "int4", 16)
    with pytest.raises(ValueError, match="block has 100 bytes"):
        Q.dequantize_block(lay, torch.zeros(100, dtype=torch.uint8), torch.ones(2))
    with pytest.raises(ValueError, match="global scales"):
        Q.dequantize_block(lay, torch.zeros(lay.block_bytes, dtype=torch.uint8), None)
