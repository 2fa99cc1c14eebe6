"""Softmax attention over the KV cache (`attend`), the Q/K norms and RoPE before it, grouped-query `Attention` and
the `OutputGate` some models multiply its output by."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from moerun.kv_cache import KVCache
from moerun.layers.linear import Linear
from moerun.layers.norm import RMSNorm, unit_rms
from moerun.layers.ops import Kernels
from moerun.layers.rope import Rope
from moerun.step import Step

if TYPE_CHECKING:  # Triton's, which only CUDA builds of torch bring
    from moerun.kernels.act_i8 import QAct
from torch import nn

# Float32 attention scores (all query heads) `attend` holds at once: a long prompt attends in blocks of query tokens,
# as its rows are independent. At once, a 4096-token prompt of 32 heads held 2 GiB of scores and twice that again in
# their masked and softmaxed copies; a 32k-token one, 128 GiB.
ATTEND_SCORE_BYTES = 256 << 20


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
    seqs: torch.Tensor | None = None,
    score_bytes: int = ATTEND_SCORE_BYTES,
) -> torch.Tensor:
    """Softmax attention of q (T, H, Dk) over one sequence's k (S, G, Dk), v (S, G, Dv), or, given `seqs` (B,), over
    every sequence's k (n_seq, S, G, Dk), v (n_seq, S, G, Dv) when the tokens are B blocks of T/B consecutive rows,
    block b reading sequence seqs[b] (Step.blocks: B = T in a decode batch, one token per sequence; B prompt chunks in
    a captured prompt step); query head h reads KV head h // (H/G). `allowed` (T, S) masks each token's slots.

    `sinks` (H,) are per-head logits that join each softmax's denominator without a value (gpt-oss). A long prompt
    of one sequence attends in blocks of query tokens whose float32 scores take at most `score_bytes`.
    Returns (T, H, Dv) float32.
    """
    if seqs is not None:  # each block's sequence
        k, v = k[seqs], v[seqs]
    T, H, Dk = q.shape
    G, Dv = v.shape[-2:]
    rows = max(1, score_bytes // (4 * H * k.shape[-3]))
    if k.dim() == 3 and T > rows:  # one sequence's long prompt: blocks of query tokens
        return torch.cat(
            [
                attend(q[i : i + rows], k, v, allowed[i : i + rows], scale, sinks, score_bytes=score_bytes)
                for i in range(0, T, rows)
            ]
        )
    if k.dim() == 3:  # one sequence: one block
        k, v = k[None], v[None]
    B, S = k.shape[:2]
    Tb, HG = T // B, H // G
    # The H/G query heads of a KV head are rows of one product with that head's keys: a broadcast matmul would copy
    # the keys and values out for every query head (on the CPU, a third of a small model's decode step). Row
    # h * Tb + t of a block's (KV head) product is its token t's query head h.
    qg = q.float().reshape(B, Tb, G, HG, Dk).permute(0, 2, 3, 1, 4).reshape(B, G, HG * Tb, Dk)
    kt, vt = k.float().permute(0, 2, 3, 1), v.float().permute(0, 2, 1, 3)  # (B, G, Dk, S), (B, G, S, Dv)
    mask = ~allowed.reshape(B, 1, 1, Tb, S).expand(B, 1, HG, Tb, S).reshape(B, 1, HG * Tb, S)
    scores = (torch.matmul(qg, kt) * scale).masked_fill(mask, float("-inf"))  # (B, G, HG * Tb, S)
    if sinks is not None:
        sink = sinks.float().reshape(1, G, HG, 1, 1).expand(1, G, HG, Tb, 1).reshape(1, G, HG * Tb, 1)
        probs = torch.softmax(torch.cat([scores, sink.expand(*scores.shape[:-1], 1)], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, vt)  # (B, G, HG * Tb, Dv)
    return out.reshape(B, G, HG, Tb, Dv).permute(0, 3, 1, 2, 4).reshape(T, H, Dv)


GATE_FUNCTIONS = {"sigmoid": torch.sigmoid, "softplus": F.softplus}


class OutputGate(nn.Module):
    """The attention output (T, H, Dv) times fn(attn_gate x), x the attention's input, before the output projection:
    one value per channel (attn_gate [H Dv, D]: AFMoE, Laguna M.1) or one per head, broadcast over its channels
    (attn_gate [H, D]: Laguna XS.2, Step-3.5). fn is sigmoid (AFMoE, Step-3.5) or softplus (Laguna), in float32."""

    def __init__(self, wgate: Linear, function: str, per_head: bool) -> None:
        super().__init__()
        self.wgate, self.function, self.per_head = wgate, GATE_FUNCTIONS[function], per_head

    def forward(self, out: torch.Tensor, x: torch.Tensor, i8: QAct | None = None) -> torch.Tensor:
        T, H, Dv = out.shape
        gate = self.function(self.wgate(x, i8).float())  # (T, H) or (T, H * Dv)
        return out * (gate[:, :, None] if self.per_head else gate.view(T, H, Dv))


class Attention(nn.Module):
    """Grouped-query attention with optional per-head Q/K RMSNorm (and V's, without a weight: `v_norm_eps`), QKV
    biases, sinks, a sliding window and an output gate. The q, k and v projections are three tensors (wq, wk, wv) or,
    in files that store them so (attn_qkv), one (wqkv)."""

    def __init__(
        self,
        *,
        wq: Linear | None = None,
        wk: Linear | None = None,
        wv: Linear | None = None,
        wqkv: Linear | None = None,
        wo: Linear,
        rope: Rope,
        cache: KVCache,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        v_head_dim: int,
        scale: float,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
        window: int = 0,
        sinks: torch.Tensor | None = None,
        gate: OutputGate | None = None,
        v_norm_eps: float | None = None,
        kernels: Kernels,
    ) -> None:
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = wq, wk, wv, wo
        self.q_norm, self.k_norm = q_norm, k_norm
        self.rope, self.cache = rope, cache
        self.n_heads, self.n_kv_heads, self.head_dim, self.v_head_dim = n_heads, n_kv_heads, head_dim, v_head_dim
        self.scale, self.window = scale, window
        self.register_buffer("sinks", sinks, persistent=False)
        self.gate, self.v_norm_eps, self.kernels = gate, v_norm_eps, kernels
        self.qkv_in_file = wqkv is not None
        # q, k and v in one product: the file's, or stacked where the kernels can
        self.wqkv = wqkv if self.qkv_in_file else self.kernels.stack_rows([wq, wk, wv])
        self.qkv_rows = (n_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * v_head_dim)

    def forward(self, x: torch.Tensor, step: Step, i8: QAct | None = None) -> torch.Tensor:
        """x (T, D), and its int8 rounding where its norm made one (for the q/k/v products) -> (T, D)."""
        T = x.shape[0]
        q, k, v = self.project(x, i8)
        q = q.view(T, self.n_heads, self.head_dim)
        k = k.view(T, self.n_kv_heads, self.head_dim)
        v = v.view(T, self.n_kv_heads, self.v_head_dim)
        if self.v_norm_eps is not None:  # Gemma 4: V normalised per head, without a weight, before it is stored
            v = unit_rms(v, self.v_norm_eps)
        # k_all, v_all: (S, G, Dh), or (n_seq, S, G, Dh) that the step's blocks index
        q, k_all, v_all = self.kernels.norm_rope_store(q, k, v, self.q_norm, self.k_norm, self.rope, step, self.cache)
        attend_args = (q, k_all, v_all, step.mask(self.window), self.scale, self.sinks, step.blocks)
        if self.kernels.attend_i8 is None or self.gate is not None:  # a gated output is rounded for wo by wo
            out, out_i8 = self.kernels.attend(*attend_args), None  # (T, H, Dv)
        else:
            out, out_i8 = self.kernels.attend_i8(*attend_args)  # and out as (T, H * Dv) rounded for wo, or None
        if self.gate is not None:
            out = self.gate(out, x, i8)
        return self.wo(out.reshape(T, self.n_heads * self.v_head_dim), out_i8)

    def project(self, x: torch.Tensor, i8: QAct | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (T, D) -> q (T, H*Dh), k (T, G*Dh), v (T, G*Dv): one stacked product, or three where the weights
        differ in type or activation hooks must see each tensor's input under its own name."""
        if self.wqkv is None or (self.wqkv.hooks.activation and not self.qkv_in_file):
            return self.wq(x, i8), self.wk(x, i8), self.wv(x, i8)
        return self.wqkv(x, i8).split(self.qkv_rows, dim=-1)


def norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_norm: RMSNorm | None,
    k_norm: RMSNorm | None,
    rope: Rope,
    positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q/K RMSNorm (per head, or over the whole projection as in olmoe: as long as its weight), then RoPE.
    q (T, H, Dh), k (T, G, Dh), v (T, G, Dv) -> q, k float32 and v as it came."""
    T = q.shape[0]
    if q_norm is not None:
        q = q_norm(q.reshape(T, -1, q_norm.weight.numel())).view_as(q)
    if k_norm is not None:
        k = k_norm(k.reshape(T, -1, k_norm.weight.numel())).view_as(k)
    return rope(q, positions), rope(k, positions), v


def qk_norms_per_head(q: torch.Tensor, q_norm: RMSNorm | None, k_norm: RMSNorm | None) -> bool | None:
    """What the fused kernels take of norm_rope's Q/K norms: True, one weight per head for q and k; False, none;
    None, anything else (olmoe's over the whole projection), which only the torch reference does."""
    if q_norm is None and k_norm is None:
        return False
    if q_norm is not None and k_norm is not None and q_norm.weight.numel() == k_norm.weight.numel() == q.shape[-1]:
        return True
    return None


def norm_rope_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_norm: RMSNorm | None,
    k_norm: RMSNorm | None,
    rope: Rope,
    step: Step,
    cache: KVCache,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """norm_rope, then k and v into the KV cache: -> q (T, H, Dh) float32 and the slots attention reads
    (KVCache.update)."""
    q, k, v = norm_rope(q, k, v, q_norm, k_norm, rope, step.positions)
    return q, *cache.update(step, k, v)
