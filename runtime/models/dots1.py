"""dots.llm1 (dots1): Qwen3's attention (per-head Q/K RMSNorm, NeoX RoPE) over DeepSeek-V3's FFN: leading dense
layers, then routed experts gated as the file says (sigmoid with exp_probs_b in the released model; renormalised and
scaled by its keys) beside shared experts."""

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
    return args.replace(shared_expert_dim=args.expert_dim * args.n_shared_experts)


def build_block(ctx: BuildContext, layer: int) -> Block:
    return ctx.block(layer, ctx.attention(layer), ctx.ffn(layer))
