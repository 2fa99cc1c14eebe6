"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): QKV biases, NeoX RoPE; softmax router without renormalisation, plus a
shared expert scaled per token by sigmoid(ffn_gate_inp_shexp . x)."""

from __future__ import annotations

from moeprep.gguf.reader import GGUFModel
from moerun.config import PLAIN_MOE, ModelArgs
from moerun.layers import Block
from moerun.models.base import BuildContext


def read_args(g: GGUFModel) -> ModelArgs:
    args = ModelArgs.from_gguf(
        g, fixed={**PLAIN_MOE, "expert_weights_norm": False, "rope_style": "neox", "output_required": True}
    )
    return args.replace(n_shared_experts=1, shared_expert_dim=args.shared_expert_dim or args.ffn_dim)


def build_block(ctx: BuildContext, layer: int) -> Block:
    shared_gate = ctx.linear(f"blk.{layer}.ffn_gate_inp_shexp", shape=(1, ctx.args.dim))  # stored as (D,)
    moe = ctx.routed_experts(layer, shared=True, shared_gate=shared_gate)
    return ctx.block(layer, ctx.attention(layer), moe)
