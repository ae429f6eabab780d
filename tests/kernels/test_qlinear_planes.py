"""The nibble-plane GEMV (kernels/qlinear_planes.py): its repacking, its tile choice, its
refusals, and on CUDA the compiled kernel (its inline assembly and bf16 FMAs, which the
interpreter does not run) at Qwen3.6's shapes: against the reference, each row of 1..16 the
one-row call's bits, the split counters reset, the prefill dequantization the reference's bits.
The interpreter's arithmetic is checked in interpreted_qlinear_planes.py."""

import importlib.util

import pytest
import torch

from edgerun.kernels import qlinear_planes as P
from edgerun.kernels.qlinear_reference import TOLERANCE, epilogue_inputs, qlinear_ref, random_qweight
from edgerun.kernels.qweight import dequantize


def nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[R, C/2] bytes -> [R, C] nibbles, column 2b: byte b's low nibble."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


@pytest.mark.parametrize("group", [16, 32, 64])
def test_repack_puts_each_value_where_the_kernel_reads_it(group, monkeypatch):
    """Element i of a step (16 bits: stored columns 4i..4i+3) holds the step's column jG + i in
    nibble j; every value moves, none is lost or changed; unpacking gives the bytes back, also
    when the rows are repacked in chunks."""
    monkeypatch.setattr(P, "REPACK_ROWS", 4)
    g = torch.Generator().manual_seed(group)
    w = random_qweight("int4", 6, 8 * group, group, g)
    pw = P.planes_weight(w)
    before, after = nibbles(w.weight), nibbles(pw.weight)
    K = 4 * group
    for step in range(w.cols // K):
        for i in range(group):
            for j in range(4):
                assert torch.equal(after[:, step * K + 4 * i + j], before[:, step * K + j * group + i])
    assert torch.equal(P.unpack_planes(pw), w.weight)


def test_tile_splits_weights_of_few_rows():
    """128-row tiles; the columns split until about MIN_PROGRAMS programs, while each keeps
    MIN_STEPS steps (4 groups a step)."""
    assert P.planes_config(248320, 2048, 32) == P.PlanesConfig(128, 4, 1)
    assert P.planes_config(12352, 2048, 32).split == 4  # 97 tiles, 16 steps
    assert P.planes_config(2048, 4096, 32).split == 16  # 16 tiles, 32 steps
    assert P.planes_config(2048, 512, 32).split == 2  # 4 steps in all
    assert P.planes_config(2048, 4096, 32, 64).split == 8  # 32 tiles of 64 rows
    with pytest.raises(ValueError, match="power of two"):
        P.PlanesConfig(split=3)


def test_prefetch_is_a_measurement_switch(monkeypatch):
    """EDGERUN_PLANES_PREFETCH sets the engine tiles' L2 prefetch (off by default); a value that is
    not a step count is refused by name."""
    assert P.planes_config(12352, 2048, 32).prefetch == 0
    monkeypatch.setenv("EDGERUN_PLANES_PREFETCH", "4")
    assert P.planes_config(12352, 2048, 32) == P.PlanesConfig(128, 4, 4, prefetch=4)
    monkeypatch.setenv("EDGERUN_PLANES_PREFETCH", "on")
    with pytest.raises(ValueError, match="EDGERUN_PLANES_PREFETCH must be a number of steps"):
        P.planes_config(12352, 2048, 32)


def test_refusals_name_the_reason():
    g = torch.Generator().manual_seed(1)
    w4 = random_qweight("int4", 8, 128, 32, g)
    assert "bf16" in P.planes_unsupported(w4, torch.float16)
    assert "int8" in P.planes_unsupported(random_qweight("int8", 8, 128, 128, g), torch.bfloat16)
    assert "group 8" in P.planes_unsupported(random_qweight("int4", 8, 128, 8, g), torch.bfloat16)
    assert "multiple of 4 groups" in P.planes_unsupported(
        random_qweight("int4", 8, 96, 32, g), torch.bfloat16
    )
    pw = P.planes_weight(w4)
    with pytest.raises(ValueError, match="at most 16"):
        P.qgemv_planes(torch.zeros(17, 128, dtype=torch.bfloat16), pw)
    with pytest.raises(ValueError, match="split 2 does not cut 128 columns"):
        P.qgemv_planes(torch.zeros(1, 128, dtype=torch.bfloat16), pw, config=P.PlanesConfig(16, 1, 2))
    wide = P.planes_weight(random_qweight("int4", 8, 256, 32, g))
    with pytest.raises(ValueError, match="needs count"):
        P.qgemv_planes(torch.zeros(1, 256, dtype=torch.bfloat16), wide, config=P.PlanesConfig(16, 1, 2))


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (none on this machine)")
SHAPES = [(12352, 2048, "none"), (2048, 4096, "residual"), (1024, 2048, "silu_mul"), (2048, 512, "residual")]


@CUDA
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}-{s[2]}")
def test_compiled_kernel_matches_and_rows_are_the_one_row_calls(shape):
    R, C, epilogue = shape
    g = torch.Generator(device="cuda").manual_seed(R)
    w = random_qweight("int4", R, C, 32, g, "cuda", torch.bfloat16)
    pw = P.planes_weight(w)
    count = P.planes_counters(pw, "cuda")
    x = torch.randn(16, C, generator=g, device="cuda").bfloat16()
    residual, gate = epilogue_inputs(epilogue, w, 16, g, "cuda", torch.bfloat16)

    def run(rows):
        out = None if residual is None else residual[rows].clone()
        return P.qgemv_planes(x[rows], pw, None, epilogue, out, count=count)

    full = run(slice(0, 16))
    ref = qlinear_ref(x, w, None, epilogue, None if residual is None else residual.clone())
    err = ((full.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    assert err < TOLERANCE[torch.bfloat16]
    if epilogue == "none":  # exact products, fp32 sums in another order: rare one-ulp flips
        exact = qlinear_ref(x, w, exact_weight=True)
        assert int((full != exact).sum()) <= max(2, full.numel() // 100)
    for n in (1, 2, 3, 4, 8, 16):
        assert torch.equal(run(slice(0, n)), full[:n]), f"{n} rows"
    assert not count.any(), "a split call left its counters set"
    assert torch.equal(P.dequantize_planes(pw, torch.bfloat16), dequantize(w).bfloat16())


def test_a_projection_goes_on_and_off_the_planes_with_its_bytes_intact():
    """``QLinear.use_planes``: the bytes repacked in place (no second copy kept), the tile and
    counters set; off again, the stored bytes exactly; a weight it cannot run is refused by name."""
    from edgerun.models.layers import QLinear

    g = torch.Generator().manual_seed(4)
    w = random_qweight("int4", 96, 256, 32, g, "cpu", torch.bfloat16)
    m = QLinear(w)
    m.use_planes(True)
    assert torch.equal(m.weight, P.repack_planes(w)) and m.planes == P.planes_config(96, 256, 32)
    assert m.planes_count is not None and not m.planes_count.any()
    # a prefill lane's calls (another stream, kernels/scratch.py) count on a set of their own
    from edgerun.kernels.scratch import scratch_set

    assert m._planes_count() is m.planes_count
    with scratch_set(2):
        lane = m._planes_count()
        assert lane is not m.planes_count and lane.shape == m.planes_count.shape and not lane.any()
        assert m._planes_count() is lane
    m.use_planes(False)
    assert torch.equal(m.weight, w.weight) and m.planes is None and m.lane_counts == {}
    with pytest.raises(ValueError, match="int8"):
        QLinear(random_qweight("int8", 8, 128, 128, g)).use_planes(True)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed here")
def test_l2_prefetch_comes_before_the_grid_sync():
    """``PlanesConfig.prefetch`` (compiled for sm_90 here: Triton compiles without a GPU): the
    weight lines are asked of L2 before ``griddepcontrol.wait``, when reading them is safe (PDL's
    contract, kernels/launch.py), and not at all with prefetch 0."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    fn = P._planes_kernel
    ptrs = dict(x="*bf16", w="*u8", s="*u8", row_scale="*fp32", bias="*bf16", gate="*bf16", out="*bf16")
    ptrs |= dict(norm_w="*bf16", norm_out="*bf16", part="*fp32", count="*i32", eps="fp32")
    for pre in (0, 4):
        const = dict(C=1024, G=32, BLOCK_R=128, SPLIT=2, HAS_BIAS=False, EPILOGUE=0, NORM=0, NORM_OUT=False,
                     NO_BLOCK=16, BLOCK_C=1024, CODE=1, PREFETCH=pre, INTERPRET=False, PDL=True)  # fmt: skip
        sig = {a: ptrs.get(a, "constexpr" if a in const else "i32") for a in fn.arg_names}
        src = ASTSource(
            fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()}
        )
        ptx = compile(
            src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "launch_pdl": True}
        ).asm["ptx"]
        if pre:
            assert ptx.count("prefetch.global.L2") == 2  # steps 0-1 and 2-3 of each row: two 128-byte lines
            assert ptx.index("prefetch.global.L2") < ptx.index("griddepcontrol.wait")
        else:
            assert "prefetch.global" not in ptx
