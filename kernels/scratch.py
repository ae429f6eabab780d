"""Which set of a kernel's mutable scratch (arrival counters) the calls in a context use.

Two kernels keep state between calls: the expert GEMV's arrival counters
(``moe_triton._counters``) and the tensor-core GEMV's (``QLinear.planes_count``). Each call leaves
its counters at 0, so calls in one stream share a set; calls that may run at the same time on
different streams (the prompts of a batch prefilled in lanes, ``engine/graphs.PrefillLanes``)
must not. Lane 0 is the main stream's set; a context that runs on lane k's stream (and every
graph captured within it, whose pointers are fixed at capture) uses set k. No Triton import:
the model's modules read it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

SCRATCH_SET: ContextVar[int] = ContextVar("edgerun_scratch_set", default=0)


@contextmanager
def scratch_set(k: int) -> Iterator[None]:
    """Within the block, kernels with counters use their set ``k``."""
    token = SCRATCH_SET.set(k)
    try:
        yield
    finally:
        SCRATCH_SET.reset(token)
