"""The routed-expert math, and its pure-torch reference over a slot pool, and random valid pools.

Shape legend: T = tokens, A = active experts per token, S = slots, D = hidden, I = expert width.

``expert_ffn`` and ``combine_experts`` are the expert math the model's layers run on resident
weights. ``moe_experts_ref`` is ``combine_experts`` over experts dequantized
from their slots with ``dequantize_block``: a token's experts are summed in ascending *expert
id* order (``expert_ids``), not in slot or router order, so the result equals the resident
model's bit for bit and does not depend on the order of the A entries. Every kernel in this
package is compared against it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from edgerun.bundle.layout import BlockLayout
from edgerun.bundle.quant import dequantize_block

# BLAS picks a different kernel for a row-count remainder, so a token's result could depend on
# how many other tokens share its expert. Padded to a multiple of ROW_TILE rows, a row's result is
# the same in any batch (tests/kernels/test_moe_reference.py), so a token's expert output does
# not depend on which other tokens run with it.
ROW_TILE = 4


def expert_ffn(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """One expert: x [N, D], gate_up [2I, D], down [D, I] -> [N, D]."""
    n = x.shape[0]
    if n % ROW_TILE:
        x = F.pad(x, (0, 0, 0, ROW_TILE - n % ROW_TILE))
    gate, up = F.linear(x, gate_up.to(x.dtype)).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down.to(x.dtype))[:n]


def combine_experts(x, ids, weights, expert_weights, out=None, experts=None, ffn=expert_ffn) -> torch.Tensor:
    """Router-weighted sum of each token's experts. x [N, D]; ids, weights [N, A];
    ``expert_weights(e)`` gives expert e's weights, which ``ffn(x, *weights)`` runs. Experts run in ascending id order,
    each over all its tokens, so the summation order is fixed (deterministic).

    ``experts`` (lo, hi): run only the experts with lo <= id <= hi, adding into ``out``. Calls over
    consecutive ranges in ascending order add in exactly the order one full call does, so a
    cache too small for all of a chunk's experts at once still gives the same bits."""
    out = torch.zeros_like(x) if out is None else out
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    ids_of, counts = torch.unique_consecutive(flat[order], return_counts=True)
    token_of = order // ids.shape[1]
    start = 0
    for e, c in zip(ids_of.tolist(), counts.tolist()):
        sel = order[start : start + c]
        tok = token_of[start : start + c]
        start += c
        if experts is not None and not experts[0] <= e <= experts[1]:
            continue
        y = ffn(x[tok], *expert_weights(e)) * weights.flatten()[sel, None]
        # tokens are unique within one expert, so this accumulate is order-free (deterministic);
        # index_add_ on CPU is pathologically slow under thread contention
        out.index_put_((tok,), y.to(out.dtype), accumulate=True)
    return out


def layout_dims(layout: BlockLayout) -> tuple[int, int]:
    """(D, I) of the experts a layout holds: gate_up is [2I, D], down is [D, I]."""
    return layout.component("down.weight").shape[0], layout.component("gate_up.weight").shape[0] // 2


def check_pool(
    pool: torch.Tensor,
    layout: BlockLayout,
    global_scales: torch.Tensor | None,
    far: torch.Tensor | None = None,
) -> int:
    """Refuse a pool (and its far tier) that is not uint8 [rows, block_bytes], or int4 global
    scales that are not fp32 [slots, 2]; returns the slots addressable (device rows + far rows)."""
    for name, t in (("slot pool", pool), ("far tier", far)):
        if t is not None and (t.dtype != torch.uint8 or t.dim() != 2 or t.shape[1] != layout.block_bytes):
            raise ValueError(
                f"{name} must be uint8 [S, block_bytes={layout.block_bytes}], got {t.dtype} {list(t.shape)}"
            )
    slots = pool.shape[0] + (far.shape[0] if far is not None else 0)
    if layout.quant == "int4" and (
        global_scales is None
        or global_scales.dtype != torch.float32
        or tuple(global_scales.shape) != (slots, 2)
    ):
        got = None if global_scales is None else f"{global_scales.dtype} {list(global_scales.shape)}"
        raise ValueError(f"an int4 pool needs global scales fp32 [S={slots}, 2], got {got}")
    return slots


@dataclass(frozen=True)
class FarTier:
    """A layer's far tier: expert blocks in pinned host memory that the GPU reads in place over
    PCIe (a discrete GPU's host tier holding every expert), addressed as slots S.. after the
    device pool's S. ``reads`` (int64 [1] on the device): the Triton kernels add the (token,
    expert) pairs they served from here; ``uses``: the decode kernel counts every pair by expert
    id, near or far (what the cache ranks experts by to choose the device slots' set)."""

    rows: torch.Tensor  # uint8 [R, block_bytes], as the device sees it
    reads: torch.Tensor | None = None
    uses: torch.Tensor | None = None  # int32 [E] on the device: the decode kernel's pairs per expert id


@dataclass(frozen=True)
class RouterLogits:
    """A MoE layer's router output not yet routed (``moe_triton.moe_gemv``'s ``route``): logits
    [T, E + X] in the model dtype (columns contiguous), their first E the experts'. The decode
    kernel routes them itself (``router_topk``'s softmax, top-k and renormalisation, the same
    bits) into the step's ids and weights, where a launch of its own did it before."""

    logits: torch.Tensor
    num_experts: int
    normalize: bool


def slot_block(pool: torch.Tensor, far: FarTier | None, slot: int) -> torch.Tensor:
    """Slot ``slot``'s block: a device row below the pool's size, else row slot - S of the far
    tier (the pinned host tier a discrete GPU reads in place)."""
    S = pool.shape[0]
    return pool[slot] if slot < S else far.rows[slot - S]


def moe_experts_ref(
    x: torch.Tensor,
    pool: torch.Tensor,
    slot_idx: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    layout: BlockLayout,
    global_scales: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    acc: torch.Tensor | None = None,
    expert_range: tuple[int, int] | None = None,
    far: FarTier | None = None,
) -> torch.Tensor:
    """Router-weighted sum of each token's experts, read from a slot pool.

    x [T, D]; pool uint8 [S, block_bytes]; slot_idx, expert_ids int64 [T, A] (entry (t, a): the
    expert and the slot holding it); weights [T, A]; global_scales fp32 [S, 2] (int4). Weights
    are dequantized to x's dtype and the sum runs in x's dtype, as in the resident model; the
    result is cast to ``out_dtype`` (default x's dtype) once, at the end. An expert id that
    appears with two different slots is refused.

    ``expert_range`` (lo, hi): only experts lo..hi run (the others' slots are not read), added
    into ``acc`` (x's dtype), which is returned; see ``combine_experts``. ``far``: slots S..S+R-1 are
    its rows (``slot_block``), global scales then [S + R, 2]."""
    slots = check_pool(pool, layout, global_scales, None if far is None else far.rows)
    if (
        slot_idx.shape != expert_ids.shape
        or slot_idx.shape != weights.shape
        or slot_idx.shape[0] != x.shape[0]
    ):
        raise ValueError(
            f"x {list(x.shape)}, slot_idx {list(slot_idx.shape)}, expert_ids {list(expert_ids.shape)} and "
            f"weights {list(weights.shape)} must agree on [T, A]"
        )
    slot_of: dict[int, int] = {}
    for e, s in zip(expert_ids.flatten().tolist(), slot_idx.flatten().tolist()):
        if expert_range is not None and not expert_range[0] <= e <= expert_range[1]:
            continue
        if slot_of.setdefault(e, s) != s:
            raise ValueError(f"expert {e} is given two slots ({slot_of[e]} and {s}) in one step")
        if not 0 <= s < slots:
            raise ValueError(f"slot {s} (expert {e}) is outside the pool of {slots} slots")

    def expert_weights(e: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = slot_of[e]
        gs = None if global_scales is None else global_scales[s]
        return dequantize_block(layout, slot_block(pool, far, s), gs, dtype=x.dtype)

    out = combine_experts(x, expert_ids, weights, expert_weights, out=acc, experts=expert_range)
    return out if out_dtype is None or acc is not None else out.to(out_dtype)


def random_pool(
    layout: BlockLayout,
    slots: int,
    *,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A pool of ``slots`` random but valid blocks (and int4 global scales) for probes, tests and
    benchmarks: every value a quantizer could write, at magnitudes that keep an expert's output
    O(1) for O(1) inputs. Built on ``device`` with ``generator`` (which must live there)."""
    D, I = layout_dims(layout)
    pool = torch.zeros(slots, layout.block_bytes, dtype=torch.uint8, device=device)
    kw = dict(generator=generator, device=device)
    gscales = None
    if layout.quant == "int4":  # powers of two, as the quantizer writes them
        gscales = torch.exp2(-torch.randint(9, 13, (slots, 2), **kw).float())
    for proj, cols in (("gate_up", D), ("down", I)):
        wc = layout.component(f"{proj}.weight")
        shape = (slots, *wc.shape)
        if layout.quant == "bf16":
            vals = (torch.randn(shape, **kw) / cols**0.5).to(torch.bfloat16)
        elif layout.quant == "int8":
            vals = torch.randint(-127, 128, shape, **kw).to(torch.int8)
        else:
            vals = torch.randint(0, 256, shape, **kw).to(torch.uint8)
        pool[:, wc.offset : wc.offset + wc.nbytes] = vals.view(torch.uint8).reshape(slots, -1)
        if layout.quant == "bf16":
            continue
        sc = layout.component(f"{proj}.scales")
        shape = (slots, *sc.shape)
        if layout.quant == "int8":
            scale = torch.rand(shape, **kw) * (2.0 / (127 * cols**0.5)) + 1e-4
            raw = scale.view(torch.uint8)
        else:  # normal e4m3 codes 0.25 .. 1.875: group scales within 3 binades, as real tensors have
            raw = torch.randint(0x28, 0x40, shape, **kw).to(torch.uint8)
        pool[:, sc.offset : sc.offset + sc.nbytes] = raw.reshape(slots, -1)
    return pool, gscales
