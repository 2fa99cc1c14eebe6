"""OLMoE: Q/K RMSNorm over the whole projection (not per head), NeoX RoPE; softmax router, no renormalisation."""

from __future__ import annotations

from moeprep.gguf.reader import GGUFModel
from moerun.config import PLAIN_MOE, ModelArgs
from moerun.layers import Attention, Block, GGUFExperts, MoE, RMSNorm, Router
from moerun.models.base import BuildContext


def read_args(g: GGUFModel) -> ModelArgs:
    args = ModelArgs.from_gguf(g, fixed={**PLAIN_MOE, "expert_weights_norm": False, "rope_style": "neox"})
    return args.replace(expert_dim=args.ffn_dim)  # the experts are feed_forward_length wide


def build_block(ctx: BuildContext, layer: int) -> Block:
    args, w, hooks = ctx.args, ctx.weights, ctx.hooks
    p = f"blk.{layer}"
    attn = Attention.load(args, w, hooks, layer, ctx.rope(), ctx.kv_cache(args.n_kv_heads, args.head_dim, args.v_head_dim))
    router = Router.load(args, w, hooks, layer)
    moe = MoE(layer, router, GGUFExperts.load(w, hooks, layer), hooks)
    return Block(RMSNorm.load(w, f"{p}.attn_norm.weight", args.norm_eps), attn,
                 RMSNorm.load(w, f"{p}.ffn_norm.weight", args.norm_eps), moe)
