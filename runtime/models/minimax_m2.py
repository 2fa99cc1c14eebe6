"""MiniMax-M2: GQA with Q/K RMSNorm over the whole projection (all heads at once, as olmoe), partial NeoX RoPE;
every block MoE, gated by the file's expert_gating_func (sigmoid in the released models) with exp_probs_b, the
chosen weights renormalised and never scaled. llama.cpp shapes its experts by feed_forward_length."""

from __future__ import annotations

from moeprep.gguf.reader import GGUFModel
from moerun.config import GATING_SIGMOID, ModelArgs
from moerun.layers import Block
from moerun.models.base import BuildContext


def read_args(g: GGUFModel) -> ModelArgs:
    fixed = {"rope_style": "neox", "expert_weights_norm": True, "expert_weights_scale": 0.0, "n_dense_lead": 0}
    fixed |= {"qk_norms_required": True, "selection_bias_required": True, "output_required": True}
    args = ModelArgs.from_gguf(g, fixed=fixed, defaults={"gating": GATING_SIGMOID})
    return args.replace(expert_dim=args.ffn_dim or args.expert_dim)


def build_block(ctx: BuildContext, layer: int) -> Block:
    return ctx.block(layer, ctx.attention(layer), ctx.routed_experts(layer))
