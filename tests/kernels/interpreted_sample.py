"""The device sampler (kernels/sample_triton.py) under Triton's CPU interpreter.

Not collected on its own: test_interpret.py runs this file in a child process with
TRITON_INTERPRET=1 set before Triton is imported.

The distribution is the CPU sampler's (``Sampler.probs``: temperature, top-k with its ties,
top-p), so the reference here is that, drawn by inverse CDF in the kernel's order (sorted
descending when the request filters, else id order) in float64. The kernel sums in fp32 tiles,
so a u within 5e-6 of the total mass of a boundary between two tokens may fall either side:
those u are skipped (and counted, to show they are few); every other u must give the
reference's token exactly.
"""

import math

import pytest
import torch

from edgerun.engine.sampler import Sampler, SamplingParams
from edgerun.kernels import sample_triton as S

CPU = torch.device("cpu")


def draw(logits, rows, u=None, counter=None, add=0):
    """rows: (temperature, top_p, top_k, seed) per row of logits -> (tokens, chosen logits)."""
    N, V = logits.shape
    buf = S.SampleBuffers(N, V, CPU, logits.dtype)
    buf.set(rows)
    sort = any(S.filtered(k, p) for _, p, k, _ in rows)
    token = torch.full((N,), -1, dtype=torch.int64)
    chosen = torch.zeros(N, dtype=logits.dtype)
    counter = counter if counter is not None else torch.zeros(N, dtype=torch.int64)
    S.sample(logits, buf, counter, add, token, chosen, sort, uniform=u)
    return token, chosen


def reference(row, t, top_p, top_k, u, sort):
    """(the token, the distance of u's target from the nearest boundary over the total mass)."""
    probs = Sampler(SamplingParams(temperature=t, top_p=top_p, top_k=top_k)).probs(row).double()
    order = (
        torch.sort(row.float(), descending=True, stable=True).indices if sort else torch.arange(row.numel())
    )
    c = probs[order].cumsum(0)
    target = u * float(c[-1])
    i = int(torch.searchsorted(c, torch.tensor([target], dtype=torch.float64), right=True)[0])
    i = min(i, row.numel() - 1)
    while float(probs[order[i]]) == 0.0:  # the draw never lands on a dropped logit
        i -= 1
    margin = min(abs(float(c[i]) - target), abs(target - (float(c[i - 1]) if i else 0.0))) / float(c[-1])
    return int(order[i]), margin


CASES = [  # (temperature, top_p, top_k)
    (1.0, 1.0, 0),
    (0.7, 1.0, 0),
    (0.8, 0.95, 0),
    (0.7, 0.8, 20),
    (1.3, 1.0, 50),
    (0.5, 0.3, 0),
]


@pytest.mark.parametrize("vocab", [50, 5000])  # one tile; two (BLOCK 4096)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-p{c[1]}-k{c[2]}")
def test_each_draw_is_the_reference_inverse_cdf(case, dtype, vocab):
    t, top_p, top_k = case
    g = torch.Generator().manual_seed(vocab + int(100 * t))
    logits = (torch.randn(1, vocab, generator=g) * 3).to(dtype)
    us = torch.linspace(0.0005, 0.9995, 40)
    sort = 0 < top_k < vocab or top_p < 1.0  # the row draws over its sorted logits
    logits_n = logits.expand(len(us), vocab).contiguous()
    tokens, chosen = draw(logits_n, [(t, top_p, top_k, 1)] * len(us), u=us)
    skipped = 0
    for j, u in enumerate(us.tolist()):
        want, margin = reference(logits[0], t, top_p, top_k, u, sort)
        if margin < 5e-6:
            skipped += 1
            continue
        assert int(tokens[j]) == want, f"u={u}: token {int(tokens[j])}, reference {want}"
        assert torch.equal(chosen[j], logits[0, want])
    assert skipped <= 6  # of 40: a boundary every ~1/5,000 of the mass at the larger vocabulary


def test_top_k_keeps_ties_at_the_kth_logit_and_top_p_keeps_the_first():
    # logits 5, 4, 4, 4, 1: top_k 2 keeps the three 4s (ties at the 2nd largest)
    logits = torch.tensor([[1.0, 4.0, 5.0, 4.0, 4.0]])
    us = torch.linspace(0.001, 0.999, 200)
    toks, _ = draw(logits.expand(200, 5).contiguous(), [(1.0, 1.0, 2, 0)] * 200, u=us)
    assert set(toks.tolist()) == {1, 2, 3, 4}
    # a top_p below the largest probability keeps the largest alone
    toks, _ = draw(logits.expand(200, 5).contiguous(), [(1.0, 1e-6, 0, 0)] * 200, u=us)
    assert set(toks.tolist()) == {2}


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("sort", [False, True])
def test_a_row_with_a_non_finite_logit_is_refused_and_only_that_row(bad, sort):
    logits = torch.randn(2, 300)
    logits[1, 123] = bad
    rows = [(1.0, 0.9 if sort else 1.0, 0, 3)] * 2
    _, chosen = draw(logits, rows)
    assert math.isfinite(float(chosen[0]))
    assert math.isnan(float(chosen[1]))


def test_a_row_is_the_same_token_alone_or_with_other_rows_and_with_the_same_seed_and_index():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 700, generator=g)
    rows = [(0.9, 0.95, 0, 11), (1.0, 1.0, 0, 12), (0.6, 0.9, 40, 13), (1.2, 1.0, 0, 14)]
    counter = torch.tensor([7, 8, 9, 10])
    together, _ = draw(logits, rows, counter=counter, add=1)
    for r in range(4):
        alone, _ = draw(logits[r : r + 1].contiguous(), [rows[r]], counter=counter[r : r + 1] + 1)
        assert int(alone[0]) == int(together[r])
    again, _ = draw(logits, rows, counter=counter, add=1)
    assert torch.equal(again, together)


def test_draws_follow_the_samplers_distribution():
    """Chi-square of 500 draws (seeds 0..499, one index) against ``Sampler.probs`` on a
    12-token vocabulary (every kept probability above 0.03: 15 draws expected or more), filtered
    and not. Seeded, so the statistic is a fixed number: at
    p = 0.001 a correct sampler fails one seed set in a thousand, and this one is fixed."""
    logits = torch.tensor([[1.0, 0.8, 0.6, 0.5, 0.3, 0.2, 0.0, -0.2, -0.4, -0.6, -0.8, -1.0]])
    n = 500
    for t, top_p, top_k in [(1.0, 1.0, 0), (0.8, 0.9, 0), (1.5, 1.0, 6)]:
        rows = [(t, top_p, top_k, seed) for seed in range(n)]
        toks, _ = draw(
            logits.expand(n, 12).contiguous(), rows, counter=torch.full((n,), 42, dtype=torch.int64)
        )
        probs = Sampler(SamplingParams(temperature=t, top_p=top_p, top_k=top_k)).probs(logits[0]).double()
        counts = torch.bincount(toks, minlength=12).double()
        assert float(counts[probs == 0].sum()) == 0.0, "a dropped token was drawn"
        live = probs > 0
        expected = probs[live] * n
        chi2 = float(((counts[live] - expected) ** 2 / expected).sum())
        dof = int(live.sum()) - 1
        # the chi-square 0.999 quantile for dof <= 11 is at most 31.3
        assert chi2 < 31.3, f"T={t} top_p={top_p} top_k={top_k}: chi2 {chi2:.1f} with {dof} dof"


def test_the_draw_depends_on_the_seed_and_the_index():
    logits = torch.zeros(64, 1000)  # uniform: the token is the draw's u, scaled
    same = draw(logits, [(1.0, 1.0, 0, 9)] * 64)[0]
    assert len(set(same.tolist())) == 1
    by_index = draw(logits, [(1.0, 1.0, 0, 9)] * 64, counter=torch.arange(64))[0]
    by_seed = draw(logits, [(1.0, 1.0, 0, s) for s in range(64)])[0]
    assert len(set(by_index.tolist())) > 50 and len(set(by_seed.tolist())) > 50


def test_bad_buffers_are_refused_by_name():
    logits = torch.randn(2, 10)
    buf = S.SampleBuffers(1, 10, CPU, logits.dtype)
    tok, ch = torch.zeros(2, dtype=torch.int64), torch.zeros(2)
    with pytest.raises(ValueError, match="do not fit sample buffers"):
        S.sample(logits, buf, torch.zeros(2, dtype=torch.int64), 0, tok, ch, False)
    buf = S.SampleBuffers(2, 10, CPU, logits.dtype)
    with pytest.raises(ValueError, match="counter must be torch.int64"):
        S.sample(logits, buf, torch.zeros(2, dtype=torch.int32), 0, tok, ch, False)


def greedy_rows(vocab: int) -> torch.Tensor:
    """Rows whose argmax has every case torch's definition settles: random; a tie for the
    largest (the first index wins); NaNs (the first NaN wins); +inf; all -inf; zeros of both
    signs (equal: the first wins)."""
    g = torch.Generator().manual_seed(vocab)
    rows = (torch.randn(6, vocab, generator=g) * 4).to(torch.bfloat16)
    top = rows[1].max()
    rows[1, vocab // 3], rows[1, -1] = top, top
    rows[2, vocab // 2], rows[2, -2] = float("nan"), float("nan")
    rows[3, -1] = float("inf")
    rows[4] = float("-inf")
    rows[5] = -1.0
    rows[5, vocab // 4 :] = 0.0
    rows[5, : vocab // 2] = -0.0
    return rows


@pytest.mark.parametrize("keys", [False, True], ids=["reductions", "keys"])
@pytest.mark.parametrize("vocab, span", [(37, None), (4096, None), (300, 64), (5000, 1024), (20000, None)])
def test_greedy_is_torchs_argmax_and_its_logit_whatever_the_split(vocab, span, keys, monkeypatch):
    """``greedy``: one launch for ``torch.argmax`` + ``torch.gather`` of the decode step's head,
    exactly theirs (the first index of the largest, NaN the largest), a row in one program or
    split among programs (``span``; 20,000 logits: the default split) that meet in one key a
    row, which the last of them leaves reset: a second call gives the same. Each tile by three
    reductions or (``GREEDY_KEYS``) by one maximum of its order keys."""
    monkeypatch.setattr(S, "GREEDY_KEYS", keys)
    logits = greedy_rows(vocab)
    want = torch.argmax(logits, dim=-1)
    chosen_want = torch.gather(logits, -1, want[:, None])[:, 0]
    scratch = S.greedy_scratch(8, CPU)
    for _ in range(2):
        token = torch.full((3, 6), -1, dtype=torch.int64)[1]  # a row of a larger buffer, as the step's
        chosen = torch.zeros(6, 2, dtype=torch.bfloat16)[:, 0]  # strided
        S.greedy(logits, token, chosen, scratch, span=span)
        assert torch.equal(token, want)
        assert torch.equal(chosen.isnan(), chosen_want.isnan())
        assert torch.equal(chosen.nan_to_num(), chosen_want.nan_to_num())
        assert torch.equal(scratch, S.greedy_scratch(8, CPU))


@pytest.mark.parametrize("span", [None, 64], ids=["one-program", "split"])
def test_greedy_direct_writes_the_host_slot_of_each_rows_position(span, monkeypatch):
    """``greedy(direct=)`` (a decode step's pick read back without copies): each row's token and
    logit also in host slot pos[n] % 2 (row n's column), the other slot untouched, and pos[n]
    advanced by one; the device outputs as without it. Its inputs refused by name."""
    monkeypatch.setattr(S, "GREEDY_KEYS", True)
    logits = greedy_rows(300)
    want = torch.argmax(logits, dim=-1)
    chosen_want = torch.gather(logits, -1, want[:, None])[:, 0]
    pos = torch.tensor([4, 7, 0, 9, 2, 5])
    host_token = torch.full((2, 6), -5, dtype=torch.int64)
    host_chosen = torch.full((2, 6), 3.0, dtype=torch.bfloat16)
    token, chosen = torch.zeros(6, dtype=torch.int64), torch.zeros(6, dtype=torch.bfloat16)
    S.greedy(
        logits, token, chosen, S.greedy_scratch(6, CPU), span=span, direct=(pos, host_token, host_chosen)
    )
    assert torch.equal(token, want) and torch.equal(chosen.nan_to_num(), chosen_want.nan_to_num())
    odd = torch.tensor([4, 7, 0, 9, 2, 5]) % 2
    rows = torch.arange(6)
    assert torch.equal(host_token[odd, rows], want)
    assert torch.equal(host_chosen[odd, rows].nan_to_num(), chosen_want.nan_to_num())
    assert torch.equal(host_chosen[odd, rows].isnan(), chosen_want.isnan())
    assert (host_token[1 - odd, rows] == -5).all() and (host_chosen[1 - odd, rows] == 3.0).all()
    assert torch.equal(pos, torch.tensor([5, 8, 1, 10, 3, 6]))
    scratch = S.greedy_scratch(6, CPU)
    with pytest.raises(ValueError, match="pos must be int64"):
        S.greedy(logits, token, chosen, scratch, direct=(pos.int(), host_token, host_chosen))
    with pytest.raises(ValueError, match="host_token int64"):
        S.greedy(logits, token, chosen, scratch, direct=(pos, host_token[:1], host_chosen))


def test_the_greedy_probe_refuses_a_wrong_pick_by_row(monkeypatch):
    """The dense probe's greedy cases pass on the kernel and name the row a wrong pick is in."""
    from edgerun.kernels import dense_probe

    gen = torch.Generator().manual_seed(0)
    dense_probe.greedy_cases(300, CPU, torch.bfloat16, gen)
    real = S.greedy

    def off_in_row_2(logits, token, chosen, scratch, direct=None):
        real(logits, token, chosen, scratch)
        token[2] += 1

    monkeypatch.setattr(S, "greedy", off_in_row_2)
    with pytest.raises(dense_probe.Refused, match=r"row 2 of 300 logits picks"):
        dense_probe.greedy_cases(300, CPU, torch.bfloat16, gen)

    def no_host_writes(logits, token, chosen, scratch, direct=None):  # the picks right, the slots not
        real(logits, token, chosen, scratch)

    monkeypatch.setattr(S, "greedy", no_host_writes)
    with pytest.raises(dense_probe.Refused, match=r"greedy \(direct\): host slots hold \[-1, -1, -1, -1\]"):
        dense_probe.greedy_cases(300, CPU, torch.bfloat16, gen)
