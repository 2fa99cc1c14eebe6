"""Fused elementwise and normalization kernels of the decode step: each replaces a chain of small torch ops.

A captured decode step is bound by its kernel count (about 78 per layer in torch ops), not by arithmetic, so each
entry point here does in one launch what the layers' torch reference (layers/) does in several:

- `rms_norm` (+ `add_rms_norm`, the residual add folded in): 1 kernel instead of 6-7;
- `qkv_rope`: per-head Q/K RMSNorm, RoPE of q and k, and k/v cast to the KV cache's dtype, in one launch for q, k
  and v (instead of 34 ops);
- `attend_decode`: softmax attention of a few query tokens over one sequence's KV slots (split over the slots, then
  one combine launch), reading the cache in its own dtype; masked slots are not read;
- `route`: router softmax (or sigmoid, or softmax over the chosen logits), top-k and renormalisation in one kernel;
- `swiglu`: silu(gate) * up; `moe_combine`: the weighted sum of each token's expert outputs.

Their `_i8` forms (`add_rms_norm_i8`, `attend_decode_i8`) also round what they write to int8 blocks in the same pass
and return that rounding (an act_i8.QAct) with it, for the products that read it on an 8-bit route, which then skip
a launch of their own.

Every function is tested against the torch reference of layers/ (tests/runtime/test_fused.py, on the CPU in
Triton's interpreter). Shapes: T tokens, H query heads, G KV heads, Dh head size, S KV slots, E experts, K experts
per token, D hidden size.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moerun.config import GATING_SIGMOID, GATING_SOFTMAX
from moerun.kernels import tuning
from moerun.kernels.act_i8 import QAct, store_i8
from moerun.kernels.qtypes import INTERPRETED
from moerun.kernels.tuning import INT8_ON, Int8Routes

# KV slots per program of attend_decode; query tokens it takes (more go to the torch reference, which is a batched
# matmul over all of them); largest head size its tiles hold.
ATTEND_SLOTS = 64
ATTEND_MAX_TOKENS = 8
ATTEND_MAX_HEAD_DIM = 256


# --------------------------------------------------------------------------------------------------------- norms


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    delta_ptr,
    w_ptr,
    sum_ptr,
    out_ptr,
    q_ptr,
    d_ptr,
    s_ptr,
    D,
    x_stride,
    eps,
    HAS_DELTA: tl.constexpr,
    I8: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Row i: h = x[i] (+ delta[i]); out[i] = h * rsqrt(mean(h^2) + eps) * w (and sum[i] = h with a delta); with
    I8, out[i] rounded for the 8-bit route into q, d, s (act_i8.store_i8)."""
    i = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    ok = c < D
    h = tl.load(x_ptr + i * x_stride + c, mask=ok, other=0.0).to(tl.float32)
    if HAS_DELTA:
        h += tl.load(delta_ptr + i * D + c, mask=ok, other=0.0).to(tl.float32)
        tl.store(sum_ptr + i * D + c, h, mask=ok)
    r = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / D + eps)
    w = tl.load(w_ptr + c, mask=ok, other=0.0)
    y = h * r * w
    tl.store(out_ptr + i * D + c, y, mask=ok)
    if I8:
        blk = tl.arange(0, BLOCK // 32)
        store_i8(tl.reshape(y, (BLOCK // 32, 32)), blk, blk < D // 32, i, D, q_ptr, d_ptr, s_ptr, BLOCK // 32)


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """x as (rows, D) with unit column stride (a view where possible, e.g. a column slice) and its row stride."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2, x2.stride(0)


def rounded_rows(routes: Int8Routes) -> int:
    """The most rows of activations that the kernels writing them round for the 8-bit routes as well (the _i8
    forms): as many as the products reading them take on one of the routes that are on (the matrix-vector kernel's,
    for a decode step's tokens and a short prompt's experts; the 8-bit GEMM's dense products)."""
    return max(
        max(tuning.GEMV_MAX_TOKENS, tuning.MOE_GEMV_MAX_TOKENS, tuning.MOE_GLU_GEMV_MAX_TOKENS) if routes.gemv else 0,
        tuning.DENSE_I8_MAX_TOKENS if routes.gemm else 0,
    )


def rounds_i8(rows: int, cols: int, routes: Int8Routes = INT8_ON) -> bool:
    """Does a kernel writing (rows, cols) activations round them for the 8-bit routes (rounded_rows, whole blocks of
    32 values)?"""
    return 0 < rows <= rounded_rows(routes) and cols % 32 == 0


def _norm(
    x: torch.Tensor,
    x_stride: int,
    delta: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    h: torch.Tensor | None,
    out: torch.Tensor,
    i8: bool,
    routes: Int8Routes = INT8_ON,
) -> QAct | None:
    """_rms_norm_kernel over the rows of x into out (and h = x + delta with h); with `i8`, where its readers can use
    it (rounds_i8), out rounded for the 8-bit routes too: -> that rounding, else None."""
    rows, D = out.shape
    act = QAct.empty(rows, D, out.device) if i8 and rounds_i8(rows, D, routes) else None
    q, d, s = (out, out, out) if act is None else (act.q, act.d, act.s)
    if rows:  # no FMA: store_i8 rounds as quantize_i8 does
        _rms_norm_kernel[(rows,)](
            x,
            delta,
            weight,
            out if h is None else h,
            out,
            q,
            d,
            s,
            D,
            x_stride,
            eps,
            HAS_DELTA=h is not None,
            I8=act is not None,
            BLOCK=triton.next_power_of_2(D),
            enable_fp_fusion=False,
        )
    return act


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (..., D) float32/bfloat16, weight (D,) float32 -> (..., D) float32."""
    x2, stride = _rows(x)
    out = torch.empty(x2.shape, dtype=torch.float32, device=x.device)
    _norm(x2, stride, x2, weight, eps, None, out, i8=False)
    return out.view(x.shape)


def add_rms_norm(
    x: torch.Tensor,
    delta: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + delta, rms_norm(h): x, delta (T, D) float32 -> (h, normed), both (T, D) float32."""
    assert x.shape == delta.shape and x.dim() == 2, (tuple(x.shape), tuple(delta.shape))
    x, delta = x.contiguous(), delta.contiguous()
    h, out = torch.empty_like(x, dtype=torch.float32), torch.empty_like(x, dtype=torch.float32)
    _norm(x, x.shape[1], delta, weight, eps, h, out, i8=False)
    return h, out


def add_rms_norm_i8(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float, routes: Int8Routes = INT8_ON
) -> tuple[torch.Tensor, torch.Tensor, QAct | None]:
    """The norm whose output products read: (h, normed) as add_rms_norm's (h = x, rms_norm(x) where delta is None:
    a residual stream with nothing pending), and normed's rounding for the 8-bit routes where the products reading
    it take one (rounds_i8; else None), made in the same pass. x, delta (T, D) -> (h, normed (T, D) float32, QAct)."""
    assert x.dim() == 2 and (delta is None or x.shape == delta.shape), (tuple(x.shape), delta is None)
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    if delta is None:
        x2, stride = _rows(x)
        return x, out, _norm(x2, stride, x2, weight, eps, None, out, i8=True, routes=routes)
    x, delta = x.contiguous(), delta.contiguous()
    h = torch.empty_like(x, dtype=torch.float32)
    return h, out, _norm(x, x.shape[1], delta, weight, eps, h, out, i8=True, routes=routes)


# ------------------------------------------------------------------------------------------ Q/K norm, RoPE, cast


@triton.jit
def _slot_row(pos_ptr, seq_ptr, t, g, G, n_ctx, SEQS: tl.constexpr):
    """The KV cache row of token t's head g: slot positions[t] of its sequence (seqs[t] with SEQS, else the one
    sequence the cache buffer is)."""
    slot = tl.load(pos_ptr + t)
    if SEQS:
        slot += tl.load(seq_ptr + t) * n_ctx
    return slot * G + g


# the step's sizes, and its positions and sequences (whose alignment follows the step's token count where they are
# rows of one tensor): see gemv._gemv_kernel
@triton.jit(do_not_specialize=["pos_ptr", "seq_ptr", "n_q_rows", "n_k_rows"])
def _qkv_rope_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    qw_ptr,
    kw_ptr,
    q_out,
    k_out,
    v_out,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    seq_ptr,
    n_q_rows,
    n_k_rows,
    H,
    G,
    Dh,
    Dv,
    rot_half,
    eps,
    n_ctx,
    HAS_NORM: tl.constexpr,
    NEOX: tl.constexpr,
    HALF: tl.constexpr,
    REST: tl.constexpr,
    VB: tl.constexpr,
    TO_SLOTS: tl.constexpr,
    SEQS: tl.constexpr,
):
    """Program p: q row p (< n_q_rows = T*H), k row p - n_q_rows (< T*G), else v row p - n_q_rows - n_k_rows.

    A q or k row (one head of one token): optionally RMSNorm over Dh with its weight, then rotate channel pairs
    (i, i + rot_half) (NEOX) or (2i, 2i + 1) of the first 2*rot_half channels by the token's cos/sin row; channels
    past them pass through. A v row is only cast to v_out's dtype. k and v rows (t, g) go to row t*G + g of k_out
    and v_out, or with TO_SLOTS to the KV cache row of (t, g) (_slot_row: k_out, v_out one sequence's cache, slot =
    position, or with SEQS every sequence's, n_ctx slots each, token t in sequence seqs[t]).
    """
    p = tl.program_id(0)
    if p >= n_q_rows + n_k_rows:
        c = tl.arange(0, VB)
        row = (p - n_q_rows - n_k_rows).to(tl.int64)
        v = tl.load(v_ptr + row * Dv + c, mask=c < Dv)
        if TO_SLOTS:
            out_row = _slot_row(pos_ptr, seq_ptr, row // G, row % G, G, n_ctx, SEQS)
        else:
            out_row = row
        tl.store(v_out + out_row * Dv + c, v.to(v_out.dtype.element_ty), mask=c < Dv)
    else:
        is_q = p < n_q_rows
        row = tl.where(is_q, p, p - n_q_rows).to(tl.int64)
        t = row // tl.where(is_q, H, G)
        x_row = tl.where(is_q, q_ptr, k_ptr) + row * Dh
        i = tl.arange(0, HALF)
        i_ok = i < rot_half
        if NEOX:
            c1, c2 = i, i + rot_half
        else:
            c1, c2 = 2 * i, 2 * i + 1
        j = 2 * rot_half + tl.arange(0, REST)
        j_ok = j < Dh
        x1 = tl.load(x_row + c1, mask=i_ok, other=0.0)
        x2 = tl.load(x_row + c2, mask=i_ok, other=0.0)
        xr = tl.load(x_row + j, mask=j_ok, other=0.0)
        if HAS_NORM:
            r = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0) + tl.sum(xr * xr, axis=0)) / Dh + eps)
            w_row = tl.where(is_q, qw_ptr, kw_ptr)
            x1 = x1 * r * tl.load(w_row + c1, mask=i_ok, other=0.0)
            x2 = x2 * r * tl.load(w_row + c2, mask=i_ok, other=0.0)
            xr = xr * r * tl.load(w_row + j, mask=j_ok, other=0.0)
        pos = tl.load(pos_ptr + t)
        cos = tl.load(cos_ptr + pos * rot_half + i, mask=i_ok, other=0.0)
        sin = tl.load(sin_ptr + pos * rot_half + i, mask=i_ok, other=0.0)
        y1 = x1 * cos - x2 * sin
        y2 = x1 * sin + x2 * cos
        # (no shared name for the two outputs: Triton cannot merge pointers of two dtypes after a branch)
        if is_q:
            tl.store(q_out + row * Dh + c1, y1, mask=i_ok)
            tl.store(q_out + row * Dh + c2, y2, mask=i_ok)
            tl.store(q_out + row * Dh + j, xr, mask=j_ok)
        else:
            if TO_SLOTS:
                out_row = _slot_row(pos_ptr, seq_ptr, t, row % G, G, n_ctx, SEQS)
            else:
                out_row = row
            tl.store(k_out + out_row * Dh + c1, y1.to(k_out.dtype.element_ty), mask=i_ok)
            tl.store(k_out + out_row * Dh + c2, y2.to(k_out.dtype.element_ty), mask=i_ok)
            tl.store(k_out + out_row * Dh + j, xr.to(k_out.dtype.element_ty), mask=j_ok)


def qkv_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    neox: bool,
    kv_dtype: torch.dtype,
    k_slots: torch.Tensor | None = None,
    v_slots: torch.Tensor | None = None,
    seqs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q and k (both weights (Dh,), or neither), RoPE by the (n_ctx, R) cos/sin tables at
    `positions` (T,) over the first 2R channels, in one launch with the cast of k and v to the KV cache's dtype.

    q (T, H, Dh), k (T, G, Dh), v (T, G, Dv) float32 -> q (T, H, Dh) float32, k and v in kv_dtype; or, given a
    sequence's cache buffers k_slots (S, G, Dh) and v_slots (S, G, Dv), k and v written there at row = position
    (which the call returns in their place); or, given every sequence's, k_slots (n_seq, S, G, Dh) and v_slots
    (n_seq, S, G, Dv), with `seqs` (T,) the sequence of each token, at (seqs[t], positions[t]).
    """
    assert (q_norm is None) == (k_norm is None), "both per-head norms or neither"
    T, H, Dh = q.shape
    G, Dv = k.shape[1], v.shape[2]
    rot_half = cos.shape[1]
    q, k, v = q.float().contiguous(), k.float().contiguous(), v.contiguous()
    q_out = torch.empty_like(q)
    to_slots = k_slots is not None
    if to_slots:
        assert k_slots.is_contiguous() and v_slots.is_contiguous() and k_slots.dtype == v_slots.dtype == kv_dtype
        assert k_slots.dim() == (3 if seqs is None else 4), (tuple(k_slots.shape), seqs is None)
        k_out, v_out = k_slots, v_slots
    else:
        k_out, v_out = torch.empty_like(k, dtype=kv_dtype), torch.empty_like(v, dtype=kv_dtype)
    n_q, n_k = T * H, T * G
    if T:
        norm = q_norm if q_norm is not None else q
        _qkv_rope_kernel[(n_q + 2 * n_k,)](
            q,
            k,
            v,
            norm,
            k_norm if k_norm is not None else q,
            q_out,
            k_out,
            v_out,
            cos,
            sin,
            positions,
            positions if seqs is None else seqs,
            n_q,
            n_k,
            H,
            G,
            Dh,
            Dv,
            rot_half,
            eps,
            k_out.shape[-3],
            HAS_NORM=q_norm is not None,
            NEOX=neox,
            HALF=triton.next_power_of_2(rot_half),
            REST=triton.next_power_of_2(max(Dh - 2 * rot_half, 1)),
            VB=triton.next_power_of_2(Dv),
            TO_SLOTS=to_slots,
            SEQS=seqs is not None,
            num_warps=1 if max(Dh, Dv) <= 256 else 4,
        )  # a program is one head's row
    return q_out, k_out, v_out


# ------------------------------------------------------------------------------------------------------ attention


@triton.jit
def _dot_f32(a, b, SPLIT: tl.constexpr):
    """a [M, K] float32 @ b [K, N] -> float32. SPLIT (b bfloat16): on tensor cores, a as the sum of three bfloat16
    terms (8 significant bits each: all 24 of a float32), smallest first, each product exact and summed in float32;
    else float32 products (FMA), as on a float32 cache and in Triton's interpreter, whose tl.dot takes bfloat16
    as integers."""
    if SPLIT:
        a1 = a.to(tl.bfloat16)
        r = a - a1.to(tl.float32)
        a2 = r.to(tl.bfloat16)
        a3 = (r - a2.to(tl.float32)).to(tl.bfloat16)
        acc = tl.dot(a3, b)
        acc = tl.dot(a2, b, acc)
        return tl.dot(a1, b, acc)
    return tl.dot(a, b.to(tl.float32), input_precision="ieee")


@triton.jit(do_not_specialize=["seq_ptr", "n_slots", "n_splits", "allowed_stride", "k_seq_stride", "v_seq_stride"])
def _attend_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    seq_ptr,
    allowed_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    n_slots,
    n_splits,
    H,
    G,
    Dk,
    Dv,
    k_stride,
    v_stride,
    k_seq_stride,
    v_seq_stride,
    allowed_stride,
    scale,
    HG: tl.constexpr,
    HGP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BS: tl.constexpr,
    SPLIT: tl.constexpr,
    SEQS: tl.constexpr,
):
    """Program (t*G + g, split): the HG query heads of KV head g for token t, over slots split*BS .. +BS of token
    t's keys and values: those of the one sequence at k_ptr, or with SEQS of sequence seqs[t] (k_ptr + seqs[t] *
    k_seq_stride).

    Writes per query head the chunk's max score m, the sum l of exp(score - m) and acc = sum exp(score - m) v;
    disallowed slots are not read, a chunk with none allowed writes m = -inf, l = 0, acc = 0.
    """
    tg = tl.program_id(0)
    split = tl.program_id(1)
    t, g = tg // G, tg % G
    hq = tl.arange(0, HGP)
    h_ok = hq < HG
    h = g * HG + hq
    dk = tl.arange(0, DK)
    dv = tl.arange(0, DV)
    s = split * BS + tl.arange(0, BS)
    s_ok = s < n_slots
    allowed = (tl.load(allowed_ptr + t * allowed_stride + s, mask=s_ok, other=0) != 0) & s_ok
    q = tl.load(q_ptr + (t * H + h)[:, None] * Dk + dk[None, :], mask=h_ok[:, None] & (dk < Dk)[None, :], other=0.0)
    kv_row = s.to(tl.int64)[:, None]
    k_base, v_base = k_ptr, v_ptr
    if SEQS:
        seq = tl.load(seq_ptr + t).to(tl.int64)
        k_base, v_base = k_ptr + seq * k_seq_stride, v_ptr + seq * v_seq_stride
    k = tl.load(
        k_base + kv_row * k_stride + g * Dk + dk[None, :], mask=allowed[:, None] & (dk < Dk)[None, :], other=0.0
    )
    scores = _dot_f32(q, tl.trans(k), SPLIT) * scale  # [HGP, BS]
    scores = tl.where(allowed[None, :], scores, float("-inf"))
    m = tl.max(scores, axis=1)
    p = tl.exp(scores - tl.where(m == float("-inf"), 0.0, m)[:, None])
    l = tl.sum(p, axis=1)
    v = tl.load(
        v_base + kv_row * v_stride + g * Dv + dv[None, :], mask=allowed[:, None] & (dv < Dv)[None, :], other=0.0
    )
    acc = _dot_f32(p, v, SPLIT)  # [HGP, DV]
    part = (t * H + h) * n_splits + split  # [HGP]
    tl.store(m_ptr + part, m, mask=h_ok)
    tl.store(l_ptr + part, l, mask=h_ok)
    tl.store(acc_ptr + part[:, None] * Dv + dv[None, :], acc, mask=h_ok[:, None] & (dv < Dv)[None, :])


@triton.jit(do_not_specialize=["n_splits"])
def _attend_combine_kernel(
    m_ptr,
    l_ptr,
    acc_ptr,
    sinks_ptr,
    out_ptr,
    q_ptr,
    d_ptr,
    s_ptr,
    n_splits,
    H,
    Dv,
    HAS_SINKS: tl.constexpr,
    I8: tl.constexpr,
    CS: tl.constexpr,
    DV: tl.constexpr,
):
    """Program t*H + h: out = sum_i exp(m_i - M) acc_i / (sum_i exp(m_i - M) l_i [+ exp(sink - M)]), M the max;
    with I8 also rounded for the 8-bit route into q, d, s (act_i8.store_i8; Dv a multiple of 32)."""
    th = tl.program_id(0)
    base = th.to(tl.int64) * n_splits
    c = tl.arange(0, CS)
    dv = tl.arange(0, DV)
    big = tl.full((CS,), float("-inf"), tl.float32)
    for s0 in range(0, n_splits, CS):
        big = tl.maximum(big, tl.load(m_ptr + base + s0 + c, mask=s0 + c < n_splits, other=float("-inf")))
    top = tl.max(big, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + th % H)
        top = tl.maximum(top, sink)
    denom = tl.zeros((CS,), tl.float32)
    acc = tl.zeros((CS, DV), tl.float32)
    for s0 in range(0, n_splits, CS):
        ok = s0 + c < n_splits
        m = tl.load(m_ptr + base + s0 + c, mask=ok, other=float("-inf"))
        w = tl.where(m == float("-inf"), 0.0, tl.exp(m - top))
        denom += w * tl.load(l_ptr + base + s0 + c, mask=ok, other=0.0)
        part = tl.load(
            acc_ptr + (base + s0 + c)[:, None] * Dv + dv[None, :], mask=ok[:, None] & (dv < Dv)[None, :], other=0.0
        )
        acc += w[:, None] * part
    total = tl.sum(denom, axis=0)
    if HAS_SINKS:
        total += tl.exp(sink - top)
    y = tl.sum(acc, axis=0) / total
    tl.store(out_ptr + th.to(tl.int64) * Dv + dv, y, mask=dv < Dv)
    if I8:  # the output as rows of Dv: the same bytes, in order, as (T, H * Dv)
        blk = tl.arange(0, DV // 32)
        store_i8(tl.reshape(y, (DV // 32, 32)), blk, blk < Dv // 32, th, Dv, q_ptr, d_ptr, s_ptr, DV // 32)


def attend_supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: torch.Tensor | None = None) -> bool:
    """attend_decode takes a few tokens, of one sequence ((S, G, D) KV) or each of its own (`seqs`, a sequence per
    token, over every sequence's (n_seq, S, G, D): a decode batch of several sequences), with heads of at most 256
    values."""
    return (
        q.shape[0] <= ATTEND_MAX_TOKENS
        and (k.dim() == 3 if seqs is None else k.dim() == 4 and seqs.shape == (q.shape[0],))
        and max(q.shape[-1], v.shape[-1]) <= ATTEND_MAX_HEAD_DIM
        and k.stride()[-2:] == (k.shape[-1], 1)
        and v.stride()[-2:] == (v.shape[-1], 1)
    )


def attend_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
    seqs: torch.Tensor | None = None,
) -> torch.Tensor:
    """layers.attend for a few tokens: q (T, H, Dk) over one sequence's k (S, G, Dk), v (S, G, Dv), or, token t over
    sequence seqs[t] of every sequence's k (n_seq, S, G, Dk), v (n_seq, S, G, Dv) (any float dtype; rows of S may be
    strided: a prefix of the cache, read in place), allowed (T, S) bool, sinks (H,) or None -> (T, H, Dv) float32.
    (In a decode batch torch's attention ran a dozen small kernels per layer where these run two.)"""
    return _attend_decode(q, k, v, allowed, scale, sinks, seqs, i8=False)[0]


def attend_decode_i8(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
    seqs: torch.Tensor | None = None,
    routes: Int8Routes = INT8_ON,
) -> tuple[torch.Tensor, QAct | None]:
    """attend_decode, and its output read as (T, H * Dv) (the output projection's input) rounded for the 8-bit
    routes in the same pass, where the products reading it take one (rounds_i8, Dv a multiple of 32; else None)."""
    return _attend_decode(q, k, v, allowed, scale, sinks, seqs, i8=True, routes=routes)


def _attend_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None,
    seqs: torch.Tensor | None,
    i8: bool,
    routes: Int8Routes = INT8_ON,
) -> tuple[torch.Tensor, QAct | None]:
    assert attend_supports(q, k, v, seqs), (tuple(q.shape), tuple(k.shape), tuple(v.shape))
    T, H, Dk = q.shape
    S, G, Dv = v.shape[-3:]
    q = q.float().contiguous()
    allowed = allowed.contiguous().view(torch.uint8)
    n_splits = triton.cdiv(S, ATTEND_SLOTS)
    m = torch.empty(T, H, n_splits, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty(T, H, n_splits, Dv, dtype=torch.float32, device=q.device)
    out = torch.empty(T, H, Dv, dtype=torch.float32, device=q.device)
    if T == 0:
        return out, None
    hg = H // G
    _attend_split_kernel[(T * G, n_splits)](
        q,
        k,
        v,
        allowed if seqs is None else seqs,
        allowed,
        m,
        l,
        acc,
        S,
        n_splits,
        H,
        G,
        Dk,
        Dv,
        k.stride(-3),
        v.stride(-3),
        k.stride(0) if seqs is not None else 0,
        v.stride(0) if seqs is not None else 0,
        allowed.stride(0),
        scale,
        HG=hg,
        HGP=max(16, triton.next_power_of_2(hg)),
        DK=max(16, triton.next_power_of_2(Dk)),
        DV=max(16, triton.next_power_of_2(Dv)),
        BS=ATTEND_SLOTS,
        SEQS=seqs is not None,
        SPLIT=k.dtype == v.dtype == torch.bfloat16 and not INTERPRETED,
    )  # (the interpreter's tl.dot: bfloat16 as ints)
    # the rounding's rows of Dv values (one per program) are the same bytes, in order, as rows of H * Dv
    act = QAct.empty(T, H * Dv, out.device) if i8 and rounds_i8(T, H * Dv, routes) and Dv % 32 == 0 else None
    q8, d8, s8 = (out, out, out) if act is None else (act.q, act.d, act.s)
    _attend_combine_kernel[(T * H,)](
        m,
        l,
        acc,
        sinks if sinks is not None else m,
        out,
        q8,
        d8,
        s8,
        n_splits,
        H,
        Dv,
        HAS_SINKS=sinks is not None,
        I8=act is not None,
        CS=16,
        DV=triton.next_power_of_2(Dv),
        enable_fp_fusion=False,
    )  # no FMA: store_i8 rounds as quantize_i8 does
    return out, act


# --------------------------------------------------------------------------------------------------------- router


@triton.jit
def _route_kernel(
    logits_ptr,
    ids_ptr,
    weights_ptr,
    E,
    scale,
    SOFTMAX: tl.constexpr,
    SIGMOID: tl.constexpr,
    NORMALIZE: tl.constexpr,
    SCALE: tl.constexpr,
    K: tl.constexpr,
    KP: tl.constexpr,
    BE: tl.constexpr,
):
    """Token t: the K largest logits (equal ones: the lowest expert id first), in descending order, and their
    weights: softmax over all E logits, sigmoid, or softmax over the K chosen; then optionally / their sum and * scale.

    Choosing on the logits is choosing on the probabilities (softmax and sigmoid are increasing), and an exact tie
    goes to the lowest id, as torch.topk does on CUDA.
    """
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BE)
    ok = e < E
    x = tl.load(logits_ptr + t * E + e, mask=ok, other=float("-inf"))
    if SOFTMAX:
        ex = tl.where(ok, tl.exp(x - tl.max(x, axis=0)), 0.0)
        probs = ex / tl.sum(ex, axis=0)
    elif SIGMOID:
        probs = 1.0 / (1.0 + tl.exp(-x))
    else:  # softmax over the chosen logits, below
        probs = x
    kk = tl.arange(0, KP)
    ids = tl.zeros((KP,), tl.int32)
    chosen = tl.zeros((KP,), tl.float32)
    free = ok
    for i in tl.static_range(K):
        best = tl.max(tl.where(free, x, float("-inf")), axis=0)
        pick = tl.min(tl.where(free & (x == best), e, BE), axis=0)
        ids = tl.where(kk == i, pick, ids)
        chosen = tl.where(kk == i, tl.sum(tl.where(e == pick, probs, 0.0), axis=0), chosen)
        free = free & (e != pick)
    k_ok = kk < K
    if not SOFTMAX and not SIGMOID:
        ex = tl.where(k_ok, tl.exp(chosen - tl.max(tl.where(k_ok, chosen, float("-inf")), axis=0)), 0.0)
        chosen = ex / tl.sum(ex, axis=0)
    if NORMALIZE:
        chosen = chosen / tl.maximum(tl.sum(tl.where(k_ok, chosen, 0.0), axis=0), 6.103515625e-5)
    if SCALE:
        chosen = chosen * scale
    tl.store(ids_ptr + t * K + kk, ids.to(tl.int64), mask=k_ok)
    tl.store(weights_ptr + t * K + kk, chosen, mask=k_ok)


def route(
    logits: torch.Tensor,
    k: int,
    gating: int,
    normalize: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (T, E) float32 -> expert ids (T, K) int64, weights (T, K) float32 (see _route_kernel); gating is
    config.GATING_SOFTMAX, GATING_SIGMOID or GATING_SOFTMAX_WEIGHT."""
    logits = logits.float().contiguous()
    T, E = logits.shape
    ids = torch.empty(T, k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(T, k, dtype=torch.float32, device=logits.device)
    if T:
        # one warp: the K rounds of max/min/sum over E logits reduce by shuffles, with no barrier
        _route_kernel[(T,)](
            logits,
            ids,
            weights,
            E,
            scale,
            SOFTMAX=gating == GATING_SOFTMAX,
            SIGMOID=gating == GATING_SIGMOID,
            NORMALIZE=normalize,
            SCALE=scale not in (0.0, 1.0),
            K=k,
            KP=triton.next_power_of_2(k),
            BE=triton.next_power_of_2(E),
            num_warps=1 if E <= 256 else 4,
        )
    return ids, weights


# ------------------------------------------------------------------------------------------------- feed-forward


@triton.jit(do_not_specialize=["n"])
def _swiglu_kernel(gate_ptr, up_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    g = tl.load(gate_ptr + i, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + i, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + i, g / (1.0 + tl.exp(-g)) * u, mask=ok)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, float32, any matching shapes."""
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty(gate.shape, dtype=torch.float32, device=gate.device)
    n = gate.numel()
    if n:
        _swiglu_kernel[(triton.cdiv(n, 1024),)](gate, up, out, n, BLOCK=1024)
    return out


@triton.jit
def _moe_combine_kernel(y_ptr, w_ptr, slot_ptr, out_ptr, D, K: tl.constexpr, BD: tl.constexpr):
    """out[t, d] = sum_k w[t, k] y[t, k, d] over the k whose slot is not -1, for a BD-wide column tile."""
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    ok = d < D
    acc = tl.zeros((BD,), tl.float32)
    for k in tl.static_range(K):
        w = tl.load(w_ptr + t * K + k)
        w = tl.where(tl.load(slot_ptr + t * K + k) != -1, w, 0.0)
        acc += w * tl.load(y_ptr + (t * K + k) * D + d, mask=ok, other=0.0)
    tl.store(out_ptr + t * D + d, acc, mask=ok)


def moe_combine(y: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """y (T, K, D) float32, weights (T, K), slots (T, K) (-1: skipped; other negative slots name experts read from
    host memory, gemv._gemv_kernel) -> (T, D) float32: sum_k weights * y."""
    T, K, D = y.shape
    y, weights, slots = y.contiguous(), weights.float().contiguous(), slots.contiguous()
    out = torch.empty(T, D, dtype=torch.float32, device=y.device)
    if T:
        _moe_combine_kernel[(T, triton.cdiv(D, 1024))](y, weights, slots, out, D, K=K, BD=1024)
    return out
