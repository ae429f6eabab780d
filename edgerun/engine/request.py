"""A request's limits, checked once: the one function every entry (the CLI, the daemon's HTTP
routes, the runner's own helpers) calls before a request reaches the engine. Pure Python: the
daemon checks on its event loop, before the engine (and torch) sees anything."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from edgerun.errors import EdgerunError


class RequestError(EdgerunError, ValueError):
    """A request the engine refuses; ``param`` names the field as the caller spelled it."""

    def __init__(self, message: str, param: str, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_context: int


@dataclass(frozen=True)
class Request:
    """A checked request: build it with :func:`check_request`."""

    prompt_ids: tuple[int, ...]
    params: Any  # SamplingParams (torch-free here; the sampler imports torch)


def check_request(
    prompt_ids: list[int],
    params,
    limits: Limits,
    prompt_field: str = "prompt",
    max_tokens_field: str = "max_tokens",
) -> Request:
    """Refuse an empty prompt, a token id outside the vocabulary, and a prompt + max_tokens over
    the context, naming the field (``prompt_field``, ``max_tokens_field``: as the caller's
    interface spells them)."""
    if not prompt_ids:
        raise RequestError(f"'{prompt_field}' is empty: give at least one token", prompt_field)
    bad = next((t for t in prompt_ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise RequestError(
            f"'{prompt_field}' token id {bad} is outside the vocabulary (0..{limits.vocab_size - 1})",
            prompt_field,
        )
    n, context = len(prompt_ids), limits.max_context
    if n >= context:
        raise RequestError(
            f"the prompt ('{prompt_field}') is {n} tokens; the context is {context} tokens, "
            "and at least one must be left to generate",
            prompt_field,
            "context_length_exceeded",
        )
    if params.max_tokens < 1:
        raise RequestError(
            f"'{max_tokens_field}' must be at least 1, got {params.max_tokens}", max_tokens_field
        )
    if n + params.max_tokens > context:
        raise RequestError(
            f"'{max_tokens_field}' ({params.max_tokens}) + the prompt ({n} tokens) exceeds the context of "
            f"{context} tokens; at most {context - n}",
            max_tokens_field,
            "context_length_exceeded",
        )
    return Request(tuple(prompt_ids), params)
