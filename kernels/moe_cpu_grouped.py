"""Routed experts on the CPU in one C call per layer (kernels/moe_cpu_grouped.c): every token's
experts, gate_up, SiLU·up, down and the router-weighted sum, computed straight from the slot
pool's bundle bytes (no repacked copy) in one OpenMP parallel region. Each expert runs over all of
its tokens of the call together (its weight rows read once, decoded once per tile of 4 tokens), so a
prompt costs about what torch's GEMMs do, and a decode step its GEMVs.

Shape legend: T = tokens, A = active experts per token, S = slots, D = hidden, I = expert width.

Numerics: the weights decoded exactly (int4: q x e4m3 code x power-of-two global; int8: q, the
fp32 row scale applied to the row's sum). int4 rows take their activations quantized to 16 bits
per group of 32 (two int8 halves, exact integer group sums: AVX-512 VNNI where the CPU has it):
3-6e-5 of the output's scale against the fp32 reference (tested; torch's bf16-activation kernels,
kernels/moe_cpu.py: ~4e-3; 8-bit activations as llama.cpp's: 1.2-1.6e-2). int8 rows take fp32
activations: ~5e-7. A token's experts are summed in ascending
expert id, in fp32, as ``combine_experts`` does; each output element is
computed by one thread in a fixed order, so the bits do not depend on the thread count, the run,
or the other tokens of a batch (tested).

The source is compiled at first use with the system C compiler (``-O3 -march=native -fopenmp``)
into a cache directory (``$XDG_CACHE_HOME/edgerun/kernels``, else ``~/.cache/...``) keyed by the
source, flags, compiler version and the CPU (architecture and feature flags), and linked against the
libgomp torch's wheel bundles where it has one (one OpenMP runtime in the process, so torch's
threads and these do not oversubscribe). No compiler or a failed build raises ``BuildError``; the
probe (kernels/probe.py) turns that into a refusal with the reason, and the engine keeps torch's
CPU kernels, shown in the start-up line and counted as a fallback.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from edgerun.bundle.layout import BlockLayout
from edgerun.bundle.quant import PROJECTIONS, e4m3_value
from edgerun.kernels.cbuild import BuildError, build, cache_dir, compiler, machine  # noqa: F401 - re-exported
from edgerun.kernels.cpu_layout import unsupported_format
from edgerun.kernels.moe_reference import FarTier, check_pool, layout_dims

SOURCE = Path(__file__).with_name("moe_cpu_grouped.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=fast", "-fPIC", "-shared", "-std=gnu99")


def kernel_name(layout: BlockLayout) -> str:
    fmt = layout.quant + (f" g{layout.group_size}" if layout.group_size else "")
    return f"cpu_grouped[{fmt}]"


def unsupported(layout: BlockLayout) -> str | None:
    """Why the grouped kernel cannot run ``layout``'s experts, or None."""
    why = unsupported_format(layout, "the grouped CPU kernel takes")
    if why:
        return why
    if layout.quant == "int4" and layout.group_size != 32:
        return f"the grouped CPU kernel takes int4 groups of 32, this bundle's are {layout.group_size}"
    D, I = layout_dims(layout)
    if D % 32 or I % 32:
        return (
            f"the grouped CPU kernel takes hidden and expert widths in multiples of 32, these are {D} and {I}"
        )
    return None


def openmp_runtime() -> Path | None:
    """The libgomp torch's wheel bundles (linked, so the process has one OpenMP runtime), if any."""
    lib = Path(torch.__file__).parent / "lib"
    found = sorted(lib.glob("libgomp*.so*"))
    return found[0] if found else None


@functools.cache
def library(portable: bool = False) -> ctypes.CDLL:
    """The built kernel, compiled on first use into ``cache_dir()``; ``BuildError`` says why not.
    ``portable``: without the AVX-512 VNNI path, as on a CPU without it (the tests run both)."""
    flags = list(FLAGS) + (["-DEDGERUN_PORTABLE"] if portable else [])
    gomp = openmp_runtime()
    link = ([str(gomp), f"-Wl,-rpath,{gomp.parent}"] if gomp else []) + ["-lm"]
    lib = build(SOURCE, compiler(), flags, link, key=machine(), what="the grouped CPU kernel")
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.edgerun_moe_grouped.argtypes = [
        p,
        p,
        p,
        i64,
        i64,
        p,
        p,
        p,
        p,
        p,
        i64,
        i64,
        i64,
        i64,
        i64,
        ctypes.c_int,
        p,
        p,
        p,
        ctypes.c_int,
    ]
    lib.edgerun_moe_grouped.restype = ctypes.c_int
    lib.edgerun_moe_grouped_scratch.argtypes = [i64, i64, i64]
    lib.edgerun_moe_grouped_scratch.restype = i64
    return lib


@functools.cache
def _offsets(layout: BlockLayout) -> torch.Tensor:
    """Byte offsets in a block: gate_up weight, gate_up scales, down weight, down scales."""
    return torch.tensor(
        [layout.component(f"{p}.{k}").offset for p in PROJECTIONS for k in ("weight", "scales")]
    )


@functools.cache
def _e4m3_table() -> torch.Tensor:
    return e4m3_value(torch.arange(256, dtype=torch.uint8)).contiguous()


def _check(
    name: str, t: torch.Tensor, dtype: torch.dtype | None, shape: tuple[int, ...], dense=False
) -> None:
    """Refuse ``t`` unless a CPU tensor of ``shape`` (and ``dtype``; ``dense``: contiguous)."""
    bad = (dtype is not None and t.dtype != dtype) or tuple(t.shape) != shape or t.device.type != "cpu"
    if bad or (dense and not t.is_contiguous()):
        raise ValueError(
            f"{name} must be a{' contiguous' if dense else ''} CPU {dtype or ''} tensor of shape "
            f"{list(shape)}, got {t.dtype} {list(t.shape)}"
            f"{' (not contiguous)' if not t.is_contiguous() else ''} on {t.device}"
        )


def moe_grouped(
    x: torch.Tensor,
    pool: torch.Tensor,
    slot_idx: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    layout: BlockLayout,
    global_scales: torch.Tensor | None,
    out_dtype: torch.dtype | None = None,
    acc: torch.Tensor | None = None,
    expert_range: tuple[int, int] | None = None,
    threads: int | None = None,
    portable: bool = False,
    far: FarTier | None = None,
) -> torch.Tensor:
    """``moe_experts_ref``'s contract in one C call: x [T, D], pool uint8 [S, block_bytes],
    slot_idx / expert_ids int64 [T, A], weights [T, A], global_scales fp32 [S, 2] (int4). With
    ``expert_range`` only those experts run, added into ``acc`` (fp32 [T, D], returned); else the
    fp32 sum cast to ``out_dtype`` (default x's). ``threads``: default torch.get_num_threads().
    ``far``: slots from the pool's rows on are its rows (host memory; global scales then cover
    both), as ``moe_experts_ref``'s."""
    why = unsupported(layout)
    if why:
        raise ValueError(why)
    S = check_pool(pool, layout, global_scales, None if far is None else far.rows)
    _check("slot pool", pool, torch.uint8, tuple(pool.shape), dense=True)
    if far is not None:
        _check("far rows", far.rows, torch.uint8, tuple(far.rows.shape), dense=True)
    T, A = expert_ids.shape if expert_ids.dim() == 2 else (-1, -1)
    D, I = layout_dims(layout)
    _check("x", x, None, (T, D))
    _check("expert_ids", expert_ids, torch.int64, (T, A))
    _check("slot_idx", slot_idx, torch.int64, (T, A))
    _check("weights", weights, None, (T, A))
    lo, hi = slot_idx.aminmax() if T and A else (0, 0)
    if lo < 0 or hi >= S:  # the kernel reads whatever a slot index points at
        raise ValueError(f"slot_idx holds slots outside the pool's 0..{S - 1}: {slot_idx.tolist()}")
    # each token's entries in ascending expert id, those in expert_range first (count[t] of them)
    key = expert_ids
    inside = torch.ones_like(expert_ids, dtype=torch.bool)
    if expert_range is not None:
        inside = (expert_ids >= expert_range[0]) & (expert_ids <= expert_range[1])
        key = torch.where(inside, expert_ids, expert_ids + (1 << 40))
    order = key.argsort(dim=1, stable=True)
    ids = expert_ids.gather(1, order)
    if A > 1 and bool((ids[:, 1:] == ids[:, :-1]).any()):
        raise ValueError(f"a token routed to the same expert twice: {expert_ids.tolist()}")
    slots = slot_idx.gather(1, order).contiguous()
    w = weights.float().gather(1, order).contiguous()
    count = inside.sum(dim=1).contiguous()
    if acc is not None:
        _check("acc", acc, torch.float32, (T, D), dense=True)
        out = acc
    else:
        out = torch.zeros(T, D, dtype=torch.float32)
    xf = x.float().contiguous()
    if layout.quant == "int4":  # read by pointer, as the pool is: on the CPU (check_pool checked the rest)
        _check("global_scales", global_scales, torch.float32, (S, 2))
    gs = global_scales.contiguous() if layout.quant == "int4" else torch.zeros(1)
    offs = _offsets(layout)
    lib = library(portable)
    scratch = torch.empty(T * lib.edgerun_moe_grouped_scratch(A, D, I), dtype=torch.uint8)
    lut = _e4m3_table()
    nthreads = torch.get_num_threads() if threads is None else threads
    failed = lib.edgerun_moe_grouped(
        xf.data_ptr(), pool.data_ptr(), 0 if far is None else far.rows.data_ptr(), pool.shape[0],
        layout.block_bytes, slots.data_ptr(), w.data_ptr(), count.data_ptr(),
        gs.data_ptr(), lut.data_ptr(), T, A, D, I, S, 4 if layout.quant == "int4" else 8, offs.data_ptr(),
        out.data_ptr(), scratch.data_ptr(), max(1, nthreads),
    )  # fmt: skip
    if failed:
        raise MemoryError(f"the grouped CPU kernel could not allocate its grouping of {T} x {A} entries")
    if acc is not None:
        return acc
    return out.to(out_dtype or x.dtype)
