"""Q4_K, Q5_K and Q6_K quantizers whose bytes equal ggml's (libggml's `ggml_quantize_chunk`).

Without an importance matrix ggml runs its reference quantizer (`quantize_row_qX_K_ref`); with one it runs the
importance-weighted search (`quantize_qX_K` with `quant_weights`). Both are written here again in numpy, from the
algorithm, and vectorised over every block at once: only the small fixed candidate loops (scale steps, refinement
passes) and the running sums are Python loops.

Bit-exactness rests on four habits, each mirroring what the C does:
  * every operation is float32, in the C's association order (`w*l*x` is `(w*l)*x`), with no fused multiply-add;
  * a running sum `s += t[i]` stays a running sum (`running_sum`): numpy's pairwise `sum` rounds differently;
  * `nearest_int` is ggml's magic-number trick on the float32 bits, so out-of-range values (huge or overflowing
    inputs, a search that drifted) wrap the same way; `np.rint` only where the value is provably in range;
  * integer stores narrow like C casts (`astype(np.uint8)` wraps), and fp16 is `np.float16`, round-to-nearest-even
    like GGML_FP32_TO_FP16.

Shapes: R rows, P values per row, B super-blocks of QK_K = 256 values, S sub-blocks, n values per sub-block.
The search arrays are element-major [n, S], so a running sum over a sub-block is n vector adds across all of S.
Rows must be finite float32 (`registry.quantize_rows` checks); P must be a multiple of 256.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, QK_K, GGMLQuantizationType

F32 = np.float32

# ggml's GROUP_MAX_EPS: a group whose largest magnitude is below this is stored as all zeros.
GROUP_MAX_EPS = F32(1e-15)

# Blocks per vectorised chunk: big enough to amortise the Python loops, small enough to stay in cache.
CHUNK_BLOCKS = 512

MAGIC = F32(12582912.0)  # 1.5 * 2**23: adding it leaves round(v) in the low mantissa bits


def nearest_int(v: np.ndarray) -> np.ndarray:
    """ggml's nearest_int: add 1.5 * 2**23 and read the low mantissa bits. [...] float32 -> [...] int32.

    Equal to round-half-even for |v| <= 4194303; beyond that (or for inf/NaN) it wraps exactly as the C does."""
    bits = (v + MAGIC).view(np.int32)
    return (bits & 0x007FFFFF) - 0x00400000


def _levels(v: np.ndarray, lo: int, hi: int, scratch: np.ndarray, out: np.ndarray) -> None:
    """out = max(lo, min(hi, nearest_int(v))) as float32, in place (scratch: int32 like v). Levels are small
    integers, exact in float32; the search then multiplies them as C multiplies its int levels."""
    np.add(v, MAGIC, out=scratch.view(F32))
    np.bitwise_and(scratch, 0x007FFFFF, out=scratch)
    np.subtract(scratch, 0x00400000, out=scratch)
    np.maximum(scratch, lo, out=scratch)
    np.minimum(scratch, hi, out=scratch)
    np.copyto(out, scratch, casting="unsafe")


def running_sum(terms: np.ndarray, start: np.ndarray | None = None) -> np.ndarray:
    """`acc += terms[i]` for i = 0..n-1 in order, as C's loop does. [n, ...] -> [...].

    start=None begins from 0.0f (C's `float s = 0;`); otherwise from a copy of start."""
    acc = np.zeros(terms.shape[1:], F32) if start is None else start.astype(F32, copy=True)
    for t in terms:
        acc += t
    return acc


def _to_fp16(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 -> (fp16 array, the fp16 value read back as float32), as GGML_FP32_TO_FP16 then GGML_FP16_TO_FP32."""
    h = v.astype(np.float16)
    return h, h.astype(F32)


def search_min_scale(x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float,
                     nstep: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Affine search `x ~ scale*L + min` (L in 0..nmax, min <= 0), ggml's make_qkx2_quants / make_qkx3_quants.

    With weights given and no mean-absolute error the two C functions do the same arithmetic.
    x, w: [n, S] float32. Returns scale [S], the_min = -min [S] and L [n, S] uint8."""
    n, S = x.shape
    nmax_f = F32(nmax)
    # C keeps the first of equal minima (`x[i] < min`), which decides the sign of a zero min that Q4_1/Q5_1 store
    xmin = np.take_along_axis(x, x.argmin(axis=0)[None], axis=0)[0]
    xmax = x.max(axis=0)
    sum_w = running_sum(w[1:], start=w[0])
    sum_x = running_sum(w[1:] * x[1:], start=w[0] * x[0])
    xmin = np.where(xmin > 0, F32(0), xmin)
    flat = xmax == xmin  # C returns early: L = 0, scale = 0

    v = np.empty_like(x)
    scratch = np.empty(x.shape, np.int32)
    L = np.empty_like(x)  # best levels so far, as float32
    terms = np.empty((n, 3, S), F32)  # per value: w*l, w*l*l, w*l*x, summed in one pass
    wl, wl2, wlx = terms[:, 0], terms[:, 1], terms[:, 2]

    iscale = nmax_f / (xmax - xmin)
    scale = F32(1) / iscale
    np.multiply(np.subtract(x, xmin, out=v), iscale, out=v)
    _levels(v, 0, nmax, scratch, L)
    np.multiply(L, scale, out=v)
    v += xmin
    v -= x
    v *= v
    v *= w  # w * diff^2: C's `w * (diff*diff)`, and float multiplication commutes
    best_error = running_sum(v)

    lf = np.empty_like(x)
    for step in range(nstep + 1):
        # C reads the running `min` here, so the candidate grid moves when a better fit is found
        iscale = (F32(rmin) + F32(rdelta) * F32(step) + nmax_f) / (xmax - xmin)
        np.multiply(np.subtract(x, xmin, out=v), iscale, out=v)
        _levels(v, 0, nmax, scratch, lf)
        np.multiply(w, lf, out=wl)
        np.multiply(wl, lf, out=wl2)
        np.multiply(wl, x, out=wlx)
        sum_l, sum_l2, sum_xl = running_sum(terms)
        D = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
        clamp = this_min > 0
        this_min = np.where(clamp, F32(0), this_min)
        this_scale = np.where(clamp, sum_xl / sum_l2, this_scale)
        np.multiply(lf, this_scale, out=v)
        v += this_min
        v -= x
        v *= v
        v *= w
        cur_error = running_sum(v)
        better = (D > 0) & (cur_error < best_error)
        np.copyto(L, lf, where=better)
        best_error = np.where(better, cur_error, best_error)
        scale = np.where(better, this_scale, scale)
        xmin = np.where(better, this_min, xmin)

    L[:, flat] = 0
    scale = np.where(flat, F32(0), scale)
    return scale, -xmin, L.astype(np.uint8)


def search_symmetric_scale(x: np.ndarray, nmax: int, qw: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric search `x ~ scale*(L - nmax)`, ggml's make_qx_quants with rmse_type 1.

    x: [n, S] float32; qw: [n, S] weights, or None for ggml's default weight x*x.
    Returns scale [S] and L [n, S] uint8 in 0..2*nmax-1."""
    n, S = x.shape
    nmax_f = F32(nmax)
    w = x * x if qw is None else qw
    wx = w * x
    ax = np.abs(x)
    first_max = ax.argmax(axis=0)[None]  # C keeps the first index of the largest |x|
    amax = np.take_along_axis(ax, first_max, axis=0)[0]
    vmax = np.take_along_axis(x, first_max, axis=0)[0]
    all_zero = amax < GROUP_MAX_EPS

    lf = np.empty_like(x)
    L = np.empty_like(x)  # best signed levels so far, as float32
    terms = np.empty((n, 2, S), F32)  # per value: w*x*l, w*l*l

    def candidate(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # |iscale*x| <= nmax + 0.9 wherever amax >= GROUP_MAX_EPS, where nearest_int is exactly round-half-even;
        # the other lanes are discarded below
        np.rint(np.multiply(x, iscale, out=lf), out=lf)
        np.maximum(lf, F32(-nmax), out=lf)
        np.minimum(lf, F32(nmax - 1), out=lf)
        np.multiply(wx, lf, out=terms[:, 0])
        np.multiply(np.multiply(w, lf, out=terms[:, 1]), lf, out=terms[:, 1])
        sumlx, suml2 = running_sum(terms)
        return sumlx, suml2

    sumlx, suml2 = candidate(-nmax_f / vmax)
    L[:] = lf
    scale = np.where(suml2 != 0, sumlx / suml2, F32(0))
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        sumlx, suml2 = candidate(-(nmax_f + F32(0.1) * F32(step)) / vmax)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        np.copyto(L, lf, where=better)
        scale = np.where(better, sumlx / suml2, scale)
        best = np.where(better, scale * sumlx, best)

    L += nmax_f
    L[:, all_zero] = 0
    return np.where(all_zero, F32(0), scale), L.astype(np.uint8)


def _search_block_scale(x: np.ndarray, nmax: int, qw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Quantize the sub-block scales (or mins) of each super-block to 0..nmax, ggml's make_qp_quants.

    x, qw: [n, B] float32 (n sub-blocks per super-block). Returns block scale [B] and L [n, B] uint8."""
    n = x.shape[0]
    nmax_f = F32(nmax)
    xmax = np.zeros(x.shape[1], F32)
    for xi in x:  # MAX(max, x[i]) from 0, with C's comparison order
        xmax = np.where(xmax > xi, xmax, xi)
    all_zero = xmax < GROUP_MAX_EPS

    iscale = nmax_f / xmax
    L = nearest_int(iscale * x).astype(np.uint8)
    scale = F32(1) / iscale
    diff = x - scale * L.astype(F32)
    best_mse = running_sum((qw * diff) * diff)
    for step in range(-4, 5):
        if step == 0:
            continue
        iscale_is = (F32(0.1) * F32(step) + nmax_f) / xmax
        scale_is = F32(1) / iscale_is
        l = np.minimum(nmax, nearest_int(iscale_is * x))
        diff = x - scale_is * l.astype(F32)
        mse = running_sum((qw * diff) * diff)
        better = mse < best_mse
        best_mse = np.where(better, mse, best_mse)
        iscale = np.where(better, iscale_is, iscale)

    l = np.minimum(nmax, nearest_int(iscale * x))
    L = l.astype(np.uint8)
    lf = l.astype(F32)
    sumlx = running_sum((qw * x) * lf)
    suml2 = running_sum((qw * lf) * lf)
    # Coordinate refinement: C stops after a pass that changes nothing; an unchanged state makes every later pass a
    # no-op too, so running all five passes on every block gives the same result without a per-block stop flag.
    for _ in range(5):
        for i in range(n):
            w, xi = qw[i], x[i]
            li = L[i].astype(F32)
            slx = sumlx - (w * xi) * li
            sl2 = suml2 - (w * li) * li
            new_l = np.minimum(nmax, nearest_int((xi * sl2) / slx))
            nlf = new_l.astype(F32)
            slx_new = slx + (w * xi) * nlf
            sl2_new = sl2 + (w * nlf) * nlf
            take = ((slx > 0) & (sl2 > 0) & (new_l != L[i].astype(np.int32))
                    & ((slx_new * slx_new) * suml2 > (sumlx * sumlx) * sl2_new))
            L[i] = np.where(take, new_l.astype(np.uint8), L[i])
            sumlx = np.where(take, slx_new, sumlx)
            suml2 = np.where(take, sl2_new, suml2)

    scale = np.where(suml2 > 0, sumlx / suml2, F32(0))
    return np.where(all_zero, F32(0), scale), np.where(all_zero, np.uint8(0), L)


def _block_sigma2(xb: np.ndarray) -> np.ndarray:
    """2 * sum(x^2) / QK_K per super-block, summed in order as C does. xb: [B, 256] -> [B]."""
    xt = np.ascontiguousarray(xb.T)
    return F32(2) * running_sum(xt * xt) / F32(QK_K)


def _pack_scales_k4(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins into ggml's 12-byte layout. ls, lm: [B, 8] uint8 -> [B, 12] uint8."""
    lo_s, hi_s, lo_m, hi_m = ls[:, :4], ls[:, 4:], lm[:, :4], lm[:, 4:]
    return np.concatenate([lo_s | ((hi_s >> 4) << 6), lo_m | ((hi_m >> 4) << 6),
                           (hi_s & 0xF) | ((hi_m & 0xF) << 4)], axis=1)


def _unpack_scales_k4(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's get_scale_min_k4 for all eight sub-blocks. [B, 12] uint8 -> (sc [B, 8], m [B, 8]) uint8."""
    a, b, c = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = np.concatenate([a & 63, (c & 0xF) | ((a >> 6) << 4)], axis=1)
    m = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=1)
    return sc, m


def _quantize_k_min(xb: np.ndarray, qw: np.ndarray | None, nmax: int, ref_search: tuple[float, float, int],
                    clamp_weighted_levels: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The shared half of Q4_K and Q5_K: eight sub-blocks of 32, each with a 6-bit scale and a 6-bit min.

    xb: [B, 256] float32; qw: [B, 256] importance or None (reference path). ref_search: the reference path's
    (rmin, rdelta, nstep). clamp_weighted_levels: ggml clamps the weighted path's scale levels to 63 for Q5_K only;
    for Q4_K an out-of-range level (a negative sub-block scale wraps to e.g. 250) is packed as is.
    Returns d [B] fp16, dmin [B] fp16, packed scales [B, 12] uint8, L [B, 256] uint8 in 0..nmax."""
    B = xb.shape[0]
    x = np.ascontiguousarray(xb.reshape(B * 8, 32).T)  # [32, S], S = 8B
    if qw is None:
        av_x = np.sqrt(running_sum(x * x) / F32(32))
        weights = av_x + np.abs(x)
        scales, mins, L = search_min_scale(x, weights, nmax, *ref_search)
        scales, mins = scales.reshape(B, 8), mins.reshape(B, 8)
        max_scale = np.zeros(B, F32)
        max_min = np.zeros(B, F32)
        for j in range(8):
            max_scale = np.where(scales[:, j] > max_scale, scales[:, j], max_scale)
            max_min = np.where(mins[:, j] > max_min, mins[:, j], max_min)
        inv_scale = np.where(max_scale > 0, F32(63) / max_scale, F32(0))
        inv_min = np.where(max_min > 0, F32(63) / max_min, F32(0))
        ls = np.minimum(np.uint8(63), nearest_int(inv_scale[:, None] * scales).astype(np.uint8))
        lm = np.minimum(np.uint8(63), nearest_int(inv_min[:, None] * mins).astype(np.uint8))
        d_block = max_scale / F32(63)
        m_block = max_min / F32(63)
    else:
        sigma2 = np.repeat(_block_sigma2(xb), 8)  # [S]
        weights = np.ascontiguousarray(qw.reshape(B * 8, 32).T) * np.sqrt(sigma2 + x * x)
        sw = running_sum(weights)
        scales, mins, L = search_min_scale(x, weights, nmax, -0.9, 0.05, 36)
        # make_qp_quants sees the eight sub-blocks of a super-block as its n: [8, B]
        sw8 = np.ascontiguousarray(sw.reshape(B, 8).T)
        d_block, ls = _search_block_scale(np.ascontiguousarray(scales.reshape(B, 8).T), 63, sw8)
        m_block, lm = _search_block_scale(np.ascontiguousarray(mins.reshape(B, 8).T), 63, sw8)
        ls, lm = ls.T, lm.T
        if clamp_weighted_levels:
            ls, lm = np.minimum(np.uint8(63), ls), np.minimum(np.uint8(63), lm)

    packed = _pack_scales_k4(ls, lm)
    d16, d = _to_fp16(d_block)
    dmin16, dmin = _to_fp16(m_block)

    # Requantize against the stored (fp16, 6-bit) scales; a sub-block whose scale is 0 keeps its search result.
    sc, m = _unpack_scales_k4(packed)
    d_sub = d[:, None] * sc.astype(F32)  # [B, 8]
    dm_sub = dmin[:, None] * m.astype(F32)
    L = L.T.reshape(B, 8, 32)
    xs = xb.reshape(B, 8, 32)
    requant = np.clip(nearest_int((xs + dm_sub[..., None]) / d_sub[..., None]), 0, nmax)
    L = np.where((d_sub != 0)[..., None], requant, L).astype(np.uint8).reshape(B, QK_K)
    return d16, dmin16, packed, L


def _q4_k_blocks(xb: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    """[B, 256] float32 -> [B, 144] bytes: d, dmin (fp16), scales[12], qs[128] (two 4-bit values per byte)."""
    B = xb.shape[0]
    d16, dmin16, packed, L = _quantize_k_min(xb, qw, 15, (-1.0, 0.1, 20), clamp_weighted_levels=False)
    Lr = L.reshape(B, 4, 2, 32)  # 64-value groups: low nibble = first 32, high nibble = next 32
    qs = (Lr[:, :, 0] | (Lr[:, :, 1] << 4)).reshape(B, 128)
    return np.concatenate([d16.view(np.uint8).reshape(B, 2), dmin16.view(np.uint8).reshape(B, 2), packed, qs], axis=1)


def _q5_k_blocks(xb: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    """[B, 256] float32 -> [B, 176] bytes: d, dmin (fp16), scales[12], qh[32] (fifth bits), qs[128]."""
    B = xb.shape[0]
    d16, dmin16, packed, L = _quantize_k_min(xb, qw, 31, (-0.5, 0.1, 15), clamp_weighted_levels=True)
    Lr = L.reshape(B, 4, 2, 32)
    lo = Lr & 0xF
    qs = (lo[:, :, 0] | (lo[:, :, 1] << 4)).reshape(B, 128)
    hi = (Lr >> 4).reshape(B, 8, 32)  # value group g sets bit g of qh[l]
    qh = np.zeros((B, 32), np.uint8)
    for g in range(8):
        qh |= hi[:, g] << g
    return np.concatenate([d16.view(np.uint8).reshape(B, 2), dmin16.view(np.uint8).reshape(B, 2), packed, qh, qs],
                          axis=1)


def _q6_k_blocks(xb: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    """[B, 256] float32 -> [B, 210] bytes: ql[128], qh[64], scales[16] (int8), d (fp16). Sixteen sub-blocks of 16."""
    B = xb.shape[0]
    x = np.ascontiguousarray(xb.reshape(B * 16, 16).T)  # [16, S], S = 16B
    # ggml passes the importance straight through here, without the sqrt(sigma2 + x^2) factor of Q4_K/Q5_K
    w = None if qw is None else np.ascontiguousarray(qw.reshape(B * 16, 16).T)
    scales, L = search_symmetric_scale(x, 32, w)
    scales = scales.reshape(B, 16)

    max_scale = np.zeros(B, F32)
    max_abs = np.zeros(B, F32)
    for ib in range(16):  # signed scale of largest magnitude, first one on ties
        a = np.abs(scales[:, ib])
        upd = a > max_abs
        max_abs = np.where(upd, a, max_abs)
        max_scale = np.where(upd, scales[:, ib], max_scale)
    zero_block = max_abs < GROUP_MAX_EPS

    iscale = F32(-128) / max_scale
    d16, d = _to_fp16(F32(1) / iscale)
    sc = np.minimum(127, nearest_int(iscale[:, None] * scales)).astype(np.int8)  # [B, 16]
    d_sub = d[:, None] * sc.astype(F32)
    L = L.T.reshape(B, 16, 16)
    xs = xb.reshape(B, 16, 16)
    requant = np.clip(nearest_int(xs / d_sub[..., None]), -32, 31) + 32
    L = np.where((d_sub != 0)[..., None], requant, L).astype(np.uint8).reshape(B, 2, 4, 32)

    lo, hi = L & 0xF, L >> 4
    ql = np.concatenate([lo[:, :, 0] | (lo[:, :, 2] << 4), lo[:, :, 1] | (lo[:, :, 3] << 4)], axis=2).reshape(B, 128)
    qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).reshape(B, 64)
    out = np.concatenate([ql, qh, sc.view(np.uint8), d16.view(np.uint8).reshape(B, 2)], axis=1)
    out[zero_block] = 0  # ggml memsets a block whose scales all vanish
    return out


def quantize_in_chunks(row_fn: Callable[[np.ndarray, np.ndarray | None], np.ndarray], rows: np.ndarray,
                       imatrix: np.ndarray | None, row_bytes: int) -> np.ndarray:
    """Apply row_fn to cache-sized chunks of whole rows. rows [R, P] float32, imatrix [P] or [R, P] -> [R, row_bytes].

    row_fn gets a row chunk [r, P] and its importance [r, P] (or None) and returns [r, row_bytes] uint8."""
    R, P = rows.shape
    rows = np.ascontiguousarray(rows, dtype=F32)
    weights = None if imatrix is None else np.broadcast_to(np.asarray(imatrix, F32), rows.shape)
    out = np.empty((R, row_bytes), np.uint8)
    step = max(1, CHUNK_BLOCKS * QK_K // P)
    with np.errstate(all="ignore"):  # masked-out lanes divide by zero exactly where the C skips them
        for r0 in range(0, R, step):
            qw = None if weights is None else np.ascontiguousarray(weights[r0:r0 + step])
            out[r0:r0 + step] = row_fn(rows[r0:r0 + step], qw)
    return out


def _quantize(block_fn: Callable[[np.ndarray, np.ndarray | None], np.ndarray], qtype: GGMLQuantizationType,
              rows: np.ndarray, imatrix: np.ndarray | None) -> np.ndarray:
    """Super-block quantizer over rows [R, P]: block_fn maps [B, 256] (+ importance [B, 256]) to [B, type_size]."""
    assert rows.ndim == 2 and rows.shape[1] % QK_K == 0, rows.shape
    row_bytes = rows.shape[1] // QK_K * GGML_QUANT_SIZES[qtype][1]

    def row_fn(x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
        blocks = block_fn(x.reshape(-1, QK_K), None if qw is None else qw.reshape(-1, QK_K))
        return blocks.reshape(x.shape[0], row_bytes)

    return quantize_in_chunks(row_fn, rows, imatrix, row_bytes)


def quantize_q4_k(rows: np.ndarray, imatrix: np.ndarray | None = None) -> np.ndarray:
    """Q4_K bytes of rows [R, P] (P % 256 == 0) -> [R, P/256*144] uint8.

    imatrix [P] (or [R, P], one per row) selects ggml's importance-weighted search; None its reference path."""
    return _quantize(_q4_k_blocks, GGMLQuantizationType.Q4_K, rows, imatrix)


def quantize_q5_k(rows: np.ndarray, imatrix: np.ndarray | None = None) -> np.ndarray:
    """Q5_K bytes of rows [R, P] (P % 256 == 0) -> [R, P/256*176] uint8.

    imatrix [P] (or [R, P], one per row) selects ggml's importance-weighted search; None its reference path."""
    return _quantize(_q5_k_blocks, GGMLQuantizationType.Q5_K, rows, imatrix)


def quantize_q6_k(rows: np.ndarray, imatrix: np.ndarray | None = None) -> np.ndarray:
    """Q6_K bytes of rows [R, P] (P % 256 == 0) -> [R, P/256*210] uint8.

    imatrix [P] (or [R, P], one per row) selects ggml's importance-weighted search; None its reference path."""
    return _quantize(_q6_k_blocks, GGMLQuantizationType.Q6_K, rows, imatrix)


KQUANTIZERS: dict[GGMLQuantizationType, Callable[[np.ndarray, np.ndarray | None], np.ndarray]] = {
    GGMLQuantizationType.Q4_K: quantize_q4_k,
    GGMLQuantizationType.Q5_K: quantize_q5_k,
    GGMLQuantizationType.Q6_K: quantize_q6_k,
}
