"""poolside's Laguna (XS.2 and M.1), as llama.cpp's laguna graph (src/models/laguna.cpp) computes it.

Attention: GQA with per-head Q/K RMSNorm and NeoX RoPE, the output multiplied by softplus(attn_gate x) (x: the
block's normed input) before attn_output, one gate value per head or per channel as the attn_gate tensor's rows
say (XS.2: per head; M.1: per channel). Query and KV head counts may differ by layer (per-layer head_count and
head_count_kv arrays, as llama.cpp reads them: XS.2's sliding layers have more query heads than its full ones).
A file with attention.sliding_window is hybrid (XS.2): the first layer of every four (or of the file's
sliding_window_pattern) attends to everything, the others slide and take plain RoPE over rope.dimension_count_swa
channels with base rope.freq_base_swa, never the file's context scaling, which (YaRN in the released models) the
full-attention layers apply. Without the key (M.1) every layer is full attention.

FFN: leading dense SwiGLU layers, then sigmoid routing with exp_probs_b, renormalised and scaled as the file's keys
say (sigmoid where it names no gating function), beside one shared expert of expert_shared_feed_forward_length.
No norms after the sublayers and no embedding scale, unlike AFMoE."""

from __future__ import annotations

import math

from moeprep.errors import MoeprepError
from moeprep.gguf.reader import GGUFModel
from moerun.config import GATING_SIGMOID, ModelArgs
from moerun.layers import Block
from moerun.models.base import BuildContext

SWA_PATTERN = 4  # one full-attention layer, then three sliding ones, where the file has no sliding_window_pattern


def read_args(g: GGUFModel) -> ModelArgs:
    defaults = {"gating": GATING_SIGMOID, "swa_pattern": SWA_PATTERN, "swa_full_first": True, "n_shared_experts": 1}
    args = ModelArgs.from_gguf(
        g,
        fixed={"rope_style": "neox", "selection_bias_required": True, "qk_norms_required": True},
        defaults=defaults,
        heads_vary=True,
        kv_heads_vary=True,
    )
    if args.head_dim != args.v_head_dim:
        raise MoeprepError(
            f"{g.path}: laguna needs key_length == value_length (got {args.head_dim}, {args.v_head_dim})"
        )
    # one shared expert of its own width; the routed experts' times their count where the file gives none
    return args.replace(shared_expert_dim=args.shared_expert_dim or args.expert_dim * args.n_shared_experts)


def build_block(ctx: BuildContext, layer: int) -> Block:
    a = ctx.args
    rope = ctx.rope(base=a.rope_base_swa, dim=a.rope_dim_swa, scaled=False) if a.swa_layers[layer] else ctx.rope()
    gate = ctx.output_gate(layer, "softplus")  # one value per head (XS.2) or per channel (M.1)
    # llama.cpp fixes the scale, and its loader requires both per-head norms
    attn = ctx.attention(layer, rope, scale=1.0 / math.sqrt(a.head_dim), gate=gate)
    return ctx.block(layer, attn, ctx.ffn(layer))
