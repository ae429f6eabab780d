"""Which expert block layouts torch's CPU weight-only kernels take (``kernels/moe_cpu.py``), and
the bytes the copy they compute from holds beside each slot: without torch, so the planner
(which imports none) counts that copy.

An int4 slot is repacked into torch's layout once per fill and the packed copy is kept beside
the slot's own bytes (which stay: they are what a refill overwrites and what was checked): the
same nibbles again, and per group of each row a bf16 scale and a bf16 zero point (4 bytes where
the bundle stores a 1-byte e4m3 code). int8 slots are read in place (nothing is copied).
"""

from __future__ import annotations

from edgerun.bundle.layout import BlockLayout

BLOCK_N = 64  # rows per block of torch's CPU int4 layout
INT4_GROUPS = (32, 64, 128, 256)  # the group sizes _weight_int4pack_mm_for_cpu takes
PROJECTIONS = ("gate_up", "down")


def unsupported_format(layout: BlockLayout, takes: str) -> str | None:
    """Why a CPU expert kernel cannot run ``layout``'s blocks (``takes``: the message's subject
    and verb, "the CPU kernels take"): every one takes unrotated int4, or int8 with one scale per
    row. None when it can."""
    if layout.quant not in ("int4", "int8"):
        return f"{takes} int4 or int8 blocks, this bundle's are {layout.quant}"
    if layout.rotation != "none":
        return f"{takes} unrotated blocks, this bundle's are {layout.rotation}-rotated"
    if layout.quant == "int8" and layout.group_size:
        return f"{takes} int8 with one scale per row, this bundle's are per group of {layout.group_size}"
    return None


def unsupported(layout: BlockLayout) -> str | None:
    """Why the CPU kernels cannot run ``layout``'s experts, or None."""
    why = unsupported_format(layout, "the CPU kernels take")
    if why:
        return why
    if layout.quant == "int4" and layout.group_size not in INT4_GROUPS:
        return f"the int4 CPU kernel takes groups of {INT4_GROUPS}, this bundle's are {layout.group_size}"
    for proj in PROJECTIONS:
        R, C = layout.component(f"{proj}.weight").shape
        C *= 2 if layout.quant == "int4" else 1
        if R % BLOCK_N or C % 32:
            return (
                f"{proj} is [{R}, {C}], the CPU kernels take rows in multiples of {BLOCK_N} and columns of 32"
            )
    return None


def packed_bytes(layout: BlockLayout) -> int:
    """Bytes of the packed copy the CPU kernels keep beside one slot of ``layout`` (0: none)."""
    if layout.quant != "int4" or unsupported(layout) is not None:
        return 0
    total = 0
    for proj in PROJECTIONS:
        R, H = layout.component(f"{proj}.weight").shape
        total += R * H + (2 * H // layout.group_size) * R * 2 * 2  # nibbles; bf16 (scale, zero)
    return total
