"""The dense decode references are the modules' math bit for bit: ``rms_norm_ref`` is
``RMSNorm.forward``, ``delta_decode_ref`` is ``GatedDeltaNet.forward`` at T = 1 from the
projections to the out_proj input, state updates included. CPU only."""

import json
import os
import subprocess
import sys

import pytest
import torch
from dense_cases import GEOMETRIES, delta_args

from edgerun.kernels.dense_probe import probe_dense
from edgerun.kernels.dense_reference import DeltaDims, delta_decode_ref, rms_norm_ref
from edgerun.models.layers import GatedDeltaNet, RMSNorm
from hf_fixtures import tiny_moe_args

DTYPES = [torch.float32, torch.bfloat16]


def random_layer(args, dtype, seed):
    torch.manual_seed(seed)
    layer = GatedDeltaNet(args)
    with torch.no_grad():  # trained-like: every parameter away from its init value
        for name, p in layer.named_parameters():
            if name == "A_log":
                p.copy_(torch.empty_like(p).uniform_(0.01, 4).log())
            elif name in ("dt_bias", "norm.weight"):
                p.add_(torch.randn_like(p) * 0.3)
            else:
                p.copy_(torch.randn_like(p) * 0.3)
    layer = layer.to(dtype)
    layer.fuse()  # as loading leaves it: one projection for qkv, z, b and a
    return layer


@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("dtype", DTYPES + [torch.float16])
def test_rms_norm_ref_is_the_module(dtype, unit_offset):
    norm = RMSNorm(48, 1e-6, unit_offset)
    with torch.no_grad():
        norm.weight.add_(torch.randn(48) * 0.3)
    norm = norm.to(dtype)
    x = (torch.randn(5, 48) * 3).to(dtype)
    got = rms_norm_ref(x, norm.weight, norm.eps, unit_offset)
    assert got.dtype == dtype and torch.equal(got, norm(x))


def test_rms_norm_ref_promotes_like_the_module():
    norm = RMSNorm(32, 1e-6)  # fp32 weight, bf16 input: the product is fp32
    x = torch.randn(3, 32).bfloat16()
    assert torch.equal(rms_norm_ref(x, norm.weight, norm.eps, False), norm(x))


@pytest.mark.parametrize("batch", [None, 2])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dims", GEOMETRIES, ids=str)
def test_delta_decode_ref_is_the_module(dims, dtype, batch):
    args = delta_args(dims)
    assert DeltaDims.from_args(args) == dims
    layer = random_layer(args, dtype, seed=dims.dk)
    B = batch or 1
    mod_state = layer.new_state(B, "cpu", dtype)
    mod_state.conv.copy_(torch.randn(mod_state.conv.shape))
    mod_state.recurrent.copy_(torch.randn(mod_state.recurrent.shape) * 0.5)
    conv, rec = mod_state.conv.clone(), mod_state.recurrent.clone()
    if batch is None:
        conv, rec = conv[0], rec[0]
    captured = []
    layer.out_proj.register_forward_pre_hook(lambda _, inp: captured.append(inp[0]))
    weights = dict(
        conv_weight=layer.conv1d.weight[:, 0],
        A_log=layer.A_log,
        dt_bias=layer.dt_bias,
        norm_weight=layer.norm.weight,
        eps=layer.norm.eps,
        n_k=dims.n_k,
        n_v=dims.n_v,
        dk=dims.dk,
        dv=dims.dv,
    )
    with torch.no_grad():
        for step in range(2):  # the second step starts from states both paths updated
            x = torch.randn(B, 1, args.hidden_size).to(dtype)
            layer(x, mod_state)
            projections = [p[:, 0] for p in layer._project(x)]
            if batch is None:
                projections = [p[0] for p in projections]
            mixed, z, b, a = projections
            got = delta_decode_ref(mixed, z, a, b, conv_state=conv, state=rec, **weights)
            want = captured[step][:, 0] if batch else captured[step][0, 0]
            assert got.dtype == dtype and torch.equal(got, want)
            assert torch.equal(conv, mod_state.conv if batch else mod_state.conv[0])
            assert torch.equal(rec, mod_state.recurrent if batch else mod_state.recurrent[0])


def test_dims_from_args():
    args = delta_args(GEOMETRIES[0])
    dims = DeltaDims.from_args(args)
    assert (dims.conv_dim, dims.value_dim) == (args.linear_conv_dim, args.linear_value_dim)


def test_probe_refuses_without_cuda_and_says_why():
    r = probe_dense(delta_args(GEOMETRIES[1]), "cpu")
    assert not r.selected and "CUDA" in r.reason
    assert r.name == "dense_triton[delta_decode]"
    assert probe_dense(tiny_moe_args(), "cpu").name == "dense_triton[]"  # no DeltaNet layers, no GEMV cases
    gemv = [("int4", 64, 64, 32, "none")]
    assert (
        probe_dense(tiny_moe_args(), "cpu", gemv=gemv).name
        == "dense_triton[qgemv, router_topk, attention_decode, greedy]"
    )


def test_import_changes_no_environment_and_defers_triton():
    code = (
        "import os, sys, json; before = dict(os.environ); "
        "import edgerun.kernels.dense_reference, edgerun.kernels.dense_probe; "
        "print(json.dumps([dict(os.environ) == before, 'edgerun.kernels.dense_triton' in sys.modules, "
        "'triton' in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [True, False, False]
