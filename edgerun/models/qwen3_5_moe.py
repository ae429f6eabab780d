"""Qwen3.5 / Qwen3.6 MoE (Qwen3.6-35B-A3B): hybrid stack given by ``layer_types``:
Gated DeltaNet linear attention and gated full attention (output gate, partial rotary);
routed experts (top-k, always renormalised) plus a shared expert behind a sigmoid gate;
RMSNorm weights stored zero-centred and applied as (1 + w). The MTP head is not loaded."""

from __future__ import annotations

from typing import Any

from edgerun.errors import ConfigError
from edgerun.models import args as A
from edgerun.models.args import ConfigReader, ModelArgs
from edgerun.models.inventory import tensor_specs  # noqa: F401  (the provider API's tensor_specs)

MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")


def model_args(cfg: dict[str, Any], source: str = "config.json") -> ModelArgs:
    cfg = A.text_config(cfg)
    r = ConfigReader(cfg, source)
    n_layers = r.require("num_hidden_layers")
    hidden = r.require("hidden_size")
    heads = r.require("num_attention_heads")
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        interval = r.get("full_attention_interval", 4)
        layer_types = [
            A.LINEAR_ATTENTION if (i + 1) % interval else A.FULL_ATTENTION for i in range(n_layers)
        ]
    if not isinstance(layer_types, list) or len(layer_types) != n_layers:
        raise ConfigError(f"{source}: key 'layer_types' must list {n_layers} entries (num_hidden_layers)")
    for i, t in enumerate(layer_types):
        if t not in (A.FULL_ATTENTION, A.LINEAR_ATTENTION):
            raise ConfigError(
                f"{source}: layer_types[{i}] = {t!r}; expected {A.FULL_ATTENTION!r} or {A.LINEAR_ATTENTION!r}"
            )
    theta, partial, section = A.rope_settings(r, partial_default=0.25)  # the reference's default here
    mtp = r.get("mtp_num_hidden_layers", 0)
    args = ModelArgs(
        model_type="qwen3_5_moe",
        vocab_size=r.require("vocab_size"),
        hidden_size=hidden,
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        num_key_value_heads=r.get("num_key_value_heads", heads),
        head_dim=r.get("head_dim", hidden // heads),
        rms_norm_eps=r.get("rms_norm_eps", 1e-6, float),
        rope_theta=theta,
        partial_rotary_factor=partial,
        mrope_section=section,
        max_position_embeddings=r.get("max_position_embeddings", 32768),
        num_experts=r.require("num_experts", aliases=("num_local_experts",)),
        num_experts_per_tok=r.require("num_experts_per_tok"),
        moe_intermediate_size=r.require("moe_intermediate_size"),
        shared_expert_intermediate_size=r.get("shared_expert_intermediate_size", 0),
        norm_topk_prob=True,
        attention_bias=r.get("attention_bias", False, bool),
        tie_word_embeddings=r.get("tie_word_embeddings", False, bool),
        attn_output_gate=True,
        norm_unit_offset=True,
        layer_types=tuple(layer_types),
        moe_layers=tuple(range(n_layers)),
        linear_conv_kernel_dim=r.get("linear_conv_kernel_dim", 4),
        linear_key_head_dim=r.get("linear_key_head_dim", 128),
        linear_value_head_dim=r.get("linear_value_head_dim", 128),
        linear_num_key_heads=r.get("linear_num_key_heads", 16),
        linear_num_value_heads=r.get("linear_num_value_heads", 32),
        bos_token_id=r.get("bos_token_id", None),
        eos_token_ids=A.eos_ids(cfg),
        mtp_num_hidden_layers=mtp,
    )
    A.validate(args, source)
    return args


def __getattr__(name: str):
    # the torch model class, made on first use: resolving and planning an architecture imports no torch
    if name == "Model":
        from edgerun.models.base import CausalLM

        return CausalLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
