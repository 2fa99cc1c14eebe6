"""Q6_K: super-blocks of 256 values in sixteen sub-blocks of 16, each with an 8-bit signed scale.

ggml's reference quantizer (`quantize_row_q6_K_ref`) and its importance-weighted one (`quantize_q6_K` with
`quant_weights`) differ only in the search's weights, so one numba row kernel does both: the symmetric search runs
on LANES sub-blocks at once (moeprep.quant.searches), the block scale and packing one super-block at a time.
"""

from __future__ import annotations

import numba
import numpy as np
from gguf import QK_K

from moeprep.quant.jit import F32, JIT
from moeprep.quant.scalars import fp16_bits, fp16_value, nearest_int
from moeprep.quant.searches import GROUP_MAX_EPS, LANES, gather_lanes, search_symmetric_scale, search_work


@numba.njit(**JIT)
def q6_k_rows(rows: np.ndarray, qw: np.ndarray | None, out: np.ndarray) -> None:
    """Q6_K bytes of rows [R, P] into out [R, B*210]; qw [1 or R, P] or None. Sixteen sub-blocks of 16.

    Block: ql[128], qh[64], scales[16] (int8), d (fp16). Each 128-value half fills 64 bytes of ql (values l and
    l+64 share a byte, then l+32 and l+96) and 32 of qh (the high two bits of the four, two bits apart)."""
    P = rows.shape[1]
    xb = rows.reshape(-1, QK_K)
    xs = rows.reshape(-1, 16)  # [R*B*16, 16]
    yb = out.reshape(xb.shape[0], -1)
    x = np.empty((16, LANES), F32)
    w = np.empty((16, LANES), F32)
    L = np.empty((16, LANES), np.uint8)
    scales = np.empty(LANES, F32)
    work = search_work(16, LANES)
    sc = np.empty(16, np.int8)
    Lb = np.empty(QK_K, np.uint8)
    for b0 in range(0, xb.shape[0], LANES // 16):
        count = gather_lanes(xs, 16 * b0, x) // 16
        if qw is None:
            for i in range(16):
                for s in range(LANES):
                    w[i, s] = x[i, s] * x[i, s]
        else:  # ggml passes the importance straight through, without Q4_K's sqrt(sigma2 + x^2) factor
            w[:] = F32(0)
            for g in range(count):
                b = b0 + g
                q = qw[b // (P // QK_K) if qw.shape[0] > 1 else 0, QK_K * (b % (P // QK_K)) :]
                for j in range(16):
                    for i in range(16):
                        w[i, 16 * g + j] = q[16 * j + i]
        search_symmetric_scale(x, w, 32, L, scales, work)

        for g in range(count):
            y = yb[b0 + g]
            scales_g = scales[16 * g : 16 * g + 16]
            max_scale = F32(0)
            max_abs = F32(0)
            for j in range(16):  # signed scale of largest magnitude, first one on ties
                if abs(scales_g[j]) > max_abs:
                    max_abs = abs(scales_g[j])
                    max_scale = scales_g[j]
            if max_abs < GROUP_MAX_EPS:  # ggml memsets a block whose scales all vanish
                y[:] = 0
                continue

            iscale = F32(-128) / max_scale
            d16 = fp16_bits(F32(1) / iscale)
            d = fp16_value(d16)
            for j in range(16):
                sc[j] = np.int8(min(127, nearest_int(iscale * scales_g[j])))  # C's int8_t store wraps
                d_sub = d * F32(sc[j])
                for i in range(16):
                    if d_sub == F32(0):  # keeps its search result
                        Lb[16 * j + i] = L[i, 16 * g + j]
                    else:
                        Lb[16 * j + i] = min(max(nearest_int(xb[b0 + g, 16 * j + i] / d_sub), -32), 31) + 32

            for h in range(2):
                ql, qh, Lh = y[64 * h : 64 * h + 64], y[128 + 32 * h : 160 + 32 * h], Lb[128 * h : 128 * h + 128]
                for i in range(32):
                    ql[i] = (Lh[i] & 0xF) | ((Lh[i + 64] & 0xF) << 4)
                    ql[i + 32] = (Lh[i + 32] & 0xF) | ((Lh[i + 96] & 0xF) << 4)
                    qh[i] = (
                        (Lh[i] >> 4) | ((Lh[i + 32] >> 4) << 2) | ((Lh[i + 64] >> 4) << 4) | ((Lh[i + 96] >> 4) << 6)
                    )
            for j in range(16):
                y[192 + j] = sc[j]
            y[208], y[209] = d16, d16 >> 8
