"""Shared cases for the dense decode kernel tests: layer geometries and ModelArgs built from them."""

from __future__ import annotations

import torch

from edgerun.kernels.dense_reference import DeltaDims, clone_inputs, random_delta_inputs
from edgerun.models.registry import load_args
from hf_fixtures import QWEN3_5_MOE

# the fixture's (GQA, dk 8, dv 12: not powers of two, masked tiles), GQA at power-of-two dims,
# no GQA with a 3-tap conv (padded taps)
# the last: a head's value columns split among 4 programs (dense_triton.delta_slices), its norm
# by the last to arrive
GEOMETRIES = [
    DeltaDims(2, 4, 8, 12, 4),
    DeltaDims(2, 4, 16, 16, 4),
    DeltaDims(2, 2, 32, 16, 3),
    DeltaDims(1, 2, 16, 64, 4),
]
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


def window_runs(decode, dims: DeltaDims, dtype, n: int, generator, device="cpu"):
    """One sequence's n consecutive rows (strided views of one projection, as the layer passes
    them) stepped from the same states twice: as a verify window, ``decode(..., trail=...)``, and
    as n one-row calls, each followed by copies of the states into a trail (what the window
    replaces). Returns both runs' {part: tensor}: output, conv / recurrent trail, conv state, state."""
    inputs = random_delta_inputs(dims, 1, generator, device, dtype)
    names = ("mixed_qkv", "z", "a", "b")
    widths = [inputs[k].shape[-1] for k in names]
    proj = torch.randn(n, sum(widths), generator=generator, device=device).to(dtype)
    rows = dict(zip(names, proj.split(widths, dim=-1), strict=True))

    def trail():
        return (
            torch.zeros(n, dims.conv_dim, dims.kernel - 1, dtype=dtype, device=device),
            torch.zeros(n, dims.n_v, dims.dk, dims.dv, device=device),
        )

    window, window_trail = clone_inputs(inputs), trail()
    out = decode(**{**window, **rows}, trail=window_trail)
    one, one_trail, outs = clone_inputs(inputs), trail(), []
    for r in range(n):
        outs.append(decode(**{**one, **{k: v[r : r + 1] for k, v in rows.items()}}))
        one_trail[0][r].copy_(one["conv_state"][0])
        one_trail[1][r].copy_(one["state"][0])
    parts = ("output", "conv trail", "recurrent trail", "conv state", "state")
    return (
        dict(zip(parts, (out, *window_trail, window["conv_state"], window["state"]), strict=True)),
        dict(zip(parts, (torch.cat(outs), *one_trail, one["conv_state"], one["state"]), strict=True)),
    )
