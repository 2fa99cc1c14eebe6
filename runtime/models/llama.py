"""llama with experts (Mixtral): normal (adjacent-pair) RoPE with optional llama3 rope_freqs, optional attention
scale; softmax router with top-k renormalisation. Without experts it is a dense llama."""

from __future__ import annotations

from moeprep.gguf.reader import GGUFModel
from moerun.config import PLAIN_MOE, ModelArgs
from moerun.layers import Block
from moerun.models.base import BuildContext


def read_args(g: GGUFModel) -> ModelArgs:
    args = ModelArgs.from_gguf(g, fixed={**PLAIN_MOE, "expert_weights_norm": True, "rope_style": "normal"})
    return args.replace(expert_dim=args.ffn_dim)  # the experts are feed_forward_length wide


def build_block(ctx: BuildContext, layer: int) -> Block:
    rope = ctx.rope(freq_factors="rope_freqs.weight") if "rope_freqs.weight" in ctx.weights else ctx.rope()
    ffn = ctx.routed_experts(layer) if ctx.args.n_experts else ctx.feed_forward(layer)
    return ctx.block(layer, ctx.attention(layer, rope), ffn)
