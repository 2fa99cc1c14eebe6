"""llama with experts (Mixtral): normal (adjacent-pair) RoPE with optional llama3 rope_freqs, optional attention
scale; softmax router with top-k renormalisation. Without experts it is a dense llama."""

from __future__ import annotations

from moeprep.gguf.reader import GGUFModel
from moerun.config import PLAIN_MOE, ModelArgs
from moerun.layers import (
    Attention,
    Block,
    FeedForward,
    GGUFExperts,
    MoE,
    RMSNorm,
    Router,
)
from moerun.models.base import BuildContext


def read_args(g: GGUFModel) -> ModelArgs:
    args = ModelArgs.from_gguf(g, fixed={**PLAIN_MOE, "expert_weights_norm": True, "rope_style": "normal"})
    return args.replace(expert_dim=args.ffn_dim)  # the experts are feed_forward_length wide


def build_block(ctx: BuildContext, layer: int) -> Block:
    args, w, hooks = ctx.args, ctx.weights, ctx.hooks
    p = f"blk.{layer}"
    rope = ctx.rope(freq_factors="rope_freqs.weight") if "rope_freqs.weight" in w else ctx.rope()
    attn = Attention.load(args, w, hooks, layer, rope, ctx.kv_cache(args.n_kv_heads, args.head_dim, args.v_head_dim))
    if args.n_experts:
        router = Router.load(args, w, hooks, layer)
        ffn = MoE(layer, router, GGUFExperts.load(w, hooks, layer), hooks)
    else:
        ffn = FeedForward.load(w, hooks, layer)
    return Block(RMSNorm.load(w, f"{p}.attn_norm.weight", args.norm_eps), attn,
                 RMSNorm.load(w, f"{p}.ffn_norm.weight", args.norm_eps), ffn)
