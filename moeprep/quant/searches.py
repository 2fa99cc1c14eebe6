"""The scale searches every block quantizer shares, on LANES groups of values at once.

`search_min_scale` (affine, scale and min: Q4_K, Q5_K, Q4_1, Q5_1) and `search_symmetric_scale` (Q6_K, Q4_0,
Q5_0) run on element-major arrays [n, S], n values of each of S groups (sub-blocks or blocks; S = LANES in the
kernels), with the loop over the S lanes innermost, so that LLVM turns it into SIMD instructions while each lane's
running sums still add in C's order. A candidate scale costs one pass over data in L1 cache, where numpy made a
pass over memory per float operation and the C makes a scalar pass per sub-block. What the C decides per group (an
early return, taking a better candidate) is a per-lane flag. `gather_lanes` fills the lanes from a row's
sub-blocks. The arithmetic follows moeprep.quant.jit's habits.
"""

from __future__ import annotations

import numba
import numpy as np

from moeprep.quant.jit import F32, JIT
from moeprep.quant.scalars import nearest_int

# ggml's GROUP_MAX_EPS: a group whose largest magnitude is below this is stored as all zeros.
GROUP_MAX_EPS = F32(1e-15)

# Groups searched at once, the lanes of the searches' vectorised inner loops: four Q4_K/Q5_K super-blocks (eight
# sub-blocks each), two of Q6_K (sixteen each), 32 blocks of the 32-value types.
LANES = 32


@numba.njit(**JIT)
def search_work(n: int, S: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Scratch for the searches over [n, S] groups, allocated once per kernel call rather than once per search:
    levels [n, S] uint8, terms [n, S] float32, per-lane values [12, S] float32, per-lane flags [2, S] bool."""
    return np.empty((n, S), np.uint8), np.empty((n, S), F32), np.empty((12, S), F32), np.empty((2, S), np.bool_)


@numba.njit(**JIT)
def search_min_scale(
    x: np.ndarray,
    w: np.ndarray,
    nmax: int,
    rmin: np.float32,
    rdelta: np.float32,
    nstep: int,
    L: np.ndarray,
    scale: np.ndarray,
    the_min: np.ndarray,
    work: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
) -> None:
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
def _symmetric_levels(
    x: np.ndarray,
    w: np.ndarray,
    wx: np.ndarray,
    iscale: np.ndarray,
    nmax: int,
    L: np.ndarray,
    sumlx: np.ndarray,
    suml2: np.ndarray,
) -> None:
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
def search_symmetric_scale(
    x: np.ndarray,
    w: np.ndarray,
    nmax: int,
    L: np.ndarray,
    scale: np.ndarray,
    work: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
) -> None:
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
