"""Streaming on a CUDA device: slot pools in device memory, filled from owned staging buffers,
dequantized on the device; equal to the resident model on the same device. Skipped without
CUDA (CI has none); run on the GPU machine before resolving."""

import pytest
import torch

from edgerun.bundle.reader import load_bundle_model
from edgerun.engine.runner import Runner
from edgerun.engine.sampler import SamplingParams
from edgerun.engine.streaming import load_streaming_model
from hf_fixtures import ARCHS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (none on this machine)")
PARAMS = SamplingParams(max_tokens=32, ignore_eos=True)
PROMPT = list(range(3, 30))


@pytest.mark.parametrize("quant", ["bf16", "int4"])
@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_streaming_equals_resident(bundles, arch, quant):
    b = bundles[(arch, quant)]
    resident, args, _ = load_bundle_model(b, dtype=torch.float32, device="cuda")
    # one token per forward: no piece splitting, so the claim is equality even with cuBLAS
    ref = Runner(resident, args, None, device="cuda", prefill_chunk=1).generate_ids(PROMPT, PARAMS)
    ids = torch.tensor([PROMPT], device="cuda")
    with torch.no_grad():
        ref_logits = resident(ids[:, :1])
    for quota in (args.num_experts_per_tok, args.num_experts):
        model, _, cache, _ = load_streaming_model(b, quota, dtype=torch.float32, device="cuda")
        assert all(p.device.type == "cuda" for p in cache.pools.values())
        assert cache.fallbacks() == {}  # staging buffers page-locked: copies run async on a side stream
        staging = next(iter(cache.readers.values()))._buffers[0]
        assert torch.frombuffer(staging, dtype=torch.uint8).is_pinned()
        with torch.no_grad():
            assert torch.equal(model(ids[:, :1]), ref_logits)
        tokens = Runner(model, args, None, device="cuda", prefill_chunk=1).generate_ids(PROMPT, PARAMS)
        assert tokens == ref
        if quota == args.num_experts_per_tok:
            assert cache.totals().evictions > 0
        cache.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_blocks_read_in_pieces_copy_to_the_device_as_whole_blocks_do(bundles, arch):
    """The native reader reading each block as 3 parts at once, copying it to device slots from the
    thread that ends its last part: the logits and tokens equal the resident model's, every block
    counted once."""
    from edgerun.cache import native
    from edgerun.config import CacheConfig

    if why := native.unavailable():
        pytest.skip(f"the native reader cannot run here: {why}")
    b = bundles[(arch, "bf16")]
    resident, args, _ = load_bundle_model(b, dtype=torch.float32, device="cuda")
    ref = Runner(resident, args, None, device="cuda", prefill_chunk=1).generate_ids(PROMPT, PARAMS)
    ids = torch.tensor([PROMPT], device="cuda")
    with torch.no_grad():
        ref_logits = resident(ids[:, :1])
    config = CacheConfig(quotas=args.num_experts_per_tok, reader="native", read_pieces=3)
    model, _, cache, _ = load_streaming_model(b, config, dtype=torch.float32, device="cuda")
    readers = list(cache.readers.values())
    assert all(r.backend == "native" for r in readers) and max(r.pieces for r in readers) > 1
    assert cache.fallbacks() == {}
    with torch.no_grad():
        assert torch.equal(model(ids[:, :1]), ref_logits)
    assert Runner(model, args, None, device="cuda", prefill_chunk=1).generate_ids(PROMPT, PARAMS) == ref
    t = cache.totals()
    # a block read is one read, not three: misses not served by a prefetch, and the prefetches
    assert t.evictions > 0
    assert (
        sum(r.stats.reads for r in readers) == t.misses - t.prefetch_useful + t.prefetch_issued + t.warm_reads
    )
    cache.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_equals_one_pass(bundles, arch):
    """Every expert held (the grouped kernel looks slots up on the device), bf16, the kernels the
    engine picks: a prompt in chunks of 7 gives the one-pass last logits within the dense
    probe's bf16 tolerance (chunks change cuBLAS's and attention's summation order, not the
    math), and the same greedy continuation."""
    from edgerun.bundle.reader import Bundle
    from edgerun.engine.setup import cache_config
    from edgerun.kernels.dense_probe import TOLERANCE

    b = bundles[(arch, "int4")]
    every = Bundle.open(b).args.num_experts
    prompt = list(range(3, 90))
    logits, tokens = [], []
    for chunk in (len(prompt), 7):
        runner = Runner.load(
            b, device="cuda", dtype=torch.bfloat16, cache=cache_config(b, quota=every), prefill_chunk=chunk
        )
        state = runner.new_state(len(prompt) + 1)
        logits.append(runner.prefill(state, prompt).float())
        tokens.append(runner.generate_ids(prompt, PARAMS))
        runner.cache.close()
    err = float((logits[1] - logits[0]).abs().max() / logits[0].abs().max())
    assert err < TOLERANCE[torch.bfloat16], err
    assert tokens[0] == tokens[1]


def test_prefetch_is_off_by_default_on_cuda_and_says_so(bundles):
    """Decode prefetch on a GPU pays only while steps miss (docs/streaming.md): off by default
    there, stated, on by request."""
    from edgerun.bundle.reader import Bundle
    from edgerun.cache.expert_cache import ExpertCache
    from edgerun.engine.setup import cache_config

    b = bundles[("qwen3_moe", "int4")]
    default = ExpertCache(Bundle.open(b), cache_config(b, quota=2), device="cuda")
    assert default.prefetch_depth == 0 and any("prefetch off on CUDA" in a for a in default.adjustments)
    asked = ExpertCache(Bundle.open(b), cache_config(b, quota=2, prefetch=True), device="cuda")
    assert asked.prefetch_depth > 0
    default.close()
    asked.close()
