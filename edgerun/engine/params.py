"""What a request asks of sampling (``SamplingParams``), checked on construction, with no torch
import: the daemon's process checks requests without loading torch (the engine's process samples,
``engine/sampler.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field

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
