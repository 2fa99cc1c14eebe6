"""Which code quantizes each GGML type, and which type a row length forces (llama-quantize's fallbacks).

A quantizer maps rows [R, P] float32 and an optional importance matrix [P] (or [R, P]) to bytes [R, row_bytes],
equal to libggml's `ggml_quantize_chunk` for the same input:
  * Q4_K, Q5_K, Q6_K: moeprep.quant.kquants, both ggml paths;
  * Q4_0, Q4_1, Q5_0, Q5_1: below, both ggml paths, as numba kernels on moeprep.quant.searches' scale searches
    (moeprep.quant.jit says how they keep ggml's bytes). gguf-py has only the reference path, and it differs from ggml
    in the sign of zero: ggml stores d = -0.0 for an all-zero Q4_0 block, and the first of equal minima as a
    Q4_1 min, where gguf-py's numpy min/argmax pick other signed zeros;
  * Q8_0, F16, BF16, F32: gguf-py (byte-exact); ggml ignores an imatrix for these, and so do we.
On `device="cuda"` the K-quants run in torch on the GPU (moeprep.quant.kquants_torch, the same bytes); the other
types stay on the CPU.

Shapes: R rows, P values per row, S blocks of 32.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import gguf
import numba
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from moeprep.errors import MoeprepError
from moeprep.quant import kquants
from moeprep.quant.jit import F32, JIT, quantize_with
from moeprep.quant.scalars import fp16_bits
from moeprep.quant.searches import LANES, gather_lanes, search_min_scale, search_symmetric_scale, search_work

Quantizer = Callable[[np.ndarray, np.ndarray | None], np.ndarray]
T = GGMLQuantizationType

FLT_MAX = F32(np.finfo(F32).max)


def _unweighted(qtype: GGMLQuantizationType) -> Quantizer:
    """gguf-py's quantizer for a type whose ggml quantizer never reads the importance matrix."""

    def quantize(rows: np.ndarray, imatrix: np.ndarray | None) -> np.ndarray:
        with np.errstate(over="ignore"):  # beyond fp16's range ggml stores inf too
            out = gguf.quants.quantize(rows, qtype)
        return np.ascontiguousarray(out).view(np.uint8).reshape(rows.shape[0], -1)

    return quantize


@numba.njit(**JIT)
def _pack_legacy(
    L: np.ndarray,
    d: np.ndarray,
    mn: np.ndarray,
    levels: int,
    with_min: bool,
    packed: np.ndarray,
    yb: np.ndarray,
    b0: int,
    count: int,
) -> None:
    """Blocks b0..b0+count-1 of yb [NB, type_size] from lanes 0..count-1 of L [32, S], d [S], mn [S].

    A block: d (fp16), [min (fp16)], [qh: bit 4 of value j as bit j, for 5-bit types], qs: values j and j+16
    share byte j, low nibble first. The bytes are put together in lanes (packed: [type_size, S] scratch), then
    copied out block by block."""
    S = L.shape[1]
    k = 4 if with_min else 2
    if levels == 32:
        for j in range(4):
            for s in range(S):
                packed[k + j, s] = 0
        for i in range(32):
            for s in range(S):
                packed[k + i // 8, s] |= ((L[i, s] >> 4) & 1) << (i % 8)
        k += 4
    for j in range(16):
        for s in range(S):
            packed[k + j, s] = (L[j, s] & 0xF) | ((L[j + 16, s] & 0xF) << 4)
    for s in range(count):
        d16 = fp16_bits(d[s])
        packed[0, s], packed[1, s] = d16, d16 >> 8
        if with_min:
            m16 = fp16_bits(mn[s])
            packed[2, s], packed[3, s] = m16, m16 >> 8
    for s in range(count):
        for j in range(packed.shape[0]):
            yb[b0 + s, j] = packed[j, s]


@numba.njit(**JIT)
def _reference_levels(
    x: np.ndarray, levels: int, with_min: bool, L: np.ndarray, d: np.ndarray, mn: np.ndarray, lane: np.ndarray
) -> None:
    """ggml's quantize_row_qX_Y_ref for S blocks at once. x: [32, S], value i of block s at [i, s].

    Writes L [32, S] uint8, d [S] and, for the affine types, mn [S] (the block's minimum). lane: [3, S] scratch."""
    n, S = x.shape
    hi, vmax, inv = lane[0], lane[1], lane[2]  # hi: the maximum, or the largest |x|; vmax: the value of largest |x|
    for s in range(S):
        # C scans with `v < min` / `v > max` from +-FLT_MAX (the first of equal extremes wins), or from max = +0.0
        # taking only a larger |v|
        mn[s] = FLT_MAX if with_min else F32(0)
        hi[s] = -FLT_MAX if with_min else F32(0)
        vmax[s] = F32(0)
    for i in range(n):
        for s in range(S):
            if with_min:
                if x[i, s] < mn[s]:
                    mn[s] = x[i, s]
                if x[i, s] > hi[s]:
                    hi[s] = x[i, s]
            elif hi[s] < abs(x[i, s]):
                hi[s] = abs(x[i, s])
                vmax[s] = x[i, s]
    for s in range(S):
        d[s] = (hi[s] - mn[s]) / F32(levels - 1) if with_min else vmax[s] / F32(-(levels // 2))
        inv[s] = F32(1) / d[s] if d[s] != F32(0) else F32(0)
    offset = F32(0.5) if with_min else F32(levels // 2) + F32(0.5)
    for i in range(n):
        for s in range(S):
            v = (x[i, s] - mn[s]) * inv[s] if with_min else x[i, s] * inv[s]
            # C truncates with an (int8_t) cast; for finite input the value never passes levels - 1
            L[i, s] = min(levels - 1, np.int8(np.int32(v + offset)))


@numba.njit(**JIT)
def _legacy_rows(rows: np.ndarray, qw: np.ndarray | None, out: np.ndarray, levels: int, with_min: bool) -> None:
    """Q4_0/Q4_1/Q5_0/Q5_1 bytes of rows [R, P] into out [R, P/32*type_size]; qw [1 or R, P] or None.

    LANES blocks at a time. Reference path (qw None): ggml's quantize_row_qX_Y_ref. Weighted path
    (quantize_row_qX_Y_impl): the symmetric types use make_qx_quants and the affine ones make_qkx3_quants, with
    weight qw[i] * sqrt(sigma2 + x[i]^2), sigma2 the mean square of the block's whole row."""
    R, P = rows.shape
    per_row = P // 32
    xb = rows.reshape(-1, 32)  # every block of every row: [R*P/32, 32]
    yb = out.reshape(xb.shape[0], -1)
    x = np.empty((32, LANES), F32)
    L = np.empty((32, LANES), np.uint8)
    d = np.empty(LANES, F32)
    mn = np.zeros(LANES, F32)  # the symmetric types store no min
    packed = np.empty((yb.shape[1], LANES), np.uint8)
    work = search_work(32, LANES)
    if qw is not None:
        w = np.empty((32, LANES), F32)
        sigma2 = np.empty(R, F32)
        for r in range(R):
            sum_x2 = F32(0)
            for i in range(P):
                sum_x2 += rows[r, i] * rows[r, i]
            sigma2[r] = sum_x2 / F32(P)
    for b0 in range(0, xb.shape[0], LANES):
        count = gather_lanes(xb, b0, x)
        if qw is None:
            _reference_levels(x, levels, with_min, L, d, mn, work[2])
        else:
            for s in range(LANES):
                b = b0 + s
                for i in range(32):
                    if s < count:
                        q = qw[b // per_row if qw.shape[0] > 1 else 0, 32 * (b % per_row) + i]
                        w[i, s] = q * np.sqrt(sigma2[b // per_row] + x[i, s] * x[i, s])
                    else:
                        w[i, s] = F32(0)
            if with_min:
                search_min_scale(x, w, levels - 1, F32(-0.9), F32(0.05), 36, L, d, mn, work)
                for s in range(LANES):
                    mn[s] = -mn[s]  # the search returns -min; the block stores min
            else:
                search_symmetric_scale(x, w, levels // 2, L, d, work)
        _pack_legacy(L, d, mn, levels, with_min, packed, yb, b0, count)


@dataclass(frozen=True)
class LegacyType:
    """A 32-value block type: Q4_0/Q5_0 store d (symmetric), Q4_1/Q5_1 store d and a min (affine)."""

    qtype: GGMLQuantizationType
    levels: int  # 16 (4-bit) or 32 (5-bit: the fifth bits go to a 32-bit qh)
    with_min: bool  # affine (_1) or symmetric (_0)

    def quantize(self, rows: np.ndarray, imatrix: np.ndarray | None) -> np.ndarray:
        """rows [R, P] (P % 32 == 0), importance [P], [R, P] or None -> bytes [R, P/32*type_size]."""
        block_size, type_size = GGML_QUANT_SIZES[self.qtype]
        return quantize_with(
            _legacy_rows, rows, imatrix, rows.shape[1] // block_size * type_size, self.levels, self.with_min
        )


# --- the tables ------------------------------------------------------------------------------------------------------

QUANTIZERS: dict[GGMLQuantizationType, Quantizer] = {
    **kquants.KQUANTIZERS,
    T.Q4_0: LegacyType(T.Q4_0, levels=16, with_min=False).quantize,
    T.Q4_1: LegacyType(T.Q4_1, levels=16, with_min=True).quantize,
    T.Q5_0: LegacyType(T.Q5_0, levels=32, with_min=False).quantize,
    T.Q5_1: LegacyType(T.Q5_1, levels=32, with_min=True).quantize,
    T.Q8_0: _unweighted(T.Q8_0),
    T.F16: _unweighted(T.F16),
    T.BF16: _unweighted(T.BF16),
    T.F32: _unweighted(T.F32),
}

# llama-quantize's tensor_type_fallback (src/llama-quant.cpp): a 256-block type whose rows do not split into
# super-blocks falls back to a 32-block type of similar size; if that does not fit either, F16.
FALLBACK: dict[GGMLQuantizationType, GGMLQuantizationType] = {
    T.Q4_K: T.Q5_0,
    T.Q5_K: T.Q5_1,
    T.Q6_K: T.Q8_0,
}


def _torch_quantizers(device: str) -> dict[GGMLQuantizationType, Quantizer]:
    import torch  # imported on first use: torch takes a second to import

    from moeprep.quant import kquants_torch

    if device == "cuda" and not torch.cuda.is_available():
        raise MoeprepError(
            f"--device cuda: torch {torch.__version__} sees no CUDA GPU (torch.cuda.is_available() "
            f"is False); use --device cpu"
        )
    return kquants_torch.quantizers_on(device)


# --device -> the types that device quantizes itself, built on first use; a type missing there runs on the CPU.
DEVICES: dict[str, Callable[[], dict[GGMLQuantizationType, Quantizer]]] = {
    "cpu": lambda: QUANTIZERS,
    "cuda": lambda: _torch_quantizers("cuda"),
}


@functools.cache
def quantizers_on(device: str) -> dict[GGMLQuantizationType, Quantizer]:
    """The quantizers `device` runs itself ("cpu": every type; "cuda": Q4_K, Q5_K, Q6_K). MoeprepError if there is
    no such device."""
    if device not in DEVICES:
        raise MoeprepError(f"unknown device {device!r}; choose one of {', '.join(DEVICES)}")
    return DEVICES[device]()


def _supported(qtype: GGMLQuantizationType) -> None:
    if qtype not in QUANTIZERS:
        names = ", ".join(t.name for t in QUANTIZERS)
        raise MoeprepError(f"moeprep cannot quantize to {qtype.name}; choose one of {names}")


def choose_type(target: GGMLQuantizationType, n_per_row: int) -> tuple[GGMLQuantizationType, bool]:
    """The type a row of n_per_row values can take, as llama-quantize picks it. -> (type, fell_back)."""
    _supported(target)
    if n_per_row % GGML_QUANT_SIZES[target][0] == 0:
        return target, False
    # a 32-block type has nothing smaller to demote to: only the F16 check below applies
    fallback = FALLBACK.get(target, target)
    if n_per_row % GGML_QUANT_SIZES[fallback][0] != 0:
        fallback = T.F16
    return fallback, True


def _first_bad(a: np.ndarray) -> tuple[int, ...]:
    return tuple(int(i) for i in np.argwhere(~np.isfinite(a))[0])


def quantize_rows(
    rows: np.ndarray, qtype: GGMLQuantizationType, imatrix: np.ndarray | None = None, device: str = "cpu"
) -> np.ndarray:
    """Bytes of rows [R, P] in qtype, as ggml_quantize_chunk writes them. -> uint8 [R, P/block*type_size].

    imatrix: importance [P] for all rows, or [R, P] one per row (e.g. the expert of each row); None for the
    reference path. Rows and importance must be finite; P must fit the type's block (see choose_type).
    device: where to quantize (see quantizers_on); the bytes are the same on every device."""
    _supported(qtype)
    rows = np.asarray(rows, dtype=F32)
    if rows.ndim != 2:
        raise MoeprepError(f"quantize_rows needs a 2-D array of rows, got shape {rows.shape}")
    n_rows, n_per_row = rows.shape
    block_size = GGML_QUANT_SIZES[qtype][0]
    if n_per_row % block_size != 0:
        raise MoeprepError(
            f"rows of {n_per_row} values do not split into {qtype.name} blocks of {block_size}; "
            f"use choose_type() to pick the fallback type llama-quantize would use"
        )
    if not np.isfinite(rows).all():
        bad = int((~np.isfinite(rows)).sum())
        raise MoeprepError(
            f"cannot quantize to {qtype.name}: {bad} NaN/Inf value(s) in the input, first at "
            f"[row, column] {list(_first_bad(rows))}; the source tensor is corrupt"
        )
    if imatrix is not None:
        imatrix = np.asarray(imatrix, dtype=F32)
        if imatrix.shape not in ((n_per_row,), (n_rows, n_per_row)):
            raise MoeprepError(
                f"importance matrix of shape {imatrix.shape} does not fit rows of shape {rows.shape}; "
                f"expected ({n_per_row},) or ({n_rows}, {n_per_row})"
            )
        if not np.isfinite(imatrix).all():
            raise MoeprepError(
                f"importance matrix has NaN/Inf values (first at {list(_first_bad(imatrix))}); "
                f"regenerate it with llama-imatrix"
            )
    return quantizers_on(device).get(qtype, QUANTIZERS[qtype])(rows, imatrix)
