"""Granite 4.0 hybrid (granitehybrid): Mamba-2 layers (layers/mamba2.py) beside GQA layers, a layer being Mamba-2
where its attention.head_count_kv entry is 0; every layer then its FFN: softmax top-k renormalised over the routed
experts (feed_forward_length wide) plus a SwiGLU shared expert where the file has one, or a dense SwiGLU FFN in a
file without experts. Granite's multipliers: embedding_scale on the embeddings, residual_scale on each layer's two
outputs before their residual adds, logit_scale dividing the logits, attention.scale for the attention. RoPE is
normal (adjacent pairs) unless rope.scaling.finetuned is false, which llama.cpp reads as no RoPE at all (the
released Granite-4.0-H models are NoPE)."""

from __future__ import annotations

import torch
from torch import nn

from moeprep.gguf.reader import GGUFModel
from moerun.config import PLAIN_MOE, ModelArgs, required_key
from moerun.layers import Block
from moerun.layers.mamba2 import Mamba2
from moerun.models.base import BuildContext
from moerun.step import Step


def read_args(g: GGUFModel) -> ModelArgs:
    args = ModelArgs.from_gguf(g, fixed={**PLAIN_MOE, "expert_weights_norm": True, "rope_style": "normal"})

    def scale(key: str) -> float:
        return float(g.get(f"{g.arch}.{key}", 0.0))

    return args.replace(
        expert_dim=args.ffn_dim,  # llama.cpp shapes the routed experts by feed_forward_length
        n_shared_experts=int(args.shared_expert_dim > 0),
        rope_dim=args.rope_dim if g.get(f"{g.arch}.rope.scaling.finetuned", True) else 0,  # 0: no rotation
        embed_scale=scale("embedding_scale") or 1.0,
        residual_scale=scale("residual_scale"),
        logit_scale=scale("logit_scale"),
    )


def mamba2_mixer(ctx: BuildContext, layer: int) -> Mamba2:
    """The Mamba-2 mixer of `layer` from llama.cpp's tensors: ssm_in, ssm_conv1d and its bias, ssm_dt.bias, ssm_a, ssm_d,
    ssm_norm and ssm_out; its sizes from the ssm.* keys."""
    g, w, p = ctx.weights.gguf, ctx.weights, f"blk.{layer}"

    def key(name: str) -> int:
        return int(required_key(g, f"{g.arch}.ssm.{name}"))

    conv = w.dense(f"{p}.ssm_conv1d.weight", torch.float32)
    return Mamba2(
        in_proj=ctx.linear(f"{p}.ssm_in"),
        conv=conv.reshape(conv.shape[0], -1),
        conv_bias=w.dense(f"{p}.ssm_conv1d.bias", torch.float32),
        dt_bias=w.dense(f"{p}.ssm_dt.bias", torch.float32),
        A=w.dense(f"{p}.ssm_a", torch.float32),
        D=w.dense(f"{p}.ssm_d", torch.float32),
        norm=w.dense(f"{p}.ssm_norm.weight", torch.float32),
        out=ctx.linear(f"{p}.ssm_out"),
        n_heads=key("time_step_rank"),
        n_groups=key("group_count"),
        state_size=key("state_size"),
        inner_size=key("inner_size"),
        eps=ctx.args.norm_eps,
        n_seq=ctx.n_seq,
    )


class Scaled(nn.Module):
    """A layer's output times a constant (Granite's residual_scale), before the block adds it to the stream."""

    def __init__(self, inner: nn.Module, scale: float) -> None:
        super().__init__()
        self.inner, self.scale = inner, scale

    def forward(self, x: torch.Tensor, step: Step, i8=None) -> torch.Tensor:
        return self.inner(x, step, i8) * self.scale


def build_block(ctx: BuildContext, layer: int) -> Block:
    a = ctx.args
    mixer: nn.Module = mamba2_mixer(ctx, layer) if a.kv_heads_by_layer[layer] == 0 else ctx.attention(layer)
    ffn: nn.Module = (
        ctx.routed_experts(layer, shared=a.n_shared_experts > 0) if a.n_experts else ctx.feed_forward(layer)
    )
    if a.residual_scale:
        mixer, ffn = Scaled(mixer, a.residual_scale), Scaled(ffn, a.residual_scale)
    return ctx.block(layer, mixer, ffn)
