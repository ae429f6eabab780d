"""Shared cases for the dense decode kernel tests: layer geometries and ModelArgs built from them."""

from __future__ import annotations

from edgerun.kernels.dense_reference import DeltaDims
from edgerun.models.registry import load_args
from hf_fixtures import QWEN3_5_MOE

# the fixture's (GQA, dk 8, dv 12: not powers of two, masked tiles), GQA at power-of-two dims,
# no GQA with a 3-tap conv (padded taps)
GEOMETRIES = [DeltaDims(2, 4, 8, 12, 4), DeltaDims(2, 4, 16, 16, 4), DeltaDims(2, 2, 32, 16, 3)]
REAL = DeltaDims(16, 32, 128, 128, 4)  # Qwen3.6-35B-A3B


def delta_args(dims: DeltaDims, **overrides):
    """ModelArgs of the tiny qwen3_5_moe fixture with this DeltaNet geometry."""
    cfg = dict(
        QWEN3_5_MOE, model_type="qwen3_5_moe", linear_num_key_heads=dims.n_k,
        linear_num_value_heads=dims.n_v, linear_key_head_dim=dims.dk, linear_value_head_dim=dims.dv,
        linear_conv_kernel_dim=dims.kernel, **overrides,
    )  # fmt: skip
    return load_args(cfg)[1]


def real_args():
    """Qwen3.6-35B-A3B's dense geometry (hidden 2048, 16 heads of 256) around REAL."""
    return delta_args(REAL, hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, head_dim=256)
