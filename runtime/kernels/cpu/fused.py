"""The decode step's Q/K norms and RoPE, and its expert choice, on the CPU as numba kernels: where one call does
what a chain of torch ops did (kernels/fused.py is the GPU's counterpart, in Triton).

On the CPU a torch op costs a few microseconds of dispatch whatever its size. Measured on the 2-core VM for one
token of a 30B-wide layer (32 query and 4 KV heads of 128): layers.norm_rope_store's ~34 ops took 118 us and
`norm_rope_rows` here 38; the router's top-k and weights 11 us in torch and 5 in `route`. The rest stays on torch
ops, which were as fast or faster there: an RMSNorm's six ops (12 us against 16 through a numba call) and attention
(torch's batched matmuls: 58 against 91 us over 64 slots, 2.3 against 6.7 ms over 4096, for a numba loop).

- `norm_rope_rows`: per-head Q/K RMSNorm (the sum of squares in float64, as ggml sums it) and RoPE of q and k,
  the same arithmetic for every kind of step (a prompt, a decode batch across sequences), so that a token's q and
  k do not depend on the step it came in;
- `route`: router softmax (or sigmoid, or softmax over the chosen logits), top-k and renormalisation.

olmoe's whole-projection Q/K norms go to the torch reference (layers/attention.py), which tests/runtime/test_fused.py
checks these against; backend.py joins these kernels to the layers.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from moeprep.quant.jit import F32, JIT
from moerun.config import GATING_SIGMOID, GATING_SOFTMAX


def _rows(x: torch.Tensor) -> np.ndarray:
    """x as a C-contiguous float32 (rows, D) array (a view where it already is one)."""
    return x.float().reshape(-1, x.shape[-1]).contiguous().numpy()


@numba.njit(**JIT)
def _norm_row(h, w, eps, out):
    """out = h / sqrt(mean(h^2) + eps) * w, the mean of a float64 sum."""
    total = 0.0
    for j in range(h.shape[0]):
        total += np.float64(h[j]) * np.float64(h[j])
    scale = F32(1) / np.sqrt(F32(total / h.shape[0]) + F32(eps))
    for j in range(h.shape[0]):
        out[j] = h[j] * scale * w[j]


# ------------------------------------------------------------------------------------------ Q/K norm, RoPE, store


@numba.njit(**JIT)
def _norm_rope_rows(x, heads, w, eps, cos, sin, positions, neox, out):
    """Rows of x (T * heads, Dh), token t = row // heads, into the same rows of out: RMSNorm with w where w has Dh
    values, then the rotation of channel pairs (i, i + R) (neox) or (2i, 2i + 1) by the token's cos/sin row (R =
    cos's columns); channels past 2R pass through."""
    half = cos.shape[1]
    row = np.empty(x.shape[1], F32)
    for r in range(x.shape[0]):
        if w.shape[0]:
            _norm_row(x[r], w, eps, row)
        else:
            row[:] = x[r]
        pos = positions[r // heads]
        dst = out[r]
        dst[:] = row
        for i in range(half):
            a, b = (i, i + half) if neox else (2 * i, 2 * i + 1)
            c, s = cos[pos, i], sin[pos, i]
            dst[a] = row[a] * c - row[b] * s
            dst[b] = row[a] * s + row[b] * c


def norm_rope_rows(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    neox: bool,
) -> torch.Tensor:
    """x (T, heads, Dh) -> the same, float32: each head's RMSNorm by `weight` (Dh,) (None: no norm), then RoPE of
    its first channels by the cos/sin tables (S, d/2) at the tokens' positions (T,)."""
    out = torch.empty(x.shape, dtype=torch.float32)
    w = np.zeros(0, np.float32) if weight is None else weight.detach().numpy()
    _norm_rope_rows(
        _rows(x),
        x.shape[1],
        w,
        eps,
        cos.numpy(),
        sin.numpy(),
        positions.numpy(),
        neox,
        out.view(-1, x.shape[2]).numpy(),
    )
    return out


# --------------------------------------------------------------------------------------------------------- router


@numba.njit(**JIT)
def _route(logits, k, gating, normalize, scale, ids, weights):
    """Token t: the k largest logits (equal ones: the lowest expert id first), in descending order, and their
    weights: softmax over all logits (GATING_SOFTMAX), sigmoid (GATING_SIGMOID), or softmax over the k chosen;
    then optionally / their sum (at least 2^-14, as llama.cpp clamps it) and * scale (unless 0 or 1)."""
    E = logits.shape[1]
    for t in range(logits.shape[0]):
        x = logits[t]
        probs = np.empty(E, np.float32)
        if gating == GATING_SOFTMAX:
            top = x.max()
            total = F32(0)
            for e in range(E):
                probs[e] = np.exp(x[e] - top)
                total += probs[e]
            for e in range(E):
                probs[e] /= total
        elif gating == GATING_SIGMOID:
            for e in range(E):
                probs[e] = F32(1) / (F32(1) + np.exp(-x[e]))
        else:
            probs[:] = x
        free = np.ones(E, np.bool_)
        for i in range(k):
            best = -1
            for e in range(E):
                if free[e] and (best < 0 or x[e] > x[best]):
                    best = e
            free[best] = False
            ids[t, i] = best
            weights[t, i] = probs[best]
        if gating != GATING_SOFTMAX and gating != GATING_SIGMOID:
            top = weights[t].max()
            total = F32(0)
            for i in range(k):
                weights[t, i] = np.exp(weights[t, i] - top)
                total += weights[t, i]
            for i in range(k):
                weights[t, i] /= total
        if normalize:
            total = F32(0)
            for i in range(k):
                total += weights[t, i]
            total = max(total, F32(6.103515625e-5))
            for i in range(k):
                weights[t, i] /= total
        if scale != 0.0 and scale != 1.0:
            for i in range(k):
                weights[t, i] *= F32(scale)


def route(
    logits: torch.Tensor,
    k: int,
    gating: int,
    normalize: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (T, E) float32 -> expert ids (T, K) int64, weights (T, K) float32 (see _route); gating is
    config.GATING_SOFTMAX, GATING_SIGMOID or GATING_SOFTMAX_WEIGHT."""
    rows = _rows(logits)
    ids = np.empty((rows.shape[0], k), np.int64)
    weights = np.empty((rows.shape[0], k), np.float32)
    _route(rows, k, gating, normalize, scale, ids, weights)
    return torch.from_numpy(ids), torch.from_numpy(weights)
