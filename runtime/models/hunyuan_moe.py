"""Hunyuan-A13B (hunyuan-moe): GQA whose per-head Q/K RMSNorm comes after NeoX RoPE (with rope_freqs factors where
the file has them), not before it; every block MoE, softmax top-k renormalised, beside an ungated shared expert.
llama.cpp shapes the routed experts by feed_forward_length."""

from __future__ import annotations

import math

import torch
from torch import nn

from moeprep.gguf.reader import GGUFModel
from moerun.config import PLAIN_MOE, ModelArgs
from moerun.layers import Block
from moerun.models.base import BuildContext
from moerun.step import Step


def read_args(g: GGUFModel) -> ModelArgs:
    args = ModelArgs.from_gguf(g, fixed={**PLAIN_MOE, "expert_weights_norm": True, "rope_style": "neox"})
    return args.replace(expert_dim=args.ffn_dim or args.expert_dim, n_shared_experts=1)


class NormAfterRope(nn.Module):
    """An Attention whose per-head Q/K norms run after RoPE: its projections, cache and output as they are."""

    def __init__(self, attn: nn.Module, q_norm: nn.Module, k_norm: nn.Module) -> None:
        super().__init__()
        self.attn, self.q_norm, self.k_norm = attn, q_norm, k_norm

    def forward(self, x: torch.Tensor, step: Step, i8=None) -> torch.Tensor:
        # i8: the norm's int8 rounding of x, unused here: its products round x themselves
        a, T = self.attn, x.shape[0]
        q, k, v = a.project(x)
        q = self.q_norm(a.rope(q.view(T, a.n_heads, a.head_dim), step.positions))
        k = self.k_norm(a.rope(k.view(T, a.n_kv_heads, a.head_dim), step.positions))
        k_all, v_all = a.cache.update(step, k, v.view(T, a.n_kv_heads, a.v_head_dim))
        out = a.kernels.attend(q, k_all, v_all, step.mask(), a.scale, None, step.blocks)
        return a.wo(out.reshape(T, a.n_heads * a.v_head_dim))


def build_block(ctx: BuildContext, layer: int) -> Block:
    a, w = ctx.args, ctx.weights
    factors = "rope_freqs.weight" if "rope_freqs.weight" in w else None
    attn = ctx.attention(layer, ctx.rope(freq_factors=factors), scale=1.0 / math.sqrt(a.head_dim))
    q_norm, k_norm = attn.q_norm, attn.k_norm
    attn.q_norm = attn.k_norm = None  # applied after RoPE by the wrapper
    return ctx.block(layer, NormAfterRope(attn, q_norm, k_norm), ctx.routed_experts(layer, shared=True))
