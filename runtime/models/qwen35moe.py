"""Qwen3.5/3.6-MoE: gated delta-net layers (layers/delta_net.py) beside gated full attention
(layers/gated_attention.py) every `full_attention_interval`-th layer (or as `attention.recurrent_layers` lists);
post_attention_norm before every FFN; softmax top-k renormalised, plus a shared expert scaled by
sigmoid(ffn_gate_inp_shexp . x). The delta net's projections are four tensors: attn_qkv (q, k, v rows), attn_gate
(z), ssm_beta and ssm_alpha. Text positions are the same on every axis of its multi-axis RoPE, which then is NeoX
RoPE over rope.dimension_count channels. A trailing NextN block is not run."""

from __future__ import annotations

import math

import torch
from torch import nn

from moeprep.gguf.reader import GGUFModel
from moerun.config import PLAIN_MOE, ModelArgs, required_key
from moerun.layers import Block, Linear
from moerun.layers.delta_net import GatedDeltaNet
from moerun.layers.gated_attention import GatedAttention
from moerun.models.base import BuildContext


def read_args(g: GGUFModel) -> ModelArgs:
    args = ModelArgs.from_gguf(g, fixed={**PLAIN_MOE, "expert_weights_norm": True, "rope_style": "neox"})
    return args.replace(n_shared_experts=1, shared_expert_dim=args.shared_expert_dim or args.ffn_dim)


def recurrent_layers(g: GGUFModel, n_layers: int) -> tuple[bool, ...]:
    """Which layers run the delta net: attention.recurrent_layers where the file lists them, else all but every
    full_attention_interval-th (default 4), as llama.cpp decides."""
    listed = g.get(f"{g.arch}.attention.recurrent_layers")
    if listed is not None:
        return tuple(bool(v) for v in (listed if isinstance(listed, list) else [listed] * n_layers)[:n_layers])
    interval = int(g.get(f"{g.arch}.full_attention_interval", 4))
    return tuple((il + 1) % interval != 0 for il in range(n_layers))


class SplitProjections(nn.Module):
    """The delta net's four input projections as separate tensors -> (qkv, z, b, a)."""

    def __init__(self, qkv: Linear, z: Linear, b: Linear, a: Linear) -> None:
        super().__init__()
        self.qkv, self.z, self.b, self.a = qkv, z, b, a

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.qkv(x), self.z(x), self.b(x), self.a(x)


def delta_net(ctx: BuildContext, layer: int, project: nn.Module, grouped_heads: bool = False) -> GatedDeltaNet:
    """The delta net of `layer` around its `project`ions: sizes from the ssm.* keys, tensors ssm_conv1d, ssm_dt.bias,
    ssm_a, ssm_norm, ssm_out; `grouped_heads` as GatedDeltaNet takes it."""
    g, w, p = ctx.weights.gguf, ctx.weights, f"blk.{layer}"

    def key(name: str) -> int:
        return int(required_key(g, f"{g.arch}.ssm.{name}"))

    d_state, n_k, n_v, d_inner = key("state_size"), key("group_count"), key("time_step_rank"), key("inner_size")
    conv = w.dense(f"{p}.ssm_conv1d.weight", torch.float32)
    return GatedDeltaNet(
        project=project,
        conv=conv.reshape(conv.shape[0], -1),
        dt_bias=w.dense(f"{p}.ssm_dt.bias", torch.float32),
        A=w.dense(f"{p}.ssm_a", torch.float32),
        norm=ctx.norm(f"{p}.ssm_norm.weight"),
        out=ctx.linear(f"{p}.ssm_out"),
        n_k_heads=n_k,
        n_v_heads=n_v,
        k_dim=d_state,
        v_dim=d_inner // n_v,
        eps=ctx.args.norm_eps,
        n_seq=ctx.n_seq,
        grouped_heads=grouped_heads,
    )


def gated_attention(ctx: BuildContext, layer: int) -> GatedAttention:
    a, p = ctx.args, f"blk.{layer}"
    return GatedAttention(
        wq=ctx.linear(f"{p}.attn_q"),
        wk=ctx.linear(f"{p}.attn_k"),
        wv=ctx.linear(f"{p}.attn_v"),
        wo=ctx.linear(f"{p}.attn_output"),
        q_norm=ctx.norm(f"{p}.attn_q_norm.weight"),
        k_norm=ctx.norm(f"{p}.attn_k_norm.weight"),
        rope=ctx.rope(),
        cache=ctx.kv_cache(a.n_kv_heads, a.head_dim, a.head_dim),
        n_heads=a.n_heads,
        n_kv_heads=a.n_kv_heads,
        head_dim=a.head_dim,
        scale=a.attn_scale or 1.0 / math.sqrt(a.head_dim),
        kernels=ctx.backend.kernels,
    )


def shared_gated_moe(ctx: BuildContext, layer: int) -> nn.Module:
    shared_gate = ctx.linear(f"blk.{layer}.ffn_gate_inp_shexp", shape=(1, ctx.args.dim))  # stored as (D,)
    return ctx.routed_experts(layer, shared=True, shared_gate=shared_gate)


def build_block(ctx: BuildContext, layer: int) -> Block:
    if recurrent_layers(ctx.weights.gguf, ctx.args.n_layers)[layer]:
        p = f"blk.{layer}"
        project = SplitProjections(
            *(ctx.linear(f"{p}.{name}") for name in ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha"))
        )
        mixer: nn.Module = delta_net(ctx, layer, project)
    else:
        mixer = gated_attention(ctx, layer)
    return ctx.block(layer, mixer, shared_gated_moe(ctx, layer), ffn_norm="post_attention_norm")
