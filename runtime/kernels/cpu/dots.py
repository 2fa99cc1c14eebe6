"""Dot products of the CPU expert kernels: a decoded weight row (blocks.py) with an activation row rounded to 8-bit
blocks, in exact integers scaled once per block (`_int_dot`), the fused decode-and-dot of the common expert types
(one pass over a row, the same integer sums and float steps, so the same bits), and the float types' dot."""

from __future__ import annotations

from collections.abc import Callable

import numba
import numpy as np

from moeprep.quant.jit import F32, JIT
from moerun.kernels.cpu.blocks import _f16, _opaque, _u32

# --------------------------------------------------------------------------------------------- dot products


def _int_dot(block: int, n_sub: int, has_min: bool) -> Callable:
    """The integer dot product of a decoded weight row with a rounded activation row (module docstring); the
    sub-block scales are already in wq, so each block is one int32 sum. `prod` (cols,) int32 is scratch."""
    sums_per_sub = block // n_sub // 16

    @numba.njit(**JIT)
    def dot(wq, wf, sc, mn, dd, xq, xf, xd, xs, prod):
        # int32 lanes: numba types int32 * int32 as int64, the narrowing keeps twice as many values per vector.
        # 32-value blocks: all products in one flat loop first; a reduction per 32 values vectorizes poorly.
        n = _opaque(block, wq)
        if block < 256:
            for i in range(wq.shape[0]):
                prod[i] = np.int32(wq[i]) * np.int32(xq[i])
        acc = F32(0)
        for b in range(dd.shape[0]):
            t = np.int32(0)
            o = b * n
            if block < 256:
                for i in range(n):
                    t = np.int32(t + prod[o + i])
            else:
                for i in range(n):
                    t = np.int32(t + np.int32(wq[o + i]) * np.int32(xq[o + i]))
            v = dd[b, 0] * F32(t)
            if has_min:
                msum = 0
                for s in range(n_sub):
                    for j in range(sums_per_sub):
                        msum += mn[b, s] * xs[(o + s * (block // n_sub)) // 16 + j]
                v -= dd[b, 1] * F32(msum)
            acc += xd[b] * v
        return acc

    return dot


# ------------------------------------------------------------------------------------- fused decode-and-dot
# fused(row, sc, mn, xq, xd, xs) -> float32: one weight row's bytes times one rounded activation row, decoding and
# multiplying in one pass (sc, mn: the unpack's scratch). An item of one token (a decode step's experts) uses each
# row once, so writing the decoded row to wq and reading it back is most of the work there: fused is 2-3x faster.
# Each block's integer sum is the one unpack + _int_dot compute (integers: exact in any order) and its float steps
# are theirs, in their order, so both paths give the same bits.
#
# Written for LLVM's vectorizer, beyond what the decoders above do: one loop over a block's positions l whose body
# takes position l of every sub-block, so a block is one int32 vector sum (one horizontal sum per block, not one
# per sub-block); products kept within 16 bits where LLVM can see it (4-6 bit values times a scale read as an 8-bit
# value, times the int16 activation), so they compile to vpmullw + vpmaddwd/vpdpwssd on 16-bit lanes rather than
# vpmulld on 32-bit ones (an int32 scale read as is measured 1.5x slower); bits are cut from the uint8 bytes and
# widened after (widening each byte first measured 15% slower). Q4_K and Q6_K keep four running sums per block:
# in one, each product waited on the one before (a chain of 16 vpdpwssd), 1.2x slower; Q5_K keeps one (with four,
# LLVM falls back to 64-bit lanes).


@numba.njit(inline="always")
def _kquant_scale_words(row, o):
    """_kquant_scales_mins on whole words: the 12 bytes at o as (scales 0-3, mins 0-3, scales 4-7, mins 4-7), each
    a word of four 6-bit values, one per byte (value i in byte i). Four at a time: the byte-wise decode, with its
    stores and loads, took as long as a block's products."""
    w0, w1, w2 = _u32(row, o), _u32(row, o + 4), _u32(row, o + 8)
    low6, low4, top2 = 0x3F3F3F3F, 0x0F0F0F0F, 0x30303030
    return (w0 & low6, w1 & low6, (w2 & low4) | ((w0 >> 2) & top2), ((w2 >> 4) & low4) | ((w1 >> 2) & top2))


@numba.njit(inline="always")
def _six(w, i):
    """Value i of a word of _kquant_scale_words, as an int32 the compiler knows fits 6 bits."""
    return np.int32((w >> (8 * i)) & 63)


@numba.njit(inline="always")
def _kquant_scales(row, o, scratch):
    """The 8 scales of a Q4_K/Q5_K block (12 bytes at o) as int32s the compiler knows fit 6 bits, and the words of
    its mins. (Read back from `scratch`: taken straight from the words, they kept LLVM from vectorizing the block's
    loop.)"""
    s_lo, m_lo, s_hi, m_hi = _kquant_scale_words(row, o)
    for i in range(4):
        scratch[i] = _six(s_lo, i)
        scratch[4 + i] = _six(s_hi, i)
    s0, s1, s2, s3 = _u8(scratch, 0), _u8(scratch, 1), _u8(scratch, 2), _u8(scratch, 3)
    s4, s5, s6, s7 = _u8(scratch, 4), _u8(scratch, 5), _u8(scratch, 6), _u8(scratch, 7)
    return s0, s1, s2, s3, s4, s5, s6, s7, m_lo, m_hi


@numba.njit(inline="always")
def _u8(a: np.ndarray, i: int) -> np.int32:
    """a[i], known to the compiler to fit 8 bits unsigned."""
    return np.int32(np.uint8(a[i]))


@numba.njit(inline="always")
def _with_mins(t, d, dmin, m_lo, m_hi, xs, v):
    """d * t - dmin * (sum of each sub-block's min times the sum of its 32 activations), _int_dot's has_min step,
    for a Q4_K/Q5_K block at value v with its mins in words m_lo, m_hi (_kquant_scale_words)."""
    k = v // 16
    msum = (
        _six(m_lo, 0) * (xs[k] + xs[k + 1])
        + _six(m_lo, 1) * (xs[k + 2] + xs[k + 3])
        + _six(m_lo, 2) * (xs[k + 4] + xs[k + 5])
        + _six(m_lo, 3) * (xs[k + 6] + xs[k + 7])
        + _six(m_hi, 0) * (xs[k + 8] + xs[k + 9])
        + _six(m_hi, 1) * (xs[k + 10] + xs[k + 11])
        + _six(m_hi, 2) * (xs[k + 12] + xs[k + 13])
        + _six(m_hi, 3) * (xs[k + 14] + xs[k + 15])
    )
    val = d * F32(t)
    val -= dmin * F32(msum)
    return val


@numba.njit(**JIT)
def _fused_q4_k(row, sc, mn, xq, xd, xs):
    """_unpack_q4_k's layout: byte l of chunk c holds value l of sub-block 2c (low nibble) and of 2c + 1 (high)."""
    n = _opaque(32, row)
    acc = F32(0)
    for b in range(xd.shape[0]):
        o, v = b * 144, b * 256
        d, dmin = _f16(row, o), _f16(row, o + 2)
        s0, s1, s2, s3, s4, s5, s6, s7, m_lo, m_hi = _kquant_scales(row, o + 4, sc[b])
        q = o + 16
        t0 = t1 = t2 = t3 = np.int32(0)
        for l in range(n):
            c0, c1, c2, c3 = row[q + l], row[q + 32 + l], row[q + 64 + l], row[q + 96 + l]
            t0 = np.int32(
                t0 + np.int32(c0 & 15) * s0 * np.int32(xq[v + l]) + np.int32(c0 >> 4) * s1 * np.int32(xq[v + 32 + l])
            )
            t1 = np.int32(
                t1
                + np.int32(c1 & 15) * s2 * np.int32(xq[v + 64 + l])
                + np.int32(c1 >> 4) * s3 * np.int32(xq[v + 96 + l])
            )
            t2 = np.int32(
                t2
                + np.int32(c2 & 15) * s4 * np.int32(xq[v + 128 + l])
                + np.int32(c2 >> 4) * s5 * np.int32(xq[v + 160 + l])
            )
            t3 = np.int32(
                t3
                + np.int32(c3 & 15) * s6 * np.int32(xq[v + 192 + l])
                + np.int32(c3 >> 4) * s7 * np.int32(xq[v + 224 + l])
            )
        t = np.int32(np.int32(t0 + t1) + np.int32(t2 + t3))
        acc += xd[b] * _with_mins(t, d, dmin, m_lo, m_hi, xs, v)
    return acc


@numba.njit(**JIT)
def _fused_q5_k(row, sc, mn, xq, xd, xs):
    """_unpack_q5_k's layout: Q4_K's nibbles, with the fifth bit of sub-block j's value l in bit j of qh[l]."""
    n = _opaque(32, row)
    acc = F32(0)
    for b in range(xd.shape[0]):
        o, v = b * 176, b * 256
        d, dmin = _f16(row, o), _f16(row, o + 2)
        s0, s1, s2, s3, s4, s5, s6, s7, m_lo, m_hi = _kquant_scales(row, o + 4, sc[b])
        q = o + 48
        t = np.int32(0)
        for l in range(n):
            h, c0, c1, c2, c3 = row[o + 16 + l], row[q + l], row[q + 32 + l], row[q + 64 + l], row[q + 96 + l]
            t = np.int32(
                t
                + np.int32((c0 & 15) | ((h & 1) << 4)) * s0 * np.int32(xq[v + l])
                + np.int32((c0 >> 4) | ((h & 2) << 3)) * s1 * np.int32(xq[v + 32 + l])
                + np.int32((c1 & 15) | ((h & 4) << 2)) * s2 * np.int32(xq[v + 64 + l])
                + np.int32((c1 >> 4) | ((h & 8) << 1)) * s3 * np.int32(xq[v + 96 + l])
                + np.int32((c2 & 15) | (h & 16)) * s4 * np.int32(xq[v + 128 + l])
                + np.int32((c2 >> 4) | ((h & 32) >> 1)) * s5 * np.int32(xq[v + 160 + l])
                + np.int32((c3 & 15) | ((h & 64) >> 2)) * s6 * np.int32(xq[v + 192 + l])
                + np.int32((c3 >> 4) | ((h & 128) >> 3)) * s7 * np.int32(xq[v + 224 + l])
            )
        acc += xd[b] * _with_mins(t, d, dmin, m_lo, m_hi, xs, v)
    return acc


@numba.njit(inline="always")
def _q6_k_four(row, a, c, z, s, xq, x):
    """Value l of Q6_K sub-blocks k, k + 2, k + 4, k + 6 of a half (_unpack_q6_k's layout) times its activations:
    a, c the low-nibble bytes, z the 2-bit planes, s the first one's scale byte, x its value's index."""
    s0, s1 = np.int32(np.int8(row[s])), np.int32(np.int8(row[s + 2]))
    s2, s3 = np.int32(np.int8(row[s + 4])), np.int32(np.int8(row[s + 6]))
    return (
        (np.int32((a & 15) | ((z & 3) << 4)) - 32) * s0 * np.int32(xq[x])
        + (np.int32((c & 15) | (((z >> 2) & 3) << 4)) - 32) * s1 * np.int32(xq[x + 32])
        + (np.int32((a >> 4) | (((z >> 4) & 3) << 4)) - 32) * s2 * np.int32(xq[x + 64])
        + (np.int32((c >> 4) | ((z >> 6) << 4)) - 32) * s3 * np.int32(xq[x + 96])
    )


@numba.njit(**JIT)
def _fused_q6_k(row, sc, mn, xq, xd, xs):
    n = _opaque(16, row)
    acc = F32(0)
    for b in range(xd.shape[0]):
        o, v = b * 210, b * 256
        d = _f16(row, o + 208)
        t0 = t1 = t2 = t3 = np.int32(0)
        for l in range(n):  # (half, g) = (0, 0), (0, 1), (1, 0), (1, 1): value 128 half + 16 g + l and the 3 above
            t0 = np.int32(t0 + _q6_k_four(row, row[o + l], row[o + 32 + l], row[o + 128 + l], o + 192, xq, v + l))
            t1 = np.int32(
                t1 + _q6_k_four(row, row[o + 16 + l], row[o + 48 + l], row[o + 144 + l], o + 193, xq, v + 16 + l)
            )
            t2 = np.int32(
                t2 + _q6_k_four(row, row[o + 64 + l], row[o + 96 + l], row[o + 160 + l], o + 200, xq, v + 128 + l)
            )
            t3 = np.int32(
                t3 + _q6_k_four(row, row[o + 80 + l], row[o + 112 + l], row[o + 176 + l], o + 201, xq, v + 144 + l)
            )
        t = np.int32(np.int32(t0 + t1) + np.int32(t2 + t3))
        acc += xd[b] * (d * F32(t))
    return acc


@numba.njit(**JIT)
def _fused_q4_0(row, sc, mn, xq, xd, xs):
    n = _opaque(16, row)
    acc = F32(0)
    for b in range(xd.shape[0]):
        o, v = b * 18, b * 32
        d = _f16(row, o)
        t = np.int32(0)
        for l in range(n):
            c = row[o + 2 + l]
            t = np.int32(
                t
                + np.int32(np.int16(c & 15) - 8) * np.int32(xq[v + l])
                + np.int32(np.int16(c >> 4) - 8) * np.int32(xq[v + 16 + l])
            )
        acc += xd[b] * (d * F32(t))
    return acc


@numba.njit(**JIT)
def _fused_q8_0(row, sc, mn, xq, xd, xs):
    n = _opaque(32, row)
    acc = F32(0)
    for b in range(xd.shape[0]):
        o, v = b * 34, b * 32
        d = _f16(row, o)
        t = np.int32(0)
        for l in range(n):
            t = np.int32(t + np.int32(np.int8(row[o + 2 + l])) * np.int32(xq[v + l]))
        acc += xd[b] * (d * F32(t))
    return acc


@numba.njit(**JIT)
def _float_dot(wq, wf, sc, mn, dd, xq, xf, xd, xs, prod):
    """float32 dot product in eight running sums (independent, so they run side by side without the
    reassociation numba's fastmath=False forbids), then their sum."""
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = F32(0)
    n = wf.shape[0]
    for i in range(0, n - n % 8, 8):
        a0 += wf[i] * xf[i]
        a1 += wf[i + 1] * xf[i + 1]
        a2 += wf[i + 2] * xf[i + 2]
        a3 += wf[i + 3] * xf[i + 3]
        a4 += wf[i + 4] * xf[i + 4]
        a5 += wf[i + 5] * xf[i + 5]
        a6 += wf[i + 6] * xf[i + 6]
        a7 += wf[i + 7] * xf[i + 7]
    for i in range(n - n % 8, n):
        a0 += wf[i] * xf[i]
    return ((a0 + a4) + (a1 + a5)) + ((a2 + a6) + (a3 + a7))
