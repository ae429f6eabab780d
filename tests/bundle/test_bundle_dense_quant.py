"""Bundle format v2: resident linear weights quantized (`convert --dense int8|int4`, `--lm-head`):
the stored bytes are the quantizer's and dequantize to within its error of the source, the
reader's `Bundle.dense_quant` says where each part is, dry-run sizes are the written sizes, hashes
and value checks cover the new tensors, v1 bundles still open, and damage is refused by name."""

import json
import math
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file

from edgerun.bundle import convert as C
from edgerun.bundle import dense_layout as DL
from edgerun.bundle import format as F
from edgerun.bundle.cli import main
from edgerun.bundle.convert import ConvertOptions, convert, plan_conversion
from edgerun.bundle.quant import dequantize_int4, dequantize_int8, e4m3_value, quantize_int4, quantize_int8
from edgerun.bundle.reader import Bundle, BundleError, load_bundle_model
from edgerun.bundle.verify import verify_bundle
from edgerun.errors import ConfigError
from edgerun.models.checkpoint import MappedFiles, canonical_name
from edgerun.safetensors_io import read_header
from edgerun.tools import synth_bundle as S

# The bundle fixtures' dims, with every linear weight's width a multiple of 32 (the default
# fixtures' shared expert (40) and DeltaNet value width (48) take int4 g16 or int8 only).
DIMS = dict(hidden_size=64, moe_intermediate_size=32)
WIDE = {
    "qwen3_5_moe": dict(shared_expert_intermediate_size=32, linear_value_head_dim=16),
    "qwen3_moe": dict(intermediate_size=64),
}


@pytest.fixture(scope="session")
def dense_sources(sources, tmp_path_factory):
    """{"qwen3_5_moe", "qwen3_moe", "qwen3_5_moe/tied"} -> fp32 checkpoints (with the bundle
    fixtures' tokenizer files)."""
    from hf_fixtures import build_hf

    tokenizer = [p for p in sources["qwen3_moe"].iterdir() if p.name.startswith(("tokenizer", "chat_"))]
    out = {}
    for key, arch, extra in (
        ("qwen3_5_moe", "qwen3_5_moe", {}),
        ("qwen3_moe", "qwen3_moe", {}),
        ("qwen3_5_moe/tied", "qwen3_5_moe", {"tie_word_embeddings": True}),
    ):
        d = tmp_path_factory.mktemp(key.replace("/", "_"))
        build_hf(arch, d, seed=5, **DIMS, **WIDE[arch], **extra)
        for p in tokenizer:
            shutil.copy(p, d / p.name)
        out[key] = d
    return out


@pytest.fixture(scope="session")
def dense_bundles(dense_sources, tmp_path_factory):
    """dense_bundles(key, dense, lm_head=None, group=None) -> bundle dir (int4 g32 experts)."""
    root = tmp_path_factory.mktemp("dense-bundles")
    made = {}

    def get(key, dense, lm_head=None, group=None):
        k = (key, dense, lm_head, group)
        if k not in made:
            dst = root / "-".join(str(x) for x in (key.replace("/", "_"), dense, lm_head, group))
            convert(
                dense_sources[key],
                dst,
                ConvertOptions("int4", dense=dense, lm_head=lm_head, dense_group=group),
            )
            made[k] = dst
        return made[k]

    return get


def _source(ckpt) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors by canonical name."""
    out = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        for name, t in load_file(f).items():
            out[canonical_name(name)[0]] = t
    return out


def _expected_targets(b: Bundle, dense: str, lm_head: str) -> set[str]:
    """Every attention / DeltaNet / shared-expert / dense-MLP projection, and the lm_head."""
    specs = [s for s in b.arch.tensor_specs(b.args) if s.category != "experts"]
    want = {DL.LINEAR: dense, DL.LM_HEAD: lm_head}
    return {s.name for s in specs if (r := DL.role(s.name, s.shape)) and want[r] != "bf16"}


@pytest.mark.parametrize("arch", ["qwen3_5_moe", "qwen3_moe"])
@pytest.mark.parametrize("dense", ["int4", "int8"])
def test_round_trip(dense_sources, dense_bundles, arch, dense):
    root = dense_bundles(arch, dense)
    b = Bundle.open(root)
    m = b.manifest
    assert m.version == 2 and F.FORMAT_VERSION == 2
    q = m.dense_quant
    group = 32 if dense == "int4" else 0
    assert (q.linear, q.lm_head, q.group_size) == (dense, dense, group)
    assert set(b.dense_quant) == set(q.tensors) == _expected_targets(b, dense, dense)
    assert "lm_head.weight" in b.dense_quant and "model.layers.0.mlp.gate.weight" not in b.dense_quant
    assert set(m.dense_tensors) == set(b.dense)  # every stored tensor hashed, parts included
    doc = json.loads((root / F.MANIFEST).read_text())["dense"]["quant"]
    assert set(doc) == {"linear", "lm_head", "group_size", "rel_rmse", "tensors"}
    assert set(doc["tensors"]["lm_head.weight"]) == {"scheme", "group_size", "rel_rmse"}

    src = _source(dense_sources[arch])
    files = MappedFiles()
    err2 = ref2 = 0.0
    for name, dq in b.dense_quant.items():
        w = src[name].float()
        R, C = w.shape
        assert dq.scheme == dense and dq.group == (group or C)
        assert dq.weight.name == name and dq.scales.name == name + ".scales"
        stored = files.tensor(dq.weight)
        scales = files.tensor(dq.scales)
        if dense == "int4":
            assert dq.weight.dtype == "U8" and dq.weight.shape == (R, C // 2)
            assert dq.scales.dtype == "U8" and dq.scales.shape == (R, C // 32)
            assert dq.global_.dtype == "F32" and dq.global_.shape == (1,)
            gscale = float(files.tensor(dq.global_)[0])
            packed, codes, gs = quantize_int4(w, 32)  # the whole weight at once: the same bytes
            assert torch.equal(stored, packed) and torch.equal(scales, codes) and gscale == gs
            got = dequantize_int4(stored, scales, gscale)
            step = (e4m3_value(scales) * gscale).repeat_interleave(32, 1)
            assert ((got - w).abs() <= 2 * step).all()  # rounding, or a maximum clipped to lower the error
        else:
            assert dq.weight.dtype == "I8" and dq.weight.shape == (R, C)
            assert dq.scales.dtype == "F32" and dq.scales.shape == (R, 1) and dq.global_ is None
            qv, sc = quantize_int8(w, 0)
            assert torch.equal(stored, qv) and torch.equal(scales, sc)
            got = dequantize_int8(stored, scales)
            assert ((got - w).abs() <= scales / 2 * (1 + 1e-6) + 1e-9).all()  # half a step
        e2, r2 = float((got - w).double().square().sum()), float(w.double().square().sum())
        assert q.tensors[name].rel_rmse == pytest.approx(math.sqrt(e2 / r2), rel=1e-6)
        err2, ref2 = err2 + e2, ref2 + r2
    assert q.rel_rmse == pytest.approx(math.sqrt(err2 / ref2), rel=1e-6)
    assert 0 < q.rel_rmse < (0.15 if dense == "int4" else 0.01)
    # plain tensors are as in v1: the source's bytes
    for name in ("model.embed_tokens.weight", "model.layers.0.mlp.gate.weight", "model.norm.weight"):
        assert torch.equal(files.tensor(b.dense[name]), src[name])

    report = verify_bundle(root, deep=True)
    assert report.bytes_hashed == sum(f.bytes for f in m.files.values())
    assert f"dense {q.scheme.label()}" in report.summary()


def test_lm_head_has_its_own_scheme(dense_bundles):
    b = Bundle.open(dense_bundles("qwen3_5_moe", "int4", "int8"))
    assert b.dense_quant["lm_head.weight"].scheme == "int8" and b.dense_quant["lm_head.weight"].group == 64
    assert {d.scheme for n, d in b.dense_quant.items() if n != "lm_head.weight"} == {"int4"}
    assert b.manifest.dense_quant.scheme == DL.DenseScheme("int4", 32, "int8", 0)
    only_head = Bundle.open(dense_bundles("qwen3_5_moe", "bf16", "int4"))
    assert set(only_head.dense_quant) == {"lm_head.weight"}
    assert only_head.manifest.dense_quant.group_size == 0


def test_int8_groups_and_int4_g16(dense_bundles):
    b = Bundle.open(dense_bundles("qwen3_moe", "int8", None, 16))
    dq = b.dense_quant["model.layers.1.mlp.down_proj.weight"]  # the dense MLP layer: [64, 64]
    assert (dq.group, dq.scales.shape) == (16, (64, 4))
    b = Bundle.open(dense_bundles("qwen3_moe", "int4", None, 16))
    assert {d.group for d in b.dense_quant.values()} == {16}


def test_plain_dense_loads_as_in_v1(dense_bundles, dense_sources):
    model, _, _ = load_bundle_model(dense_bundles("qwen3_5_moe", "bf16"), dtype=torch.float32, experts=False)
    assert torch.equal(model.lm_head.weight, _source(dense_sources["qwen3_5_moe"])["lm_head.weight"])


def test_row_blocks_write_the_bytes_of_the_whole_weight(dense_sources, dense_bundles, tmp_path, monkeypatch):
    monkeypatch.setattr(C, "QCHUNK", 1)  # one row at a time
    dst = tmp_path / "rows"
    convert(dense_sources["qwen3_5_moe"], dst, ConvertOptions("int4", dense="int4"))
    whole = dense_bundles("qwen3_5_moe", "int4")
    assert (dst / F.DENSE).read_bytes() == (whole / F.DENSE).read_bytes()
    rows, one = F.read_manifest(dst).dense_quant, F.read_manifest(whole).dense_quant
    assert rows.scheme == one.scheme and rows.rel_rmse == pytest.approx(one.rel_rmse, rel=1e-9)


@pytest.mark.parametrize("dense,lm_head", [("int4", None), ("int8", "int4"), ("bf16", None)])
def test_dry_run_sizes_are_the_written_sizes(dense_sources, tmp_path, dense, lm_head, capsys):
    src = dense_sources["qwen3_5_moe"]
    options = ConvertOptions("int4", dense=dense, lm_head=lm_head)
    plan = plan_conversion(src, options)
    m = convert(src, tmp_path / "b", options)
    assert {n: r.bytes for n, r in m.files.items()} == plan.file_sizes()
    assert (tmp_path / "b" / F.MANIFEST).stat().st_size <= plan.manifest_estimate()
    stored, _ = read_header(tmp_path / "b" / F.DENSE)
    by_category = {}
    for r in plan.resident:
        for name, *_ in r.parts:
            by_category[r.category] = by_category.get(r.category, 0) + stored[name].nbytes
    sizes = plan.sizes_by_category()
    assert all(sizes[c] == n for c, n in by_category.items() if n)
    args = ["convert", str(src), str(tmp_path / "dry"), "--dense", dense, "--dry-run", "-v"]
    assert main(args + (["--lm-head", lm_head] if lm_head else [])) == 0
    out = capsys.readouterr().out
    assert f"dense linear weights {plan.dense.label()}" in out
    assert re.search(rf"\n  lm_head +{sizes['lm_head']:,d} bytes", out)
    if dense != "bf16":
        assert re.search(
            rf"resident  attention {dense} (g32|per row) +model.layers.3.self_attn.q_proj.weight", out
        )


def test_tied_lm_head_stays_plain_and_an_explicit_lm_head_is_refused(dense_sources, tmp_path, capsys):
    src = dense_sources["qwen3_5_moe/tied"]
    with pytest.raises(
        ConfigError, match=r"--lm-head int4: this model ties its lm_head to the embedding table"
    ):
        plan_conversion(src, ConvertOptions("int4", dense="int4", lm_head="int4"))
    args = ["convert", str(src), str(tmp_path / "x"), "--dense", "int4", "--lm-head", "bf16"]
    assert main(args) == 2
    assert "ties its lm_head" in capsys.readouterr().err and not (tmp_path / "x").exists()
    m = convert(src, tmp_path / "b", ConvertOptions("int4", dense="int4"))
    assert m.dense_quant.lm_head == "bf16" and "lm_head.weight" not in m.dense_quant.tensors
    assert "model.embed_tokens.weight" in Bundle.open(tmp_path / "b").dense  # plain


def test_a_weight_the_group_does_not_divide_is_refused_by_name(sources):
    # the default fixtures: DeltaNet out_proj [64, 48], shared expert down_proj [64, 40]
    with pytest.raises(
        ConfigError,
        match=r"tensor 'model.layers.0.linear_attn.out_proj.weight' of shape \[64, 48\] as int4 with group 32: "
        r"48 columns .* int4 group sizes that divide it: 16",
    ):
        plan_conversion(sources["qwen3_5_moe"], ConvertOptions("int4", dense="int4"))
    with pytest.raises(ConfigError, match=r"\[64, 40\] as int4 with group 16: .* no int4 group size"):
        plan_conversion(sources["qwen3_5_moe"], ConvertOptions("int4", dense="int4", dense_group=16))
    with pytest.raises(ConfigError, match=r"as int8 with group 32: .*: 0 \(per row\), 16"):
        plan_conversion(sources["qwen3_5_moe"], ConvertOptions("int4", dense="int8", dense_group=32))
    plan_conversion(sources["qwen3_5_moe"], ConvertOptions("int4", dense="int8"))  # per row fits any width
    with pytest.raises(ConfigError, match="--dense-group 64: int4 takes 16 or 32"):
        plan_conversion(sources["qwen3_5_moe"], ConvertOptions("int4", dense="int4", dense_group=64))
    with pytest.raises(ConfigError, match="no dense weight is quantized"):
        plan_conversion(sources["qwen3_5_moe"], ConvertOptions("int4", dense_group=32))


def test_resume_key_holds_the_dense_options(dense_sources, dense_bundles, tmp_path):
    src = dense_sources["qwen3_moe"]
    with pytest.raises(F.BundleError, match=r"complete bundle of another .* dense int4 g32"):
        convert(src, dense_bundles("qwen3_moe", "int4"), ConvertOptions("int4", dense="int8"))
    assert convert(src, dense_bundles("qwen3_moe", "int4"), ConvertOptions("int4", dense="int4"))  # done

    class Stop(Exception):
        pass

    def stop(*_):
        raise Stop

    partial = tmp_path / "partial"
    with pytest.raises(Stop):
        convert(src, partial, ConvertOptions("int4", dense="int4"), on_block=stop)
    assert (partial / F.DENSE).is_file()  # dense is written first
    with pytest.raises(F.BundleError, match="unfinished conversion with a different dense_quant"):
        convert(src, partial, ConvertOptions("int4", dense="int4", lm_head="int8"))
    m = convert(src, partial, ConvertOptions("int4", dense="int4"))  # resumes, keeps dense.safetensors
    assert (partial / F.MANIFEST).read_bytes() == (
        dense_bundles("qwen3_moe", "int4") / F.MANIFEST
    ).read_bytes()
    assert m.dense_quant.linear == "int4"


# --------------------------------------------------------------------------------------------
# Version 1


def _edit_manifest(path, fn):
    doc = json.loads((path / F.MANIFEST).read_text())
    fn(doc)
    doc.pop(F.MANIFEST_HASH, None)  # as a bundle written before manifests hashed themselves
    (path / F.MANIFEST).write_text(json.dumps(doc))


def _as_v1(doc):
    doc["version"] = 1
    del doc["dense"]["quant"]


def test_v1_bundles_still_open(bundle_copy):
    root = bundle_copy("qwen3_5_moe", "int4", 16)
    _edit_manifest(root, _as_v1)
    b = Bundle.open(root)
    assert b.manifest.version == 1 and b.dense_quant == {}
    assert b.manifest.dense_quant == F.DenseQuantRecord.plain()
    assert "quant" not in b.manifest.to_json()["dense"]  # written back as it was
    verify_bundle(root, deep=True)
    model, _, _ = load_bundle_model(root, dtype=torch.float32)
    assert not model.lm_head.weight.is_meta


def test_a_v1_manifest_with_dense_quant_is_refused(bundle_copy):
    root = bundle_copy("qwen3_5_moe", "int4", 16)
    _edit_manifest(root, lambda d: d.update(version=1))
    with pytest.raises(BundleError, match=r"\[dense\]: key 'quant' is a version 2 key, but 'version' is 1"):
        Bundle.open(root)


# --------------------------------------------------------------------------------------------
# Damaged v2 bundles: each refused by Bundle.open (before anything is allocated), naming the tensor

Q = "model.layers.3.self_attn.q_proj.weight"  # [128, 64]: int4 g32 -> U8 [128, 32], scales U8 [128, 2]


def _edit_header(root, fn):
    """Rewrite dense.safetensors' header in place (same length: padded with spaces)."""
    path = root / F.DENSE
    data = bytearray(path.read_bytes())
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    fn(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n
    data[8 : 8 + n] = text + b" " * (n - len(text))
    path.write_bytes(bytes(data))


def scales_dtype(root):
    _edit_header(root, lambda h: h[Q + ".scales"].update(dtype="I8"))


def scales_shape(root):
    _edit_header(root, lambda h: h[Q + ".scales"].update(shape=[2, 128]))


def missing_global(root):
    _edit_header(root, lambda h: h.pop(Q + ".global"))


def router_listed(root):
    rec = {"scheme": "int4", "group_size": 32, "rel_rmse": 0.1}
    _edit_manifest(
        root, lambda d: d["dense"]["quant"]["tensors"].update({"model.layers.3.mlp.gate.weight": rec})
    )


def unknown_name(root):
    rec = {"scheme": "int4", "group_size": 32, "rel_rmse": 0.1}
    _edit_manifest(
        root, lambda d: d["dense"]["quant"]["tensors"].update({"model.layers.9.self_attn.q_proj.weight": rec})
    )


def unlisted_weight(root):
    _edit_manifest(root, lambda d: d["dense"]["quant"]["tensors"].pop(Q))


def bad_scheme(root):
    _edit_manifest(root, lambda d: d["dense"]["quant"].update(linear="int3"))


def bad_tensor_scheme(root):
    _edit_manifest(root, lambda d: d["dense"]["quant"]["tensors"][Q].update(scheme="int8"))


def bad_group(root):
    _edit_manifest(root, lambda d: d["dense"]["quant"]["tensors"][Q].update(group_size=24))


def group_of_another_role(root):
    _edit_manifest(root, lambda d: d["dense"]["quant"]["tensors"][Q].update(group_size=16))


def missing_quant(root):
    _edit_manifest(root, lambda d: d["dense"].pop("quant"))


DAMAGE = {
    scales_dtype: rf"dense.safetensors: tensor '{Q}.scales' is I8 \[128, 2\], expected U8 \[128, 2\]: "
    rf"the manifest records '{Q}' \[128, 64\] as int4 g32",
    scales_shape: rf"tensor '{Q}.scales' is U8 \[2, 128\], expected U8 \[128, 2\]",
    missing_global: rf"dense.safetensors: lacks tensor '{Q}.global' \(F32 \[1\]\)",
    router_listed: r"key 'dense.quant.tensors' lists 'model.layers.3.mlp.gate.weight': not a linear weight",
    unknown_name: r"lists 'model.layers.9.self_attn.q_proj.weight': a tensor the model lacks",
    unlisted_weight: rf"key 'dense.quant.linear' is 'int4', but 'dense.quant.tensors' does not list .*'{Q}'",
    bad_scheme: r"\[dense.quant\]: key 'linear' is 'int3', expected one of bf16, int8, int4",
    bad_tensor_scheme: rf"\[dense.quant.tensors\['{Q}'\]\]: key 'scheme' is 'int8', but the linear weights are 'int4'",
    bad_group: r"key 'group_size' is 24, but int4 takes 16 or 32",
    group_of_another_role: r"key 'group_size' is 16, but the linear weights' group is 32",
    missing_quant: r"\[dense\]: required key 'quant' is missing",
}


@pytest.mark.parametrize("damage", list(DAMAGE), ids=lambda f: f.__name__)
def test_damaged_v2_bundle_is_refused_by_name(damage, dense_bundles, tmp_path, monkeypatch):
    root = tmp_path / "b"
    shutil.copytree(dense_bundles("qwen3_5_moe", "int4"), root)
    damage(root)

    def allocate(*a, **k):
        raise AssertionError("the model was built before the bundle was validated")

    monkeypatch.setattr("edgerun.bundle.reader.load_entries", allocate)
    with pytest.raises(BundleError, match=DAMAGE[damage]):
        load_bundle_model(root)
    others = [m for d, m in DAMAGE.items() if d is not damage]
    with pytest.raises(BundleError) as err:
        Bundle.open(root)
    assert not any(re.search(m, str(err.value)) for m in others)


def _rewrite_bytes(root, name, fn):
    """Change stored tensor ``name``'s bytes and re-hash them in the manifest (tensor and file), as
    a writer with a bug would: only the value checks of `verify --deep` can see it."""
    e = read_header(root / F.DENSE)[0][name]
    data = bytearray((root / F.DENSE).read_bytes())
    fn(memoryview(data)[e.start : e.end])
    (root / F.DENSE).write_bytes(bytes(data))

    def rehash(d):
        d["dense"]["tensors"][name] = F.part_hash(bytes(data[e.start : e.end]))
        d["files"][F.DENSE]["blake2b"] = F.file_hash(root / F.DENSE)

    _edit_manifest(root, rehash)
    return e


@pytest.mark.parametrize(
    "dense,part,value,message",
    [
        ("int4", ".scales", 0x00, r"e4m3 scale code 0x00 at byte {b} \(row 0, column 1\)"),
        ("int4", ".scales", 0x7F, r"e4m3 scale code 0x7f at byte {b}"),
        ("int4", ".global", None, r"global scale 3.0 at byte {b}"),
        ("int8", "", 0x80, r"int8 value -128 at byte {b} \(row 0, column 1\)"),
        ("int8", ".scales", None, r"fp32 scale -1.0 at byte {b}"),
    ],
)
def test_deep_verify_checks_the_values_of_quantized_dense_weights(
    dense_bundles, tmp_path, dense, part, value, message
):
    root = tmp_path / "b"
    shutil.copytree(dense_bundles("qwen3_5_moe", dense), root)
    name = Q + part

    def poke(view):
        if value is not None:
            view[1] = value
        else:
            view[:4] = torch.tensor([3.0 if part == ".global" else -1.0]).view(torch.uint8).numpy().tobytes()

    e = _rewrite_bytes(root, name, poke)
    verify_bundle(root)  # structure and sizes are fine
    at = e.start + (1 if value is not None else 0)
    with pytest.raises(BundleError, match=rf"tensor '{re.escape(name)}' .*" + message.format(b=at)):
        verify_bundle(root, deep=True)


# --------------------------------------------------------------------------------------------
# Synthesized bundles (edgerun bench decode)


@pytest.mark.parametrize("dense,lm_head", [("int4", None), ("int8", "int4")])
def test_synth_bundle_with_quantized_dense_opens(tmp_path, dense, lm_head):
    out = S.synth_bundle(
        tmp_path / "s", S.tiny_config("qwen3_5_moe"), dense=dense, lm_head=lm_head, threads=2
    )
    b = Bundle.open(out)
    want = DL.DenseScheme.resolve(dense, lm_head)
    assert b.manifest.dense_quant.scheme == want and b.manifest.dense_quant.rel_rmse == 0.0
    assert set(b.dense_quant) == _expected_targets(b, want.linear, want.lm_head)
    verify_bundle(out, deep=True)  # hashes and values
    files = MappedFiles()
    for name, dq in b.dense_quant.items():
        # drawn in stored form, as a fixed point of the quantizer (the manifest records no error)
        w, s = files.tensor(dq.weight), files.tensor(dq.scales)
        if dq.scheme == "int4":
            g = float(files.tensor(dq.global_)[0])
            x = dequantize_int4(w, s, g)
            again = quantize_int4(x, dq.group)
            assert torch.equal(again[0], w) and torch.equal(again[1], s) and again[2] == g, name
        else:
            x = dequantize_int8(w, s)
            again = quantize_int8(x, 0 if dq.group == x.shape[1] else dq.group)
            assert torch.equal(again[0], w) and torch.equal(again[1], s), name
        assert 0.3 < x.std().item() * math.sqrt(x.shape[1]) < 3  # about N(0, 1/fan_in)
    same = S.synth_bundle(
        tmp_path / "t", S.tiny_config("qwen3_5_moe"), dense=dense, lm_head=lm_head, threads=1
    )
    assert (same / F.DENSE).read_bytes() == (out / F.DENSE).read_bytes()  # whatever the thread count


def test_synth_dense_layout_is_what_convert_writes(dense_sources, tmp_path):
    src = dense_sources["qwen3_5_moe"]
    config = json.loads((src / "config.json").read_text())
    converted = convert(
        src, tmp_path / "c", ConvertOptions("int4", dense="int4", lm_head="int8", dense_dtype="bf16")
    )
    synthetic = F.read_manifest(
        S.synth_bundle(tmp_path / "s", config, dense="int4", lm_head="int8", tokenizer_from=src, threads=2)
    )
    assert synthetic.inventory == converted.inventory  # stored names, dtypes, shapes
    assert list(synthetic.dense_tensors) == list(converted.dense_tensors)  # file order
    assert synthetic.files[F.DENSE].bytes == converted.files[F.DENSE].bytes
    assert synthetic.dense_quant.scheme == converted.dense_quant.scheme
    assert set(synthetic.dense_quant.tensors) == set(converted.dense_quant.tensors)


def test_synth_cli_takes_the_dense_options(tmp_path, capsys):
    out = tmp_path / "s"
    argv = [str(out), "--geometry", "tiny", "--dense", "int4", "--lm-head", "int8", "--threads", "2"]
    assert S.main(argv) == 0
    assert "dense int4 g32, lm_head int8 per row" in capsys.readouterr().out
    assert os.path.getsize(out / F.DENSE) == F.read_manifest(out).files[F.DENSE].bytes


def test_dry_run_at_the_real_geometry_is_the_planners_arithmetic(tmp_path, capsys):
    """Qwen3.6-35B-A3B's inventory over a sparse checkpoint (never read): convert's sizes per
    category with --dense int4 are the planner's resident bytes, byte for byte."""
    from synthetic import write_checkpoint

    from edgerun.budget.planner import resident_bytes

    cfg = S.qwen36_config()["text_config"] | {"model_type": "qwen3_5_moe", "tie_word_embeddings": False}
    write_checkpoint(tmp_path / "src", cfg, sparse=True)
    plan = plan_conversion(tmp_path / "src", ConvertOptions("int4", dense="int4"))
    sizes = plan.sizes_by_category()
    planned = resident_bytes(plan.arch.tensor_specs(plan.args), "bf16", plan.dense)
    assert {c: n for c, n in planned.items() if n} == {c: sizes[c] for c, n in planned.items() if n}
    assert sum(planned.values()) == 2_080_262_620
    assert (
        main(["convert", str(tmp_path / "src"), str(tmp_path / "out"), "--dense", "int4", "--dry-run"]) == 0
    )
    assert "311 dense weights quantized" in capsys.readouterr().out


def test_bench_budgets_are_sized_by_the_planner(tmp_path):
    """`edgerun bench decode/prefill --budgets`: the quota for a device budget is the planner's
    (every planned item, not a fixed allowance), so the measured peak can be held to the budget;
    a budget that cannot hold top_k slots is refused with the planner's words."""
    from edgerun.bench.decode import LIBRARY_WORKSPACE, quota_for
    from edgerun.budget import inputs

    out = S.synth_bundle(tmp_path / "s", S.tiny_config("qwen3_5_moe"), dense="int4", threads=2)
    a = Bundle.open(out).args
    assert quota_for(2**30, out, 64)[0] == a.num_experts  # everything fits
    model = inputs.from_bundle(out)
    per_slot = sum(model.experts.block_bytes)
    quotas = [quota_for(LIBRARY_WORKSPACE + n, out, 64)[0] for n in range(2**17, 4 * 2**20, 2**17)]
    assert quotas == sorted(quotas) and len(set(quotas)) > 2  # more budget, more slots
    q, how = quota_for(LIBRARY_WORKSPACE + 2**17, out, 64)
    assert q == 0 and "over by" in how, how
    assert quota_for(LIBRARY_WORKSPACE, out, 64)[0] == 0
    # one budget step of a layer's slot bytes adds at most one slot a layer
    q1 = quota_for(LIBRARY_WORKSPACE + 3 * 2**20, out, 64)[0]
    assert quota_for(LIBRARY_WORKSPACE + 3 * 2**20 + per_slot, out, 64)[0] in (q1, q1 + 1)
