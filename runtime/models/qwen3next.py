"""Qwen3-Next: qwen35moe's layers (gated delta net beside gated full attention, shared-expert MoE) with plain NeoX
RoPE and the delta net's projections grouped by key head. ssm_in gives, per key head, its query and key and then
the v and z of its r = Hv / Hk value heads; ssm_beta_alpha (ssm_ba) per key head its r write-strength logits, then
its r decay logits. Files with attn_qkv and attn_gate in place of ssm_in take those for q, k, v and z. Value head
j of key head h is value head h r + j, and reads key head h (where qwen35moe pairs value head i with i mod Hk)."""

from __future__ import annotations

import torch
from torch import nn

from moerun.layers import Block, Linear
from moerun.models.base import BuildContext
from moerun.models.qwen35moe import (
    delta_net,
    gated_attention,
    read_args,  # noqa: F401  (the same hyperparameters)
    recurrent_layers,
    shared_gated_moe,
)


class GroupedProjections(nn.Module):
    """ssm_in (or attn_qkv + attn_gate) and ssm_ba -> (qkv, z, b, a) in the delta net's flat layout."""

    def __init__(
        self,
        qkvz: Linear | None,
        qkv: Linear | None,
        z: Linear | None,
        ba: Linear,
        n_k_heads: int,
        n_v_heads: int,
        k_dim: int,
        v_dim: int,
    ) -> None:
        super().__init__()
        self.qkvz, self.qkv, self.z, self.ba = qkvz, qkv, z, ba
        self.Hk, self.r, self.Dk, self.Dv = n_k_heads, n_v_heads // n_k_heads, k_dim, v_dim

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        T, Hk, r, Dk, Dv = x.shape[0], self.Hk, self.r, self.Dk, self.Dv
        if self.qkvz is not None:
            q, k, v, z = self.qkvz(x).view(T, Hk, 2 * Dk + 2 * r * Dv).split([Dk, Dk, r * Dv, r * Dv], dim=-1)
            qkv, z = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1), z.reshape(T, -1)
        else:
            qkv, z = self.qkv(x), self.z(x)
        b, a = self.ba(x).view(T, Hk, 2 * r).split([r, r], dim=-1)
        return qkv, z, b.reshape(T, -1), a.reshape(T, -1)


def build_block(ctx: BuildContext, layer: int) -> Block:
    if recurrent_layers(ctx.weights.gguf, ctx.args.n_layers)[layer]:
        g, w, p = ctx.weights.gguf, ctx.weights, f"blk.{layer}"
        n_k, n_v = int(g.get(f"{g.arch}.ssm.group_count")), int(g.get(f"{g.arch}.ssm.time_step_rank"))
        d_state, d_inner = int(g.get(f"{g.arch}.ssm.state_size")), int(g.get(f"{g.arch}.ssm.inner_size"))
        fused = f"{p}.ssm_in.weight" in w
        project = GroupedProjections(
            ctx.linear(f"{p}.ssm_in") if fused else None,
            None if fused else ctx.linear(f"{p}.attn_qkv"),
            None if fused else ctx.linear(f"{p}.attn_gate"),
            ctx.linear(f"{p}.ssm_ba"),
            n_k,
            n_v,
            d_state,
            d_inner // n_v,
        )
        mixer: nn.Module = delta_net(ctx, layer, project, grouped_heads=True)
    else:
        mixer = gated_attention(ctx, layer)
    return ctx.block(layer, mixer, shared_gated_moe(ctx, layer), ffn_norm="post_attention_norm")
