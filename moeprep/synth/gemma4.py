"""Gemma 4's MoE variant (`gemma4`, as Gemma-4-26B-A4B) as a synthetic architecture.

What sets it apart from the shared parts of parts.py:
  * sliding-window and full-attention layers alternate (`attention.sliding_window_pattern`, a per-layer bool array):
    full layers have heads twice as wide (attention.key_length against key_length_swa, as 512 against 256), half the
    KV heads (a per-layer head_count_kv), their own RoPE base (rope.freq_base against freq_base_swa) and no attn_v
    (their keys' projection serves as values, as the 26B model's attention_k_eq_v);
  * the full layers' RoPE is "proportional": rope.dimension_count covers the whole head, and the global rope_freqs
    [d/2] gives the pairs past the first quarter a frequency divisor of 1e30, so only a quarter of each head turns;
  * Q and K have per-head RMSNorm weights (attn_q_norm, attn_k_norm [d]); every sublayer's output is normed
    (post_attention_norm, post_ffw_norm) before the residual add;
  * every layer has a dense GELU-gated MLP (ffn_gate/up/down of feed_forward_length, with ffn_norm and
    post_ffw_norm_1) beside its routed experts (pre_ffw_norm_2 before, post_ffw_norm_2 after); the router reads the
    residual stream normed without a weight, divided by sqrt(D) and times ffn_gate_inp.scale [D]; each expert's
    output is scaled by ffn_down_exps.scale [E];
  * each layer's output is scaled by layer_output_scale [1]; logits are soft-capped at final_logit_softcapping;
  * the tokenizer is Gemma 4's ("gemma4": SentencePiece-style BPE pieces, BOS always added).
Shapes and keys follow the llama.cpp vendored by llama-cpp-python 0.3.36 (src/models/gemma4.cpp), which requires
embedding_length_per_layer_input (0 here: the per-layer embeddings are the dense E2B/E4B models').

Letters as in parts.py; d here is the full layers' head size, d/2 the sliding layers'.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import MODEL_ARCH, Keys

from moeprep.synth.config import SynthConfig
from moeprep.synth.parts import (
    EXPERT_FF,
    ArchSpec,
    Moe,
    T,
    TensorSpec,
    ffn,
    matrix_in,
    matrix_out,
    norm,
    tensor_name,
)
from moeprep.synth.tokenizer import load_vocab, sentencepiece_style
from moeprep.synth.weights import NORM_NOISE, Normal

SWA_ROPE_BASE = 10_000.0  # Gemma 4's bases: 10k on the sliding layers, 1M on the full ones
FULL_ROPE_BASE = 1_000_000.0
ROTATED_FRACTION = 0.25  # of a full layer's head: Gemma 4's partial_rotary_factor there
UNROTATED_DIVISOR = 1e30  # Gemma 4's converter's rope_freqs entry for a pair that does not turn
LOGIT_SOFTCAP = 10.0  # Gemma 4 writes 30; the synthetic logits are smaller, so a lower cap still bends them
EXPERT_SCALE_STD = 0.2  # ffn_down_exps.scale around 1: far enough from 1 that ignoring it shows


def is_sliding(il: int) -> bool:
    """Even layers slide, odd ones attend to everything: both kinds in the tiny preset's 3 layers."""
    return il % 2 == 0


def head_dim(c: SynthConfig, il: int) -> int:
    return c.head_dim // 2 if is_sliding(il) else c.head_dim


def kv_heads(c: SynthConfig, il: int) -> int:
    """Full layers have half the sliding layers' KV heads (Gemma-4-26B-A4B: 2 against 8)."""
    return c.n_head_kv if is_sliding(il) else max(1, c.n_head_kv // 2)


@dataclass(frozen=True)
class ProportionalRopeFactors:
    """rope_freqs [d/2]: 1 for the first `rotated` pairs, UNROTATED_DIVISOR for the rest."""

    rotated: int
    std: float = 0.0

    def sample(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        values = np.full(shape, UNROTATED_DIVISOR, dtype=np.float32)
        values[: self.rotated] = 1.0
        return values


@dataclass(frozen=True)
class Gemma4Attention:
    """Per-layer head size and KV heads, q/k norms, no attn_v on the full layers, the output normed."""

    def tensors(self, c: SynthConfig, il: int) -> list[TensorSpec]:
        d, g = head_dim(c, il), kv_heads(c, il)
        out = [
            matrix_in(T.ATTN_Q, il, (c.n_head * d, c.n_embd)),
            matrix_in(T.ATTN_K, il, (g * d, c.n_embd)),
        ]
        if is_sliding(il):
            out.append(matrix_in(T.ATTN_V, il, (g * d, c.n_embd)))
        return [
            *out,
            norm(T.ATTN_Q_NORM, il, d),
            norm(T.ATTN_K_NORM, il, d),
            matrix_out(c, T.ATTN_OUT, il, (c.n_embd, c.n_head * d)),
            norm(T.ATTN_POST_NORM, il, c.n_embd),
        ]

    def metadata(self, c: SynthConfig) -> dict[str, Any]:
        layers = range(c.n_layer)
        return {
            Keys.Attention.HEAD_COUNT_KV: [kv_heads(c, il) for il in layers],
            Keys.Attention.KEY_LENGTH: c.head_dim,
            Keys.Attention.VALUE_LENGTH: c.head_dim,
            Keys.Attention.KEY_LENGTH_SWA: c.head_dim // 2,
            Keys.Attention.VALUE_LENGTH_SWA: c.head_dim // 2,
            Keys.Attention.SLIDING_WINDOW: c.sliding_window,
            Keys.Attention.SLIDING_WINDOW_PATTERN: [is_sliding(il) for il in layers],
            Keys.Attention.SHARED_KV_LAYERS: 0,
            Keys.Rope.DIMENSION_COUNT: c.head_dim,  # whole heads; rope_freqs stops all but a quarter
            Keys.Rope.DIMENSION_COUNT_SWA: c.head_dim // 2,
            Keys.Rope.FREQ_BASE: FULL_ROPE_BASE,
            Keys.Rope.FREQ_BASE_SWA: SWA_ROPE_BASE,
        }


@dataclass(frozen=True)
class Gemma4ArchSpec(ArchSpec):
    """Every layer: attention, then the dense MLP beside the routed experts, each branch with its own norms."""

    def global_tensors(self, c: SynthConfig) -> list[TensorSpec]:
        rotated = int(c.head_dim * ROTATED_FRACTION / 2)
        return [TensorSpec(tensor_name(T.ROPE_FREQS), (c.head_dim // 2,), ProportionalRopeFactors(rotated))]

    def layer_tensors(self, c: SynthConfig, il: int) -> list[TensorSpec]:
        D = c.n_embd
        return [
            norm(T.ATTN_NORM, il, D),
            *self.attention.tensors(c, il),
            norm(T.FFN_NORM, il, D),
            *ffn(c, il, T.FFN_GATE, T.FFN_UP, T.FFN_DOWN, c.n_ff),
            norm(T.FFN_POST_NORM_1, il, D),
            norm(T.FFN_PRE_NORM_2, il, D),
            *self.moe.tensors(c, il),
            # the router's input is normed to RMS 1/sqrt(D); a scale of about sqrt(D) gives its logits their spread
            TensorSpec(tensor_name(T.FFN_GATE_INP, il, "scale"), (D,), Normal(NORM_NOISE * math.sqrt(D), math.sqrt(D))),
            TensorSpec(tensor_name(T.FFN_DOWN_EXP, il, "scale"), (c.n_expert,), Normal(EXPERT_SCALE_STD, 1.0)),
            norm(T.FFN_POST_NORM_2, il, D),
            norm(T.FFN_POST_NORM, il, D),
            norm(T.LAYER_OUT_SCALE, il, 1),
        ]


GEMMA4 = Gemma4ArchSpec(
    MODEL_ARCH.GEMMA4,
    Gemma4Attention(),
    Moe(),
    # the preset's head_dim goes to the sliding layers (the small preset's attention rows stay multiples of 256)
    derived={
        "head_dim": lambda g: g["head_dim"] * 2,
        "n_vocab": lambda g: -(-sentencepiece_style(load_vocab()).size // 256) * 256,
    },
    metadata=EXPERT_FF
    | {
        Keys.LLM.FINAL_LOGIT_SOFTCAPPING: lambda c: LOGIT_SOFTCAP,
        Keys.LLM.EMBD_LENGTH_PER_LAYER_INP: lambda c: 0,
    },
    checks=(
        (lambda c: c.head_dim % 8 == 0, "gemma4 needs head_dim (the full layers') a multiple of 8"),
        (lambda c: c.n_head % kv_heads(c, 1) == 0, "n_head must be a multiple of both layers' KV heads"),
        (lambda c: c.n_layer >= 2, "gemma4 needs at least 2 layers (both attention kinds)"),
    ),
    tokenizer="gemma4",
)
