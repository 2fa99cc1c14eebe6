"""The CPU expert kernels on ggml's row dot products (kernels/ggml_cpu.py) where the installed llama.cpp has them
for a tensor's type: the same plan and activations as moe_rows.py's kernels (work.py), ggml's input roundings and
dots.

numba's cache keys a compiled kernel by its own file only: the kernels here and in moe_rows.py compile work.py's
activations in, so a new activation there needs these files to change too (or their caches cleared) to be seen."""

from __future__ import annotations

import numba
import numpy as np

from moeprep.quant.jit import F32, JIT
from moerun.kernels import ggml_cpu
from moerun.kernels.cpu.work import (
    PARALLEL_MIN_ROWS,
    _activate_item,
    _combine,
    _items,
    _pairs,
)

# ---------------------------------------------------- the same, on ggml's row dot products where they are there

# A tensor's ggml kernel as the numba kernels take it: (vec_dot address, from_float address, bytes of one activation
# row in the dot's format); ggml_cpu.py.


@numba.njit(inline="always")
def _address(a: np.ndarray) -> np.int64:
    return np.int64(a.ctypes.data)


@numba.njit(parallel=True, **JIT)
def _quantize_rows(quantize, x, used, q):
    """Rows i of x (float32) with used[i] into row i of q, in the format of a ggml dot (its from_float); few rows on
    the calling thread."""
    if x.shape[0] < PARALLEL_MIN_ROWS:
        for t in range(x.shape[0]):
            if used[t]:
                ggml_cpu.from_float(quantize, _address(x[t]), _address(q[t]), x.shape[1])
    else:
        for t in numba.prange(x.shape[0]):
            if used[t]:
                ggml_cpu.from_float(quantize, _address(x[t]), _address(q[t]), x.shape[1])


@numba.njit(**JIT)
def _ggml_rows(dot, w, step, bias, item, order, act_row, q, n, y):
    """y[p, r] = row r of expert item[0] . q[act_row[p]] (n values; + its bias) over the item's pairs and rows;
    expert e is block e * step of w (ExpertBytes.kernel_step)."""
    e, row_bytes = item[0], np.int64(w.shape[2])
    base = _address(w) + e * step * w.shape[1] * row_bytes
    for j in range(item[1], item[2]):
        p = order[j]
        qp, yp = _address(q[act_row[p]]), _address(y[p])
        for r in range(item[3], item[4]):
            ggml_cpu.vec_dot(dot, n, yp + 4 * r, base + r * row_bytes, qp)
        if bias.shape[0]:
            for r in range(item[3], item[4]):
                y[p, r] += bias[e, r]


@numba.njit(**JIT)
def _ggml_gate_up_item(
    gate_dot,
    gate_w,
    gate_step,
    gate_b,
    up_dot,
    up_w,
    up_step,
    up_b,
    act_code,
    limit,
    up_limit,
    item,
    order,
    token,
    xg,
    xu,
    n,
    g,
    u,
    h,
):
    _ggml_rows(gate_dot, gate_w, gate_step, gate_b, item, order, token, xg, n, g)
    _ggml_rows(up_dot, up_w, up_step, up_b, item, order, token, xu, n, u)
    _activate_item(act_code, limit, up_limit, item, order, g, u, h)


@numba.njit(parallel=True, **JIT)
def _moe_ggml(
    items_wanted,
    x,
    ids,
    weights,
    gate_k,
    gate_w,
    gate_step,
    gate_b,
    up_k,
    up_w,
    up_step,
    up_b,
    down_k,
    down_w,
    down_step,
    down_b,
    act_code,
    limit,
    up_limit,
    out,
):
    """_moe with ggml's row dots (gate_k, up_k, down_k: the tensors' ggml kernels) and its roundings of the inputs."""
    bad, token, order, start, used = _pairs(ids, (gate_w.shape[0] - 1) // gate_step + 1)
    if bad >= 0:
        return bad
    P, T, D, I = token.shape[0], x.shape[0], x.shape[1], gate_w.shape[1]
    if P == 0:
        return -1
    gate_items = _items(start, I, items_wanted)
    down_items = _items(start, out.shape[1], items_wanted)
    xg = np.empty((T, gate_k[2]), np.uint8)
    _quantize_rows(gate_k[1], x, used, xg)
    xu = xg
    if up_k[1] != gate_k[1]:
        xu = np.empty((T, up_k[2]), np.uint8)
        _quantize_rows(up_k[1], x, used, xu)
    g, u, h = np.empty((P, I), F32), np.empty((P, I), F32), np.empty((P, I), F32)
    for it in numba.prange(gate_items.shape[0]):
        _ggml_gate_up_item(
            gate_k[0],
            gate_w,
            gate_step,
            gate_b,
            up_k[0],
            up_w,
            up_step,
            up_b,
            act_code,
            F32(limit),
            F32(up_limit),
            gate_items[it],
            order,
            token,
            xg,
            xu,
            D,
            g,
            u,
            h,
        )
    hq = np.empty((P, down_k[2]), np.uint8)
    _quantize_rows(down_k[1], h, np.ones(P, np.bool_), hq)
    y = np.empty((P, out.shape[1]), F32)
    pair = np.arange(P)
    for it in numba.prange(down_items.shape[0]):
        _ggml_rows(down_k[0], down_w, down_step, down_b, down_items[it], order, pair, hq, I, y)
    _combine(ids, weights, token, y, out)
    return -1


@numba.njit(parallel=True, **JIT)
def _matmul_ggml(items_wanted, x, experts, k, w, step, bias, y):
    """_matmul with ggml's row dot (k: the tensor's ggml kernel)."""
    bad, token, order, start, used = _pairs(experts, (w.shape[0] - 1) // step + 1)
    if bad >= 0:
        return bad
    items = _items(start, y.shape[1], items_wanted)
    q = np.empty((x.shape[0], k[2]), np.uint8)
    _quantize_rows(k[1], x, used, q)
    for it in numba.prange(items.shape[0]):
        _ggml_rows(k[0], w, step, bias, items[it], order, token, q, x.shape[1], y)
    return -1
