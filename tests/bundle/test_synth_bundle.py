"""Synthetic bundles (edgerun.tools.synth_bundle): valid and loadable, laid out exactly as convert
lays out a checkpoint of the same config, blocks that are the quantizer's fixed points, a router
that spreads tokens, the same bytes whatever the thread count."""

import json
import math

import pytest
import torch

from edgerun.bundle import format as F
from edgerun.bundle.convert import plan_conversion
from edgerun.bundle.layout import expert_block_layout
from edgerun.bundle.quant import dequantize_block, quantize_expert
from edgerun.bundle.reader import Bundle, load_bundle_model
from edgerun.bundle.verify import verify_bundle
from edgerun.errors import ConfigError
from edgerun.kernels.moe_reference import expert_ffn
from edgerun.models.registry import load_args
from edgerun.tools import synth_bundle as S

ARCHS = ("qwen3_moe", "qwen3_5_moe")


@pytest.fixture(scope="module")
def synthesized(tmp_path_factory):
    """synthesized(arch, rotation="none") -> a tiny int4 bundle, written once per module."""
    made = {}

    def get(arch: str, rotation: str = "none"):
        if (arch, rotation) not in made:
            out = tmp_path_factory.mktemp("synth") / f"{arch}-{rotation}"
            made[arch, rotation] = S.synth_bundle(out, S.tiny_config(arch), rotation=rotation, threads=2)
        return made[arch, rotation]

    return get


@pytest.mark.parametrize("rotation", ["none", "hadamard"])
@pytest.mark.parametrize("arch", ARCHS)
def test_opens_verifies_and_gives_finite_logits(synthesized, arch, rotation):
    root = synthesized(arch, rotation)
    b = Bundle.open(root)
    m = b.manifest
    assert (m.quant.scheme, m.quant.group_size, m.quant.rotation) == ("int4", 32, rotation)
    assert m.quant.rel_rmse == 0.0 and m.source["synthetic"]["weights"].startswith("random")
    assert verify_bundle(root, deep=True).bytes_hashed == sum(f.bytes for f in m.files.values())
    assert not (root / ".convert-journal.json").exists() and not list(root.rglob("*.tmp"))

    model, args, _ = load_bundle_model(root, dtype=torch.float32)
    tokens = torch.randint(0, args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    logits = model(tokens)
    assert torch.isfinite(logits).all()
    assert 0.1 < logits.std().item() < 10


def _layout_fields(m: F.Manifest) -> dict:
    """The manifest less what depends on the weights or the source: hashes, errors, ``source``."""
    doc = m.to_json()
    del doc["source"], doc["quant"]["rel_rmse"]
    doc["dense"]["tensors"] = list(doc["dense"]["tensors"])  # names, in file order
    for rec in doc["layers"]:
        del rec["block_blake2b"], rec["block_xxh3"], rec["rel_rmse"]
    doc["files"] = {name: f["bytes"] for name, f in doc["files"].items()}
    return doc


@pytest.mark.parametrize("group,rotate", [(None, False), (16, True)])
@pytest.mark.parametrize("arch", ARCHS)
def test_manifest_is_what_convert_writes(sources, bundles, tmp_path, arch, group, rotate):
    src = sources[f"{arch}/bf16"]
    converted = F.read_manifest(bundles(f"{arch}/bf16", "int4", group, rotate))
    config = json.loads((src / "config.json").read_text())
    rotation = "hadamard" if rotate else "none"
    out = S.synth_bundle(tmp_path / "b", config, "int4", group, rotation, tokenizer_from=src, threads=2)
    synthetic = F.read_manifest(out)
    assert _layout_fields(synthetic) == _layout_fields(converted)
    assert synthetic.inventory == converted.inventory  # names, dtypes, shapes of dense.safetensors
    for name in synthetic.tokenizer_files:
        assert synthetic.files[name] == converted.files[name]


@pytest.mark.parametrize(
    "quant,group,rotation",
    [
        ("int4", 32, "none"),
        ("int4", 16, "hadamard"),
        ("int8", 0, "none"),
        ("int8", 16, "none"),
        ("bf16", 0, "none"),
    ],
)
def test_blocks_are_the_quantizers_fixed_points(quant, group, rotation):
    """quantize_expert of a block's dequantized weights returns the block and its global scales
    bit for bit: every value (and the zero padding) is one the quantizer writes."""
    args = load_args(S.tiny_config("qwen3_moe"))[1]
    layout = expert_block_layout(args, quant, group, rotation)
    x = torch.randn(64, args.hidden_size, generator=torch.Generator().manual_seed(1))
    for e in range(4):
        block, gscales = S.random_block(layout, S.part_rng(0, S.EXPERT_PART, 0, e))
        raw = torch.from_numpy(block)
        gs = None if gscales is None else torch.from_numpy(gscales)
        gate_up, down = dequantize_block(layout, raw, gs, torch.float32)
        again, gs_again = quantize_expert(layout, gate_up, down)
        assert torch.equal(again, raw)
        if gs is not None:
            assert torch.equal(gs_again, gs)
            assert all(math.frexp(v)[0] == 0.5 for v in gs.tolist())  # powers of two
        y = expert_ffn(x, gate_up, down)
        assert 0.05 < y.std().item() < 5  # O(1) out for O(1) in


def test_int8_with_rotation_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="int8 blocks cannot be rotated"):
        S.synth_bundle(tmp_path / "b", S.tiny_config("qwen3_moe"), "int8", 16, "hadamard")
    assert not (tmp_path / "b").exists()


def test_router_spreads_tokens_over_experts(synthesized):
    model, args, _ = load_bundle_model(synthesized("qwen3_5_moe"), dtype=torch.float32)
    ids: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(model.model.layers):
        layer.mlp.gate.register_forward_hook(lambda mod, inp, out, i=i: ids.__setitem__(i, out[1]))
    T = 300
    model(torch.randint(0, args.vocab_size, (1, T), generator=torch.Generator().manual_seed(2)))
    for i, chosen in ids.items():
        counts = torch.bincount(chosen.flatten(), minlength=args.num_experts)
        assert (counts > 0).sum().item() >= 0.75 * args.num_experts, (i, counts.tolist())
        assert counts.max().item() < 0.5 * T, (i, counts.tolist())  # no expert takes most tokens


def test_same_bytes_whatever_the_thread_count(synthesized, tmp_path):
    two = F.read_manifest(synthesized("qwen3_moe"))
    one = F.read_manifest(S.synth_bundle(tmp_path / "one", S.tiny_config("qwen3_moe"), threads=1))
    assert one.files == two.files
    other = F.read_manifest(S.synth_bundle(tmp_path / "seed1", S.tiny_config("qwen3_moe"), seed=1))
    assert other.files[F.expert_file(0)] != two.files[F.expert_file(0)]


def test_refuses_without_space_before_writing(tmp_path, monkeypatch):
    class Usage:
        free = 10_000

    monkeypatch.setattr(S.shutil, "disk_usage", lambda p: Usage)
    with pytest.raises(F.BundleError, match=r"the bundle needs [\d,]+ more bytes .* has 10,000 bytes free"):
        S.synth_bundle(tmp_path / "b", S.tiny_config("qwen3_moe"))
    assert not (tmp_path / "b").exists()


def test_rerun_keeps_the_bundle_and_other_directories_are_refused(synthesized, tmp_path):
    root = synthesized("qwen3_moe")
    before = (root / F.expert_file(0)).stat().st_mtime_ns
    S.synth_bundle(root, S.tiny_config("qwen3_moe"), threads=2)
    assert (root / F.expert_file(0)).stat().st_mtime_ns == before
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(F.BundleError, match="not empty"):
        S.synth_bundle(tmp_path / "busy", S.tiny_config("qwen3_moe"))


def test_interrupted_run_resumes_to_the_same_bundle(synthesized, tmp_path, monkeypatch):
    whole = F.read_manifest(synthesized("qwen3_5_moe"))
    write_layer = S._write_layer

    def fail_on_layer_2(plan, dst, layer, seed):
        if layer == 2:
            raise OSError("disk went away")
        return write_layer(plan, dst, layer, seed)

    monkeypatch.setattr(S, "_write_layer", fail_on_layer_2)
    with pytest.raises(OSError, match="disk went away"):
        S.synth_bundle(tmp_path / "b", S.tiny_config("qwen3_5_moe"), threads=2)
    assert not (tmp_path / "b" / F.MANIFEST).exists()
    monkeypatch.setattr(S, "_write_layer", write_layer)
    resumed = F.read_manifest(S.synth_bundle(tmp_path / "b", S.tiny_config("qwen3_5_moe"), threads=2))
    assert resumed.to_json() == whole.to_json()


def test_real_geometry_plan_without_writing(tmp_path):
    config = S.qwen36_config()
    args = load_args(config)[1]
    assert (args.model_type, args.num_hidden_layers, args.num_experts, args.num_experts_per_tok) == (
        "qwen3_5_moe", 40, 256, 8,
    )  # fmt: skip
    assert args.layer_types == ("linear_attention",) * 3 + ("full_attention",) + args.layer_types[4:]
    assert args.full_attention_layers == tuple(range(3, 40, 4))
    assert (args.hidden_size, args.moe_intermediate_size, args.shared_expert_intermediate_size) == (
        2048,
        512,
        512,
    )
    assert (args.vocab_size, args.head_dim, args.rotary_dim, args.rope_theta) == (248320, 256, 64, 1e7)
    S._sparse_checkpoint(tmp_path / "ckpt", config, None)
    plan = plan_conversion(tmp_path / "ckpt", S.ConvertOptions("int4"))
    plan.check()
    assert plan.layout.block_bytes == 1_671_168  # docs/bundle-format.md
    sizes = plan.sizes_by_category()
    assert sizes["experts"] == 40 * 256 * 1_671_168
    assert 4.8e9 < sum(r.nbytes for r in plan.resident) < 5.0e9
    assert (tmp_path / "ckpt" / "model.safetensors").stat().st_blocks * 512 < 1 << 20  # a hole

    two = S.with_layers(config, 2)
    assert load_args(two)[1].layer_types == ("linear_attention",) * 2


def test_cli_prints_what_it_wrote(tmp_path, capsys):
    assert S.main([str(tmp_path / "b"), "--geometry", "tiny", "--threads", "2"]) == 0
    out = capsys.readouterr().out
    m = F.read_manifest(tmp_path / "b")
    assert f"bytes {sum(f.bytes for f in m.files.values())} " in out
    assert f"block_bytes {m.layers[0].block_bytes}" in out and "seconds " in out and "random weights" in out
    assert S.main([str(tmp_path / "c"), "--geometry", "tiny", "--layers", "9"]) == 1
    assert "layers must be in 1..4" in capsys.readouterr().err
