"""Which code quantizes each GGML type, and which type a row length forces (llama-quantize's fallbacks).

A quantizer maps rows [R, P] float32 and an optional importance matrix [P] (or [R, P]) to bytes [R, row_bytes],
equal to libggml's `ggml_quantize_chunk` for the same input:
  * Q4_K, Q5_K, Q6_K: moeprep.quant.kquants, both ggml paths;
  * Q4_0, Q4_1, Q5_0, Q5_1: below, both ggml paths. gguf-py has only the reference path, and it differs from ggml
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
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from moeprep.errors import MoeprepError
from moeprep.quant import kquants
from moeprep.quant.kquants import F32, quantize_in_chunks, running_sum, search_min_scale, search_symmetric_scale

Quantizer = Callable[[np.ndarray, np.ndarray | None], np.ndarray]
T = GGMLQuantizationType


def _unweighted(qtype: GGMLQuantizationType) -> Quantizer:
    """gguf-py's quantizer for a type whose ggml quantizer never reads the importance matrix."""
    def quantize(rows: np.ndarray, imatrix: np.ndarray | None) -> np.ndarray:
        with np.errstate(over="ignore"):  # beyond fp16's range ggml stores inf too
            out = gguf.quants.quantize(rows, qtype)
        return np.ascontiguousarray(out).view(np.uint8).reshape(rows.shape[0], -1)
    return quantize


@dataclass(frozen=True)
class LegacyType:
    """A 32-value block type: Q4_0/Q5_0 store d (symmetric), Q4_1/Q5_1 store d and a min (affine).

    Reference path: ggml's quantize_row_qX_Y_ref. Weighted path (quantize_row_qX_Y_impl): the symmetric types use
    make_qx_quants and the affine ones make_qkx3_quants, with weight qw[i] * sqrt(sigma2 + x[i]^2), sigma2 the mean
    square of the whole row."""
    qtype: GGMLQuantizationType
    levels: int     # 16 (4-bit) or 32 (5-bit: the fifth bits go to a 32-bit qh)
    with_min: bool  # affine (_1) or symmetric (_0)

    def reference(self, xb: np.ndarray) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        """xb [S, 32] -> d [S], min [S] or None, L [S, 32] uint8."""
        first = np.take_along_axis
        if self.with_min:
            # C scans with `v < min` / `v > max`: the first of equal extremes wins, which fixes a zero's sign
            mn = first(xb, xb.argmin(axis=1)[:, None], axis=1)[:, 0]
            mx = first(xb, xb.argmax(axis=1)[:, None], axis=1)[:, 0]
            d = (mx - mn) / F32(self.levels - 1)
            offset, shifted = F32(0.5), xb - mn[:, None]
        else:
            vmax = first(xb, np.abs(xb).argmax(axis=1)[:, None], axis=1)[:, 0]
            vmax = np.where(vmax != 0, vmax, F32(0))  # C starts from max = +0.0 and only takes a larger |v|
            d = vmax / F32(-(self.levels // 2))
            mn, offset, shifted = None, F32(self.levels // 2 + 0.5), xb
        inv = np.where(d != 0, F32(1) / d, F32(0))
        # C truncates with an (int8_t) or (uint8_t) cast; for finite input the value never passes levels - 1
        q = (shifted * inv[:, None] + offset).astype(np.int32).astype(np.int8)
        return d, mn, np.minimum(self.levels - 1, q).astype(np.uint8)

    def weighted(self, x: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        """x, w [32, S] (element-major) -> d [S], min [S] or None, L [S, 32] uint8."""
        if self.with_min:
            scale, the_min, L = search_min_scale(x, w, self.levels - 1, -0.9, 0.05, 36)
            return scale, -the_min, L.T
        scale, L = search_symmetric_scale(x, self.levels // 2, w)
        return scale, None, L.T

    def pack(self, d: np.ndarray, mn: np.ndarray | None, L: np.ndarray) -> np.ndarray:
        """-> [S, type_size]: d (fp16), [min (fp16)], [qh: bit 4 of value j as bit j], qs: values j, j+16 per byte."""
        parts = [d.astype(np.float16).view(np.uint8).reshape(-1, 2)]
        if mn is not None:
            parts.append(mn.astype(np.float16).view(np.uint8).reshape(-1, 2))
        if self.levels == 32:
            parts.append(np.packbits((L >> 4) & 1, axis=1, bitorder="little"))
        parts.append((L[:, :16] & 0xF) | ((L[:, 16:] & 0xF) << 4))
        return np.concatenate(parts, axis=1)

    def quantize(self, rows: np.ndarray, imatrix: np.ndarray | None) -> np.ndarray:
        block_size, type_size = GGML_QUANT_SIZES[self.qtype]
        return quantize_in_chunks(self._rows, rows, imatrix, rows.shape[1] // block_size * type_size)

    def _rows(self, x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
        """Row chunk [r, P] (+ importance [r, P]) -> bytes [r, row_bytes]."""
        R, P = x.shape
        if qw is None:
            return self.pack(*self.reference(x.reshape(-1, 32))).reshape(R, -1)
        xt = np.ascontiguousarray(x.T)  # [P, r]: the row's running sum of squares, in order
        sigma2 = np.repeat(running_sum(xt * xt) / F32(P), P // 32)  # [S]
        xs = np.ascontiguousarray(x.reshape(-1, 32).T)  # [32, S]
        weight = np.ascontiguousarray(qw.reshape(-1, 32).T) * np.sqrt(sigma2 + xs * xs)
        return self.pack(*self.weighted(xs, weight)).reshape(R, -1)


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
        raise MoeprepError(f"--device cuda: torch {torch.__version__} sees no CUDA GPU (torch.cuda.is_available() "
                           f"is False); use --device cpu")
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


def quantize_rows(rows: np.ndarray, qtype: GGMLQuantizationType, imatrix: np.ndarray | None = None,
                  device: str = "cpu") -> np.ndarray:
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
        raise MoeprepError(f"rows of {n_per_row} values do not split into {qtype.name} blocks of {block_size}; "
                           f"use choose_type() to pick the fallback type llama-quantize would use")
    if not np.isfinite(rows).all():
        bad = int((~np.isfinite(rows)).sum())
        raise MoeprepError(f"cannot quantize to {qtype.name}: {bad} NaN/Inf value(s) in the input, first at "
                           f"[row, column] {list(_first_bad(rows))}; the source tensor is corrupt")
    if imatrix is not None:
        imatrix = np.asarray(imatrix, dtype=F32)
        if imatrix.shape not in ((n_per_row,), (n_rows, n_per_row)):
            raise MoeprepError(f"importance matrix of shape {imatrix.shape} does not fit rows of shape {rows.shape}; "
                               f"expected ({n_per_row},) or ({n_rows}, {n_per_row})")
        if not np.isfinite(imatrix).all():
            raise MoeprepError(f"importance matrix has NaN/Inf values (first at {list(_first_bad(imatrix))}); "
                               f"regenerate it with llama-imatrix")
    return quantizers_on(device).get(qtype, QUANTIZERS[qtype])(rows, imatrix)
