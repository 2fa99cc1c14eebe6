"""The CPU expert kernels' table of block types: each `Format` joins a type's decoder (blocks.py), its dot
(dots.py), the activation rounding llama.cpp applies to its input (ROUNDINGS) and its block shape; the kernels index
it by code. `ExpertBytes` is one stacked expert tensor's bytes prepared for them."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import numba
import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from moeprep.quant.jit import F32, JIT
from moeprep.quant.scalars import fp16_bits, fp16_value
from moerun.kernels.cpu.blocks import (
    _unpack_bf16,
    _unpack_f16,
    _unpack_f32,
    _unpack_iq4_xs,
    _unpack_mxfp4,
    _unpack_q2_k,
    _unpack_q3_k,
    _unpack_q4_0,
    _unpack_q4_1,
    _unpack_q4_k,
    _unpack_q5_0,
    _unpack_q5_1,
    _unpack_q5_k,
    _unpack_q6_k,
    _unpack_q8_0,
)
from moerun.kernels.cpu.dots import (
    _float_dot,
    _fused_q4_0,
    _fused_q4_k,
    _fused_q5_k,
    _fused_q6_k,
    _fused_q8_0,
    _int_dot,
)
from moerun.kernels.rounding import q8_0_blocks, q8_k_blocks


@dataclass(frozen=True)
class ExpertBytes:
    """One stacked expert tensor as GGUF bytes in host memory (E, rows, row_bytes), and its optional bias (E, rows).
    `data` is C-contiguous, or a row range of a C-contiguous stack whose experts hold `step` times as many rows (the
    gate or up half of a fused ffn_gate_up_exps: step 2). What the kernels take is prepared once here: the format's
    code (-1: no kernel for the type) and C-contiguous read-only views of the bytes and the bias (memory-mapped and
    in-memory arrays then share one numba type, hence one compiled kernel): `kernel_data`, from data's first byte,
    in which expert e is kernel_data[e * kernel_step], so a half is read in place, not copied."""

    data: np.ndarray
    qtype: Q
    rows: int
    cols: int
    bias: np.ndarray | None = None
    code: int = field(init=False, repr=False, compare=False)
    kernel_data: np.ndarray = field(init=False, repr=False, compare=False)
    kernel_step: int = field(init=False, repr=False, compare=False)
    kernel_bias: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        code = _FORMAT_CODES.get(self.qtype, -1)
        if code >= 0:
            block, type_size = GGML_QUANT_SIZES[self.qtype]
            assert self.cols % block == 0 and self.data.shape[1:] == (self.rows, self.cols // block * type_size), (
                self.data.shape,
                self.qtype,
            )
        kernel_data, step = _expert_blocks(self.data)
        object.__setattr__(self, "code", code)
        object.__setattr__(self, "kernel_data", kernel_data)
        object.__setattr__(self, "kernel_step", step)
        object.__setattr__(self, "kernel_bias", _NO_BIAS if self.bias is None else _read_only(self.bias, F32))


def _read_only(a: np.ndarray, dtype: type) -> np.ndarray:
    """A C-contiguous read-only view (a copy only if a is not C-contiguous of dtype)."""
    view = np.ascontiguousarray(a, dtype).view(np.ndarray)
    view.flags.writeable = False
    return view


def _expert_blocks(data: np.ndarray) -> tuple[np.ndarray, int]:
    """data (E, rows, row_bytes) uint8 -> (a C-contiguous read-only array of (rows, row_bytes) blocks starting at
    data's first byte, the step between experts in it). A row range of a stack whose experts hold `step` such blocks
    (its rows contiguous, the experts step * rows rows apart) is read in place: the array ends at data's last
    expert's rows, so it stays within the stack. Any other layout is copied (step 1)."""
    n_experts, rows, row_bytes = data.shape
    block = rows * row_bytes
    strides = data.strides
    if (
        data.dtype == np.uint8
        and n_experts > 0
        and block > 0
        and strides[1:] == (row_bytes, 1)
        and strides[0] >= block
        and strides[0] % block == 0
    ):
        step = strides[0] // block
        blocks = np.lib.stride_tricks.as_strided(
            data, ((n_experts - 1) * step + 1, rows, row_bytes), (block, row_bytes, 1), writeable=False
        )
        return blocks.view(np.ndarray), step
    return _read_only(data, np.uint8), 1


_NO_BIAS = _read_only(np.zeros((0, 0), F32), F32)


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
    def rows(w, step, bias, item, order, act_row, xq, xf, xd, xs, block, n_sub, y):
        e, j0, j1, r0, r1 = item[0], item[1], item[2], item[3], item[4]
        we = e * step  # expert e's block of w (ExpertBytes.kernel_step)
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
                    v = fused(w[we, r], sc, mn, xq[a], xd[a], xs[a])
                    y[p, r] = v + bias[e, r] if bias.shape[0] else v
            return
        for r in range(r0, r1):
            unpack(w[we, r], wq, wf, sc, mn, dd)
            for j in range(j0, j1):
                p = order[j]
                a = act_row[p]
                v = dot(wq, wf, sc, mn, dd, xq[a], xf[a], xd[a], xs[a], prod)
                y[p, r] = v + bias[e, r] if bias.shape[0] else v

    return rows


@dataclass(frozen=True)
class Format:
    rows: Callable  # the work item (_rows_kernel)
    rounding: str  # key of ROUNDINGS: what llama.cpp rounds this type's input to (kernels/rounding.py)
    block: int  # values per block (and per activation block)
    n_sub: int  # sub-blocks per block with their own integer scale


def _int_format(
    unpack: Callable, rounding: str, block: int, n_sub: int, has_min: bool, fused: Callable | None = None
) -> Format:
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
warnings.filterwarnings(
    "ignore", ".*First-class function type feature is experimental", numba.core.errors.NumbaExperimentalFeatureWarning
)


_FORMAT_CODES = {qtype: i for i, qtype in enumerate(FORMATS)}


_ROWS = tuple(f.rows for f in FORMATS.values())


_ROUNDING_CODES = {name: i for i, name in enumerate(ROUNDINGS)}


_ROUNDINGS = tuple(ROUNDINGS.values())


assert tuple(ROUNDINGS)[: len(INTEGER_ROUNDINGS)] == INTEGER_ROUNDINGS  # an integer rounding's code is the lower


# Each format's facts by format code, read by the kernels (numba freezes global arrays into the compiled code).
_BLOCK = np.array([f.block for f in FORMATS.values()], np.int64)


_N_SUB = np.array([f.n_sub for f in FORMATS.values()], np.int64)


_FORMAT_ROUNDING = np.array([_ROUNDING_CODES[f.rounding] for f in FORMATS.values()], np.int64)


_ROUNDING_BLOCK = np.array(
    [next(f.block for f in FORMATS.values() if f.rounding == name) for name in ROUNDINGS], np.int64
)


def integer_kernel(qtype: Q) -> bool:
    """Does the type have an integer kernel (its input rounded to 8-bit blocks), rather than a float one or none?"""
    code = _FORMAT_CODES.get(qtype, -1)
    return code >= 0 and _FORMAT_ROUNDING[code] < len(INTEGER_ROUNDINGS)
