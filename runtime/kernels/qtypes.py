"""Triton decoders of GGUF blocks, one per type, shared by the GEMV and GEMM kernels (gemv.py, gemm.py).

A decoder reads one GGUF block per (row, block) pair of a tile and returns one *part* of it: P consecutive values
(columns part*P .. part*P + P - 1 of the block) that share a scale, so that the scale is loaded once per part rather
than once per value. The kernels loop over the V // P parts of a block at compile time (`tl.static_range`).

    decode(blk, lane, PART) -> [..., P] float32
    blk: [..., 1] uint8 pointers to the first byte of a block (R rows x B blocks of a tile), lane: tl.arange(0, P)
    shaped [1, ..., 1, P], PART: constexpr. Any rank: the GEMV's tiles are 4-D, the GEMM's 3-D.

Layouts are ggml's (ggml-common.h), read the way kernels/dequant.py (the torch reference these are tested against)
reads them; each docstring names only what a part needs. Small non-negative integers become float32 through the
exponent trick (`_small_f32`) instead of an int-to-float conversion, whose throughput on NVIDIA GPUs is a quarter of
an add's and would bound a matrix-vector product. Scale products are the reference's (d * sc first, then * q), so
the values equal dequant.py's, up to a fused multiply-add rounding `d*sc * q - dmin*m` once instead of twice.

F16/BF16/F32 have no blocks (gguf's block size is 1); the table gives them 32-value blocks, so their rows must hold
a multiple of 32 values, as every weight matrix of the models we run does.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl
from gguf import GGMLQuantizationType as Q


@triton.jit
def _f16(p):
    """The fp16 field at p (an even offset in every block layout) as float32."""
    return tl.load(p.to(tl.pointer_type(tl.float16))).to(tl.float32)


# Whether Triton's interpreter runs the kernels (TRITON_INTERPRET=1, the CPU tests: it decorates with objects of its
# own, runs no PTX and has quirks of its own, said where the kernels work around them); as Triton code reads it.
INTERPRETED = not isinstance(_f16, triton.runtime.JITFunction)
_INTERPRETED: tl.constexpr = tl.constexpr(INTERPRETED)


@triton.jit
def _small_f32(u):
    """Integers 0 <= u < 2**23 -> float32, exactly: 2**23 + u has u as its significand bits, then subtract 2**23."""
    return (u | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _small_f32_less(u, OFFSET: tl.constexpr):
    """u - OFFSET as float32 for integers 0 <= u, OFFSET < 2**23: _small_f32 with the offset folded into its
    subtraction (2**23 + OFFSET is exact too), one float op instead of two."""
    return (u | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + OFFSET)


@triton.jit
def _bytes(p, lane):
    """The bytes at p + lane, as int32: a part's run of quant bytes."""
    return tl.load(p + lane).to(tl.int32)


@triton.jit
def _q8_0(blk, lane, PART: tl.constexpr):
    """d (fp16), 32 int8 quants; one part of 32. (u ^ 0x80) is q + 128 for the byte u of an int8 q."""
    return _small_f32_less(_bytes(blk + 2, lane) ^ 0x80, 128) * _f16(blk)


@triton.jit
def _q4_0(blk, lane, PART: tl.constexpr):
    """d (fp16), 16 bytes: the low nibbles are values 0-15 (part 0), the high ones 16-31 (part 1); d * (q - 8)."""
    return _small_f32_less((_bytes(blk + 2, lane) >> (4 * PART)) & 15, 8) * _f16(blk)


@triton.jit
def _q4_1(blk, lane, PART: tl.constexpr):
    """d, m (fp16), 16 bytes of nibbles as in Q4_0; d * q + m."""
    return _small_f32((_bytes(blk + 4, lane) >> (4 * PART)) & 15) * _f16(blk) + _f16(blk + 2)


@triton.jit
def _nibbles_5bit(qs, qh, lane, PART: tl.constexpr):
    """Q5_0/Q5_1 quants of part PART (16 values): nibbles at qs as Q4_0's, bit j of the uint32 at qh is value j's
    fifth bit."""
    j = PART * 16 + lane
    fifth = (tl.load(qh + j // 8).to(tl.int32) >> (j % 8)) & 1
    return _small_f32(((_bytes(qs, lane) >> (4 * PART)) & 15) | (fifth << 4))


@triton.jit
def _q5_0(blk, lane, PART: tl.constexpr):
    """d (fp16), qh (4 bytes), 16 bytes of nibbles; d * (q - 16)."""
    return (_nibbles_5bit(blk + 6, blk + 2, lane, PART) - 16.0) * _f16(blk)


@triton.jit
def _q5_1(blk, lane, PART: tl.constexpr):
    """d, m (fp16), qh (4 bytes), 16 bytes of nibbles; d * q + m."""
    return _nibbles_5bit(blk + 8, blk + 4, lane, PART) * _f16(blk) + _f16(blk + 2)


@triton.jit
def _mxfp4(blk, lane, PART: tl.constexpr):
    """e (E8M0), 16 bytes of E2M1 nibbles ordered as Q4_0's; e2m1 * 2**(e - 127).

    Twice the E2M1 value is an integer (0, 1, 2, 3, 4, 6, 8, 12): exponent 0 is the mantissa itself, exponent x > 0
    (2 + mantissa) << (x - 1). It multiplies half the scale, 2**(e - 128), whose float32 bits are built directly
    (e < 2 are subnormals).
    """
    code = (_bytes(blk + 1, lane) >> (4 * PART)) & 15
    exp, man = (code >> 1) & 3, code & 1
    doubled = _small_f32(tl.where(exp == 0, man, (2 + man) << tl.maximum(exp - 1, 0)))
    e = tl.load(blk).to(tl.int32)
    half = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23).to(tl.float32, bitcast=True)
    return tl.where(code >= 8, -doubled, doubled) * half


@triton.jit
def _k_scale_min(blk, PART: tl.constexpr):
    """Q4_K/Q5_K sub-block PART's scale d*sc and min dmin*m, from d, dmin (fp16) and 12 bytes of 6-bit fields at 4.

    Bytes 4-7 hold scales 0-3, bytes 8-11 mins 0-3 (low 6 bits); sub-blocks 4-7 take their low 4 bits from a nibble
    of bytes 12-15 (scale low, min high) and their top 2 bits from the spare top bits of bytes 4-11.
    """
    if PART < 4:
        sc = tl.load(blk + 4 + PART).to(tl.int32) & 63
        m = tl.load(blk + 8 + PART).to(tl.int32) & 63
    else:
        packed = tl.load(blk + 8 + PART).to(tl.int32)
        sc = (packed & 15) | ((tl.load(blk + PART).to(tl.int32) >> 6) << 4)
        m = (packed >> 4) | ((tl.load(blk + 4 + PART).to(tl.int32) >> 6) << 4)
    return _f16(blk) * sc.to(tl.float32), _f16(blk + 2) * m.to(tl.float32)


@triton.jit
def _q4_k_q5_k(blk, q, PART: tl.constexpr):
    """Q4_K/Q5_K value d*sc * q - dmin*m of sub-block PART."""
    scale, low = _k_scale_min(blk, PART)
    return scale * _small_f32(q) - low


@triton.jit
def _q4_k(blk, lane, PART: tl.constexpr):
    """Parts are the 8 sub-blocks of 32; sub-blocks 2c and 2c+1 are the low and high nibbles of 32 bytes at 16+32c."""
    return _q4_k_q5_k(blk, (_bytes(blk + 16 + (PART // 2) * 32, lane) >> (4 * (PART % 2))) & 15, PART)


@triton.jit
def _q5_k_quants(blk, lane, PART: tl.constexpr):
    """Q4_K's parts with 32 bytes qh at 16 and the nibbles at 48: bit PART of qh[l] is sub-block PART's fifth bit of
    value l."""
    low = (_bytes(blk + 48 + (PART // 2) * 32, lane) >> (4 * (PART % 2))) & 15
    return low | (((_bytes(blk + 16, lane) >> PART) & 1) << 4)


@triton.jit
def _q5_k(blk, lane, PART: tl.constexpr):
    return _q4_k_q5_k(blk, _q5_k_quants(blk, lane, PART), PART)


@triton.jit
def _q6_k(blk, lane, PART: tl.constexpr):
    """128 bytes of low nibbles, 64 bytes of 2-bit high parts, 16 int8 scales at 192, d (fp16) at 208; 16 parts of 16.

    Value n*128 + f*32 + l (half n, field f, l < 32): low nibble of byte n*64 + (f%2)*32 + l (its high nibble when
    f >= 2), high bits (byte 128 + n*32 + l) >> 2f; d * sc * (q - 32).
    """
    n, f, l0 = PART // 8, (PART % 8) // 2, (PART % 2) * 16
    low = (_bytes(blk + n * 64 + (f % 2) * 32 + l0, lane) >> ((f // 2) * 4)) & 15
    high = (_bytes(blk + 128 + n * 32 + l0, lane) >> (2 * f)) & 3
    sc = tl.load(blk + 192 + PART).to(tl.int8, bitcast=True).to(tl.float32)
    return (_f16(blk + 208) * sc) * _small_f32_less(low | (high << 4), 32)


@triton.jit
def _q2_k(blk, lane, PART: tl.constexpr):
    """16 scale bytes (low nibble scale, high nibble min), 64 bytes of 2-bit quants, d, dmin (fp16) at 80, 82.

    Parts are the 16 sub-blocks of 16: sub-block j is 2-bit plane (j%8)//2 of bytes 16 + (j//8)*32 + (j%2)*16 + l.
    """
    q = (_bytes(blk + 16 + (PART // 8) * 32 + (PART % 2) * 16, lane) >> (2 * ((PART % 8) // 2))) & 3
    sm = tl.load(blk + PART).to(tl.int32)
    return (_f16(blk + 80) * (sm & 15).to(tl.float32)) * _small_f32(q) - _f16(blk + 82) * (sm >> 4).to(tl.float32)


@triton.jit
def _q3_k(blk, lane, PART: tl.constexpr):
    """32 bytes hmask, 64 bytes of 2-bit quants (as Q2_K's), 12 bytes of 6-bit scales at 96, d (fp16) at 108.

    Scale PART: low 4 bits from nibble PART of bytes 96-103 (all low nibbles first), top 2 bits from field PART // 4
    of byte 104 + PART % 4, minus 32. Quant: 2 low bits, minus 4 where bit PART // 2 of hmask[l] is clear.
    """
    l0 = (PART % 2) * 16
    q = (_bytes(blk + 32 + (PART // 8) * 32 + l0, lane) >> (2 * ((PART % 8) // 2))) & 3
    h = (_bytes(blk + l0, lane) >> (PART // 2)) & 1
    low = (tl.load(blk + 96 + PART % 8).to(tl.int32) >> (4 * (PART // 8))) & 15
    high = (tl.load(blk + 104 + PART % 4).to(tl.int32) >> (2 * (PART // 4))) & 3
    ds = _f16(blk + 108) * ((low | (high << 4)) - 32).to(tl.float32)
    return ds * _small_f32_less(q + 4 * h, 4)


@triton.jit
def _iq4_xs(blk, lane, PART: tl.constexpr):
    """d (fp16), scales_h (uint16), scales_l (4 bytes), 128 bytes of 4-bit codes; 16 parts of 16.

    Sub-block j = PART // 2 of 32: 6-bit scale ls = nibble j of scales_l | (2-bit field j of scales_h) << 4; values
    d * (ls - 32) * kvalues[code] (ggml's kvalues_iq4nl, here a select tree on the code's bits), codes in 16 bytes
    at 8 + 16j as Q4_0's (low nibbles first).
    """
    j = PART // 2
    ls = ((tl.load(blk + 4 + j // 2).to(tl.int32) >> (4 * (j % 2))) & 15) | (
        ((tl.load(blk + 2 + j // 4).to(tl.int32) >> (2 * (j % 4))) & 3) << 4
    )
    c = (_bytes(blk + 8 + 16 * j, lane) >> (4 * (PART % 2))) & 15
    b0, b1, b2 = (c & 1) != 0, (c & 2) != 0, (c & 4) != 0
    negative = tl.where(
        b2,
        tl.where(b1, tl.where(b0, -10, -22), tl.where(b0, -35, -49)),
        tl.where(b1, tl.where(b0, -65, -83), tl.where(b0, -104, -127)),
    )
    positive = tl.where(
        b2,
        tl.where(b1, tl.where(b0, 113, 89), tl.where(b0, 69, 53)),
        tl.where(b1, tl.where(b0, 38, 25), tl.where(b0, 13, 1)),
    )
    value = tl.where(c >= 8, positive, negative).to(tl.float32)
    return (_f16(blk) * (ls - 32).to(tl.float32)) * value


# Integer forms for the matrix-vector kernel's 8-bit route (gemv.py: activations rounded to int8 per 32 values,
# dot products of four 8-bit pairs per instruction). The route walks a row in *units* of BlockType.dot8_values values,
# one unit per lane of a tile: a 32-value block, or a quarter of a Q4_K/Q5_K block (two sub-blocks: the 32 bytes of
# quants that hold them), so that the lanes of a warp read neighbouring pieces of a few blocks rather than one piece
# of each of 32 blocks. A dot8 decoder returns quad PART (16 values, four int32 words) of unit u as packed quants
# and the affine map that turns them into values:
#
#     dot8(row, u, word, PART) -> (q, scale, offset): q [..., 4] int32, each four signed 8-bit quants (values
#     16*PART + 4*word .. +3 of the unit, lowest byte first); scale, offset float32: value = scale * q + offset.
#
# u and row (the row's first byte) come shaped [..., 1], word [..., 4]: q comes out [..., 4], scale and offset
# [..., 1], one per quad (the kernel sums a quad's four word products in integers first).
# The quants stay packed: nibbles come out four at a time with a shift and a mask, never one value per instruction.


@triton.jit
def _words(p, word):
    """The little-endian int32 words p[word] of a 16-byte aligned p (blocks of 144 or 176 bytes): one wide load."""
    return tl.load(p.to(tl.pointer_type(tl.int32)) + word)


@triton.jit
def _words2(p, word):
    """The same from a 2-byte aligned p (blocks of 18 or 34 bytes start at even bytes), from aligned 32-bit loads:
    where p is 2 bytes past a word, each word is the top half of one aligned word and the bottom half of the next
    (the loads of the next words repeat the first ones' addresses but one). An aligned p reads no next word: the
    word past a bank's last block may lie past the memory it is in."""
    off = (p.to(tl.int64) & 2).to(tl.int32)  # 0 or 2 bytes past an aligned word
    at = (p - off).to(tl.pointer_type(tl.int32)) + word
    low = tl.load(at)
    high = tl.load(at + 1, mask=off != 0, other=0)
    return tl.where(off == 0, low, ((low >> 16) & 0xFFFF) | (high << 16))


@triton.jit
def _k_unit_scale_min(blk, j):
    """_k_scale_min for a sub-block j given as a tensor (blk and j [..., 1]): the 16-byte header (d, dmin and the
    12 bytes of 6-bit fields) in one load, its fields taken apart in registers -> [..., 1] float32 each."""
    h0, h1, h2, h3 = _split4(_words(blk, tl.arange(0, 4)))
    h0, h1 = tl.reshape(h0, h0.shape + [1]), tl.reshape(h1, h1.shape + [1])  # [..., 1] again
    h2, h3 = tl.reshape(h2, h2.shape + [1]), tl.reshape(h3, h3.shape + [1])
    shift = (j % 4) * 8
    a = (tl.where(j < 4, h0, h1) >> shift) & 0xFF  # byte j
    b = (tl.where(j < 4, h1, h2) >> shift) & 0xFF  # byte 4 + j
    c = (tl.where(j < 4, h2, h3) >> shift) & 0xFF  # byte 8 + j
    sc = tl.where(j < 4, b & 63, (c & 15) | ((a >> 6) << 4))
    m = tl.where(j < 4, c & 63, (c >> 4) | ((b >> 6) << 4))
    d = (h0 & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    dmin = ((h0 >> 16) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return d * sc.to(tl.float32), dmin * m.to(tl.float32)


@triton.jit
def _split4(h):
    """[..., 4] -> its four [...] slices (one thread's words: register renames)."""
    a, b = tl.split(tl.reshape(h, h.shape[:-1] + [2, 2]))  # words 0, 2 and words 1, 3
    h0, h2 = tl.split(a)
    h1, h3 = tl.split(b)
    return h0, h1, h2, h3


@triton.jit
def _q4_k_i8(row, u, word, PART: tl.constexpr):
    """Unit u = sub-blocks 2p and 2p + 1 (p = u % 4) of block u // 4, the low and high nibbles of its 32 bytes of
    quants at 16 + 32p: quad PART is half PART % 2 of sub-block 2p + PART // 2; value = d*sc * q - dmin*m."""
    blk = row + (u // 4) * 144
    p = u % 4
    scale, low = _k_unit_scale_min(blk, 2 * p + PART // 2)
    q = (_words(blk + 16 + p * 32 + (PART % 2) * 16, word) >> (4 * (PART // 2))) & 0x0F0F0F0F
    return q, scale, -low


@triton.jit
def _q5_k_i8(row, u, word, PART: tl.constexpr):
    """Q4_K's units with the fifth bits (quants at 48): bit j of qh byte l (the 32 bytes at 16) is value l's of
    sub-block j, moved to bit 4."""
    blk = row + (u // 4) * 176
    p = u % 4
    j = 2 * p + PART // 2
    scale, low = _k_unit_scale_min(blk, j)
    nibbles = (_words(blk + 48 + p * 32 + (PART % 2) * 16, word) >> (4 * (PART // 2))) & 0x0F0F0F0F
    return nibbles | (((_words(blk + 16 + (PART % 2) * 16, word) >> j) & 0x01010101) << 4), scale, -low


@triton.jit
def _q8_0_i8(row, u, word, PART: tl.constexpr):
    """Half PART of block u: q = the int8 quants, value = d * q."""
    blk = row + u * 34
    d = _f16(blk)
    return _words2(blk + 2 + 16 * PART, word), d, 0.0 * d


@triton.jit
def _q4_0_i8(row, u, word, PART: tl.constexpr):
    """Half PART of block u: the low nibbles of the 16 bytes are values 0-15, the high ones 16-31;
    value = d * (q - 8)."""
    blk = row + u * 18
    d = _f16(blk)
    return (_words2(blk + 2, word) >> (4 * PART)) & 0x0F0F0F0F, d, -8.0 * d


# Integer forms for the 8-bit GEMM (gemm._gemm_i8_kernel: int8 tiles multiplied on tensor cores, exact in
# int32): tl.dot takes one int8 per element, not packed words, so these give part PART of a block as 32 quants that
# share one scale (values 32*PART .. 32*PART + 31 of the block: a K-quant's sub-block, a whole Q8_0/Q4_0 block):
#
#     gemm8(blk, lane, PART) -> (q, scale, offset): q [BN, 32] integers in -128..127 (int32 or int8), scale and
#     offset [BN, 1] float32: value = scale * q + offset. blk [BN, 1] (a GEMM tile's rows), lane tl.arange(0, 32)
#     shaped [1, 32].


@triton.jit
def _nibbles8(b, HIGH: tl.constexpr):
    """The low (HIGH 0) or high (1) nibbles of the uint8 bytes b, as int8: four bytes per instruction (a thread
    holds its bytes four to a register), where int8 arithmetic would take one instruction per byte."""
    if _INTERPRETED:  # the interpreter runs no PTX
        return ((b >> (4 * HIGH)) & 15).to(tl.int8)
    if HIGH:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t; shr.b32 t, $1, 4; and.b32 $0, t, 0x0F0F0F0F; }",
            "=r,r",
            [b],
            dtype=tl.int8,
            is_pure=True,
            pack=4,
        )
    return tl.inline_asm_elementwise("and.b32 $0, $1, 0x0F0F0F0F;", "=r,r", [b], dtype=tl.int8, is_pure=True, pack=4)


@triton.jit
def _q4_k_gemm8(blk, lane, PART: tl.constexpr):
    scale, low = _k_scale_min(blk, PART)
    return _nibbles8(tl.load(blk + 16 + (PART // 2) * 32 + lane), PART % 2), scale, -low


@triton.jit
def _q5_k_gemm8(blk, lane, PART: tl.constexpr):
    scale, low = _k_scale_min(blk, PART)
    return _q5_k_quants(blk, lane, PART), scale, -low


@triton.jit
def _q8_0_gemm8(blk, lane, PART: tl.constexpr):
    d = _f16(blk)
    return tl.load((blk + 2 + lane).to(tl.pointer_type(tl.int8))), d, 0.0 * d


@triton.jit
def _q4_0_gemm8(blk, lane, PART: tl.constexpr):
    """Values 0-15 are the low nibbles of the 16 bytes, 16-31 the high ones, minus 8: offset 0."""
    b = tl.load(blk + 2 + tl.arange(0, 16)[None, :])  # [..., 16]
    low, high = _nibbles8(b, 0) - 8, _nibbles8(b, 1) - 8
    q = tl.reshape(tl.permute(tl.join(low, high), (0, 2, 1)), (b.shape[0], 32))
    d = _f16(blk)
    return q, d, 0.0 * d


@triton.jit
def _f16_values(blk, lane, PART: tl.constexpr):
    return tl.load(blk.to(tl.pointer_type(tl.float16)) + lane).to(tl.float32)


@triton.jit
def _bf16_values(blk, lane, PART: tl.constexpr):
    return tl.load(blk.to(tl.pointer_type(tl.bfloat16)) + lane).to(tl.float32)


@triton.jit
def _f32_values(blk, lane, PART: tl.constexpr):
    return tl.load(blk.to(tl.pointer_type(tl.float32)) + lane)


@dataclass(frozen=True)
class BlockType:
    decode: triton.JITFunction  # (blk [..., 1], lane [..., P], PART) -> [..., P] float32
    values: int  # V: values per block
    nbytes: int  # S: bytes per block
    part: int  # P: values per part (a power of two, at least 16 for tl.dot)
    dot8: triton.JITFunction | None = None  # the 8-bit route's decoder (quads of 16 values), where the type has one
    dot8_values: int = 32  # values of a unit of the 8-bit route (a lane's share of a tile)
    gemm8: triton.JITFunction | None = None  # the 8-bit GEMM's decoder (parts of 32 values), where the type has one
    gemm8_mins: bool = False  # whether its offsets are ever nonzero (the K-quants' mins)


# The common expert and attention types of MoE GGUFs first.
BLOCK_TYPES: dict[Q, BlockType] = {
    Q.Q4_K: BlockType(_q4_k, 256, 144, 32, _q4_k_i8, 64, _q4_k_gemm8, True),
    Q.Q5_K: BlockType(_q5_k, 256, 176, 32, _q5_k_i8, 64, _q5_k_gemm8, True),
    Q.Q6_K: BlockType(_q6_k, 256, 210, 16),  # its 8-bit form lost: 872 GB/s against 1156
    Q.Q8_0: BlockType(_q8_0, 32, 34, 32, _q8_0_i8, gemm8=_q8_0_gemm8),
    Q.Q4_0: BlockType(_q4_0, 32, 18, 16, _q4_0_i8, gemm8=_q4_0_gemm8),
    Q.MXFP4: BlockType(_mxfp4, 32, 17, 16),  # gpt-oss experts
    Q.IQ4_XS: BlockType(_iq4_xs, 256, 136, 16),
    Q.Q2_K: BlockType(_q2_k, 256, 84, 16),
    Q.Q3_K: BlockType(_q3_k, 256, 110, 16),
    Q.Q5_0: BlockType(_q5_0, 32, 22, 16),
    Q.Q4_1: BlockType(_q4_1, 32, 20, 16),
    Q.Q5_1: BlockType(_q5_1, 32, 24, 16),
    Q.F16: BlockType(_f16_values, 32, 64, 32),
    Q.BF16: BlockType(_bf16_values, 32, 64, 32),
    Q.F32: BlockType(_f32_values, 32, 128, 32),
}
