"""Batched decoding on CUDA (issue 18): a batch's step is a CUDA graph per row count over the
batch's state pool (engine/graphs.RowSteps). A request's greedy tokens among 1, 3 and B-1
neighbours (joining and leaving at other steps, other positions) equal its tokens alone in the
same batch, torch.equal on the ids, on both architectures, bf16 and int4 dense, every expert held
(table) and streamed (routed: the union of the rows' experts looked up together), graphs on and
off; the start-up probe passes and leaves every row count captured.
Skipped without CUDA (CI has none; the CPU twin is tests/engine/test_batch.py, and the kernels'
rows are checked under Triton's interpreter); run on the GPU machine before resolving."""

import pytest
import torch
from test_batch import MAX_TOKENS, PROMPTS, together

from edgerun.config import CacheConfig
from edgerun.engine.policy import KernelPolicy
from edgerun.engine.runner import Runner
from edgerun.engine.sampler import SamplingParams
from edgerun.errors import EdgerunError
from hf_fixtures import ARCHS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (none on this machine)")
B = 4


def _load(bundle, quota, graphs="on", experts="auto"):
    return Runner.load(
        bundle,
        device="cuda",
        dtype=torch.bfloat16,
        cache=CacheConfig(quota) if quota else None,
        kernels=KernelPolicy(graphs=graphs, experts=experts),
    )


def _invariance(runner: Runner, batch: int = B) -> None:
    prompts, max_tokens = PROMPTS[:batch], MAX_TOKENS[:batch]
    single = None
    if runner.batch is None:  # batch 1 first: a batch's sequence is the one-sequence path, bit for bit
        single = [
            runner.generate_ids(p, SamplingParams(max_tokens=n, ignore_eos=True))
            for p, n in zip(prompts, max_tokens)
        ]
    if runner.batch is None or runner.batch.size != batch:
        runner.enable_batch(batch)
    alone = [
        runner.generate_ids(p, SamplingParams(max_tokens=n, ignore_eos=True))
        for p, n in zip(prompts, max_tokens)
    ]
    if single is not None:
        assert alone == single
    for neighbours in sorted({1, 2, batch - 1} & set(range(1, batch))):
        group = list(range(neighbours + 1))
        joins = [0] + [1 + j // 2 for j in range(neighbours)]
        got = together(runner, [prompts[i] for i in group], [max_tokens[i] for i in group], joins)
        for i in group:
            assert torch.equal(torch.tensor(got[i]), torch.tensor(alone[i])), (neighbours, i)
    sizes = runner.batch.stats.sizes
    assert sizes[1] > 0 and sizes[batch] > 0, sizes
    assert runner.batch.running == 0


@pytest.mark.parametrize("graphs", ["on", "off"])
# every expert held in the cache; streamed (6 experts, top 2); resident (no cache: the experts
# dequantized at load, held as bf16 blocks for the expert kernels, Runner.set_kernels)
@pytest.mark.parametrize("quota, batch", [(16, B), (4, 2), (None, B)])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_among_neighbours_equals_alone(bundles, arch, quota, batch, graphs):
    runner = _load(bundles[(arch, "int4")], quota, graphs)
    _invariance(runner, batch)
    modes = {m for g in runner.row_steps.by_rows.values() for m in g.modes.values()}
    assert modes == ({"routed"} if quota == 4 else {"table"}), modes
    if quota is None:
        assert runner.cache is None and runner.kernels.moe.impl == "triton", runner.kernels.fallbacks
        quota = 16  # every expert held
    counts = runner.decode_counts()
    if graphs == "on":
        assert counts["graph" if quota == 16 else "mixed"] > 0 and "graphs" not in runner.fallbacks(), counts
    else:
        assert counts["graph"] == counts["mixed"] == 0
    if quota != 16:
        assert runner.cache.totals().evictions > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_prompts_in_lanes_equal_alone(dense_bundles, arch):
    """Prompts that arrive together prefill at once in lanes of their own (streams, scratch
    states and counter sets, graphs captured per lane, all at start-up as serve does): each
    request's tokens are still its tokens alone in a batch-1 runner, joined all in one round or
    staggered, and no request captures a graph."""
    runner = _load(dense_bundles[arch], 16)
    prompts, max_tokens = PROMPTS[:B], MAX_TOKENS[:B]
    single = [
        runner.generate_ids(p, SamplingParams(max_tokens=n, ignore_eos=True))
        for p, n in zip(prompts, max_tokens)
    ]
    runner.enable_batch(B, lanes=B)
    runner.probe_batch()  # serve's start-up: the probe, then every prompt length's graph in each lane
    line = runner.capture_prefill()
    assert line is not None and f"tokens in each of {B} lanes captured in" in line, line
    captured = runner.capture_counts()["prefill"]
    before = runner.prefill_counts()["graph"]
    for joins in ([0] * B, [0, 0, 1, 3]):
        got = together(runner, prompts, max_tokens, joins)
        for i in range(B):
            assert torch.equal(torch.tensor(got[i]), torch.tensor(single[i])), (joins, i)
    assert runner.lanes is not None and len(runner.lanes.lanes) == B
    assert runner.prefill_counts()["graph"] - before == 2 * B  # every first chunk replayed in a lane
    assert runner.capture_counts()["prefill"] == captured  # each captured at start-up
    assert runner.batch.running == 0
    with pytest.raises(EdgerunError, match="lanes"):
        runner.enable_batch(1, lanes=2)


@pytest.mark.parametrize("arch", ARCHS)
def test_int4_dense_rows_and_the_probe(dense_bundles, arch):
    runner = _load(dense_bundles[arch], 16)
    runner.enable_batch(B)
    line = runner.probe_batch()
    assert "bit for bit" in line and sorted(runner.row_steps.by_rows) == list(range(1, B + 1)), line
    captures = runner.steps.captures
    _invariance(runner)
    assert runner.steps.captures == captures  # the probe captured every row count: no request did


def test_refusals(bundles):
    runner = _load(bundles[("qwen3_moe", "int4")], 3)  # top 2: a 2-row step may need 4 experts
    with pytest.raises(
        EdgerunError, match=r"batch 2: a step of 2 rows needs up to top_k x B = 4 .*--batch 1 fits"
    ):
        runner.enable_batch(2)
    with pytest.raises(EdgerunError, match="at most 8 rows"):
        _load(bundles[("qwen3_moe", "int4")], 16).enable_batch(9)
    stacked = _load(bundles[("qwen3_moe", "int4")], None, experts="reference")  # torch's products
    assert stacked.kernels.choices["experts"] == "torch (stacked resident weights)"
    with pytest.raises(EdgerunError, match="resident stacked experts"):
        stacked.enable_batch(2)


@pytest.mark.parametrize("arch", ARCHS)
def test_int4_dense_on_the_tensor_core_gemv(dense_bundles, arch, monkeypatch):
    """A batch puts its large int4 projections on the tensor-core GEMV (``Runner._use_planes``;
    here every one it takes, the size threshold set to 0): its probe passes, the start-up batch
    probe passes, a request's tokens among neighbours equal its tokens alone, and batch 1 puts
    the weights back in their stored bytes."""
    from edgerun.models import base

    monkeypatch.setattr(base, "PLANES_MIN_VALUES", 0)
    runner = _load(dense_bundles[arch], 16)
    stored = {n: p.clone() for n, p in runner.model.named_parameters() if n.endswith(".weight")}
    runner.enable_batch(B)
    assert runner.planes > 0 and runner.planes_refused is None
    assert "tensor-core GEMV" in runner.kernel_summary()
    assert "bit for bit" in runner.probe_batch()
    _invariance(runner)
    runner.enable_batch(1)
    assert runner.planes == 0
    assert all(torch.equal(p, stored[n]) for n, p in runner.model.named_parameters() if n in stored)
