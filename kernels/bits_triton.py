"""Exact decoders of stored bits for the Triton kernels (experts and projections alike).

Quantized values become fp32 without int-to-float conversions (a quarter-rate instruction on the
GPU): a field is masked in place, its sign bit flipped and an exponent or-ed over it, so the
float is 2^e + (q + 2^(bits-1)), from which one exact subtraction leaves q. An e4m3 scale code
moves into fp32's sign and low exponent bits and one multiply by 2^120 rescales it.

Order keys: an fp32 value and its index as one int64 whose integer order is the pick order (the
larger value, then the lower index), so that one max reduction (or one ``atomic_max`` between
programs) is an argmax with its tie rule, and the value comes back from the key exactly.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _field(word, P: tl.constexpr, BITS: tl.constexpr, zero):
    """The two's complement field of BITS bits at bit P (P + BITS <= 23) of int32 words, as
    fp32, exactly: (field ^ sign) | exponent is 2^(23 - P) + field + 2^(BITS - 1). ``zero`` (a
    runtime 0) keeps the constant in a register, so the mask and xor are one instruction."""
    MASK: tl.constexpr = ((1 << BITS) - 1) << P
    BASE: tl.constexpr = ((1 << (BITS - 1)) << P) | ((150 - P) << 23)
    f = ((word & MASK) ^ (zero + BASE)).to(tl.float32, bitcast=True)
    return f - tl.full([1], BASE, tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _nibbles(p, zero):
    """Packed int4 bytes -> (low, high) values as fp32, exactly: column 2j is byte j's low nibble."""
    v = p.to(tl.int32)
    return _field(v, 0, 4, zero), _field(v, 4, 4, zero)


@triton.jit
def _e4m3(code):
    """float8_e4m3fn bit patterns (uint8) -> fp32, exactly, NaN codes aside (never written): the
    sign and the 7 exponent and mantissa bits moved to fp32's sign and low exponent bits make
    the value times 2^-120, subnormal codes included (an fp32 subnormal then)."""
    c = code.to(tl.int32)
    bits = ((c & 0x7F) << 20) | ((c & 0x80) << 24)
    return bits.to(tl.float32, bitcast=True) * 1.329227995784916e36  # 2^120


KEY_EMPTY = tl.constexpr(-(2**63))  # below every key ``_order_key`` makes


@triton.jit
def _order_key(x, index):
    """fp32 x and its index (< 2^32) -> int64: (the value's order - 2^31) * 2^32 + (2^32 - 1 -
    index). The order is the value's bits made monotone (a negative value's 31 low bits flipped),
    -0.0 as +0.0 (they compare equal) and NaN above +inf, as ``torch.argmax`` ranks it."""
    bits = (x + 0.0).to(tl.int32, bitcast=True).to(tl.int64)
    order = tl.where(bits < 0, -1 - bits, bits + 2147483648)  # -1 - b: ~b of a 32-bit b, as int64
    order = tl.where(x != x, 4294967295, order)
    return (order - 2147483648) * 4294967296 + (4294967295 - index.to(tl.int64))


KEY32_EMPTY = tl.constexpr(-(2**31))  # below every key ``_order_key32`` makes


@triton.jit
def _order_key32(x, index):
    """A bf16 value x (as fp32: exact) and its index (< 2^16) -> int32 that sorts as
    ``_order_key`` does: (the value's signed 16-bit order) * 2^16 + (2^16 - 1 - index). The
    signed order of fp32 bits is the bits, a negative value's 31 low bits flipped; a bf16's
    fp32 bits have 16 zero low bits (all ones once flipped), so the order's high 16 bits are
    all of it. -0.0 is +0.0, NaN the highest (no real value's order reaches 2^15 - 1). Half the
    width of ``_order_key``'s int64: a maximum over keys moves half as many bits between threads."""
    bits = (x + 0.0).to(tl.int32, bitcast=True)
    order = tl.where(bits < 0, bits ^ 2147483647, bits)  # signed order: a negative's magnitude flipped
    order = tl.where(x != x, 2147483647, order)
    return (order >> 16) * 65536 + (65535 - index.to(tl.int32))  # arithmetic shift: the sign stays


@triton.jit
def _key32_index(key):
    """The index ``_order_key32`` put in ``key``."""
    return 65535 - (key & 65535)


@triton.jit
def _key32_value(key):
    """The value ``_order_key32`` put in ``key``, as fp32, exactly (+0.0 for -0.0; a NaN for NaN)."""
    order = key >> 16
    bits = tl.where(order >= 0, order, order ^ 32767)  # the bf16's bits, sign-extended
    return (bits << 16).to(tl.float32, bitcast=True)


@triton.jit
def _key_index(key):
    """The index ``_order_key`` put in ``key``."""
    return (4294967295 - (key & 4294967295)).to(tl.int32)


@triton.jit
def _key_value(key):
    """The fp32 value ``_order_key`` put in ``key``, exactly (+0.0 for -0.0; a NaN for NaN)."""
    order = (key >> 32) + 2147483648
    bits = tl.where(order >= 2147483648, order - 2147483648, -1 - order)
    return bits.to(tl.int32).to(tl.float32, bitcast=True)
