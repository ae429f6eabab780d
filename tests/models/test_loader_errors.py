"""Loader errors name the thing that is wrong."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from edgerun.errors import CheckpointError, ConfigError
from edgerun.models.checkpoint import load_model
from edgerun.models.registry import load_args
from hf_fixtures import rewrite


@pytest.fixture()
def ckpt(hf_checkpoints, tmp_path):
    dst = tmp_path / "ck"
    shutil.copytree(hf_checkpoints["qwen3_5_moe"][1], dst)
    return dst


def _edit(ckpt, fn):
    path = ckpt / "model.safetensors"
    tensors = load_file(str(path))
    fn(tensors)
    save_file(tensors, str(path))


def _edit_config(ckpt, fn):
    cfg = json.loads((ckpt / "config.json").read_text())
    fn(cfg)
    (ckpt / "config.json").write_text(json.dumps(cfg))


def test_wrong_shape_names_tensor_and_both_shapes(ckpt):
    name = "model.layers.1.self_attn.k_proj.weight"
    _edit(ckpt, lambda t: t.__setitem__(name, torch.zeros(5, 48)))
    with pytest.raises(CheckpointError, match=rf"{name}' has shape \[5, 48\], expected \[32, 48\]"):
        load_model(ckpt)


def test_wrong_expert_shape_in_fused_layout(hf_checkpoints, tmp_path):
    fused = rewrite(hf_checkpoints["qwen3_5_moe"][1], tmp_path / "f", fused=True)
    name = "model.layers.0.mlp.experts.down_proj"
    _edit(fused, lambda t: t.__setitem__(name, torch.zeros(6, 24, 48)))
    with pytest.raises(CheckpointError, match=rf"{name}' has shape \[6, 24, 48\], expected \[6, 48, 24\]"):
        load_model(fused)


def test_missing_tensor_is_named(ckpt):
    _edit(ckpt, lambda t: t.pop("model.layers.2.linear_attn.A_log"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model.layers.2.linear_attn.A_log'"):
        load_model(ckpt)


def test_missing_expert_is_named(ckpt):
    _edit(ckpt, lambda t: t.pop("model.layers.3.mlp.experts.4.up_proj.weight"))
    with pytest.raises(
        CheckpointError, match=r"missing tensor 'model.layers.3.mlp.experts.4.up_proj.weight'"
    ):
        load_model(ckpt)


def test_expert_beyond_num_experts_is_refused(ckpt):
    _edit(ckpt, lambda t: t.__setitem__("model.layers.0.mlp.experts.6.up_proj.weight", torch.zeros(24, 48)))
    with pytest.raises(CheckpointError, match=r"is expert 6, but num_experts is 6"):
        load_model(ckpt)


def test_unknown_tensor_is_named(ckpt):
    _edit(ckpt, lambda t: t.__setitem__("model.layers.0.mystery.weight", torch.zeros(2)))
    with pytest.raises(CheckpointError, match=r"unknown tensor 'model.layers.0.mystery.weight'"):
        load_model(ckpt)


def test_non_float_dtype_is_named(ckpt):
    name = "model.norm.weight"
    _edit(ckpt, lambda t: t.__setitem__(name, torch.zeros(48, dtype=torch.int32)))
    with pytest.raises(CheckpointError, match=rf"{name}' has dtype I32; expected one of F32, F16, BF16"):
        load_model(ckpt)


def test_truncated_file_is_refused(ckpt):
    path = ckpt / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match=r"past the end of the file"):
        load_model(ckpt)


def test_index_naming_a_missing_shard(hf_checkpoints, tmp_path):
    sharded = rewrite(hf_checkpoints["qwen3_moe"][1], tmp_path / "s", shards=2)
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"lists shard\(s\) that do not exist: .*model-00002-of-00002"):
        load_model(sharded)


def test_missing_config_key_is_named_with_suggestion(ckpt):
    _edit_config(ckpt, lambda c: c.pop("hidden_size"))
    with pytest.raises(ConfigError, match=r"required key 'hidden_size' is missing"):
        load_args(ckpt)


def test_wrong_type_config_key(ckpt):
    _edit_config(ckpt, lambda c: c.__setitem__("num_hidden_layers", "four"))
    with pytest.raises(ConfigError, match=r"key 'num_hidden_layers' must be int, got 'four'"):
        load_args(ckpt)


def test_bad_layer_type_and_model_type(ckpt):
    _edit_config(ckpt, lambda c: c["layer_types"].__setitem__(2, "sliding_attention"))
    with pytest.raises(ConfigError, match=r"layer_types\[2\] = 'sliding_attention'"):
        load_args(ckpt)
    _edit_config(ckpt, lambda c: c.__setitem__("model_type", "llama"))
    with pytest.raises(ConfigError, match=r"model_type 'llama' is not supported"):
        load_args(ckpt)


def test_unknown_config_keys_are_ignored(ckpt):
    _edit_config(ckpt, lambda c: c.__setitem__("some_future_key", 1))
    _, args = load_args(ckpt)
    assert args.num_hidden_layers == 4


@pytest.mark.parametrize(
    "key, value, says",
    [
        ("num_hidden_layers", 10**9, "is 1000000000; a model's is 1 to 4096"),
        ("num_attention_heads", 0, "is 0; a model's is 1 to 4096"),
        ("vocab_size", 2**40, "is 1099511627776; a model's is 1 to 16777216"),
    ],
)
def test_a_size_past_any_models_is_refused_by_its_key_before_anything_is_sized(ckpt, key, value, says):
    """A damaged or hostile config.json (a layer count of 10^9 would build tables of 10^9 entries
    first; 0 heads would divide by zero) is refused by the key it gives."""
    _edit_config(ckpt, lambda c: c.__setitem__(key, value))
    with pytest.raises(ConfigError, match=rf"key '{key}' {says}"):
        load_args(ckpt)


def test_unsupported_rope_type_is_refused(ckpt):
    _edit_config(ckpt, lambda c: c.__setitem__("rope_parameters", {"rope_type": "yarn", "factor": 4.0}))
    with pytest.raises(ConfigError, match=r"rope_type 'yarn' is not supported"):
        load_args(ckpt)


def test_rope_parameters_without_a_partial_factor_take_the_architecture_default(ckpt):
    """Qwen3.5-MoE rotates a quarter of each head unless its config says otherwise, also when its
    ``rope_parameters`` leave the factor out (the reference's config class fills 0.25 in)."""
    from transformers import AutoConfig

    _edit_config(ckpt, lambda c: c["rope_parameters"].pop("partial_rotary_factor", None))
    _, args = load_args(ckpt)
    hf = AutoConfig.from_pretrained(ckpt).rope_parameters["partial_rotary_factor"]
    assert args.partial_rotary_factor == hf == 0.25


def test_rope_scaling_beside_rope_parameters_is_read_as_the_reference_reads_it(ckpt):
    """A ``rope_scaling`` dict (Qwen's advice for long contexts) replaces ``rope_parameters``,
    as in transformers: its yarn is refused by that key's name, not run as plain RoPE."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    _edit_config(ckpt, lambda c: c.__setitem__("rope_scaling", yarn))
    with pytest.raises(ConfigError, match=r"rope_scaling\.rope_type 'yarn' is not supported"):
        load_args(ckpt)
    _edit_config(ckpt, lambda c: c.__setitem__("rope_scaling", None))
    load_args(ckpt)


def test_a_multimodal_config_ties_by_its_top_level_key(hf_checkpoints, tmp_path):
    """transformers' ``save_pretrained`` of a tied multimodal Qwen3.5-MoE writes
    ``tie_word_embeddings`` true at the top level and false in ``text_config``, and no lm_head:
    the model ties by the top level's."""
    dst = rewrite(hf_checkpoints["qwen3_5_moe"][1], tmp_path / "mm", fused=True, multimodal=True)
    _edit(dst, lambda t: t.pop("lm_head.weight", None))

    def tie(c):
        c["tie_word_embeddings"] = True
        c["text_config"]["tie_word_embeddings"] = False

    _edit_config(dst, tie)
    model, args, _ = load_model(dst)
    assert args.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def _sharded(hf_checkpoints, tmp_path, edit):
    dst = rewrite(hf_checkpoints["qwen3_moe"][1], tmp_path / "sh", shards=2)
    index = dst / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    edit(doc["weight_map"])
    index.write_text(json.dumps(doc))
    return dst, index


def test_an_index_and_its_shards_must_agree(hf_checkpoints, tmp_path):
    """A tensor the index lists where no shard holds it, one it places in the wrong shard and one
    a shard holds that the index does not list: each refused, naming the index and the tensor."""
    dst, index = _sharded(
        hf_checkpoints, tmp_path / "a", lambda m: m.__setitem__("model.extra.weight", next(iter(m.values())))
    )
    with pytest.raises(
        CheckpointError, match=r"index\.json: lists tensor 'model\.extra\.weight' in model-0000"
    ):
        load_model(dst)

    def move(m):
        name = sorted(m)[0]
        m[name] = (
            "model-00002-of-00002.safetensors"
            if m[name].startswith("model-00001")
            else "model-00001-of-00002.safetensors"
        )

    dst, _ = _sharded(hf_checkpoints, tmp_path / "b", move)
    with pytest.raises(CheckpointError, match=r"lists tensor .* but it is in model-0000"):
        load_model(dst)
    dst, _ = _sharded(hf_checkpoints, tmp_path / "c", lambda m: m.pop(sorted(m)[-1]))
    with pytest.raises(CheckpointError, match=r"index\.json: does not list tensor"):
        load_model(dst)


def test_loading_is_lazy_for_matching_dtype(hf_checkpoints):
    """Same-dtype tensors are views of the file mapping, not copies; projections fused into one
    GEMV (q/k/v here) are the one copy loading makes."""
    model, _, _ = load_model(hf_checkpoints["qwen3_moe"][1])
    attn = model.model.layers[0].self_attn
    assert not attn.o_proj.weight.untyped_storage().resizable()  # borrowed from the mmap
    assert attn.qkv.weight.untyped_storage().resizable()  # the concatenation, allocated by torch
