"""Programmatic dependent launch (PDL) for the decode kernels, on sm_90+ GPUs.

A decode step is a chain of ~10 small kernels a layer, each a few microseconds, so the launch
of a kernel and the first DRAM latency of its loads are a large share of it. With PDL a kernel
may start while its predecessor finishes: its programs read what never changes during a step
(the weights) at once, then ``_grid_sync`` waits for the predecessor to complete (its writes
visible) before anything else, and lets the successor launch.

The contract that keeps it exact, for every kernel launched with ``pdl_kwargs``:
- it calls ``_grid_sync`` in every program, before reading any activation and before any store;
- before that call it reads only tensors that neither it nor its predecessor writes and that, if
  anything in the step writes them, were written two or more launches back: its launch waited
  for every program of the predecessor to pass *its* wait, so the kernel before that had
  completed. Weights and scales qualify everywhere; a MoE layer's expert ids, slots and slot
  table qualify in the expert down kernel (the router or the cache wrote them before the gate_up
  launch between them), which loads them bypassing L1 (``.cg``).
So the arithmetic is the same with and without PDL: the bits do not change, only the overlap.
Kernels launched without it (torch's own, the prefill path) serialise as usual.
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


def describe(device: torch.device) -> str:
    if pdl_supported(device):
        return "programmatic dependent launch (weights read while the previous kernel finishes)"
    return "plain launches (PDL needs CUDA sm_90+)"


@triton.jit
def _grid_sync(PDL: tl.constexpr):
    """Wait until the previous kernel has completed, then let the next one launch (PDL only)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
