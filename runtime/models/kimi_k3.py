"""Moonshot's Kimi-K3 (kimi-k3): Kimi-Linear's hybrid of KDA (recurrent) and MLA (full) attention layers, with
cross-layer residual attention, a latent MoE, the situ activation and gated MLA.

Layers. attention.head_count_kv 0 marks a KDA layer (glm5-next's KimiDeltaAttention, with K3's one full-rank output
gate ssm_g and its q/k L2 norm at the model's RMS epsilon), any other an MLA layer: deepseek2's absorbed MLAttention
without RoPE, scaled by 1/sqrt(key_length_mla), its output multiplied by sigmoid(attn_gate x) before attn_output where the file has attn_gate.
Leading dense blocks, then sigmoid-routed experts beside a shared expert; every FFN uses situ (layers.ffn.situ)
in place of SwiGLU.

Latent MoE. The router and the shared expert read the normed input x (D); the routed experts run on
ffn_routed_down x (L = expert_latent_length), and their weighted sum, RMS-normed by ffn_routed_norm, goes back to D
through ffn_routed_up (layers.moe.LatentMoE).

Residual attention. Every `attn_res.block_size`-th block banks its raw input (the embedding for block 0). Before
the attention and before the FFN, a block replaces its residual stream h by a mix of the banked inputs and h:
softmax over sum(rms_norm(c) w) of each candidate c (w: attn_res_score or ffn_res_score, rms_norm without a weight),
the candidates summed with those probabilities. A banking block restarts its stream from its attention output
alone (the bank holds what came before); the others add it as usual. After the last block the same mix with
output_res_score feeds the final norm. Between blocks the residual is (T, B + 1, D): the B banked inputs so far,
then the stream; the last block hands on the final mix (T, D).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from moeprep.gguf.reader import GGUFModel
from moerun.config import ModelArgs, required_key
from moerun.layers import Activation, LatentMoE, MoE, RMSNorm
from moerun.models import glm5_next
from moerun.models.base import BuildContext
from moerun.models.deepseek2 import MLAttention
from moerun.models.glm5_next import KimiDeltaAttention
from moerun.step import Step


def read_args(g: GGUFModel) -> ModelArgs:
    # llama.cpp's kimi-k3 loader requires exp_probs_b and output.weight
    return glm5_next.read_args(g).replace(selection_bias_required=True, output_required=True)


@dataclass(frozen=True)
class KimiK3Args:
    """The keys ModelArgs does not hold; KimiDeltaAttention reads the kda_*, conv_kernel, gate and l2 fields."""

    mla_layers: tuple[bool, ...]  # head_count_kv > 0, per block
    kda_head_dim: int
    conv_kernel: int
    gate_lower_bound: float | None
    l2_eps: float
    res_block_size: int  # 0: no residual attention
    situ: Activation
    has_latent: bool
    full_output_gate: bool = True  # KDA's output gate is one full-rank ssm_g

    @classmethod
    def from_gguf(cls, g: GGUFModel, norm_eps: float) -> KimiK3Args:
        key = lambda name: f"{g.arch}.{name}"  # noqa: E731

        def need(name: str) -> object:
            return required_key(g, key(name))

        kv_heads = need("attention.head_count_kv")
        n_blocks = int(need("block_count"))
        per_block = kv_heads if isinstance(kv_heads, list) else [kv_heads] * n_blocks
        lower_bound = g.get(key("kda.gate_lower_bound"))
        return cls(
            mla_layers=tuple(bool(n) for n in per_block),
            kda_head_dim=int(need("kda.head_dim")),
            conv_kernel=int(need("ssm.conv_kernel")),
            gate_lower_bound=None if lower_bound is None or math.isinf(lower_bound) else float(lower_bound),
            l2_eps=norm_eps,
            res_block_size=int(need("attn_res.block_size")),
            situ=Activation("situ", float(need("activation.situ_beta")), float(need("activation.situ_linear_beta"))),
            has_latent=int(g.get(key("expert_latent_length"), 0)) > 0,
        )


def residual_mix(banked: torch.Tensor, h: torch.Tensor, score: torch.Tensor, eps: float) -> torch.Tensor:
    """The softmax-weighted sum of the banked inputs (T, B, D) and the stream h (T, D), each scored by
    sum(rms_norm(c) * score); h itself where nothing is banked yet."""
    if banked.shape[1] == 0:
        return h
    candidates = torch.cat([banked, h[:, None]], dim=1).float()  # (T, B + 1, D)
    normed = candidates * torch.rsqrt(candidates.pow(2).mean(-1, keepdim=True) + eps)
    p = torch.softmax((normed * score).sum(-1), dim=-1)  # (T, B + 1)
    return (banked * p[:, :-1, None]).sum(1) + h * p[:, -1:]


class ResidualAttentionBlock(nn.Module):
    """Pre-norm attention and FFN, each reading the residual mix of its score (see the module's docstring)."""

    def __init__(
        self,
        attn_norm: RMSNorm,
        attn: nn.Module,
        ffn_norm: RMSNorm,
        ffn: nn.Module,
        scores: dict[str, torch.Tensor],
        eps: float,
        bank: bool,
        first: bool,
        last: bool,
    ) -> None:
        super().__init__()
        self.attn_norm, self.attn, self.ffn_norm, self.ffn = attn_norm, attn, ffn_norm, ffn
        for name, score in scores.items():  # attn, ffn, and on the last block output
            self.register_buffer(f"{name}_score", score, persistent=False)
        self.eps, self.bank, self.first, self.last = eps, bank, first, last

    def mix(self, banked: torch.Tensor, h: torch.Tensor, site: str) -> torch.Tensor:
        score = getattr(self, f"{site}_score", None)
        return h if score is None else residual_mix(banked, h, score, self.eps)

    def forward(self, x: torch.Tensor, delta: None, step: Step) -> tuple[torch.Tensor, None]:
        """x (T, D) for the first block, else (T, B + 1, D) -> (T, B' + 1, D), or the final mix (T, D) from the
        last block. The block sums its stream itself: no pending delta (layers.Block's) comes in or goes out."""
        assert delta is None
        if self.first:
            x = x[:, None]
        banked, h = x[:, :-1], x[:, -1]
        attn_in = self.mix(banked, h, "attn")
        if self.bank:
            banked = torch.cat([banked, h[:, None]], dim=1)
        y = self.attn(self.attn_norm(attn_in), step)
        h = y if self.bank else h + y
        _, normed, i8 = self.ffn_norm.add_forward_i8(self.mix(banked, h, "ffn"), None)
        h = h + self.ffn(normed, step, i8)
        if self.last:
            return self.mix(banked, h, "output"), None
        return torch.cat([banked, h[:, None]], dim=1), None


def build_block(ctx: BuildContext, layer: int) -> ResidualAttentionBlock:
    args, w, hooks, p = ctx.args, ctx.weights, ctx.hooks, f"blk.{layer}"
    a = KimiK3Args.from_gguf(w.gguf, args.norm_eps)
    if a.mla_layers[layer]:
        attn: nn.Module = MLAttention(
            ctx,
            layer,
            ctx.rope(),
            ctx.kv_cache(1, args.kv_lora_rank, args.kv_lora_rank),
            gated=f"{p}.attn_gate.weight" in w,  # optional, as in llama.cpp's loader
        )
        attn.scale = 1.0 / math.sqrt(args.head_dim_mla)  # no RoPE, so none of its magnitude corrections
    else:
        attn = KimiDeltaAttention(ctx, a, layer)
    shared = ctx.feed_forward(layer, "_shexp", activation=a.situ) if f"{p}.ffn_gate_shexp.weight" in w else None
    if layer < args.n_dense_lead:
        ffn: nn.Module = ctx.feed_forward(layer, activation=a.situ)
    elif a.has_latent:
        ffn = LatentMoE(
            layer,
            ctx.router(layer),
            ctx.experts(layer, a.situ),
            hooks,
            down=ctx.linear(f"{p}.ffn_routed_down"),
            up=ctx.linear(f"{p}.ffn_routed_up"),
            latent_norm=ctx.norm(f"{p}.ffn_routed_norm.weight") if f"{p}.ffn_routed_norm.weight" in w else None,
            shared=shared,
        )
    else:
        ffn = MoE(layer, ctx.router(layer), ctx.experts(layer, a.situ), hooks, shared=shared)
    last = layer == args.n_layers - 1
    scores = {}
    if a.res_block_size > 0:
        scores = {site: w.dense(f"{p}.{site}_res_score.weight", torch.float32) for site in ("attn", "ffn")}
        if last:
            scores["output"] = w.dense("output_res_score.weight", torch.float32)
    return ResidualAttentionBlock(
        ctx.norm(f"{p}.attn_norm.weight"),
        attn,
        ctx.norm(f"{p}.ffn_norm.weight"),
        ffn,
        scores,
        args.norm_eps,
        bank=a.res_block_size > 0 and layer % a.res_block_size == 0,
        first=layer == 0,
        last=last,
    )
