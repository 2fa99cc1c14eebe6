"""Arcee's AFMoE (Trinity Nano/Mini/Large), as llama.cpp's afmoe graph (src/models/afmoe.cpp) computes it.

The token embedding is scaled by sqrt(D). Attention: GQA with per-head Q/K RMSNorm and NeoX RoPE, the output gated
per channel by sigmoid(attn_gate x) (x: the block's normed input) before attn_output; three sliding-window layers to
one full-attention layer unless the file gives another pattern (the sliding layers' RoPE base is freq_base_swa
where the file has it); every 4th layer (the full-attention one, in the released models) has no RoPE at all, a
rule llama.cpp fixes whatever the file says. Both sublayers' outputs are RMS-normalised again before the residual
add (post_attention_norm, post_ffw_norm). FFN: leading dense SwiGLU layers, then sigmoid routing with exp_probs_b,
renormalised and scaled as the file's keys say, beside a shared expert."""

from __future__ import annotations

import math

import numpy as np

from moeprep.errors import MoeprepError
from moeprep.gguf.reader import GGUFModel
from moerun.config import GATING_SIGMOID, ModelArgs
from moerun.layers import OutputGate, SandwichBlock
from moerun.models.base import BuildContext

NO_ROPE_EVERY = 4  # llama.cpp's n_no_rope_layer_step, which its afmoe loader never reads from the file
SWA_PATTERN = 4  # three sliding layers, then a full one, where the file has no sliding_window_pattern


def read_args(g: GGUFModel) -> ModelArgs:
    dim = int(g.get(f"{g.arch}.embedding_length", 0))
    fixed = {"rope_style": "neox", "embed_scale": float(np.float32(math.sqrt(dim)))}  # sqrtf(n_embd)
    fixed |= {"qk_norms_required": True, "selection_bias_required": True}
    args = ModelArgs.from_gguf(g, fixed=fixed, defaults={"gating": GATING_SIGMOID, "swa_pattern": SWA_PATTERN})
    if args.head_dim != args.v_head_dim:
        raise MoeprepError(f"{g.path}: afmoe needs key_length == value_length (got {args.head_dim}, {args.v_head_dim})")
    # one shared expert is expert_feed_forward_length wide; several are as wide together
    return args.replace(shared_expert_dim=args.expert_dim * args.n_shared_experts)


def build_block(ctx: BuildContext, layer: int) -> SandwichBlock:
    a, p = ctx.args, f"blk.{layer}"
    sliding = a.swa_layers[layer]
    rotate = (layer + 1) % NO_ROPE_EVERY != 0
    rope = ctx.rope(base=a.rope_base_swa if sliding else a.rope_base, rotate=rotate)
    gate = OutputGate(ctx.linear(f"{p}.attn_gate"), "sigmoid", per_head=False)
    attn = ctx.attention(layer, rope, scale=1.0 / math.sqrt(a.head_dim), gate=gate)  # llama.cpp fixes the scale
    if layer < a.n_dense_lead:
        ffn = ctx.feed_forward(layer)
    else:
        ffn = ctx.routed_experts(layer, shared=a.n_shared_experts > 0)
    return SandwichBlock(
        ctx.norm(f"{p}.attn_norm.weight"),
        attn,
        ctx.norm(f"{p}.post_attention_norm.weight"),
        ctx.norm(f"{p}.ffn_norm.weight"),
        ffn,
        ctx.norm(f"{p}.post_ffw_norm.weight"),
    )
