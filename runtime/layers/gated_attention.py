"""Gated full attention (Qwen3-Next, Qwen3.5/3.6-MoE): grouped-query attention whose query projection also gives,
per head, an output gate; the attention output is multiplied by sigmoid(gate) before the output projection.

attn_q's rows are, per head, Dh query rows and then Dh gate rows. Q and K take a per-head RMSNorm, then RoPE.
"""

from __future__ import annotations

import torch
from torch import nn

from moerun.kv_cache import KVCache
from moerun.layers.linear import Linear
from moerun.layers.norm import RMSNorm
from moerun.layers.ops import Kernels
from moerun.layers.rope import Rope
from moerun.step import Step


class GatedAttention(nn.Module):
    def __init__(
        self,
        *,
        wq: Linear,
        wk: Linear,
        wv: Linear,
        wo: Linear,
        q_norm: RMSNorm,
        k_norm: RMSNorm,
        rope: Rope,
        cache: KVCache,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        scale: float,
        kernels: Kernels,
    ) -> None:
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = wq, wk, wv, wo
        self.q_norm, self.k_norm, self.rope, self.cache = q_norm, k_norm, rope, cache
        self.n_heads, self.n_kv_heads, self.head_dim, self.scale = n_heads, n_kv_heads, head_dim, scale
        self.kernels = kernels

    def forward(self, x: torch.Tensor, step: Step, i8=None) -> torch.Tensor:
        # i8: the norm's int8 rounding of x, unused here: its products round x themselves
        T, H, G, Dh = x.shape[0], self.n_heads, self.n_kv_heads, self.head_dim
        q_and_gate = self.wq(x).view(T, H, 2, Dh)
        q, gate = q_and_gate[:, :, 0].contiguous(), q_and_gate[:, :, 1].reshape(T, H * Dh)
        k, v = self.wk(x).view(T, G, Dh), self.wv(x).view(T, G, Dh)
        q, k_all, v_all = self.kernels.norm_rope_store(q, k, v, self.q_norm, self.k_norm, self.rope, step, self.cache)
        out = self.kernels.attend(q, k_all, v_all, step.mask(), self.scale, None, step.blocks)  # (T, H, Dh)
        return self.wo(out.reshape(T, H * Dh) * torch.sigmoid(gate.float()))
