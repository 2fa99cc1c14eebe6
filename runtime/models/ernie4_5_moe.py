"""ERNIE 4.5 MoE (ernie4_5-moe): plain GQA with normal RoPE; leading dense layers, then MoE layers routed by softmax
with exp_probs_b added for the choice only, the chosen weights renormalised, beside an optional shared expert."""

from __future__ import annotations

from moeprep.gguf.reader import GGUFModel
from moerun.config import GATING_SOFTMAX, ModelArgs
from moerun.layers import Block
from moerun.models.base import BuildContext


def read_args(g: GGUFModel) -> ModelArgs:
    fixed = {"rope_style": "normal", "gating": GATING_SOFTMAX, "expert_weights_norm": True, "expert_weights_scale": 0.0}
    return ModelArgs.from_gguf(g, fixed=fixed)


def build_block(ctx: BuildContext, layer: int) -> Block:
    g = ctx.weights.gguf
    step = int(g.get(f"{g.arch}.interleave_moe_layer_step", 1))
    if layer >= ctx.args.n_dense_lead and (layer + 1) % step == 0:
        ffn = ctx.routed_experts(layer, shared=ctx.args.shared_expert_dim > 0)
    else:
        ffn = ctx.feed_forward(layer)
    return ctx.block(layer, ctx.attention(layer), ffn)
