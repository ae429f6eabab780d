"""Token sampling: greedy, temperature, top-k, top-p, with a seeded generator.

Sampling runs on the CPU in fp32 from the last position's logits, so a seed gives the same
tokens whatever device computed the logits. A temperature below ``GREEDY_BELOW`` is greedy (its
limit): dividing logits by 1e-38 overflows to inf, and sampling from NaN fails.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from edgerun.errors import EdgerunError

GREEDY_BELOW = 1e-5  # as vLLM


class SamplingError(EdgerunError, ValueError):
    pass


class NonFiniteLogits(EdgerunError, RuntimeError):
    """The model produced NaN or infinite logits: no token is chosen from them."""

    def __init__(self, what: str) -> None:
        super().__init__(f"{what}: the request is stopped, no token emitted")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0  # 0 (below GREEDY_BELOW): greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            raise SamplingError(f"max_tokens must be a non-negative integer, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise SamplingError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise SamplingError(f"top_k must be a non-negative integer, got {self.top_k!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise SamplingError("stop must be a list of non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_k == 1


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
        p = self.params
        logits = logits.detach()
        if p.greedy:  # on the logits' device: two small kernels and one read of two ints, not of [V]
            token, bad = torch.stack([torch.argmax(logits), (~torch.isfinite(logits)).sum()]).tolist()
            if bad:
                raise NonFiniteLogits(f"{bad} of {logits.numel()} logits are NaN or infinite")
            return token
        return self.draw(self.probs(logits))

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
            logits = logits.index_put((order[drop],), torch.tensor(float("-inf")))
        return torch.softmax(logits, dim=-1)

    def draw(self, probs: torch.Tensor) -> int:
        """One token from ``probs`` [V] with the request's generator."""
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def uniform(self) -> float:
        """A number in [0, 1) from the request's generator (a speculative acceptance test)."""
        return float(torch.rand((), generator=self.generator))
