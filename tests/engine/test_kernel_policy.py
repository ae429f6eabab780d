"""The kernel policy: what a request resolves to on a device, with every fallback named; the
options that carry it (generate flags, serve keys) refuse bad values by name. CPU only; the
CUDA resolution (probes selecting Triton) is covered by tests/engine/test_graphs_cuda.py."""

from pathlib import Path

import pytest
import torch

from edgerun.bundle.reader import Bundle
from edgerun.cache.expert_cache import ExpertCache
from edgerun.cache.slots import QuotaError
from edgerun.config import CacheConfig
from edgerun.engine.policy import KernelPolicy, resolve
from edgerun.engine.setup import cache_config
from edgerun.errors import ConfigError
from edgerun.server.options import ServeOptions


def test_cpu_resolves_to_the_cpu_kernels_or_a_named_fallback_and_names_asked_for_triton(
    bundles, cpu_kernel_bundles
):
    layouts = list(dict.fromkeys(Bundle.open(cpu_kernel_bundles[("qwen3_moe", "int4")]).layouts.values()))
    auto = resolve(KernelPolicy(), torch.device("cpu"), layouts)
    assert auto.moe.impl == "cpu_grouped" and not auto.graphs and auto.dense == "torch"
    assert auto.fallbacks == {} and auto.describe().startswith("experts cpu_grouped[int4 g32] (matched")
    asked = resolve(KernelPolicy(experts="cpu_grouped"), torch.device("cpu"), layouts)
    assert asked.moe.impl == "cpu_grouped" and asked.fallbacks == {}
    assert asked.describe().startswith("experts cpu_grouped[int4 g32] (matched")
    cpu = resolve(KernelPolicy(experts="cpu"), torch.device("cpu"), layouts)
    assert cpu.moe.impl == "cpu" and cpu.describe().startswith("experts cpu_int4pack[int4 g32] (by request)")
    assert "graphs off (no CUDA graphs on cpu)" in auto.describe()
    assert resolve(KernelPolicy(experts="reference"), torch.device("cpu"), layouts).moe.impl == "reference"
    layouts = list(dict.fromkeys(Bundle.open(bundles[("qwen3_moe", "int4")]).layouts.values()))
    rotated = resolve(KernelPolicy(), torch.device("cpu"), layouts)  # int4 g16 hadamard: no CPU kernel
    assert rotated.moe.impl == "reference" and rotated.choices["experts"] == "reference"
    assert rotated.fallbacks["expert_kernel"].startswith("cpu_grouped[int4 g16] not selected: ")
    assert "; cpu_int4pack[int4 g16] not selected: " in rotated.fallbacks["expert_kernel"]
    both = resolve(KernelPolicy(experts="cpu_grouped"), torch.device("cpu"), layouts)
    assert both.moe.impl == "reference" and list(both.fallbacks) == ["expert_kernel"]
    assert both.fallbacks["expert_kernel"].startswith("cpu_grouped[int4 g16] not selected: ")
    assert "; cpu_int4pack[int4 g16] not selected: " in both.fallbacks["expert_kernel"]
    asked = resolve(
        KernelPolicy(experts="triton", dense="triton"), torch.device("cpu"), layouts, args=object()
    )
    assert asked.moe.impl == "reference"
    assert asked.fallbacks["expert_kernel"] == "triton asked for, but the device is cpu"
    assert asked.fallbacks["dense_kernel"] == "triton asked for, but the device is cpu"
    stacked = resolve(KernelPolicy(), torch.device("cpu"), [])
    assert stacked.choices["experts"] == "torch (stacked resident weights)"


@pytest.mark.parametrize(
    "field, value, message",
    [
        (
            "experts",
            "cutlass",
            "expert kernel 'cutlass' is not one of auto, reference, triton, cpu, cpu_grouped",
        ),
        ("graphs", "sometimes", "graphs 'sometimes' is not one of auto, on, off"),
        ("dense", "fast", "dense kernel 'fast' is not one of auto, torch, triton"),
        ("window_rows", "some", "window rows 'some' is not one of auto, shared, alone"),
        ("dense_act", "fp8", "dense activations 'fp8' are not one of bf16, int8"),
        ("expert_act", "fp8", "expert activations 'fp8' are not one of bf16, int8"),
    ],
)
def test_policy_refuses_unknown_values(field, value, message):
    with pytest.raises(ConfigError, match=message):
        KernelPolicy(**{field: value})


@pytest.mark.parametrize(
    "key, value, message",
    [
        (
            "expert_kernel",
            "cutlass",
            "'expert_kernel' must be one of auto, reference, triton, cpu, cpu_grouped",
        ),
        ("graphs", "yes", "'graphs' must be one of auto, on, off"),
        ("slot_pool", "vram", "'slot_pool' must be one of device, mapped"),
        ("cpu_experts", "yes", "'cpu_experts' must be one of auto, off, on"),
        ("read_depth", 0, "'read_depth' must be at least 1"),
        ("dense_act", "int4", "'dense_act' must be one of bf16, int8"),
        ("expert_act", "int4", "'expert_act' must be one of bf16, int8"),
    ],
)
def test_serve_options_refuse_bad_kernel_keys(key, value, message):
    with pytest.raises(ConfigError, match=message):
        ServeOptions(**{key: value})


def test_int8_activations_are_refused_where_the_triton_gemv_does_not_run(bundles):
    """--dense-act int8 asked for by name: refused with the torch dense kernel, on the CPU (both
    at the options and at resolution), never fallen back from to bf16 x unnamed."""
    from edgerun.engine.setup import runtime

    with pytest.raises(
        ConfigError, match="--dense-act int8 runs in the Triton GEMV: it does not combine with"
    ):
        KernelPolicy(dense="torch", dense_act="int8")
    with pytest.raises(
        ConfigError,
        match=r"--dense-act int8: int8 activations run in the Triton kernels on CUDA, and this runs on the cpu \(--device cpu\)",
    ):
        runtime("cpu", dense_act="int8")
    assert runtime("cpu").kernels.dense_act == "bf16"
    layouts = list(dict.fromkeys(Bundle.open(bundles[("qwen3_moe", "int4")]).layouts.values()))
    with pytest.raises(
        ConfigError,
        match="--dense-act int8 runs in the Triton GEMV on CUDA; the dense kernels here are torch",
    ):
        resolve(KernelPolicy(dense_act="int8"), torch.device("cpu"), layouts)


def test_int8_activations_go_to_the_int4_g32_projections_of_many_rows():
    """``int8_worth``: int4 in groups of 32 on qgemv's MANY tile (8,448 rows or more at 2,048
    columns) and running qgemv; not an int8 / plain / g64 weight, a FEW-tile one, one with a tile
    of its own, or one off the GEMV; ``Model.use_int8_activations`` sets and clears ``act``."""
    from types import SimpleNamespace

    from edgerun.kernels.qweight import QWeight
    from edgerun.models.layers import QLinear, int8_cases, int8_worth

    def lin(
        scheme, rows, cols=2048, group=32
    ):  # the stored tensors' shapes and dtypes; the values do not matter
        if scheme == "int8":
            w = QWeight(
                "int8",
                torch.zeros(rows, cols, dtype=torch.int8),
                torch.ones(rows, cols // group),
                group=group,
            )
        else:
            packed = torch.zeros(rows, cols // 2, dtype=torch.uint8)
            w = QWeight(
                "int4", packed, torch.zeros(rows, cols // group, dtype=torch.uint8), torch.ones(rows), group
            )
        m = QLinear(w)
        m.gemv = True
        return m

    big = lin("int4", 8448)
    assert int8_worth(big) and int8_worth(lin("int4", 12352))
    assert not int8_worth(lin("int4", 8432))  # 527 programs of 16 rows: the FEW tile
    assert not int8_worth(lin("int4", 8448, group=64)) and not int8_worth(lin("int8", 8448))
    off = lin("int4", 8448)
    off.gemv = False
    tiled = lin("int4", 8448)
    tiled.tile = SimpleNamespace()
    planes = lin("int4", 8448)
    planes.planes = object()  # on the batch's tensor-core GEMV
    assert not int8_worth(off) and not int8_worth(tiled) and not int8_worth(planes)
    assert big.qweight().act == "bf16"
    big.act = "int8"
    assert big.qweight().act == "int8"
    assert int8_cases([big], "unit") == [
        ("int4", 8448, 2048, 32, "none"),
        ("int4", 8448, 2048, 32, "none", "unit"),
    ]


CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_slot_pool_follows_the_profile(bundles):
    def pool(requested, profile):
        return cache_config(bundles[("qwen3_moe", "bf16")], quota=2, pool=requested, profile=profile)

    assert pool(None, None).pool is None and not pool(None, None).unified_memory  # CUDA: device slots
    assert pool(None, CONFIGS / "jetson_thor.yaml").unified_memory  # unified memory: mapped slots
    assert not pool(None, CONFIGS / "rtx5070.yaml").unified_memory  # discrete: VRAM slots
    assert pool("device", CONFIGS / "jetson_thor.yaml").pool == "device"  # asked for


def test_cpu_experts_reaches_the_cache_config_and_needs_streaming(bundles, tmp_path):
    from edgerun.cli import build_parser

    b = bundles[("qwen3_moe", "bf16")]
    assert cache_config(b, quota=2).cpu_experts == "off"  # the default, until measured on a GPU
    assert cache_config(b, quota=2, cpu_experts="auto").cpu_experts == "auto"
    with pytest.raises(ConfigError, match="--cpu-experts sets up expert streaming"):
        cache_config(b, cpu_experts="on")
    ns = build_parser().parse_args(["generate", "--model", str(b), "--quota", "2", "--cpu-experts", "on"])
    assert ns.cpu_experts == "on"


def test_cpu_experts_on_without_a_far_tier_is_refused_at_load(bundles):
    from edgerun.engine.streaming import load_streaming_model

    with pytest.raises(ConfigError, match="--cpu-experts on needs a far tier"):
        load_streaming_model(bundles[("qwen3_moe", "int4")], CacheConfig(2, cpu_experts="on"))


def test_a_mapped_pool_is_refused_on_the_cpu(bundles):
    with pytest.raises(QuotaError, match="slot pool 'mapped' does not serve device cpu"):
        ExpertCache(Bundle.open(bundles[("qwen3_moe", "bf16")]), CacheConfig(2, pool="mapped"))


def test_resident_experts_held_as_bf16_blocks_keep_their_bits_and_logits(hf_checkpoints):
    """A CUDA runner holds a checkpoint's resident bf16 experts (and its MTP head's) as bf16
    expert blocks so they run the expert cache's Triton kernels (``Runner.set_kernels``): each
    block holds the stacked weights' own bits, and the reference kernel over the blocks gives the
    stacked forward's logits, torch.equal (here on the CPU, where a runner keeps them stacked:
    ``resident_layout`` is None on a CPU and for experts in another dtype)."""
    from edgerun.bundle.layout import expert_block_layout
    from edgerun.engine.streaming import REFERENCE, HeldExperts, hold_resident_experts, resident_layout
    from edgerun.models.checkpoint import load_model
    from edgerun.models.layers import SparseMoe

    for arch, (_, ckpt) in hf_checkpoints.items():
        model, args, _ = load_model(ckpt, dtype=torch.bfloat16)
        assert resident_layout(model, args, torch.device("cpu")) is None
        tokens = torch.arange(3, 20)[None]
        moe = [x.mlp for x in model.model.layers if isinstance(x.mlp, SparseMoe)]
        stacked = [
            (m.experts.gate_up_proj.detach().clone(), m.experts.down_proj.detach().clone()) for m in moe
        ]
        with torch.inference_mode():
            want = model(tokens)
        layout = expert_block_layout(args, "bf16")
        n = hold_resident_experts(model, layout, REFERENCE, torch.device("cpu"))
        assert all(isinstance(m.experts, HeldExperts) for m in moe)
        assert (
            n == sum(m.experts.pool.nbytes for m in moe) == len(moe) * args.num_experts * layout.block_bytes
        )
        for m, (gate_up, down) in zip(moe, stacked):
            for name, w in (("gate_up.weight", gate_up), ("down.weight", down)):
                c = layout.component(name)
                got = m.experts.pool[:, c.offset : c.offset + c.nbytes].view(torch.bfloat16)
                assert torch.equal(got.reshape(w.shape), w), (arch, name)
        with torch.inference_mode():
            assert torch.equal(model(tokens), want), arch
        assert hold_resident_experts(model, layout, REFERENCE, torch.device("cpu")) == n  # once
        fp32, args32, _ = load_model(ckpt, dtype=torch.float32)
        assert resident_layout(fp32, args32, torch.device("cuda")) is None  # would round to bf16


@pytest.mark.parametrize("selected", [True, False])
def test_set_kernels_holds_resident_experts_only_where_the_expert_kernel_is_selected(monkeypatch, selected):
    """``Runner.set_kernels`` on a device whose resident experts can be held (``resident_layout``:
    CUDA, bf16; stood in for here on the CPU) probes the expert kernel on the bf16 layout and holds
    every expert as blocks, the MTP head's too, where it is selected (the load line says the bytes);
    where its probe refuses, the experts stay stacked, run by torch's products, the fallback named."""
    from edgerun.bundle.layout import expert_block_layout
    from edgerun.engine import runner as R
    from edgerun.engine.policy import Resolved
    from edgerun.engine.speculative import SpeculativeConfig
    from edgerun.engine.streaming import HeldExperts
    from edgerun.kernels.moe import MoeKernelPolicy
    from edgerun.models.layers import Experts

    runner = R.Runner.load(None, device="cpu", dtype=torch.bfloat16, speculative=SpeculativeConfig("mtp", 1))
    layout = expert_block_layout(runner.args, "bf16")
    probed = []

    def resolve(request, device, layouts, *a, **kw):
        probed.append(layouts)
        if selected:
            return Resolved(MoeKernelPolicy("triton"), graphs=False, choices={"experts": "moe_triton[bf16]"})
        why = {"expert_kernel": "moe_triton[bf16] not selected: refused"}
        return Resolved(MoeKernelPolicy(), graphs=False, choices={"experts": "reference"}, fallbacks=why)

    monkeypatch.setattr(R, "resident_layout", lambda model, args, device: layout)
    monkeypatch.setattr(R, "resolve", resolve)
    monkeypatch.setattr(type(runner.model), "use_kernels", lambda *a: None)
    runner.set_kernels(KernelPolicy())
    assert probed == [[layout]]
    experts = [m.experts for m in runner.model.modules() if hasattr(m, "experts") and hasattr(m, "gate")]
    assert len(experts) == len(runner.args.moe_layers) + 1  # the MTP head's too
    kind = HeldExperts if selected else Experts
    assert all(type(e) is kind for e in experts)
    if selected:
        assert "routed experts held as bf16 blocks for the expert kernels" in runner.load_summary
        assert all(e.policy.impl == "triton" for e in experts)
    else:
        assert runner.kernels.choices["experts"] == "torch (stacked resident weights)"
        assert "expert_kernel" in runner.fallbacks()


def test_int8_expert_activations_are_refused_where_the_triton_expert_kernel_does_not_run(bundles):
    """--expert-act int8 asked for by name: refused with another expert kernel, on the CPU (at the
    options and at resolution), and by the policy the kernels take; never fallen back from."""
    from edgerun.engine.setup import runtime
    from edgerun.kernels.moe import MoeKernelPolicy

    with pytest.raises(
        ConfigError, match="--expert-act int8 runs in the Triton expert kernel: it does not combine"
    ):
        KernelPolicy(experts="reference", expert_act="int8")
    with pytest.raises(
        ConfigError,
        match=r"--expert-act int8: int8 activations run in the Triton kernels on CUDA, and this runs on the cpu \(--device cpu\)",
    ):
        runtime("cpu", expert_act="int8")
    assert runtime("cpu").kernels.expert_act == "bf16"
    with pytest.raises(ConfigError, match="int8 expert activations run in the Triton expert kernel, not cpu"):
        MoeKernelPolicy("cpu", act="int8")
    layouts = list(dict.fromkeys(Bundle.open(bundles[("qwen3_moe", "int4")]).layouts.values()))
    with pytest.raises(
        ConfigError, match="--expert-act int8 runs in the Triton expert kernel on CUDA; the experts here run"
    ):
        resolve(KernelPolicy(expert_act="int8"), torch.device("cpu"), layouts)
