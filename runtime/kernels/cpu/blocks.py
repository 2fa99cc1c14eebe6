"""Block decoders of the CPU expert kernels: each GGUF block type's `unpack` of one weight row into int16 values
`wq` that carry their sub-block's integer scale, integer mins `mn` and per-block float scales `dd` (the float types:
float32 values `wf`). See moe_rows.py for how the kernels use them."""

from __future__ import annotations

import platform

import numba
import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

from moeprep.quant.jit import JIT
from moeprep.quant.scalars import fp16_value

# ------------------------------------------------------------------------------------------------ block decoders
# unpack(row, wq, wf, sc, mn, dd): one weight row's bytes -> for the integer types wq (cols,) int16, each value
# already times its sub-block's integer scale (exact: at most 127 * 32 in magnitude), mn (nb, n_sub) int32 mins and
# dd (nb, 2) float32 (d, dmin), with sc (nb, n_sub) int32 as scratch; for the float types wf (cols,) float32.
# Layouts are ggml's blocks, read as moerun.kernels.dequant reads them (its docstrings draw them).
#
# Written for LLVM's loop vectorizer: flat indices into the row (a slice per block costs more than a block of 16
# values), and the short inner loops run to a count it cannot see (`_opaque`): a loop of a known 16 or 32 steps is
# unrolled before the vectorizer runs and then stays scalar, 3-10x slower.


@numba.njit(inline="always")
def _opaque(n: int, a: np.ndarray) -> int:
    """n, in a form the compiler cannot fold to a constant (an array's length is never negative, but LLVM does not
    know that)."""
    return n + (a.shape[0] < 0)


@intrinsic
def _half_bits_to_f32(typingctx, bits):
    """The fp16 with these bits (uint16) as a float32: LLVM's half -> float extension, one vcvtph2ps (F16C) on x86.
    numba has no float16 type on the CPU, hence the intrinsic."""

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.uint16), codegen


# The conversion is one instruction where the CPU has one (F16C on x86-64, in every CPU since 2012; every ARM64);
# without it LLVM would call a runtime helper the JIT may not link, so such CPUs keep the bit arithmetic.
_HARDWARE_HALF = platform.machine() not in ("x86_64", "AMD64") or bool(llvm.get_host_cpu_features().get("f16c"))


@numba.njit(inline="always")
def _f16(blk: np.ndarray, o: int) -> np.float32:
    """The fp16 at blk[o:o + 2], exactly, by the hardware's conversion (the bit arithmetic it replaces, a dozen
    instructions, was a tenth of a Q8_0 block's work); inf and NaN the slow way, so that a signaling NaN keeps its
    bits as in GGML's table (the hardware would quiet it)."""
    h = np.uint32(blk[o]) | (np.uint32(blk[o + 1]) << np.uint32(8))
    if not _HARDWARE_HALF or h & np.uint32(0x7C00) == np.uint32(0x7C00):
        return fp16_value(h)
    return _half_bits_to_f32(np.uint16(h))


@numba.njit(inline="always")
def _u32(blk: np.ndarray, o: int) -> int:
    return np.int64(blk[o]) | (np.int64(blk[o + 1]) << 8) | (np.int64(blk[o + 2]) << 16) | (np.int64(blk[o + 3]) << 24)


@numba.njit(**JIT)
def _unpack_q4_0(row, wq, wf, sc, mn, dd):
    """d (fp16), 16 bytes: value l is the low nibble of byte l, value l + 16 its high nibble; q - 8."""
    half = _opaque(16, row)
    for b in range(dd.shape[0]):
        o, v = b * 18, b * 32
        dd[b, 0] = _f16(row, o)
        for l in range(half):
            c = row[o + 2 + l]
            wq[v + l] = np.int16(c & 15) - 8
            wq[v + half + l] = np.int16(c >> 4) - 8


@numba.njit(**JIT)
def _unpack_q4_1(row, wq, wf, sc, mn, dd):
    """d, m (fp16), 16 bytes of nibbles as Q4_0; value d * q + m."""
    half = _opaque(16, row)
    for b in range(dd.shape[0]):
        o, v = b * 20, b * 32
        dd[b, 0], dd[b, 1] = _f16(row, o), -_f16(row, o + 2)
        mn[b, 0] = 1
        for l in range(half):
            c = row[o + 4 + l]
            wq[v + l] = np.int16(c & 15)
            wq[v + half + l] = np.int16(c >> 4)


@numba.njit(**JIT)
def _unpack_q5_0(row, wq, wf, sc, mn, dd):
    """d (fp16), qh (uint32: bit j is value j's fifth bit), 16 bytes of nibbles as Q4_0; q - 16."""
    half = _opaque(16, row)
    for b in range(dd.shape[0]):
        o, v = b * 22, b * 32
        dd[b, 0] = _f16(row, o)
        qh = _u32(row, o + 2)
        for l in range(half):
            c = row[o + 6 + l]
            wq[v + l] = np.int16((c & 15) | (((qh >> l) & 1) << 4)) - 16
            wq[v + half + l] = np.int16((c >> 4) | (((qh >> (l + 16)) & 1) << 4)) - 16


@numba.njit(**JIT)
def _unpack_q5_1(row, wq, wf, sc, mn, dd):
    """d, m (fp16), qh, 16 bytes of nibbles as Q5_0; value d * q + m."""
    half = _opaque(16, row)
    for b in range(dd.shape[0]):
        o, v = b * 24, b * 32
        dd[b, 0], dd[b, 1] = _f16(row, o), -_f16(row, o + 2)
        mn[b, 0] = 1
        qh = _u32(row, o + 4)
        for l in range(half):
            c = row[o + 8 + l]
            wq[v + l] = np.int16((c & 15) | (((qh >> l) & 1) << 4))
            wq[v + half + l] = np.int16((c >> 4) | (((qh >> (l + 16)) & 1) << 4))


@numba.njit(**JIT)
def _unpack_q8_0(row, wq, wf, sc, mn, dd):
    """d (fp16), 32 int8 values."""
    n = _opaque(32, row)
    for b in range(dd.shape[0]):
        o, v = b * 34, b * 32
        dd[b, 0] = _f16(row, o)
        for l in range(n):
            wq[v + l] = np.int8(row[o + 2 + l])


# E2M1 codes (sign, 2-bit exponent, 1-bit mantissa) as twice their value, the integers ggml's MXFP4 dot uses.
E2M1_DOUBLED = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int16)


@numba.njit(**JIT)
def _unpack_mxfp4(row, wq, wf, sc, mn, dd):
    """e (E8M0 exponent), 16 bytes of E2M1 nibbles as Q4_0; value = doubled code * 2**(e - 128)."""
    half = _opaque(16, row)
    for b in range(dd.shape[0]):
        o, v = b * 17, b * 32
        e = np.int64(row[o])
        bits = (0x00200000 << e) if e < 2 else ((e - 1) << 23)  # below float32's normal range: subnormals
        dd[b, 0] = np.uint32(bits).view(np.float32)
        for l in range(half):
            c = row[o + 1 + l]
            wq[v + l] = E2M1_DOUBLED[c & 15]
            wq[v + half + l] = E2M1_DOUBLED[c >> 4]


@numba.njit(**JIT)
def _unpack_q2_k(row, wq, wf, sc, mn, dd):
    """16 scale bytes (low nibble scale, high nibble min of a sub-block of 16), 64 bytes of 2-bit values, d, dmin.
    Each 32-byte half h holds 128 values as four 2-bit planes p of 32: value 128h + 32p + l in byte 32h + l."""
    n = _opaque(16, row)
    for b in range(dd.shape[0]):
        o, v = b * 84, b * 256
        for s in range(16):
            mn[b, s] = row[o + s] >> 4
        dd[b, 0], dd[b, 1] = _f16(row, o + 80), _f16(row, o + 82)
        for h in range(2):
            for p in range(4):
                for g in range(2):
                    scale = np.int16(row[o + h * 8 + p * 2 + g] & 15)
                    src, dst = o + 16 + h * 32 + g * 16, v + h * 128 + p * 32 + g * 16
                    for l in range(n):
                        wq[dst + l] = np.int16((row[src + l] >> (2 * p)) & 3) * scale


@numba.njit(**JIT)
def _unpack_q3_k(row, wq, wf, sc, mn, dd):
    """32 bytes hmask (third bits), 64 bytes of 2-bit values as Q2_K, 12 bytes of 6-bit signed scales, d.
    Scale i: low 4 bits from nibble i of bytes 0-7 (the low nibbles first), top 2 bits from 2-bit field i // 4 of
    byte 8 + i % 4. Value j is its 2 low bits, minus 4 where bit j // 32 of hmask byte j % 32 is clear."""
    n = _opaque(16, row)
    for b in range(dd.shape[0]):
        o, v = b * 110, b * 256
        for i in range(16):
            low = np.int64(row[o + 96 + i] & 15) if i < 8 else np.int64(row[o + 88 + i] >> 4)
            high = np.int64(row[o + 104 + i % 4] >> (2 * (i // 4))) & 3
            sc[b, i] = (low | (high << 4)) - 32
        dd[b, 0] = _f16(row, o + 108)
        for h in range(2):
            for p in range(4):
                for g in range(2):
                    scale = np.int16(sc[b, h * 8 + p * 2 + g])
                    src, mask, dst = o + 32 + h * 32 + g * 16, o + g * 16, v + h * 128 + p * 32 + g * 16
                    for l in range(n):
                        low2 = np.int16((row[src + l] >> (2 * p)) & 3)
                        third = np.int16((row[mask + l] >> (h * 4 + p)) & 1)
                        wq[dst + l] = (low2 - 4 + 4 * third) * scale


@numba.njit(inline="always")
def _kquant_scales_mins(row, o, sc, mn):
    """The 12 bytes at o of 6-bit scales and mins of Q4_K/Q5_K's eight sub-blocks (see
    dequant._kquant_scales_mins)."""
    for j in range(4):
        sc[j] = row[o + j] & 63
        mn[j] = row[o + 4 + j] & 63
        sc[4 + j] = (row[o + 8 + j] & 15) | ((row[o + j] >> 6) << 4)
        mn[4 + j] = (row[o + 8 + j] >> 4) | ((row[o + 4 + j] >> 6) << 4)


@numba.njit(**JIT)
def _unpack_q4_k(row, wq, wf, sc, mn, dd):
    """d, dmin (fp16), 12 bytes of scales and mins, 128 bytes: chunk c of 32 bytes holds sub-block 2c in its low
    nibbles and 2c + 1 in its high nibbles."""
    n = _opaque(32, row)
    for b in range(dd.shape[0]):
        o, v = b * 144, b * 256
        dd[b, 0], dd[b, 1] = _f16(row, o), _f16(row, o + 2)
        _kquant_scales_mins(row, o + 4, sc[b], mn[b])
        for c in range(4):
            lo, hi = np.int16(sc[b, 2 * c]), np.int16(sc[b, 2 * c + 1])
            src, dst = o + 16 + c * 32, v + c * 64
            for l in range(n):
                wq[dst + l] = np.int16(row[src + l] & 15) * lo
                wq[dst + n + l] = np.int16(row[src + l] >> 4) * hi


@numba.njit(**JIT)
def _unpack_q5_k(row, wq, wf, sc, mn, dd):
    """Q4_K with 32 bytes qh before the nibbles: bit j of qh[l] is the fifth bit of sub-block j's value l."""
    n = _opaque(32, row)
    for b in range(dd.shape[0]):
        o, v = b * 176, b * 256
        dd[b, 0], dd[b, 1] = _f16(row, o), _f16(row, o + 2)
        _kquant_scales_mins(row, o + 4, sc[b], mn[b])
        for c in range(4):
            lo, hi = np.int16(sc[b, 2 * c]), np.int16(sc[b, 2 * c + 1])
            src, qh, dst = o + 48 + c * 32, o + 16, v + c * 64
            for l in range(n):
                x, h = row[src + l], row[qh + l]
                wq[dst + l] = np.int16((x & 15) | (((h >> (2 * c)) & 1) << 4)) * lo
                wq[dst + n + l] = np.int16((x >> 4) | (((h >> (2 * c + 1)) & 1) << 4)) * hi


@numba.njit(**JIT)
def _unpack_q6_k(row, wq, wf, sc, mn, dd):
    """128 bytes of low nibbles, 64 bytes of 2-bit high parts, 16 int8 scales (sub-blocks of 16), d; q - 32.
    Half h of 128 values: value 32k + l (k = 0..3, l < 32) takes the low (k < 2) or high nibble of byte
    64h + 32(k % 2) + l and, as its top bits, 2-bit plane k of byte 32h + l."""
    n = _opaque(16, row)
    for b in range(dd.shape[0]):
        o, v = b * 210, b * 256
        dd[b, 0] = _f16(row, o + 208)
        for h in range(2):
            for g in range(2):
                scales = o + 192 + h * 8 + g  # sub-block 8h + 2k + g
                s0, s1 = np.int16(np.int8(row[scales])), np.int16(np.int8(row[scales + 2]))
                s2, s3 = np.int16(np.int8(row[scales + 4])), np.int16(np.int8(row[scales + 6]))
                a, c, hb = o + h * 64 + g * 16, o + h * 64 + 32 + g * 16, o + 128 + h * 32 + g * 16
                dst = v + h * 128 + g * 16
                for l in range(n):
                    x, y, z = row[a + l], row[c + l], row[hb + l]
                    wq[dst + l] = (np.int16((x & 15) | ((z & 3) << 4)) - 32) * s0
                    wq[dst + 32 + l] = (np.int16((y & 15) | (((z >> 2) & 3) << 4)) - 32) * s1
                    wq[dst + 64 + l] = (np.int16((x >> 4) | (((z >> 4) & 3) << 4)) - 32) * s2
                    wq[dst + 96 + l] = (np.int16((y >> 4) | (((z >> 6) & 3) << 4)) - 32) * s3


# IQ4_NL / IQ4_XS: the 16 non-linear levels a 4-bit code stands for.
IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int16)


@numba.njit(**JIT)
def _unpack_iq4_xs(row, wq, wf, sc, mn, dd):
    """d (fp16), scales_h (uint16: 2 high bits per sub-block of 32), scales_l (4 bytes: a low nibble per
    sub-block), 128 bytes: 16 per sub-block, value l the level of the low nibble of byte l, l + 16 of the high."""
    n = _opaque(16, row)
    for b in range(dd.shape[0]):
        o, v = b * 136, b * 256
        dd[b, 0] = _f16(row, o)
        high = np.int64(row[o + 2]) | (np.int64(row[o + 3]) << 8)
        for s in range(8):
            low = np.int64(row[o + 4 + s // 2] >> (4 * (s % 2))) & 15
            scale = np.int16((low | (((high >> (2 * s)) & 3) << 4)) - 32)
            src, dst = o + 8 + s * 16, v + s * 32
            for l in range(n):
                wq[dst + l] = IQ4_LEVELS[row[src + l] & 15] * scale
                wq[dst + n + l] = IQ4_LEVELS[row[src + l] >> 4] * scale


@numba.njit(**JIT)
def _unpack_f32(row, wq, wf, sc, mn, dd):
    wf[:] = row.view(np.float32)


@numba.njit(**JIT)
def _unpack_f16(row, wq, wf, sc, mn, dd):
    for i in range(wf.shape[0]):
        wf[i] = _f16(row, 2 * i)


@numba.njit(**JIT)
def _unpack_bf16(row, wq, wf, sc, mn, dd):
    for i in range(wf.shape[0]):
        wf[i] = np.uint32((np.int64(row[2 * i]) << 16) | (np.int64(row[2 * i + 1]) << 24)).view(np.float32)
