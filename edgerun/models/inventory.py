"""Every tensor the shared causal-LM shell (``models/base.py``) holds, listed from the model's
arguments alone: names, shapes and planner categories, in the module's own parameter order.
Pure Python, so planning, conversion checks and ``edgerun plan`` import no torch;
tests/models/test_inventory.py holds it equal to the meta-device instance's parameters."""

from __future__ import annotations

from edgerun.models import args as A
from edgerun.models.args import ModelArgs, TensorSpec


def _linear(name: str, out: int, inp: int, bias: bool = False) -> list[tuple[str, tuple[int, ...]]]:
    return [(f"{name}.weight", (out, inp))] + ([(f"{name}.bias", (out,))] if bias else [])


def _layer(a: ModelArgs, i: int | None) -> list[tuple[str, tuple[int, ...]]]:
    """Decoder layer i's tensors; i None: the MTP head's layer (full attention, MoE)."""
    D = a.hidden_size
    out: list[tuple[str, tuple[int, ...]]] = []
    if i is None or a.layer_types[i] == A.FULL_ATTENTION:
        H, Hk, Dh, b = a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.attention_bias
        out += _linear("self_attn.q_proj", H * Dh * (2 if a.attn_output_gate else 1), D, b)
        out += _linear("self_attn.k_proj", Hk * Dh, D, b)
        out += _linear("self_attn.v_proj", Hk * Dh, D, b)
        out += _linear("self_attn.o_proj", D, H * Dh, b)
        out += [("self_attn.q_norm.weight", (Dh,)), ("self_attn.k_norm.weight", (Dh,))]
    else:  # the module's own parameters first, then its submodules'
        nv, C = a.linear_num_value_heads, a.linear_conv_dim
        out += [("linear_attn.dt_bias", (nv,)), ("linear_attn.A_log", (nv,))]
        out += _linear("linear_attn.in_proj_qkv", C, D)
        out += _linear("linear_attn.in_proj_z", a.linear_value_dim, D)
        out += _linear("linear_attn.in_proj_b", nv, D)
        out += _linear("linear_attn.in_proj_a", nv, D)
        out += [("linear_attn.conv1d.weight", (C, 1, a.linear_conv_kernel_dim))]
        out += [("linear_attn.norm.weight", (a.linear_value_head_dim,))]
        out += _linear("linear_attn.out_proj", D, a.linear_value_dim)
    if i is None or i in a.moe_layers:
        E, I, S = a.num_experts, a.moe_intermediate_size, a.shared_expert_intermediate_size
        out += [("mlp.gate.weight", (E, D))]
        out += [("mlp.experts.gate_up_proj", (E, 2 * I, D)), ("mlp.experts.down_proj", (E, D, I))]
        if S > 0:
            out += _linear("mlp.shared_expert.gate_proj", S, D) + _linear("mlp.shared_expert.up_proj", S, D)
            out += _linear("mlp.shared_expert.down_proj", D, S) + _linear("mlp.shared_expert_gate", 1, D)
    else:
        F = a.intermediate_size
        out += _linear("mlp.gate_proj", F, D) + _linear("mlp.up_proj", F, D) + _linear("mlp.down_proj", D, F)
    return out + [("input_layernorm.weight", (D,)), ("post_attention_layernorm.weight", (D,))]


def categorize(name: str) -> str:
    """The planner category of a canonical tensor name."""
    if name.startswith("mtp."):
        return A.MTP
    if name.startswith("model.embed_tokens"):
        return A.EMBED
    if name.startswith("lm_head"):
        return A.LM_HEAD
    if ".mlp.experts." in name:
        return A.EXPERT
    if ".mlp.shared_expert" in name:
        return A.SHARED_EXPERT
    if ".mlp.gate." in name:
        return A.ROUTER
    if ".mlp." in name:
        return A.DENSE_MLP
    if ".self_attn." in name:
        return A.ATTENTION
    if ".linear_attn." in name:
        return A.DELTANET
    return A.NORM


def tensor_specs(args: ModelArgs) -> list[TensorSpec]:
    """The shell's tensors for ``args`` (a tied lm_head is the embedding: listed once)."""
    named = [("model.embed_tokens.weight", (args.vocab_size, args.hidden_size))]
    for i in range(args.num_hidden_layers):
        named += [(f"model.layers.{i}.{n}", shape) for n, shape in _layer(args, i)]
    named.append(("model.norm.weight", (args.hidden_size,)))
    if not args.tie_word_embeddings:
        named.append(("lm_head.weight", (args.vocab_size, args.hidden_size)))
    specs = []
    for name, shape in named:
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        specs.append(TensorSpec(name, shape, categorize(name), layer))
    return specs


def mtp_specs(args: ModelArgs) -> list[TensorSpec]:
    """The MTP head's tensors (``models/base.py`` MtpHead; none when the config declares no MTP
    layer), its routed experts stacked as the published checkpoints store them. Not part of
    ``tensor_specs``: the head loads, converts and is planned only where it is asked for."""
    D = args.hidden_size
    named = [("mtp.pre_fc_norm_embedding.weight", (D,)), ("mtp.pre_fc_norm_hidden.weight", (D,))]
    named += [("mtp.fc.weight", (D, 2 * D))]
    for j in range(args.mtp_num_hidden_layers):
        named += [(f"mtp.layers.{j}.{n}", shape) for n, shape in _layer(args, None)]
    named.append(("mtp.norm.weight", (D,)))
    return [TensorSpec(n, shape, A.MTP) for n, shape in named] if args.mtp_num_hidden_layers else []
