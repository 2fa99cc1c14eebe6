"""Q4_K and Q5_K: super-blocks of 256 values in eight sub-blocks of 32, each with a 6-bit scale and a 6-bit min.

Without an importance matrix ggml runs its reference quantizer (`quantize_row_q4_K_ref`, `quantize_row_q5_K_ref`);
with one, the importance-weighted search (`quantize_q4_K` / `quantize_q5_K` with `quant_weights`). Both are written
here again, from the algorithm, as one numba row kernel: the sub-blocks' affine search runs on LANES sub-blocks at
once (moeprep.quant.searches); the rest of a super-block (its scale quantization, fp16, requantization, packing) is
scalar code, one block at a time, as in the C.
"""

from __future__ import annotations

import numba
import numpy as np
from gguf import QK_K

from moeprep.quant.jit import F32, JIT
from moeprep.quant.scalars import fp16_bits, fp16_value, nearest_int
from moeprep.quant.searches import GROUP_MAX_EPS, LANES, gather_lanes, search_min_scale, search_work


@numba.njit(**JIT)
def _search_block_scale(x: np.ndarray, nmax: int, qw: np.ndarray, L: np.ndarray) -> np.float32:
    """Quantize the sub-block scales (or mins) of one super-block to 0..nmax, ggml's make_qp_quants.

    x, qw: [n] float32 (n sub-blocks). L: [n] uint8, receives the levels; a negative level wraps as in C's uint8_t
    store (Q4_K packs it as is). Returns the block scale. Eight values, once per super-block: plain scalar code."""
    n = x.shape[0]
    nmax_f = F32(nmax)
    xmax = F32(0)
    for i in range(n):  # MAX(max, x[i]) from 0, with C's comparison order
        xmax = xmax if xmax > x[i] else x[i]
    if xmax < GROUP_MAX_EPS:
        L[:] = 0
        return F32(0)

    iscale = nmax_f / xmax
    for i in range(n):
        L[i] = nearest_int(iscale * x[i])
    scale = F32(1) / iscale
    best_mse = F32(0)
    for i in range(n):
        diff = x[i] - scale * F32(L[i])
        best_mse += (qw[i] * diff) * diff
    for step in range(-4, 5):
        if step == 0:
            continue
        iscale_is = (F32(0.1) * F32(step) + nmax_f) / xmax
        scale_is = F32(1) / iscale_is
        mse = F32(0)
        for i in range(n):
            diff = x[i] - scale_is * F32(min(nmax, nearest_int(iscale_is * x[i])))
            mse += (qw[i] * diff) * diff
        if mse < best_mse:
            best_mse = mse
            iscale = iscale_is

    sumlx = F32(0)
    suml2 = F32(0)
    for i in range(n):
        l = min(nmax, nearest_int(iscale * x[i]))
        L[i] = l  # the sums take the int level, the refinement the stored (wrapped) one, as in C
        sumlx += (qw[i] * x[i]) * F32(l)
        suml2 += (qw[i] * F32(l)) * F32(l)
    for _ in range(5):  # coordinate refinement, until a pass changes nothing
        changed = False
        for i in range(n):
            li = F32(L[i])
            slx = sumlx - (qw[i] * x[i]) * li
            sl2 = suml2 - (qw[i] * li) * li
            if slx > F32(0) and sl2 > F32(0):
                new_l = min(nmax, nearest_int((x[i] * sl2) / slx))
                if new_l != L[i]:
                    slx += (qw[i] * x[i]) * F32(new_l)
                    sl2 += (qw[i] * F32(new_l)) * F32(new_l)
                    if (slx * slx) * suml2 > (sumlx * sumlx) * sl2:
                        L[i] = new_l
                        sumlx = slx
                        suml2 = sl2
                        changed = True
        if not changed:
            break
    return sumlx / suml2 if suml2 > F32(0) else F32(0)


@numba.njit(**JIT)
def k_min_rows(
    rows: np.ndarray,
    qw: np.ndarray | None,
    out: np.ndarray,
    nmax: int,
    rmin: np.float32,
    rdelta: np.float32,
    nstep: int,
    clamp_weighted_levels: bool,
) -> None:
    """Q4_K (nmax 15) or Q5_K (nmax 31) bytes of rows [R, P] into out [R, B*type_size]; qw [1 or R, P] or None.

    Eight sub-blocks of 32 per super-block, each with a 6-bit scale and a 6-bit min; the reference path searches
    with (rmin, rdelta, nstep), the weighted one as ggml's quantize_row_qX_K_impl. clamp_weighted_levels: ggml
    clamps the weighted path's scale levels to 63 for Q5_K only; for Q4_K an out-of-range level (a negative
    sub-block scale wraps to e.g. 250) is packed as is.
    Q4_K block: d, dmin (fp16), scales[12], qs[128]: 64-value groups, the first 32 in the low nibbles, the next 32 high.
    Q5_K block: d, dmin, scales[12], qh[32] (value group g sets bit g of qh[l]), qs[128] as Q4_K's low 4 bits."""
    P = rows.shape[1]
    xb = rows.reshape(-1, QK_K)  # [R*B, 256]
    xs = rows.reshape(-1, 32)  # [R*B*8, 32]
    yb = out.reshape(xb.shape[0], -1)
    x = np.empty((32, LANES), F32)
    w = np.empty((32, LANES), F32)
    L = np.empty((32, LANES), np.uint8)
    scales = np.empty(LANES, F32)
    mins = np.empty(LANES, F32)
    sw = np.empty(LANES, F32)
    spread = np.empty(LANES, F32)  # per lane: the reference weight's av_x, or the weighted path's sigma2
    work = search_work(32, LANES)
    ls = np.empty(8, np.uint8)
    lm = np.empty(8, np.uint8)
    Lb = np.empty(QK_K, np.uint8)
    for b0 in range(0, xb.shape[0], LANES // 8):
        count = gather_lanes(xs, 8 * b0, x) // 8
        if qw is None:
            for s in range(LANES):  # weight av_x + |x|, av_x the RMS of the sub-block
                sum_x2 = F32(0)
                for i in range(32):
                    sum_x2 += x[i, s] * x[i, s]
                spread[s] = np.sqrt(sum_x2 / F32(32))
            for i in range(32):
                for s in range(LANES):
                    w[i, s] = spread[s] + abs(x[i, s])
            search_min_scale(x, w, nmax, rmin, rdelta, nstep, L, scales, mins, work)
        else:
            w[:] = F32(0)
            for g in range(count):  # weight qw * sqrt(sigma2 + x^2), sigma2 twice the super-block's mean square
                b = b0 + g
                sum_x2 = F32(0)
                for i in range(QK_K):
                    sum_x2 += xb[b, i] * xb[b, i]
                q = qw[b // (P // QK_K) if qw.shape[0] > 1 else 0, QK_K * (b % (P // QK_K)) :]
                for j in range(8):
                    spread[8 * g + j] = F32(2) * sum_x2 / F32(QK_K)
                    for i in range(32):
                        w[i, 8 * g + j] = q[32 * j + i]
            for i in range(32):
                for s in range(LANES):
                    w[i, s] = w[i, s] * np.sqrt(spread[s] + x[i, s] * x[i, s])
            for s in range(LANES):
                sum_w = F32(0)
                for i in range(32):
                    sum_w += w[i, s]
                sw[s] = sum_w
            search_min_scale(x, w, nmax, F32(-0.9), F32(0.05), 36, L, scales, mins, work)

        for g in range(count):
            y = yb[b0 + g]
            scales_g, mins_g = scales[8 * g : 8 * g + 8], mins[8 * g : 8 * g + 8]
            if qw is None:
                max_scale = F32(0)
                max_min = F32(0)
                for j in range(8):
                    if scales_g[j] > max_scale:
                        max_scale = scales_g[j]
                    if mins_g[j] > max_min:
                        max_min = mins_g[j]
                inv_scale = F32(63) / max_scale if max_scale > F32(0) else F32(0)
                inv_min = F32(63) / max_min if max_min > F32(0) else F32(0)
                for j in range(8):  # C narrows to uint8_t before clamping to 63
                    ls[j] = min(63, np.uint8(nearest_int(inv_scale * scales_g[j])))
                    lm[j] = min(63, np.uint8(nearest_int(inv_min * mins_g[j])))
                d_block = max_scale / F32(63)
                m_block = max_min / F32(63)
            else:
                d_block = _search_block_scale(scales_g, 63, sw[8 * g : 8 * g + 8], ls)
                m_block = _search_block_scale(mins_g, 63, sw[8 * g : 8 * g + 8], lm)
                if clamp_weighted_levels:
                    for j in range(8):
                        ls[j] = min(63, ls[j])
                        lm[j] = min(63, lm[j])

            d16 = fp16_bits(d_block)
            dmin16 = fp16_bits(m_block)
            y[0], y[1], y[2], y[3] = d16, d16 >> 8, dmin16, dmin16 >> 8
            packed = y[4:16]
            for j in range(8):  # ggml's 12-byte layout: 6 bits each, the high two bits of scales 4..7 in bytes 0..7
                if j < 4:
                    packed[j] = ls[j]
                    packed[j + 4] = lm[j]
                else:
                    packed[j + 4] = (ls[j] & 0xF) | ((lm[j] & 0xF) << 4)
                    packed[j - 4] |= (ls[j] >> 4) << 6
                    packed[j] |= (lm[j] >> 4) << 6

            # Requantize against the stored (fp16, 6-bit) scales; a sub-block whose scale is 0 keeps its search result.
            d = fp16_value(d16)
            dmin = fp16_value(dmin16)
            for j in range(8):
                if j < 4:  # ggml's get_scale_min_k4
                    sc, m = packed[j] & 63, packed[j + 4] & 63
                else:
                    sc = (packed[j + 4] & 0xF) | ((packed[j - 4] >> 6) << 4)
                    m = (packed[j + 4] >> 4) | ((packed[j] >> 6) << 4)
                d_sub = d * F32(sc)
                dm_sub = dmin * F32(m)
                for i in range(32):
                    if d_sub == F32(0):
                        Lb[32 * j + i] = L[i, 8 * g + j]
                    else:
                        Lb[32 * j + i] = min(max(nearest_int((xb[b0 + g, 32 * j + i] + dm_sub) / d_sub), 0), nmax)

            if nmax == 15:
                qs = y[16:144]
                for k in range(4):
                    for i in range(32):
                        qs[32 * k + i] = Lb[64 * k + i] | (Lb[64 * k + 32 + i] << 4)
            else:
                qh, qs = y[16:48], y[48:176]
                qh[:] = 0
                for k in range(4):
                    for i in range(32):
                        lo, hi = Lb[64 * k + i], Lb[64 * k + 32 + i]
                        qh[i] |= ((lo >> 4) << (2 * k)) | ((hi >> 4) << (2 * k + 1))
                        qs[32 * k + i] = (lo & 0xF) | ((hi & 0xF) << 4)
