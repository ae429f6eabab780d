"""The nibble-plane GEMV prototype (kernels/qlinear_planes.py): its repacking, its refusals, and
on CUDA the compiled kernel (its inline assembly and bf16 FMAs, which the interpreter does not
run): against the reference, and each row of 1..16 the one-row call's bits. The interpreter's
arithmetic is checked in interpreted_qlinear_mma.py."""

import pytest
import torch

from edgerun.kernels.qlinear_planes import planes_unsupported, qgemv_planes, repack_planes
from edgerun.kernels.qlinear_reference import TOLERANCE, qlinear_ref, random_qweight


def nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[R, C/2] bytes -> [R, C] nibbles, column 2b: byte b's low nibble."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


@pytest.mark.parametrize("group", [16, 32, 64])
def test_repack_puts_each_value_where_the_kernel_reads_it(group):
    """Element i of a step (16 bits: stored columns 4i..4i+3) holds the step's column jG + i in
    nibble j; every value moves, none is lost or changed."""
    g = torch.Generator().manual_seed(group)
    w = random_qweight("int4", 6, 8 * group, group, g)
    before, after = nibbles(w.weight), nibbles(repack_planes(w))
    K = 4 * group
    for step in range(w.cols // K):
        for i in range(group):
            for j in range(4):
                assert torch.equal(after[:, step * K + 4 * i + j], before[:, step * K + j * group + i])
    assert torch.equal(after.sort(dim=1).values, before.sort(dim=1).values)


def test_refusals_name_the_reason():
    g = torch.Generator().manual_seed(1)
    w4 = random_qweight("int4", 8, 128, 32, g)
    assert "bf16" in planes_unsupported(w4, torch.float16)
    assert "int8" in planes_unsupported(random_qweight("int8", 8, 128, 128, g), torch.bfloat16)
    assert "group 8" in planes_unsupported(random_qweight("int4", 8, 128, 8, g), torch.bfloat16)
    assert "multiple of 4 groups" in planes_unsupported(random_qweight("int4", 8, 96, 32, g), torch.bfloat16)
    with pytest.raises(ValueError, match="N <= 16"):
        qgemv_planes(torch.zeros(17, 128, dtype=torch.bfloat16), w4, repack_planes(w4))
    with pytest.raises(ValueError, match="repack_planes"):
        qgemv_planes(torch.zeros(1, 128, dtype=torch.bfloat16), w4, w4.weight[:4])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (none on this machine)")
@pytest.mark.parametrize("shape", [(12352, 2048), (2048, 4096), (1024, 2048)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_compiled_kernel_matches_and_rows_are_the_one_row_calls(shape):
    R, C = shape
    g = torch.Generator(device="cuda").manual_seed(R)
    w = random_qweight("int4", R, C, 32, g, "cuda", torch.bfloat16)
    planes = repack_planes(w)
    x = torch.randn(16, C, generator=g, device="cuda").bfloat16()
    full = qgemv_planes(x, w, planes)
    ref = qlinear_ref(x, w)
    assert ((full.float() - ref.float()).abs().max() / ref.float().abs().max()).item() < TOLERANCE[
        torch.bfloat16
    ]
    # the weights are exact (the bf16 FMA rounds once) and only the fp32 order differs: the
    # exact-weight reference's bits but for rare one-ulp flips
    exact = qlinear_ref(x, w, exact_weight=True)
    assert int((full != exact).sum()) <= max(2, full.numel() // 100)
    for n in (1, 2, 3, 4, 8, 16):
        part = qgemv_planes(x[:n], w, planes)
        assert torch.equal(part, full[:n]), f"{n} rows"
