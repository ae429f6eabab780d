"""The dense decode kernels on a CUDA device: the real Qwen3.6-35B-A3B geometry against the
references, bit-for-bit repeats, CUDA-graph replay equal to eager, and the start-up probe.

Skipped without CUDA (CI has none); run on the GPU machine before resolving. Tolerances: the
probe's TOLERANCE for the model dtype (its docstring says why); the conv state is always equal.
"""

import pytest
import torch
from dense_cases import GEOMETRIES, REAL, real_args, window_runs
from moe_cases import rel_err

from edgerun.kernels.dense_probe import TOLERANCE, probe_dense
from edgerun.kernels.dense_reference import (
    clone_inputs,
    delta_decode_ref,
    random_delta_inputs,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (none on this machine)")
STATES = ("conv_state", "state")


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


@pytest.mark.parametrize("batch", [None, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dims", [REAL, *GEOMETRIES], ids=str)
def test_delta_decode(dims, dtype, batch):
    from edgerun.kernels import dense_triton as K

    inputs = random_delta_inputs(dims, batch, gen(dims.dk), "cuda", dtype)
    runs = [clone_inputs(inputs) for _ in range(2)]
    outs = [K.delta_decode(**r) for r in runs]
    ref = clone_inputs(inputs)
    want = delta_decode_ref(**ref)
    assert outs[0].dtype == dtype and rel_err(outs[0], want) < TOLERANCE[dtype]
    assert rel_err(runs[0]["state"], ref["state"]) < TOLERANCE[dtype]
    assert torch.equal(runs[0]["conv_state"], ref["conv_state"])
    assert torch.equal(outs[0], outs[1])
    assert all(torch.equal(runs[0][s], runs[1][s]) for s in STATES)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_delta_decode_window_is_one_row_calls(dtype, n):
    """A verify window (two launches, each program looping over the rows) is bit for bit n
    one-row calls in order, each followed by copies of the states into a trail."""
    from edgerun.kernels import dense_triton as K

    window, rows = window_runs(K.delta_decode, REAL, dtype, n, gen(n), "cuda")
    for part, got in window.items():
        assert torch.equal(got, rows[part]), part


def test_graph_replay_equals_eager():
    from edgerun.kernels import dense_triton as K

    inputs = random_delta_inputs(REAL, None, gen(0), "cuda", torch.bfloat16)
    static, eager = clone_inputs(inputs), clone_inputs(inputs)

    def step(t):
        return (K.delta_decode(**t),)

    side = torch.cuda.Stream()  # compile outside the capture, on a side stream (torch's recipe)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(clone_inputs(inputs))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(static)
    for s in STATES:  # capture ran nothing; start both paths from the same states regardless
        static[s].copy_(inputs[s])
    for i in range(3):  # each step continues from the states the last one left
        g = gen(10 + i)
        for name in ("mixed_qkv", "z", "a", "b"):
            new = torch.randn(inputs[name].shape, generator=g, device="cuda").bfloat16()
            static[name].copy_(new)
            eager[name] = new
        graph.replay()
        want = step(eager)
        assert torch.equal(captured[0], want[0])
        assert all(torch.equal(static[s], eager[s]) for s in STATES)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_probe_selects_on_this_gpu(dtype):
    r = probe_dense(real_args(), "cuda", dtype)
    print(r)
    assert r.selected, r.reason
    assert r.name == "dense_triton[delta_decode]"


@pytest.mark.parametrize("scheme", ["int4", "int8"])
def test_the_conv_in_the_in_proj_launch_at_the_real_geometry(scheme):
    """Qwen3.6's in_proj (12,352 x 2,048: the 16-row MANY tile, 2 warps) with the DeltaNet conv
    in its launch, then the delta rule alone: the projection, output and both states bit for bit
    those of the conv's own launch, twice (the probe's case, ``conv_fold_cases``), in bf16."""
    from dense_cases import delta_args

    from edgerun.kernels.dense_probe import conv_fold_cases

    args = delta_args(REAL, hidden_size=2048)
    rows = REAL.conv_dim + REAL.value_dim + 2 * REAL.n_v
    case = (scheme, rows, 2048, 32, "conv", "unit")
    assert conv_fold_cases([case], args, torch.device("cuda"), torch.bfloat16, gen(9)) == 1
