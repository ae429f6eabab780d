"""Tiny GGUF files written from the tiny HF checkpoints the way llama.cpp's convert_hf_to_gguf.py
writes them (conversion/qwen.py, base.py): names from gguf's own TensorNameMap, experts stacked
per layer, norms and 1-D tensors in F32, the same metadata keys, and for qwen35moe its DeltaNet
transforms (A -> -exp(A_log), dt_bias -> ssm_dt.bias, conv1d squeezed, (1 + w) norms stored as
1 + w, V heads reordered from grouped to tiled). Written independently of edgerun's reader, so
a test that converts these files back checks the reader's inverse of each transform."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

GGUF_ARCH = {"qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE, "qwen3_5_moe": gguf.MODEL_ARCH.QWEN35MOE}
Q = gguf.GGMLQuantizationType


def _reorder_v_heads(t: torch.Tensor, dim: int, nk: int, r: int, hd: int) -> torch.Tensor:
    """llama.cpp's _LinearAttentionVReorderBase._reorder_v_heads: grouped -> tiled V heads."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], nk, r, hd, *shape[dim + 1 :])
    perm = list(range(t.dim()))
    perm[dim], perm[dim + 1] = perm[dim + 1], perm[dim]
    return t.permute(*perm).contiguous().reshape(*shape)


def llama_cpp_tensors(cfg: dict, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF tensors -> llama.cpp's (HF-style names, llama.cpp's values): experts stacked, and for
    qwen3_5_moe the transforms of Qwen3NextModel / _LinearAttentionVReorderBase.modify_tensors."""
    out, experts = {}, {}
    for name, t in tensors.items():
        if ".mlp.experts." in name:
            prefix, rest = name.split(".mlp.experts.")
            e, part, _ = rest.split(".")
            experts.setdefault((prefix, part), {})[int(e)] = t
        else:
            out[name] = t
    for (prefix, part), by_e in experts.items():
        out[f"{prefix}.mlp.experts.{part}.weight"] = torch.stack([by_e[e] for e in sorted(by_e)])
    if cfg["model_type"] == "qwen3_moe":
        return out
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    hk, hv, r = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], nv // nk
    done = {}
    for name, t in out.items():
        if "linear_attn." in name and nk != nv:
            if ".in_proj_qkv." in name:
                t = torch.cat([t[: 2 * nk * hk], _reorder_v_heads(t[2 * nk * hk :], 0, nk, r, hv)])
            elif ".in_proj_z." in name:
                t = _reorder_v_heads(t, 0, nk, r, hv)
            elif ".in_proj_b." in name or ".in_proj_a." in name:
                t = _reorder_v_heads(t, 0, nk, r, 1)
            elif ".A_log" in name or ".dt_bias" in name:
                t = _reorder_v_heads(t.unsqueeze(-1), 0, nk, r, 1).squeeze(-1)
            elif ".conv1d" in name:
                d = t.squeeze()
                t = torch.cat([d[: 2 * nk * hk], _reorder_v_heads(d[2 * nk * hk :], 0, nk, r, hv)])
            elif ".out_proj." in name:
                t = _reorder_v_heads(t, 1, nk, r, hv)
        if name.endswith(".A_log"):
            t = -torch.exp(t)
        elif name.endswith(".dt_bias"):
            name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
        elif "conv1d" in name:
            t = t.squeeze()
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            t = t + 1
        done[name] = t
    return done


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """A plain Q4_K quantizer (gguf.quants has no Python one): rows of 256-value blocks, each 8
    sub-blocks of 32 with a 6-bit scale and min; layout of ggml's block_q4_K (d, dmin, 12 bytes
    of packed scales/mins, 128 bytes of nibbles)."""
    rows, n = x.shape
    b = x.reshape(-1, 8, 32).astype(np.float32)
    lo = np.minimum(b.min(-1), 0)
    scale = (b.max(-1) - lo) / 15
    d = np.maximum(scale.max(-1), 1e-8) / 63
    dmin = np.maximum((-lo).max(-1), 1e-8) / 63
    sc = np.clip(np.round(scale / d[:, None]), 1, 63).astype(np.uint8)
    m = np.clip(np.round(-lo / dmin[:, None]), 0, 63).astype(np.uint8)
    d16, dmin16 = d.astype(np.float16), dmin.astype(np.float16)
    step = d16.astype(np.float32)[:, None] * sc
    off = dmin16.astype(np.float32)[:, None] * m
    q = np.clip(np.round((b + off[..., None]) / step[..., None]), 0, 15).astype(np.uint8)
    packed = np.zeros((b.shape[0], 12), np.uint8)
    packed[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)  # sub-blocks 2k (low) and 2k+1 (high)
    block = np.concatenate(
        [d16.view(np.uint8).reshape(-1, 2), dmin16.view(np.uint8).reshape(-1, 2), packed, qs], axis=1
    )
    return block.reshape(rows, n // 256 * 144)


def _store(t: torch.Tensor, qtype) -> tuple[np.ndarray, Q]:
    """The bytes llama.cpp writes for ``t`` at ``qtype``; rows that do not fit its block stay F32."""
    a = t.float().numpy()
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if qtype == Q.F32 or a.shape[-1] % block:
        return a, Q.F32
    if qtype == Q.Q4_K:
        return quantize_q4_k(a.reshape(-1, a.shape[-1])).reshape(*a.shape[:-1], -1), qtype
    return gguf.quants.quantize(a, qtype), qtype


def write_gguf(
    ckpt: Path,
    out: Path,
    qtype=Q.F32,
    experts_qtype=None,
    pre: str = "gpt-2",
    split_max_tensors: int = 0,
    fuse_gate_up: bool = False,
) -> Path:
    """The GGUF llama.cpp would write for HF checkpoint ``ckpt`` (with a byte-level BPE
    tokenizer.json) at ``qtype`` for 2-D+ tensors (routed experts at ``experts_qtype``);
    ``fuse_gate_up``: as convert_hf_to_gguf.py --fuse-gate-up-exps. Returns the first file."""
    cfg = json.loads((ckpt / "config.json").read_text())
    arch = GGUF_ARCH[cfg["model_type"].removesuffix("_text")]
    n = cfg["num_hidden_layers"]
    out.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(out, gguf.MODEL_ARCH_NAMES[arch], split_max_tensors=split_max_tensors)
    w.add_block_count(n)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    if "intermediate_size" in cfg:
        w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    rope = cfg["rope_parameters"]
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_count(cfg.get("num_local_experts", cfg.get("num_experts")))
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if arch == gguf.MODEL_ARCH.QWEN35MOE:
        w.add_rope_dimension_sections((list(rope["mrope_section"]) + [0] * 4)[:4])
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
        w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
        w.add_ssm_state_size(cfg["linear_key_head_dim"])
        w.add_ssm_group_count(cfg["linear_num_key_heads"])
        w.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
        w.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
        w.add_full_attention_interval(cfg.get("full_attention_interval", 4))
        w.add_rope_dimension_count(int(cfg["head_dim"] * rope["partial_rotary_factor"]))
    _add_tokenizer(w, ckpt, pre)

    names = gguf.get_tensor_name_map(arch, n)
    tensors = llama_cpp_tensors(cfg, load_file(str(ckpt / "model.safetensors")))
    for gate in [k for k in tensors if fuse_gate_up and k.endswith("experts.gate_proj.weight")]:
        up = tensors.pop(gate.replace("gate_proj", "up_proj"))
        tensors[gate.replace("gate_proj", "gate_up_proj")] = torch.cat([tensors.pop(gate), up], dim=1)
    for name, t in sorted(tensors.items()):
        new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert new is not None, name
        if t.dim() <= 1 or new.endswith("_norm.weight"):
            q = Q.F32
        else:
            q = experts_qtype if experts_qtype is not None and "_exps" in new else qtype
        if q == Q.BF16:
            data, q = t.to(torch.bfloat16).view(torch.int16).numpy(), Q.BF16
            w.add_tensor(new, data, raw_shape=list(t.shape), raw_dtype=q)
        else:
            data, q = _store(t, q)
            w.add_tensor(new, data, raw_dtype=q if q != Q.F32 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    first = sorted(out.parent.glob(out.stem + "*.gguf"))[0]
    return first


def _add_tokenizer(w: gguf.GGUFWriter, ckpt: Path, pre: str) -> None:
    """As llama.cpp's _set_vocab_gpt2: tokens by id, CONTROL for special added tokens, merges,
    special ids from tokenizer_config.json, the chat template."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    doc = json.loads((ckpt / "tokenizer.json").read_text())
    vocab = tok.get_vocab()
    by_id = {i: t for t, i in vocab.items()}
    special = {a["content"] for a in doc["added_tokens"] if a["special"]}
    tokens = [by_id[i] for i in range(len(by_id))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in doc["model"]["merges"]])
    tcfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    if tcfg.get("eos_token"):
        w.add_eos_token_id(vocab[tcfg["eos_token"]])
    if tcfg.get("chat_template"):
        w.add_chat_template(tcfg["chat_template"])
