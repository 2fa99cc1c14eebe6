"""Qwen3-MoE: GQA with per-head Q/K RMSNorm, NeoX RoPE; every block MoE, softmax router, top-k renormalised."""

from __future__ import annotations

from moeprep.gguf.reader import GGUFModel
from moerun.config import PLAIN_MOE, ModelArgs
from moerun.layers import Block
from moerun.models.base import BuildContext


def read_args(g: GGUFModel) -> ModelArgs:
    return ModelArgs.from_gguf(
        g, fixed={**PLAIN_MOE, "expert_weights_norm": True, "rope_style": "neox", "qk_norms_required": True}
    )


def build_block(ctx: BuildContext, layer: int) -> Block:
    return ctx.block(layer, ctx.attention(layer), ctx.routed_experts(layer))
