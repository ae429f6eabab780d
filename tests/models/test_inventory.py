"""The torch-free tensor inventory (models/inventory.py) lists exactly what the model holds:
the same names, shapes, categories and order as the meta-device instance, for every layout the
two architectures' configs can give."""

import pytest

from edgerun.models import base, inventory
from edgerun.models.registry import load_args
from hf_fixtures import QWEN3_5_MOE, QWEN3_MOE

CONFIGS = {"qwen3_moe": QWEN3_MOE, "qwen3_5_moe": QWEN3_5_MOE}
VARIANTS = {
    "plain": {},
    "tied": {"tie_word_embeddings": True},
    "attention bias": {"attention_bias": True},
    "dense layers": {"mlp_only_layers": [0, 2], "intermediate_size": 40},
    "no shared expert": {"shared_expert_intermediate_size": 0},
    "ungated attention": {"attn_output_gate": False},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("arch", list(CONFIGS))
def test_inventory_equals_the_module_parameters(arch, variant):
    cfg = {"model_type": arch, **CONFIGS[arch], **VARIANTS[variant]}
    module, args = load_args(cfg)
    assert inventory.tensor_specs(args) == base.tensor_specs(base.CausalLM, args)
    assert module.tensor_specs(args) == base.tensor_specs(module.Model, args)
