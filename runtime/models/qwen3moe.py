"""Qwen3-MoE: GQA with per-head Q/K RMSNorm, NeoX RoPE; every block MoE, softmax router, top-k renormalised."""

from __future__ import annotations

from moeprep.gguf.reader import GGUFModel
from moerun.config import PLAIN_MOE, ModelArgs
from moerun.layers import Attention, Block, GGUFExperts, MoE, RMSNorm, Router
from moerun.models.base import BuildContext


def read_args(g: GGUFModel) -> ModelArgs:
    return ModelArgs.from_gguf(g, fixed={**PLAIN_MOE, "expert_weights_norm": True, "rope_style": "neox"})


def build_block(ctx: BuildContext, layer: int) -> Block:
    args, w, hooks = ctx.args, ctx.weights, ctx.hooks
    p = f"blk.{layer}"
    attn = Attention.load(args, w, hooks, layer, ctx.rope(), ctx.kv_cache(args.n_kv_heads, args.head_dim, args.v_head_dim))
    router = Router.load(args, w, hooks, layer)
    moe = MoE(layer, router, GGUFExperts.load(w, hooks, layer), hooks)
    return Block(RMSNorm.load(w, f"{p}.attn_norm.weight", args.norm_eps), attn,
                 RMSNorm.load(w, f"{p}.ffn_norm.weight", args.norm_eps), moe)
