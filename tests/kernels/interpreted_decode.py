"""The router and attention decode kernels under Triton's CPU interpreter (tiny geometries, and
the probe at two real ones).

Not collected on its own: test_interpret.py runs this file in a child process with
TRITON_INTERPRET=1 set before Triton is imported (Triton reads it at import). Tolerances, each of
max |got - ref| over max |ref| (kernels/decode_reference.py says why the probe's are what they
are):

- fp32 1e-5: the kernels differ from the references only in summation order and transcendental
  ulps, ~1e-6 relative (about 5e-7 seen).
- bf16 / fp16: the probe's TOLERANCE. An fp32-level difference now and then flips a rounding by
  one ulp, and the attention rounds its unnormalised probabilities where the module rounds the
  normalised ones (that alone moves up to half the outputs of a short history by an ulp, so
  outputs are not compared bit by bit). The key written at pos rounds exactly where the module
  does: it is checked to be bit-equal but for rare flips (``mostly_equal``). The fp32 cases
  check the math itself, 1e-5.
- router weights, element by element: fp32 within 1e-5 of each weight (softmax over E <= 512
  terms summed in another order, exp ulps); bf16 / fp16 within one ulp of each (2^-7 / 2^-10 of
  the value at most), where an fp32-level difference carried a rounding across a boundary.
- ids: equal to the reference's (random logits have no ties, and decisive_rows says so); the
  tie test checks the lower-id rule directly.
"""

import os
from contextlib import nullcontext

import pytest
import torch
import triton
import triton.language as tl
from router_cases import router, with_shared
from test_decode_reference import qwen3_30b_args, qwen36_args, tiny_args
from torch import nn

from edgerun.kernels import decode_triton as K
from edgerun.kernels.bits_triton import _key32_index, _key_index, _key_value, _order_key, _order_key32
from edgerun.kernels.decode_reference import (
    TOLERANCE,
    AttnDims,
    capacity_mismatch,
    check_attention,
    check_router,
    decisive_rows,
    probe_cases,
    random_attention_inputs,
    random_router_inputs,
    run_attention,
    run_router,
    window_mismatch,
)
from edgerun.kernels.decode_triton import _pick, _route_row
from edgerun.kernels.qlinear_reference import random_qweight
from edgerun.kernels.qlinear_triton import pairs, qgemv

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="run by test_interpret.py")
TOL = {**TOLERANCE, torch.float32: 1e-5}
WEIGHT_RTOL = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}
DTYPES = [torch.float32, torch.bfloat16]


def mostly_equal(got: torch.Tensor, ref: torch.Tensor, share: float) -> None:
    """In bf16 / fp16, at most ``share`` of the elements differ at all."""
    if ref.dtype != torch.float32:
        assert (got != ref).float().mean() <= share, (got != ref).float().mean()


# --------------------------------------------------------------------------------------------
# Router


def untied_logits(n: int, width: int, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """Rows of distinct values in -8..8 (multiples of 1/32: exact in bf16), shuffled: no ties."""
    grid = (torch.arange(512) - 256) / 32
    return torch.stack([grid[torch.randperm(512, generator=gen)[:width]] for _ in range(n)]).to(dtype)


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("dtype", [*DTYPES, torch.float16])
@pytest.mark.parametrize("E, A, extra", [(8, 2, 0), (16, 2, 1), (12, 3, 2), (500, 8, 1)])
def test_router_matches_reference(E, A, extra, dtype, normalize):
    gen = torch.Generator().manual_seed(E)
    inputs = random_router_inputs(6, E, A, extra, gen, dtype=dtype, normalize=normalize)
    inputs["logits"] = untied_logits(6, E + extra, gen, dtype)
    assert decisive_rows(inputs["logits"], E, A)[1].all()  # every id is decided
    runs, ref = run_router(inputs, K.router_topk)
    check_router(runs, ref, TOL[dtype])
    got = runs[0]
    assert torch.equal(got["ids_out"], ref["ids_out"])
    w, w_ref = got["weights_out"].float(), ref["weights_out"].float()
    assert ((w - w_ref).abs() <= WEIGHT_RTOL[dtype] * w_ref.abs()).all()
    if extra:
        g, g_ref = got["gate_out"].float(), ref["gate_out"].float()
        assert ((g - g_ref).abs() <= WEIGHT_RTOL[dtype] * g_ref.abs()).all()


def test_router_ties_go_to_the_lower_expert_id():
    logits = torch.tensor([[0.5, 2.0, 1.0, 2.0, 2.0, -1.0, 0.0, 2.0], [1.0] * 8]).bfloat16()
    for k, want in [(1, [[1], [0]]), (2, [[1, 3], [0, 1]]), (3, [[1, 3, 4], [0, 1, 2]])]:
        weights, ids = torch.empty(2, k, dtype=torch.bfloat16), torch.empty(2, k, dtype=torch.int64)
        K.router_topk(logits, 8, k, False, weights, ids)
        assert ids.tolist() == want
        probs = torch.softmax(logits.float(), -1)
        assert torch.equal(weights, probs.gather(1, ids).bfloat16())


def test_router_ranks_minus_zero_with_zero_and_minus_inf_last():
    # -0.0 == +0.0, so among them the lower id goes first; -inf logits (masked experts) go last
    logits = torch.tensor([[-1.0, 0.0, -0.0, -float("inf"), -0.5, -0.0, -float("inf"), -2.0]])
    weights, ids = torch.empty(1, 8), torch.empty(1, 8, dtype=torch.int64)
    K.router_topk(logits, 8, 8, False, weights, ids)
    assert ids.tolist() == [[1, 2, 5, 4, 0, 7, 3, 6]]


@triton.jit
def _keys_kernel(x, index, keys, values, indices, N: tl.constexpr):
    o = tl.arange(0, N)
    key = _order_key(tl.load(x + o), tl.load(index + o))
    tl.store(keys + o, key)
    tl.store(values + o, _key_value(key))
    tl.store(indices + o, _key_index(key))


def test_order_keys_sort_as_argmax_ranks_and_give_back_value_and_index():
    """``bits_triton._order_key``: the integer order of the keys is (value descending, NaN
    first, -0.0 equal to +0.0, then the lower index), and the value and index come back exactly."""
    g = torch.Generator().manual_seed(3)
    special = [
        float("nan"),
        float("inf"),
        -float("inf"),
        0.0,
        -0.0,
        1e-40,
        -1e-40,
        3.4e38,
        -3.4e38,
        1.0,
        -1.0,
    ]
    x = torch.cat(
        [torch.tensor(special), torch.randn(64 - 2 * len(special), generator=g), torch.tensor(special)]
    )
    index = torch.randint(0, 2**31 - 1, (64,), generator=g, dtype=torch.int32)
    index[-len(special) :] = index[: len(special)] + 1  # each special value twice, indices adjacent
    keys, values = torch.empty(64, dtype=torch.int64), torch.empty(64)
    indices = torch.empty(64, dtype=torch.int32)
    _keys_kernel[(1,)](x, index, keys, values, indices, N=64)
    assert torch.equal(indices, index)
    nan = x.isnan()
    assert values[nan].isnan().all()
    want = torch.where(x == 0, torch.zeros_like(x), x)  # +0.0 for -0.0
    assert torch.equal(values[~nan].view(torch.int32), want[~nan].view(torch.int32))
    ranked = sorted(range(64), key=lambda i: (not nan[i], 0.0 if nan[i] else -x[i].item(), index[i].item()))
    assert sorted(range(64), key=lambda i: -keys[i].item()) == ranked


@triton.jit
def _keys32_kernel(x, index, keys, keys32, indices, N: tl.constexpr):
    o = tl.arange(0, N)
    v, i = tl.load(x + o).to(tl.float32), tl.load(index + o)
    tl.store(keys + o, _order_key(v, i))
    k32 = _order_key32(v, i)
    tl.store(keys32 + o, k32)
    tl.store(indices + o, _key32_index(k32))


def test_int32_keys_of_bf16_values_sort_as_the_int64_keys():
    """``_order_key32`` on bf16 values: the int32 keys sort exactly as ``_order_key``'s int64 keys
    (NaN first, -0.0 equal to +0.0, infinities, subnormals, neighbouring bf16 values, ties by
    the lower index) and give the index back."""
    g = torch.Generator().manual_seed(4)
    special = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, -1e-40, 3.38e38, -3.38e38, 1.0,
               -1.0, 1.0078125, -1.0078125, 0.99609375, -0.99609375]  # fmt: skip
    x = torch.cat(
        [torch.tensor(special), torch.randn(128 - 2 * len(special), generator=g), torch.tensor(special)]
    )
    x = x.bfloat16()
    x[40:44] = x[44:48]  # equal values at other indices
    index = torch.randperm(128, generator=g).int()
    keys, keys32 = torch.empty(128, dtype=torch.int64), torch.empty(128, dtype=torch.int32)
    indices = torch.empty(128, dtype=torch.int32)
    _keys32_kernel[(1,)](x, index, keys, keys32, indices, N=128)
    assert torch.equal(indices, index)
    assert torch.equal(keys32.long().argsort(descending=True), keys.argsort(descending=True))
    assert len(set(keys32.tolist())) == 128  # unique: a pick removes exactly one key


@triton.jit
def _pick_kernel(logits, out, E: tl.constexpr, K: tl.constexpr, BLOCK_E: tl.constexpr, KEY32: tl.constexpr):
    row = tl.program_id(0)
    for a in range(K):
        tl.store(out + row * K + a, _pick(logits + row * E, a, E, K, BLOCK_E, KEY32))


@pytest.mark.parametrize("E, top", [(16, 8), (200, 8), (257, 6)])
def test_picks_on_int32_keys_are_the_int64_keys_picks(E, top):
    """``_pick`` with KEY32 on bf16 logit rows (ties at and below the top, -0.0 and +0.0, -inf,
    NaN, padding past E): every pick a < K the int64 keys' pick, and router_topk's ids."""
    g = torch.Generator().manual_seed(E)
    logits = torch.randn(5, E, generator=g).bfloat16()
    logits[0, 3] = logits[0, 9] = logits[0].max() + 1  # a tie at the top
    logits[1, :4] = torch.tensor([0.0, -0.0, 0.0, -0.0])
    logits[1, 4:] = -float("inf")  # masked experts: zeros first, then the -inf ones by id
    logits[2, 5] = float("nan")
    logits[3] = logits[3].round()  # many ties
    ids = {}
    for key32 in (False, True):
        out = torch.empty(5, top, dtype=torch.int32)
        _pick_kernel[(5,)](logits, out, E=E, K=top, BLOCK_E=triton.next_power_of_2(E), KEY32=key32)
        ids[key32] = out
    assert torch.equal(ids[True], ids[False])
    weights, want = torch.empty(5, top, dtype=torch.bfloat16), torch.empty(5, top, dtype=torch.int64)
    K.router_topk(logits, E, top, True, weights, want)
    assert torch.equal(ids[True].long()[[0, 1, 3, 4]], want[[0, 1, 3, 4]])  # (a NaN row: its own test)


@triton.jit
def _route32_kernel(logits, weights, ids, E: tl.constexpr, K: tl.constexpr, BLOCK_E: tl.constexpr,
                    BLOCK_K: tl.constexpr, KEY32: tl.constexpr):  # fmt: skip
    _route_row(
        logits, E, tl.program_id(0), weights, ids, weights, E, K, BLOCK_E, BLOCK_K, True, False, 1, KEY32
    )


@pytest.mark.parametrize("E, top", [(16, 8), (257, 6)])
def test_routing_on_int32_keys_is_the_int64_keys_routing(E, top):
    """``_route_row`` with KEY32 on bf16 rows (ties, zeros of both signs, -inf, NaN, padding):
    the ids and the renormalised weights bit for bit the int64 keys' (``_key32_value`` gives each
    pick's value back exactly)."""
    g = torch.Generator().manual_seed(E + 1)
    logits = torch.randn(5, E, generator=g).bfloat16()
    logits[0, 3] = logits[0, 9] = logits[0].max() + 1
    logits[1, :4] = torch.tensor([0.0, -0.0, 0.0, -0.0])
    logits[1, 4:] = -float("inf")
    logits[2, 5] = float("nan")
    logits[3] = logits[3].round()
    logits[4] = -logits[4].abs()  # every logit negative
    got = {}
    for key32 in (False, True):
        w, i = torch.empty(5, top, dtype=torch.bfloat16), torch.empty(5, top, dtype=torch.int64)
        _route32_kernel[(5,)](logits, w, i, E=E, K=top, BLOCK_E=triton.next_power_of_2(E),
                              BLOCK_K=triton.next_power_of_2(top), KEY32=key32)  # fmt: skip
        got[key32] = (w, i)
    assert torch.equal(got[True][1], got[False][1])
    assert torch.equal(got[True][0].view(torch.int16), got[False][0].view(torch.int16))  # NaN rows too


def test_router_reads_strided_rows_and_the_gate_column():
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(5, 40, generator=g).bfloat16()
    logits = wide[:, 4:21]  # E 16 + the gate column, rows 40 apart
    inputs = random_router_inputs(5, 16, 2, 1, g)
    inputs["logits"] = logits
    runs, ref = run_router(inputs, K.router_topk)
    check_router(runs, ref, TOL[torch.bfloat16])
    assert torch.equal(runs[0]["gate_out"], torch.sigmoid(logits[:, 16:17]))


def test_router_refusals_name_the_tensor():
    inputs = random_router_inputs(3, 8, 2, 1, torch.Generator().manual_seed(2))
    cases = [
        ("weights_out", inputs["weights_out"].float(), "weights_out must be torch.bfloat16"),
        ("ids_out", inputs["ids_out"][:, :1], r"ids_out must be \[3, 2\]"),
        ("gate_out", inputs["gate_out"][:2], r"gate_out must be \[3, 1\]"),
        ("logits", inputs["logits"].t(), "contiguous rows"),
        ("logits", inputs["logits"][:, :8], "needs 9"),
        ("top_k", 9, "not in 1..8"),
    ]
    for name, bad, msg in cases:
        with pytest.raises(ValueError, match=msg):
            K.router_topk(**{**inputs, name: bad})


# --------------------------------------------------------------------------------------------
# Attention


@pytest.mark.parametrize("pos", [0, 5, 63])
@pytest.mark.parametrize("dh, r", [(32, 16), (64, 64)])
@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_matches_reference(dtype, gated, unit_offset, dh, r, pos):
    dims = AttnDims(4, 2, dh, r, gated)
    gen = torch.Generator().manual_seed(pos + dh)
    inputs = random_attention_inputs(dims, 64, pos, gen, dtype=dtype, unit_offset=unit_offset)
    runs, ref, before = run_attention(inputs, K.attention_decode)
    check_attention(runs, ref, before, TOL[dtype])  # also: rows past pos unread (NaN), others untouched
    mostly_equal(runs[0]["k_cache"][:, :, pos], ref["k_cache"][:, :, pos], 0.02)


@pytest.mark.parametrize(
    "heads, s_max, pos",
    [
        ((2, 2, 48, 16), 64, 40),  # no GQA; head dim not a power of two (masked channels)
        ((4, 1, 32, 32), 64, 33),  # one kv head for all
        ((8, 2, 32, 8), 50, 49),  # buffer not a whole number of tiles, last position
        ((8, 2, 32, 8), 50, 20),
    ],
)
@pytest.mark.parametrize("dtype", [*DTYPES, torch.float16])
def test_attention_other_geometries(heads, s_max, pos, dtype):
    dims = AttnDims(*heads, gated=True)
    inputs = random_attention_inputs(dims, s_max, pos, torch.Generator().manual_seed(pos), dtype=dtype)
    check_attention(*run_attention(inputs, K.attention_decode), TOL[dtype])


def test_attention_splits_share_long_histories():
    # 64 splits over 2 kv heads, 64-position tiles: pos 70 runs on two of them (70 + 1 positions
    # in shares of 64), pos 255 on four, its own row in the last; the rest return at once
    assert K.attention_plan(2, 32) == K.AttnPlan(block_s=64, nsplit=64)
    dims = AttnDims(4, 2, 32, 32, True)
    for pos in (70, 255):
        inputs = random_attention_inputs(dims, 256, pos, torch.Generator().manual_seed(pos))
        check_attention(*run_attention(inputs, K.attention_decode), TOL[torch.bfloat16])


def test_attention_bits_do_not_depend_on_the_cache_capacity():
    """The same history in caches of 64 to 1024 positions: the same output and cache writes,
    bit for bit (tests/kernels/test_decode_cuda.py checks the compiled kernel at the real
    geometry, where the combine over splits is where a capacity-sized plan showed)."""
    dims = AttnDims(4, 2, 32, 32, True)
    for pos in (50, 63):
        gen = torch.Generator().manual_seed(pos)
        assert (
            capacity_mismatch(K.attention_decode, dims, pos, [64, 256, 1024], gen, "cpu", torch.bfloat16)
            is None
        )


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_rows_by_slot_are_one_row_calls(dtype):
    """A batch's step: N rows, each at its own position in its own entry of a cache pool (by
    slot); each row's output and the key and value it writes are the one-row call's bit for bit,
    and the entry no row names is untouched."""
    dims = AttnDims(4, 2, 32, 16, True)
    gen = torch.Generator().manual_seed(11)
    pool = random_attention_inputs(dims, 64, 0, gen, dtype=dtype)
    pool["k_cache"] = torch.randn(3, 2, 64, 32, generator=gen).to(dtype)
    pool["v_cache"] = torch.randn(3, 2, 64, 32, generator=gen).to(dtype)
    qkv = torch.randn(2, dims.qkv_width, generator=gen).mul(2).to(dtype)
    slots, pos = torch.tensor([2, 0]), torch.tensor([5, 40])
    got = {**pool, "qkv": qkv, "pos": pos, "slots": slots, "out": torch.empty(2, 128, dtype=dtype)}
    got["k_cache"], got["v_cache"] = pool["k_cache"].clone(), pool["v_cache"].clone()
    K.attention_decode(**got)
    for r, e in enumerate(slots.tolist()):
        one = {**pool, "qkv": qkv[r : r + 1], "pos": pos[r : r + 1], "out": torch.empty(1, 128, dtype=dtype)}
        one["k_cache"], one["v_cache"] = (
            pool["k_cache"][e : e + 1].clone(),
            pool["v_cache"][e : e + 1].clone(),
        )
        K.attention_decode(**one)
        assert torch.equal(got["out"][r], one["out"][0]), r
        assert torch.equal(got["k_cache"][e], one["k_cache"][0]) and torch.equal(
            got["v_cache"][e], one["v_cache"][0]
        )
    assert torch.equal(got["k_cache"][1], pool["k_cache"][1])
    with pytest.raises(ValueError, match="without slots the caches hold one entry a row"):
        K.attention_decode(**{**got, "slots": None})


@pytest.mark.parametrize(
    "dtype, gated, pos, programs",
    [
        (torch.bfloat16, True, 5, None),  # pos in its split's one tile
        (torch.float32, False, 63, None),  # pos the tile's last row
        (torch.bfloat16, True, 70, None),  # two splits, pos in the second's first tile
        (torch.bfloat16, False, 255, 4),  # splits of two tiles: pos in a later tile
        (torch.float32, True, 130, 4),
    ],
)
def test_attention_reading_early_is_the_same_bits(dtype, gated, pos, programs, monkeypatch):
    """``ATTN_EARLY``: the attend launch reads the position, the slot and the first tile of older
    keys and values before its wait (the row at pos put in from the registers that stored it),
    the combine the position and the output gate: the output and the caches bit for bit those of
    the launches that read after the wait, one row and rows by slot; with ``EARLY_NORMS`` the q
    and k norms' weights and the rotary tables read early too. (It fails when the row at pos is
    not put into the early tile: the tile then holds 0 there.)"""
    from edgerun.kernels import launch

    if programs:
        monkeypatch.setattr(K, "TARGET_PROGRAMS", programs)
    dims = AttnDims(4, 2, 32, 16, gated)
    gen = torch.Generator().manual_seed(pos)
    one = random_attention_inputs(dims, 256, pos, gen, dtype=dtype)
    batch = dict(one, qkv=torch.randn(2, dims.qkv_width, generator=gen).to(dtype), slots=torch.tensor([1, 0]))
    batch["k_cache"] = torch.randn(2, 2, 256, 32, generator=gen).to(dtype)
    batch["v_cache"] = torch.randn(2, 2, 256, 32, generator=gen).to(dtype)
    batch["pos"], batch["out"] = torch.tensor([pos, pos // 2]), torch.empty(2, 128, dtype=dtype)

    def run(inputs, early, params):
        monkeypatch.setattr(K, "ATTN_EARLY", early)
        monkeypatch.setattr(launch, "EARLY_NORMS", params)
        got = {**inputs, "k_cache": inputs["k_cache"].clone(), "v_cache": inputs["v_cache"].clone()}
        got["out"] = torch.full_like(inputs["out"], float("nan"))
        K.attention_decode(**got)
        return got["out"], got["k_cache"], got["v_cache"]

    for inputs in (one, batch):
        want = run(inputs, False, False)
        for early, params in ((True, False), (True, True), (False, True)):
            got = run(inputs, early, params)
            assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


# each dtype, gated and not, each size. 64 splits over 2 kv heads are 64 positions long (61, 62:
# windows that cross from one split to two). With 4 programs (2 splits) a split is cdiv(pos + 1, 2)
# in 64-position tiles: 127 in the second of 64, 128 in the first of 192, which reads the keys of
# 126 and 127 that other programs of the launch write (programs the interpreter runs later).
@pytest.mark.parametrize(
    "dtype, gated, n, start, programs",
    [
        (torch.float32, False, 5, 61, None),
        (torch.bfloat16, True, 5, 61, None),
        (torch.bfloat16, False, 3, 62, None),
        (torch.float32, True, 2, 40, None),
        (torch.bfloat16, False, 1, 5, None),
        (torch.bfloat16, True, 3, 126, 4),
        (torch.float32, False, 3, 126, 4),
    ],
)
def test_attention_window_is_its_one_row_calls(dtype, gated, n, start, programs, monkeypatch):
    """A verify window of n tokens in one call: each row's output and the caches afterwards are
    those of n one-row calls in order, bit for bit."""
    if programs:
        monkeypatch.setattr(K, "TARGET_PROGRAMS", programs)
        assert K.attention_plan(2, 32).nsplit == programs // 2
    dims = AttnDims(4, 2, 32, 16, gated)
    gen = torch.Generator().manual_seed(n)
    got = window_mismatch(K.attention_decode, dims, start, n, 136, gen, "cpu", dtype)
    assert got is None, got


def test_attention_window_refusals():
    inputs = random_attention_inputs(AttnDims(4, 2, 32, 16, True), 64, 3, torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match="slots cannot be given with window"):
        K.attention_decode(**inputs, slots=torch.tensor([0]), window=True)
    empty = {name: inputs[name][:0] for name in ("k_cache", "v_cache")}
    with pytest.raises(ValueError, match="the caches hold no entry"):
        K.attention_decode(**{**inputs, **empty}, window=True)


def test_attention_refusals_name_the_tensor():
    dims = AttnDims(4, 2, 32, 16, True)
    inputs = random_attention_inputs(dims, 64, 3, torch.Generator().manual_seed(3))
    cases = [
        ("qkv", inputs["qkv"][:, :-1], r"qkv must be \[1, 384\]"),
        ("k_cache", inputs["k_cache"].float(), "k_cache must be torch.bfloat16"),
        ("v_cache", inputs["v_cache"][:, :, :32], r"v_cache must be \[1, 2, 64, 32\]"),
        ("pos", inputs["pos"].int(), "pos must be torch.int64"),
        ("inv_freq", inputs["inv_freq"].double(), "inv_freq must be torch.float32"),
        ("q_norm_w", inputs["q_norm_w"].float(), "q_norm_w must be torch.bfloat16"),
        ("out", inputs["out"][:, :64], r"out must be \[1, 128\]"),
        ("n_kv", 3, "not a multiple of kv heads"),
        ("inv_freq", inputs["inv_freq"].repeat(3), "rotary dim 48"),
    ]
    for name, bad, msg in cases:
        with pytest.raises(ValueError, match=msg):
            K.attention_decode(**{**inputs, name: bad})


def test_unsupported_geometries():
    assert K.unsupported_attention(16, 2, 256, 64) is None
    assert "over 256" in K.unsupported_attention(4, 2, 512, 64)
    assert K.unsupported_router(256, 8) is None and "over" in K.unsupported_router(2048, 8)


# --------------------------------------------------------------------------------------------
# The probe at the real geometries


@pytest.mark.parametrize("args", [qwen36_args, qwen3_30b_args])
@pytest.mark.parametrize("dtype", DTYPES)
def test_probe_cases_pass_at_the_real_geometries(args, dtype):
    assert probe_cases(args(), torch.device("cpu"), dtype) < TOL[dtype]


# --------------------------------------------------------------------------------------------
# The router's launches (Router.route)


def test_router_route_is_logits_then_select():
    """``Router.route`` is :meth:`logits` then :meth:`select` (``fused``: ``router_topk``'s one
    launch after the GEMV's), on qgemv or not, within exact_rows or not; the shared expert's
    gate_up rides in the router's launch only where fused on qgemv."""
    from edgerun.models.layers import QLinear, RMSNorm, Router, exact_rows

    args = tiny_args("qwen3_5_moe")
    torch.manual_seed(0)
    r = Router(args)
    with torch.no_grad():
        r.weight.normal_(0, 1)
    r.fuse(nn.Linear(args.hidden_size, 1, bias=False))
    r.proj.gemv = True
    norm = RMSNorm(args.hidden_size, args.rms_norm_eps, args.norm_unit_offset)
    A = args.num_experts_per_tok

    def outs(n):
        return torch.full((n, A), float("nan")), torch.full((n, A), -1, dtype=torch.long)

    for n, rows, fused in [(2, nullcontext, True), (3, exact_rows, True), (3, nullcontext, True), (2, nullcontext, False)]:  # fmt: skip
        x = torch.randn(n, args.hidden_size)
        with rows():
            one, two, normed, normed_apart = outs(n), outs(n), torch.empty_like(x), torch.empty_like(x)
            logits = r.route(x, one, fused, norm, normed)
            want = r.logits(x, norm, normed_apart)
            r.select(want, two, fused)
        assert torch.equal(logits, want) and torch.equal(normed, normed_apart)
        assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True))
    shared = QLinear(random_qweight("int4", 32, args.hidden_size, 16, torch.Generator().manual_seed(2)))
    shared.gemv = True
    x = torch.randn(1, args.hidden_size)
    with pytest.raises(ValueError, match="only where fused"):
        r.route(x, outs(1), False, norm, torch.empty_like(x), also=(shared, "silu_mul", torch.empty(1, 16)))


@pytest.mark.parametrize("scheme", ["int4", "int8", "plain"])
def test_gemv_with_a_second_weight_is_each_ones_launch(scheme):
    """The router GEMV with the shared expert's gate_up in its launch (``also``, the decode
    step's): logits, the normalised x it stores and the gate_up's SiLU(gate) * up (its programs
    normalising x themselves) each bit for bit the launch it replaces."""
    E, extra, D, inter = 24, 1, 64, 40
    w, norm = router(E, extra, D, torch.bfloat16, seed=5)
    shared = random_qweight(scheme, 2 * inter, D, 16, torch.Generator().manual_seed(6), dtype=torch.bfloat16)
    assert pairs(w, shared, D)
    for seed in (1, 2):
        x = (torch.randn(1, D, generator=torch.Generator().manual_seed(seed)) * 3).bfloat16()
        one, two = with_shared(w, norm, shared, x)
        for a, b in zip(one, two, strict=True):
            assert torch.equal(a, b)


def test_gemv_second_weight_refusals():
    """What the paired launch does not take is refused, named: more than one row, an epilogue
    other than none / silu_mul, a weight whose tile runs other warps (a launch has one count)."""
    E, D = 16, 64
    w, norm = router(E, 0, D, torch.bfloat16, seed=1)
    shared = random_qweight("int4", 32, D, 16, torch.Generator().manual_seed(2), dtype=torch.bfloat16)
    x = torch.randn(2, D).bfloat16()
    with pytest.raises(ValueError, match="one row"):
        qgemv(x, w, also=(shared, "silu_mul", torch.empty(2, 16, dtype=torch.bfloat16)))
    with pytest.raises(ValueError, match="epilogue"):
        qgemv(x[:1], w, also=(shared, "residual", torch.empty(1, 32, dtype=torch.bfloat16)))
    many = random_qweight("int4", 8448, D, 16, torch.Generator().manual_seed(3), dtype=torch.bfloat16)
    assert not pairs(w, many, D)  # MANY's int4 tile runs 2 warps, the router's plain tile 4
    with pytest.raises(ValueError, match="does not pair"):
        qgemv(x[:1], w, also=(many, "none", torch.empty(1, 8448, dtype=torch.bfloat16)))
