"""Which set of a kernel's mutable scratch (arrival counters) the calls in a context use.

Kernels keep state between calls: arrival counters (``counters``: the expert GEMV's down
kernel) and the tensor-core GEMV's (``QLinear.planes_count``). Each call leaves
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

import torch

SCRATCH_SET: ContextVar[int] = ContextVar("edgerun_scratch_set", default=0)


@contextmanager
def scratch_set(k: int) -> Iterator[None]:
    """Within the block, kernels with counters use their set ``k``."""
    token = SCRATCH_SET.set(k)
    try:
        yield
    finally:
        SCRATCH_SET.reset(token)


_COUNTERS: dict[tuple[torch.device, int], torch.Tensor] = {}
# smaller sets a larger one replaced: graphs captured on them still read them
_RETIRED: list[torch.Tensor] = []
COUNTERS = 1 << 15  # counters first allocated: 256 tokens of a 2048-wide model at 16 rows a tile (or more)


def counters(device: torch.device, n: int) -> torch.Tensor:
    """Arrival counters on ``device`` for a kernel whose last program to arrive finishes the
    work (``moe_triton``'s down kernel), or whose programs wait for a flag another launch sets
    and take it down (the down kernel's READY): int32, at least ``n``,
    all 0 between calls (each call's last arrivals reset theirs, before the call completes, so
    calls in one stream share them). Kept for the process, one set a device and scratch set
    (calls that may overlap on different streams, prompts prefilled in lanes, use sets of their
    own). Allocated (zeroed) at a set's first call, or when a call needs more, which must not be
    during graph capture: a captured fill would not have run before the next eager call (the
    engine's warm-up steps run first). A set that a larger one replaces is kept, never freed: a
    CUDA graph captured on it (a decode step) reads it at every replay."""
    key = (device, SCRATCH_SET.get())
    c = _COUNTERS.get(key)
    if c is None or c.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            have = 0 if c is None else c.numel()
            raise RuntimeError(
                f"a kernel needs {n} arrival counters on {device} and has {have}: call it once "
                "outside graph capture first (a warm-up of as many tokens)"
            )
        if c is not None:
            _RETIRED.append(c)
        c = _COUNTERS[key] = torch.zeros(max(n, COUNTERS), dtype=torch.int32, device=device)
    return c
