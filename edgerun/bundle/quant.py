"""Expert (and dense weight) quantizers and the one dequantizer every load path uses.

Each scheme's quantizer sits beside its dequantizer. ``quantize_expert`` packs one routed expert
into a block of ``layout.block_bytes`` bytes; ``dequantize_block`` turns such a block (read from
disk into host memory, or into a device slot) back into ``gate_up [2I, D]`` and ``down [D, I]``.
The resident loader and the streaming engine both call ``dequantize_block``, so they agree bit
for bit. docs/bundle-format.md specifies the bytes.

Shape legend: R = rows (output features), C = columns (input features), g = group size,
G = groups per row (C // g).
"""

from __future__ import annotations

import math

import torch

from edgerun.bundle.layout import BlockLayout

INT8_MAX = 127
INT4_MAX = 7  # symmetric [-7, 7]; nibble 0x8 (-8) is never written, and read back as -8
E4M3_MAX = 448.0
E4M3_MIN_NORMAL = 2.0**-6
E4M3_MIN_NORMAL_BITS = 0x08  # 2^-6
E4M3_MAX_BITS = 0x7E  # 448 (0x7F is NaN in e4m3fn)
FP32_MIN_NORMAL_EXP = -126


# --------------------------------------------------------------------------------------------
# Hadamard rotation


def hadamard(g: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Orthonormal Sylvester Hadamard matrix [g, g] (fp32). It is symmetric, so it is its own
    inverse: rotating twice returns the input (up to fp32 rounding)."""
    if g <= 0 or g & (g - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {g}")
    h = torch.ones(1, 1)
    while h.shape[0] < g:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(g)).to(device)


def rotate_groups(w: torch.Tensor, g: int) -> torch.Tensor:
    """w [R, C] -> each length-g group of every row multiplied by H_g (fp32)."""
    R, C = w.shape
    h = hadamard(g, w.device)
    return (w.float().reshape(R, C // g, g) @ h).reshape(R, C)


# --------------------------------------------------------------------------------------------
# int8: symmetric, one fp32 scale per row (group 0) or per group of g columns


def _groups(w: torch.Tensor, g: int) -> torch.Tensor:
    R, C = w.shape
    return w.float().reshape(R, C // (g or C), g or C)  # [R, G, g]


def quantize_int8(w: torch.Tensor, g: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [R, C] -> (q int8 [R, C] in [-127, 127], scales fp32 [R, G]); scale = absmax / 127."""
    x = _groups(w, g)
    scale = x.abs().amax(-1) / INT8_MAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(x / safe[..., None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q.reshape(w.shape), scale


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """q int8 [R, C], scales fp32 [R, G] -> fp32 [R, C] = q * scale (one fp32 multiply)."""
    R, C = q.shape
    G = scales.shape[1]
    return (q.reshape(R, G, C // G).float() * scales[..., None]).reshape(R, C)


# --------------------------------------------------------------------------------------------
# int4: symmetric [-7, 7] in groups of g, scale = fp8_e4m3 per group x fp32 power of two per tensor


def e4m3_bits(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> float8_e4m3fn bit patterns (uint8), round to nearest even."""
    return x.float().to(torch.float8_e4m3fn).view(torch.uint8)


def e4m3_value(bits: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn bit patterns (uint8) -> fp32 (exact)."""
    return bits.view(torch.float8_e4m3fn).float()


def int4_global_scale(max_group_scale: float) -> float:
    """The power of two that maps the largest ideal group scale into (224, 448]. A power of two
    keeps ``code * global`` and ``q * code * global`` exact in fp32 (so dequantization is exact
    and order-free on any device), at the cost of at most one binade at the top of e4m3's range."""
    if not math.isfinite(max_group_scale):
        raise ValueError(f"weights are not finite (largest group scale {max_group_scale})")
    if max_group_scale <= 0:
        return 1.0
    m, e = math.frexp(max_group_scale / E4M3_MAX)  # ratio = m * 2^e, m in [0.5, 1)
    exp = e - 1 if m == 0.5 else e
    return math.ldexp(1.0, max(exp, FP32_MIN_NORMAL_EXP))


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q int8 [R, C] in [-8, 7] -> uint8 [R, C/2]: column 2j in the low nibble of byte j, column
    2j+1 in the high nibble; each nibble is the value's 4-bit two's complement."""
    n = q.to(torch.int8).view(torch.uint8) & 0xF
    return n[:, 0::2] | (n[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [R, C/2] -> int8 [R, C] (inverse of ``pack_int4``)."""
    R = packed.shape[0]
    n = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(R, -1)
    return ((n.to(torch.int16) ^ 8) - 8).to(torch.int8)


def int4_max_group_scale(w: torch.Tensor) -> float:
    """The largest ideal group scale (absmax / 7, in fp32) of ``w``: what the global is chosen
    from. The max over row blocks of a tensor is the tensor's, so a caller quantizing a large
    weight in row blocks takes the max of the blocks' and passes ``int4_global_scale`` of it."""
    return float(w.float().abs().amax() / INT4_MAX)


def quantize_int4(
    w: torch.Tensor, g: int, global_scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """w [R, C] -> (packed uint8 [R, C/2], group scale codes uint8 (e4m3 bits) [R, G], global fp32).

    The per-tensor global scale is a power of two (see ``int4_global_scale``); ``global_scale``
    gives it for ``w`` a block of rows of a larger tensor (groups are independent given the
    global, so the blocks' bytes are the whole tensor's). Each group's code is the one, among the
    four e4m3 values around absmax / 7 / global (the nearest, two below it and one above, clamped
    to [2^-6, 448]: never subnormal, never zero), whose rounded and clamped values have the least
    squared error; ties go to the smaller code."""
    x = _groups(w, g)  # [R, G, g]
    ideal = x.abs().amax(-1) / INT4_MAX  # [R, G]
    gscale = int4_global_scale(float(ideal.max())) if global_scale is None else global_scale
    nearest = e4m3_bits((ideal / gscale).clamp(E4M3_MIN_NORMAL, E4M3_MAX)).to(torch.int16)
    best_err = best_q = best_codes = None
    for k in (-2, -1, 0, 1):
        codes = (nearest + k).clamp(E4M3_MIN_NORMAL_BITS, E4M3_MAX_BITS).to(torch.uint8)
        step = (e4m3_value(codes) * gscale)[..., None]
        q = torch.round(x / step).clamp(-INT4_MAX, INT4_MAX)
        err = (q * step - x).square().sum(-1)
        if best_err is None:
            best_err, best_q, best_codes = err, q, codes
        else:
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_q = torch.where(better[..., None], q, best_q)
            best_codes = torch.where(better, codes, best_codes)
    return pack_int4(best_q.to(torch.int8).reshape(w.shape)), best_codes, gscale


def dequantize_int4(packed: torch.Tensor, codes: torch.Tensor, gscale: float | torch.Tensor) -> torch.Tensor:
    """(packed uint8 [R, C/2], codes uint8 [R, G], global fp32) -> fp32 [R, C], exact:
    value = q * (e4m3(code) * global)."""
    q = unpack_int4(packed)
    R, C = q.shape
    G = codes.shape[1]
    step = e4m3_value(codes) * torch.as_tensor(gscale, dtype=torch.float32, device=codes.device)
    return (q.reshape(R, G, C // G).float() * step[..., None]).reshape(R, C)


# --------------------------------------------------------------------------------------------
# Blocks

PROJECTIONS = ("gate_up", "down")  # block order; also the column order of the global-scale sidecar


def quantize_expert(
    layout: BlockLayout, gate_up: torch.Tensor, down: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One expert -> (block uint8 [block_bytes], global scales fp32 [2] for int4, else None).
    Bytes between and after components are zero. Computed on the weights' device."""
    block = torch.zeros(layout.block_bytes, dtype=torch.uint8, device=gate_up.device)
    gscales = torch.zeros(2, dtype=torch.float32, device=gate_up.device) if layout.quant == "int4" else None

    def put(name: str, t: torch.Tensor) -> None:
        c = layout.component(name)
        if tuple(t.shape) != c.shape:
            raise ValueError(f"component {name}: shape {list(t.shape)}, layout expects {list(c.shape)}")
        raw = t.contiguous().view(torch.uint8).reshape(-1)
        block[c.offset : c.offset + c.nbytes] = raw

    for i, (proj, w) in enumerate(zip(PROJECTIONS, (gate_up, down))):
        if layout.rotation == "hadamard":
            w = rotate_groups(w, layout.group_size)
        if layout.quant == "bf16":
            put(f"{proj}.weight", w.to(torch.bfloat16))
        elif layout.quant == "int8":
            q, scales = quantize_int8(w, layout.group_size)
            put(f"{proj}.weight", q)
            put(f"{proj}.scales", scales)
        else:
            packed, codes, gs = quantize_int4(w, layout.group_size)
            put(f"{proj}.weight", packed)
            put(f"{proj}.scales", codes)
            gscales[i] = gs
    return block, gscales


def as_bytes_tensor(raw: bytes | bytearray | memoryview | torch.Tensor) -> torch.Tensor:
    if isinstance(raw, torch.Tensor):
        return raw.reshape(-1).view(torch.uint8)
    if isinstance(raw, bytes):
        raw = bytearray(raw)  # frombuffer needs a writable buffer
    return torch.frombuffer(raw, dtype=torch.uint8)


def dequantize_block(
    layout: BlockLayout,
    raw: bytes | bytearray | memoryview | torch.Tensor,
    global_scales: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A block's bytes -> (gate_up [2I, D], down [D, I]) on the bytes' device.

    ``global_scales``: the expert's row of the layer's sidecar (fp32 [2]: gate_up, down), int4
    only. ``dtype`` None returns bf16 views of the block for an unrotated bf16 bundle and fp32
    otherwise; a dtype casts the fp32 (or bf16) result once, at the end."""
    buf = as_bytes_tensor(raw)
    if buf.numel() != layout.block_bytes:
        raise ValueError(f"block has {buf.numel()} bytes, the layout's block_bytes is {layout.block_bytes}")
    if layout.quant == "int4" and (global_scales is None or global_scales.numel() != 2):
        raise ValueError("an int4 block needs its two fp32 global scales (gate_up, down) from the sidecar")

    def comp(name: str, dt: torch.dtype) -> torch.Tensor:
        c = layout.component(name)
        return buf[c.offset : c.offset + c.nbytes].view(dt).reshape(c.shape)

    out = []
    for i, proj in enumerate(PROJECTIONS):
        if layout.quant == "bf16":
            w = comp(f"{proj}.weight", torch.bfloat16)
        elif layout.quant == "int8":
            w = dequantize_int8(comp(f"{proj}.weight", torch.int8), comp(f"{proj}.scales", torch.float32))
        else:
            w = dequantize_int4(
                comp(f"{proj}.weight", torch.uint8), comp(f"{proj}.scales", torch.uint8), global_scales[i]
            )
        if layout.rotation == "hadamard":
            w = rotate_groups(w, layout.group_size)  # H_g is its own inverse
        out.append(w if dtype is None else w.to(dtype))
    return out[0], out[1]
