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
  launch between them), which loads them bypassing L1 (``.cg``); so do, in the attention decode
  launches (``decode_triton``'s EARLY), a row's position and cache slot (the host or the step's
  first kernels wrote them, or the last step's greedy launch, which advances a sequence's
  position: the step's first launch, torch's embedding gather, starts once it has ended), the
  keys and values older than the position (earlier steps; the one at the position, which the
  attend launch itself writes, is not read early) and, in the combine launch, the output gate's
  qkv columns (the projection before the attend launch wrote them);
  so does a program's own part of a state that only its layer's launch of this kind writes, as
  that program's previous step left it (the DeltaNet recurrent state in the delta rule, the conv
  state in the in_proj epilogue; a rollback restores them with torch's copies, which serialise);
- or what its predecessor flags as written: a program of the predecessor stores, then sets a
  flag with release semantics, and the kernel's programs wait for the flag (``_wait_set``)
  before they read (bypassing L1). The expert down kernel reads the ids its routing gate_up
  launch wrote this way (``moe_triton``'s READY). The wait ends: this kernel starts only once
  every program of the predecessor has passed its own wait, the flagging one among them.
A short kernel may let its successor launch before its own wait (``_grid_sync``'s LAUNCH_FIRST), so
that the successor's programs are resident and reading their weights while the kernel before the
short one still runs: the successor's wait still waits for the short kernel to complete, and so
for everything before it, but its pre-wait reads must then be weights and scales alone (the
kernel two back may still be writing). The DeltaNet gated norm launch (before out_proj) does this
(``dense_triton.NORM_LAUNCH_FIRST``, on: +1.2% at 40 layers on an H100), and the attention combine
launch (before o_proj) may (``decode_triton.COMBINE_LAUNCH_FIRST``, off: -1.4%): their successors
are GEMVs, which read only weights before their waits. The delta rule's launch doing it too (the
norm and out_proj resident beside it) lost 3.2% and was removed (docs/benchmarks.md, 2026-12-07,
forty-second session: the in_proj and out_proj launches each took ~0.4 µs longer; the norm's programs
then launch while in_proj, a GEMV of several waves, still runs).
So the arithmetic is the same with and without PDL: the bits do not change, only the overlap.
Kernels launched without it (torch's own, the prefill path) serialise as usual.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# The small weights a launch would read after its wait (the DeltaNet gated norm's weights, a
# head's A_log and dt_bias, the conv's taps and older inputs in the in_proj epilogue, the slot
# table the experts' gate_up looks its picks up in) are read before it, as its first weights are:
# they are weights (the conv state: the layer's own, of its previous step), so the contract above
# holds, and the bits do not change. +0.7-0.9% at 40 layers on an H100 (docs/benchmarks.md,
# 2026-12-07, forty-third session; the in_proj launch 0.3 µs shorter). An A/B switch
# (benchmarks/ab_decode.py), read at each call; EDGERUN_EARLY_PARAMS=0 clears it at import.
EARLY_PARAMS = os.environ.get("EDGERUN_EARLY_PARAMS", "1") != "0"
# The same for the norm weights of a normed projection's first step (qgemv's NORM prologue: the
# router launch's programs, one step each, read nothing else after their wait but x) and, in the
# attend launch, the q and k norms' weights and the rotary tables at the row's position (EARLY
# reads only): +2.1% at 40 layers on an H100, the same tokens (docs/benchmarks.md, 2026-12-07,
# forty-fourth session; the attend launch 0.6 µs shorter). An A/B switch read at each call;
# EDGERUN_EARLY_NORMS=0 clears it at import.
EARLY_NORMS = os.environ.get("EDGERUN_EARLY_NORMS", "1") != "0"

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
def _grid_sync(PDL: tl.constexpr, LAUNCH_FIRST: tl.constexpr = False):
    """Wait until the previous kernel has completed, then let the next one launch (PDL only).
    LAUNCH_FIRST: let the next one launch first, then wait (the contract's last case)."""
    if PDL:
        if LAUNCH_FIRST:
            gdc_launch_dependents()
            gdc_wait()
        else:
            gdc_wait()
            gdc_launch_dependents()


@triton.jit
def _load_acquire_t0(c, other):
    """The int32 at ``c`` loaded by thread 0 of the program with acquire semantics at GPU scope,
    ``other`` in every other thread. A program polls this way: the other threads leave the loop
    at once and wait at a CTA barrier after it, which orders their later loads after thread 0's
    acquire (one poller a program: every thread polling one line made a grid barrier 2.5x
    dearer in ``benchmarks/launch_floor.py``'s persistent variants)."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; mov.u32 $0, $2; "
        "@p ld.global.acquire.gpu.b32 $0, [$1]; }",
        "=r,l,r",
        [c, other],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _wait_set(c, INTERPRET: tl.constexpr):
    """Returns once the int32 flag at ``c`` is non-zero (thread 0 polling, ``_load_acquire_t0``),
    every thread's later loads ordered after it. Under the interpreter a launch's programs run
    after the launch before it has ended: the flag is set already."""
    if not INTERPRET:
        v = _load_acquire_t0(c, 1)
        while v == 0:
            v = _load_acquire_t0(c, 1)
    tl.debug_barrier()
