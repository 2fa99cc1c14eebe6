"""Q4_K, Q5_K and Q6_K quantizers whose bytes equal ggml's (libggml's `ggml_quantize_chunk`).

Without an importance matrix ggml runs its reference quantizer (`quantize_row_qX_K_ref`); with one it runs the
importance-weighted search (`quantize_qX_K` with `quant_weights`). Both are written here again, from the algorithm,
as numba kernels. The scale searches (`search_min_scale`, `search_symmetric_scale`, shared with the 32-value types
in registry.py) run on LANES sub-blocks at once: element-major arrays [n, S] with the loop over the S lanes
innermost, so that LLVM turns it into SIMD instructions while each lane's running sums still add in C's order. A
candidate scale costs one pass over data in L1 cache, where numpy made a pass over memory per float operation and
the C makes a scalar pass per sub-block. What the C decides per sub-block (an early return, taking a better
candidate) is a per-lane flag. The rest of a super-block (its scale quantization, fp16, requantization, packing) is
scalar code, one block at a time, as in the C.

Bit-exactness rests on these habits, each mirroring what the C does:
  * every value is float32: numba types `float32 op float32` as float32, but a Python float literal or an int mixed
    with a float32 gives float64, so every constant is an `F32(...)` and every integer level is converted with
    `F32(l)` before it meets a float;
  * the C's association order (`w*l*x` is `(w*l)*x`), and no fused multiply-add: the kernels are compiled without
    fastmath, so LLVM neither contracts a*b+c nor reorders a running sum `s += t[i]`. Its SIMD runs across lanes,
    which are independent, so vectorising changes no lane's operations or their order;
  * `nearest_int` is ggml's magic-number trick on the float32 bits, so out-of-range values (huge or overflowing
    inputs, a search that drifted) wrap the same way;
  * integer stores narrow like C casts (storing an int into a uint8 array or `np.int8(v)` wraps), and fp16 is
    `fp16_bits`, round-to-nearest-even like GGML_FP32_TO_FP16 (numba has no float16 scalar type);
  * `error_model="numpy"`: a float division by zero gives inf or NaN, as in C, instead of raising.

The kernels are compiled on first use and cached on disk (`cache=True`; see `_numba_cache_usable`), and release the
GIL (`nogil=True`), so moeprep.quant.quantize's thread pool runs row chunks in parallel.

Shapes: R rows, P values per row, B = P/256 super-blocks of QK_K = 256 values; a search works on [n, S], n values
of each of S groups (sub-blocks or blocks; S = LANES in the kernels).
Rows must be finite float32 (`registry.quantize_rows` checks); P must be a multiple of 256.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import numba
import numpy as np
from gguf import GGML_QUANT_SIZES, QK_K, GGMLQuantizationType
from numba.misc.appdirs import AppDirs

F32 = np.float32

# ggml's GROUP_MAX_EPS: a group whose largest magnitude is below this is stored as all zeros.
GROUP_MAX_EPS = F32(1e-15)

MAGIC = F32(12582912.0)  # 1.5 * 2**23: adding it leaves round(v) in the low mantissa bits
_FP16_TINY = F32(2.0 ** -24)  # the smallest fp16 subnormal

# Groups searched at once, the lanes of the searches' vectorised inner loops: four Q4_K/Q5_K super-blocks (eight
# sub-blocks each), two of Q6_K (sixteen each), 32 blocks of the 32-value types.
LANES = 32


def _writable(folder: Path) -> bool:
    """Whether numba could cache in folder: it creates it and writes a file there, as numba checks."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError:
        return False
    return True


def _numba_cache_usable() -> bool:
    """Make sure numba's on-disk cache has a writable home; False if none can be found (compile in memory).

    numba caches next to the source (moeprep/quant/__pycache__), else in the user-wide cache (~/.cache/numba); with
    neither writable (a read-only install and a read-only home) `cache=True` raises at import. Then the cache goes
    to a folder in the system temp dir, through NUMBA_CACHE_DIR (numba reads it when it places a function's cache);
    a NUMBA_CACHE_DIR the user set wins."""
    if numba.config.CACHE_DIR:
        return True
    if _writable(Path(__file__).parent / "__pycache__") or _writable(Path(AppDirs("numba", False).user_cache_dir)):
        return True
    try:
        fallback = Path(tempfile.gettempdir()) / f"moeprep-numba-{getattr(os, 'getuid', lambda: 0)()}"
    except FileNotFoundError:  # no writable temp dir either
        return False
    if not _writable(fallback):
        return False
    numba.config.CACHE_DIR = os.environ["NUMBA_CACHE_DIR"] = str(fallback)
    return True


# Options of every kernel (see the module docstring). fastmath stays off: it would allow FMA and reassociation.
JIT = {"cache": _numba_cache_usable(), "nogil": True, "error_model": "numpy"}


@numba.njit(**JIT)
def nearest_int(v: np.float32) -> int:
    """ggml's nearest_int: add 1.5 * 2**23 and read the low mantissa bits. float32 -> int.

    Equal to round-half-even for |v| <= 4194303; beyond that (or for inf/NaN) it wraps exactly as the C does."""
    bits = F32(F32(v) + MAGIC).view(np.int32)
    return (bits & 0x007FFFFF) - 0x00400000


@numba.njit(**JIT)
def fp16_bits(v: np.float32) -> int:
    """GGML_FP32_TO_FP16: float32 -> fp16 bits (0..0xFFFF), rounded to nearest even. Overflow gives inf; a NaN keeps
    its sign and top payload bits and is quieted, as x86's F16C does (x86's default NaN 0xFFC00000 -> 0xFE00)."""
    f = F32(v).view(np.uint32)
    sign = (f >> 16) & 0x8000
    a = f & 0x7FFFFFFF
    if a > 0x7F800000:  # NaN
        return sign | 0x7E00 | ((a >> 13) & 0x3FF)
    if a >= 0x477FF000:  # inf, and 65520 and above, which round to 65536
        return sign | 0x7C00
    if a >= 0x38800000:  # normal fp16 (>= 2**-14): rebias the exponent by 127 - 15, keep 10 mantissa bits
        h = (a - 0x38000000) >> 13
        dropped, half = a & 0x1FFF, 0x1000
    else:  # subnormal fp16 or zero: the float32 significand with its implicit bit, in units of 2**-24
        shift = 126 - (a >> 23)
        if shift > 24:  # below 2**-25: rounds to zero
            return sign
        m = (a & 0x7FFFFF) | 0x800000
        h = m >> shift
        dropped, half = m & ((1 << shift) - 1), 1 << (shift - 1)
    if dropped > half or (dropped == half and h & 1):
        h += 1  # a carry out of the mantissa is the next binade, as IEEE rounding wants
    return sign | h


@numba.njit(**JIT)
def fp16_value(h: int) -> np.float32:
    """GGML_FP16_TO_FP32 of fp16 bits: the stored scale as the C reads it back. Exact."""
    sign = (h & 0x8000) << 16
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    if e == 0:  # zero or subnormal: m * 2**-24 is exact in float32
        v = F32(m) * _FP16_TINY
        return -v if sign else v
    bits = sign | (0x7F800000 if e == 31 else (e + 112) << 23) | (m << 13)
    return np.uint32(bits).view(np.float32)


@numba.njit(**JIT)
def search_work(n: int, S: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Scratch for the searches over [n, S] groups, allocated once per kernel call rather than once per search:
    levels [n, S] uint8, terms [n, S] float32, per-lane values [12, S] float32, per-lane flags [2, S] bool."""
    return np.empty((n, S), np.uint8), np.empty((n, S), F32), np.empty((12, S), F32), np.empty((2, S), np.bool_)


@numba.njit(**JIT)
def search_min_scale(x: np.ndarray, w: np.ndarray, nmax: int, rmin: np.float32, rdelta: np.float32, nstep: int,
                     L: np.ndarray, scale: np.ndarray, the_min: np.ndarray,
                     work: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]) -> None:
    """Affine search `x ~ scale*L + min` (L in 0..nmax, min <= 0), ggml's make_qkx2_quants / make_qkx3_quants,
    for S groups at once. With weights given and no mean-absolute error the two C functions do the same arithmetic.

    x, w: [n, S] float32, value i of group s at [i, s]. Writes L [n, S] uint8, scale [S] and the_min [S] (= -min).
    work: search_work(n, S)."""
    n, S = x.shape
    nmax_f = F32(nmax)
    Laux, _, lane, flags = work
    better, flat = flags[0], flags[1]
    xmin, xmax, sum_w, sum_x, best_error, iscale = lane[0], lane[1], lane[2], lane[3], lane[4], lane[5]
    sum_l, sum_l2, sum_xl, this_scale, this_min, error = lane[6], lane[7], lane[8], lane[9], lane[10], lane[11]

    for s in range(S):
        xmin[s] = x[0, s]
        xmax[s] = x[0, s]
        sum_w[s] = w[0, s]
        sum_x[s] = w[0, s] * x[0, s]
    for i in range(1, n):
        for s in range(S):
            # C keeps the first of equal minima (`x[i] < min`), which decides the sign of a zero min Q4_1/Q5_1 store
            if x[i, s] < xmin[s]:
                xmin[s] = x[i, s]
            if x[i, s] > xmax[s]:
                xmax[s] = x[i, s]
            sum_w[s] += w[i, s]
            sum_x[s] += w[i, s] * x[i, s]
    for s in range(S):
        if xmin[s] > F32(0):
            xmin[s] = F32(0)
        flat[s] = xmax[s] == xmin[s]  # C returns here: L = 0, scale = 0; the search below runs on and is discarded
        iscale[s] = nmax_f / (xmax[s] - xmin[s])
        scale[s] = F32(1) / iscale[s]
        best_error[s] = F32(0)
    for i in range(n):
        for s in range(S):
            L[i, s] = min(max(nearest_int(iscale[s] * (x[i, s] - xmin[s])), 0), nmax)
            diff = scale[s] * F32(L[i, s]) + xmin[s] - x[i, s]
            best_error[s] += w[i, s] * (diff * diff)

    for step in range(nstep + 1):
        for s in range(S):
            # C reads the running `min` here, so the candidate grid moves when a better fit is found
            iscale[s] = (rmin + rdelta * F32(step) + nmax_f) / (xmax[s] - xmin[s])
            sum_l[s] = F32(0)
            sum_l2[s] = F32(0)
            sum_xl[s] = F32(0)
        for i in range(n):
            for s in range(S):
                l = min(max(nearest_int(iscale[s] * (x[i, s] - xmin[s])), 0), nmax)
                Laux[i, s] = l
                wl = w[i, s] * F32(l)
                sum_l[s] += wl
                sum_l2[s] += wl * F32(l)
                sum_xl[s] += wl * x[i, s]
        for s in range(S):
            D = sum_w[s] * sum_l2[s] - sum_l[s] * sum_l[s]
            better[s] = D > F32(0) and not flat[s]
            this_scale[s] = (sum_w[s] * sum_xl[s] - sum_x[s] * sum_l[s]) / D
            this_min[s] = (sum_l2[s] * sum_x[s] - sum_l[s] * sum_xl[s]) / D
            if this_min[s] > F32(0):
                this_min[s] = F32(0)
                this_scale[s] = sum_xl[s] / sum_l2[s]
            error[s] = F32(0)
        for i in range(n):
            for s in range(S):
                diff = this_scale[s] * F32(Laux[i, s]) + this_min[s] - x[i, s]
                error[s] += w[i, s] * (diff * diff)
        for s in range(S):
            better[s] = better[s] and error[s] < best_error[s]
            if better[s]:
                best_error[s] = error[s]
                scale[s] = this_scale[s]
                xmin[s] = this_min[s]
        for i in range(n):
            for s in range(S):
                if better[s]:
                    L[i, s] = Laux[i, s]

    for s in range(S):
        the_min[s] = -xmin[s]
        if flat[s]:
            scale[s] = F32(0)
    for i in range(n):
        for s in range(S):
            if flat[s]:
                L[i, s] = 0


@numba.njit(inline="always", **JIT)
def _symmetric_levels(x: np.ndarray, w: np.ndarray, wx: np.ndarray, iscale: np.ndarray, nmax: int, L: np.ndarray,
                      sumlx: np.ndarray, suml2: np.ndarray) -> None:
    """One candidate of search_symmetric_scale: levels clamp(nearest_int(iscale*x), -nmax, nmax-1) + nmax into L,
    and per lane the sums of (w*x)*l and (w*l)*l, in C's order."""
    n, S = x.shape
    for s in range(S):
        sumlx[s] = F32(0)
        suml2[s] = F32(0)
    for i in range(n):
        for s in range(S):
            l = min(max(nearest_int(iscale[s] * x[i, s]), -nmax), nmax - 1)
            L[i, s] = l + nmax
            sumlx[s] += wx[i, s] * F32(l)
            suml2[s] += (w[i, s] * F32(l)) * F32(l)


@numba.njit(**JIT)
def search_symmetric_scale(x: np.ndarray, w: np.ndarray, nmax: int, L: np.ndarray, scale: np.ndarray,
                           work: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]) -> None:
    """Symmetric search `x ~ scale*(L - nmax)`, ggml's make_qx_quants with rmse_type 1, for S groups at once.

    x, w: [n, S] float32, value i of group s at [i, s] (ggml's default weight is x*x: the caller passes it).
    Writes L [n, S] uint8 (levels in 0..2*nmax-1) and scale [S]. work: search_work(n, S)."""
    n, S = x.shape
    nmax_f = F32(nmax)
    Laux, wx, lane, flags = work  # wx: C's `w*x[i]*l` is (w*x)*l, the first product the same for every candidate
    better = flags[0]
    amax, vmax, iscale, sumlx, suml2, best = lane[0], lane[1], lane[2], lane[3], lane[4], lane[5]

    for s in range(S):
        amax[s] = F32(0)
        vmax[s] = F32(0)
    for i in range(n):
        for s in range(S):
            wx[i, s] = w[i, s] * x[i, s]
            if abs(x[i, s]) > amax[s]:  # C keeps the first of equal largest |x|
                amax[s] = abs(x[i, s])
                vmax[s] = x[i, s]
    for s in range(S):
        iscale[s] = -nmax_f / vmax[s]
    _symmetric_levels(x, w, wx, iscale, nmax, L, sumlx, suml2)
    for s in range(S):
        scale[s] = sumlx[s] / suml2[s] if suml2[s] != F32(0) else F32(0)
        best[s] = scale[s] * sumlx[s]

    for step in range(-9, 10):
        if step == 0:
            continue
        for s in range(S):
            iscale[s] = -(nmax_f + F32(0.1) * F32(step)) / vmax[s]
        _symmetric_levels(x, w, wx, iscale, nmax, Laux, sumlx, suml2)
        for s in range(S):
            better[s] = suml2[s] > F32(0) and sumlx[s] * sumlx[s] > best[s] * suml2[s]
            if better[s]:
                scale[s] = sumlx[s] / suml2[s]
                best[s] = scale[s] * sumlx[s]
        for i in range(n):
            for s in range(S):
                if better[s]:
                    L[i, s] = Laux[i, s]

    for s in range(S):  # all zero: C returns L = 0, scale = 0 before searching
        if amax[s] < GROUP_MAX_EPS:
            scale[s] = F32(0)
    for i in range(n):
        for s in range(S):
            if amax[s] < GROUP_MAX_EPS:
                L[i, s] = 0


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
def gather_lanes(sub: np.ndarray, first: int, x: np.ndarray) -> int:
    """Sub-blocks first, first+1, ... of sub [M, n] into the lanes of x [n, S], element-major: sub-block first+s at
    x[:, s]. Lanes past the last sub-block are zeros, which every search treats as an all-zero group and which are
    never stored. Returns how many sub-blocks were gathered."""
    n, S = x.shape
    count = min(S, sub.shape[0] - first)
    for s in range(count):  # reads in order, writes strided: measured faster than the other way round
        for i in range(n):
            x[i, s] = sub[first + s, i]
    for i in range(n):
        for s in range(count, S):
            x[i, s] = F32(0)
    return count


@numba.njit(**JIT)
def _k_min_rows(rows: np.ndarray, qw: np.ndarray | None, out: np.ndarray, nmax: int, rmin: np.float32,
                rdelta: np.float32, nstep: int, clamp_weighted_levels: bool) -> None:
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
                q = qw[b // (P // QK_K) if qw.shape[0] > 1 else 0, QK_K * (b % (P // QK_K)):]
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
            scales_g, mins_g = scales[8 * g:8 * g + 8], mins[8 * g:8 * g + 8]
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
                d_block = _search_block_scale(scales_g, 63, sw[8 * g:8 * g + 8], ls)
                m_block = _search_block_scale(mins_g, 63, sw[8 * g:8 * g + 8], lm)
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


@numba.njit(**JIT)
def _q6_k_rows(rows: np.ndarray, qw: np.ndarray | None, out: np.ndarray) -> None:
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
                q = qw[b // (P // QK_K) if qw.shape[0] > 1 else 0, QK_K * (b % (P // QK_K)):]
                for j in range(16):
                    for i in range(16):
                        w[i, 16 * g + j] = q[16 * j + i]
        search_symmetric_scale(x, w, 32, L, scales, work)

        for g in range(count):
            y = yb[b0 + g]
            scales_g = scales[16 * g:16 * g + 16]
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
                ql, qh, Lh = y[64 * h:64 * h + 64], y[128 + 32 * h:160 + 32 * h], Lb[128 * h:128 * h + 128]
                for i in range(32):
                    ql[i] = (Lh[i] & 0xF) | ((Lh[i + 64] & 0xF) << 4)
                    ql[i + 32] = (Lh[i + 32] & 0xF) | ((Lh[i + 96] & 0xF) << 4)
                    qh[i] = ((Lh[i] >> 4) | ((Lh[i + 32] >> 4) << 2) | ((Lh[i + 64] >> 4) << 4)
                             | ((Lh[i + 96] >> 4) << 6))
            for j in range(16):
                y[192 + j] = sc[j]
            y[208], y[209] = d16, d16 >> 8


def quantize_with(kernel: Callable[..., None], rows: np.ndarray, imatrix: np.ndarray | None, row_bytes: int,
                  *params: object) -> np.ndarray:
    """Run a row kernel `kernel(rows, qw, out, *params)`. rows [R, P] float32, imatrix [P] or [R, P] -> [R, row_bytes].

    The kernel gets rows C-contiguous, qw as [1, P] (one importance for every row) or [R, P], or None."""
    rows = np.ascontiguousarray(rows, dtype=F32)
    qw = None if imatrix is None else np.ascontiguousarray(np.atleast_2d(imatrix), dtype=F32)
    out = np.empty((rows.shape[0], row_bytes), np.uint8)
    kernel(rows, qw, out, *params)
    return out


# Per type: the row kernel and its parameters. Q4_K and Q5_K: nmax, the reference search's (rmin, rdelta, nstep),
# and whether the weighted path clamps its scale levels to 63.
_KERNELS: dict[GGMLQuantizationType, tuple[Callable[..., None], tuple[object, ...]]] = {
    GGMLQuantizationType.Q4_K: (_k_min_rows, (15, F32(-1.0), F32(0.1), 20, False)),
    GGMLQuantizationType.Q5_K: (_k_min_rows, (31, F32(-0.5), F32(0.1), 15, True)),
    GGMLQuantizationType.Q6_K: (_q6_k_rows, ()),
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
