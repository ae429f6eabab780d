"""The decode references are the modules' math bit for bit: ``attention_decode_ref`` on the fused
q|k|v projection is ``Attention.decode_static`` up to o_proj (caches included), and
``router_topk_ref`` is ``Router.forward`` after the linear (plus the shared-expert gate's
sigmoid of its logit column). CPU only, no Triton."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
from dense_cases import real_args
from torch import nn

from edgerun.kernels.decode_reference import (
    AttnDims,
    attention_decode_ref,
    decisive_rows,
    rope_inv_freq,
    router_topk_ref,
)
from edgerun.models.layers import Attention, Rotary, Router, StaticStep
from edgerun.models.registry import load_args
from hf_fixtures import QWEN3_5_MOE, QWEN3_MOE

DTYPES = [torch.float32, torch.bfloat16]


def qwen36_args():
    """Qwen3.6-35B-A3B: 16 heads / 2 kv heads of 256, rotary 64, gated, unit-offset norms, 256
    experts top 8 and a shared expert (its gate logit a column of the router's)."""
    return dataclasses.replace(real_args(), num_experts=256, num_experts_per_tok=8)


def qwen3_30b_args():
    """Qwen3-30B-A3B: 32 heads / 4 kv heads of 128, full rotary, no gate, 128 experts top 8."""
    cfg = dict(
        QWEN3_MOE, model_type="qwen3_moe", hidden_size=2048, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
    )  # fmt: skip
    return load_args(cfg)[1]


def tiny_args(arch: str):
    """The fixtures' tiny geometries: qwen3_5_moe gated, unit offset, rotary 4 of 16; qwen3_moe
    neither, full rotary."""
    return load_args(dict(QWEN3_5_MOE if arch == "qwen3_5_moe" else QWEN3_MOE, model_type=arch))[1]


def random_attention(args, dtype, seed) -> Attention:
    torch.manual_seed(seed)
    attn = Attention(args)
    with torch.no_grad():  # trained-like: norm weights away from their init
        for norm in (attn.q_norm, attn.k_norm):
            norm.weight.add_(torch.randn_like(norm.weight) * 0.3)
    attn = attn.to(dtype)
    attn.fuse()
    return attn


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ["qwen3_5_moe", "qwen3_moe"])
def test_attention_decode_ref_is_decode_static(arch, dtype):
    args = tiny_args(arch)
    attn = random_attention(args, dtype, seed=len(arch))
    S = 24
    cache = attn.new_state(1, S, "cpu", dtype)
    cache.k.copy_(torch.randn(cache.k.shape))  # a history, and rows past pos the step must ignore
    cache.v.copy_(torch.randn(cache.v.shape))
    k_ref, v_ref = cache.k.clone(), cache.v.clone()
    rotary = Rotary(args.rotary_dim, args.rope_theta)
    captured = []
    attn.o_proj.register_forward_pre_hook(lambda _, inp: captured.append(inp[0].clone()))
    with torch.no_grad():
        for step, p in enumerate([0, 1, 9, S - 1]):
            pos = torch.tensor([p])
            cos, sin = rotary(pos, dtype)
            x = torch.randn(1, args.hidden_size).to(dtype)
            static = StaticStep(cos, sin, pos, torch.arange(S))
            residual = torch.zeros(1, args.hidden_size, dtype=dtype)
            attn.decode_static(x, static, cache, residual, norm=torch.nn.Identity())  # x is the mixer's input
            out = torch.empty(1, args.num_attention_heads * args.head_dim, dtype=dtype)
            got = attention_decode_ref(
                attn.qkv(x), attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps, args.norm_unit_offset,
                rotary.inv_freq, pos, k_ref, v_ref, out, args.num_attention_heads, args.num_key_value_heads,
                args.head_dim, args.attn_output_gate,
            )  # fmt: skip
            assert got is out and torch.equal(out, captured[step].reshape(out.shape))
            assert torch.equal(k_ref, cache.k) and torch.equal(v_ref, cache.v)


def test_inv_freq_is_rotarys():
    assert torch.equal(rope_inv_freq(64, 1e7), Rotary(64, 1e7).inv_freq)


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("extra", [0, 1])
@pytest.mark.parametrize("dtype", DTYPES)
def test_router_topk_ref_is_router_forward(dtype, extra, normalize):
    args = dataclasses.replace(tiny_args("qwen3_5_moe"), num_experts=16, num_experts_per_tok=3)
    args = dataclasses.replace(args, norm_topk_prob=normalize)
    torch.manual_seed(extra)
    router = Router(args)
    with torch.no_grad():
        router.weight.copy_(torch.randn_like(router.weight))
    gate = nn.Linear(args.hidden_size, 1, bias=False) if extra else None
    router, gate = router.to(dtype), gate.to(dtype) if gate else None
    router.fuse(gate)
    x = torch.randn(5, args.hidden_size).to(dtype)
    with torch.no_grad():
        weights, ids, logits = router(x)
    assert logits.shape == (5, 16 + extra)
    w, i = torch.empty_like(weights), torch.empty_like(ids)
    g = torch.empty(5, 1, dtype=dtype) if extra else None
    assert router_topk_ref(logits, 16, 3, normalize, w, i, g) == (w, i, g)
    assert torch.equal(w, weights) and torch.equal(i, ids)
    if extra:
        assert torch.equal(g, torch.sigmoid(logits[:, 16:]))  # SparseMoe.shared_output's gate


def test_decisive_rows():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0], [3.0, 2.0, 2.0, 0.0], [2.0, 2.0, 1.0, 0.0]])
    sets, order = decisive_rows(logits, 4, 2)
    assert sets.tolist() == [True, False, True] and order.tolist() == [True, False, False]
    assert decisive_rows(logits, 4, 4)[0].all()


def test_attn_dims_from_args():
    assert AttnDims.from_args(qwen36_args()) == AttnDims(16, 2, 256, 64, True)
    assert AttnDims.from_args(qwen3_30b_args()) == AttnDims(32, 4, 128, 128, False)
    assert AttnDims(16, 2, 256, 64, True).qkv_width == 16 * 512 + 2 * 2 * 256


def test_import_changes_no_environment_and_defers_triton():
    code = (
        "import os, sys, json; before = dict(os.environ); "
        "import edgerun.kernels.decode_reference; "
        "print(json.dumps([dict(os.environ) == before, 'edgerun.kernels.decode_triton' in sys.modules, "
        "'triton' in sys.modules, any(m.startswith('edgerun.models') for m in sys.modules)]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [True, False, False, False]
