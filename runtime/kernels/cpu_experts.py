"""Routed experts on the CPU, computed straight from their GGUF bytes in host memory (numba, multi-threaded, no GIL).

`moe_rows` runs gate, up and down of the experts the router chose for each token, reading each expert's rows from the
(E, rows, row_bytes) uint8 view of the memory-mapped GGUF. It does what llama.cpp's CPU backend does, in our own
code: each activation row is rounded once to 8-bit blocks (Q8_K, 256 values, for the K-quants and IQ4_XS; Q8_0, 32
values, for the 32-value types; moerun.rounding holds both roundings), then every weight block meets its activation
block in an integer dot product, scaled once per block:

    block value  = d * sc[s] * q - dmin * m[s]          (sub-block s; sc and m small integers, d and dmin floats)
    block . x    = xd * (d * sum_i (sc q)_i xq_i - dmin * sum_s m[s] * sum(xq)_s)

where x = xd * xq is the rounded activation block. The integer parts are exact; the float parts differ from a float64
dequantize-then-matmul only by float32 rounding (tests/runtime/test_cpu_experts.py). F16, BF16 and F32 experts take
a float32 dot product on the input rounded to their type instead.

Each type is a `Format`: its `unpack` decodes one weight row into int16 values `wq` that already carry their
sub-block's integer scale (so a block is one integer sum: `vpmaddwd` work), integer mins `mn` and per-block float
scales `dd` (d, dmin) (float types: float32 values `wf`), and its `dot` is the product above; `rounding` names the
activation rounding. The types of the common expert GGUFs (Q4_K, Q5_K, Q6_K, Q4_0, Q8_0) also have a `fused` dot that
decodes and multiplies a row in one pass, with the same integer sums and float steps (so the same bits): what an item
of one token (a decode step) takes, where a decoded row would be used once (2-3x faster per core than unpack + dot). Work is split into items (one expert, the tokens that chose it, a range of rows), run by numba's
`prange`; every output element is computed by one item with the same operations whatever the split, so any thread
count gives the same bits. A row is decoded once for all the tokens of its item.

A call is one compiled function, `_moe`, because the expert cache makes one call per layer per decode step for a
token's few missed experts, where a fixed cost weighs as much as the bytes: it plans (the pairs grouped by expert,
the items), rounds the inputs, runs one parallel loop whose item computes its gate rows, its up rows and then h =
act(g, u) on them, rounds each pair's h, runs a second parallel loop over the down items, and sums each token's
pairs into `out`. The roundings and the sum run on the calling thread below PARALLEL_MIN_ROWS rows (tokens, or
pairs for h), so a call for a token's few missed experts starts two parallel regions. (It was five numba launches
with Python between them, argument checks, array allocations and copies, and two numba.set_num_threads calls: about
20 us of Python and three more region starts per call on a 2-core VM, docs/BENCHMARKS.md.) What stays in Python is
what numba cannot do: ExpertBytes prepares each tensor's read-only views and format code once, and numba's thread
count is changed only when the call asks for another one. Rounding h inside each down item instead (no region
between the two loops) measured 5% slower on a 64-token call, so h is rounded in a step of its own.

Shapes: T tokens, K experts per token, P = the (token, k) pairs with an expert (ids >= 0), E experts, D hidden
size, I expert hidden size; a row has `cols` values in `nb` blocks of `block` values, each of `n_sub` sub-blocks.
"""

from __future__ import annotations

import platform
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import numba
import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from llvmlite import ir
from llvmlite import binding as llvm
from numba import literal_unroll
from numba.core import types
from numba.extending import intrinsic

from moeprep.errors import MoeprepError
from moeprep.quant.jit import F32, JIT
from moeprep.quant.scalars import fp16_bits, fp16_value
from moerun.hooks import Hooks
from moerun.kernels import ggml_cpu
from moerun.layers import GGUFExperts, Linear
from moerun.rounding import input_rounding, q8_0_blocks, q8_k_blocks
from moerun.weights import Weights

# numba's workqueue threading layer (its fallback where neither TBB nor OpenMP is there) aborts the process on two
# launches at once, so launches hold _LAUNCH. (The OpenMP layer it picks otherwise starts a parallel region in about
# 5 us against workqueue's 80-100 us, which made a 4-layer decode step 1.8x slower, docs/BENCHMARKS.md.)
_LAUNCH = threading.Lock()

# Fewest weight rows per work item: below this the per-item setup outweighs the rows.
MIN_ROWS_PER_ITEM = 16
# Work items per thread for each tensor, so that uneven items (experts chosen by more tokens) still balance.
ITEMS_PER_THREAD = 4


@dataclass(frozen=True)
class ExpertBytes:
    """One stacked expert tensor as GGUF bytes in host memory (E, rows, row_bytes), and its optional bias (E, rows).
    What the kernels take is prepared once here: the format's code (-1: no kernel for the type) and C-contiguous
    read-only views of the bytes and the bias (memory-mapped and in-memory arrays then share one numba type, hence
    one compiled kernel)."""

    data: np.ndarray
    qtype: Q
    rows: int
    cols: int
    bias: np.ndarray | None = None
    code: int = field(init=False, repr=False, compare=False)
    kernel_data: np.ndarray = field(init=False, repr=False, compare=False)
    kernel_bias: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        code = _FORMAT_CODES.get(self.qtype, -1)
        if code >= 0:
            block, type_size = GGML_QUANT_SIZES[self.qtype]
            assert self.cols % block == 0 and self.data.shape[1:] == (self.rows, self.cols // block * type_size), \
                (self.data.shape, self.qtype)
        object.__setattr__(self, "code", code)
        object.__setattr__(self, "kernel_data", _read_only(self.data, np.uint8))
        object.__setattr__(self, "kernel_bias", _NO_BIAS if self.bias is None else _read_only(self.bias, F32))


def _read_only(a: np.ndarray, dtype: type) -> np.ndarray:
    """A C-contiguous read-only view (a copy only if a is not C-contiguous of dtype)."""
    view = np.ascontiguousarray(a, dtype).view(np.ndarray)
    view.flags.writeable = False
    return view


_NO_BIAS = _read_only(np.zeros((0, 0), F32), F32)


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
    msum = (_six(m_lo, 0) * (xs[k] + xs[k + 1]) + _six(m_lo, 1) * (xs[k + 2] + xs[k + 3])
            + _six(m_lo, 2) * (xs[k + 4] + xs[k + 5]) + _six(m_lo, 3) * (xs[k + 6] + xs[k + 7])
            + _six(m_hi, 0) * (xs[k + 8] + xs[k + 9]) + _six(m_hi, 1) * (xs[k + 10] + xs[k + 11])
            + _six(m_hi, 2) * (xs[k + 12] + xs[k + 13]) + _six(m_hi, 3) * (xs[k + 14] + xs[k + 15]))
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
            t0 = np.int32(t0 + np.int32(c0 & 15) * s0 * np.int32(xq[v + l])
                          + np.int32(c0 >> 4) * s1 * np.int32(xq[v + 32 + l]))
            t1 = np.int32(t1 + np.int32(c1 & 15) * s2 * np.int32(xq[v + 64 + l])
                          + np.int32(c1 >> 4) * s3 * np.int32(xq[v + 96 + l]))
            t2 = np.int32(t2 + np.int32(c2 & 15) * s4 * np.int32(xq[v + 128 + l])
                          + np.int32(c2 >> 4) * s5 * np.int32(xq[v + 160 + l]))
            t3 = np.int32(t3 + np.int32(c3 & 15) * s6 * np.int32(xq[v + 192 + l])
                          + np.int32(c3 >> 4) * s7 * np.int32(xq[v + 224 + l]))
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
            t = np.int32(t + np.int32((c0 & 15) | ((h & 1) << 4)) * s0 * np.int32(xq[v + l])
                         + np.int32((c0 >> 4) | ((h & 2) << 3)) * s1 * np.int32(xq[v + 32 + l])
                         + np.int32((c1 & 15) | ((h & 4) << 2)) * s2 * np.int32(xq[v + 64 + l])
                         + np.int32((c1 >> 4) | ((h & 8) << 1)) * s3 * np.int32(xq[v + 96 + l])
                         + np.int32((c2 & 15) | (h & 16)) * s4 * np.int32(xq[v + 128 + l])
                         + np.int32((c2 >> 4) | ((h & 32) >> 1)) * s5 * np.int32(xq[v + 160 + l])
                         + np.int32((c3 & 15) | ((h & 64) >> 2)) * s6 * np.int32(xq[v + 192 + l])
                         + np.int32((c3 >> 4) | ((h & 128) >> 3)) * s7 * np.int32(xq[v + 224 + l]))
        acc += xd[b] * _with_mins(t, d, dmin, m_lo, m_hi, xs, v)
    return acc


@numba.njit(inline="always")
def _q6_k_four(row, a, c, z, s, xq, x):
    """Value l of Q6_K sub-blocks k, k + 2, k + 4, k + 6 of a half (_unpack_q6_k's layout) times its activations:
    a, c the low-nibble bytes, z the 2-bit planes, s the first one's scale byte, x its value's index."""
    s0, s1 = np.int32(np.int8(row[s])), np.int32(np.int8(row[s + 2]))
    s2, s3 = np.int32(np.int8(row[s + 4])), np.int32(np.int8(row[s + 6]))
    return ((np.int32((a & 15) | ((z & 3) << 4)) - 32) * s0 * np.int32(xq[x])
            + (np.int32((c & 15) | (((z >> 2) & 3) << 4)) - 32) * s1 * np.int32(xq[x + 32])
            + (np.int32((a >> 4) | (((z >> 4) & 3) << 4)) - 32) * s2 * np.int32(xq[x + 64])
            + (np.int32((c >> 4) | ((z >> 6) << 4)) - 32) * s3 * np.int32(xq[x + 96]))


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
            t1 = np.int32(t1 + _q6_k_four(row, row[o + 16 + l], row[o + 48 + l], row[o + 144 + l], o + 193, xq,
                                          v + 16 + l))
            t2 = np.int32(t2 + _q6_k_four(row, row[o + 64 + l], row[o + 96 + l], row[o + 160 + l], o + 200, xq,
                                          v + 128 + l))
            t3 = np.int32(t3 + _q6_k_four(row, row[o + 80 + l], row[o + 112 + l], row[o + 176 + l], o + 201, xq,
                                          v + 144 + l))
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
            t = np.int32(t + np.int32(np.int16(c & 15) - 8) * np.int32(xq[v + l])
                         + np.int32(np.int16(c >> 4) - 8) * np.int32(xq[v + 16 + l]))
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


# ------------------------------------------------------------------------------------------ activation rounding
# rounding(x, xq, xf, xd, xs): one activation row x (cols,) float32 -> xq (cols,) int8 values (held as int16), xd
# (nb,) float32 block scales and xs (cols/16,) int32 sums of 16 xq values (the integer types); xf (cols,) float32
# (the float types).


def _int_rounding(blocks: Callable) -> Callable:
    @numba.njit(**JIT)
    def rounding(x, xq, xf, xd, xs):
        blocks(x, xq, xd)
        for j in range(xs.shape[0]):
            t = 0
            for i in range(16 * j, 16 * j + 16):
                t += xq[i]
            xs[j] = t

    return rounding


@numba.njit(**JIT)
def _rounding_f32(x, xq, xf, xd, xs):
    xf[:] = x


@numba.njit(**JIT)
def _rounding_f16(x, xq, xf, xd, xs):
    for i in range(x.shape[0]):
        xf[i] = fp16_value(fp16_bits(x[i]))


@numba.njit(**JIT)
def _rounding_bf16(x, xq, xf, xd, xs):
    """Round to nearest even on the top 16 bits of the float32 (finite inputs), as torch's .bfloat16()."""
    for i in range(x.shape[0]):
        bits = np.int64(F32(x[i]).view(np.uint32))
        xf[i] = np.uint32(((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16).view(np.float32)


# Activation roundings by name (Format.rounding), in the order of their codes.
ROUNDINGS: dict[str, Callable] = {
    "q8_k": _int_rounding(q8_k_blocks),
    "q8_0": _int_rounding(q8_0_blocks),
    "f16": _rounding_f16,
    "bf16": _rounding_bf16,
    "f32": _rounding_f32,
}
INTEGER_ROUNDINGS = ("q8_k", "q8_0")


def _rows_kernel(unpack: Callable, dot: Callable, fused: Callable | None, fused_pairs: int) -> Callable:
    """The work item of one format: y[p, r] = row r of expert e . activation row act_row[p] (+ bias[e, r]) for the
    pairs p = order[j0:j1] and rows r0..r1-1 of item (e, j0, j1, r0, r1). Items of at most `fused_pairs` pairs take
    the fused decode-and-dot per pair; the others decode each row once, into wq, for all their pairs."""
    @numba.njit(**JIT)
    def rows(w, bias, item, order, act_row, xq, xf, xd, xs, block, n_sub, y):
        e, j0, j1, r0, r1 = item[0], item[1], item[2], item[3], item[4]
        nb = max(xq.shape[1], xf.shape[1]) // block
        wq = np.empty(xq.shape[1], np.int16)
        prod = np.empty(xq.shape[1], np.int32)
        wf = np.empty(xf.shape[1], F32)
        sc = np.zeros((nb, n_sub), np.int32)
        mn = np.zeros((nb, n_sub), np.int32)
        dd = np.zeros((nb, 2), F32)
        if fused is not None and j1 - j0 <= fused_pairs:
            for r in range(r0, r1):
                for j in range(j0, j1):
                    p = order[j]
                    a = act_row[p]
                    v = fused(w[e, r], sc, mn, xq[a], xd[a], xs[a])
                    y[p, r] = v + bias[e, r] if bias.shape[0] else v
            return
        for r in range(r0, r1):
            unpack(w[e, r], wq, wf, sc, mn, dd)
            for j in range(j0, j1):
                p = order[j]
                a = act_row[p]
                v = dot(wq, wf, sc, mn, dd, xq[a], xf[a], xd[a], xs[a], prod)
                y[p, r] = v + bias[e, r] if bias.shape[0] else v

    return rows


@dataclass(frozen=True)
class Format:
    rows: Callable  # the work item (_rows_kernel)
    rounding: str  # key of ROUNDINGS: what llama.cpp rounds this type's input to (moerun.rounding)
    block: int  # values per block (and per activation block)
    n_sub: int  # sub-blocks per block with their own integer scale


def _int_format(unpack: Callable, rounding: str, block: int, n_sub: int, has_min: bool,
                fused: Callable | None = None) -> Format:
    """A K-quant's fused dot takes items of one pair (from 2 pairs on for Q4_K, 4 for Q6_K, decoding a row once for
    them measured faster); a 32-value type's takes every item (its unpack + _int_dot, with a horizontal sum per 32
    values over a scratch array, is slower even at 8 pairs)."""
    fused_pairs = 0 if fused is None else 1 if block == 256 else np.iinfo(np.int64).max
    return Format(_rows_kernel(unpack, _int_dot(block, n_sub, has_min), fused, fused_pairs), rounding, block, n_sub)


def _float_format(unpack: Callable, rounding: str) -> Format:
    return Format(_rows_kernel(unpack, _float_dot, None, 0), rounding, 1, 1)


# The expert types of common MoE GGUFs, the K-quants and the 32-value types, and the float ones.
FORMATS: dict[Q, Format] = {
    Q.Q4_K: _int_format(_unpack_q4_k, "q8_k", 256, 8, True, _fused_q4_k),
    Q.Q5_K: _int_format(_unpack_q5_k, "q8_k", 256, 8, True, _fused_q5_k),
    Q.Q6_K: _int_format(_unpack_q6_k, "q8_k", 256, 16, False, _fused_q6_k),
    Q.Q3_K: _int_format(_unpack_q3_k, "q8_k", 256, 16, False),
    Q.Q2_K: _int_format(_unpack_q2_k, "q8_k", 256, 16, True),
    Q.IQ4_XS: _int_format(_unpack_iq4_xs, "q8_k", 256, 8, False),
    Q.Q8_0: _int_format(_unpack_q8_0, "q8_0", 32, 1, False, _fused_q8_0),
    Q.Q4_0: _int_format(_unpack_q4_0, "q8_0", 32, 1, False, _fused_q4_0),
    Q.Q5_0: _int_format(_unpack_q5_0, "q8_0", 32, 1, False),
    Q.Q4_1: _int_format(_unpack_q4_1, "q8_0", 32, 1, True),
    Q.Q5_1: _int_format(_unpack_q5_1, "q8_0", 32, 1, True),
    Q.MXFP4: _int_format(_unpack_mxfp4, "q8_0", 32, 1, False),
    Q.F32: _float_format(_unpack_f32, "f32"),
    Q.F16: _float_format(_unpack_f16, "f16"),
    Q.BF16: _float_format(_unpack_bf16, "bf16"),
}


def supports(qtype: Q) -> bool:
    return qtype in FORMATS


# ------------------------------------------------------------------------------------------------- the kernels
# The kernels take a table index (a format's, a rounding's, an activation's) and pick the function with
# literal_unroll over the table, rather than taking the function itself: numba's disk cache cannot key a compiled
# function on a function argument, and would compile these again in every process.

# Calling a table's function through literal_unroll is what numba's warning calls its first-class function feature.
warnings.filterwarnings("ignore", ".*First-class function type feature is experimental",
                        numba.core.errors.NumbaExperimentalFeatureWarning)

_FORMAT_CODES = {qtype: i for i, qtype in enumerate(FORMATS)}
_ROWS = tuple(f.rows for f in FORMATS.values())
_ROUNDING_CODES = {name: i for i, name in enumerate(ROUNDINGS)}
_ROUNDINGS = tuple(ROUNDINGS.values())
assert tuple(ROUNDINGS)[:len(INTEGER_ROUNDINGS)] == INTEGER_ROUNDINGS  # an integer rounding's code is the lower
# Each format's facts by format code, read by the kernels (numba freezes global arrays into the compiled code).
_BLOCK = np.array([f.block for f in FORMATS.values()], np.int64)
_N_SUB = np.array([f.n_sub for f in FORMATS.values()], np.int64)
_FORMAT_ROUNDING = np.array([_ROUNDING_CODES[f.rounding] for f in FORMATS.values()], np.int64)
_ROUNDING_BLOCK = np.array([next(f.block for f in FORMATS.values() if f.rounding == name) for name in ROUNDINGS],
                           np.int64)

# Below this many rows (tokens or pairs to round, tokens to combine) a step runs on the calling thread: a parallel
# region costs more than the rows.
PARALLEL_MIN_ROWS = 8


@numba.njit(**JIT)
def _round_one(code, x, xq, xf, xd, xs):
    i = 0
    for rounding in literal_unroll(_ROUNDINGS):
        if i == code:
            rounding(x, xq, xf, xd, xs)
        i += 1


@numba.njit(**JIT)
def _rounded(code, n, cols):
    """Empty arrays for n rows of `cols` values rounded by rounding `code` (those it does not fill: no columns)."""
    integer = code < len(INTEGER_ROUNDINGS)
    block = _ROUNDING_BLOCK[code]
    # int8 values held as int16: the dots then multiply them as they load them, no sign extension per weight row.
    xq = np.empty((n, cols if integer else 0), np.int16)
    xf = np.empty((n, 0 if integer else cols), F32)
    xd = np.empty((n, cols // block if integer else 0), F32)
    xs = np.empty((n, cols // 16 if integer else 0), np.int32)
    return xq, xf, xd, xs


@numba.njit(parallel=True, **JIT)
def _round_rows(code, x, used, xq, xf, xd, xs):
    """Round the rows i of x with used[i] into the same rows of xq/xf/xd/xs; few rows on the calling thread."""
    if x.shape[0] < PARALLEL_MIN_ROWS:
        for t in range(x.shape[0]):
            if used[t]:
                _round_one(code, x[t], xq[t], xf[t], xd[t], xs[t])
    else:
        for t in numba.prange(x.shape[0]):
            if used[t]:
                _round_one(code, x[t], xq[t], xf[t], xd[t], xs[t])


@numba.njit(**JIT)
def _rows_one(code, w, bias, item, order, act_row, xq, xf, xd, xs, y):
    i = 0
    for rows in literal_unroll(_ROWS):
        if i == code:
            rows(w, bias, item, order, act_row, xq, xf, xd, xs, _BLOCK[code], _N_SUB[code], y)
        i += 1


@numba.njit(**JIT)
def _pairs(ids, n_experts):
    """Pairs (t, k) with ids[t, k] >= 0, numbered in (t, k) order, grouped by expert (a counting sort, stable).
    Returns the first expert id past the stack or -1 (the kernels index without bounds checks: the callers return
    it, and the other results are then empty), the token of each pair (P,), the pairs in expert order (P,), each
    expert's first index into that order (E + 1,), and whether each token has a pair (T,)."""
    T, K = ids.shape
    for t in range(T):
        for k in range(K):
            if ids[t, k] >= n_experts:
                empty = np.empty(0, np.int64)
                return ids[t, k], empty, empty, empty, np.zeros(0, np.bool_)
    start = np.zeros(n_experts + 1, np.int64)
    for t in range(T):
        for k in range(K):
            if ids[t, k] >= 0:
                start[ids[t, k] + 1] += 1
    for e in range(n_experts):
        start[e + 1] += start[e]
    P = start[n_experts]
    token, order = np.empty(P, np.int64), np.empty(P, np.int64)
    used = np.zeros(T, np.bool_)
    fill = start[:-1].copy()
    p = 0
    for t in range(T):
        for k in range(K):
            e = ids[t, k]
            if e >= 0:
                token[p] = t
                order[fill[e]] = p
                fill[e] += 1
                used[t] = True
                p += 1
    return np.int64(-1), token, order, start, used


@numba.njit(**JIT)
def _items(start, n_rows, items_wanted):
    """Work items (n, 5) over the experts with pairs: expert, first and end index into the ordered pairs, first and
    end row; each expert's rows split into the same number of ranges, of at least MIN_ROWS_PER_ITEM rows."""
    n_experts = start.shape[0] - 1
    n_seg = 0
    for e in range(n_experts):
        n_seg += start[e + 1] > start[e]
    chunks = max(1, min(-(-items_wanted // max(n_seg, 1)), -(-n_rows // MIN_ROWS_PER_ITEM)))
    items = np.empty((n_seg * chunks, 5), np.int64)
    i = 0
    for e in range(n_experts):
        if start[e + 1] > start[e]:
            for c in range(chunks):
                items[i, 0], items[i, 1], items[i, 2] = e, start[e], start[e + 1]
                items[i, 3], items[i, 4] = n_rows * c // chunks, n_rows * (c + 1) // chunks
                i += 1
    return items


@numba.njit(parallel=True, **JIT)
def _matmul(items_wanted, x, experts, code, w, bias, y):
    """y[i] = expert experts[i] of w times x[i] (+ its bias); the entry of expert_matmul."""
    bad, token, order, start, used = _pairs(experts, w.shape[0])
    if bad >= 0:
        return bad
    items = _items(start, y.shape[1], items_wanted)
    xq, xf, xd, xs = _rounded(_FORMAT_ROUNDING[code], x.shape[0], x.shape[1])
    _round_rows(_FORMAT_ROUNDING[code], x, used, xq, xf, xd, xs)
    for it in numba.prange(items.shape[0]):
        _rows_one(code, w, bias, items[it], order, token, xq, xf, xd, xs, y)
    return -1


# An activation is act(g, u, limit) (float32 each); `limit` is moe_rows' argument, read by those that have one.


@numba.njit(**JIT)
def _swiglu(g: np.float32, u: np.float32, limit: np.float32) -> np.float32:
    return g / (F32(1) + np.exp(-g)) * u


@numba.njit(**JIT)
def _swiglu_oai(g: np.float32, u: np.float32, limit: np.float32) -> np.float32:
    """gpt-oss (alpha 1.702, its limit 7, not the argument): the gate capped at the limit, up clamped to +-limit and
    shifted by 1."""
    g = min(g, F32(7))
    u = max(min(u, F32(7)), F32(-7))
    return g / (F32(1) + np.exp(-F32(1.702) * g)) * (u + F32(1))


@numba.njit(**JIT)
def _swiglu_clamp(g: np.float32, u: np.float32, limit: np.float32) -> np.float32:
    """glm5-next (`swiglu_clamp_exp` in its GGUF): the gate capped at `limit` before SiLU, up clamped to +-limit."""
    g = min(g, limit)
    u = max(min(u, limit), -limit)
    return g / (F32(1) + np.exp(-g)) * u


# Expert activations by name: moerun.layers.ACTIVATIONS' and moerun.models.glm5_next.swiglu_clamp.
ACTIVATIONS: dict[str, Callable] = {"swiglu": _swiglu, "swiglu_oai": _swiglu_oai, "swiglu_clamp": _swiglu_clamp}
_ACTIVATION_CODES = {name: i for i, name in enumerate(ACTIVATIONS)}
_ACTIVATIONS = tuple(ACTIVATIONS.values())


@numba.njit(**JIT)
def _activate_item(code, limit, item, order, g, u, h):
    """h = act(g, u, limit) on the pairs and rows of a work item."""
    i = 0
    for act in literal_unroll(_ACTIVATIONS):
        if i == code:
            for j in range(item[1], item[2]):
                p = order[j]
                for r in range(item[3], item[4]):
                    h[p, r] = act(g[p, r], u[p, r], limit)
        i += 1


@numba.njit(**JIT)
def _combine_token(t, first, ids, weights, y, acc, out):
    """out[t] += sum over k (in order) of weights[t, k] * y[pair of (t, k)], the pairs of t numbered from first;
    acc (D,) is scratch. (Each value is a running float32 sum from zero, k by k, as in a loop over k per value.)"""
    acc[:] = F32(0)
    p = first
    for k in range(ids.shape[1]):
        if ids[t, k] >= 0:
            w = weights[t, k]
            for i in range(out.shape[1]):
                acc[i] += w * y[p, i]
            p += 1
    for i in range(out.shape[1]):
        out[t, i] += acc[i]


@numba.njit(parallel=True, **JIT)
def _combine(ids, weights, token, y, out):
    T = ids.shape[0]
    first = np.zeros(T + 1, np.int64)  # first[t]: token t's first pair (pairs are numbered in (t, k) order)
    for p in range(token.shape[0]):
        first[token[p] + 1] += 1
    for t in range(T):
        first[t + 1] += first[t]
    if T < PARALLEL_MIN_ROWS:
        acc = np.empty(out.shape[1], F32)
        for t in range(T):
            _combine_token(t, first[t], ids, weights, y, acc, out)
    else:
        for t in numba.prange(T):
            _combine_token(t, first[t], ids, weights, y, np.empty(out.shape[1], F32), out)


# The body of _moe's gate/up loop is a function of its own, as the other loops' bodies are one call each.


@numba.njit(**JIT)
def _gate_up_item(gate_code, gate_w, gate_b, up_code, up_w, up_b, act_code, limit, item, order, token, xq, xf, xd,
                  xs, uq, uf, ud, us, g, u, h):
    """The gate and up rows of a work item, then h = act(g, u, limit) on its rows and pairs."""
    _rows_one(gate_code, gate_w, gate_b, item, order, token, xq, xf, xd, xs, g)
    _rows_one(up_code, up_w, up_b, item, order, token, uq, uf, ud, us, u)
    _activate_item(act_code, limit, item, order, g, u, h)


@numba.njit(parallel=True, **JIT)
def _moe(items_wanted, x, ids, weights, gate_code, gate_w, gate_b, up_code, up_w, up_b, down_code, down_w, down_b,
         act_code, limit, out):
    """moe_rows in one call (see there): returns -1, or an expert id past the stack (then out is untouched).

    1. plan: the pairs grouped by expert, work items of (expert, its pairs, a range of rows) over gate/up's I rows
       and over down's D rows; round the inputs of the tokens with pairs for gate (and up, where its rounding
       differs).
    2. in parallel over the gate/up items: an item's gate rows, its up rows, then h = act(g, u) on those rows and
       pairs.
    3. round each pair's h for down, then in parallel over the down items: the down rows.
    4. out += the weighted sum of each token's pairs.
    The roundings of 1 and 3 and the sum of 4 run in parallel over rows from PARALLEL_MIN_ROWS rows on, on the
    calling thread below, so a decode call (a token and its few missed experts) starts two parallel regions."""
    n_experts = gate_w.shape[0]
    bad, token, order, start, used = _pairs(ids, n_experts)
    if bad >= 0:
        return bad
    P, T, D, I = token.shape[0], x.shape[0], x.shape[1], gate_w.shape[1]
    if P == 0:
        return -1
    gate_items = _items(start, I, items_wanted)
    down_items = _items(start, out.shape[1], items_wanted)

    gate_rounding, up_rounding = _FORMAT_ROUNDING[gate_code], _FORMAT_ROUNDING[up_code]
    xq, xf, xd, xs = _rounded(gate_rounding, T, D)
    _round_rows(gate_rounding, x, used, xq, xf, xd, xs)
    uq, uf, ud, us = xq, xf, xd, xs
    if up_rounding != gate_rounding:
        uq, uf, ud, us = _rounded(up_rounding, T, D)
        _round_rows(up_rounding, x, used, uq, uf, ud, us)

    g, u, h = np.empty((P, I), F32), np.empty((P, I), F32), np.empty((P, I), F32)
    for it in numba.prange(gate_items.shape[0]):
        _gate_up_item(gate_code, gate_w, gate_b, up_code, up_w, up_b, act_code, F32(limit), gate_items[it], order,
                      token, xq, xf, xd, xs, uq, uf, ud, us, g, u, h)

    down_rounding = _FORMAT_ROUNDING[down_code]
    hq, hf, hd, hs = _rounded(down_rounding, P, I)
    _round_rows(down_rounding, h, np.ones(P, np.bool_), hq, hf, hd, hs)
    y = np.empty((P, out.shape[1]), F32)
    pair = np.arange(P)
    for it in numba.prange(down_items.shape[0]):
        _rows_one(down_code, down_w, down_b, down_items[it], order, pair, hq, hf, hd, hs, y)

    _combine(ids, weights, token, y, out)
    return -1


# ---------------------------------------------------- the same, on ggml's row dot products where they are there

# A tensor's ggml kernel as the numba kernels take it: (vec_dot address, from_float address, bytes of one activation
# row in the dot's format); ggml_cpu.py.


@numba.njit(inline="always")
def _address(a: np.ndarray) -> np.int64:
    return np.int64(a.ctypes.data)


@numba.njit(parallel=True, **JIT)
def _quantize_rows(quantize, x, used, q):
    """Rows i of x (float32) with used[i] into row i of q, in the format of a ggml dot (its from_float); few rows on
    the calling thread."""
    if x.shape[0] < PARALLEL_MIN_ROWS:
        for t in range(x.shape[0]):
            if used[t]:
                ggml_cpu.from_float(quantize, _address(x[t]), _address(q[t]), x.shape[1])
    else:
        for t in numba.prange(x.shape[0]):
            if used[t]:
                ggml_cpu.from_float(quantize, _address(x[t]), _address(q[t]), x.shape[1])


@numba.njit(**JIT)
def _ggml_rows(dot, w, bias, item, order, act_row, q, n, y):
    """y[p, r] = row r of expert item[0] . q[act_row[p]] (n values; + its bias) over the item's pairs and rows."""
    e, row_bytes = item[0], np.int64(w.shape[2])
    base = _address(w) + e * w.shape[1] * row_bytes
    for j in range(item[1], item[2]):
        p = order[j]
        qp, yp = _address(q[act_row[p]]), _address(y[p])
        for r in range(item[3], item[4]):
            ggml_cpu.vec_dot(dot, n, yp + 4 * r, base + r * row_bytes, qp)
        if bias.shape[0]:
            for r in range(item[3], item[4]):
                y[p, r] += bias[e, r]


@numba.njit(**JIT)
def _ggml_gate_up_item(gate_dot, gate_w, gate_b, up_dot, up_w, up_b, act_code, limit, item, order, token, xg, xu, n,
                       g, u, h):
    _ggml_rows(gate_dot, gate_w, gate_b, item, order, token, xg, n, g)
    _ggml_rows(up_dot, up_w, up_b, item, order, token, xu, n, u)
    _activate_item(act_code, limit, item, order, g, u, h)


@numba.njit(parallel=True, **JIT)
def _moe_ggml(items_wanted, x, ids, weights, gate_k, gate_w, gate_b, up_k, up_w, up_b, down_k, down_w, down_b,
              act_code, limit, out):
    """_moe with ggml's row dots (gate_k, up_k, down_k: the tensors' ggml kernels) and its roundings of the inputs."""
    n_experts = gate_w.shape[0]
    bad, token, order, start, used = _pairs(ids, n_experts)
    if bad >= 0:
        return bad
    P, T, D, I = token.shape[0], x.shape[0], x.shape[1], gate_w.shape[1]
    if P == 0:
        return -1
    gate_items = _items(start, I, items_wanted)
    down_items = _items(start, out.shape[1], items_wanted)
    xg = np.empty((T, gate_k[2]), np.uint8)
    _quantize_rows(gate_k[1], x, used, xg)
    xu = xg
    if up_k[1] != gate_k[1]:
        xu = np.empty((T, up_k[2]), np.uint8)
        _quantize_rows(up_k[1], x, used, xu)
    g, u, h = np.empty((P, I), F32), np.empty((P, I), F32), np.empty((P, I), F32)
    for it in numba.prange(gate_items.shape[0]):
        _ggml_gate_up_item(gate_k[0], gate_w, gate_b, up_k[0], up_w, up_b, act_code, F32(limit), gate_items[it],
                           order, token, xg, xu, D, g, u, h)
    hq = np.empty((P, down_k[2]), np.uint8)
    _quantize_rows(down_k[1], h, np.ones(P, np.bool_), hq)
    y = np.empty((P, out.shape[1]), F32)
    pair = np.arange(P)
    for it in numba.prange(down_items.shape[0]):
        _ggml_rows(down_k[0], down_w, down_b, down_items[it], order, pair, hq, I, y)
    _combine(ids, weights, token, y, out)
    return -1


@numba.njit(parallel=True, **JIT)
def _matmul_ggml(items_wanted, x, experts, k, w, bias, y):
    """_matmul with ggml's row dot (k: the tensor's ggml kernel)."""
    bad, token, order, start, used = _pairs(experts, w.shape[0])
    if bad >= 0:
        return bad
    items = _items(start, y.shape[1], items_wanted)
    q = np.empty((x.shape[0], k[2]), np.uint8)
    _quantize_rows(k[1], x, used, q)
    for it in numba.prange(items.shape[0]):
        _ggml_rows(k[0], w, bias, items[it], order, token, q, x.shape[1], y)
    return -1


def _ggml_kernel(t: ExpertBytes) -> tuple[int, int, int] | None:
    """t's ggml kernel, or None (ggml_cpu.row_dot)."""
    dot = ggml_cpu.row_dot(t.qtype)
    return None if dot is None else (dot.dot, dot.quantize, dot.row_bytes(t.cols))


def _code(t: ExpertBytes) -> int:
    if t.code < 0:
        raise MoeprepError(f"no CPU expert kernel for {Q(t.qtype).name}")
    return t.code


def _out_of_range(bad: int, n_experts: int) -> ValueError:
    return ValueError(f"expert id {bad} out of range: the tensors hold {n_experts} experts")


def _launch(kernel: Callable, threads: int | None, *args) -> int:
    """kernel(items wanted, *args), holding _LAUNCH, on `threads` numba threads (None: the calling thread's
    setting; numba's setting is changed, and put back, only when it differs)."""
    with _LAUNCH:
        previous = numba.get_num_threads()
        n = threads or previous
        if n == previous:
            return kernel(ITEMS_PER_THREAD * n, *args)
        numba.set_num_threads(n)
        try:
            return kernel(ITEMS_PER_THREAD * n, *args)
        finally:
            numba.set_num_threads(previous)


def expert_matmul(x: np.ndarray, t: ExpertBytes, experts: np.ndarray, threads: int | None = None) -> np.ndarray:
    """y[i] = expert experts[i] of t times x[i] (+ its bias), rounding x[i] as llama.cpp does for t's type.
    x (n, cols) float32, experts (n,) integers -> y (n, rows) float32."""
    y = np.empty((len(x), t.rows), F32)
    x, experts = np.ascontiguousarray(x, F32), np.ascontiguousarray(experts, np.int64)[:, None]
    ggml = _ggml_kernel(t)
    if ggml is not None:
        bad = _launch(_matmul_ggml, threads, x, experts, ggml, t.kernel_data, t.kernel_bias, y)
    else:
        bad = _launch(_matmul, threads, x, experts, _code(t), t.kernel_data, t.kernel_bias, y)
    if bad >= 0:
        raise _out_of_range(bad, t.data.shape[0])
    return y


def moe_rows(x: np.ndarray, ids: np.ndarray, weights: np.ndarray, gate: ExpertBytes, up: ExpertBytes,
             down: ExpertBytes, activation: str, out: np.ndarray, threads: int | None = None,
             limit: float = 0.0) -> None:
    """out (T, D) += sum_k weights[t, k] * expert_{ids[t, k]}(x[t]), for x (T, D) float32, ids (T, K) integers
    (< 0: no expert) and weights (T, K) float32; an expert is down(act(gate x + b, up x + b)) + b, `activation` a
    key of ACTIVATIONS and `limit` its clamp where it takes one (swiglu_clamp). `threads`: numba threads for this
    call (default: numba's setting for the calling thread). One compiled call: _moe_ggml where ggml has a row dot for
    all three tensors' types (ggml_cpu.py), else _moe."""
    x, ids, weights = (np.ascontiguousarray(x, F32), np.ascontiguousarray(ids, np.int64),
                       np.ascontiguousarray(weights, F32))
    ggml = [_ggml_kernel(t) for t in (gate, up, down)]
    if all(k is not None for k in ggml):
        bad = _launch(_moe_ggml, threads, x, ids, weights, ggml[0], gate.kernel_data, gate.kernel_bias, ggml[1],
                      up.kernel_data, up.kernel_bias, ggml[2], down.kernel_data, down.kernel_bias,
                      _ACTIVATION_CODES[activation], float(limit), out)
    else:
        bad = _launch(_moe, threads, x, ids, weights, _code(gate), gate.kernel_data, gate.kernel_bias, _code(up),
                      up.kernel_data, up.kernel_bias, _code(down), down.kernel_data, down.kernel_bias,
                      _ACTIVATION_CODES[activation], float(limit), out)
    if bad >= 0:
        raise _out_of_range(bad, gate.data.shape[0])


# ------------------------------------------------------------------------------------------- the ExpertCompute


class CPUExperts(GGUFExperts):
    """ExpertCompute on the CPU through moe_rows, straight from the memory-mapped GGUF, with torch's thread count.
    With activation hooks registered (imatrix collection) it runs the reference path, which reports each expert's
    inputs. `activation` names moe_rows' activation and `limit` its clamp (glm5-next sets both, and `act`, the
    reference path's)."""

    limit: float = 0.0

    @classmethod
    def can_run(cls, w: Weights, layer: int) -> bool:
        return all(supports(w.info(f"blk.{layer}.ffn_{part}_exps.weight").ggml_type) for part in ("gate", "up", "down"))

    @classmethod
    def load(cls, w: Weights, hooks: Hooks, layer: int, activation: str = "swiglu") -> CPUExperts:
        experts = super().load(w, hooks, layer, activation)
        experts.activation = activation
        experts.host = tuple(_host_bytes(w, f"blk.{layer}.ffn_{part}_exps", bias) for part, bias in
                             zip(("gate", "up", "down"), (experts.gate_bias, experts.up_bias, experts.down_bias)))
        return experts

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.hooks.activation:
            return super().forward(x, ids, weights)
        out = torch.zeros(x.shape, dtype=torch.float32)
        moe_rows(x.float().contiguous().numpy(), ids.numpy(), weights.float().contiguous().numpy(), *self.host,
                 self.activation, out.numpy(), threads=_torch_threads(),
                 limit=self.limit)
        return out


# ----------------------------------------------------------------------------------- dense products on the CPU

# Up to this many tokens a CPU Linear runs the integer kernels on the GGUF bytes; more take the float32 copy's GEMM.
# Measured on this project's 2-core VM, 4096x2048, 2 threads (expert_matmul against F.linear): Q4_K 0.43 against 1.73
# ms for 1 token, 1.51 against 3.98 for 4, 9.0 against 5.8 for 32 (Q8_0 alike; Q6_K 0.88 against 1.74 for 1).
# Through ggml's row dots (ggml_cpu.py), same VM and shape: 0.18 against 1.57 ms for 1 token, 3.7 against 5.1 for
# 32, 15.0 against 17.4 for 128, 60.8 against 52.1 for 512: no float32 copy then (CPUQuantLinear).
QUANT_MAX_TOKENS = 8
# F16 and BF16 weights run ggml's row dots too where they are there (moerun's numba float kernels do not beat torch's
# float32 product): 8192 x 2048 F16, 2 threads, this project's 2-core VM, 0.29 against 1.65 ms for 1 token, 2.0
# against 3.5 for 8, 16.2 against 7.8 for 64, 126 against 50 for 512. Row dots for every token count all the same, as
# for the integer types: a token's product then does not depend on how many tokens share its step (a server's batch
# and the same prompt alone sample the same tokens), and no copy is kept (a 152k-token F16 output head's would be
# 1.2 GB; heads multiply one row per sequence anyway).
HALF_TYPES = (Q.F16, Q.BF16)


class CPUQuantLinear(Linear):
    """A Linear on the CPU whose weight has an integer kernel (the block-quantized types), or a half-precision one
    where ggml's row dots are there, multiplying the memory-mapped GGUF bytes (a Q4_K matrix is a seventh of its
    float32 copy's bytes; one "expert" of expert_matmul). On ggml's row dots it takes any number of tokens and keeps
    no float32 copy (a 30B model's attention alone would take 3.6 GB more); on the numba kernels a step of more than
    QUANT_MAX_TOKENS tokens (a prompt) goes through a float32 copy's GEMM, which computes it faster. Both round the
    input as llama.cpp does for the weight's type."""

    host: ExpertBytes

    def __init__(self, host: ExpertBytes, weight: torch.Tensor | None, bias: torch.Tensor | None, name: str,
                 hooks: Hooks, round_input) -> None:
        torch.nn.Module.__init__(self)  # not Linear.__init__: the weight may be absent
        self.weight = None if weight is None else torch.nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        self.name, self.hooks, self.round_input, self.host = name, hooks, round_input, host

    @classmethod
    def can_run(cls, qtype: Q) -> bool:
        code = _FORMAT_CODES.get(qtype, -1)
        integer = code >= 0 and _FORMAT_ROUNDING[code] < len(INTEGER_ROUNDINGS)
        return integer or (qtype in HALF_TYPES and ggml_cpu.row_dot(qtype) is not None)

    @classmethod
    def load(cls, w: Weights, prefix: str, hooks: Hooks, bias: torch.Tensor | None) -> CPUQuantLinear:
        """GGUF tensor `prefix`.weight's bytes, and its float32 copy where the numba kernels would need it."""
        host = _host_bytes(w, prefix, bias)
        name = f"{prefix}.weight"
        weight = None if _ggml_kernel(host) is not None else w.dense(name, torch.float32)
        return cls(host, weight, bias, name, hooks, input_rounding(host.qtype))

    def product(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is not None and (x.dim() != 2 or x.shape[0] > QUANT_MAX_TOKENS):
            return super().product(x)
        rows = x.reshape(-1, x.shape[-1]).float().contiguous().numpy()
        y = expert_matmul(rows, self.host, np.zeros(len(rows), np.int64), _torch_threads())
        return torch.from_numpy(y).reshape(*x.shape[:-1], self.host.rows)


def _torch_threads() -> int:
    """The kernels' threads for a layer's call: torch's count (moerun's -t), within numba's pool."""
    return min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)


def _host_bytes(w: Weights, prefix: str, bias: torch.Tensor | None) -> ExpertBytes:
    """`prefix.weight` as (E, rows, row_bytes) in the memory map (a 2-D weight as one expert), with `prefix.bias` as
    the caller read it (None: the file has none)."""
    info = w.info(f"{prefix}.weight")
    n_experts, rows, cols = info.shape if len(info.shape) == 3 else (1, *info.shape)
    return ExpertBytes(w.gguf.raw(info).reshape(n_experts, rows, -1), info.ggml_type, rows, cols,
                       None if bias is None else bias.cpu().numpy().reshape(n_experts, rows))
