"""The Triton kernels under Triton's CPU interpreter (tiny shapes, every scheme).

Not collected on its own: test_interpret.py runs this file in a child process with
TRITON_INTERPRET=1 set before Triton is imported (Triton reads it at import). Tolerances: the
GEMV path is fp32 throughout, so it differs from the fp32 reference only in summation order
(1e-5 of the output's scale); the GEMM path rounds operands and products to bf16 (probe's 2e-2).
"""

import os

import pytest
import torch
from moe_cases import FORMATS, fmt_id, layout_for, random_step, rel_err

from edgerun.bundle.quant import dequantize_block, rotate_groups
from edgerun.kernels import moe_triton as K
from edgerun.kernels.moe_reference import random_pool
from edgerun.kernels.probe import TOLERANCE

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="run by test_interpret.py")


@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
def test_gemv_matches_reference_and_repeats(fmt):
    from edgerun.kernels.moe_reference import moe_experts_ref

    layout = layout_for(fmt)
    args = random_step(layout, 3, 3, 6, torch.Generator().manual_seed(0))  # A = 3: not a power of two
    ref = moe_experts_ref(*args)
    out = K.moe_gemv(*args)
    assert out.dtype == torch.float32 and rel_err(out, ref) < 1e-5
    assert torch.equal(out, K.moe_gemv(*args))
    x, pool, slots, ids, w, _, gs = args
    perm = torch.tensor([2, 0, 1])  # entry order does not matter: experts are summed by ascending id
    assert torch.equal(out, K.moe_gemv(x, pool, slots[:, perm], ids[:, perm], w[:, perm], layout, gs))
    bf = K.moe_gemv(x.bfloat16(), pool, slots, ids, w, layout, gs)
    assert bf.dtype == torch.bfloat16 and rel_err(bf, ref) < TOLERANCE


@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
def test_grouped_matches_reference(fmt):
    from edgerun.kernels.moe_reference import moe_experts_ref

    layout = layout_for(fmt)
    args = random_step(layout, 6, 2, 5, torch.Generator().manual_seed(1))
    ref = moe_experts_ref(*args)
    out = K.moe_grouped(*args, scratch_experts=2)  # several scratch chunks
    assert rel_err(out, ref) < TOLERANCE
    assert torch.equal(out, K.moe_grouped(*args, scratch_experts=5))  # chunking changes nothing


@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
def test_dequantize_slots_is_exact(fmt):
    # Every e4m3 code but NaN (subnormals included), so the bit decoding is checked code by code.
    layout = layout_for(fmt)
    plain = layout_for((fmt[0], fmt[1], "none"))
    pool, gs = random_pool(layout, 3, generator=torch.Generator().manual_seed(2))
    if layout.quant == "int4":
        for proj in ("gate_up", "down"):
            c = layout.component(f"{proj}.scales")
            codes = torch.arange(c.nbytes) % 0x7F
            pool[:, c.offset : c.offset + c.nbytes] = codes.to(torch.uint8)
    D, I = plain.component("down.weight").shape[0], plain.component("gate_up.weight").shape[0] // 2
    slots = torch.tensor([2, 0])
    gu = torch.empty(2, 2 * I, D, dtype=torch.bfloat16)
    dn = torch.empty(2, D, I, dtype=torch.bfloat16)
    K.dequantize_slots(pool, slots, layout, gs, gu, dn)
    for u, s in enumerate(slots.tolist()):
        want = dequantize_block(plain, pool[s], None if gs is None else gs[s], dtype=torch.bfloat16)
        if layout.quant == "int8":  # the interpreter truncates fp32 -> bf16 (the GPU rounds to nearest even)
            torch.testing.assert_close(gu[u], want[0], rtol=2**-7, atol=0)
            torch.testing.assert_close(dn[u], want[1], rtol=2**-7, atol=0)
        else:  # int4 and bf16 values are bf16-exact
            assert torch.equal(gu[u], want[0]) and torch.equal(dn[u], want[1])


@pytest.mark.parametrize("g", [16, 32])
def test_rotation_kernel_is_the_bundle_rotation(g):
    v = torch.randn(3, 512)
    got = K.rotate_activations(v.bfloat16(), g)
    torch.testing.assert_close(got, rotate_groups(v.bfloat16(), g), rtol=1e-6, atol=1e-6)
