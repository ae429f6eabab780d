"""Token sampling: greedy, temperature, top-k, top-p, with a seeded generator.

Where the logits are: on the CPU, ``probs`` (fp32) and a draw from the request's generator; on
a CUDA device, the draw is made there (kernels/sample_triton.py: the same distribution, the
draw keyed by the request's seed and the token's index in its sequence), so a step's logits
never travel to the host, and the decode step's graph can make the draw itself
(``DecodeGraphs.sample_with``): a sampled request is pipelined as a greedy one is. A seed repeats
a request's tokens on the same device (in a graph or not, alone or in a batch), not across
devices (their logits differ in the last bits anyway). A temperature below ``GREEDY_BELOW`` is
greedy (its limit): dividing logits by 1e-38 overflows to inf, and sampling from NaN fails.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from edgerun.engine.params import GREEDY_BELOW, NonFiniteLogits, SamplingError, SamplingParams

__all__ = ["GREEDY_BELOW", "NonFiniteLogits", "Sampler", "SamplingError", "SamplingParams"]


TOP_P_FIRST = 1024  # logits sorted first for a top-p request (8x more each time the nucleus is larger)
SEED_MASK = 2**63 - 1  # a device draw's seed: the request's, as a non-negative int64


class Sampler:
    """``position``: the index in its sequence of the next token this sampler draws (the
    prompt's length, for a request's first token), which keys a device draw with the seed."""

    def __init__(self, params: SamplingParams, position: int = 0) -> None:
        self.params = params
        self.generator = torch.Generator(device="cpu")
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()
        self.position = position
        self.seed = (
            params.seed
            if params.seed is not None
            else int(torch.randint(2**62, (), generator=self.generator))
        ) & SEED_MASK
        self.drawn = {"device": 0, "host": 0}  # sampled tokens by where they were drawn
        self._device = None  # a device draw's buffers, made on the first

    def __call__(self, logits: torch.Tensor) -> int:
        """logits: [V] for one position -> token id; refused (:class:`NonFiniteLogits`) when any
        is NaN or infinite."""
        if self.params.greedy:  # on the logits' device: a read of two ints, not of [V]
            token = next(self.greedy_rows(logits[None]))
        elif logits.is_cuda:
            token = self.device_draw(logits)
        else:
            token = self.draw(self.probs(logits))
        self.position += 1
        return token

    @property
    def sort(self) -> bool:
        """Whether a device draw sorts the logits first (the request filters: top-k or top-p)."""
        from edgerun.kernels.sample_triton import filtered

        return filtered(self.params.top_k, self.params.top_p)

    def row(self) -> tuple[float, float, int, int]:
        """This request's (temperature, top_p, top_k, seed), as a device draw takes them."""
        p = self.params
        return (p.temperature, p.top_p, p.top_k, self.seed)

    def device_draw(self, logits: torch.Tensor) -> int:
        """The token at :attr:`position` drawn on the logits' device (one read of two numbers)."""
        from edgerun.kernels import sample_triton as S

        V = logits.shape[-1]
        if self._device is None or self._device[0].vals.shape[1] != V:
            buffers = S.SampleBuffers(1, V, logits.device, logits.dtype)
            buffers.set([self.row()])
            out = torch.zeros(2, dtype=torch.int64, device=logits.device)  # counter, token
            self._device = (buffers, out, torch.zeros(1, dtype=logits.dtype, device=logits.device))
        buffers, out, chosen = self._device
        out[0].fill_(self.position)
        rows = logits.detach().reshape(1, V)
        S.sample(
            rows if rows.stride(1) == 1 else rows.contiguous(),
            buffers,
            out[:1],
            0,
            out[1:2],
            chosen,
            self.sort,
        )
        token, value = torch.cat([out[1:2].double(), chosen.double()]).tolist()
        self.drawn["device"] += 1
        if not math.isfinite(value):
            raise NonFiniteLogits(f"a sampled step's logits hold NaN or infinite values ({V} logits)")
        return int(token)

    def greedy_rows(self, logits: torch.Tensor) -> Iterator[int]:
        """Each row's greedy token of logits [N, V], in order: :meth:`__call__` of each row, with
        every row's argmax and count of NaN / infinite logits read in one transfer; a row with
        any is refused (:class:`NonFiniteLogits`) when the caller reaches it."""
        n = logits.shape[0]
        logits = logits.detach()
        both = torch.cat([torch.argmax(logits, dim=-1), (~torch.isfinite(logits)).sum(-1)]).tolist()
        for j in range(n):
            if both[n + j]:
                raise NonFiniteLogits(f"{both[n + j]} of {logits.shape[1]} logits are NaN or infinite")
            yield both[j]

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution a non-greedy request samples from: logits [V] -> probabilities [V]
        (fp32, CPU) after temperature, top-k and top-p; refused when any logit is NaN or infinite."""
        p = self.params
        logits = logits.detach().float().cpu()
        if not bool(torch.isfinite(logits).all()):
            raise NonFiniteLogits(
                f"{int((~torch.isfinite(logits)).sum())} of {logits.numel()} logits are NaN or infinite"
            )
        logits = logits / p.temperature
        V = logits.numel()
        cand = None  # the top-k set: every logit >= the k-th largest (ties at it stay)
        if p.top_k and p.top_k < V:
            cand = (logits >= torch.topk(logits, p.top_k).values[-1]).nonzero().squeeze(1)
        if p.top_p < 1.0:
            cand = self._nucleus(logits, cand)
        if cand is not None:
            keep = torch.full_like(logits, float("-inf"))
            keep[cand] = logits[cand]
            logits = keep
        return torch.softmax(logits, dim=-1)

    def probs_reference(self, logits: torch.Tensor) -> torch.Tensor:
        """:meth:`probs` by the definition, the whole vector sorted (what :meth:`probs` is tested
        against, and what it computed until it sorted only the head)."""
        p = self.params
        logits = logits.detach().float().cpu() / p.temperature
        if p.top_k and p.top_k < logits.numel():
            logits = logits.masked_fill(logits < torch.topk(logits, p.top_k).values[-1], float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True, stable=True)
            probs = torch.softmax(sorted_logits, dim=-1)
            drop = (probs.cumsum(-1) - probs) >= p.top_p
            drop[0] = False
            logits = logits.index_put((order[drop],), torch.tensor(float("-inf")))
        return torch.softmax(logits, dim=-1)

    def _nucleus(self, logits: torch.Tensor, cand: torch.Tensor | None) -> torch.Tensor:
        """The ids top-p keeps of ``cand`` (the top-k set; None: every id): the head of them
        sorted descending (stable: ties in id order), dropping each whose mass before it (over
        ``cand``) already reaches top_p, the first always kept. Without a top-k set only the
        largest m are sorted (every logit >= the m-th, so no tie group is split), m growing
        until the cut falls among them: the mass before each is over every logit either way."""
        top_p = self.params.top_p
        pool = logits if cand is None else logits[cand]
        total = torch.logsumexp(pool, dim=-1)
        m = min(pool.numel(), TOP_P_FIRST)
        while True:
            head = (pool >= torch.topk(pool, m).values[-1]).nonzero().squeeze(1) if m < pool.numel() else None
            vals, order = torch.sort(pool if head is None else pool[head], descending=True, stable=True)
            probs = torch.exp(vals - total)
            drop = (probs.cumsum(-1) - probs) >= top_p
            drop[0] = False  # a top_p that underflows fp32 (1e-320) would drop it too
            if head is None or bool(drop.any()):
                break
            m = min(pool.numel(), m * 8)
        kept = order[~drop] if head is None else head[order[~drop]]
        return kept if cand is None else cand[kept]

    def draw(self, probs: torch.Tensor) -> int:
        """One token from ``probs`` [V] (non-negative, not all zero) with the request's generator:
        the first whose running sum (fp64) passes u times the total (inverse CDF), a token of
        zero probability never (torch.multinomial took 3-5 ms at 248,320 probabilities)."""
        self.drawn["host"] += 1
        cum = probs.double().cumsum(0)
        target = float(torch.rand((), generator=self.generator, dtype=torch.float64)) * float(cum[-1])
        i = int(torch.searchsorted(cum, torch.tensor([target], dtype=torch.float64), right=True)[0])
        if i >= probs.numel():  # u * total rounding to the total: the last token with mass
            i = int(probs.nonzero()[-1, 0])
        return i

    def uniform(self) -> float:
        """A number in [0, 1) from the request's generator (a speculative acceptance test)."""
        return float(torch.rand((), generator=self.generator))
