"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): QKV biases, NeoX RoPE; softmax router without renormalisation, plus a
shared expert scaled per token by sigmoid(ffn_gate_inp_shexp . x)."""

from __future__ import annotations

from moeprep.gguf.reader import GGUFModel
from moerun.config import PLAIN_MOE, ModelArgs
from moerun.layers import (
    Attention,
    Block,
    FeedForward,
    GGUFExperts,
    Linear,
    MoE,
    RMSNorm,
    Router,
)
from moerun.models.base import BuildContext


def read_args(g: GGUFModel) -> ModelArgs:
    args = ModelArgs.from_gguf(g, fixed={**PLAIN_MOE, "expert_weights_norm": False, "rope_style": "neox"})
    return args.replace(n_shared_experts=1, shared_expert_dim=args.shared_expert_dim or args.ffn_dim)


def build_block(ctx: BuildContext, layer: int) -> Block:
    args, w, hooks = ctx.args, ctx.weights, ctx.hooks
    p = f"blk.{layer}"
    attn = Attention.load(args, w, hooks, layer, ctx.rope(), ctx.kv_cache(args.n_kv_heads, args.head_dim, args.v_head_dim))
    router = Router.load(args, w, hooks, layer)
    shared_gate = Linear.load(w, f"{p}.ffn_gate_inp_shexp", hooks, shape=(1, args.dim))  # stored as (D,)
    moe = MoE(layer, router, GGUFExperts.load(w, hooks, layer), hooks,
              shared=FeedForward.load(w, hooks, layer, "_shexp"), shared_gate=shared_gate)
    return Block(RMSNorm.load(w, f"{p}.attn_norm.weight", args.norm_eps), attn,
                 RMSNorm.load(w, f"{p}.ffn_norm.weight", args.norm_eps), moe)
