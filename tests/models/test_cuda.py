"""The same claims on a CUDA device: oracle match, identical greedy tokens, determinism.

Skipped without CUDA (CI has none); run on the GPU machine before resolving. Tolerance 1e-4 in
fp32: GPU reductions (SDPA, cuBLAS split-K) order sums differently from the reference's eager path.
"""

import pytest
import torch

from edgerun.engine.runner import Runner
from edgerun.engine.sampler import SamplingParams
from edgerun.models.checkpoint import load_model
from hf_fixtures import ARCHS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (none on this machine)")


@pytest.fixture
def no_tf32():
    """The oracle in fp32: cuDNN runs transformers' DeltaNet conv1d with TF32 by default (about 1e-3
    of the logits' scale off, seen on an H200), which is not the fp32 reference."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_matches_transformers_and_cpu(hf_checkpoints, arch, no_tf32):
    hf, ckpt = hf_checkpoints[arch]
    hf = hf.to("cuda")
    model, args, _ = load_model(ckpt, dtype=torch.float32, device="cuda")
    ids = torch.randint(0, 97, (1, 70), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, atol=1e-4, rtol=0)
        ref = hf.generate(ids[:, :12], max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    ours = Runner(model, args, None, device="cuda").generate_ids(ids[0, :12].tolist(), params)
    assert ours == ref[0, 12:].tolist()
    cpu_model, _, _ = load_model(ckpt, dtype=torch.float32)
    assert Runner(cpu_model, args, None).generate_ids(ids[0, :12].tolist(), params) == ours
    hf.to("cpu")


@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_bf16_greedy_is_deterministic(hf_checkpoints, arch):
    model, args, _ = load_model(hf_checkpoints[arch][1], dtype=torch.bfloat16, device="cuda")
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    prompt = list(range(3, 60))
    runs = [
        Runner(model, args, None, device="cuda", prefill_chunk=c).generate_ids(prompt, params)
        for c in (512, 512)
    ]
    assert runs[0] == runs[1]
