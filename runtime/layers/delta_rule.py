"""The gated delta rule: a per-head (key, value) state that decays and takes delta-rule writes, the recurrence of
Kimi delta attention (glm5-next, a decay per key channel) and of the gated delta net (qwen35moe, qwen3next: one decay
per head, the same value on every channel).

Per token t and head: S <- exp(g_t) * S (g_t <= 0, per key channel), then S <- S + k_t beta_t (v_t - S^T k_t)^T, and
the output is S^T q_t. A step of several tokens runs in chunks (delta_rule_chunked: matrix products within a chunk,
the state carried between chunks); a single token, step by step (delta_rule_recurrent). Keys and values may differ
in size. Letters: T tokens, H heads, Dk key and Dv value size per head (written Hd where they are one size).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK, SUBCHUNK = 64, 8  # prefill tokens per chunk of the delta rule, and per sub-chunk


def delta_rule_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, S: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule token by token (decode, and the reference for delta_rule_chunked): q, k, g (T, H, Dk), v (T, H,
    Dv), beta (T, H), state S (H, Dk, Dv) -> outputs S_t^T q_t (T, H, Dv), the last state. Per token the state decays
    per key channel by exp(g_t), then S += k_t beta_t (v_t - S^T k_t)^T."""
    decay, out = g.exp(), torch.empty_like(v)
    for t in range(q.shape[0]):
        S = S * decay[t, :, :, None]
        delta = (v[t] - torch.einsum("hkv,hk->hv", S, k[t])) * beta[t, :, None]
        S = S + k[t, :, :, None] * delta[:, None, :]
        out[t] = torch.einsum("hkv,hk->hv", S, q[t])
    return out, S


def delta_rule_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    S: torch.Tensor,
    chunk: int = CHUNK,
    sub: int = SUBCHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """delta_rule_recurrent in chunks of `chunk` tokens: matrix products within a chunk, the state carried between
    chunks.

    Within a chunk starting from state S0, with G_t the cumulative decay (the sum of g up to and including t, per
    key channel), the state after token t is exp(G_t) S0 + sum_{i<=t} exp(G_t - G_i) k_i u_i^T, where u_t, the write
    of token t, is beta_t (v_t - (exp(G_t) k_t)^T S0 - sum_{i<t} a_ti u_i) with a_ti = k_t . exp(G_t - G_i) k_i: a
    unit lower triangular system (I + beta A) U = beta (V - (exp(G) K) S0) per head. Token t's output is then
    (exp(G_t) q_t)^T S0 + sum_{i<=t} p_ti u_i with p_ti = q_t . exp(G_t - G_i) k_i.

    Every exponent is a decay (G_t - G_i with i <= t), never a growth, so nothing overflows however strong the gate
    is: within a sub-chunk of `sub` tokens the pairwise decays are a (sub, sub, Hd) table; between sub-chunks the
    decay splits at the end r of the earlier sub-chunks, exp(G_t - r) exp(r - G_i), both factors at most 1, which
    makes those parts of A and P matrix products. The tail is padded with tokens that write nothing (k = beta = 0,
    g = 0). Letters: C tokens in a chunk, n sub-chunks of s tokens in it."""
    T, H, Hd = q.shape
    C, s = chunk, sub
    n = C // s
    assert n * s == C
    pad = -T % C
    q, k, v, g = (F.pad(x.transpose(0, 1), (0, 0, 0, pad)) for x in (q, k, v, g))  # (H, T + pad, Hd)
    beta = F.pad(beta.transpose(0, 1), (0, pad))[..., None]  # (H, T + pad, 1)
    device = q.device
    t_in_sub = torch.arange(s, device=device)
    later_in_sub = (t_in_sub[:, None] < t_in_sub[None, :])[None, None, :, :, None]  # i after t: no such term
    sub_of = torch.arange(C, device=device) // s
    not_before = (sub_of[None, :] >= torch.arange(n, device=device)[:, None])[None, :, :, None]  # (1, n, C, 1)
    eye = torch.eye(C, device=device, dtype=v.dtype)
    exp = lambda x: x.to(v.dtype).exp()  # noqa: E731  (exponents computed in float64)
    out = torch.empty_like(v)
    for c0 in range(0, T + pad, C):
        qc, kc, vc, bc = (x[:, c0 : c0 + C] for x in (q, k, v, beta))
        G = g[:, c0 : c0 + C].double().cumsum(1)  # (H, C, Hd); float64, as its differences are what counts
        Gs, ks, qs = G.view(H, n, s, Hd), kc.view(H, n, s, Hd), qc.view(H, n, s, Hd)
        # within a sub-chunk: the exact pairwise decays, (H, n, s t, s i, Hd)
        pair = exp((Gs[:, :, :, None] - Gs[:, :, None]).masked_fill(later_in_sub, float("-inf")))
        kd = ks[:, :, None] * pair
        # across sub-chunks: split at r, the cumulative decay where sub-chunk b starts
        r = torch.cat([torch.zeros_like(Gs[:, :1, 0]), Gs[:, :-1, -1]], 1)[:, :, None]  # (H, n, 1, Hd)
        to_t = exp(Gs - r)  # (H, n, s, Hd)
        from_i = kc[:, None] * exp((r - G[:, None]).masked_fill(not_before, float("-inf")))  # (H, n, C, Hd)
        A = torch.einsum("hbtd,hbid->hbti", ks * to_t, from_i).reshape(H, C, C)
        P = torch.einsum("hbtd,hbid->hbti", qs * to_t, from_i).reshape(H, C, C)
        A.view(H, n, s, n, s).diagonal(0, 1, 3).copy_((ks[:, :, :, None] * kd).sum(-1).permute(0, 2, 3, 1))
        P.view(H, n, s, n, s).diagonal(0, 1, 3).copy_((qs[:, :, :, None] * kd).sum(-1).permute(0, 2, 3, 1))
        decay = exp(G)
        rhs = bc * (vc - (kc * decay) @ S)  # (H, C, Hd value)
        U = torch.linalg.solve_triangular(eye + bc * A.tril(-1), rhs, upper=False, unitriangular=True)
        out[:, c0 : c0 + C] = (qc * decay) @ S + P @ U
        S = decay[:, -1, :, None] * S + (kc * exp(G[:, -1:] - G)).transpose(1, 2) @ U
    return out[:, :T].transpose(0, 1), S
