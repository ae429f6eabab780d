"""Loading a model from a bundle: bf16 bundles give the checkpoint's logits exactly; quantized
bundles give exactly the logits of the source model run with the dequantized weights."""

import os

import pytest
import torch

from edgerun.bundle import format as F
from edgerun.bundle import reader as R
from edgerun.bundle.layout import expert_block_layout
from edgerun.bundle.quant import dequantize_block, quantize_expert
from edgerun.bundle.reader import Bundle, BundleError, load_bundle_model
from edgerun.models.checkpoint import load_model
from hf_fixtures import ARCHS

TOKENS = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(7))


def _logits(model):
    with torch.no_grad():
        return model(TOKENS)


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_bundle_logits_equal_checkpoint(sources, bundles, arch):
    src = sources[f"{arch}/bf16"]
    ref, _, _ = load_model(src)
    got, args, report = load_bundle_model(bundles(f"{arch}/bf16", "bf16"))
    assert got.model.embed_tokens.weight.dtype == torch.bfloat16
    for name, p in ref.named_parameters():
        assert torch.equal(p, got.get_parameter(name)), name
    assert torch.equal(_logits(ref), _logits(got))
    assert report.expert_layout == "bundle bf16, dense bf16"


def _dequantized_reference(src, args, quant, group, rotate):
    """The source model (fp32) with every expert replaced by quantize -> dequantize, computed in
    memory from the checkpoint, not from the bundle."""
    model, _, _ = load_model(src, dtype=torch.float32)
    lay = expert_block_layout(args, quant, group, "hadamard" if rotate else "none")
    for layer in args.moe_layers:
        ex = model.model.layers[layer].mlp.experts
        for e in range(args.num_experts):
            block, gscales = quantize_expert(lay, ex.gate_up_proj[e], ex.down_proj[e])
            gu, dn = dequantize_block(lay, block, gscales, torch.float32)
            ex.gate_up_proj.data[e], ex.down_proj.data[e] = gu, dn
    return model


@pytest.mark.parametrize(
    "arch,quant,group,rotate",
    [
        ("qwen3_moe", "bf16", None, False),  # fp32 source: experts rounded to bf16
        ("qwen3_moe", "int8", 0, False),
        ("qwen3_5_moe", "int8", 16, True),
        ("qwen3_moe", "int4", 32, True),
        ("qwen3_5_moe", "int4", 16, False),
    ],
)
def test_quantized_bundle_logits_equal_dequantized_model(sources, bundles, arch, quant, group, rotate):
    path = bundles(arch, quant, group, rotate)
    got, args, _ = load_bundle_model(path, dtype=torch.float32)
    ref = _dequantized_reference(sources[arch], args, quant, group, rotate)
    assert torch.equal(_logits(ref), _logits(got))
    # and the quantization is a small perturbation of the source model
    src, _, _ = load_model(sources[arch])
    a, b = _logits(src), _logits(got)
    assert (a - b).norm() / a.norm() < (0.1 if quant != "int4" else 0.8)


def test_read_block_is_one_aligned_read(bundles):
    path = bundles("qwen3_5_moe", "int4", 16)
    b = Bundle.open(path)
    layer = b.args.moe_layers[-1]
    lay = b.layouts[layer]
    data = b.expert_path(layer).read_bytes()
    for e in (0, 3, b.args.num_experts - 1):
        off = b.block_offset(layer, e)
        assert off == e * lay.block_bytes and off % 4096 == 0
        assert bytes(b.read_block(layer, e).numpy()) == data[off : off + lay.block_bytes]
    with pytest.raises(IndexError, match="expert 6 is out of range"):
        b.block_offset(layer, b.args.num_experts)
    model, _, _ = load_bundle_model(path, dtype=torch.float32)
    gu, dn = b.expert(layer, 3, torch.float32)
    assert torch.equal(gu, model.model.layers[layer].mlp.experts.gate_up_proj[3])
    assert torch.equal(dn, model.model.layers[layer].mlp.experts.down_proj[3])


def test_experts_false_leaves_experts_on_meta(bundles):
    model, args, _ = load_bundle_model(bundles("qwen3_moe", "int8"), experts=False)
    ex = model.model.layers[args.moe_layers[0]].mlp.experts
    assert ex.gate_up_proj.is_meta and ex.down_proj.is_meta
    assert not model.model.embed_tokens.weight.is_meta


def test_a_broken_bundle_is_refused_before_any_allocation(bundle_copy, monkeypatch):
    path = bundle_copy("qwen3_moe", "int4", 16)
    f = path / "experts" / "L02.bin"
    os.truncate(f, f.stat().st_size - 1)

    def allocate(*a, **k):
        raise AssertionError("the model was built before the bundle was validated")

    monkeypatch.setattr(R, "load_entries", allocate)
    with pytest.raises(BundleError, match="truncated expert file"):
        load_bundle_model(path)


def test_block_checksums_are_recorded_and_checked_by_shape(bundle_copy):
    import json

    path = bundle_copy("qwen3_moe", "int8")
    b = Bundle.open(path)
    assert b.unchecked is None
    rec = b.manifest.layers[0]
    block = b.expert_path(rec.layer).read_bytes()[: rec.block_bytes]
    assert b.check_block(rec.layer, 0, block) and rec.block_xxh3[0] == F.block_checksum(block)
    doc = json.loads((path / F.MANIFEST).read_text())
    doc["layers"][0]["block_xxh3"] = doc["layers"][0]["block_xxh3"][:-1]
    doc[F.MANIFEST_HASH] = F.manifest_fingerprint(doc)  # an edit that keeps the manifest's own hash
    (path / F.MANIFEST).write_text(json.dumps(doc))
    with pytest.raises(
        BundleError, match=rf"key 'layers\[layer {rec.layer}\].block_xxh3' must hold 6 checksums"
    ):
        Bundle.open(path)
    for r in doc["layers"]:  # an older bundle: no checksums, read unchecked and said so
        del r["block_xxh3"]
    del doc[F.MANIFEST_HASH]  # nor a hash of its own
    (path / F.MANIFEST).write_text(json.dumps(doc))
    old = Bundle.open(path)
    assert "has no block_xxh3 for 2 of 2 MoE layers" in old.unchecked
    assert not old.check_block(rec.layer, 0, bytes(rec.block_bytes))
