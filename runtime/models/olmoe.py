"""OLMoE: Q/K RMSNorm over the whole projection (not per head), NeoX RoPE; softmax router, no renormalisation."""

from __future__ import annotations

import torch

from moeprep.gguf.reader import GGUFModel
from moerun.config import ModelArgs
from moerun.layers import Attention, Block, GGUFExperts, Linear, MoE, RMSNorm, Router
from moerun.models.base import BuildContext


def read_args(g: GGUFModel) -> ModelArgs:
    return ModelArgs.from_gguf(g, fixed={"rope_style": "neox"})


def build_block(ctx: BuildContext, layer: int) -> Block:
    args, w, hooks = ctx.args, ctx.weights, ctx.hooks
    p = f"blk.{layer}"
    attn = Attention.load(args, w, hooks, layer, ctx.rope(), ctx.kv_cache(args.n_kv_heads, args.head_dim, args.v_head_dim))
    router = Router(Linear.load(w, f"{p}.ffn_gate_inp", hooks, torch.float32), args, normalize=False)
    moe = MoE(layer, router, GGUFExperts.load(w, hooks, layer), hooks)
    return Block(RMSNorm.load(w, f"{p}.attn_norm.weight", args.norm_eps), attn,
                 RMSNorm.load(w, f"{p}.ffn_norm.weight", args.norm_eps), moe)
