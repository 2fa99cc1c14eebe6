"""GLM-4.5 (glm4moe): QKV biases, optional Q/K norm, partial NeoX RoPE; leading dense blocks, then sigmoid-gated
experts with exp_probs_b and a shared expert; the FFN norm is called post_attention_norm. The trailing nextn
(multi-token prediction) blocks are not run."""

from __future__ import annotations

from moeprep.gguf.reader import GGUFModel
from moerun.config import GATING_SIGMOID, ModelArgs
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
    args = ModelArgs.from_gguf(g, fixed={"rope_style": "neox"}, defaults={"gating": GATING_SIGMOID})
    return args.replace(shared_expert_dim=args.expert_dim * args.n_shared_experts)


def build_block(ctx: BuildContext, layer: int) -> Block:
    args, w, hooks = ctx.args, ctx.weights, ctx.hooks
    p = f"blk.{layer}"
    attn = Attention.load(args, w, hooks, layer, ctx.rope(), ctx.kv_cache(args.n_kv_heads, args.head_dim, args.v_head_dim))
    if layer < args.n_dense_lead:
        ffn = FeedForward.load(w, hooks, layer)
    else:
        router = Router.load(args, w, hooks, layer)
        ffn = MoE(layer, router, GGUFExperts.load(w, hooks, layer), hooks, shared=FeedForward.load(w, hooks, layer, "_shexp"))
    return Block(RMSNorm.load(w, f"{p}.attn_norm.weight", args.norm_eps), attn,
                 RMSNorm.load(w, f"{p}.post_attention_norm.weight", args.norm_eps), ffn)
