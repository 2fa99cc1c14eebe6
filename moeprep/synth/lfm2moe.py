"""Liquid AI's LFM2 MoE (`lfm2moe`, LFM2-8B-A1B) as a synthetic architecture.

What sets it apart from the shared parts of parts.py:
  * most layers mix tokens with a gated short convolution instead of attention: shortconv.in_proj [3 D, D] (rows
    b, c, x), shortconv.conv [D, L] (L = shortconv.l_cache taps per channel), shortconv.out_proj [D, D]; such a
    layer has head_count_kv 0 in the per-layer array, which is how llama.cpp tells the kinds apart;
  * the attention layers are GQA with per-head q/k norms, q and output [D, D];
  * a leading dense layer, then sigmoid routing with exp_probs_b, renormalised, unscaled (the loader reads no
    weights scale), the gating function written as llama.cpp requires it;
  * the final norm is stored as token_embd_norm.
Odd layers attend, even ones convolve: with 3 or 4 layers both kinds appear after the dense leading layer.
Shapes and keys follow the llama.cpp vendored by llama-cpp-python 0.3.36 (src/models/lfm2moe.cpp, lfm2.cpp).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from gguf import MODEL_ARCH, Keys

from moeprep.synth.config import SynthConfig
from moeprep.synth.parts import (
    EXPERT_FF,
    GQA,
    SIGMOID,
    ArchSpec,
    Moe,
    T,
    TensorSpec,
    matrix_in,
    matrix_out,
    tensor_name,
)
from moeprep.synth.weights import Normal

CONV_TAPS = 3  # LFM2's conv_L_cache


def is_attention(il: int) -> bool:
    return il % 2 == 1


@dataclass(frozen=True)
class Lfm2Mixer:
    """A short-convolution layer, or GQA with per-head q/k norms."""

    def tensors(self, c: SynthConfig, il: int) -> list[TensorSpec]:
        if is_attention(il):
            return GQA(qk_norm="head").tensors(c, il)
        D = c.n_embd
        return [
            matrix_in(T.SHORTCONV_INPROJ, il, (3 * D, D)),
            TensorSpec(tensor_name(T.SHORTCONV_CONV, il), (D, CONV_TAPS), Normal(1 / math.sqrt(CONV_TAPS))),
            matrix_out(c, T.SHORTCONV_OUTPROJ, il, (D, D)),
        ]

    def metadata(self, c: SynthConfig) -> dict[str, Any]:
        return GQA().metadata(c) | {
            Keys.Attention.HEAD_COUNT_KV: [c.n_head_kv if is_attention(il) else 0 for il in range(c.n_layer)],
            Keys.ShortConv.L_CACHE: CONV_TAPS,
        }


LFM2MOE = ArchSpec(
    MODEL_ARCH.LFM2MOE,
    Lfm2Mixer(),
    Moe(gating=SIGMOID),
    output_norm=T.TOKEN_EMBD_NORM,
    derived={"n_dense_lead": lambda g: 1, "head_dim": lambda g: g["n_embd"] // g["n_head"]},
    metadata=EXPERT_FF
    | {
        Keys.LLM.LEADING_DENSE_BLOCK_COUNT: lambda c: c.n_dense_lead,
        Keys.LLM.EXPERT_GATING_FUNC: lambda c: int(SIGMOID.func),
    },
    checks=(
        (lambda c: c.n_head * c.head_dim == c.n_embd, "q and output are [D, D]: n_head * head_dim must equal n_embd"),
        (lambda c: c.rope_dim == c.head_dim, "lfm2moe rotates whole heads (rope_dim == head_dim)"),
        (lambda c: c.n_layer >= 3, "lfm2moe needs at least 3 layers (a dense one, then both kinds of layer)"),
    ),
)
