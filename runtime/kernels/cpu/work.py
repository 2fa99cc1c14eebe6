"""What the CPU expert kernels share, whichever row dots they run (moe_rows.py's own or ggml's, ggml_rows.py):
grouping (token, k) pairs by expert, splitting the work into items, the activations, summing each token's pairs, and
launching a kernel on numba's threads."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable

import numba
import numpy as np
from numba import literal_unroll

from moeprep.quant.jit import F32, JIT

# Calling a table's function through literal_unroll is what numba's warning calls its first-class function feature.
warnings.filterwarnings(
    "ignore", ".*First-class function type feature is experimental", numba.core.errors.NumbaExperimentalFeatureWarning
)

# numba's workqueue threading layer (its fallback where neither TBB nor OpenMP is there) aborts the process on two
# launches at once, so launches hold _LAUNCH. (The OpenMP layer it picks otherwise starts a parallel region in about
# 5 us against workqueue's 80-100 us, which made a 4-layer decode step 1.8x slower, docs/history/benchmarks-log.md.)
_LAUNCH = threading.Lock()


# Fewest weight rows per work item: below this the per-item setup outweighs the rows.
MIN_ROWS_PER_ITEM = 16


# Work items per thread for each tensor, so that uneven items (experts chosen by more tokens) still balance.
ITEMS_PER_THREAD = 4


# Below this many rows (tokens or pairs to round, tokens to combine) a step runs on the calling thread: a parallel
# region costs more than the rows.
PARALLEL_MIN_ROWS = 8


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


# An activation is act(g, u, limit, up_limit) (float32 each); `limit` and `up_limit` are moe_rows' arguments, read by
# those that have them.


@numba.njit(**JIT)
def _swiglu(g: np.float32, u: np.float32, limit: np.float32, up_limit: np.float32) -> np.float32:
    return g / (F32(1) + np.exp(-g)) * u


@numba.njit(**JIT)
def _swiglu_oai(g: np.float32, u: np.float32, limit: np.float32, up_limit: np.float32) -> np.float32:
    """gpt-oss (alpha 1.702, its limit 7, not the argument): the gate capped at the limit, up clamped to +-limit and
    shifted by 1."""
    g = min(g, F32(7))
    u = max(min(u, F32(7)), F32(-7))
    return g / (F32(1) + np.exp(-F32(1.702) * g)) * (u + F32(1))


@numba.njit(**JIT)
def _swiglu_clamp(g: np.float32, u: np.float32, limit: np.float32, up_limit: np.float32) -> np.float32:
    """glm5-next (`swiglu_clamp_exp` in its GGUF): the gate capped at `limit` before SiLU, up clamped to +-limit."""
    g = min(g, limit)
    u = max(min(u, limit), -limit)
    return g / (F32(1) + np.exp(-g)) * u


@numba.njit(**JIT)
def _swiglu_limited(g: np.float32, u: np.float32, limit: np.float32, up_limit: np.float32) -> np.float32:
    """step35 (moerun.layers.ffn.swiglu_limited): SiLU of the gate capped at `limit` after it, up clamped to
    +-limit."""
    u = max(min(u, limit), -limit)
    return min(g / (F32(1) + np.exp(-g)), limit) * u


F16_MIN_NORMAL = 2.0**-14  # below it float16 values are subnormal, spaced 2^-24 apart
F16_SUBNORMAL_STEP = 2.0**-24


@numba.njit(**JIT)
def _round_f16(x: np.float32) -> np.float32:
    """x rounded to the nearest float16 value (ties to even), as a float32; |x| within float16's range."""
    if abs(x) < F32(F16_MIN_NORMAL):
        return F32(np.rint(x / F32(F16_SUBNORMAL_STEP)) * F32(F16_SUBNORMAL_STEP))
    bits = np.array([x], np.float32).view(np.int32)[0]
    bits = (bits + np.int32(0xFFF) + ((bits >> 13) & np.int32(1))) & np.int32(~0x1FFF)  # 23 -> 10 mantissa bits
    return np.array([bits], np.int32).view(np.float32)[0]


@numba.njit(**JIT)
def _geglu(g: np.float32, u: np.float32, limit: np.float32, up_limit: np.float32) -> np.float32:
    """Gemma (moerun.layers.ffn.geglu): GELU of the gate as ggml's CPU backend computes it (float16 table over
    [-10, 10], the gate itself above, 0 below), times up."""
    if g >= F32(10):
        return g * u
    if g <= F32(-10):
        return F32(0)
    h = _round_f16(g)
    gelu = F32(0.5) * h * (F32(1) + np.tanh(F32(0.7978845608028654) * h * (F32(1) + F32(0.044715) * h * h)))
    return _round_f16(gelu) * u


@numba.njit(**JIT)
def _relu_sqr(g: np.float32, u: np.float32, limit: np.float32, up_limit: np.float32) -> np.float32:
    """Nemotron-H's ungated experts: relu(u)^2, the gate not read."""
    r = max(u, F32(0))
    return r * r


@numba.njit(**JIT)
def _reglu(g: np.float32, u: np.float32, limit: np.float32, up_limit: np.float32) -> np.float32:
    """SmallThinker (moerun.layers.ffn.reglu): relu(gate) * up."""
    return max(g, F32(0)) * u


@numba.njit(**JIT)
def _situ(g: np.float32, u: np.float32, limit: np.float32, up_limit: np.float32) -> np.float32:
    """Kimi-K3 (moerun.layers.ffn.situ): beta tanh(g / beta) sigmoid(g) times up, itself saturated as
    up_beta tanh(u / up_beta) where up_beta > 0; beta is `limit`, up_beta `up_limit`."""
    a = limit * np.tanh(g * (F32(1) / limit)) * (F32(1) / (F32(1) + np.exp(-g)))
    if up_limit > F32(0):
        u = up_limit * np.tanh(u * (F32(1) / up_limit))
    return a * u


# Expert activations by name: moerun.layers.ACTIVATIONS'.
ACTIVATIONS: dict[str, Callable] = {
    "swiglu": _swiglu,
    "swiglu_oai": _swiglu_oai,
    "swiglu_clamp": _swiglu_clamp,
    "geglu": _geglu,
    "relu_sqr": _relu_sqr,
    "reglu": _reglu,
    "swiglu_limited": _swiglu_limited,
    "situ": _situ,
}


_ACTIVATION_CODES = {name: i for i, name in enumerate(ACTIVATIONS)}


_ACTIVATIONS = tuple(ACTIVATIONS.values())


@numba.njit(**JIT)
def _activate_item(code, limit, up_limit, item, order, g, u, h):
    """h = act(g, u, limit, up_limit) on the pairs and rows of a work item."""
    i = 0
    for act in literal_unroll(_ACTIVATIONS):
        if i == code:
            for j in range(item[1], item[2]):
                p = order[j]
                for r in range(item[3], item[4]):
                    h[p, r] = act(g[p, r], u[p, r], limit, up_limit)
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
