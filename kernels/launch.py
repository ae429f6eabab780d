"""Programmatic dependent launch (PDL) for the decode kernels, on sm_90+ GPUs.

A decode step is a chain of ~10 small kernels a layer, each a few microseconds, so the launch
of a kernel and the first DRAM latency of its loads are a large share of it. With PDL a kernel
may start while its predecessor finishes: its programs read what never changes during a step
(the weights) at once, then ``_grid_sync`` waits for the predecessor to complete (its writes
visible) before anything else, and lets the successor launch.

The contract that keeps it exact, for every kernel launched with ``pdl_kwargs``:
- it calls ``_grid_sync`` in every program, before reading any activation and before any store;
- before that call it reads only tensors that no kernel of the last two launches writes (weights,
  scales): its launch waited for every program of the predecessor to pass *its* wait, so the
  kernel before that had completed.
So the arithmetic is the same with and without PDL: the bits do not change, only the overlap.
Kernels launched without it (torch's own, the prefill path) serialise as usual.

L2 prefetch (with PDL, unless ``EDGERUN_L2_PREFETCH=0``): before its wait, a program of the
projection GEMV asks the L2 for every weight byte it will read (``_prefetch_l2``: one bulk
prefetch, served by the copy engine while the program waits), and an expert program for its
expert's rows; so the weights of kernel k + 1 stream from memory while kernel k computes,
instead of after it, and a step's ~10 small kernels a layer keep the memory busy between them.
A prefetch is a hint: nothing computed reads what it fetched any differently, so the bits do
not depend on it either. Its address may come from ids a kernel still writes (an expert's, read
before the wait): it is clamped into the pool, and a stale one only fetches the wrong bytes.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

_cache: dict[int, bool] = {}


def pdl_supported(device: torch.device) -> bool:
    """True on a CUDA device of compute capability 9.0 or more, outside the Triton interpreter,
    unless ``EDGERUN_PDL=0`` (a measurement switch: the bits do not depend on it). Decided once
    per device: every launch of the decode step asks."""
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _cache:
        off = os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("EDGERUN_PDL") == "0"
        _cache[index] = not off and torch.cuda.get_device_capability(index) >= (9, 0)
    return _cache[index]


def pdl_kwargs(device: torch.device) -> dict:
    """Launch arguments for a kernel that takes ``PDL: tl.constexpr`` and calls ``_grid_sync``."""
    return {"PDL": True, "launch_pdl": True} if pdl_supported(device) else {"PDL": False}


def prefetch_supported(device: torch.device) -> bool:
    """True where PDL runs (a prefetch before the wait overlaps the previous kernel; without it
    the program's own loads follow at once), unless ``EDGERUN_L2_PREFETCH=0`` (a measurement
    switch: the bits do not depend on it)."""
    return pdl_supported(device) and os.environ.get("EDGERUN_L2_PREFETCH") != "0"


def prefetch_kwargs(device: torch.device) -> dict:
    """Launch arguments for a kernel that takes ``PREFETCH: tl.constexpr``."""
    return {"PREFETCH": prefetch_supported(device)}


def describe(device: torch.device) -> str:
    if pdl_supported(device):
        l2 = (
            ", each kernel's weights prefetched into L2 before its wait" if prefetch_supported(device) else ""
        )
        return f"programmatic dependent launch (weights read while the previous kernel finishes{l2})"
    return "plain launches (PDL needs CUDA sm_90+)"


@triton.jit
def _grid_sync(PDL: tl.constexpr):
    """Wait until the previous kernel has completed, then let the next one launch (PDL only)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def _prefetch_l2(ptr, nbytes):
    """Asks the L2 for ``nbytes`` from ``ptr`` (both widened to whole 16-byte units, as the
    instruction needs: a tensor's allocation is 512-byte aligned, so they stay inside it): one
    ``cp.async.bulk.prefetch.L2`` (sm_90) from thread 0 of the program. Nothing waits for it."""
    lo = ptr.to(tl.int64, bitcast=True)
    start = lo // 16 * 16
    size = ((lo + nbytes + 15) // 16 * 16 - start).to(tl.int32)
    if nbytes > 0:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
            "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r",
            [start, size],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
