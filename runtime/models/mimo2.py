"""MiMo-V2 (Xiaomi MiMo-V2-Flash): sliding-window and full-attention layers side by side, each kind with its own
KV head count (a per-layer head_count_kv), RoPE base (freq_base_swa on the sliding layers) and, where the file has
them, attention sinks; partial NeoX RoPE over keys wider than values (the file's context scaling on the full layers;
the sliding ones keep their positions, with the rope op's magnitude factor); the attention output scaled by
value_scale.
A layer without a router (ffn_gate_inp) has a dense SwiGLU FFN; the others route by sigmoid scores plus
exp_probs_b, the chosen weights renormalised and never scaled (llama.cpp's mimo2 graph fixes all three)."""

from __future__ import annotations

import math

import torch
from torch import nn

from moeprep.gguf.reader import GGUFModel
from moerun.config import GATING_SIGMOID, ModelArgs
from moerun.layers import Block, yarn_attn_factor
from moerun.models.base import BuildContext
from moerun.step import Step


def read_args(g: GGUFModel) -> ModelArgs:
    names = {t.name for t in g.tensors}
    dense = 0  # the leading layers without a router
    while f"blk.{dense}.ffn_gate_inp.weight" not in names and dense < int(g.get(f"{g.arch}.block_count", 0)):
        dense += 1
    fixed = {
        "rope_style": "neox",
        "gating": GATING_SIGMOID,
        "expert_weights_norm": True,
        "expert_weights_scale": 0.0,
        "n_dense_lead": dense,
        "output_required": True,
    }
    # llama.cpp's default base for the sliding layers when the file gives none
    return ModelArgs.from_gguf(g, fixed=fixed, defaults={"rope_base_swa": 10000.0}, kv_heads_vary=True)


class ScaledOutput(nn.Module):
    """An attention whose output is multiplied by a constant (MiMo's value scale)."""

    def __init__(self, attn: nn.Module, scale: float) -> None:
        super().__init__()
        self.attn, self.scale = attn, scale

    def forward(self, x: torch.Tensor, step: Step, i8=None) -> torch.Tensor:
        # i8: the norm's int8 rounding of x, unused here: its products round x themselves
        return self.attn(x, step) * self.scale


def build_block(ctx: BuildContext, layer: int) -> Block:
    a, w, p = ctx.args, ctx.weights, f"blk.{layer}"
    sliding = a.swa_layers[layer]
    # llama.cpp's mimo2 gives the sliding layers no context scaling of their own: positions as they are, with the
    # magnitude factor the rope op applies on every layer
    rope = ctx.rope(base=a.rope_base_swa, scaled=False, attn_factor=yarn_attn_factor(a)) if sliding else ctx.rope()
    attn: nn.Module = ctx.attention(layer, rope, scale=1.0 / math.sqrt(a.head_dim))  # sinks, window: the layer's
    if a.attn_value_scale not in (0.0, 1.0):
        attn = ScaledOutput(attn, a.attn_value_scale)
    ffn = ctx.routed_experts(layer) if f"{p}.ffn_gate_inp.weight" in w else ctx.feed_forward(layer)
    return ctx.block(layer, attn, ffn)
