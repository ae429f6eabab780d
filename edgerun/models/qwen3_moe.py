"""Qwen3-MoE (Qwen3-30B-A3B): GQA attention with q/k RMSNorm and RoPE; top-k routed experts,
``norm_topk_prob`` honoured; optional dense-MLP layers (``mlp_only_layers``, ``decoder_sparse_step``)."""

from __future__ import annotations

from typing import Any

from edgerun.errors import ConfigError
from edgerun.models import args as A
from edgerun.models.args import ConfigReader, ModelArgs
from edgerun.models.inventory import tensor_specs  # noqa: F401  (the provider API's tensor_specs)

MODEL_TYPES = ("qwen3_moe",)


def model_args(cfg: dict[str, Any], source: str = "config.json") -> ModelArgs:
    cfg = A.text_config(cfg)
    r = ConfigReader(cfg, source)
    n_layers = r.require("num_hidden_layers")
    hidden = r.require("hidden_size")
    heads = r.require("num_attention_heads")
    n_experts = r.require("num_experts", aliases=("num_local_experts",))
    step = r.get("decoder_sparse_step", 1)
    mlp_only = set(r.get("mlp_only_layers", [], list))
    moe_layers = tuple(
        i for i in range(n_layers) if i not in mlp_only and n_experts > 0 and step > 0 and (i + 1) % step == 0
    )
    if r.get("use_sliding_window", False, bool):
        raise ConfigError(f"{source}: use_sliding_window=true is not supported")
    theta, partial, section = A.rope_settings(r)
    args = ModelArgs(
        model_type="qwen3_moe",
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
        num_experts=n_experts,
        num_experts_per_tok=r.require("num_experts_per_tok"),
        moe_intermediate_size=r.require("moe_intermediate_size"),
        intermediate_size=r.get("intermediate_size", 0),
        norm_topk_prob=r.get("norm_topk_prob", False, bool),
        attention_bias=r.get("attention_bias", False, bool),
        tie_word_embeddings=r.get("tie_word_embeddings", False, bool),
        layer_types=(A.FULL_ATTENTION,) * n_layers,
        moe_layers=moe_layers,
        bos_token_id=r.get("bos_token_id", None),
        eos_token_ids=A.eos_ids(cfg),
    )
    A.validate(args, source)
    return args


def __getattr__(name: str):
    # the torch model class, made on first use: resolving and planning an architecture imports no torch
    if name == "Model":
        from edgerun.models.base import CausalLM

        return CausalLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
