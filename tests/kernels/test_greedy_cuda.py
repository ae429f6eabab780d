"""The decode step's greedy pick on the GPU (``sample_triton.greedy``: the argmax and its logit
in one launch): equal to ``torch.argmax`` then ``torch.gather``, at the demo's and Qwen's
vocabularies, where a row is split among programs that meet through atomics in one key a row
(the ordering the interpreter cannot show: its programs run one after another), called again
and again and replayed from a CUDA graph. The edge cases (ties, NaN, +inf, -inf, signed zeros)
are checked under the interpreter too (tests/kernels/interpreted_sample.py). Skipped without
CUDA (CI has none)."""

import pytest
import torch
from interpreted_sample import greedy_rows

from edgerun.kernels import sample_triton as S

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (none on this machine)")


def _want(logits):
    token = torch.argmax(logits, dim=-1)
    return token, torch.gather(logits, -1, token[:, None])[:, 0]


def _same(token, chosen, want):
    return torch.equal(token, want[0]) and torch.equal(chosen.nan_to_num(), want[1].nan_to_num())


@pytest.mark.parametrize("vocab", [4096, 151_936, 248_320])
def test_greedy_is_torchs_pick_again_and_again_and_from_a_graph(vocab):
    dev = torch.device("cuda")
    edge = greedy_rows(vocab).to(dev)
    g = torch.Generator(device=dev).manual_seed(vocab)
    scratch = S.greedy_scratch(8, dev)
    token = torch.zeros(8, dtype=torch.int64, device=dev)
    chosen = torch.zeros(8, dtype=torch.bfloat16, device=dev)
    for trial in range(50):  # random rows, most with a tie for the largest somewhere
        logits = (torch.randn(8, vocab, generator=g, device=dev) * 2).to(torch.bfloat16)
        S.greedy(logits, token, chosen, scratch)
        assert _same(token, chosen, _want(logits)), trial
    S.greedy(edge, token[:6], chosen[:6], scratch)
    assert _same(token[:6], chosen[:6], _want(edge))
    static = torch.zeros(4, vocab, dtype=torch.bfloat16, device=dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        S.greedy(static, token[:4], chosen[:4], scratch)
    for trial in range(20):
        static.copy_((torch.randn(4, vocab, generator=g, device=dev) * 2).to(torch.bfloat16))
        graph.replay()
        assert _same(token[:4], chosen[:4], _want(static)), trial
    torch.cuda.synchronize()
    assert torch.equal(scratch, S.greedy_scratch(8, dev))
