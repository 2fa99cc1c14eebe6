"""Llama 4: RoPE (normal, with rope_freqs factors) on all but every 4th layer; the RoPE'd layers attend within
chunks of 8192 positions and RMS-normalise Q and K (no weight) after RoPE, except in the 128-expert model; the
RoPE-less layers attend to every position with the query scaled by log(floor((p + 1) / 8192) + 1) / 10 + 1.
A file whose attention.sliding_window is 0 has no chunks and RoPE everywhere but its last layer.
Every interleave_moe_layer_step-th layer is MoE, the others dense: the router picks its top-1 by logit, and the
expert's input (not its output) is scaled by the sigmoid of that logit; a shared expert adds its output.
These are llama.cpp's rules (src/models/llama4.cpp), fixed by the architecture rather than written in the file."""

from __future__ import annotations

import math

import torch
from torch import nn

from moeprep.errors import MoeprepError
from moeprep.gguf.reader import GGUFModel
from moerun.config import GATING_SIGMOID, ModelArgs
from moerun.kv_cache import KVCache
from moerun.layers import Block, Linear, MoE, Rope
from moerun.layers.ops import Kernels
from moerun.models.base import BuildContext
from moerun.step import Step

CHUNK = 8192  # llama.cpp sets the chunk, and the temperature's floor scale, whatever the file says
NO_ROPE_EVERY = 4
TEMP_SCALE, TEMP_OFFSET = 0.1, 1.0


def read_args(g: GGUFModel) -> ModelArgs:
    fixed = {
        "rope_style": "normal",
        "gating": GATING_SIGMOID,
        "expert_weights_norm": False,
        "n_dense_lead": 0,
        "sliding_window": 0,
    }  # its chunks are not a sliding window: Llama4Attention masks them
    args = ModelArgs.from_gguf(g, fixed=fixed)
    if args.n_experts_used != 1:
        raise MoeprepError(
            f"{g.path}: llama4 with {args.n_experts_used} experts per token is not supported "
            "(Llama 4 routes each token to one expert)"
        )
    return args


class Llama4Attention(nn.Module):
    """GQA with RoPE, Q/K RMS-normalisation and chunks, or (`rope` None) with neither and a temperature."""

    def __init__(
        self,
        *,
        wq: Linear,
        wk: Linear,
        wv: Linear,
        wo: Linear,
        rope: Rope | None,
        qk_norm: bool,
        chunk: int,
        cache: KVCache,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        eps: float,
        kernels: Kernels,
    ) -> None:
        super().__init__()
        self.wq, self.wk, self.wv, self.wo, self.rope, self.cache = wq, wk, wv, wo, rope, cache
        self.qk_norm, self.chunk, self.eps, self.kernels = qk_norm, chunk, eps, kernels
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim

    def forward(self, x: torch.Tensor, step: Step, i8=None) -> torch.Tensor:
        # i8: the norm's int8 rounding of x, unused here: its products round x themselves
        T, H, G, Dh = x.shape[0], self.n_heads, self.n_kv_heads, self.head_dim
        q = self.wq(x).view(T, H, Dh).float()
        k, v = self.wk(x).view(T, G, Dh).float(), self.wv(x).view(T, G, Dh)
        if self.rope is not None:
            q, k = self.rope(q, step.positions), self.rope(k, step.positions)
            if self.qk_norm:
                q, k = (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + self.eps) for t in (q, k))  # no weight
        else:
            temperature = torch.log(torch.floor((step.positions.float() + TEMP_OFFSET) / CHUNK) + 1) * TEMP_SCALE + 1
            q = q * temperature[:, None, None]
        k_all, v_all = self.cache.update(step, k, v)
        allowed = step.mask()
        if self.chunk:  # a query sees its own chunk's positions only
            slots = torch.arange(step.n_slots, device=allowed.device)
            allowed = allowed & (slots[None, :] >= step.positions[:, None] // self.chunk * self.chunk)
        out = self.kernels.attend(q, k_all, v_all, allowed, 1.0 / math.sqrt(Dh), None, step.blocks)
        return self.wo(out.reshape(T, H * Dh))


class WeightedInputMoE(MoE):
    """Top-1 routing whose weight scales the expert's input (FFN(w x)) rather than its output, plus the shared
    expert on the unscaled input."""

    def forward(self, x: torch.Tensor, step: Step, i8=None) -> torch.Tensor:
        # i8: the norm's int8 rounding of x, unused here: its products round x themselves
        ids, weights = self.router(x, step)  # (T, 1)
        if self.hooks.routing:
            self.hooks.fire_routing(self.layer, step.positions, ids, weights)
        return self.experts(x * weights, ids, torch.ones_like(weights), step) + self.shared(x)


def build_block(ctx: BuildContext, layer: int) -> Block:
    a, g, w, p = ctx.args, ctx.weights.gguf, ctx.weights, f"blk.{layer}"
    window = g.get(f"{g.arch}.attention.sliding_window")
    chunked = window is None or int(window) != 0
    no_rope_every = NO_ROPE_EVERY if chunked else a.n_layers
    use_rope = (layer + 1) % no_rope_every != 0
    factors = "rope_freqs.weight" if "rope_freqs.weight" in w else None  # one tensor for every layer
    attn = Llama4Attention(
        wq=ctx.linear(f"{p}.attn_q"),
        wk=ctx.linear(f"{p}.attn_k"),
        wv=ctx.linear(f"{p}.attn_v"),
        wo=ctx.linear(f"{p}.attn_output"),
        rope=ctx.rope(freq_factors=factors) if use_rope else None,
        qk_norm=a.n_experts != 128,
        chunk=CHUNK if chunked and use_rope else 0,
        cache=ctx.kv_cache(a.n_kv_heads, a.head_dim, a.head_dim),
        n_heads=a.n_heads,
        n_kv_heads=a.n_kv_heads,
        head_dim=a.head_dim,
        eps=a.norm_eps,
        kernels=ctx.backend.kernels,
    )
    step_moe = int(g.get(f"{g.arch}.interleave_moe_layer_step", 1))
    if step_moe > 0 and (layer + 1) % step_moe == 0:
        ffn: nn.Module = WeightedInputMoE(
            layer, ctx.router(layer), ctx.experts(layer), ctx.hooks, shared=ctx.feed_forward(layer, "_shexp")
        )
    else:
        ffn = ctx.feed_forward(layer)
    return ctx.block(layer, attn, ffn)
