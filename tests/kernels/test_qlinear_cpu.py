"""The CPU weight-only kernels for dense projections (kernels/qlinear_cpu.py): the packed int4
weights are the reference's exactly, outputs within the bf16 tolerance, and the engine's choice
on the CPU. Tolerance 2e-2 of the output's scale: the dense probe's for bf16 (the kernels take
bf16 activations and keep bf16 partial sums; kernels/dense_probe.py says why that bound)."""

import pytest
import torch

from edgerun.kernels import qlinear_cpu as K
from edgerun.kernels.qlinear_reference import qlinear_ref, random_qweight
from edgerun.kernels.qweight import QWeight, dequantize

CASES = [("int4", 32), ("int4", 64), ("int8", None)]


@pytest.mark.parametrize("scheme,group", CASES)
def test_packed_weights_are_the_stored_values(scheme, group):
    """x = the identity picks each weight column out exactly (one nonzero term a sum)."""
    w = random_qweight(scheme, 128, 256, group or 256, torch.Generator().manual_seed(1))
    got = K.linear(torch.eye(256), K.pack(w))
    want = dequantize(w).t()
    if scheme == "int8":  # the row scale multiplies the kernel's output in fp32: q * scale, rounded like it
        torch.testing.assert_close(got, want, rtol=2**-8, atol=0)
    else:
        assert torch.equal(got, want)


@pytest.mark.parametrize("scheme,group", CASES)
@pytest.mark.parametrize("epilogue", ["none", "silu_mul", "gated"])
def test_linear_with_epilogues_matches_the_reference(scheme, group, epilogue):
    g = torch.Generator().manual_seed(2)
    w = random_qweight(scheme, 192, 512, group or 512, g)
    x = torch.randn(5, 512, generator=g)
    gate = torch.randn(5, 1, generator=g)
    ref = qlinear_ref(x, w, None, epilogue, gate=gate)
    got = qlinear_ref(x, w, None, epilogue, gate=gate, matmul=lambda z: K.linear(z, K.pack(w)))
    assert float((got - ref).abs().max() / ref.abs().max()) < 2e-2


def test_an_int8_weight_off_alignment_is_copied_before_the_kernel_reads_it():
    """torch's int8 kernel faults (SIGSEGV) on a weight 8 bytes off a 16-byte boundary, as a
    mapped dense.safetensors may place one: ``pack`` hands it an aligned copy, same bits out."""
    w = random_qweight("int8", 96, 256, 256, torch.Generator().manual_seed(4))
    off = K.misaligned(w)
    assert off.weight.data_ptr() % 16 == 8 and torch.equal(off.weight, w.weight)
    packed = K.pack(off)
    assert packed[0].data_ptr() % K.ALIGN == 0
    aligned = K.pack(w)
    assert aligned[0].data_ptr() == w.weight.data_ptr()  # in place where it is aligned
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(5))
    assert torch.equal(K.linear(x, packed), K.linear(x, aligned))


def test_what_it_does_not_take_is_named():
    g = torch.Generator().manual_seed(3)
    assert "group of 16" in K.unsupported(random_qweight("int8", 64, 64, 16, g))
    assert "int4 group 16" in K.unsupported(random_qweight("int4", 64, 64, 16, g))
    assert "multiples of 64" in K.unsupported(random_qweight("int4", 96, 64, 32, g))
    assert "plain" in K.unsupported(QWeight("plain", torch.zeros(4, 4)))


def test_the_engine_packs_the_quantized_projections_on_the_cpu(tmp_path):
    """A bundle with int4 dense weights on the CPU: the probe selects the kernels, every int4
    projection they take is packed, and greedy decoding runs through them (tokens within the
    reference's: the first token equal, as a bf16-tolerance claim allows)."""
    from edgerun.engine.policy import KernelPolicy
    from edgerun.engine.runner import Runner
    from edgerun.engine.sampler import SamplingParams
    from edgerun.models.layers import QLinear
    from edgerun.tools.synth_bundle import synth_bundle
    from hf_fixtures import QWEN3_MOE

    cfg = dict(QWEN3_MOE, model_type="qwen3_moe", hidden_size=128, moe_intermediate_size=64,
               intermediate_size=128, head_dim=32, num_attention_heads=4, num_key_value_heads=2, vocab_size=256)  # fmt: skip
    synth_bundle(tmp_path / "b", cfg, quant="int8", seed=0, dense="int4")
    fast = Runner.load(tmp_path / "b", device="cpu")
    assert fast.kernels.cpu_dense and "cpu_weight_only" in fast.kernel_summary()
    packed = [m for m in fast.model.modules() if isinstance(m, QLinear) and m.cpu is not None]
    assert packed and all(m.scheme == "int4" for m in packed)
    ref = Runner.load(tmp_path / "b", device="cpu", kernels=KernelPolicy(dense="torch"))
    assert not ref.kernels.cpu_dense
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    assert fast.generate_ids([5, 6, 7], params)[:1] == ref.generate_ids([5, 6, 7], params)[:1]


@pytest.mark.parametrize("rows,cols,group", [(128, 256, 32), (192, 512, 32), (64, 96, 32), (128, 256, 16)])
def test_the_planner_counts_the_packed_copy_pack_makes(rows, cols, group):
    """`edgerun plan` on a device without CUDA holds the int4 dense weights' packed copy
    (budget/planner.cpu_packed_dense): byte for byte what ``pack`` allocates beside the weight."""
    from edgerun.budget.planner import cpu_packed_dense
    from edgerun.bundle.dense_layout import DenseScheme
    from edgerun.models.args import TensorSpec

    w = random_qweight("int4", rows, cols, group, torch.Generator().manual_seed(3))
    spec = TensorSpec("model.layers.0.self_attn.o_proj.weight", (rows, cols), "attention")
    got, how = cpu_packed_dense([spec], DenseScheme.resolve("int4", None, group, False))
    if K.unsupported(w):  # group 16: the kernel does not take it, nothing is packed
        assert got == 0 and "0 int4 projections" in how
        return
    packed, scales, _ = K.pack(w)
    assert got == packed.nbytes + scales.nbytes and "1 int4 projections" in how
    assert cpu_packed_dense([spec], DenseScheme())[0] == 0  # plain dense: nothing packed
