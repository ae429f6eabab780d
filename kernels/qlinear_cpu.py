"""Quantized dense projections on the CPU from their stored bytes: the int4 / int8 weight-only
GEMMs the expert kernels use (``kernels/moe_cpu.py``), for a ``QWeight`` (``kernels/qweight.py``)
instead of an expert block, so an int4 lm_head is read as 0.5 bytes a weight instead of being
dequantized to fp32 on every token.

int4: the weight is repacked once (``pack``) into torch's CPU layout (this CPU's:
``moe_cpu.int4_block_rows``); its group scales, e4m3(code)
x row_scale (a power of two), are exact in bf16, so the weights are exactly the reference's.
int8 with one scale per row: the stored bytes in place, the fp32 row scales applied after the
kernel. Activations and partial results are bf16 inside the kernels: within the dense probe's
bf16 tolerance of the reference (``probe_cpu``), not bit for bit. The packed copy is held beside
the stored weight (the same bytes again for int4; int8 shares them).
"""

from __future__ import annotations

import dataclasses

import torch

from edgerun.bundle.quant import e4m3_value
from edgerun.kernels.cpu_layout import BLOCK_N, INT4_GROUPS
from edgerun.kernels.moe_cpu import ACT, int4_layout_unknown, repack_int4
from edgerun.kernels.probe import ProbeResult
from edgerun.kernels.qweight import QWeight

NAME = "cpu_weight_only[int4pack, int8pack]"

Packed = tuple[torch.Tensor, torch.Tensor, int]  # (weight, scales, int4 group or 0 for int8)


def unsupported(w: QWeight) -> str | None:
    """Why the CPU kernels cannot compute with ``w``, or None."""
    if w.act != "bf16":
        return f"{w.act} activations (W4A8) run on qgemv only"
    if w.scheme == "int8":
        return (
            None
            if w.group == w.cols
            else f"int8 per group of {w.group} (the CPU kernel takes one scale a row)"
        )
    if w.scheme != "int4":
        return f"a {w.scheme} weight (the CPU kernels take int4 or int8)"
    if w.group not in INT4_GROUPS:
        return f"int4 group {w.group} (the CPU kernel takes {INT4_GROUPS})"
    if why := int4_layout_unknown():
        return why
    if w.rows % BLOCK_N or w.cols % 32:
        return f"[{w.rows}, {w.cols}] (the CPU kernel takes rows in multiples of {BLOCK_N}, columns of 32)"
    return None


# the int8 kernel's vector loads fault on a weight that is not 16-byte aligned (a segfault, not
# an error); a bundle's dense.safetensors places a tensor only 8-byte aligned
ALIGN = 64


def aligned(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy of it in fresh (aligned) memory where its data is not ``ALIGN``-aligned."""
    return t if t.data_ptr() % ALIGN == 0 else t.clone()


def pack(w: QWeight) -> Packed:
    """``w`` as the CPU kernels take it (check ``unsupported`` first): int8 the stored bytes in
    place where they are aligned, else a copy."""
    if w.scheme == "int8":
        return aligned(w.weight), w.scales[:, 0].contiguous(), 0
    scale = (e4m3_value(w.scales) * w.row_scale[:, None]).t()  # [G, R], exact
    return repack_int4(w.weight), torch.stack([scale, torch.zeros_like(scale)], dim=-1).to(ACT), w.group


def linear(x: torch.Tensor, packed: Packed) -> torch.Tensor:
    """x [N, C] @ the packed weight^T -> [N, R] in x's dtype (bf16 inside the kernel)."""
    w, s, group = packed
    xb = x.to(ACT)
    if group:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, w, group, s).float()
    else:  # the fp32 row scales in fp32 after the kernel (as bf16 they would be rounded)
        y = torch.ops.aten._weight_int8pack_mm(xb, w, torch.ones_like(s, dtype=ACT)).float() * s
    return y.to(x.dtype)


def misaligned(w: QWeight) -> QWeight:
    """``w`` with its weight bytes 8 bytes past an aligned address, as a bundle's mapped file may
    place them (the probe checks ``pack`` on such a weight, not only on fresh memory)."""
    raw = w.weight.reshape(-1).view(torch.uint8)
    buf = torch.empty(raw.numel() + ALIGN + 8, dtype=torch.uint8)
    start = (-buf.data_ptr()) % ALIGN + 8
    buf[start : start + raw.numel()].copy_(raw)
    moved = buf[start : start + raw.numel()].view(w.weight.dtype).view(w.weight.shape)
    return dataclasses.replace(w, weight=moved)


def probe(cases) -> ProbeResult:
    """The CPU kernels on random weights of each quantized (scheme, columns, group) the model has
    (``cases``: ``CausalLM.gemv_cases``), against ``qlinear_ref`` in fp32: selected when every
    output is within the dense probe's bf16 tolerance (the kernels' activations are bf16) and two
    runs are bitwise equal. Cases the kernels do not take are left to torch (and said)."""
    from edgerun.kernels.dense_probe import TOLERANCE, Refused, compare
    from edgerun.kernels.qlinear_reference import qlinear_ref, random_qweight

    kinds = sorted({(c[0], c[2], c[3]) for c in cases if c[0] != "plain"})
    if not kinds:
        return ProbeResult(NAME, False, "the model has no int4 / int8 projection")
    gen = torch.Generator().manual_seed(0)
    worst, skipped = 0.0, []
    try:
        for scheme, cols, group in kinds:
            w = misaligned(random_qweight(scheme, 2 * BLOCK_N, cols, group, gen))
            why = unsupported(w)
            if why:
                skipped.append(why)
                continue
            x = torch.randn(3, cols, generator=gen)
            packed = pack(w)
            runs = [linear(x, packed) for _ in range(2)]
            worst = max(
                worst,
                compare(f"{scheme} g{group} x {cols}", runs, qlinear_ref(x, w), TOLERANCE[torch.bfloat16]),
            )
    except Refused as e:
        return ProbeResult(NAME, False, str(e))
    if len(skipped) == len(kinds):
        return ProbeResult(NAME, False, f"no projection it takes: {skipped[0]}")
    note = f"; torch for {len(skipped)} kind(s): {skipped[0]}" if skipped else ""
    return ProbeResult(
        NAME,
        True,
        f"matched the reference within {worst:.1e} of the output's scale (limit 2e-2) and repeated{note}",
    )
