"""The dense decode kernels under Triton's CPU interpreter (tiny geometries, one real one).

Not collected on its own: test_interpret.py runs this file in a child process with
TRITON_INTERPRET=1 set before Triton is imported (Triton reads it at import). Tolerances: in fp32
a kernel differs from its reference only in summation order and transcendental ulps (1e-5 of
the output's scale; about 5e-7 seen); in bf16 / fp16 it rounds where the reference rounds, and
an fp32-level difference occasionally flips one rounding by an ulp, so the probe's TOLERANCE
(its docstring says why). The conv state is a shift of stored values: always equal.
"""

import os

import pytest
import torch
from dense_cases import GEOMETRIES, REAL, real_args, window_runs
from moe_cases import rel_err

from edgerun.kernels import dense_triton as K
from edgerun.kernels.dense_probe import TOLERANCE, run_cases
from edgerun.kernels.dense_reference import (
    DeltaDims,
    clone_inputs,
    delta_decode_ref,
    random_delta_inputs,
)

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="run by test_interpret.py")
TOL = {**TOLERANCE, torch.float32: 1e-5}


def assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Within TOL; in bf16 / fp16 also bit-equal but for rare one-ulp flips (a few in 10^4 seen):
    a kernel that rounded anywhere the reference does not would differ in most elements."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert rel_err(out, ref) < TOL[ref.dtype]
    if ref.dtype != torch.float32:
        assert (out != ref).float().mean() < 0.01


def run_steps(fn, inputs: dict, steps: int, seed: int) -> tuple[list[torch.Tensor], dict]:
    """``steps`` decode steps from inputs' states, fresh activations each step."""
    state = clone_inputs(inputs)
    g = torch.Generator().manual_seed(seed)
    outs = []
    for _ in range(steps):
        for name in ("mixed_qkv", "z", "a", "b"):
            state[name] = torch.randn(state[name].shape, generator=g).to(state[name].dtype)
        outs.append(fn(**state))
    return outs, state


@pytest.mark.parametrize("batch", [None, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dims", GEOMETRIES, ids=str)
def test_delta_decode_matches_reference(dims, dtype, batch):
    inputs = random_delta_inputs(dims, batch, torch.Generator().manual_seed(dims.dk), dtype=dtype)
    got, got_state = run_steps(K.delta_decode, inputs, 2, seed=1)
    want, want_state = run_steps(delta_decode_ref, inputs, 2, seed=1)
    for o, r in zip(got, want):
        assert_matches(o, r)
    assert rel_err(got_state["state"], want_state["state"]) < TOL[dtype]
    assert torch.equal(got_state["conv_state"], want_state["conv_state"])


def test_probe_cases_pass_at_the_real_geometry():
    # what probe_dense runs on the GPU, here through the interpreter; Refused if a case fails
    assert run_cases(real_args(), torch.device("cpu"), torch.bfloat16) < TOL[torch.bfloat16]


def test_delta_decode_fp32_weights_with_bf16_activations():
    # A_log, dt_bias, norm_weight kept in fp32: the norm product is not rounded (the reference's
    # type promotion)
    inputs = random_delta_inputs(GEOMETRIES[1], None, torch.Generator().manual_seed(3))
    for name in ("A_log", "dt_bias", "norm_weight"):
        inputs[name] = inputs[name].float() + 1e-3
    got, ref = clone_inputs(inputs), clone_inputs(inputs)
    assert_matches(K.delta_decode(**got), delta_decode_ref(**ref))


def test_delta_decode_repeats_and_is_batch_invariant():
    dims = GEOMETRIES[0]
    inputs = random_delta_inputs(dims, 3, torch.Generator().manual_seed(4), dtype=torch.float32)
    runs = [clone_inputs(inputs) for _ in range(2)]
    outs = [K.delta_decode(**r) for r in runs]
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(runs[0]["state"], runs[1]["state"])
    one = {
        k: v[1].clone() if k in ("mixed_qkv", "z", "a", "b", "conv_state", "state") else v
        for k, v in inputs.items()
    }
    assert torch.equal(K.delta_decode(**one), outs[0][1])  # a row's bits do not depend on the batch
    assert torch.equal(one["state"], runs[0]["state"][1])


def test_delta_decode_rows_by_slot_are_one_row_calls():
    """A batch's step: rows' states are entries of a pool, by slot; each row (its output, its
    entries' conv and recurrent state) is the one-row call's bit for bit, the row inputs strided
    views of one projection, and the entries no row names are untouched."""
    dims = GEOMETRIES[0]
    pool = random_delta_inputs(dims, 4, torch.Generator().manual_seed(6), dtype=torch.bfloat16)
    rows = random_delta_inputs(dims, 2, torch.Generator().manual_seed(7), dtype=torch.bfloat16)
    names = ("mixed_qkv", "z", "a", "b")
    proj = torch.cat([rows[n] for n in names], dim=-1)  # one [N, width] output, split as the layer does
    views = dict(zip(names, torch.split(proj, [rows[n].shape[-1] for n in names], dim=-1), strict=True))
    slots = torch.tensor([3, 1])
    got = clone_inputs(pool)
    out = K.delta_decode(**{**got, **views, "slots": slots})
    for r, e in enumerate(slots.tolist()):
        one = clone_inputs(pool)
        one.update({n: rows[n][r : r + 1] for n in names})
        one["conv_state"], one["state"] = (
            pool["conv_state"][e : e + 1].clone(),
            pool["state"][e : e + 1].clone(),
        )
        assert torch.equal(out[r : r + 1], K.delta_decode(**one)), r
        assert torch.equal(got["state"][e], one["state"][0]) and torch.equal(
            got["conv_state"][e], one["conv_state"][0]
        )
    for e in (0, 2):
        assert torch.equal(got["state"][e], pool["state"][e]) and torch.equal(
            got["conv_state"][e], pool["conv_state"][e]
        )
    with pytest.raises(ValueError, match=r"slots must be \[2\]"):
        K.delta_decode(**{**clone_inputs(pool), **views, "slots": slots[:1]})


# GEOMETRIES[2]: 160 conv channels (two programs of the conv launch), a 3-tap conv, no GQA
@pytest.mark.parametrize(
    "dims, n", [*((GEOMETRIES[0], n) for n in (1, 2, 3, 5)), (GEOMETRIES[2], 3), (GEOMETRIES[3], 3)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_delta_decode_window_is_one_row_calls(dims, dtype, n):
    """A verify window (two launches, each program looping over the rows) is bit for bit n
    one-row calls in order, each followed by copies of the states into a trail."""
    window, rows = window_runs(K.delta_decode, dims, dtype, n, torch.Generator().manual_seed(n))
    for part, got in window.items():
        assert torch.equal(got, rows[part]), part
    if n > 1:  # the rows advance the state
        for part in ("conv trail", "recurrent trail"):
            assert not torch.equal(window[part][0], window[part][-1]), part


def test_delta_decode_window_refusals_name_the_trail():
    dims = GEOMETRIES[0]
    inputs = random_delta_inputs(dims, 1, torch.Generator().manual_seed(9))
    rows = {k: torch.cat([inputs[k]] * 2) for k in ("mixed_qkv", "z", "a", "b")}
    conv = torch.zeros(2, dims.conv_dim, dims.kernel - 1, dtype=torch.bfloat16)
    rec = torch.zeros(2, dims.n_v, dims.dk, dims.dv)
    cases = [
        ((conv[:1], rec), r"conv_trail must be \[2, 80, 3\], got \[1, 80, 3\]"),
        ((conv, rec[:, :2]), r"recurrent_trail must be \[2, 4, 8, 12\], got \[2, 2, 8, 12\]"),
        ((conv.float(), rec), "conv_trail must be torch.bfloat16"),
        ((conv, rec.bfloat16()), "recurrent_trail must be torch.float32"),
        ((conv,), r"trail must be \(conv_trail"),
    ]
    for trail, msg in cases:
        with pytest.raises(ValueError, match=msg):
            K.delta_decode(**{**clone_inputs(inputs), **rows, "trail": trail})
    with pytest.raises(ValueError, match="trail .* and slots .* exclude each other"):
        K.delta_decode(
            **{**clone_inputs(inputs), **rows, "trail": (conv, rec), "slots": torch.tensor([0, 1])}
        )
    pool = {k: torch.cat([inputs[k]] * 2) for k in ("conv_state", "state")}
    with pytest.raises(ValueError, match=r"conv_state must be \[1, 80, 3\]"):  # one sequence's states
        K.delta_decode(**{**inputs, **rows, **pool, "trail": (conv, rec)})


def test_delta_decode_refusals_name_the_tensor():
    inputs = random_delta_inputs(GEOMETRIES[1], None, torch.Generator().manual_seed(5))
    cases = [
        ("z", inputs["z"][:-1], r"z must be \[64\]"),
        ("state", inputs["state"].bfloat16(), "state must be torch.float32"),
        ("a", inputs["a"].float(), "a must be torch.bfloat16"),
        ("conv_state", inputs["conv_state"].t().contiguous().t(), "conv_state must be contiguous"),
        ("mixed_qkv", inputs["mixed_qkv"][None, None], r"mixed_qkv must be \[C\] or \[N, C\]"),
        ("conv_weight", inputs["conv_weight"][:, None], r"conv_weight must be \[C, K\]"),
        ("n_v", 5, "not a multiple of key heads"),
    ]
    for name, bad, msg in cases:
        with pytest.raises(ValueError, match=msg):
            K.delta_decode(**{**inputs, name: bad})


def test_unsupported_geometries():
    assert K.unsupported_delta(REAL) is None
    assert "state tile" in K.unsupported_delta(DeltaDims(2, 2, 256, 256, 4))
    assert "taps" in K.unsupported_delta(DeltaDims(2, 2, 16, 16, 1))


@pytest.mark.parametrize("early", [False, True], ids=["params-after-wait", "params-early"])
def test_a_heads_columns_split_among_programs(early, monkeypatch):
    """Qwen3.6's 32 value heads of 128 columns take 8 programs each (256 a row); a geometry with
    many heads or narrow ones keeps fewer, or one a head. Split heads (their norms in the launch
    after the delta rule) match the reference, with the head's A_log and dt_bias and the norm's
    weights read after the launches' waits or before them (``EARLY_PARAMS``)."""
    from edgerun.kernels import launch

    monkeypatch.setattr(launch, "EARLY_PARAMS", early)
    assert K.delta_slices(REAL.n_v, REAL.dv) == 8
    assert K.delta_slices(64, 128) == 4 and K.delta_slices(4, 16) == 1 and K.delta_slices(2, 64) == 4
    dims = GEOMETRIES[3]
    assert K.delta_slices(dims.n_v, dims.dv) == 4
    inputs = random_delta_inputs(dims, 2, torch.Generator().manual_seed(3), dtype=torch.bfloat16)
    ref_in = clone_inputs(inputs)
    assert_matches(K.delta_decode(**inputs), delta_decode_ref(**ref_in))


def test_early_params_are_the_same_bits(monkeypatch):
    """``EARLY_PARAMS`` moves loads, not arithmetic: the split-head step (delta rule, then the
    norms' launch) with the head's A_log and dt_bias and the norm's weights read before the
    waits gives the output and state of the step that reads them after, bit for bit, twice."""
    from edgerun.kernels import launch

    dims = GEOMETRIES[3]
    inputs = random_delta_inputs(dims, 2, torch.Generator().manual_seed(7), dtype=torch.bfloat16)
    runs = {}
    for early in (False, True):
        monkeypatch.setattr(launch, "EARLY_PARAMS", early)
        mine = clone_inputs(inputs)
        outs = [K.delta_decode(**mine) for _ in range(2)]
        runs[early] = (*outs, mine["state"], mine["conv_state"])
    assert all(torch.equal(a, b) for a, b in zip(runs[False], runs[True], strict=True))


# --------------------------------------------------------------------------------------------
# The conv in the in_proj GEMV's launch (qgemv's conv)


def _in_proj(dims: DeltaDims, scheme: str, cols: int, seed: int, dtype=torch.bfloat16):
    """A random in_proj of this geometry (qkv, z, b, a rows) and a plain RMSNorm of its input."""
    from edgerun.kernels.qlinear_reference import random_norm, random_qweight

    gen = torch.Generator().manual_seed(seed)
    rows = dims.conv_dim + dims.value_dim + 2 * dims.n_v
    return random_qweight(scheme, rows, cols, 16, gen, dtype=dtype), random_norm(
        "unit", cols, gen, "cpu", dtype
    )


# every geometry once, the schemes and dtypes spread over them (the interpreter is slow)
FOLD_CASES = [
    (GEOMETRIES[0], "int4", torch.bfloat16),
    (GEOMETRIES[1], "int8", torch.float32),
    (GEOMETRIES[2], "plain", torch.bfloat16),
    (GEOMETRIES[3], "int4", torch.float32),
]


@pytest.mark.parametrize("dims, scheme, dtype", FOLD_CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_the_conv_in_the_projection_launch_is_the_conv_launch(dims, scheme, dtype):
    """The probe's case (``dense_probe.conv_fold_cases``): the in_proj GEMV with the conv in its
    launch, then the delta rule alone, equal bit for bit to the GEMV, the conv's own launch and
    the delta rule (projection, output, recurrent and conv state), twice, at every geometry
    (3-tap convs, masked heads), scheme and dtype."""
    from dense_cases import delta_args

    from edgerun.kernels.dense_probe import conv_fold_cases
    from edgerun.kernels.qlinear_triton import folds_conv

    w, _ = _in_proj(dims, scheme, 64, seed=1, dtype=dtype)
    assert folds_conv(w, 64, dims.conv_dim)
    args = delta_args(dims)
    case = (scheme, w.rows, 64, 16, "conv", "unit")
    assert conv_fold_cases([case], args, torch.device("cpu"), dtype, torch.Generator().manual_seed(2)) == 1


@pytest.mark.parametrize("block_r", [2, 16])
@pytest.mark.parametrize("early", [False, True], ids=["params-after-wait", "params-early"])
def test_the_conv_epilogue_on_each_tile(block_r, early, monkeypatch):
    """On the MANY tile (16 rows a program, an in_proj of Qwen3.6's size takes it) and TINY's (2):
    act and the shifted conv state equal the conv launch's, the projection's output the GEMV's
    without the conv, through delta_decode's act; the programs past the conv's channels (z, b,
    a) run no conv; the same with the conv's taps, the delta rule's A_log and dt_bias and the
    split heads' norm weights read before the launches' waits (``EARLY_PARAMS``)."""
    from edgerun.kernels import launch
    from edgerun.kernels.qlinear_triton import GemvConfig, qgemv

    monkeypatch.setattr(launch, "EARLY_PARAMS", early)

    dims = GEOMETRIES[1]
    w, norm = _in_proj(dims, "int4", 64, seed=3)
    cfg = GemvConfig(block_r, 256, 2)
    x = (torch.randn(1, 64, generator=torch.Generator().manual_seed(4)) * 3).bfloat16()
    inputs = random_delta_inputs(dims, 1, torch.Generator().manual_seed(5), dtype=torch.bfloat16)
    split = [dims.conv_dim, dims.value_dim, dims.n_v, dims.n_v]
    plain, folded = clone_inputs(inputs), clone_inputs(inputs)
    y0 = qgemv(x, w, norm=norm, config=cfg)
    act = torch.full((1, dims.conv_dim), float("nan"))
    y1 = qgemv(x, w, norm=norm, config=cfg, conv=(folded["conv_state"], folded["conv_weight"], act))
    assert torch.equal(y0, y1)
    qkv, z, b, a = y0.split(split, dim=-1)
    out0 = K.delta_decode(**{**plain, "mixed_qkv": qkv, "z": z, "a": a, "b": b})
    qkv, z, b, a = y1.split(split, dim=-1)
    out1 = K.delta_decode(**{**folded, "mixed_qkv": qkv, "z": z, "a": a, "b": b}, act=act)
    assert not act.isnan().any()
    for got, want in (
        (out1, out0),
        (folded["state"], plain["state"]),
        (folded["conv_state"], plain["conv_state"]),
    ):
        assert torch.equal(got, want)
    assert not torch.equal(folded["conv_state"], inputs["conv_state"])  # shifted


def test_the_conv_epilogue_refusals_name_what_does_not_fit():
    """More than one row, another epilogue, top-k along, channels past the outputs or not at a
    tile's end, a state of another shape or dtype, a bf16 act: refused, named; delta_decode's act
    with slots or a trail too."""
    from edgerun.kernels.qlinear_triton import folds_conv, qgemv

    dims = GEOMETRIES[1]
    w, norm = _in_proj(dims, "int4", 64, seed=6)
    inputs = random_delta_inputs(dims, 1, torch.Generator().manual_seed(7), dtype=torch.bfloat16)
    cs, cw = inputs["conv_state"], inputs["conv_weight"]
    act = torch.empty(1, dims.conv_dim)
    x = torch.randn(2, 64).bfloat16()
    with pytest.raises(ValueError, match="one row"):
        qgemv(x, w, conv=(cs, cw, act))
    with pytest.raises(ValueError, match="one row"):
        qgemv(
            x[:1],
            w,
            epilogue="residual",
            out=torch.zeros(1, w.rows, dtype=torch.bfloat16),
            conv=(cs, cw, act),
        )
    assert not folds_conv(w, 64, dims.conv_dim + 1) and not folds_conv(w, 64, w.rows + 2)
    with pytest.raises(ValueError, match="does not fit"):
        qgemv(x[:1], w, conv=(cs[:, :-1], cw[:-1], act[:, :-1]))  # not at the end of a tile of 2 rows
    with pytest.raises(ValueError, match="conv_state must be"):
        qgemv(x[:1], w, conv=(cs.float(), cw, act))
    with pytest.raises(ValueError, match="act must be"):
        qgemv(x[:1], w, conv=(cs, cw, act.bfloat16()))
    with pytest.raises(ValueError, match="act"):
        K.delta_decode(
            **random_delta_inputs(dims, 2, torch.Generator().manual_seed(8)),
            act=torch.empty(2, dims.conv_dim),
        )
