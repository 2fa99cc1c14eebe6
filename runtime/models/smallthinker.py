"""SmallThinker (PowerInfer's SmallThinker-4B-A0.6B and -21B-A3B), as llama.cpp's smallthinker graph
(src/models/smallthinker.cpp) computes it.

Every layer is MoE, and its router reads the block's input (the residual stream before attn_norm), not the FFN's
normed input; the file's gating function (llama.cpp refuses a file without one), top-k renormalised, never scaled;
the experts are ReLU-gated (relu(gate x) * up x). Attention: plain GQA with NeoX RoPE over whole heads.

A file with attention.sliding_window is the sliding-window variant: the window is 4096 whatever the file says, the
first layer of every four (or of the file's sliding_window_pattern) attends to everything and the others slide,
and every 4th layer from layer 0 has no RoPE, except in a model of exactly 4 layers (llama.cpp's rule, kept here).
Without the key, every layer attends to everything with RoPE."""

from __future__ import annotations

import torch
from torch import nn

from moeprep.errors import MoeprepError
from moeprep.gguf.reader import GGUFModel
from moerun.config import ModelArgs
from moerun.layers import Activation, MoE, RMSNorm
from moerun.models.base import BuildContext
from moerun.step import Step

REGLU = Activation("reglu")
WINDOW = 4096  # llama.cpp's, whatever the file's attention.sliding_window says (where it is above 0)
SWA_PATTERN = 4  # one full layer, then three sliding ones, where the file gives no sliding_window_pattern
NO_ROPE_EVERY = 4  # in the sliding-window variant: layers 0, 4, 8... have no RoPE


def read_args(g: GGUFModel) -> ModelArgs:
    arch = g.arch
    if g.get(f"{arch}.expert_gating_func") is None:
        raise MoeprepError(f"{g.path}: {arch}.expert_gating_func is missing (llama.cpp cannot run this file either)")
    sliding = int(g.get(f"{arch}.attention.sliding_window", 0) or 0) > 0
    fixed = {
        "rope_style": "neox",
        "expert_weights_norm": True,
        "expert_weights_scale": 0.0,
        "n_dense_lead": 0,
        "sliding_window": WINDOW if sliding else 0,
    }
    # the full layer first in every period (llama.cpp's dense_first)
    args = ModelArgs.from_gguf(g, fixed=fixed, defaults={"swa_pattern": SWA_PATTERN, "swa_full_first": True})
    if args.rope_dim != args.head_dim or args.head_dim != args.v_head_dim:
        raise MoeprepError(f"{g.path}: smallthinker needs rope.dimension_count == key_length == value_length")
    return args


def rotates(args: ModelArgs, layer: int) -> bool:
    """Does `layer` apply RoPE: always without a sliding window; with one, all but every 4th layer from layer 0,
    unless the model has exactly 4 layers (llama.cpp's n_no_rope_layer_step == n_layer test)."""
    return not args.sliding_window or args.n_layers == NO_ROPE_EVERY or layer % NO_ROPE_EVERY != 0


class InputRoutedBlock(nn.Module):
    """h = x + attn(attn_norm(x)); out = h + experts(ffn_norm(h)) with the experts chosen from x itself."""

    def __init__(self, attn_norm: RMSNorm, attn: nn.Module, ffn_norm: RMSNorm, moe: MoE) -> None:
        super().__init__()
        self.attn_norm, self.attn, self.ffn_norm, self.moe = attn_norm, attn, ffn_norm, moe

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        x, normed, i8 = self.attn_norm.add_forward_i8(x, delta)
        ids, weights = self.moe.route(x, step)
        h, normed, i8 = self.ffn_norm.add_forward_i8(x, self.attn(normed, step, i8))
        return h, self.moe.experts(normed, ids, weights, step, i8)


def build_block(ctx: BuildContext, layer: int) -> InputRoutedBlock:
    a, p = ctx.args, f"blk.{layer}"
    base = a.rope_base_swa if a.swa_layers[layer] else a.rope_base
    attn = ctx.attention(layer, ctx.rope(base=base, rotate=rotates(a, layer)))
    return InputRoutedBlock(
        ctx.norm(f"{p}.attn_norm.weight"),
        attn,
        ctx.norm(f"{p}.ffn_norm.weight"),
        ctx.routed_experts(layer, REGLU),
    )
