"""Token sampling: greedy, temperature, top-k, top-p, with a seeded generator.

Sampling runs on the CPU in fp32 from the last position's logits, so a seed gives the same
tokens whatever device computed the logits. A temperature below ``GREEDY_BELOW`` is greedy (its
limit): dividing logits by 1e-38 overflows to inf, and sampling from NaN fails.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from edgerun.engine.params import GREEDY_BELOW, NonFiniteLogits, SamplingError, SamplingParams

__all__ = ["GREEDY_BELOW", "NonFiniteLogits", "Sampler", "SamplingError", "SamplingParams"]


class Sampler:
    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.generator = torch.Generator(device="cpu")
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        """logits: [V] for one position -> token id; refused (:class:`NonFiniteLogits`) when any
        is NaN or infinite."""
        if self.params.greedy:  # on the logits' device: a read of two ints, not of [V]
            return next(self.greedy_rows(logits[None]))
        return self.draw(self.probs(logits))

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
        if p.top_k and p.top_k < logits.numel():
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True, stable=True)
            probs = torch.softmax(sorted_logits, dim=-1)
            # drop a token when the mass before it already reaches top_p (the first always stays)
            drop = (probs.cumsum(-1) - probs) >= p.top_p
            drop[0] = False  # a top_p that underflows fp32 (1e-320) would drop it too
            logits = logits.index_put((order[drop],), torch.tensor(float("-inf")))
        return torch.softmax(logits, dim=-1)

    def draw(self, probs: torch.Tensor) -> int:
        """One token from ``probs`` [V] with the request's generator."""
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def uniform(self) -> float:
        """A number in [0, 1) from the request's generator (a speculative acceptance test)."""
        return float(torch.rand((), generator=self.generator))
