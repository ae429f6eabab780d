"""GGUF checkpoints (llama.cpp's format) as a source for `edgerun convert` and `edgerun plan`.

A GGUF file, or a split set (NAME-00001-of-0000N.gguf), is read with the ``gguf`` package. Its
metadata becomes the HF config the architecture expects, its tensors become entries under
canonical names and shapes (experts stacked as [E, 2I, D] / [E, D, I]), and the tokenizer is
rebuilt from the ``tokenizer.ggml.*`` keys: all from the header, so ``--dry-run`` and ``edgerun
plan`` read no tensor data. :class:`GGUFTensors` reads the data: dequantized with
``gguf.quants`` and with llama.cpp's conversion transforms undone (qwen35moe: norms stored as
1 + w, ``ssm_a`` as -exp(A_log), conv1d squeezed, DeltaNet V heads tiled instead of grouped).
Imports no torch until a tensor is read: planning stays torch-free.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgerun.bundle import format as F
from edgerun.errors import CheckpointError, ConfigError
from edgerun.models import args as A

# GGUF general.architecture -> edgerun model_type
ARCHITECTURES = {"qwen3moe": "qwen3_moe", "qwen35moe": "qwen3_5_moe"}
LOSSLESS = ("F32", "F16", "BF16")
ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2}
# GGML types read (gguf.quants dequantizes each; tests/bundle/test_gguf.py checks the list)
QUANT_TYPES = LOSSLESS + ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# tokenizer.ggml.pre -> the pre-tokenizer regex llama.cpp applies (src/llama-vocab.cpp); "gpt-2":
# the byte-level pre-tokenizer's own regex
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = {"gpt-2": None, "qwen2": _QWEN2, "qwen35": _QWEN35}
CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values of special and added tokens
SPLIT = re.compile(r"^(?P<stem>.*)-(?P<i>\d{5})-of-(?P<n>\d{5})\.gguf$")

# canonical name (after "model.layers.{i}.") -> GGUF name (after "blk.{i}."), as llama.cpp's
# convert_hf_to_gguf.py writes them; tests/bundle/test_gguf.py checks each against gguf's own
# TensorNameMap. A ".weight" / ".bias" suffix carries over.
GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm",
    "mlp.gate": "ffn_gate_inp",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "linear_attn.in_proj_qkv": "attn_qkv",
    "linear_attn.in_proj_z": "attn_gate",
    "linear_attn.in_proj_b": "ssm_beta",
    "linear_attn.in_proj_a": "ssm_alpha",
    "linear_attn.conv1d": "ssm_conv1d",
    "linear_attn.norm": "ssm_norm",
    "linear_attn.out_proj": "ssm_out",
}
POST_NORM = {"qwen3moe": "ffn_norm", "qwen35moe": "post_attention_norm"}
EXACT = {
    "mlp.experts.gate_up_proj": ("ffn_gate_exps.weight", "ffn_up_exps.weight"),
    "mlp.experts.down_proj": ("ffn_down_exps.weight",),
    "linear_attn.A_log": ("ssm_a",),
    "linear_attn.dt_bias": ("ssm_dt.bias",),
}


def gguf_names(name: str, arch: str) -> tuple[str, ...]:
    """The GGUF tensor(s) a canonical tensor comes from (two for the fused gate_up experts)."""
    if name in GLOBAL:
        return (GLOBAL[name],)
    _, _, i, rest = name.split(".", 3)
    if rest in EXACT:
        return tuple(f"blk.{i}.{p}" for p in EXACT[rest])
    stem, suffix = rest.rsplit(".", 1)
    table = {**LAYER, "post_attention_layernorm": POST_NORM[arch]}
    return (f"blk.{i}.{table[stem]}.{suffix}",)


def transform(name: str, arch: str) -> str:
    """Which llama.cpp conversion transform ``name`` went through ("" for none); see ``undo``."""
    if arch != "qwen35moe":
        return ""
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        return "norm"  # llama.cpp stores 1 + w for the (1 + w) RMSNorms
    for suffix, kind in (
        ("A_log", "a_log"),
        ("dt_bias", "v_rows1"),
        ("conv1d.weight", "conv1d"),
        ("in_proj_qkv.weight", "qkv"),
        ("in_proj_z.weight", "v_rows"),
        ("in_proj_a.weight", "v_rows1"),
        ("in_proj_b.weight", "v_rows1"),
        ("out_proj.weight", "v_cols"),
    ):
        if name.endswith(suffix):
            return kind
    return ""


@dataclass(frozen=True)
class Part:
    """One tensor as stored in a GGUF file."""

    name: str
    file: Path
    ggml_type: str
    shape: tuple[int, ...]  # torch order (GGUF's ne reversed)
    start: int  # absolute byte offset of its data in ``file``
    nbytes: int


@dataclass(frozen=True)
class GGUFEntry:
    """A canonical tensor made from GGUF ``parts``, with the fields of a safetensors TensorEntry
    (``start`` 0, ``end`` its size at ``dtype``: F32 when a part is quantized), so convert plans
    and addresses it like one. (Not a subclass: that module imports torch; planning must not.)"""

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int
    parts: tuple[Part, ...] = ()
    transform: str = ""
    heads: tuple[int, int, int, int] = (0, 0, 0, 0)  # DeltaNet k heads, v heads, k head dim, v head dim

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass
class GGUFCheckpoint:
    path: Path
    files: list[Path]
    arch: str  # general.architecture
    config: dict[str, Any]  # the HF config it stands for
    entries: dict[str, GGUFEntry]  # by canonical name (unmapped tensors by their GGUF name)
    tokenizer: dict[str, bytes]  # file name -> contents (tokenizer.json, tokenizer_config.json, ...)
    header_hashes: dict[str, str]  # file name -> blake2b of its header (metadata + tensor infos)
    problems: list[str]

    @property
    def config_hash(self) -> str:
        return F.part_hash(json.dumps(self.config, sort_keys=True).encode())


def is_gguf(path: str | Path) -> bool:
    return str(path).endswith(".gguf")


def split_files(path: Path) -> list[Path]:
    """``path`` alone, or every file of the split set it belongs to (a missing one is named)."""
    m = SPLIT.match(path.name)
    if not m:
        return [path]
    n = int(m["n"])
    files = [path.with_name(f"{m['stem']}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{path}: split GGUF set of {n} files lacks {', '.join(missing)}")
    return files


def _reader(path: Path):
    import gguf

    if not path.is_file():
        raise CheckpointError(f"{path}: no such GGUF file")
    try:
        return gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError) as exc:
        raise CheckpointError(f"{path}: not a readable GGUF file ({exc})") from exc


class _Meta:
    """Typed GGUF metadata that names the key (and the file) in every error."""

    def __init__(self, reader, path: Path) -> None:
        self.fields, self.path = reader.fields, path

    def get(self, key: str, default: Any = None) -> Any:
        f = self.fields.get(key)
        if f is None:
            return default
        value = f.contents()
        # GGUF floats are f32: 1e-6 reads back as 9.99999997e-07; take the shortest f32 repr
        return float(str(np.float32(value))) if isinstance(value, float) else value

    def require(self, key: str) -> Any:
        if key not in self.fields:
            raise ConfigError(f"{self.path}: GGUF key {key!r} is missing")
        return self.get(key)

    def count(self, key: str, hf_key: str, default: int | None = None) -> int:
        """An integer key, within what a config's ``hf_key`` may be (``A.SIZE_LIMITS``): checked
        before anything is sized from it."""
        value = self.require(key) if default is None else self.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"{self.path}: GGUF key {key!r} must be an integer, got {value!r}")
        lo, hi = A.SIZE_LIMITS.get(hf_key, (0, 1 << 31))
        if not lo <= value <= hi:
            raise ConfigError(f"{self.path}: GGUF key {key!r} is {value}; a model's is {lo} to {hi}")
        return value


def _hf_config(meta: _Meta, arch: str, tensors: dict[str, Part]) -> dict[str, Any]:
    """The HF config the GGUF metadata describes (the keys convert_hf_to_gguf.py writes)."""
    p = arch + "."
    scaling = meta.get(p + "rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise ConfigError(
            f"{meta.path}: GGUF key '{p}rope.scaling.type' is {scaling!r}; only 'none' is supported"
        )
    n_layers = meta.count(p + "block_count", "num_hidden_layers") - meta.count(
        p + "nextn_predict_layers", "mtp_num_hidden_layers", 0
    )
    heads = meta.count(p + "attention.head_count", "num_attention_heads")
    hidden = meta.count(p + "embedding_length", "hidden_size")
    head_dim = meta.count(p + "attention.key_length", "head_dim", max(hidden // heads, 1))
    embd = tensors.get("token_embd.weight")
    vocab = embd.shape[0] if embd else len(meta.require("tokenizer.ggml.tokens"))
    rope = {"rope_type": "default", "rope_theta": meta.get(p + "rope.freq_base", 10000.0)}
    cfg: dict[str, Any] = dict(
        model_type=ARCHITECTURES[arch],
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        num_key_value_heads=meta.get(p + "attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=meta.require(p + "attention.layer_norm_rms_epsilon"),
        rope_parameters=rope,
        max_position_embeddings=meta.get(p + "context_length", 32768),
        num_experts=meta.require(p + "expert_count"),
        num_experts_per_tok=meta.require(p + "expert_used_count"),
        moe_intermediate_size=meta.require(p + "expert_feed_forward_length"),
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
    )
    if arch == "qwen3moe":
        # llama.cpp always renormalises qwen3moe's top-k weights; layers without a router are dense
        cfg["norm_topk_prob"] = True
        cfg["mlp_only_layers"] = [i for i in range(n_layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors]
        if cfg["mlp_only_layers"]:
            cfg["intermediate_size"] = meta.require(p + "feed_forward_length")
    else:
        v_heads = meta.require(p + "ssm.time_step_rank")
        rope["partial_rotary_factor"] = meta.require(p + "rope.dimension_count") / head_dim
        sections = meta.get(p + "rope.dimension_sections")
        if sections:
            rope["mrope_section"] = list(sections[:3])
        cfg.update(
            shared_expert_intermediate_size=meta.get(p + "expert_shared_feed_forward_length", 0),
            linear_conv_kernel_dim=meta.require(p + "ssm.conv_kernel"),
            linear_key_head_dim=meta.require(p + "ssm.state_size"),
            linear_num_key_heads=meta.require(p + "ssm.group_count"),
            linear_num_value_heads=v_heads,
            linear_value_head_dim=meta.require(p + "ssm.inner_size") // v_heads,
            mtp_num_hidden_layers=meta.get(p + "nextn_predict_layers", 0),
            # which layers are DeltaNet: those with an ssm_a tensor
            layer_types=[
                A.LINEAR_ATTENTION if f"blk.{i}.ssm_a" in tensors else A.FULL_ATTENTION
                for i in range(n_layers)
            ],
        )
    return {k: v for k, v in cfg.items() if v is not None}


def build_tokenizer(meta: _Meta) -> dict[str, bytes]:
    """tokenizer.json (+ tokenizer_config.json with the chat template, generation_config.json)
    rebuilt from the tokenizer.ggml.* keys; byte-level BPE only, with a known pre-tokenizer."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    kind = meta.require("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ConfigError(
            f"{meta.path}: GGUF key 'tokenizer.ggml.model' is {kind!r}; only 'gpt2' (byte-level BPE) "
            "tokenizers can be rebuilt"
        )
    pre = meta.get("tokenizer.ggml.pre", "gpt-2")
    if pre not in PRE_TOKENIZERS:
        raise ConfigError(
            f"{meta.path}: GGUF key 'tokenizer.ggml.pre' is {pre!r}; supported: {', '.join(PRE_TOKENIZERS)}"
        )
    tokens = meta.require("tokenizer.ggml.tokens")
    types = meta.get("tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in meta.require("tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    regex = PRE_TOKENIZERS[pre]
    if regex is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == CONTROL]
    )
    tok.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == USER_DEFINED]
    )

    def text(key: str) -> str | None:
        i = meta.get(key)
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    tcfg = {
        "bos_token": text("tokenizer.ggml.bos_token_id"),
        "eos_token": text("tokenizer.ggml.eos_token_id"),
    }
    template = meta.get("tokenizer.chat_template")
    if template is not None:
        tcfg["chat_template"] = template
    eos = [meta.get(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
    out = {
        "tokenizer.json": tok.to_str().encode(),
        "tokenizer_config.json": json.dumps(tcfg, indent=1).encode(),
    }
    eos_ids = list(dict.fromkeys(i for i in eos if i is not None))
    if eos_ids:
        out["generation_config.json"] = json.dumps({"eos_token_id": eos_ids}).encode()
    return out


def open_gguf(path: str | Path, with_tokenizer: bool = True) -> GGUFCheckpoint:
    """Headers only: the architecture, config, canonical entries and tokenizer of a GGUF file or
    split set. Unknown architectures are refused here; problems with single tensors (unknown
    quant type, missing tensor) are collected for the conversion plan to report together."""
    from edgerun.models.inventory import tensor_specs
    from edgerun.models.registry import architecture

    path = Path(path)
    files = split_files(path)
    readers = [_reader(f) for f in files]
    meta = _Meta(readers[0], files[0])
    arch = meta.require("general.architecture")
    if arch not in ARCHITECTURES:
        raise ConfigError(
            f"{files[0]}: GGUF architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
        )
    parts: dict[str, Part] = {}
    for f, r in zip(files, readers):
        for t in r.tensors:
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            parts[t.name] = Part(t.name, f, t.tensor_type.name, shape, int(t.data_offset), int(t.n_bytes))
        _check_spans(f, [p for p in parts.values() if p.file == f])
    config = _hf_config(meta, arch, parts)
    vocab = config["vocab_size"]
    for key in ("eos_token_id", "bos_token_id"):
        if config.get(key) is not None and not 0 <= config[key] < vocab:
            raise ConfigError(
                f"{files[0]}: GGUF key 'tokenizer.ggml.{key}' is {config[key]}, outside the vocabulary of {vocab}"
            )
    source = f"{files[0]} (GGUF metadata)"
    args = architecture(config["model_type"], source).model_args(config, source)
    problems, entries, used = [], {}, set()
    heads = (args.linear_num_key_heads, args.linear_num_value_heads, args.linear_key_head_dim)
    heads += (args.linear_value_head_dim,)
    for spec in tensor_specs(args):
        names = gguf_names(spec.name, arch)
        fused = names[0].replace("_gate_exps", "_gate_up_exps")
        if fused in parts:  # convert_hf_to_gguf.py --fuse-gate-up-exps: already [E, 2I, D]
            names = (fused,)
        missing = [n for n in names if n not in parts]
        if missing:
            problems.append(f"{files[0]}: no tensor {missing[0]!r} (for {spec.name!r})")
            continue
        src = tuple(parts[n] for n in names)
        used.update(names)
        entries[spec.name] = _entry(spec.name, src, transform(spec.name, arch), heads)
    for name, p in parts.items():
        m = re.match(r"blk\.(\d+)\.", name)
        if name in used:
            continue
        key = f"mtp.{name}" if m and int(m[1]) >= args.num_hidden_layers else name  # MTP: ignored
        entries[key] = GGUFEntry(name, p.file, "F32", p.shape, 0, math.prod(p.shape) * 4)
    for p in parts.values():
        if p.ggml_type not in QUANT_TYPES:
            problems.append(
                f"{p.file}: tensor {p.name!r} has GGML type {p.ggml_type}; supported: {', '.join(QUANT_TYPES)}"
            )
    return GGUFCheckpoint(
        path=path,
        files=files,
        arch=arch,
        config=config,
        entries=entries,
        tokenizer=build_tokenizer(meta) if with_tokenizer else {},
        header_hashes={f.name: _header_hash(f, r.data_offset) for f, r in zip(files, readers)},
        problems=problems,
    )


def _check_spans(f: Path, parts: list[Part]) -> None:
    """Each tensor's data inside the file and apart from every other's (a damaged offset would
    read another tensor's bytes, or past the end), named with its offsets."""
    size = f.stat().st_size
    last = None
    for p in sorted(parts, key=lambda p: p.start):
        if p.start + p.nbytes > size:
            raise CheckpointError(
                f"{f}: tensor {p.name!r} spans bytes [{p.start}, {p.start + p.nbytes}), past the end of the file ({size} bytes)"
            )
        if last is not None and p.start < last.start + last.nbytes:
            raise CheckpointError(
                f"{f}: tensors {last.name!r} (bytes [{last.start}, {last.start + last.nbytes})) and {p.name!r} "
                f"(from byte {p.start}) overlap: the file is damaged"
            )
        last = p


def _entry(name: str, parts: tuple[Part, ...], kind: str, heads: tuple[int, int, int, int]) -> GGUFEntry:
    first = parts[0]
    shape = first.shape
    if len(parts) == 2:  # gate and up experts [E, I, D] -> [E, 2I, D]
        shape = (shape[0], sum(p.shape[1] for p in parts), *shape[2:])
    if kind == "conv1d":  # llama.cpp squeezed [C, 1, K] to [C, K]
        shape = (shape[0], 1, *shape[1:])
    types = {p.ggml_type for p in parts}
    dtype = first.ggml_type if len(types) == 1 and first.ggml_type in LOSSLESS else "F32"
    nbytes = math.prod(shape) * ITEMSIZE[dtype]
    label = "+".join(p.name for p in parts)
    return GGUFEntry(label, first.file, dtype, shape, 0, nbytes, parts, kind, heads)


def _header_hash(path: Path, data_offset: int) -> str:
    with open(path, "rb") as f:
        return F.part_hash(f.read(data_offset))


def hf_config(path: str | Path) -> dict[str, Any]:
    """The HF config of a GGUF file, from its header alone (``edgerun plan --checkpoint``)."""
    return open_gguf(path, with_tokenizer=False).config


# --------------------------------------------------------------------------------------------
# Reading tensor data


def _regroup(t, dim: int, heads: tuple[int, int, int, int], head_dim: int):
    """Undo llama.cpp's V-head reorder along ``dim``: it tiles V heads ([K0, K1, K0, K1, ...])
    for ggml's broadcast where HF groups them by K head ([K0, K0, K1, K1, ...])."""
    nk, nv = heads[0], heads[1]
    if nk == nv:
        return t
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], nv // nk, nk, head_dim, *shape[dim + 1 :])
    return t.transpose(dim, dim + 1).reshape(shape)


def undo(kind: str, t, heads: tuple[int, int, int, int]):
    """Invert llama.cpp's qwen35moe transform ``kind`` (see :func:`transform`) on fp32 ``t``."""
    import torch

    nk, _, hk, hv = heads
    if kind == "norm":
        return t - 1
    if kind == "a_log":  # stored A = -exp(A_log)
        return _regroup(torch.log(-t), 0, heads, 1)
    if kind == "v_rows1":
        return _regroup(t, 0, heads, 1)
    if kind == "v_rows":
        return _regroup(t, 0, heads, hv)
    if kind == "v_cols":
        return _regroup(t, 1, heads, hv)
    if kind in ("qkv", "conv1d"):  # q and k rows (channels) stay; the V part is reordered
        qk = 2 * nk * hk
        t = torch.cat([t[:qk], _regroup(t[qk:], 0, heads, hv)])
        return t.unsqueeze(1) if kind == "conv1d" else t
    return t


class GGUFTensors:
    """Reads :class:`GGUFEntry` data with positional reads (no mmap): a tensor with a transform
    whole, one without by the dim-0 slices (rows, or experts) a read covers; the last slice read
    is kept, so a tensor read in chunks is dequantized once."""

    def __init__(self) -> None:
        self.fds: dict[Path, int] = {}
        self.last: tuple[str, int, int, Any] | None = None

    def _raw(self, p: Part, r0: int, r1: int):
        """Dim-0 slices [r0, r1) of part ``p`` as fp32 (or its own dtype when lossless)."""
        import gguf
        import torch

        from edgerun.safetensors_io import DTYPES

        per = p.nbytes // p.shape[0] if p.shape else p.nbytes
        n = (r1 - r0) * per
        fd = self.fds.get(p.file)
        if fd is None:
            fd = self.fds[p.file] = os.open(p.file, os.O_RDONLY)
        buf = bytearray(n)
        if os.preadv(fd, [buf], p.start + r0 * per) != n:
            raise CheckpointError(f"{p.file}: short read of tensor {p.name!r} at byte {p.start + r0 * per}")
        shape = (r1 - r0, *p.shape[1:])
        if p.ggml_type in LOSSLESS:
            return torch.frombuffer(buf, dtype=DTYPES[p.ggml_type]).view(shape)
        qtype = gguf.GGMLQuantizationType[p.ggml_type]
        rows = np.frombuffer(buf, dtype=np.uint8).reshape(-1, n // max(1, math.prod(shape[:-1])))
        return torch.from_numpy(gguf.quants.dequantize(rows, qtype).copy()).view(shape)

    def slices(self, e: GGUFEntry, r0: int, r1: int):
        """Dim-0 slices [r0, r1) of ``e`` in its canonical layout and dtype."""
        import torch

        from edgerun.safetensors_io import DTYPES

        if self.last and self.last[:3] == (e.name, r0, r1):
            return self.last[3]
        t = torch.cat([self._raw(p, r0, r1) for p in e.parts], dim=1) if len(e.parts) > 1 else None
        if t is None:
            t = self._raw(e.parts[0], r0, r1)
        if e.transform:
            t = undo(e.transform, t.float(), e.heads)
        t = t.to(DTYPES[e.dtype]).contiguous()
        if not torch.isfinite(t).all():
            raise CheckpointError(f"{e.file}: tensor {e.name!r} holds a non-finite value")
        self.last = (e.name, r0, r1, t)
        return t

    def read(self, e: GGUFEntry, offset: int, nbytes: int):
        """Bytes [offset, offset + nbytes) of ``e`` (canonical layout) as a flat tensor of its dtype."""
        item = ITEMSIZE[e.dtype]
        if e.transform or len(e.shape) < 2:
            r0, r1, row = 0, e.shape[0], e.nbytes // e.shape[0]
        else:
            row = e.nbytes // e.shape[0]
            r0, r1 = offset // row, -(-(offset + nbytes) // row)
        t = self.slices(e, r0, r1).reshape(-1)
        lo = (offset - r0 * row) // item
        return t[lo : lo + nbytes // item]

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()
