"""``example_moe``: Qwen3-MoE decoder blocks under a config vocabulary of its own.

An architecture module implements provider API 1: ``MODEL_TYPES``, ``model_args(cfg, source)``
returning :class:`~edgerun.models.args.ModelArgs`, ``Model`` (a
:class:`~edgerun.models.base.CausalLM`) and ``tensor_specs(args)``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from edgerun.models import qwen3_moe
from edgerun.models.args import ModelArgs, TensorSpec
from edgerun.models.base import CausalLM
from edgerun.models.base import tensor_specs as _specs

MODEL_TYPES = ("example_moe",)

# example_moe config key -> the Qwen3-MoE key it means; every other key passes through
KEYS = {
    "n_vocab": "vocab_size",
    "n_layer": "num_hidden_layers",
    "d_model": "hidden_size",
    "n_head": "num_attention_heads",
    "n_kv_head": "num_key_value_heads",
    "d_head": "head_dim",
    "d_ff": "intermediate_size",
    "dense_layers": "mlp_only_layers",
    "n_expert": "num_experts",
    "n_expert_active": "num_experts_per_tok",
    "d_expert": "moe_intermediate_size",
    "n_ctx": "max_position_embeddings",
}


def model_args(cfg: dict[str, Any], source: str = "config.json") -> ModelArgs:
    args = qwen3_moe.model_args({KEYS.get(k, k): v for k, v in cfg.items()}, source)
    return dataclasses.replace(args, model_type=MODEL_TYPES[0])


class Model(CausalLM):
    """The shared decoder shell: canonical tensor names (``model.layers.N.mlp.experts...``), so
    edgerun's loader, planner, bundle and expert cache handle it unchanged."""


def tensor_specs(args: ModelArgs) -> list[TensorSpec]:
    return _specs(Model, args)
