"""Ling 2.0 (bailingmoe2): Qwen3's attention with q, k and v stored as one attn_qkv tensor and a partial NeoX
RoPE, over DeepSeek-V3's FFN: leading dense layers, then group-limited sigmoid routing with exp_probs_b (renormalised
and scaled by the file's keys) beside shared experts. The file's NextN (multi-token prediction) blocks are not run."""

from __future__ import annotations

from moeprep.gguf.reader import GGUFModel
from moerun.config import GATING_SIGMOID, ModelArgs
from moerun.layers import Block
from moerun.models.base import BuildContext


def read_args(g: GGUFModel) -> ModelArgs:
    args = ModelArgs.from_gguf(
        g,
        fixed={"rope_style": "neox", "qk_norms_required": True, "output_required": True},
        defaults={"gating": GATING_SIGMOID},
    )
    # expert_shared_feed_forward_length is one shared expert's width (the routed experts' where absent)
    return args.replace(shared_expert_dim=(args.shared_expert_dim or args.expert_dim) * args.n_shared_experts)


def build_block(ctx: BuildContext, layer: int) -> Block:
    return ctx.block(layer, ctx.attention(layer), ctx.ffn(layer))
