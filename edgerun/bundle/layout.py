"""The byte layout of one routed expert's block in an expert file (bundle formats 1 and 2).

A block holds one expert's gate_up [2I, D] and down [D, I] projections, quantized as the bundle
says, each followed by its per-row or per-group scales. Components start on 64-byte boundaries
(vector loads); the block is padded to a multiple of 4096 bytes, so expert ``e`` sits at
``e * block_bytes`` and every read is O_DIRECT-aligned in offset and length. Per-tensor (global)
scales live in the per-layer ``.scales`` sidecar, not in the block. A rotation (Hadamard, per
group) changes how the bytes are read back, never where they are. Pure arithmetic: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from edgerun.errors import ConfigError

if TYPE_CHECKING:
    from edgerun.models.args import ModelArgs

ALIGN = 4096
COMPONENT_ALIGN = 64
QUANTS = ("bf16", "int8", "int4")
DEFAULT_GROUP = {"bf16": 0, "int8": 0, "int4": 32}  # int8 group 0: one scale per output row
INT4_GROUPS = (16, 32)
ROTATIONS = ("none", "hadamard")  # hadamard: orthonormal Sylvester Hadamard over each group


@dataclass(frozen=True)
class Component:
    name: str  # gate_up.weight | gate_up.scales | down.weight | down.scales
    dtype: str  # bf16 | int8 | uint8 (two int4 per byte) | fp32 | fp8_e4m3
    shape: tuple[int, ...]
    offset: int  # byte offset inside the block
    nbytes: int


@dataclass(frozen=True)
class BlockLayout:
    quant: str
    group_size: int
    components: tuple[Component, ...]
    block_bytes: int
    rotation: str = "none"

    def component(self, name: str) -> Component:
        for c in self.components:
            if c.name == name:
                return c
        raise KeyError(name)

    @property
    def payload_bytes(self) -> int:
        return sum(c.nbytes for c in self.components)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def check_quant(quant: str, group_size: int | None, hidden: int, inter: int) -> int:
    """Validate (quant, group) for this geometry; returns the effective group size."""
    if quant not in QUANTS:
        raise ConfigError(f"quant {quant!r} is not supported (supported: {', '.join(QUANTS)})")
    group = DEFAULT_GROUP[quant] if group_size is None else group_size
    if quant == "bf16":
        return 0
    if quant == "int4" and group not in INT4_GROUPS:
        raise ConfigError(f"int4 group size must be one of {INT4_GROUPS}, got {group}")
    if group < 0:
        raise ConfigError(f"group size must be >= 0, got {group}")
    if group:
        for cols in (hidden, inter):
            if cols % group:
                raise ConfigError(
                    f"group size {group} does not divide the expert's input width {cols} "
                    f"(hidden {hidden}, expert intermediate {inter})"
                )
    return group


def check_rotation(rotation: str, quant: str, group: int) -> None:
    if rotation not in ROTATIONS:
        raise ConfigError(f"rotation {rotation!r} is not supported (supported: {', '.join(ROTATIONS)})")
    if rotation == "hadamard" and (quant == "bf16" or group <= 0 or group & (group - 1)):
        raise ConfigError(
            f"a Hadamard rotation needs a quantized scheme with a power-of-two group size "
            f"(got quant {quant!r}, group {group})"
        )


def expert_block_layout(
    args: ModelArgs, quant: str = "bf16", group_size: int | None = None, rotation: str = "none"
) -> BlockLayout:
    D, I = args.hidden_size, args.moe_intermediate_size
    group = check_quant(quant, group_size, D, I)
    check_rotation(rotation, quant, group)
    comps: list[Component] = []
    offset = 0

    def add(name: str, dtype: str, shape: tuple[int, ...], nbytes: int) -> None:
        nonlocal offset
        offset = _round_up(offset, COMPONENT_ALIGN)
        comps.append(Component(name, dtype, shape, offset, nbytes))
        offset += nbytes

    for proj, rows, cols in (("gate_up", 2 * I, D), ("down", D, I)):
        if quant == "bf16":
            add(f"{proj}.weight", "bf16", (rows, cols), rows * cols * 2)
        elif quant == "int8":
            add(f"{proj}.weight", "int8", (rows, cols), rows * cols)
            ngroups = cols // group if group else 1
            add(f"{proj}.scales", "fp32", (rows, ngroups), rows * ngroups * 4)
        else:  # int4: two values per byte, one fp8 (e4m3) scale per group; fp32 global in the sidecar
            add(f"{proj}.weight", "uint8", (rows, cols // 2), rows * cols // 2)
            add(f"{proj}.scales", "fp8_e4m3", (rows, cols // group), rows * cols // group)
    return BlockLayout(quant, group, tuple(comps), _round_up(offset, ALIGN), rotation)
