"""Routed experts on the CPU from their quantized bytes: torch's int4 / int8 weight-only GEMMs
(``aten._weight_int4pack_mm_for_cpu``, ``aten._weight_int8pack_mm``) with bf16 activations,
instead of dequantizing every active expert to fp32 on every token.

Shape legend: T = tokens, A = active experts per token, R = rows (outputs), C = columns (inputs),
g = group size, G = C // g.

int4: a slot's block is repacked once per fill (``pack_block``; the cache drops a slot's entry
when it refills it) into the layout ``_convert_weight_to_int4pack_for_cpu`` writes on this CPU:
rows in blocks of B (64 where torch's kernels are built for AVX512, 32 for AVX2; found once by
packing a probe with torch's own converter, ``int4_block_rows``), and for each column a byte
per row pair (i, i + B/2) of the block, low nibble first, each nibble the unsigned q + 8. The
kernel computes ``(nibble - 8) * scale + zero``, so the symmetric q in [-7, 7] needs zero point
0, and the group scale e4m3(code) x global (a power of two) is exact in bf16: 4 significant bits
times a power of two (unless the product falls below bf16's smallest normal, 2^-126, which no
real tensor's scales do). The weights are therefore
exactly the reference's (tests/kernels/test_moe_cpu.py checks this bit for bit); what differs is
activations and partial results in bf16 and the kernel's summation order, within the probe's
tolerance (kernels/probe.py). int8 (one scale per row) needs no repack: the kernel reads the
slot's int8 bytes in place, with unit scales; the fp32 row scales multiply its output in fp32
(as bf16 scales they would be rounded).

A token's experts are summed in ascending expert id, in fp32, as the reference does
(``combine_experts``; a decode step's one token by ``one_row``, the same bits without the
per-expert sort, gather and scatter), and no row is padded: the kernels' rows do not depend on each other
(tested), so a row's result is the same in any batch.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from edgerun.bundle.layout import BlockLayout
from edgerun.bundle.quant import PROJECTIONS, e4m3_value, pack_int4
from edgerun.kernels.cpu_layout import BLOCK_N, unsupported  # noqa: F401 (unsupported: the probe's)
from edgerun.kernels.moe_reference import FarTier, check_pool, combine_experts, slot_block

ACT = torch.bfloat16  # the kernels' fast path (fp32 activations run a scalar loop, ~30x slower)

Packed = tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def kernel_name(layout: BlockLayout) -> str:
    fmt = layout.quant + (f" g{layout.group_size}" if layout.group_size else "")
    return f"cpu_{'int4pack' if layout.quant == 'int4' else 'int8pack'}[{fmt}]"


def _repack(packed: torch.Tensor, block: int) -> torch.Tensor:
    """``repack_int4`` for a layout of ``block`` rows a block."""
    R, H = packed.shape
    u = (packed ^ 0x88).view(R // block, 2, block // 2, H)  # two's complement -> q + 8
    top, bottom = u[:, 0], u[:, 1]  # rows i and i + block/2 of each block: [R/block, block/2, C/2]
    even, odd = (top & 0xF) | (bottom << 4), (top >> 4) | (bottom & 0xF0)  # columns 2j, 2j + 1
    return (
        torch.stack([even, odd], dim=-1)
        .view(R // block, block // 2, 2 * H)
        .transpose(1, 2)
        .contiguous()
        .view(R, H)
    )


LAYOUT_BLOCKS = (64, 32)  # rows a block of torch's CPU int4 layout: AVX512 builds, AVX2 and below


@functools.cache
def int4_block_rows() -> int | None:
    """Rows a block of the int4 layout torch's CPU kernels take on this CPU (``LAYOUT_BLOCKS``),
    found by packing a random probe with ``_convert_weight_to_int4pack_for_cpu`` itself; None
    where neither matches (the int4 kernels are then not used: ``int4_layout_unknown``)."""
    q = torch.randint(0, 16, (2 * BLOCK_N, 64), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    try:
        theirs = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1).view(torch.uint8).reshape(-1)
    except (RuntimeError, AttributeError):
        return None
    stored = pack_int4(q - 8)  # the bundle's bytes of the same weight
    for block in LAYOUT_BLOCKS:
        if theirs.numel() == stored.numel() and torch.equal(_repack(stored, block).reshape(-1), theirs):
            return block
    return None


def int4_layout_unknown() -> str | None:
    """Why the int4 CPU kernels cannot be fed here (torch packs them in a layout of neither
    ``LAYOUT_BLOCKS``), or None."""
    if int4_block_rows() is None:
        return (
            f"torch {torch.__version__} packs int4 for this CPU ({torch.backends.cpu.get_cpu_capability()}) "
            f"in a layout of neither {' nor '.join(map(str, LAYOUT_BLOCKS))}-row blocks"
        )
    return None


def repack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The bundle's int4 bytes (uint8 [R, C/2]: column 2j low nibble, two's complement) -> torch's
    CPU layout of the unsigned q + 8 (uint8 [R, C/2]), as ``_convert_weight_to_int4pack_for_cpu``
    writes it on this CPU (check ``int4_layout_unknown`` first). Byte-wise: a target byte pairs
    one column of rows i and i + B/2 of a block of B rows (``int4_block_rows``)."""
    block = int4_block_rows()
    if block is None:
        raise RuntimeError(int4_layout_unknown())
    return _repack(packed, block)


def pack_block(layout: BlockLayout, block: torch.Tensor, gscales: torch.Tensor | None) -> Packed:
    """A slot's bytes -> ((weight, scales) for gate_up, (weight, scales) for down) as the CPU
    kernels take them; int8 weights are views of ``block``."""

    def comp(name: str, dt: torch.dtype) -> torch.Tensor:
        c = layout.component(name)
        return block[c.offset : c.offset + c.nbytes].view(dt).reshape(c.shape)

    out = []
    for i, proj in enumerate(PROJECTIONS):
        if layout.quant == "int8":
            out.append((comp(f"{proj}.weight", torch.int8), comp(f"{proj}.scales", torch.float32)[:, 0]))
            continue
        w = repack_int4(comp(f"{proj}.weight", torch.uint8))
        scale = (e4m3_value(comp(f"{proj}.scales", torch.uint8)) * gscales[i]).t()  # [G, R], exact
        out.append((w, torch.stack([scale, torch.zeros_like(scale)], dim=-1).to(ACT)))
    return out[0], out[1]


def pack_slots(
    layout: BlockLayout,
    pool: torch.Tensor,
    global_scales: torch.Tensor | None,
    slots,
    packed: dict[int, Packed],
    far: FarTier | None = None,
) -> None:
    """``pack_block`` for each of ``slots`` that ``packed`` does not hold yet, into ``packed``
    (``far``: slots from the pool's rows on are its rows)."""
    for s in slots:
        if s not in packed:
            block = slot_block(pool, far, s)
            packed[s] = pack_block(layout, block, None if global_scales is None else global_scales[s])


def linear(x: torch.Tensor, weight: tuple[torch.Tensor, torch.Tensor], group: int) -> torch.Tensor:
    """x bf16 [N, C] @ a packed weight^T -> fp32 [N, R]."""
    w, s = weight
    if group:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, w, group, s).float()
    # int8: the fp32 row scales applied in fp32 after the kernel (bf16 would round them)
    return torch.ops.aten._weight_int8pack_mm(x, w, torch.ones_like(s, dtype=ACT)).float() * s


def stacked(calls, group: int) -> torch.Tensor:
    """``linear`` of each (x [1, C], packed weight) in ``calls``, as rows of one fp32 [len, R]:
    for int4 the kernels' bf16 rows are converted to fp32 once (an exact conversion, so the bits
    of ``linear`` per row)."""
    if not group:
        return torch.cat([linear(x, w, 0) for x, w in calls])
    mm = torch.ops.aten._weight_int4pack_mm_for_cpu
    return torch.cat([mm(x, w, group, s) for x, (w, s) in calls]).float()


def moe_cpu(
    x: torch.Tensor,
    pool: torch.Tensor,
    slot_idx: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    layout: BlockLayout,
    global_scales: torch.Tensor | None,
    packed: dict[int, Packed],
    out_dtype: torch.dtype | None = None,
    acc: torch.Tensor | None = None,
    expert_range: tuple[int, int] | None = None,
    far: FarTier | None = None,
) -> torch.Tensor:
    """``moe_experts_ref``'s contract on the CPU kernels. ``packed``: slot -> its packed weights,
    filled here for slots that have none (the caller drops a slot's entry when it refills it).
    The sum runs in fp32 (``acc`` fp32 when given) and is cast to ``out_dtype`` once. ``far``:
    slots from the pool's rows on are its rows, as ``moe_experts_ref``'s."""
    check_pool(pool, layout, global_scales, None if far is None else far.rows)
    group = layout.group_size if layout.quant == "int4" else 0
    if x.shape[0] == 1 and acc is None and expert_range is None:  # a decode step
        y = one_row(x, pool, slot_idx, expert_ids, weights, layout, global_scales, packed, group, far)
        return y.to(out_dtype or x.dtype)
    slot_of = dict(zip(expert_ids.flatten().tolist(), slot_idx.flatten().tolist()))

    def expert_weights(e: int) -> Packed:
        pack_slots(layout, pool, global_scales, (slot_of[e],), packed, far)
        return packed[slot_of[e]]

    def ffn(h: torch.Tensor, gate_up: tuple, down: tuple) -> torch.Tensor:
        gate, up = linear(h.to(ACT), gate_up, group).chunk(2, dim=-1)
        return linear((F.silu(gate) * up).to(ACT), down, group)

    out = torch.zeros(x.shape, dtype=torch.float32) if acc is None else acc
    out = combine_experts(x, expert_ids, weights, expert_weights, out=out, experts=expert_range, ffn=ffn)
    return out if acc is not None else out.to(out_dtype or x.dtype)


def one_row(
    x: torch.Tensor,
    pool: torch.Tensor,
    slot_idx: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    layout: BlockLayout,
    global_scales: torch.Tensor | None,
    packed: dict[int, Packed],
    group: int,
    far: FarTier | None = None,
) -> torch.Tensor:
    """``moe_cpu`` of one token (x [1, D], the rest [1, A]) -> fp32 [1, D], with the bits
    ``combine_experts`` gives (tested equal): the A experts' GEMMs one kernel call each (torch
    has no grouped int4 kernel), everything between them one op over all A rows (elementwise, so
    each row's bits are its own), and the router-weighted rows summed one by one in ascending
    expert id, in fp32, into zeros, as ``combine_experts`` accumulates them. No sort, gather or
    scatter per expert."""
    ids, slots = expert_ids[0].tolist(), slot_idx[0].tolist()  # CPU tensors: no device round trip
    order = sorted(range(len(ids)), key=ids.__getitem__)
    if len(set(ids)) != len(ids):
        raise ValueError(f"a token routed to the same expert twice: {ids}")
    pack_slots(layout, pool, global_scales, (slots[a] for a in order), packed, far)
    xb = x.to(ACT)
    gate, up = stacked([(xb, packed[slots[a]][0]) for a in order], group).chunk(2, dim=-1)
    h = (F.silu(gate) * up).to(ACT)  # [A, I]
    ys = stacked([(h[i : i + 1], packed[slots[a]][1]) for i, a in enumerate(order)], group)
    ys = ys * weights[0, order, None]  # [A, D] fp32
    out = torch.zeros(x.shape, dtype=torch.float32)
    for i in range(len(order)):
        out.add_(ys[i])
    return out
