"""GLM-4.5 (glm4moe): QKV biases, optional Q/K norm, partial NeoX RoPE; leading dense blocks, then sigmoid-gated
experts with exp_probs_b and a shared expert; the FFN norm is called post_attention_norm. The trailing nextn
(multi-token prediction) blocks are not run."""

from __future__ import annotations

from moeprep.gguf.reader import GGUFModel
from moerun.config import GATING_SIGMOID, ModelArgs
from moerun.layers import Block
from moerun.models.base import BuildContext


def read_args(g: GGUFModel) -> ModelArgs:
    args = ModelArgs.from_gguf(
        g, fixed={"rope_style": "neox", "selection_bias_required": True}, defaults={"gating": GATING_SIGMOID}
    )
    return args.replace(shared_expert_dim=args.expert_dim * args.n_shared_experts)


def build_block(ctx: BuildContext, layer: int) -> Block:
    return ctx.block(layer, ctx.attention(layer), ctx.ffn(layer), ffn_norm="post_attention_norm")
