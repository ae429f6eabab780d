"""The CPU expert kernels in the engine (the grouped C kernel, ``cpu_grouped``, which ``auto``
selects on a CPU where its probe passes and says so; torch's, ``cpu``, by request or in its
place, named): they decode the same greedy tokens as the reference on tiny checkpoints, streamed as resident,
with the same misses; a bundle they cannot run falls back to the reference, named and counted.

torch's kernels are not bit-exact (bf16 activations, ~0.5% of a layer's output; the grouped
kernel's fp32 ~1e-6), and a random tiny
model has near-tied router scores: a 0.5% change in a layer's input can swap a token's expert and
then its next token. 16 greedy tokens agree on every case here; at 24, qwen3_5_moe int8 differs
in its last token for that reason (tokens 1-23 equal), so the claim tested is 16."""

from pathlib import Path

import pytest

from edgerun.config import CacheConfig
from edgerun.engine.policy import KernelPolicy
from edgerun.engine.runner import Runner
from edgerun.engine.sampler import SamplingParams
from hf_fixtures import ARCHS

PROMPT = list(range(3, 20))
GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)


NAMES = {
    ("cpu", "int4"): "cpu_int4pack[int4 g32]",
    ("cpu", "int8"): "cpu_int8pack[int8]",
    ("cpu_grouped", "int4"): "cpu_grouped[int4 g32]",
    ("cpu_grouped", "int8"): "cpu_grouped[int8]",
}


@pytest.mark.parametrize("kernel", ["cpu", "cpu_grouped"])
@pytest.mark.parametrize("quant", ["int4", "int8"])
@pytest.mark.parametrize("arch", ARCHS)
def test_cpu_kernels_decode_the_references_tokens_streamed_and_resident(
    cpu_kernel_bundles, arch, quant, kernel
):
    """torch's kernels (``cpu``) and the grouped C kernel (``cpu_grouped``)."""
    bundle = cpu_kernel_bundles[(arch, quant)]
    runs = {}
    for experts in ("reference", kernel):
        for quota in (64, 2):  # every expert held; top_k, so most steps miss and refill slots
            r = Runner.load(
                bundle, device="cpu", cache=CacheConfig(quota), kernels=KernelPolicy(experts=experts)
            )
            if experts == kernel:
                assert r.kernels.moe.impl == kernel and r.fallbacks() == {}
                assert r.kernel_summary().startswith(f"experts {NAMES[(kernel, quant)]}")
                assert "matched the reference" in r.kernel_summary()
            runs[(experts, quota)] = (r.generate_ids(PROMPT, GREEDY), r.cache.totals().misses)
        # lfu-bypass: misses left unheld are read into spill rows, which the kernel reads as slots Q..
        r = Runner.load(
            bundle,
            device="cpu",
            cache=CacheConfig(3, policy="lfu-bypass"),
            kernels=KernelPolicy(experts=experts),
        )
        runs[(experts, "bypass")] = (r.generate_ids(PROMPT, GREEDY), r.cache.totals().misses)
        assert r.cache.totals().passed > 0
    tokens = {k: t for k, (t, _) in runs.items()}
    assert tokens[(kernel, 64)] == tokens[("reference", 64)]  # greedy unchanged by the kernel
    assert tokens[(kernel, 2)] == tokens[(kernel, 64)]  # streamed == resident
    assert tokens[(kernel, "bypass")] == tokens[(kernel, 64)]
    assert runs[(kernel, 2)][1] == runs[("reference", 2)][1] > 0  # misses counted the same
    assert runs[(kernel, "bypass")][1] == runs[("reference", "bypass")][1]


def test_the_grouped_kernel_keeps_no_packed_copy(cpu_kernel_bundles):
    bundle = cpu_kernel_bundles[(ARCHS[0], "int4")]
    r = Runner.load(bundle, device="cpu", cache=CacheConfig(64), kernels=KernelPolicy(experts="cpu_grouped"))
    assert r.kernels.moe.impl == "cpu_grouped" and r.fallbacks() == {}
    r.generate_ids(PROMPT, SamplingParams(max_tokens=3, ignore_eos=True))
    assert all(not r.cache.packed[layer] for layer in r.args.moe_layers)


def test_a_bundle_the_cpu_kernels_cannot_run_falls_back_named_and_counted(bundles):
    runner = Runner.load(bundles[("qwen3_moe", "int4")], device="cpu", cache=CacheConfig(4), prefill_chunk=8)
    assert runner.kernels.moe.impl == "reference"
    assert runner.fallbacks() == {
        "expert_kernel": "cpu_grouped[int4 g16] not selected: the grouped CPU kernel takes unrotated "
        "blocks, this bundle's are hadamard-rotated; cpu_int4pack[int4 g16] not selected: the CPU "
        "kernels take unrotated blocks, this bundle's are hadamard-rotated"
    }
    runner.generate_ids(PROMPT, SamplingParams(max_tokens=5, ignore_eos=True))
    assert runner.fallback_counts() == {"expert_kernel": 7}  # 3 prefill chunks, 4 decode steps


def test_layers_holding_every_expert_are_repacked_at_load(cpu_kernel_bundles):
    """torch's kernels: every slot of a complete layer in the CPU layout before the first request
    (not on each expert's first use, inside a prompt's prefill); a streamed layer packs as it fills."""
    bundle = cpu_kernel_bundles[(ARCHS[0], "int4")]
    cpu = KernelPolicy(experts="cpu")
    held = Runner.load(bundle, device="cpu", cache=CacheConfig(64), kernels=cpu)
    E = held.args.num_experts
    assert all(len(held.cache.packed[layer]) == E for layer in held.args.moe_layers)
    streamed = Runner.load(bundle, device="cpu", cache=CacheConfig(2), kernels=cpu)
    assert all(not streamed.cache.packed[layer] for layer in streamed.args.moe_layers)
    assert held.generate_ids(PROMPT, GREEDY) == streamed.generate_ids(PROMPT, GREEDY)


def test_auto_on_a_cpu_runs_the_grouped_kernel_and_says_so(cpu_kernel_bundles):
    r = Runner.load(cpu_kernel_bundles[(ARCHS[0], "int4")], device="cpu", cache=CacheConfig(64))
    assert r.kernels.moe.impl == "cpu_grouped" and r.fallbacks() == {}
    assert r.kernel_summary().startswith("experts cpu_grouped[int4 g32] (matched the reference")
    assert all(not r.cache.packed[layer] for layer in r.args.moe_layers)  # no repacked copy


@pytest.mark.parametrize("asked", ["auto", "cpu_grouped"])
def test_no_compiler_runs_torchs_kernels_named_and_counted(cpu_kernel_bundles, monkeypatch, asked):
    from edgerun.kernels import moe_cpu_grouped

    monkeypatch.setattr(moe_cpu_grouped, "compiler", lambda: None)
    moe_cpu_grouped.library.cache_clear()
    try:
        r = Runner.load(
            cpu_kernel_bundles[(ARCHS[0], "int4")],
            device="cpu",
            cache=CacheConfig(64),
            prefill_chunk=8,
            kernels=KernelPolicy(experts=asked),
        )
    finally:
        moe_cpu_grouped.library.cache_clear()
    assert r.kernels.moe.impl == "cpu"
    assert r.kernel_summary().startswith("experts cpu_int4pack[int4 g32] (matched")
    assert r.fallbacks() == {
        "expert_kernel_grouped": "cpu_grouped[int4 g32] not selected: BuildError: no C compiler found "
        "(sysconfig CC, cc, gcc): the grouped CPU kernel is built at first use"
    }
    r.generate_ids(PROMPT, SamplingParams(max_tokens=5, ignore_eos=True))
    assert r.fallback_counts() == {"expert_kernel_grouped": 7}  # 3 prefill chunks, 4 decode steps


def test_a_cpu_plan_counts_the_repacked_copy_only_where_torchs_kernels_run(cpu_kernel_bundles, monkeypatch):
    """The engine re-plans after loading for the kernel that will run: torch's kernels' repacked
    copy of each int4 slot is in the expert budget for ``cpu``, and for ``auto`` only where the
    grouped kernel's probe refuses (then torch's kernels run)."""
    from edgerun.engine import setup
    from edgerun.kernels import moe_cpu_grouped

    bundle = cpu_kernel_bundles[(ARCHS[0], "int4")]
    profile = Path(__file__).parents[2] / "configs" / "cpu.yaml"
    real, seen = setup.replan, []

    def replan(*args, **kw):
        config = real(*args, **kw)
        seen.append((args[-1], config.budget))  # (the kernel counted, the expert cache budget)
        return config

    monkeypatch.setattr(setup, "replan", replan)
    runs = {}
    for name, experts, compiler in (
        ("cpu", "cpu", True),
        ("auto", "auto", True),
        ("refused", "auto", False),
    ):
        if not compiler:
            monkeypatch.setattr(moe_cpu_grouped, "compiler", lambda: None)
        moe_cpu_grouped.library.cache_clear()
        try:
            config = setup.cache_config(bundle, profile=profile)
            runs[name] = Runner.load(
                bundle, device="cpu", cache=config, kernels=KernelPolicy(experts=experts)
            )
        finally:
            moe_cpu_grouped.library.cache_clear()
    kernels = {name: r.kernels.moe.impl for name, r in runs.items()}
    assert kernels == {"cpu": "cpu", "auto": "cpu_grouped", "refused": "cpu"}
    assert [k for k, _ in seen] == ["cpu", "cpu_grouped", "cpu"]
    budget = dict(zip(runs, (b for _, b in seen)))
    packed = runs["cpu"].cache.packed_bytes()
    assert packed > 0 and budget["cpu"] - budget["auto"] == packed and budget["refused"] == budget["cpu"]
