"""Liquid AI's LFM2 MoE (LFM2-8B-A1B, LFM2-24B-A2B), as llama.cpp's lfm2 graph (src/models/lfm2.cpp) computes it
for lfm2moe files.

A layer whose head_count_kv is 0 mixes tokens with LFM2's gated short convolution (layers/short_conv.py, its state
kept per sequence); the others are the shared GQA (BuildContext.attention) with per-head Q/K RMSNorm, which
llama.cpp's loader requires, and NeoX RoPE. FFN: leading dense SwiGLU layers, then the file's gating function
(llama.cpp refuses a file without one) with exp_probs_b, top-k renormalised and never scaled. The final norm is
stored as token_embd_norm."""

from __future__ import annotations

import math

import torch

from moeprep.errors import MoeprepError
from moeprep.gguf.reader import GGUFModel
from moerun.config import ModelArgs, required_key
from moerun.layers import Block
from moerun.layers.short_conv import ShortConv
from moerun.models.base import BuildContext


def read_args(g: GGUFModel) -> ModelArgs:
    arch = g.arch
    for key in ("expert_gating_func", "shortconv.l_cache"):
        required_key(g, f"{arch}.{key}")
    fixed = {
        "rope_style": "neox",
        "expert_weights_norm": True,
        "expert_weights_scale": 0.0,
        "sliding_window": 0,
        "selection_bias_required": True,
        "qk_norms_required": True,
        "final_norm": "token_embd_norm.weight",
    }
    return ModelArgs.from_gguf(g, fixed=fixed, kv_heads_vary=True)


def build_block(ctx: BuildContext, layer: int) -> Block:
    a, w, p = ctx.args, ctx.weights, f"blk.{layer}"
    if a.kv_heads_by_layer[layer] == 0:  # a short-convolution layer
        mixer: torch.nn.Module = ShortConv(
            in_proj=ctx.linear(f"{p}.shortconv.in_proj"),
            conv=w.dense(f"{p}.shortconv.conv.weight", torch.float32),
            out_proj=ctx.linear(f"{p}.shortconv.out_proj"),
            n_seq=ctx.n_seq,
        )
    else:
        if a.head_dim != a.v_head_dim:
            raise MoeprepError(f"{w.gguf.path}: lfm2moe needs key_length == value_length")
        # llama.cpp scales by 1/sqrt(head size) whatever attention.scale says
        mixer = ctx.attention(layer, scale=1.0 / math.sqrt(a.head_dim))
    ffn = ctx.feed_forward(layer) if layer < a.n_dense_lead else ctx.routed_experts(layer)
    return ctx.block(layer, mixer, ffn)
