"""Nemotron-H MoE (nemotron_h_moe, Nemotron-3-Nano): each layer is attn_norm and one part, by a pattern the file
spells with two per-layer arrays: Mamba-2 (layers/mamba2.py) where attention.head_count_kv and feed_forward_length
are both 0, GQA without RoPE where only feed_forward_length is 0, and an FFN elsewhere. The FFN is ungated: routed
experts relu(up x)^2 -> down, chosen by sigmoid scores plus exp_probs_b, their weights renormalised and scaled as the
file says (expert_weights_norm, expert_weights_scale), beside an ungated relu^2 shared expert. Latent MoE
(ffn_latent_down/up, Nemotron-3-Super) and the MTP block are not run."""

from __future__ import annotations

import torch
from torch import nn

from moeprep.errors import MoeprepError
from moeprep.gguf.reader import GGUFModel
from moerun.config import GATING_SIGMOID, ModelArgs
from moerun.layers import RELU_SQR, MoE, RMSNorm, UngatedFeedForward
from moerun.models.base import BuildContext
from moerun.models.granite_hybrid import mamba2_mixer
from moerun.step import Step


def read_args(g: GGUFModel) -> ModelArgs:
    eps = g.get(f"{g.arch}.attention.layernorm_rms_epsilon", g.get(f"{g.arch}.attention.layernorm_epsilon"))
    args = ModelArgs.from_gguf(
        g,
        fixed={"gating": GATING_SIGMOID, "n_dense_lead": 0, "rope_style": "normal", "selection_bias_required": True},
        defaults={"norm_eps": eps if eps is not None else 1e-5},
    )
    return args.replace(rope_dim=0, n_shared_experts=1)  # no RoPE in any layer


def layer_kind(g: GGUFModel, args: ModelArgs, layer: int) -> str:
    """The layer's one part: "mamba", "attention" or "ffn", as llama.cpp's nemotron-h loader tells them apart."""
    ffn = g.get(f"{g.arch}.feed_forward_length", 0)
    n_ff = ffn[layer] if isinstance(ffn, list) else ffn
    if n_ff:
        return "ffn"
    return "attention" if args.kv_heads_by_layer[layer] else "mamba"


class OnePartBlock(nn.Module):
    """A residual block of one part: h = x + part(norm(x)). Handed on as (x, part's output), whose sum the next
    norm takes (see Block). A part that mixes positions (Mamba-2, attention) sits in `attn`, the slot the model runs
    group by group on a mixed step; an FFN in `ffn`, which runs on the whole step at once, as every block's FFN does:
    the expert cache takes one routing per layer and step."""

    def __init__(self, attn_norm: RMSNorm, part: nn.Module, mixes_positions: bool) -> None:
        super().__init__()
        self.attn_norm = attn_norm
        self.attn, self.ffn = (part, None) if mixes_positions else (None, part)

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        x, normed, i8 = self.attn_norm.add_forward_i8(x, delta)
        part = self.attn if self.attn is not None else self.ffn
        return x, part(normed, step, i8)


def ffn(ctx: BuildContext, layer: int) -> nn.Module:
    p, w = f"blk.{layer}", ctx.weights
    if f"{p}.ffn_latent_down.weight" in w:
        raise MoeprepError(f"{w.gguf.path}: latent MoE (ffn_latent_down/up, Nemotron-3-Super) is not supported")
    if f"{p}.ffn_gate_inp.weight" not in w:
        return UngatedFeedForward(ctx.linear(f"{p}.ffn_up"), ctx.linear(f"{p}.ffn_down"))
    shared = UngatedFeedForward(ctx.linear(f"{p}.ffn_up_shexp"), ctx.linear(f"{p}.ffn_down_shexp"))
    return MoE(layer, ctx.router(layer), ctx.experts(layer, RELU_SQR), ctx.hooks, shared=shared)


def build_block(ctx: BuildContext, layer: int) -> nn.Module:
    kind = layer_kind(ctx.weights.gguf, ctx.args, layer)
    if kind == "mamba":
        part: nn.Module = mamba2_mixer(ctx, layer)
    else:
        part = ctx.attention(layer) if kind == "attention" else ffn(ctx, layer)
    return OnePartBlock(ctx.norm(f"blk.{layer}.attn_norm.weight"), part, mixes_positions=kind != "ffn")
