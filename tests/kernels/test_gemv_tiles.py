"""The projection GEMV's tile choice (``qlinear_triton.gemv_config``): a fixed function of the
weight's scheme and rows that keeps every SM busy, and keeps a MoE layer's router in one launch
with its shared expert's gate_up (``pairs``) in every dense scheme. Host-only logic: no kernel
runs here."""

import pytest
import torch
import triton

from edgerun.kernels import qlinear_triton as K
from edgerun.kernels.qlinear_reference import random_qweight


@pytest.mark.parametrize("scheme", ["int4", "int8", "plain"])
def test_every_weight_gets_a_program_for_each_sm_or_the_smallest_tile(scheme):
    # ... where it is large enough for that to matter (TINY_BYTES); smaller ones keep FEW's tile
    for cols in [512, 2048, 4096]:
        for rows in [1, 2, 33, 64, 128, 257, 264, 512, 1024, 2048, 4096, 8192, 12352, 248320]:
            cfg = K.gemv_config(scheme, rows, cols)
            programs = triton.cdiv(rows, cfg.block_r)
            large = rows * cols * K.VALUE_BITS[scheme] >= 8 * K.TINY_BYTES
            if cfg == K.MANY[scheme]:
                assert programs >= K.MIN_PROGRAMS, (scheme, rows)
            else:
                assert programs >= K.SMS or cfg.block_r == 2 or not large, (scheme, rows, cols, cfg)
                assert cfg == K.FEW[scheme] or large
                assert cfg.num_warps == K.FEW[scheme].num_warps  # what a router pairs on


def test_a_routers_few_rows_spread_over_the_sms():
    # Qwen3.6's router and shared gate, bf16 [257, 2048]: 129 programs of 2 rows (FEW's 8-row
    # tile would give 33, each reading 32 KB in turn); Qwen3-30B-A3B's, [128, 2048]: 64
    cfg = K.gemv_config("plain", 257, 2048)
    assert (cfg.block_r, triton.cdiv(257, cfg.block_r)) == (2, 129)
    assert K.gemv_config("plain", 128, 2048).block_r == 2
    assert K.gemv_config("plain", 16, 64) == K.FEW["plain"]  # a test model's: a few KB


@pytest.mark.parametrize("dense", [("int4", 32), ("int8", 2048), ("plain", None)])
@pytest.mark.parametrize("experts, shared", [(256, 512), (128, 768), (64, 1408), (512, 256)])
def test_the_router_pairs_with_its_shared_gate_up(dense, experts, shared):
    scheme, group = dense
    g = torch.Generator().manual_seed(experts)
    router = random_qweight("plain", experts + 1, 2048, 2048, g)
    gate_up = random_qweight(scheme, 2 * shared, 2048, group or 2048, g)
    assert K.pairs(router, gate_up, 2048)
