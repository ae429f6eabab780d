"""GGUF checkpoints as convert input: tiny GGUF files written the way llama.cpp writes them
(gguf_fixtures.py) from tiny HF checkpoints, converted, and compared with the bundle converted
from the HF checkpoint itself; llama.cpp's qwen35moe transforms undone one by one; the tokenizer
rebuilt from metadata; refusals before writing; headers-only planning."""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf_fixtures import GGUF_ARCH, Q, llama_cpp_tensors, quantize_q4_k, write_gguf

from edgerun.bundle import convert as C
from edgerun.bundle import format as F
from edgerun.bundle import gguf_source as G
from edgerun.bundle.cli import main
from edgerun.bundle.convert import ConvertOptions, convert, plan_conversion
from edgerun.bundle.reader import load_bundle_model
from edgerun.errors import CheckpointError, ConfigError
from edgerun.models.inventory import tensor_specs
from edgerun.models.registry import load_args
from hf_fixtures import build_hf, write_bpe_tokenizer

ARCHS = ("qwen3_moe", "qwen3_5_moe")
TEXT = "The quick brown fox jumps over the lazy dog. In the beginning there was text, and 42 numbers! "
STRINGS = [
    "The quick brown fox",
    "numbers 1234 and   spaces",
    "<|im_start|>user\nhi<|im_end|>",
    "ünïcödé café",
]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> dict[str, Path]:
    """HF checkpoints llama.cpp can convert (qwen3_moe without dense layers), with a byte-level
    BPE tokenizer of 300 tokens (the vocab size)."""
    out = {}
    for arch in ARCHS:
        d = tmp_path_factory.mktemp(arch)
        extra = {"mlp_only_layers": []} if arch == "qwen3_moe" else {}
        build_hf(arch, d, seed=5, hidden_size=64, moe_intermediate_size=32, vocab_size=300, **extra)
        write_bpe_tokenizer(d, TEXT, [2])
        out[arch] = d
    return out


def _greedy(model, n: int = 24) -> list[int]:
    prompt = torch.arange(3, 15).reshape(1, -1)
    state = model.new_state(1, 64)
    tokens = []
    with torch.no_grad():
        logits = model(prompt, state, last_only=True)
        for _ in range(n):
            tokens.append(int(logits[0, -1].argmax()))
            logits = model(torch.tensor([[tokens[-1]]]), state, last_only=True)
    return tokens


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.arange(3, 40).reshape(1, -1))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _compare(got_dir: Path, ref_dir: Path, bound: dict[str, float]) -> float:
    """Each tensor of bundle ``got_dir`` within its relative error bound (by substring of its
    name; 1e-6 otherwise) of ``ref_dir``'s; returns the logits' relative error."""
    got, _, _ = load_bundle_model(got_dir, dtype=torch.float32)
    ref, _, _ = load_bundle_model(ref_dir, dtype=torch.float32)
    theirs = dict(ref.named_parameters())
    for name, p in got.named_parameters():
        tol = next((v for k, v in bound.items() if k in name), 1e-6)
        assert _rel(p, theirs[name]) < tol, name
    return _rel(_logits(got), _logits(ref))


# --------------------------------------------------------------------------------------------
# Names and transforms, against llama.cpp's own tables


@pytest.mark.parametrize("arch", ARCHS)
def test_names_match_llama_cpp(hf, arch):
    """Every canonical tensor maps to the GGUF name gguf's TensorNameMap gives its HF name."""
    cfg = json.loads((hf[arch] / "config.json").read_text())
    _, args = load_args(cfg)
    tmap = gguf.get_tensor_name_map(GGUF_ARCH[arch], args.num_hidden_layers)
    garch = gguf.MODEL_ARCH_NAMES[GGUF_ARCH[arch]]
    for spec in tensor_specs(args):
        hf_names = [spec.name]
        if spec.name.endswith("experts.gate_up_proj"):
            prefix = spec.name.removesuffix("gate_up_proj")
            hf_names = [prefix + "gate_proj.weight", prefix + "up_proj.weight"]
        elif spec.name.endswith("experts.down_proj"):
            hf_names = [spec.name + ".weight"]
        elif spec.name.endswith("dt_bias"):
            hf_names = [spec.name.replace("dt_bias", "dt_proj.bias")]
        want = tuple(tmap.get_name(n, try_suffixes=(".weight", ".bias")) for n in hf_names)
        assert G.gguf_names(spec.name, garch) == want, spec.name


TRANSFORMS = {
    "norm": "model.layers.0.input_layernorm.weight",
    "a_log": "model.layers.0.linear_attn.A_log",
    "v_rows1": "model.layers.0.linear_attn.in_proj_a.weight",
    "v_rows": "model.layers.0.linear_attn.in_proj_z.weight",
    "v_cols": "model.layers.0.linear_attn.out_proj.weight",
    "qkv": "model.layers.0.linear_attn.in_proj_qkv.weight",
    "conv1d": "model.layers.0.linear_attn.conv1d.weight",
}


@pytest.mark.parametrize("kind", list(TRANSFORMS))
def test_each_qwen35moe_transform_is_undone(hf, kind):
    """llama.cpp's transform of a real tensor (gguf_fixtures, after conversion/qwen.py), undone."""
    from safetensors.torch import load_file

    d = hf["qwen3_5_moe"]
    cfg = json.loads((d / "config.json").read_text())
    _, args = load_args(cfg)
    name = TRANSFORMS[kind]
    assert G.transform(name, "qwen35moe") == kind
    original = load_file(str(d / "model.safetensors"))[name]
    stored = llama_cpp_tensors(cfg, {name: original})
    (value,) = stored.values()
    assert not torch.equal(value.reshape(original.shape), original)  # the transform changes it
    heads = (args.linear_num_key_heads, args.linear_num_value_heads)
    heads += (args.linear_key_head_dim, args.linear_value_head_dim)
    torch.testing.assert_close(G.undo(kind, value.float(), heads), original, atol=1e-6, rtol=0)
    assert G.transform("model.layers.0.linear_attn.norm.weight", "qwen35moe") == ""  # plain w
    assert G.transform(name, "qwen3moe") == ""


def test_every_listed_type_dequantizes():
    for name in G.QUANT_TYPES:
        qtype = gguf.GGMLQuantizationType[name]
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        out = gguf.quants.dequantize(np.zeros((2, size * (256 // block)), np.uint8), qtype)
        assert out.shape == (2, 256) and not out.any(), name


def test_q4_k_fixture_quantizer_round_trips():
    """gguf.quants can dequantize Q4_K but not quantize it, so the fixture packs Q4_K blocks
    itself; gguf's dequantizer reading them back within Q4_K's error checks the packing."""
    x = np.random.default_rng(0).standard_normal((4, 512)).astype(np.float32)
    back = gguf.quants.dequantize(quantize_q4_k(x), Q.Q4_K)
    assert np.sqrt(((back - x) ** 2).mean() / (x**2).mean()) < 0.12


# --------------------------------------------------------------------------------------------
# Conversion


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("qtype", ["F32", "BF16"])
def test_lossless_gguf_converts_to_the_hf_bundle(hf, tmp_path, arch, qtype):
    """A lossless GGUF converts to the bundle the HF checkpoint converts to: the same tensors
    and the same greedy tokens; the BF16 file is compared with the HF checkpoint rounded to
    bf16. qwen35moe's 1 + w norms and -exp(A_log) come back to within one rounding of the dtype
    llama.cpp computed them in: f32 for an f32 checkpoint, bf16 for a bf16 one (its converter
    adds 1 to the bf16 tensor, so near 1 only 2^-8 resolution is left)."""
    from hf_fixtures import rewrite

    src = hf[arch]
    if qtype == "BF16":
        src = rewrite(src, tmp_path / "hf_bf16", dtype=torch.bfloat16)
        write_bpe_tokenizer(src, TEXT, [2])
    g = write_gguf(src, tmp_path / "m.gguf", Q[qtype])
    convert(src, tmp_path / "from_hf", ConvertOptions())
    convert(g, tmp_path / "from_gguf", ConvertOptions())
    ref, _, _ = load_bundle_model(tmp_path / "from_hf", dtype=torch.float32)
    got, _, _ = load_bundle_model(tmp_path / "from_gguf", dtype=torch.float32)
    theirs = dict(ref.named_parameters())
    for name, p in got.named_parameters():
        if qtype == "BF16" and arch == "qwen3_5_moe" and G.transform(name, "qwen35moe") in ("norm", "a_log"):
            torch.testing.assert_close(p, theirs[name], atol=2**-8, rtol=2**-7, msg=name)
            theirs[name].data.copy_(p)  # the rest must then decode the same tokens
        else:
            torch.testing.assert_close(p, theirs[name], atol=2e-7, rtol=0, msg=name)
    assert _greedy(got) == _greedy(ref)
    m = F.read_manifest(tmp_path / "from_gguf")
    assert m.source["files"][0]["name"] == "m.gguf" and m.config["model_type"] == arch


def test_split_and_fused_gguf_convert_like_one_file(hf, tmp_path):
    """A split set (NAME-0000i-of-0000N.gguf) and a file with fused gate_up experts
    (--fuse-gate-up-exps) give the bundle one plain file gives."""
    src = hf["qwen3_5_moe"]
    one = write_gguf(src, tmp_path / "one" / "m.gguf")
    first = write_gguf(src, tmp_path / "split" / "m.gguf", split_max_tensors=20)
    fused = write_gguf(src, tmp_path / "fused" / "m.gguf", fuse_gate_up=True)
    assert first.name == "m-00001-of-00004.gguf"
    assert "blk.0.ffn_gate_up_exps.weight" in {t.name for t in gguf.GGUFReader(fused).tensors}
    a = convert(one, tmp_path / "a", ConvertOptions("int8"))
    for b in (
        convert(first, tmp_path / "b", ConvertOptions("int8")),
        convert(fused, tmp_path / "c", ConvertOptions("int8")),
    ):
        assert a.dense_tensors == b.dense_tensors and a.layers == b.layers
    assert len(F.read_manifest(tmp_path / "b").source["files"]) == 4
    (tmp_path / "split" / "m-00003-of-00004.gguf").unlink()
    with pytest.raises(CheckpointError, match="m-00003-of-00004.gguf"):
        plan_conversion(first, ConvertOptions())


@pytest.mark.parametrize("arch", ARCHS)
def test_q8_0_gguf_is_dequantized_with_a_bounded_error(hf, tmp_path, arch):
    """Q8_0 weights: the bundle's experts are exactly gguf's dequantized values (bf16 here), the
    error the bundle adds is reported per layer, every quantized tensor (transforms undone) is
    within Q8_0's error of the original, and so are the logits."""
    g = write_gguf(hf[arch], tmp_path / "q8.gguf", Q.Q8_0)
    m = convert(g, tmp_path / "q8", ConvertOptions())
    convert(hf[arch], tmp_path / "ref", ConvertOptions())
    assert all(0 < rec.rel_rmse < 5e-3 for rec in m.layers)  # bf16 rounding of the dequantized values

    reader = gguf.GGUFReader(g)
    t = next(t for t in reader.tensors if t.name == "blk.0.ffn_down_exps.weight")
    assert t.tensor_type == Q.Q8_0
    want = torch.from_numpy(gguf.quants.dequantize(np.array(t.data), Q.Q8_0)).to(torch.bfloat16)
    model, _, _ = load_bundle_model(tmp_path / "q8")
    assert torch.equal(model.model.layers[0].mlp.experts.down_proj, want)

    # 2-D weights: Q8_0 (~0.4%), plus bf16 rounding for experts; norms and 1-D tensors are F32
    assert (
        _compare(tmp_path / "q8", tmp_path / "ref", {".weight": 0.01, "experts": 0.01, "A_log": 1e-6}) < 0.15
    )


def test_q4_k_experts_requantized_to_int4(tmp_path):
    """Q4_K experts (rows of 256): dequantized, then stored as the bundle's int4; the added error
    is reported per layer and the logits stay within the two quantizations' error."""
    d = tmp_path / "hf"
    build_hf(
        "qwen3_moe", d, seed=1, hidden_size=256, moe_intermediate_size=256, vocab_size=300, mlp_only_layers=[]
    )
    write_bpe_tokenizer(d, TEXT, [2])
    g = write_gguf(d, tmp_path / "q4k.gguf", Q.F32, experts_qtype=Q.Q4_K)
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(g).tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == Q.Q4_K and types["blk.0.attn_q.weight"] == Q.F32
    m = convert(g, tmp_path / "int4", ConvertOptions("int4", 32))
    assert all(0.02 < rec.rel_rmse < 0.2 for rec in m.layers)  # int4 of the Q4_K values
    kept = convert(g, tmp_path / "bf16", ConvertOptions("bf16"))  # experts kept at higher precision
    assert all(rec.rel_rmse < 5e-3 for rec in kept.layers)
    convert(d, tmp_path / "ref", ConvertOptions())
    assert _compare(tmp_path / "bf16", tmp_path / "ref", {"experts": 0.12}) < 0.5
    assert _compare(tmp_path / "int4", tmp_path / "ref", {"experts": 0.2}) < 0.6


# --------------------------------------------------------------------------------------------
# Tokenizer


@pytest.mark.parametrize("pre", ["gpt-2", "qwen2"])
def test_tokenizer_is_rebuilt_from_metadata(hf, tmp_path, pre):
    """The same ids as the original tokenizer; "qwen2": the demo model's (Qwen2 regex + NFC)."""
    from tokenizers import Tokenizer

    from edgerun.tokenizer import Tokenizer as EdgerunTokenizer

    src = hf["qwen3_moe"]
    if pre == "qwen2":
        src = tmp_path / "demo_tok"
        src.mkdir()
        for f in ("model.safetensors", "config.json"):
            (src / f).write_bytes((hf["qwen3_moe"] / f).read_bytes())
        demo = REPO / "edgerun" / "demo"
        (src / "tokenizer.json").write_bytes((demo / "tokenizer.json").read_bytes())
        (src / "tokenizer_config.json").write_bytes((demo / "tokenizer_config.json").read_bytes())
    g = write_gguf(src, tmp_path / "t.gguf", pre=pre)
    made = G.open_gguf(g).tokenizer
    out = tmp_path / "out"
    out.mkdir()
    for name, data in made.items():
        (out / name).write_bytes(data)
    original, rebuilt = (
        Tokenizer.from_file(str(src / "tokenizer.json")),
        Tokenizer.from_file(str(out / "tokenizer.json")),
    )
    for s in STRINGS + [TEXT]:
        assert rebuilt.encode(s).ids == original.encode(s).ids, s
        assert rebuilt.decode(rebuilt.encode(s).ids) == original.decode(original.encode(s).ids)
    tok = EdgerunTokenizer.from_dir(out)
    tcfg = json.loads((src / "tokenizer_config.json").read_text())
    assert tok.chat_template == tcfg.get("chat_template")
    assert tok.eos_token == tcfg["eos_token"]
    assert tok.eos_token_ids == (original.token_to_id(tcfg["eos_token"]),)


def test_unknown_tokenizers_are_refused(hf, tmp_path):
    g = write_gguf(hf["qwen3_moe"], tmp_path / "t.gguf", pre="deepseek-llm")
    with pytest.raises(ConfigError, match=r"'tokenizer.ggml.pre' is 'deepseek-llm'; supported: gpt-2"):
        G.open_gguf(g)


# --------------------------------------------------------------------------------------------
# Refusals, dry run, plan


def _rewrite(src: Path, dst: Path, arch: str | None = None, extra=None, kv=None) -> Path:
    """A copy of GGUF ``src`` with another architecture name, extra raw tensors and/or keys
    set (``kv``: key -> (value, GGUFValueType); value None drops the key)."""
    r = gguf.GGUFReader(src)
    old = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(dst, arch or old)
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        if f.name not in (kv or {}):
            w.add_key_value(f.name.replace(old + ".", (arch or old) + "."), f.contents(), vtype, sub_type=sub)
    for key, (value, vtype) in (kv or {}).items():
        if value is not None:
            w.add_key_value(key, value, vtype)
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    for name, (data, qtype) in (extra or {}).items():
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_unknown_architecture_and_quant_type_are_refused_before_writing(hf, tmp_path):
    g = write_gguf(hf["qwen3_moe"], tmp_path / "m.gguf")
    llama = _rewrite(g, tmp_path / "llama.gguf", arch="llama")
    with pytest.raises(ConfigError, match="GGUF architecture 'llama' is not supported"):
        convert(llama, tmp_path / "out", ConvertOptions())
    iq = {"blk.0.foo.weight": (np.zeros((2, 66), np.uint8), Q.IQ2_XXS)}
    bad = _rewrite(g, tmp_path / "iq.gguf", extra=iq)
    with pytest.raises(CheckpointError, match="tensor 'blk.0.foo.weight' has GGML type IQ2_XXS; supported"):
        convert(bad, tmp_path / "out", ConvertOptions())
    assert not (tmp_path / "out").exists()
    g35 = write_gguf(hf["qwen3_5_moe"], tmp_path / "q35.gguf")
    no_conv = _rewrite(g35, tmp_path / "nc.gguf", kv={"qwen35moe.ssm.conv_kernel": (None, None)})
    with pytest.raises(ConfigError, match="nc.gguf: GGUF key 'qwen35moe.ssm.conv_kernel' is missing"):
        convert(no_conv, tmp_path / "out", ConvertOptions())
    assert not (tmp_path / "out").exists()


def test_hostile_metadata_is_refused_by_its_key_before_anything_is_sized(hf, tmp_path):
    """A block count of 2^31 (tables of that many layers), a float where a count goes, 0 heads (a
    division) and an EOS id past the vocabulary: each refused by its GGUF key."""
    g = write_gguf(hf["qwen3_moe"], tmp_path / "m.gguf")
    V = gguf.GGUFValueType
    cases = {
        "qwen3moe.block_count": ((2**31, V.UINT32), r"is 2147483648; a model's is 1 to 4096"),
        "qwen3moe.attention.head_count": ((0, V.UINT32), r"is 0; a model's is 1 to 4096"),
        "qwen3moe.embedding_length": ((64.0, V.FLOAT32), r"must be an integer, got 64.0"),
        "tokenizer.ggml.eos_token_id": ((10**9, V.UINT32), r"is 1000000000, outside the vocabulary of"),
    }
    for i, (key, (value, says)) in enumerate(cases.items()):
        bad = _rewrite(g, tmp_path / f"bad{i}.gguf", kv={key: value})
        with pytest.raises(ConfigError, match=rf"GGUF key '{re.escape(key)}' {says}"):
            convert(bad, tmp_path / "out", ConvertOptions())
    assert not (tmp_path / "out").exists()


def test_tensors_whose_data_overlap_are_refused(hf, tmp_path):
    """A damaged tensor offset that points into another tensor's data: refused, both named."""
    g = write_gguf(hf["qwen3_moe"], tmp_path / "m.gguf")
    r = gguf.GGUFReader(g)
    first, second = sorted(r.tensors, key=lambda t: int(t.data_offset))[:2]
    data = bytearray(g.read_bytes())
    # the tensor-info block holds each name's data offset (relative to the data section) as a u64
    rel = int(second.data_offset) - int(r.data_offset)
    at = data.index(second.name.encode()) + len(second.name) + 4 + 8 * len(second.shape) + 4
    assert int.from_bytes(data[at : at + 8], "little") == rel
    data[at : at + 8] = (int(first.data_offset) - int(r.data_offset)).to_bytes(8, "little")
    bad = tmp_path / "overlap.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"overlap: the file is damaged"):
        convert(bad, tmp_path / "out", ConvertOptions())


def test_mtp_blocks_are_ignored(hf, tmp_path):
    """Blocks past block_count - nextn_predict_layers are the MTP head: listed, not loaded."""
    g = write_gguf(hf["qwen3_5_moe"], tmp_path / "m.gguf")
    u32 = gguf.GGUFValueType.UINT32
    kv = {"qwen35moe.block_count": (5, u32), "qwen35moe.nextn_predict_layers": (1, u32)}
    extra = {"blk.4.nextn.eh_proj.weight": (np.zeros((64, 128), np.float32), None)}
    plan = plan_conversion(_rewrite(g, tmp_path / "mtp.gguf", extra=extra, kv=kv), ConvertOptions())
    assert not plan.problems
    assert plan.args.num_hidden_layers == 4 and plan.args.mtp_num_hidden_layers == 1
    row = next(r for r in plan.rows if r.name == "blk.4.nextn.eh_proj.weight")
    assert (row.kind, row.detail) == ("ignored", "mtp")


def test_dry_run_and_plan_read_headers_only(hf, tmp_path, monkeypatch, capsys):
    from edgerun.cli import main as edgerun

    g = write_gguf(hf["qwen3_5_moe"], tmp_path / "m.gguf", Q.Q8_0)

    def refuse(*a, **k):
        raise AssertionError("tensor data was read")

    monkeypatch.setattr(G.GGUFTensors, "_raw", refuse)
    monkeypatch.setattr(C.Source, "read", refuse)
    assert main(["convert", str(g), str(tmp_path / "out"), "--quant", "int4", "--dry-run", "-v"]) == 0
    out = capsys.readouterr().out
    assert "blk.0.ffn_gate_exps.weight+blk.0.ffn_up_exps.weight" in out and "0 unknown" in out
    assert not (tmp_path / "out").exists()
    plan = [
        "plan",
        "--profile",
        str(REPO / "configs" / "cpu.yaml"),
        "--model",
        str(g),
        "--context",
        "256",
    ]
    assert edgerun(plan) in (0, 1)  # fits or is refused with a plan: either way, from the header
    assert "qwen3_5_moe" in capsys.readouterr().out


def test_list_gguf_support(capsys):
    assert main(["convert", "--list-gguf-support"]) == 0
    out = capsys.readouterr().out
    assert "qwen3moe" in out and "qwen35moe" in out and "Q4_K" in out and "Q8_0" in out


# --------------------------------------------------------------------------------------------
# A real llama.cpp export

PEER_KIT = REPO.parent / "shared" / "peers" / "gpu"


@pytest.mark.skipif(
    not (PEER_KIT / "convert_gguf.py").is_file() or not (PEER_KIT / "llama.cpp").is_dir(),
    reason=f"llama.cpp's converter (the peer kit, {PEER_KIT}) is not on this machine",
)
def test_demo_model_exported_by_llama_cpp(tmp_path):
    """The demo model through llama.cpp's own convert_hf_to_gguf.py and back: BF16 decodes the
    same greedy tokens as the bundle converted from the HF checkpoint, Q8_0 scores the held-out
    text within 1% of its perplexity, and the rebuilt tokenizer gives the demo tokenizer's ids."""
    import subprocess
    import sys

    from tokenizers import Tokenizer

    from edgerun.tools.quality import perplexity

    demo = REPO / "edgerun" / "demo"
    convert(demo, tmp_path / "hf", ConvertOptions())
    ref, _, _ = load_bundle_model(tmp_path / "hf", dtype=torch.float32)
    text = (REPO / "tests" / "data" / "kjv_heldout.txt").read_text()[:12000]
    ids = Tokenizer.from_file(str(demo / "tokenizer.json")).encode(text).ids[:2048]
    for outtype in ("bf16", "q8_0"):
        g = tmp_path / f"demo-{outtype}.gguf"
        cmd = [sys.executable, str(PEER_KIT / "convert_gguf.py"), str(demo), "--outtype", outtype]
        subprocess.run([*cmd, "--outfile", str(g), "--no-mtp"], check=True, capture_output=True, timeout=300)
        convert(g, tmp_path / outtype, ConvertOptions())
        got, _, _ = load_bundle_model(tmp_path / outtype, dtype=torch.float32)
        if outtype == "bf16":
            assert _greedy(got, 40) == _greedy(ref, 40)
            rebuilt = Tokenizer.from_file(str(tmp_path / outtype / "tokenizer.json"))
            assert rebuilt.encode(text).ids[:2048] == ids
        else:
            want, have = perplexity(ref, ids), perplexity(got, ids)
            assert abs(have - want) / want < 0.01, (have, want)
