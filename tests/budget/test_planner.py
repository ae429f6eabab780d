import random
import subprocess
import sys

import pytest
import torch

from edgerun.budget.planner import (
    PlanOptions,
    deltanet_state_bytes,
    expert_source_from_layout,
    kv_bytes_per_token,
    miss_curve,
    plan,
    replay,
    split_quotas,
    trace_steps,
)
from edgerun.cache.policy import LRUSet
from edgerun.config import device_profile_from_dict
from edgerun.engine.policy import cpu_expert_kernel
from edgerun.errors import ConfigError
from edgerun.models.registry import load_args
from edgerun.tools.routes import RouteTrace, TraceHeader
from hf_fixtures import QWEN3_5_MOE, QWEN3_MOE


def tiny(arch):
    cfg = {**(QWEN3_5_MOE if arch == "qwen3_5_moe" else QWEN3_MOE), "model_type": arch}
    module, args = load_args(cfg)
    return module, args, module.tensor_specs(args)


def profile(cap, **kw):
    raw = dict(
        name="tiny",
        memory_kind="unified",
        memory_cap=cap,
        os_reserve=1000,
        cuda_context=2000,
        pinned_limit=100_000,
        memory_bandwidth=1e6,
        storage_read_bandwidth=1e5,
        compute_capability="8.7",
    )
    raw.update(kw)
    return device_profile_from_dict({k: v for k, v in raw.items() if v is not None})


# --------------------------------------------------------------------------------------------
# Tiny configs, every category by hand

# qwen3_5_moe tiny (hf_fixtures.QWEN3_5_MOE): V 97, D 48, layers L F L F, 4 heads / 2 KV x 16,
# DeltaNet 2 key heads x 8, 4 value heads x 12, conv 4; 6 experts top-2, I 24, shared 40. bf16.
TINY35_ITEMS = {
    "os_reserve": 1000,
    "cuda_context": 2000,
    "embeddings": 97 * 48 * 2,  # 9312
    "lm_head": 48 * 97 * 2,  # 9312
    # per full layer: q 48x128 (with gate) + k 48x32 + v 48x32 + o 64x48 + q/k norms 16+16
    "attention": 2 * (6144 + 1536 + 1536 + 3072 + 32) * 2,  # 49280
    # per linear layer: qkv 48x80 + z 48x48 + b 48x4 + a 48x4 + conv 80x4 + dt_bias 4 + A_log 4
    # + norm 12 + out 48x48
    "deltanet": 2 * (3840 + 2304 + 192 + 192 + 320 + 4 + 4 + 12 + 2304) * 2,  # 36688
    "norms": (4 * 2 * 48 + 48) * 2,  # 864
    "routers": 4 * 6 * 48 * 2,  # 2304
    "shared_experts": 4 * (3 * 48 * 40 + 48) * 2,  # 46464
    # 2 full layers x K,V x batch 2 x 2 heads x 64 tokens x 16 x 2 B
    "kv_cache": 2 * 2 * 2 * 2 * 64 * 16 * 2,  # 32768
    # 2 linear layers x batch 2 x (conv 80 x 3 x 2 B + recurrent 4 x 8 x 12 x 4 B)
    "deltanet_state": 2 * 2 * (80 * 3 * 2 + 4 * 8 * 12 * 4),  # 8064
    # per token: stream 4x48x2 = 384; DeltaNet (wider than attention's 512): (2x80 + 2x48 + 2x4) x 2
    # + fp32 (2x4x8 + 4x12) x 4 + chunk 3x4x64x4 = 4048; MoE: router 6x4 + fp32 2 x (24 + 48) x 4 +
    # shared 2x40x2 = 760 -> 5192 B; prefill chunk 16 tokens + fp32 logits 2 x 97 x 4 + the grouped
    # step's tile padding 32 rows x 6 experts x 24 x 4 B
    # + K,V of the 64-token context repeated to 4 query heads x 16 x 2 B (chunks of 16 after the first)
    "activation_workspace": 16 * 5192 + 2 * 97 * 4 + 32 * 6 * 24 * 4 + 2 * 4 * 64 * 16 * 2,  # 118664
    # graph sets of 1 and 2 rows: 3 rows x (per token + fp32 logits)
    "cuda_graph_pool": 3 * (5192 + 97 * 4),  # 16740
    # one sequence's static state of 64 positions (the 16-token chunk's capacity, at most the
    # context): K,V 2 layers x 2 heads x 16 x 2 B a position + one DeltaNet state (8064 / 2)
    "batch_prefill_state": 64 * 2 * 2 * 2 * 16 * 2 + 4032,  # 20416
    "pinned_staging": 4 * 4096,  # 2 x top_k buffers x int8 block (2304 + 192 + 1152 + 192 -> 4096)
}
TINY35_FIXED = sum(TINY35_ITEMS.values())  # 370260


def test_tiny_qwen3_5_every_category_byte_exact():
    _, args, specs = tiny("qwen3_5_moe")
    experts = expert_source_from_layout(args, "int8")
    assert experts.block_bytes == (4096,) * 4
    p = plan(args, specs, experts, profile(462_380), 64, 2, PlanOptions(prefill_chunk=16))
    assert TINY35_FIXED == 370_260
    # slots: (462380 - 370260) // (4 layers x 4096) = 5 per layer; the minimum is 2 x top_k = 4
    assert p.fits and p.min_quota == 4 and p.quotas == (5, 5, 5, 5)
    # lfu-bypass (the cache's default): top_k = 2 spill rows of 4096 B beside the slots
    want = {**TINY35_ITEMS, "expert_slots": 5 * 4 * 4096, "spill_rows": 2 * 4096}
    assert {it.name: it.nbytes for it in p.items} == want
    (pool,) = p.pools
    assert (pool.name, pool.cap, pool.used, pool.headroom) == ("unified", 462_380, 460_372, 2_008)
    # every miss held (lfu): no spill rows
    lfu = plan(
        args, specs, experts, profile(462_380), 64, 2, PlanOptions(prefill_chunk=16, cache_policy="lfu")
    )
    assert {it.name: it.nbytes for it in lfu.items} == {**TINY35_ITEMS, "expert_slots": 5 * 4 * 4096}
    assert lfu.pools[0].headroom == 10_200


def test_prefill_lanes_each_hold_a_graph_pool_a_state_and_a_workspace():
    """A batch's prefill lanes replay only where the prefill graphs do: the graphs' item counts
    each lane's own pool, scratch state (a chunk) and cuBLAS workspace, at most one lane a row."""
    from edgerun.budget.planner import library_workspace_bytes

    _, args, specs = tiny("qwen3_5_moe")
    experts = expert_source_from_layout(args, "int8")
    base = plan(args, specs, experts, profile(10**8), 64, 2, PlanOptions(prefill_chunk=16, prefill_lanes=1))
    lanes = plan(args, specs, experts, profile(10**8), 64, 2, PlanOptions(prefill_chunk=16, prefill_lanes=4))
    assert lanes.quotas == base.quotas == (6, 6, 6, 6)  # every expert held: the graphs replay
    pool = 16 * 5192 + 32 * 6 * 24 * 4  # 16 tokens + the grouped step's tile padding
    assert {it.name: it.nbytes for it in base.items}["prefill_graph_pool"] == pool
    # a 16-token scratch state: K,V 2 layers x 2 heads x 16 x 2 B a position + one DeltaNet state
    state = 16 * 2 * 2 * 2 * 16 * 2 + 4032
    want = pool + 2 * (pool + state + library_workspace_bytes("8.7") // 2)
    assert {it.name: it.nbytes for it in lanes.items}["prefill_graph_pool"] == want
    assert lanes.pools[0].used - base.pools[0].used == want - pool
    assert (base.prefill_lanes, lanes.prefill_lanes) == (1, 2)
    # streamed (a quota below E): no prefill graphs, so no lanes either
    streamed = PlanOptions(prefill_chunk=16, prefill_lanes=4, quota=5)
    got = plan(args, specs, experts, profile(10**8), 64, 2, streamed)
    assert "prefill_graph_pool" not in {it.name for it in got.items} and got.prefill_lanes == 1


def test_prefill_lanes_by_default_only_where_they_take_no_expert_slot():
    """Lanes not asked for (None): up to DEFAULT_PREFILL_LANES where every expert is held and
    their pools fit beside it; where they do not, one lane and every expert still held (not a
    slot fewer); none at batch 1, streamed, or without CUDA."""
    _, args, specs = tiny("qwen3_5_moe")
    experts = expert_source_from_layout(args, "int8")
    one = PlanOptions(prefill_chunk=16, prefill_lanes=1)
    auto = PlanOptions(prefill_chunk=16)
    base = plan(args, specs, experts, profile(10**8), 64, 2, one)
    wide = plan(args, specs, experts, profile(10**8), 64, 2, PlanOptions(prefill_chunk=16, prefill_lanes=2))
    got = plan(args, specs, experts, profile(10**8), 64, 2, auto)
    assert got.prefill_lanes == 2 and got.items == wide.items  # batch 2: at most a lane a row
    # room for every expert and one lane's pool, not for two lanes'
    extra = wide.pools[0].used - base.pools[0].used
    tight = profile(10**8 - base.pools[0].headroom + extra - 1)
    got = plan(args, specs, experts, tight, 64, 2, auto)
    assert got.fits and got.quotas == base.quotas == (6, 6, 6, 6)
    assert got.prefill_lanes == 1 and got.items == plan(args, specs, experts, tight, 64, 2, one).items
    assert plan(args, specs, experts, profile(10**8), 64, 1, auto).prefill_lanes == 1
    streamed = plan(args, specs, experts, profile(10**8), 64, 2, PlanOptions(prefill_chunk=16, quota=5))
    assert streamed.prefill_lanes == 1
    cpu = profile(10**8, cuda_context=0, compute_capability=None)
    assert plan(args, specs, experts, cpu, 64, 2, auto).prefill_lanes == 1
    with pytest.raises(ConfigError, match="prefill_lanes must be >= 1, got 0"):
        plan(args, specs, experts, profile(10**8), 64, 2, PlanOptions(prefill_lanes=0))


def test_tiny_qwen3_moe_dense_mlp_and_quota_capped_at_num_experts():
    _, args, specs = tiny("qwen3_moe")  # 3 layers, layer 1 dense (mlp_only_layers), no gate, no CUDA
    cpu = profile(1_000_000, cuda_context=0, compute_capability=None)
    p = plan(
        args, specs, expert_source_from_layout(args, "int8"), cpu, 32, 1, PlanOptions(dense_dtype="bf16")
    )
    assert {it.name: it.nbytes for it in p.items} == {
        "os_reserve": 1000,
        "cuda_context": 0,
        "embeddings": 9312,
        "lm_head": 9312,
        "attention": 3 * (48 * 64 + 48 * 32 + 48 * 32 + 64 * 48 + 32) * 2,  # 55488
        "norms": (3 * 2 * 48 + 48) * 2,  # 672
        "routers": 2 * 6 * 48 * 2,  # 1152
        "dense_mlp": 3 * 48 * 80 * 2,  # 23040
        "kv_cache": 3 * 2 * 2 * 32 * 16 * 2,  # 12288
        # per token: stream 384 + attention (64 + 64 + 64) x 2 + MoE 6 x 4 + fp32 2 x (24 + 48) x 4
        # = 1368; no tile padding (the grouped kernels run on CUDA)
        "activation_workspace": 32 * 1368 + 97 * 4,  # 44164
        "pinned_staging": 4 * 4096,
        "expert_slots": 6 * 2 * 4096,  # all 6 experts: more would hold nothing
    }
    assert p.quotas == (6, 6) and "no CUDA on this device: no graph pool" in p.notes
    assert p.prediction.misses_per_token == 0 and p.prediction.storage_bound_tok_s is None


def test_state_bytes_match_the_models_own_decode_state():
    module, args, _ = tiny("qwen3_5_moe")
    with torch.device("meta"):
        model = module.Model(args)
    state = model.new_state(3, 40, device="meta", dtype=torch.bfloat16)
    assert state.nbytes() == 3 * 40 * kv_bytes_per_token(args) + deltanet_state_bytes(args, 3)


def test_refusal_names_the_smallest_over_budget_item_and_what_fits():
    _, args, specs = tiny("qwen3_5_moe")
    experts = expert_source_from_layout(args, "int8")
    opts = PlanOptions(prefill_chunk=16, cache_policy="lfu")  # no spill rows: the arithmetic below
    p = plan(args, specs, experts, profile(422_380), 64, 2, opts)
    # needs 370260 + 4 slots x 4 layers x 4096 = 435796: over by 13416; the smallest item at least
    # that large is the staging (16384). A context token costs 1024 B: KV 512 B at batch 2, the
    # GQA expansion 256 B (chunks of 16 after the first) and the batch's one-sequence prefill
    # state 256 B (its positions are the context's, under 256): 14 fewer tokens fit.
    r = p.refusal
    assert not p.fits and p.prediction is None
    assert (r.pool, r.overflow, r.item, r.item_bytes) == ("unified", 13_416, "pinned_staging", 16_384)
    assert (r.max_context, r.max_batch, r.max_quota) == (50, 1, None)
    assert "Largest context that fits at batch 2 with 4 slots per layer: 50 tokens" in r.message
    assert "Largest batch that fits at context 64: 1" in r.message
    assert p.pools[0].headroom == -13_416 and p.quotas == (4, 4, 4, 4)
    assert plan(args, specs, experts, profile(422_380), 50, 2, opts).fits
    assert not plan(args, specs, experts, profile(422_380), 51, 2, opts).fits


def test_staging_over_the_pinned_limit_is_refused():
    _, args, specs = tiny("qwen3_5_moe")
    experts = expert_source_from_layout(args, "int8")
    p = plan(args, specs, experts, profile(10**6, pinned_limit=10_000), 64, 2)
    r = p.refusal
    assert (r.pool, r.overflow, r.item) == ("pinned_limit", 16_384 - 10_000, "pinned_staging")
    assert "pinned memory (pinned_limit) is over by" in r.message
    assert plan(
        args, specs, experts, profile(10**6, pinned_limit=10_000), 64, 2, PlanOptions(staging_buffers=2)
    ).fits


def test_measured_resident_bytes_replace_the_estimate():
    _, args, specs = tiny("qwen3_5_moe")
    experts = expert_source_from_layout(args, "int8")
    p = plan(args, specs, experts, profile(10**6), 64, resident={"embeddings": 123, "deltanet": 456})
    names = {it.name: it.nbytes for it in p.items}
    assert names["embeddings"] == 123 and names["deltanet"] == 456 and "attention" not in names


def test_requested_quota():
    _, args, specs = tiny("qwen3_5_moe")
    experts = expert_source_from_layout(args, "int8")
    opts = PlanOptions(prefill_chunk=16, quota=6)
    p = plan(args, specs, experts, profile(462_380), 64, 2, opts)
    assert not p.fits and p.refusal.max_quota == 5
    assert "Largest quota that fits at context 64, batch 2: 5 per layer" in p.refusal.message
    p = plan(args, specs, experts, profile(542_380), 64, 2, opts)
    assert p.fits and p.quotas == (6, 6, 6, 6)
    for bad in (3, 7):  # below top_k x batch, above num_experts
        with pytest.raises(ConfigError, match=f"quota {bad} must be in 4..6"):
            plan(args, specs, experts, profile(500_000), 64, 2, PlanOptions(quota=bad))


def test_cpu_plan_counts_the_cpu_kernels_packed_copy_of_each_int4_slot():
    """On a device without CUDA every int4 slot the CPU kernels take also holds its repacked
    layout (ExpertCache.packed_bytes; its size is checked against real packs in
    tests/kernels/test_moe_cpu.py): the plan counts it and sizes the quota by it."""
    cfg = {**QWEN3_MOE, "model_type": "qwen3_moe", "hidden_size": 64, "moe_intermediate_size": 32}
    module, args = load_args(cfg)
    specs = module.tensor_specs(args)
    experts = expert_source_from_layout(args, "int4", 32)
    # gate_up [64, 64] and down [64, 32]: the nibbles again (2048 + 1024 B) and a bf16 (scale,
    # zero) per row and group of 32 (64 x 2 and 64 x 1 groups, 4 B each)
    packed = 64 * 32 + 64 * 16 + (64 * 2 + 64 * 1) * 4
    opts = PlanOptions(prefill_chunk=16, quota=args.num_experts, expert_kernel="cpu", cache_policy="lfu")
    cpu = plan(args, specs, experts, profile(10**8, compute_capability=None, cuda_context=0), 64, 1, opts)
    gpu = plan(args, specs, experts, profile(10**8), 64, 1, opts)
    n = args.num_experts * len(args.moe_layers)
    assert cpu.item("expert_slots").nbytes == n * (experts.block_bytes[0] + packed)
    assert gpu.item("expert_slots").nbytes == n * experts.block_bytes[0]
    assert "packed for the CPU kernels" in cpu.item("expert_slots").detail
    # the memory that holds every block but not their packed copies does not fit them
    fixed = sum(it.nbytes for it in cpu.items) - cpu.item("expert_slots").nbytes
    for extra, fits in ((n * packed, True), (n * packed - 1, False)):
        cap = profile(fixed + n * experts.block_bytes[0] + extra, compute_capability=None, cuda_context=0)
        assert plan(args, specs, experts, cap, 64, 1, opts).fits is fits
    # int8 slots are read in place: nothing packed
    int8 = expert_source_from_layout(args, "int8")
    cpu8 = plan(args, specs, int8, profile(10**8, compute_capability=None, cuda_context=0), 64, 1, opts)
    assert cpu8.item("expert_slots").nbytes == n * int8.block_bytes[0]


def test_cpu_plan_counts_what_the_chosen_expert_kernel_holds():
    """torch's CPU kernels hold a repacked copy beside each int4 slot, the grouped C kernel reads
    the slot's own bytes (none), the reference dequantizes per step (none); auto counts what the
    engine picks where its probe passes (engine/policy.py's cpu_expert_kernel)."""
    cfg = {**QWEN3_MOE, "model_type": "qwen3_moe", "hidden_size": 64, "moe_intermediate_size": 32}
    module, args = load_args(cfg)
    specs = module.tensor_specs(args)
    experts = expert_source_from_layout(args, "int4", 32)
    dev = profile(10**8, compute_capability=None, cuda_context=0)
    n = args.num_experts * len(args.moe_layers)

    def slots(kernel):
        opts = PlanOptions(prefill_chunk=16, quota=args.num_experts, expert_kernel=kernel)
        return plan(args, specs, experts, dev, 64, 1, opts).item("expert_slots")

    packed = slots("cpu").nbytes - n * experts.block_bytes[0]
    assert packed == n * (64 * 32 + 64 * 16 + (64 * 2 + 64 * 1) * 4)
    for kernel in ("cpu_grouped", "reference", "triton"):  # triton on a CPU runs the reference
        assert slots(kernel).nbytes == n * experts.block_bytes[0]
        assert "packed" not in slots(kernel).detail
    assert slots("auto") == slots(cpu_expert_kernel("auto"))
    with pytest.raises(ConfigError, match="expert kernel 'fast' is not one of auto, reference"):
        slots("fast")


def test_bad_inputs():
    _, args, specs = tiny("qwen3_moe")
    experts = expert_source_from_layout(args, "int8")
    with pytest.raises(ConfigError, match="context 513 must be in 1..512"):
        plan(args, specs, experts, profile(10**7), 513)
    with pytest.raises(ConfigError, match="batch must be >= 1"):
        plan(args, specs, experts, profile(10**7), 64, 0)
    with pytest.raises(ConfigError, match="kv_dtype 'fp6' is not supported"):
        plan(args, specs, experts, profile(10**7), 64, 1, PlanOptions(kv_dtype="fp6"))
    other = TraceHeader("x", "qwen3_moe", 3, (0, 2), 6, 3)
    with pytest.raises(ConfigError, match="trace top_k is 3 but the model's is 2"):
        plan(args, specs, experts, profile(10**7), 64, 1, trace=RouteTrace(other, (((0, 1, 2), (3, 4, 5)),)))


# --------------------------------------------------------------------------------------------
# Discrete: two tiers


def discrete(vram, pinned):
    return profile(
        vram,
        memory_kind="discrete",
        pinned_limit=pinned,
        host_memory_cap=10**7,
        host_reserve=10**6,
        pcie_bandwidth=1e6,
    )


def test_discrete_two_tiers():
    _, args, specs = tiny("qwen3_5_moe")
    experts = expert_source_from_layout(args, "int8")
    vram_fixed = TINY35_FIXED - TINY35_ITEMS["pinned_staging"]  # staging lives in pinned host RAM
    dev = discrete(vram_fixed + 4 * 4 * 4096, 16_384 + 20 * 4096)
    p = plan(args, specs, experts, dev, 64, 2, PlanOptions(prefill_chunk=16, cache_policy="lfu"))
    vram, host = p.pools
    assert (vram.name, host.name) == ("vram", "host_pinned")
    assert p.quotas == (4, 4, 4, 4) and p.host_quotas == (5, 5, 5, 5)
    assert p.item("pinned_staging").pool == "host_pinned" and p.item("host_expert_tier").nbytes == 20 * 4096
    assert vram.headroom == 0 and host.headroom == 0
    d = 6 * (1 - (1 - 2 / 6) ** 2)  # distinct experts per step of 2 tokens
    pr = p.prediction
    assert pr.device_misses_per_token == pytest.approx(4 * d * (1 - 4 / 6) / 2)
    assert pr.misses_per_token == pytest.approx(4 * d * (1 - 5 / 6) / 2)
    assert pr.pcie_bound_tok_s == pytest.approx(1e6 / (pr.device_misses_per_token * 4096))
    assert pr.tok_s == pytest.approx(min(pr.memory_bound_tok_s, pr.storage_bound_tok_s, pr.pcie_bound_tok_s))
    assert 1 / pr.tok_s_serial == pytest.approx(
        1 / pr.memory_bound_tok_s + 1 / pr.storage_bound_tok_s + 1 / pr.pcie_bound_tok_s
    )
    # the tier's misses are copies, which prefetch does not read ahead: no prefetch figure
    assert (pr.tok_s_prefetch, pr.prefetch_useful_per_token, pr.guesses) == (0.0, 0.0, "")


def test_a_host_tier_takes_the_spill_rows_pinned_memory():
    """Under lfu-bypass (the default) the spill rows are reserved in pinned memory, but a host
    tier keeps LFU and needs none: the tier is sized as if they were never reserved."""
    _, args, specs = tiny("qwen3_5_moe")
    experts = expert_source_from_layout(args, "int8")
    vram_fixed = TINY35_FIXED - TINY35_ITEMS["pinned_staging"]
    dev = discrete(vram_fixed + 4 * 4 * 4096, 16_384 + 20 * 4096)  # pinned: staging + 5 slots a layer
    bypass = plan(args, specs, experts, dev, 64, 2, PlanOptions(prefill_chunk=16))
    lfu = plan(args, specs, experts, dev, 64, 2, PlanOptions(prefill_chunk=16, cache_policy="lfu"))
    assert bypass.host_quotas == lfu.host_quotas == (5, 5, 5, 5)
    assert bypass.items == lfu.items and not any(it.name == "spill_rows" for it in bypass.items)
    # pinned memory for no tier (only 2 blocks past staging): the spill rows stay, in it
    small = plan(args, specs, experts, discrete(vram_fixed + 4 * 4 * 4096, 16_384 + 2 * 4096), 64, 2,
                 PlanOptions(prefill_chunk=16))  # fmt: skip
    assert small.host_quotas == () and small.item("spill_rows").nbytes == 2 * 4096
    assert small.item("spill_rows").pool == "host_pinned"


def test_no_host_tier_when_pinned_memory_cannot_include_the_vram_tier():
    _, args, specs = tiny("qwen3_5_moe")
    experts = expert_source_from_layout(args, "int8")
    lfu = PlanOptions(cache_policy="lfu")  # no spill rows in the pinned memory this leaves
    p = plan(args, specs, experts, discrete(2 * 10**6, 16_384 + 4096), 64, 2, lfu)
    assert p.fits and p.quotas == (6,) * 4 and p.host_quotas == ()
    assert any(it.name == "prefill_graph_pool" for it in p.items)  # every expert held: prompts replay
    assert any("no pinned host tier" in n for n in p.notes)
    assert p.prediction.misses_per_token == p.prediction.device_misses_per_token == 0
    p = plan(args, specs, experts, discrete(10**6, 16_000), 64, 2, lfu)
    assert not p.fits and p.refusal.pool == "host_pinned" and p.refusal.item == "pinned_staging"


# --------------------------------------------------------------------------------------------
# Route traces: per-layer quotas and replayed misses


def lru_misses(steps, quota):
    """The expert cache's own bookkeeping, step by step: what the planner's replay must equal."""
    lru = LRUSet(quota)
    return sum(len(lru.access(s).misses) for s in steps)


def test_miss_curve_and_replay_equal_the_cache_lru():
    """On random traces, every quota from the widest step to E: one-token steps, batched steps
    from trace_steps, and the simulator's steps (repeated ids, ragged widths)."""
    rng = random.Random(1)
    E = 16
    for trial in range(6):
        hot = rng.sample(range(E), 10)  # a skewed trace: most routes go to 10 of the 16
        tokens = tuple(
            tuple(tuple(rng.sample(hot if rng.random() < 0.8 else range(E), 2)) for _ in range(2))
            for _ in range(150)
        )
        cases = [trace_steps(RouteTrace(TraceHeader("x", "t", 2, (0, 1), E, 2), tokens), b) for b in (1, 3)]
        ragged = [
            [rng.choice(hot) for _ in range(rng.randint(1, 7))] for _ in range(150)
        ]  # duplicates within a step, as fetches() batches a prefill's tokens
        cases.append([ragged])
        for steps in cases:
            for layer in steps:
                widest = max(len(set(s)) for s in layer)
                curve = miss_curve(layer, E)
                for q in range(widest, E + 1):
                    want = lru_misses(layer, q)
                    assert curve[q] == replay(layer, q) == want, (trial, q)
                assert curve[widest] > curve[E]  # the traces do reuse: the check compares hits


def test_replay_refuses_what_the_cache_refuses():
    steps = [[1, 2, 3], [3, 3, 4]]
    for quota in (0, 2):
        with pytest.raises(ValueError) as ours:
            replay(steps, quota)
        with pytest.raises(ValueError) as cache:
            lru_misses(steps, quota)
        assert str(ours.value) == str(cache.value)
    assert replay([], 1) == lru_misses([], 1) == 0


def test_planner_imports_neither_the_cache_nor_the_trace_reader():
    """The planner computes LRU misses itself: importing it pulls in neither the cache package's
    bookkeeping nor the route-trace reader (a type only)."""
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import edgerun.budget.planner\n"
        "print(sorted(m for m in ('edgerun.cache.policy', 'edgerun.tools.routes') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_trace_gives_layers_that_need_more_a_larger_quota():
    _, args, specs = tiny("qwen3_moe")  # MoE layers 0 and 2, 6 experts, top-2
    experts = expert_source_from_layout(args, "int8")
    # layer 0 cycles through all six experts (a cliff: nothing hits until all six fit);
    # layer 2 reuses one pair
    cycle = [(0, 1), (2, 3), (4, 5)]
    tokens = tuple((cycle[t % 3], (0, 1)) for t in range(30))
    trace = RouteTrace(TraceHeader("tiny", "qwen3_moe", 3, (0, 2), 6, 2), tokens, "t.jsonl")
    lfu = PlanOptions(cache_policy="lfu")  # no spill rows: 8 slots below are all the memory left
    uniform = plan(args, specs, experts, profile(10**7), 64, options=lfu)
    fixed = sum(it.nbytes for it in uniform.items if it.name not in ("expert_slots", "prefill_graph_pool"))
    dev = profile(fixed + 8 * 4096)  # 8 slots in all
    p = plan(args, specs, experts, dev, 64, options=lfu, trace=trace)
    assert p.quotas == (6, 2)
    pr = p.prediction
    assert pr.model == "trace" and pr.trace_tokens == 30 and "t.jsonl" in pr.description
    assert pr.misses_per_layer == (6 / 30, 2 / 30)  # cold misses only
    assert plan(args, specs, experts, dev, 64, options=lfu).quotas == (4, 4)  # without a trace: uniform
    steps = trace_steps(trace, 1)
    assert [replay(s, 4) for s in steps] == [60, 2]  # what the uniform split would cost
    # the same split in slots, as the policy study asks for it (every slot one size here)
    assert split_quotas([miss_curve(s, 6) for s in steps], 8, 2) == p.quotas
    with pytest.raises(ValueError, match="3 slots cannot give 2 layers 2 each"):
        split_quotas([miss_curve(s, 6) for s in steps], 3, 2)


# --------------------------------------------------------------------------------------------
# The real models on the shipped profiles, against arithmetic done here

QWEN36 = dict(  # Qwen3.6-35B-A3B, int4 g32 experts, bf16 dense
    dense=(2 * 248320 * 2048)  # embeddings + lm_head
    + 10 * (2048 * 8192 + 2 * 2048 * 512 + 4096 * 2048 + 2 * 256)  # gated attention
    + 30 * (2048 * 8192 + 2048 * 4096 + 2 * 2048 * 32 + 8192 * 4 + 32 + 32 + 128 + 4096 * 2048)  # DeltaNet
    + (40 * 2 * 2048 + 2048)  # norms
    + 40 * 256 * 2048  # routers
    + 40 * (3 * 2048 * 512 + 2048),  # shared experts and their gates
    block=1024 * 1024 + 1024 * 64 + 2048 * 256 + 2048 * 16,  # gate_up, fp8 scales, down, scales
    # without CUDA, each slot's CPU-kernel layout too: the nibbles and a bf16 (scale, zero) a group
    packed=1024 * 1024 + 2048 * 256 + 4 * (1024 * 64 + 2048 * 16),
    kv_per_token=10 * 2 * 2 * 256 * 2,
    state_per_seq=30 * (8192 * 3 * 2 + 32 * 128 * 128 * 4),
    ws_per_token=224_384,  # see token_workspace_bytes: 16384 + DeltaNet 123008 + MoE 84992
    chunk_extra=32 * 256 * 512 * 4,  # prefill_chunk_extra: the grouped step's tile padding (dense bf16)
    vocab=248320,
    layers=40,
    experts=256,
)
QWEN3 = dict(  # Qwen3-30B-A3B, int4 g32 experts, bf16 dense
    dense=(2 * 151936 * 2048)
    + 48 * (2048 * 4096 + 2 * 2048 * 512 + 4096 * 2048 + 2 * 128)
    + (48 * 2 * 2048 + 2048)
    + 48 * 128 * 2048,
    block=1536 * 1024 + 1536 * 64 + 2048 * 384 + 2048 * 24,
    packed=1536 * 1024 + 2048 * 384 + 4 * (1536 * 64 + 2048 * 24),
    kv_per_token=48 * 2 * 4 * 128 * 2,
    state_per_seq=0,
    ws_per_token=125_440,  # 16384 + attention 18432 + MoE 90624
    chunk_extra=32 * 128 * 768 * 4,
    vocab=151936,
    layers=48,
    experts=128,
)


def expected(m, dev, context, batch):
    """(VRAM-or-unified quota, host quota) by hand, or None when even the minimum does not fit."""
    a = 2
    dense = m["dense"] * a
    fixed = dev.os_reserve + dev.cuda_context + dense + batch * context * m["kv_per_token"]
    fixed += batch * m["state_per_seq"] + min(512, context) * m["ws_per_token"] + batch * m["vocab"] * 4
    if dev.has_cuda:  # the grouped expert kernels' tile padding (CUDA's)
        fixed += m["chunk_extra"]
    if context > 512:  # later chunks repeat the context's K and V to the query heads (16 KiB a token both)
        fixed += context * 16384
    if dev.has_cuda:  # graph pool: a graph set per row count 1..batch
        fixed += batch * (batch + 1) // 2 * (m["ws_per_token"] + m["vocab"] * 4)
    if dev.has_cuda and batch > 1:  # one sequence's static state for a batch's first prompt chunks
        positions = min(max(256, 1 << (min(512, context) - 1).bit_length()), context)
        fixed += positions * m["kv_per_token"] + m["state_per_seq"]
    staging = 16 * m["block"]
    if not dev.discrete:
        fixed += staging
    host = (
        min(m["experts"], (dev.pinned_limit - staging) // (m["layers"] * m["block"])) if dev.discrete else 0
    )
    if host == m["experts"]:  # the far tier: every expert reachable, prompts replay prefill graphs from VRAM
        fixed += min(max(batch, min(512, context)), 2048) * m["ws_per_token"] + m["chunk_extra"]
    slot = m["block"] + (0 if dev.has_cuda or cpu_expert_kernel("auto") != "cpu" else m["packed"])
    quota = min(m["experts"], (dev.memory_cap - fixed) // (m["layers"] * slot))
    if quota < min(m["experts"], 8 * batch):
        return None
    return quota, host if host >= quota else 0


@pytest.mark.parametrize("device", ["jetson_thor", "orin", "orin_nano", "rtx5070", "cpu"])
@pytest.mark.parametrize("model", ["qwen3.6-35b-a3b", "qwen3-30b-a3b"])
def test_real_models_fit_or_refuse_as_the_arithmetic_says(model_inputs, profiles, model, device):
    mi, dev = model_inputs[model], profiles[device]
    m = QWEN36 if model.startswith("qwen3.6") else QWEN3
    assert mi.experts.block_bytes == (m["block"],) * m["layers"]
    bf16 = PlanOptions(dense_dtype="bf16")  # ``expected`` counts at bf16 (a CPU's runtime dtype may differ)
    for context in (4096, 32768, mi.args.max_position_embeddings):
        for batch in (1, 4):
            p = plan(mi.args, mi.specs, mi.experts, dev, context, batch, bf16)
            want = expected(m, dev, context, batch)
            assert p.fits == (want is not None), (context, batch, p.refusal)
            assert all(q >= mi.args.num_experts_per_tok for q in p.quotas)
            if want is None:
                r = p.refusal
                assert (
                    r.max_context is None
                    or plan(mi.args, mi.specs, mi.experts, dev, r.max_context, batch, bf16).fits
                )
                if r.max_context is not None:
                    assert not plan(mi.args, mi.specs, mi.experts, dev, r.max_context + 1, batch, bf16).fits
                    assert f"{r.max_context} tokens" in r.message
                continue
            quota, host = want
            assert p.quotas == (quota,) * m["layers"]
            assert p.host_quotas == ((host,) * m["layers"] if host else ())
            pr = p.prediction
            if host == m["experts"]:  # the far tier: no misses; the pairs VRAM slots lack cross PCIe
                far = m["layers"] * 8 * (1 - quota / m["experts"])
                assert pr.misses_per_token == pr.device_misses_per_token == 0
                assert pr.far_reads_per_token == pytest.approx(far)
                assert pr.pcie_bound_tok_s == pytest.approx(dev.pcie_bandwidth / (far * m["block"]))
                assert pr.tok_s == pytest.approx(min(pr.memory_bound_tok_s, pr.pcie_bound_tok_s))
                continue
            d = m["experts"] * (1 - (1 - 8 / m["experts"]) ** batch)
            storage_q = host or quota
            assert pr.misses_per_token == pytest.approx(
                m["layers"] * d * (1 - storage_q / m["experts"]) / batch
            )
            assert pr.device_misses_per_token == pytest.approx(
                m["layers"] * d * (1 - quota / m["experts"]) / batch
            )
            if pr.storage_bound_tok_s is not None:
                assert pr.storage_bound_tok_s == pytest.approx(
                    dev.storage_read_bandwidth / (pr.misses_per_token * m["block"])
                )
            bounds = [pr.memory_bound_tok_s, pr.storage_bound_tok_s, pr.pcie_bound_tok_s]
            assert pr.tok_s == pytest.approx(min(b for b in bounds if b is not None))


def test_real_dense_bytes(model_inputs):
    for name, m in (("qwen3.6-35b-a3b", QWEN36), ("qwen3-30b-a3b", QWEN3)):
        mi = model_inputs[name]
        p = plan(mi.args, mi.specs, mi.experts, profile(10**12, pinned_limit=10**9), 4096)
        resident = ("embeddings", "lm_head", "attention", "deltanet", "norms", "routers", "shared_experts")
        assert sum(it.nbytes for it in p.items if it.name in resident) == 2 * m["dense"]
    assert QWEN36["dense"] * 2 == 4_896_711_936 and QWEN3["dense"] * 2 == 3_082_186_752


def test_refusal_on_rtx5070_names_the_kv_cache(model_inputs, profiles):
    mi = model_inputs["qwen3-30b-a3b"]
    p = plan(mi.args, mi.specs, mi.experts, profiles["rtx5070"], 32768, 4)
    assert not p.fits and p.refusal.item == "kv_cache" and p.refusal.max_batch == 1
    assert "Largest context that fits at batch 4 with 32 slots per layer" in p.refusal.message


def test_the_planned_tile_padding_is_the_kernels():
    """The planner sizes the grouped expert step's padding with the kernels' tile rows (it cannot
    import them: planning imports no torch)."""
    pytest.importorskip("triton")
    from edgerun.budget.planner import PREFILL_TILE_ROWS
    from edgerun.kernels.moe_triton import DEFAULT_GROUPED

    assert PREFILL_TILE_ROWS == DEFAULT_GROUPED.block_m


def test_prefill_graphs_are_planned_only_where_they_replay():
    """Holding every expert turns the prefill graphs on (engine/graphs.PrefillGraphs), whose pool
    the plan then holds; where that pool would not fit beside every expert, a slot gives way
    (prompts then run eagerly, no pool); streamed plans and the CPU hold no such pool."""
    _, args, specs = tiny("qwen3_5_moe")
    experts = expert_source_from_layout(args, "int8")
    roomy = plan(args, specs, experts, discrete(2 * 10**6, 10**6), 64, 1, PlanOptions(tier_reads="copy"))
    pool = next(it for it in roomy.items if it.name == "prefill_graph_pool")
    assert roomy.quotas == (6,) * 4 and pool.nbytes > 0
    used = sum(it.nbytes for it in roomy.items if it.pool == pool.pool)
    tight = plan(
        args, specs, experts, discrete(used - pool.nbytes // 2, 10**6), 64, 1, PlanOptions(tier_reads="copy")
    )
    assert tight.fits and min(tight.quotas) < 6
    assert not any(it.name == "prefill_graph_pool" for it in tight.items)
    cpu = profile(10**7, compute_capability=None, cuda_context=0)
    assert not any(it.name == "prefill_graph_pool" for it in plan(args, specs, experts, cpu, 64).items)
    # a pinned host tier holding every expert (read in place): every expert is reachable, so the
    # prefill graphs replay whatever the VRAM quota, and their pool comes before the slots
    E = args.num_experts
    far = plan(args, specs, experts, discrete(used, 8 * 10**6), 64, 1)
    assert far.fits and far.host_quotas == (E,) * 4 and far.prediction.far_reads_per_token >= 0
    assert any(it.name == "prefill_graph_pool" for it in far.items)
    assert sum(it.nbytes for it in far.items if it.pool == pool.pool) <= used


def test_layer_reads_in_waves_of_the_read_depth_after_the_router():
    """A layer's misses are read after its router, read_depth at a time, each wave at the rate that
    many reads in flight reach; a layer that reads pays the host's overhead once."""
    from dataclasses import replace

    from edgerun.budget.planner import layer_read_seconds
    from edgerun.config import device_profile_from_dict

    dev = device_profile_from_dict(
        {
            "name": "t",
            "memory_kind": "unified",
            "memory_cap": "8GiB",
            "os_reserve": "1GiB",
            "cuda_context": 0,
            "pinned_limit": "1GiB",
            "memory_bandwidth": "100GB/s",
            "storage_read_bandwidth": "2GB/s",
            "storage_read_single": "1GB/s",
            "read_depth": 4,
            "host_read_overhead": 0.001,
        }
    )
    block = 2_000_000
    # every expert missing: 1 read alone; 5 reads = a wave of 4 at the full rate, then 1 alone
    assert layer_read_seconds(1, 1.0, block, dev) == pytest.approx(block / 1e9 + 0.001)
    assert layer_read_seconds(5, 1.0, block, dev) == pytest.approx(4 * block / 2e9 + block / 1e9 + 0.001)
    # 2 in flight: between the single and the full rate (linear in the depth)
    assert layer_read_seconds(2, 1.0, block, dev) == pytest.approx(2 * block / (1e9 + 1e9 / 3) + 0.001)
    assert layer_read_seconds(8, 0.0, block, dev) == 0.0
    # one rate at every depth and no overhead: the expected bytes over the bandwidth (the storage bound)
    flat = replace(dev, storage_read_single=0.0, host_read_overhead=0.0)
    assert layer_read_seconds(8, 0.3, block, flat) == pytest.approx(8 * 0.3 * block / 2e9)


def test_each_layer_that_can_miss_pays_the_hosts_lookup_once_in_the_layered_prediction():
    """``host_layer_overhead``: the seconds a streamed layer's lookup costs the host even without a
    miss (the wait for its router's ids, the books, the return): once per layer that can miss,
    on top of its reads; the bound and the no-overlap figure do not see it."""
    from dataclasses import replace

    _, args, specs = tiny("qwen3_5_moe")
    experts = expert_source_from_layout(args, "int8")
    opts = PlanOptions(prefill_chunk=16, quota=4)
    dev = profile(542_380, host_layer_overhead=1e-3)  # a profile key (seconds)
    base, slow = (
        plan(args, specs, experts, d, 64, 1, opts).prediction
        for d in (replace(dev, host_layer_overhead=0.0), dev)
    )
    layers = sum(m > 0 for m in base.misses_per_layer)
    assert layers == len(args.moe_layers) == 4
    assert 1 / slow.tok_s_layered - 1 / base.tok_s_layered == pytest.approx(layers * 1e-3)
    assert (slow.tok_s, slow.tok_s_serial) == (base.tok_s, base.tok_s_serial)
    default = plan(args, specs, experts, profile(542_380), 64, 1, opts).prediction
    assert 1 / default.tok_s_layered - 1 / base.tok_s_layered == pytest.approx(layers * 2e-4)


# --------------------------------------------------------------------------------------------
# Decode prefetch in the prediction


def test_prefetch_seconds_takes_each_layer_the_longer_of_its_reads_and_its_unguessed_wait():
    """One layer, one distinct expert that always misses: the layer takes the longer of the
    disk's time for the miss and the wait for it when no guess read it (each half the time), then
    the host's gap; a wrong guess is read only in the time the disk has before the lookup drops it
    (the gap, and a wait longer than the read), so a disk that is behind reads none."""
    from dataclasses import replace

    from edgerun.budget.planner import prefetch_seconds, read_wait_seconds

    gap = 5e-4
    dev = replace(
        profile(10**7), storage_read_bandwidth=1e9, storage_read_single=5e8, read_depth=2,
        host_read_overhead=1e-3, host_layer_overhead=gap,
    )  # fmt: skip
    block = 1_000_000
    read, wait = block / 1e9, read_wait_seconds(1, block, dev)  # 1 ms on the disk; 3 ms after the router
    assert wait == pytest.approx(block / 5e8 + 1e-3)

    def step(useful: float, wasted: float, other: float = 0.0) -> float:
        return prefetch_seconds([1.0], [1.0], [block], [useful], [wasted], 1, dev, other)

    # guessed: the read's time; not guessed: the wait (longer); half each
    assert step(1.0, 0.0) == pytest.approx(read + gap)
    assert step(0.0, 0.0) == pytest.approx(wait + gap)
    assert step(0.5, 0.0, other=0.01) == pytest.approx(0.01 + 0.5 * (read + wait) + gap)
    # a wrong guess beside a guessed miss: read in the gap only (the rest cancelled)
    assert step(1.0, 1.0) == pytest.approx(read + gap + gap)
    assert step(1.0, 0.1) == pytest.approx(read + 0.1 * read + gap)
    # beside an unguessed miss whose wait is longer than the disk's read: read in that time, free
    assert step(0.0, 1.0) == pytest.approx(wait + gap)
    # a layer that never misses costs nothing, not even the gap
    assert prefetch_seconds([0.0], [1.0], [block], [0.0], [0.0], 1, dev, 0.0) == 0.0


def test_the_prediction_with_prefetch_uses_the_measured_prior_without_a_trace():
    """No trace: of each layer's misses GUESS_RECALL are read a layer early and GUESS_WASTE wrong
    guesses a miss are read beside them, no more than the prefetch buffers (staging - top_k) a
    layer; no buffers beyond top_k, or a host tier (its layers are not prefetched): none."""
    from edgerun.budget.planner import GUESS_RECALL, GUESS_WASTE

    _, args, specs = tiny("qwen3_5_moe")  # 4 MoE layers, 6 experts, top-2
    experts = expert_source_from_layout(args, "int8")
    dev = profile(10**7, memory_bandwidth=1e12)  # storage 1e5 B/s: the disk dominates
    pr = plan(args, specs, experts, dev, 64, 1, PlanOptions(prefill_chunk=16, quota=4)).prediction
    m = pr.misses_per_token
    assert m == pytest.approx(4 * 2 * (1 - 4 / 6))
    assert (pr.prefetch_useful_per_token, pr.prefetch_wasted_per_token) == (
        pytest.approx(GUESS_RECALL * m),
        pytest.approx(GUESS_WASTE * m),
    )
    assert "no route trace" in pr.guesses
    # a disk that is behind reads the misses, and the wrong guesses only in the host's gap (0.2 ms
    # a layer, the profile's default) before each lookup drops them: slower than the bound by
    # more than the gaps, less than every wrong guess read would make it
    gaps = 4 * 2e-4
    assert 1 / pr.storage_bound_tok_s + gaps < 1 / pr.tok_s_prefetch
    assert 1 / pr.tok_s_prefetch < (1 + GUESS_WASTE) / pr.storage_bound_tok_s + 2 * gaps
    # on a disk as fast for one read as for many, reads after the router lose only the host's
    # overheads; where a read alone is slow, guessing wins
    assert pr.tok_s_prefetch < pr.tok_s
    latent = profile(10**7, memory_bandwidth=1e12, storage_read_single=2e4, read_depth=4)
    lp = plan(args, specs, experts, latent, 64, 1, PlanOptions(prefill_chunk=16, quota=4)).prediction
    assert lp.tok_s_layered < lp.tok_s_prefetch < lp.tok_s
    # one buffer beyond top_k: a layer's 4/3 misses guess 1.21 x 4/3 reads, cut to 1
    one = plan(args, specs, experts, dev, 64, 1, PlanOptions(prefill_chunk=16, quota=2, staging_buffers=3))
    per_layer = 2 * (1 - 2 / 6)
    cut = 1 / (per_layer * (GUESS_RECALL + GUESS_WASTE))
    assert one.prediction.prefetch_useful_per_token == pytest.approx(4 * per_layer * GUESS_RECALL * cut)
    assert (
        one.prediction.prefetch_useful_per_token + one.prediction.prefetch_wasted_per_token
        == pytest.approx(4)
    )
    none = plan(args, specs, experts, dev, 64, 1, PlanOptions(prefill_chunk=16, quota=4, staging_buffers=2))
    assert (none.prediction.tok_s_prefetch, none.prediction.guesses) == (0.0, "")


def test_the_prediction_with_prefetch_replays_a_traces_guesses():
    """A trace with guesses: each layer's useful and wrong prefetches as the simulator replays
    them (the cache's own counts); a trace without: the prior, saying why."""
    from edgerun.tools.simulate import simulate

    _, args, specs = tiny("qwen3_moe")  # MoE layers 0 and 2, 6 experts, top-2
    experts = expert_source_from_layout(args, "int8")
    rng = random.Random(3)
    tokens = tuple(tuple(tuple(rng.sample(range(6), 2)) for _ in range(2)) for _ in range(40))
    # the guess for layer 2: right half the time, else two other experts
    guesses = tuple(
        (tok[1] if t % 2 else tuple(e for e in range(6) if e not in tok[1])[:2],)
        for t, tok in enumerate(tokens)
    )
    header = TraceHeader("tiny", "qwen3_moe", 3, (0, 2), 6, 2)
    trace = RouteTrace(header, tokens, "g.jsonl", predicted=guesses)
    opts = PlanOptions(prefill_chunk=16, quota=3, cache_policy="lfu")
    pr = plan(args, specs, experts, profile(10**7), 64, 1, opts, trace=trace).prediction
    sim = simulate(trace, {0: 3, 2: 3}, "lfu", prefetch_depth=2)
    assert pr.misses_per_token == pytest.approx(sim.misses_per_token)
    assert pr.prefetch_useful_per_token == pytest.approx(sim.prefetch_total("useful") / 40)
    assert pr.prefetch_wasted_per_token == pytest.approx(sim.prefetch_total("wasted") / 40)
    assert sim.prefetch_total("useful") > 0 and sim.prefetch_total("wasted") > 0
    assert "replayed" in pr.guesses
    bare = plan(
        args, specs, experts, profile(10**7), 64, 1, opts, trace=RouteTrace(header, tokens, "b.jsonl")
    )
    assert "no 'predicted' experts" in bare.prediction.guesses
    assert bare.prediction.prefetch_useful_per_token == pytest.approx(0.7 * bare.prediction.misses_per_token)


def test_binomial_probabilities_hold_at_large_counts():
    """The read models' Binomial(n, p) in floats: the exact values at small n, and a distribution
    (summing to 1) where (1 - p)^n alone would underflow."""
    import math

    from edgerun.budget.planner import binomial

    assert binomial(10, 0.2) == pytest.approx(
        [math.comb(10, k) * 0.2**k * 0.8 ** (10 - k) for k in range(11)]
    )
    far = binomial(400, 0.99)
    assert sum(far) == pytest.approx(1.0) and max(range(401), key=far.__getitem__) == 396
    assert binomial(3, 0.0) == [1.0, 0.0, 0.0, 0.0] and binomial(3, 1.0) == [0.0, 0.0, 0.0, 1.0]
