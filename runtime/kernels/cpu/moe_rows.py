"""Routed experts on the CPU, computed straight from their GGUF bytes in host memory (numba, multi-threaded, no GIL).

`moe_rows` runs gate, up and down of the experts the router chose for each token, reading each expert's rows from the
(E, rows, row_bytes) uint8 view of the memory-mapped GGUF. It does what llama.cpp's CPU backend does, in our own
code: each activation row is rounded once to 8-bit blocks (Q8_K, 256 values, for the K-quants and IQ4_XS; Q8_0, 32
values, for the 32-value types; kernels/rounding.py holds both roundings), then every weight block meets its activation
block in an integer dot product, scaled once per block:

    block value  = d * sc[s] * q - dmin * m[s]          (sub-block s; sc and m small integers, d and dmin floats)
    block . x    = xd * (d * sum_i (sc q)_i xq_i - dmin * sum_s m[s] * sum(xq)_s)

where x = xd * xq is the rounded activation block. The integer parts are exact; the float parts differ from a float64
dequantize-then-matmul only by float32 rounding (tests/runtime/test_cpu_experts.py). F16, BF16 and F32 experts take
a float32 dot product on the input rounded to their type instead.

Each type is a `Format`: its `unpack` decodes one weight row into int16 values `wq` that already carry their
sub-block's integer scale (so a block is one integer sum: `vpmaddwd` work), integer mins `mn` and per-block float
scales `dd` (d, dmin) (float types: float32 values `wf`), and its `dot` is the product above; `rounding` names the
activation rounding. The types of the common expert GGUFs (Q4_K, Q5_K, Q6_K, Q4_0, Q8_0) also have a `fused` dot that
decodes and multiplies a row in one pass, with the same integer sums and float steps (so the same bits): what an item
of one token (a decode step) takes, where a decoded row would be used once (2-3x faster per core than unpack + dot). Work is split into items (one expert, the tokens that chose it, a range of rows), run by numba's
`prange`; every output element is computed by one item with the same operations whatever the split, so any thread
count gives the same bits. A row is decoded once for all the tokens of its item.

A call is one compiled function, `_moe`, because the expert cache makes one call per layer per decode step for a
token's few missed experts, where a fixed cost weighs as much as the bytes: it plans (the pairs grouped by expert,
the items), rounds the inputs, runs one parallel loop whose item computes its gate rows, its up rows and then h =
act(g, u) on them, rounds each pair's h, runs a second parallel loop over the down items, and sums each token's
pairs into `out`. The roundings and the sum run on the calling thread below PARALLEL_MIN_ROWS rows (tokens, or
pairs for h), so a call for a token's few missed experts starts two parallel regions. (It was five numba launches
with Python between them, argument checks, array allocations and copies, and two numba.set_num_threads calls: about
20 us of Python and three more region starts per call on a 2-core VM, docs/history/benchmarks-log.md.) What stays in Python is
what numba cannot do: ExpertBytes prepares each tensor's read-only views and format code once, and numba's thread
count is changed only when the call asks for another one. Rounding h inside each down item instead (no region
between the two loops) measured 5% slower on a 64-token call, so h is rounded in a step of its own.

Shapes: T tokens, K experts per token, P = the (token, k) pairs with an expert (ids >= 0), E experts, D hidden
size, I expert hidden size; a row has `cols` values in `nb` blocks of `block` values, each of `n_sub` sub-blocks.
"""

from __future__ import annotations

import numba
import numpy as np
from gguf import GGMLQuantizationType as Q
from numba import literal_unroll

from moeprep.errors import MoeprepError
from moeprep.quant.jit import F32, JIT
from moerun.kernels.cpu.formats import (
    _BLOCK,
    _FORMAT_ROUNDING,
    _N_SUB,
    _ROUNDING_BLOCK,
    _ROUNDINGS,
    _ROWS,
    INTEGER_ROUNDINGS,
    ExpertBytes,
)
from moerun.kernels.cpu.ggml_rows import _matmul_ggml, _moe_ggml
from moerun.kernels.cpu.work import (
    _ACTIVATION_CODES,
    PARALLEL_MIN_ROWS,
    _activate_item,
    _combine,
    _items,
    _launch,
    _out_of_range,
    _pairs,
)
from moerun.kernels.ggml_cpu import GgmlCPU


@numba.njit(**JIT)
def _round_one(code, x, xq, xf, xd, xs):
    i = 0
    for rounding in literal_unroll(_ROUNDINGS):
        if i == code:
            rounding(x, xq, xf, xd, xs)
        i += 1


@numba.njit(**JIT)
def _rounded(code, n, cols):
    """Empty arrays for n rows of `cols` values rounded by rounding `code` (those it does not fill: no columns)."""
    integer = code < len(INTEGER_ROUNDINGS)
    block = _ROUNDING_BLOCK[code]
    # int8 values held as int16: the dots then multiply them as they load them, no sign extension per weight row.
    xq = np.empty((n, cols if integer else 0), np.int16)
    xf = np.empty((n, 0 if integer else cols), F32)
    xd = np.empty((n, cols // block if integer else 0), F32)
    xs = np.empty((n, cols // 16 if integer else 0), np.int32)
    return xq, xf, xd, xs


@numba.njit(parallel=True, **JIT)
def _round_rows(code, x, used, xq, xf, xd, xs):
    """Round the rows i of x with used[i] into the same rows of xq/xf/xd/xs; few rows on the calling thread."""
    if x.shape[0] < PARALLEL_MIN_ROWS:
        for t in range(x.shape[0]):
            if used[t]:
                _round_one(code, x[t], xq[t], xf[t], xd[t], xs[t])
    else:
        for t in numba.prange(x.shape[0]):
            if used[t]:
                _round_one(code, x[t], xq[t], xf[t], xd[t], xs[t])


@numba.njit(**JIT)
def _rows_one(code, w, step, bias, item, order, act_row, xq, xf, xd, xs, y):
    i = 0
    for rows in literal_unroll(_ROWS):
        if i == code:
            rows(w, step, bias, item, order, act_row, xq, xf, xd, xs, _BLOCK[code], _N_SUB[code], y)
        i += 1


@numba.njit(inline="always")
def _n_experts(w, step):
    """Experts in a kernel array whose expert e is block e * step (ExpertBytes.kernel_step)."""
    return (w.shape[0] - 1) // step + 1


@numba.njit(parallel=True, **JIT)
def _matmul(items_wanted, x, experts, code, w, step, bias, y):
    """y[i] = expert experts[i] of w times x[i] (+ its bias); the entry of expert_matmul."""
    bad, token, order, start, used = _pairs(experts, _n_experts(w, step))
    if bad >= 0:
        return bad
    items = _items(start, y.shape[1], items_wanted)
    xq, xf, xd, xs = _rounded(_FORMAT_ROUNDING[code], x.shape[0], x.shape[1])
    _round_rows(_FORMAT_ROUNDING[code], x, used, xq, xf, xd, xs)
    for it in numba.prange(items.shape[0]):
        _rows_one(code, w, step, bias, items[it], order, token, xq, xf, xd, xs, y)
    return -1


# The body of _moe's gate/up loop is a function of its own, as the other loops' bodies are one call each.


@numba.njit(**JIT)
def _gate_up_item(
    gate_code,
    gate_w,
    gate_step,
    gate_b,
    up_code,
    up_w,
    up_step,
    up_b,
    act_code,
    limit,
    up_limit,
    item,
    order,
    token,
    xq,
    xf,
    xd,
    xs,
    uq,
    uf,
    ud,
    us,
    g,
    u,
    h,
):
    """The gate and up rows of a work item, then h = act(g, u, limit, up_limit) on its rows and pairs."""
    _rows_one(gate_code, gate_w, gate_step, gate_b, item, order, token, xq, xf, xd, xs, g)
    _rows_one(up_code, up_w, up_step, up_b, item, order, token, uq, uf, ud, us, u)
    _activate_item(act_code, limit, up_limit, item, order, g, u, h)


@numba.njit(parallel=True, **JIT)
def _moe(
    items_wanted,
    x,
    ids,
    weights,
    gate_code,
    gate_w,
    gate_step,
    gate_b,
    up_code,
    up_w,
    up_step,
    up_b,
    down_code,
    down_w,
    down_step,
    down_b,
    act_code,
    limit,
    up_limit,
    out,
):
    """moe_rows in one call (see there): returns -1, or an expert id past the stack (then out is untouched).

    1. plan: the pairs grouped by expert, work items of (expert, its pairs, a range of rows) over gate/up's I rows
       and over down's D rows; round the inputs of the tokens with pairs for gate (and up, where its rounding
       differs).
    2. in parallel over the gate/up items: an item's gate rows, its up rows, then h = act(g, u) on those rows and
       pairs.
    3. round each pair's h for down, then in parallel over the down items: the down rows.
    4. out += the weighted sum of each token's pairs.
    The roundings of 1 and 3 and the sum of 4 run in parallel over rows from PARALLEL_MIN_ROWS rows on, on the
    calling thread below, so a decode call (a token and its few missed experts) starts two parallel regions."""
    bad, token, order, start, used = _pairs(ids, _n_experts(gate_w, gate_step))
    if bad >= 0:
        return bad
    P, T, D, I = token.shape[0], x.shape[0], x.shape[1], gate_w.shape[1]
    if P == 0:
        return -1
    gate_items = _items(start, I, items_wanted)
    down_items = _items(start, out.shape[1], items_wanted)

    gate_rounding, up_rounding = _FORMAT_ROUNDING[gate_code], _FORMAT_ROUNDING[up_code]
    xq, xf, xd, xs = _rounded(gate_rounding, T, D)
    _round_rows(gate_rounding, x, used, xq, xf, xd, xs)
    uq, uf, ud, us = xq, xf, xd, xs
    if up_rounding != gate_rounding:
        uq, uf, ud, us = _rounded(up_rounding, T, D)
        _round_rows(up_rounding, x, used, uq, uf, ud, us)

    g, u, h = np.empty((P, I), F32), np.empty((P, I), F32), np.empty((P, I), F32)
    for it in numba.prange(gate_items.shape[0]):
        _gate_up_item(
            gate_code,
            gate_w,
            gate_step,
            gate_b,
            up_code,
            up_w,
            up_step,
            up_b,
            act_code,
            F32(limit),
            F32(up_limit),
            gate_items[it],
            order,
            token,
            xq,
            xf,
            xd,
            xs,
            uq,
            uf,
            ud,
            us,
            g,
            u,
            h,
        )

    down_rounding = _FORMAT_ROUNDING[down_code]
    hq, hf, hd, hs = _rounded(down_rounding, P, I)
    _round_rows(down_rounding, h, np.ones(P, np.bool_), hq, hf, hd, hs)
    y = np.empty((P, out.shape[1]), F32)
    pair = np.arange(P)
    for it in numba.prange(down_items.shape[0]):
        _rows_one(down_code, down_w, down_step, down_b, down_items[it], order, pair, hq, hf, hd, hs, y)

    _combine(ids, weights, token, y, out)
    return -1


def ggml_kernel(t: ExpertBytes, ggml: GgmlCPU | None) -> tuple[int, int, int] | None:
    """t's kernel in the ggml library `ggml` as the numba kernels take it, or None (no library, or no row dot for
    t's type there: GgmlCPU.row_dot)."""
    dot = None if ggml is None else ggml.row_dot(t.qtype)
    return None if dot is None else (dot.dot, dot.quantize, dot.row_bytes(t.cols))


def _code(t: ExpertBytes) -> int:
    if t.code < 0:
        raise MoeprepError(f"no CPU expert kernel for {Q(t.qtype).name}")
    return t.code


def expert_matmul(
    x: np.ndarray, t: ExpertBytes, experts: np.ndarray, threads: int | None = None, ggml: GgmlCPU | None = None
) -> np.ndarray:
    """y[i] = expert experts[i] of t times x[i] (+ its bias), rounding x[i] as llama.cpp does for t's type, on
    `ggml`'s row dot where it has one for the type, else on moerun's kernels. x (n, cols) float32, experts (n,)
    integers -> y (n, rows) float32."""
    y = np.empty((len(x), t.rows), F32)
    x, experts = np.ascontiguousarray(x, F32), np.ascontiguousarray(experts, np.int64)[:, None]
    kernel = ggml_kernel(t, ggml)
    if kernel is not None:
        bad = _launch(_matmul_ggml, threads, x, experts, kernel, t.kernel_data, t.kernel_step, t.kernel_bias, y)
    else:
        bad = _launch(_matmul, threads, x, experts, _code(t), t.kernel_data, t.kernel_step, t.kernel_bias, y)
    if bad >= 0:
        raise _out_of_range(bad, t.data.shape[0])
    return y


def moe_rows(
    x: np.ndarray,
    ids: np.ndarray,
    weights: np.ndarray,
    gate: ExpertBytes,
    up: ExpertBytes,
    down: ExpertBytes,
    activation: str,
    out: np.ndarray,
    threads: int | None = None,
    limit: float = 0.0,
    up_limit: float = 0.0,
    ggml: GgmlCPU | None = None,
) -> None:
    """out (T, D) += sum_k weights[t, k] * expert_{ids[t, k]}(x[t]), for x (T, D) float32, ids (T, K) integers
    (< 0: no expert) and weights (T, K) float32; an expert is down(act(gate x + b, up x + b)) + b, `activation` a
    key of ACTIVATIONS (an ungated expert, relu_sqr, is given its up tensor as gate too) and `limit` its clamp where
    it takes one (swiglu_clamp, swiglu_limited), or situ's beta, `up_limit` situ's linear beta. `threads`: numba threads for this
    call (default: numba's setting for the calling thread). One compiled call: _moe_ggml where the library `ggml`
    has a row dot for all three tensors' types (ggml_cpu.py), else _moe (moerun's own kernels)."""
    x, ids, weights = (
        np.ascontiguousarray(x, F32),
        np.ascontiguousarray(ids, np.int64),
        np.ascontiguousarray(weights, F32),
    )
    kernels = [ggml_kernel(t, ggml) for t in (gate, up, down)]
    if all(k is not None for k in kernels):
        bad = _launch(
            _moe_ggml,
            threads,
            x,
            ids,
            weights,
            kernels[0],
            gate.kernel_data,
            gate.kernel_step,
            gate.kernel_bias,
            kernels[1],
            up.kernel_data,
            up.kernel_step,
            up.kernel_bias,
            kernels[2],
            down.kernel_data,
            down.kernel_step,
            down.kernel_bias,
            _ACTIVATION_CODES[activation],
            float(limit),
            float(up_limit),
            out,
        )
    else:
        bad = _launch(
            _moe,
            threads,
            x,
            ids,
            weights,
            _code(gate),
            gate.kernel_data,
            gate.kernel_step,
            gate.kernel_bias,
            _code(up),
            up.kernel_data,
            up.kernel_step,
            up.kernel_bias,
            _code(down),
            down.kernel_data,
            down.kernel_step,
            down.kernel_bias,
            _ACTIVATION_CODES[activation],
            float(limit),
            float(up_limit),
            out,
        )
    if bad >= 0:
        raise _out_of_range(bad, gate.data.shape[0])
