"""ggml's scalar conversions as numba functions, bit for bit: float32 -> integer level (`nearest_int`) and
float32 <-> fp16 (`fp16_bits`, `fp16_value`), the way every block format stores its scales."""

from __future__ import annotations

import numba
import numpy as np

from moeprep.quant.jit import F32, JIT

MAGIC = F32(12582912.0)  # 1.5 * 2**23: adding it leaves round(v) in the low mantissa bits
_FP16_TINY = F32(2.0**-24)  # the smallest fp16 subnormal


@numba.njit(**JIT)
def nearest_int(v: np.float32) -> int:
    """ggml's nearest_int: add 1.5 * 2**23 and read the low mantissa bits. float32 -> int.

    Equal to round-half-even for |v| <= 4194303; beyond that (or for inf/NaN) it wraps exactly as the C does."""
    bits = F32(F32(v) + MAGIC).view(np.int32)
    return (bits & 0x007FFFFF) - 0x00400000


@numba.njit(**JIT)
def fp16_bits(v: np.float32) -> int:
    """GGML_FP32_TO_FP16: float32 -> fp16 bits (0..0xFFFF), rounded to nearest even. Overflow gives inf; a NaN keeps
    its sign and top payload bits and is quieted, as x86's F16C does (x86's default NaN 0xFFC00000 -> 0xFE00)."""
    f = F32(v).view(np.uint32)
    sign = (f >> 16) & 0x8000
    a = f & 0x7FFFFFFF
    if a > 0x7F800000:  # NaN
        return sign | 0x7E00 | ((a >> 13) & 0x3FF)
    if a >= 0x477FF000:  # inf, and 65520 and above, which round to 65536
        return sign | 0x7C00
    if a >= 0x38800000:  # normal fp16 (>= 2**-14): rebias the exponent by 127 - 15, keep 10 mantissa bits
        h = (a - 0x38000000) >> 13
        dropped, half = a & 0x1FFF, 0x1000
    else:  # subnormal fp16 or zero: the float32 significand with its implicit bit, in units of 2**-24
        shift = 126 - (a >> 23)
        if shift > 24:  # below 2**-25: rounds to zero
            return sign
        m = (a & 0x7FFFFF) | 0x800000
        h = m >> shift
        dropped, half = m & ((1 << shift) - 1), 1 << (shift - 1)
    if dropped > half or (dropped == half and h & 1):
        h += 1  # a carry out of the mantissa is the next binade, as IEEE rounding wants
    return sign | h


@numba.njit(**JIT)
def fp16_value(h: int) -> np.float32:
    """GGML_FP16_TO_FP32 of fp16 bits: the stored scale as the C reads it back. Exact."""
    sign = (h & 0x8000) << 16
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    if e == 0:  # zero or subnormal: m * 2**-24 is exact in float32
        v = F32(m) * _FP16_TINY
        return -v if sign else v
    bits = sign | (0x7F800000 if e == 31 else (e + 112) << 23) | (m << 13)
    return np.uint32(bits).view(np.float32)
