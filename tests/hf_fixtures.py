"""Tiny random Hugging Face checkpoints of both architectures, built with ``transformers``
(a test dependency only) and saved with ``save_pretrained``; plus rewrites into the other
on-disk layouts real checkpoints use (fused experts, multimodal prefix, sharded with an index)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ARCHS = ("qwen3_moe", "qwen3_5_moe")

QWEN3_MOE = dict(
    vocab_size=97,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    moe_intermediate_size=24,
    num_experts=6,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    mlp_only_layers=[1],
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
QWEN3_5_MOE = dict(
    vocab_size=97,
    hidden_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    moe_intermediate_size=24,
    shared_expert_intermediate_size=40,
    num_experts=6,
    num_experts_per_tok=2,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
    linear_conv_kernel_dim=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [1, 1, 0],
        "mrope_interleaved": True,
    },
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


def tiny_moe_args(hidden: int = 32, inter: int = 16, experts: int = 2, top_k: int = 1):
    """ModelArgs of a one-layer qwen3_moe, for tests that need only an expert geometry."""
    from edgerun.models.registry import load_args

    cfg = dict(
        model_type="qwen3_moe", vocab_size=16, hidden_size=hidden, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, moe_intermediate_size=inter,
        num_experts=experts, num_experts_per_tok=top_k,
    )  # fmt: skip
    return load_args(cfg)[1]


def _torch_only_transformers():
    """transformers with its models' own torch code: where flash-linear-attention (fla-core, an
    edgerun [gpu] dependency) is installed, transformers would run the oracle's DeltaNet through
    it (TF32 products), which is not the fp32 reference the oracle tests hold edgerun to. The
    modeling modules pick fla at import, so they are imported with fla hidden, then fla is
    importable again for edgerun's own kernels."""
    import sys

    hidden = "fla" not in sys.modules
    if hidden:
        sys.modules["fla"] = None  # import fla raises ImportError
    try:
        import transformers as tf
        import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe  # noqa: F401
    finally:
        if hidden:
            del sys.modules["fla"]
    return tf


def build_hf(arch: str, out: Path, seed: int = 0, **overrides):
    """Random HF model saved to ``out``; returns the (fp32, eval) HF model."""
    tf = _torch_only_transformers()

    torch.manual_seed(seed)
    if arch == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**{**QWEN3_MOE, **overrides})
        model = tf.Qwen3MoeForCausalLM(cfg)
    else:
        cfg = tf.Qwen3_5MoeTextConfig(**{**QWEN3_5_MOE, **overrides})
        model = tf.Qwen3_5MoeForCausalLM(cfg)
    with torch.no_grad():
        # Random init leaves norms at 1 / 0 and routers near zero; perturb everything so a
        # wrong norm convention or routing bug cannot hide.
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.01, 4).log())
            elif "norm" in name or name.endswith("dt_bias"):
                p.add_(torch.randn_like(p) * 0.3)
            elif ".mlp.gate." in name or "experts" in name:
                p.copy_(torch.randn_like(p) * 0.2)
    model.eval()
    model.save_pretrained(out)
    return model


CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_bpe_tokenizer(out: Path, text: str, eos_ids: list[int]) -> Path:
    """A 300-token byte-level BPE trained on ``text``, ChatML specials and chat template, EOS ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([text] * 20, trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "bos_token": None, "chat_template": CHAT_TEMPLATE})
    )
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}))
    return out


def _per_expert_to_fused(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out, groups = {}, {}
    for name, t in tensors.items():
        if ".mlp.experts." in name and name.endswith(".weight"):
            prefix, rest = name.split(".mlp.experts.")
            e, part, _ = rest.split(".")
            groups.setdefault(prefix, {})[(int(e), part)] = t
        else:
            out[name] = t
    for prefix, parts in groups.items():
        n = 1 + max(e for e, _ in parts)
        out[f"{prefix}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([parts[(e, "gate_proj")], parts[(e, "up_proj")]]) for e in range(n)]
        ).contiguous()
        out[f"{prefix}.mlp.experts.down_proj"] = torch.stack(
            [parts[(e, "down_proj")] for e in range(n)]
        ).contiguous()
    return out


def rewrite(src: Path, dst: Path, fused=False, multimodal=False, shards=1, extra=None, dtype=None) -> Path:
    """Copy an HF checkpoint into another layout."""
    dst.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(src / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    if fused:
        tensors = _per_expert_to_fused(tensors)
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    if multimodal:
        tensors = {
            ("model.language_model." + k[6:] if k.startswith("model.") else k): v for k, v in tensors.items()
        }
        tensors["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(8, 4)
        tensors["model.visual.merger.linear_fc1.weight"] = torch.zeros(4, 4)
        tensors["mtp.fc.weight"] = torch.zeros(4, 4)
        tensors["mtp.layers.0.mlp.experts.gate_up_proj"] = torch.zeros(2, 4, 4)
        outer = cfg["model_type"].removesuffix("_text")
        cfg = {
            "model_type": outer,
            "architectures": ["Qwen3_5MoeForConditionalGeneration"],
            "text_config": {**cfg, "model_type": outer + "_text"},
            "vision_config": {"depth": 1},
            "tie_word_embeddings": False,
        }
    if extra:
        tensors.update(extra)
    names = sorted(tensors)
    if shards == 1:
        save_file(
            {k: tensors[k].contiguous() for k in names},
            str(dst / "model.safetensors"),
            metadata={"format": "pt"},
        )
    else:
        weight_map = {}
        per = -(-len(names) // shards)
        for i in range(shards):
            fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            chunk = names[i * per : (i + 1) * per]
            save_file(
                {k: tensors[k].contiguous() for k in chunk}, str(dst / fname), metadata={"format": "pt"}
            )
            weight_map.update({k: fname for k in chunk})
        (dst / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map})
        )
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def add_mtp(src: Path, dst: Path, seed: int = 0, fused: bool = False) -> Path:
    """A copy of a tiny qwen3_5_moe checkpoint with an MTP head (``mtp.*``, as the published
    Qwen3.5/3.6 checkpoints name it) and ``mtp_num_hidden_layers`` 1 in its config. The head's
    decoder layer is the first full-attention layer's tensors, perturbed (so its drafts are
    related to the model's own predictions); fc and the three norms are random."""
    tensors = load_file(str(src / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    template = _per_expert_to_fused(tensors) if fused else tensors
    g = torch.Generator().manual_seed(seed)
    prefix = f"model.layers.{cfg['layer_types'].index('full_attention')}."
    extra = {}
    for name, t in template.items():
        if name.startswith(prefix):
            extra["mtp.layers.0." + name[len(prefix) :]] = t + torch.randn(t.shape, generator=g) * 0.05
    D = cfg["hidden_size"]
    extra["mtp.fc.weight"] = torch.randn(D, 2 * D, generator=g) / (2 * D) ** 0.5
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        extra[f"mtp.{n}.weight"] = torch.randn(D, generator=g) * 0.3
    rewrite(src, dst, fused=fused, extra=extra)
    (dst / "config.json").write_text(json.dumps({**cfg, "mtp_num_hidden_layers": 1}))
    return dst
