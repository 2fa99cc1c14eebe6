"""OLMoE: Q/K RMSNorm over the whole projection (not per head), NeoX RoPE; softmax router, no renormalisation."""

from __future__ import annotations

from moeprep.gguf.reader import GGUFModel
from moerun.config import PLAIN_MOE, ModelArgs
from moerun.layers import Block
from moerun.models.base import BuildContext


def read_args(g: GGUFModel) -> ModelArgs:
    args = ModelArgs.from_gguf(
        g,
        fixed={
            **PLAIN_MOE,
            "expert_weights_norm": False,
            "rope_style": "neox",
            "qk_norms_required": True,
            "output_required": True,
        },
    )
    return args.replace(expert_dim=args.ffn_dim)  # the experts are feed_forward_length wide


def build_block(ctx: BuildContext, layer: int) -> Block:
    return ctx.block(layer, ctx.attention(layer), ctx.routed_experts(layer))
