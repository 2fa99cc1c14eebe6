"""Gemma 4, its MoE variant (Gemma-4-26B-A4B): sliding-window and full-attention layers, as llama.cpp's gemma4 graph
(src/models/gemma4.cpp) computes them.

Attention: the two kinds of layer differ in head size (attention.key_length against key_length_swa), KV heads (a
per-layer head_count_kv), RoPE base (rope.freq_base against freq_base_swa) and rotated channels
(rope.dimension_count against dimension_count_swa); the full layers' NeoX RoPE is "proportional", its unrotated
channel pairs given frequency divisors of 1e30 by rope_freqs; the file's context scaling applies to the full layers'
positions only, the sliding ones sharing just the rope op's magnitude factor. Q and K are RMS-normalised per head
with a weight, V without one; a full layer without attn_v uses its keys' projection as values. Scores are not scaled
(scale 1).
Every sublayer output is RMS-normalised before it joins the residual stream (attn_post_norm, post_ffw_norm).

FFN: a dense GELU-gated MLP in every layer; a layer with a router adds routed experts beside it, each branch with its
own pre- and post-norm (pre_ffw_norm_2, post_ffw_norm_1/2). The router reads the attention output's residual stream
RMS-normalised without a weight, scaled by 1/sqrt(D) and by ffn_gate_inp.scale; softmax over all experts, top-k
renormalised; ffn_down_exps.scale (where present) scales each expert's output. A layer's output is multiplied by its
layer_output_scale where the file has one. The embedding is scaled by sqrt(D) and the logits soft-capped at
final_logit_softcapping.

Gemma 4's dense edge models (E2B, E4B) add per-layer token embeddings and share KV caches between layers; those
files are refused, as is a fused attn_qkv, which llama.cpp also reads. Experts fused into ffn_gate_up_exps (as Gemma 4's
converter writes them) run as they are stored (moerun.weights.expert_rows), as the split layout does.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from moeprep.errors import MoeprepError
from moeprep.gguf.reader import GGUFModel
from moerun.config import GATING_SOFTMAX, ModelArgs
from moerun.hooks import Hooks
from moerun.layers import Activation, Attention, FeedForward, MoE, RMSNorm, Router, yarn_attn_factor
from moerun.layers.moe import ExpertCompute
from moerun.layers.norm import unit_rms
from moerun.models.base import BuildContext
from moerun.step import Step

GEGLU = Activation("geglu")


def read_args(g: GGUFModel) -> ModelArgs:
    arch, names = g.arch, {t.name for t in g.tensors}
    if int(g.get(f"{arch}.embedding_length_per_layer_input", 0)):
        raise MoeprepError(f"{g.path}: gemma4 with per-layer token embeddings (Gemma 4 E2B/E4B) is not supported")
    if int(g.get(f"{arch}.attention.shared_kv_layers", 0)):
        raise MoeprepError(f"{g.path}: gemma4 with layers sharing KV caches (Gemma 4 E2B/E4B) is not supported")
    if any(name.endswith(".attn_qkv.weight") for name in names):
        raise MoeprepError(
            f"{g.path}: gemma4 with attn_qkv (projections fused into one tensor) is not supported "
            "(moerun reads attn_q, attn_k, attn_v apart)"
        )
    dim = int(g.get(f"{arch}.embedding_length", 0))
    fixed = {
        "rope_style": "neox",
        "gating": GATING_SOFTMAX,
        "expert_weights_norm": True,
        "expert_weights_scale": 0.0,
        "n_dense_lead": 0,
        "attn_scale": 1.0,  # llama.cpp fixes it: Gemma 4 does not scale its attention scores
        "embed_scale": float(np.float32(math.sqrt(dim))),  # ggml scales by sqrtf(n_embd)
        "logit_softcap": float(g.get(f"{arch}.final_logit_softcapping", 0.0)),
    }
    return ModelArgs.from_gguf(g, fixed=fixed, kv_heads_vary=True)


class Gemma4MoE(MoE):
    """The routed-experts branch: pre_ffw_norm_2 -> experts -> post_ffw_norm_2, routed from the residual stream
    `h` itself (not the branch's normed input): rms_norm(h) / sqrt(D) * ffn_gate_inp.scale through the router."""

    def __init__(
        self,
        layer: int,
        router: Router,
        experts: ExpertCompute,
        hooks: Hooks,
        *,
        pre_norm: RMSNorm,
        post_norm: RMSNorm,
        router_scale: torch.Tensor,
        expert_scale: torch.Tensor | None,
        eps: float,
    ) -> None:
        super().__init__(layer, router, experts, hooks)
        self.pre_norm, self.post_norm, self.eps = pre_norm, post_norm, eps
        self.inv_sqrt_dim = 1.0 / math.sqrt(router_scale.numel())
        self.register_buffer("router_scale", router_scale, persistent=False)
        self.register_buffer("expert_scale", expert_scale, persistent=False)

    def forward(self, h: torch.Tensor, step: Step, i8=None) -> torch.Tensor:
        """h (T, D), the residual stream after attention -> the branch's output (T, D)."""
        x = self.pre_norm(h)
        ids, weights = self.router(unit_rms(h, self.eps) * self.inv_sqrt_dim * self.router_scale, step)  # (T, K)
        if self.hooks.routing:
            self.hooks.fire_routing(self.layer, step.positions, ids, weights)
        if self.expert_scale is not None:  # ffn_down_exps.scale: each chosen expert's output times its scale
            weights = weights * self.expert_scale[ids]
        return self.post_norm(self.experts(x, ids, weights, step))


class Gemma4Block(nn.Module):
    """h = x + attn_post_norm(attn(attn_norm(x))); f = post_ffw_norm(mlp(ffn_norm(h)) [post_ffw_norm_1'd, plus the
    experts' branch, where the layer has a router]); the output (h + f) * layer_output_scale, handed on as the pair
    (h, f) scaled, whose sum the next norm takes (see Block)."""

    def __init__(
        self,
        attn_norm: RMSNorm,
        attn: nn.Module,
        attn_post_norm: RMSNorm,
        ffn_norm: RMSNorm,
        mlp: FeedForward,
        ffn_post_norm: RMSNorm,
        moe: Gemma4MoE | None = None,
        mlp_post_norm: RMSNorm | None = None,
        out_scale: float = 1.0,
    ) -> None:
        super().__init__()
        self.attn_norm, self.attn, self.attn_post_norm = attn_norm, attn, attn_post_norm
        self.ffn_norm, self.mlp, self.ffn_post_norm = ffn_norm, mlp, ffn_post_norm
        self.moe, self.mlp_post_norm, self.out_scale = moe, mlp_post_norm, out_scale

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        x, normed = self.attn_norm.add_forward(x, delta)
        h = x + self.attn_post_norm(self.attn(normed, step))
        f = self.mlp(self.ffn_norm(h))
        if self.moe is not None:
            f = self.mlp_post_norm(f) + self.moe(h, step)
        f = self.ffn_post_norm(f)
        if self.out_scale != 1.0:
            return h * self.out_scale, f * self.out_scale
        return h, f


def layer_geometry(ctx: BuildContext, layer: int) -> tuple[int, int, float]:
    """(head size, rotated channels, RoPE base) of `layer`: the *_swa keys on sliding layers, as llama.cpp reads them
    (a missing key_length_swa is key_length; a missing dimension_count_swa is dimension_count)."""
    a, g = ctx.args, ctx.weights.gguf
    if not a.swa_layers[layer]:
        return a.head_dim, a.rope_dim, a.rope_base
    head_dim = int(g.get(f"{g.arch}.attention.key_length_swa", a.head_dim))
    value_dim = int(g.get(f"{g.arch}.attention.value_length_swa", head_dim))
    if value_dim != head_dim:
        raise MoeprepError(f"{g.path}: gemma4 needs key_length_swa == value_length_swa (got {head_dim}, {value_dim})")
    return head_dim, int(g.get(f"{g.arch}.rope.dimension_count_swa", a.rope_dim)), a.rope_base_swa


def build_block(ctx: BuildContext, layer: int) -> Gemma4Block:
    a, w, p = ctx.args, ctx.weights, f"blk.{layer}"
    if a.head_dim != a.v_head_dim:
        raise MoeprepError(f"{w.gguf.path}: gemma4 needs key_length == value_length (got {a.head_dim}, {a.v_head_dim})")
    sliding = a.swa_layers[layer]
    head_dim, rope_dim, base = layer_geometry(ctx, layer)
    n_kv = a.kv_heads_by_layer[layer]
    wk = ctx.linear(f"{p}.attn_k")
    if sliding:  # llama.cpp's gemma4 gives them no context scaling: the rope op's magnitude factor alone
        rope = ctx.rope(base=base, dim=rope_dim, scaled=False, attn_factor=yarn_attn_factor(a))
    else:  # rope_freqs (required, as llama.cpp's gemma4 loader requires it): the full layers' only
        rope = ctx.rope(base=base, dim=rope_dim, freq_factors="rope_freqs.weight")
    attn = Attention(
        wq=ctx.linear(f"{p}.attn_q"),
        wk=wk,
        wv=ctx.linear(f"{p}.attn_v") if f"{p}.attn_v.weight" in w else wk,  # no attn_v: the keys' projection
        wo=ctx.linear(f"{p}.attn_output"),
        rope=rope,
        cache=ctx.kv_cache(n_kv, head_dim, head_dim),
        n_heads=a.n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        v_head_dim=head_dim,
        scale=a.attn_scale,
        q_norm=ctx.norm(f"{p}.attn_q_norm.weight"),
        k_norm=ctx.norm(f"{p}.attn_k_norm.weight"),
        window=a.sliding_window if sliding else 0,
        v_norm_eps=a.norm_eps,
        kernels=ctx.backend.kernels,
    )
    moe = mlp_post_norm = None
    moe_parts = (
        "ffn_gate_up_exps",
        "ffn_gate_exps",
        "ffn_up_exps",
        "ffn_down_exps",
        "pre_ffw_norm_2",
        "post_ffw_norm_2",
    )
    if ctx.present(f"{p}.ffn_gate_inp.weight", *(f"{p}.{part}.weight" for part in moe_parts)):
        moe = Gemma4MoE(
            layer,
            ctx.router(layer),
            ctx.experts(layer, GEGLU),
            ctx.hooks,
            pre_norm=ctx.norm(f"{p}.pre_ffw_norm_2.weight"),
            post_norm=ctx.norm(f"{p}.post_ffw_norm_2.weight"),
            router_scale=w.dense(f"{p}.ffn_gate_inp.scale", torch.float32),
            expert_scale=w.optional(f"{p}.ffn_down_exps.scale", torch.float32),
            eps=a.norm_eps,
        )
        mlp_post_norm = ctx.norm(f"{p}.post_ffw_norm_1.weight")
    out_scale = w.optional(f"{p}.layer_output_scale.weight", torch.float32)
    return Gemma4Block(
        ctx.norm(f"{p}.attn_norm.weight"),
        attn,
        ctx.norm(f"{p}.post_attention_norm.weight"),
        ctx.norm(f"{p}.ffn_norm.weight"),
        ctx.feed_forward(layer, activation=GEGLU),
        ctx.norm(f"{p}.post_ffw_norm.weight"),
        moe,
        mlp_post_norm,
        1.0 if out_scale is None else float(out_scale.reshape(-1)[0]),
    )
