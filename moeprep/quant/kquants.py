"""Q4_K, Q5_K and Q6_K quantizers whose bytes equal ggml's (libggml's `ggml_quantize_chunk`).

Without an importance matrix ggml runs its reference quantizer (`quantize_row_qX_K_ref`); with one it runs the
importance-weighted search (`quantize_qX_K` with `quant_weights`). Both are numba row kernels: Q4_K and Q5_K in
moeprep.quant.q4_k_q5_k, Q6_K in moeprep.quant.q6_k, on the shared scale searches of moeprep.quant.searches;
moeprep.quant.jit says how the kernels keep ggml's bytes. This module is their entry point: one function per type
and the KQUANTIZERS table.

Shapes: R rows, P values per row, B = P/256 super-blocks of QK_K = 256 values.
Rows must be finite float32 (`registry.quantize_rows` checks); P must be a multiple of 256.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, QK_K, GGMLQuantizationType

from moeprep.quant.jit import F32, quantize_with
from moeprep.quant.q4_k_q5_k import k_min_rows
from moeprep.quant.q6_k import q6_k_rows

# Per type: the row kernel and its parameters. Q4_K and Q5_K: nmax, the reference search's (rmin, rdelta, nstep),
# and whether the weighted path clamps its scale levels to 63.
_KERNELS: dict[GGMLQuantizationType, tuple[Callable[..., None], tuple[object, ...]]] = {
    GGMLQuantizationType.Q4_K: (k_min_rows, (15, F32(-1.0), F32(0.1), 20, False)),
    GGMLQuantizationType.Q5_K: (k_min_rows, (31, F32(-0.5), F32(0.1), 15, True)),
    GGMLQuantizationType.Q6_K: (q6_k_rows, ()),
}


def _quantize(qtype: GGMLQuantizationType, rows: np.ndarray, imatrix: np.ndarray | None) -> np.ndarray:
    assert rows.ndim == 2 and rows.shape[1] % QK_K == 0, rows.shape
    kernel, params = _KERNELS[qtype]
    return quantize_with(kernel, rows, imatrix, rows.shape[1] // QK_K * GGML_QUANT_SIZES[qtype][1], *params)


def quantize_q4_k(rows: np.ndarray, imatrix: np.ndarray | None = None) -> np.ndarray:
    """Q4_K bytes of rows [R, P] (P % 256 == 0) -> [R, P/256*144] uint8.

    imatrix [P] (or [R, P], one per row) selects ggml's importance-weighted search; None its reference path."""
    return _quantize(GGMLQuantizationType.Q4_K, rows, imatrix)


def quantize_q5_k(rows: np.ndarray, imatrix: np.ndarray | None = None) -> np.ndarray:
    """Q5_K bytes of rows [R, P] (P % 256 == 0) -> [R, P/256*176] uint8.

    imatrix [P] (or [R, P], one per row) selects ggml's importance-weighted search; None its reference path."""
    return _quantize(GGMLQuantizationType.Q5_K, rows, imatrix)


def quantize_q6_k(rows: np.ndarray, imatrix: np.ndarray | None = None) -> np.ndarray:
    """Q6_K bytes of rows [R, P] (P % 256 == 0) -> [R, P/256*210] uint8.

    imatrix [P] (or [R, P], one per row) selects ggml's importance-weighted search; None its reference path."""
    return _quantize(GGMLQuantizationType.Q6_K, rows, imatrix)


KQUANTIZERS: dict[GGMLQuantizationType, Callable[[np.ndarray, np.ndarray | None], np.ndarray]] = {
    GGMLQuantizationType.Q4_K: quantize_q4_k,
    GGMLQuantizationType.Q5_K: quantize_q5_k,
    GGMLQuantizationType.Q6_K: quantize_q6_k,
}
