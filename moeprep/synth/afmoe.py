"""Arcee's AFMoE (`afmoe`, Trinity Nano/Mini/Large) as a synthetic architecture.

What sets it apart from the shared parts of parts.py:
  * the attention's output is gated per channel by sigmoid(attn_gate x) before attn_output (attn_gate [H d, D]);
  * Q and K have per-head RMSNorm weights (attn_q_norm, attn_k_norm [d]);
  * both sublayers' outputs are RMS-normalised again before the residual add (post_attention_norm, post_ffw_norm);
  * three sliding-window layers, then a full one: llama.cpp's default pattern for afmoe, so the file carries only
    attention.sliding_window; every 4th layer (the full one) has no RoPE, which llama.cpp fixes for the
    architecture, so the model has at least 4 layers for one such layer to appear;
  * a leading dense layer, then sigmoid routing with exp_probs_b, renormalised and scaled (Trinity's 2.826),
    beside one shared expert as wide as a routed one.
Shapes and keys follow the llama.cpp vendored by llama-cpp-python 0.3.36 (src/models/afmoe.cpp).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gguf import MODEL_ARCH, Keys

from moeprep.synth.config import SynthConfig
from moeprep.synth.parts import (
    EXPERT_FF,
    GQA,
    SIGMOID,
    SIGMOID_ROUTING,
    ArchSpec,
    Moe,
    SharedExpert,
    T,
    TensorSpec,
    matrix_in,
    norm,
)

ROUTE_SCALE = 2.826  # Trinity's route_scale


@dataclass(frozen=True)
class AfmoeAttention:
    """GQA with per-head q/k norms, the output gate and the norm after the attention."""

    def tensors(self, c: SynthConfig, il: int) -> list[TensorSpec]:
        return [
            *GQA(qk_norm="head").tensors(c, il),
            matrix_in(T.ATTN_GATE, il, (c.n_head * c.head_dim, c.n_embd)),
            norm(T.ATTN_POST_NORM, il, c.n_embd),
        ]

    def metadata(self, c: SynthConfig) -> dict[str, Any]:
        return GQA().metadata(c) | {Keys.Attention.SLIDING_WINDOW: c.sliding_window}


@dataclass(frozen=True)
class AfmoeArchSpec(ArchSpec):
    """The shared layer, with the norm after the FFN."""

    def layer_tensors(self, c: SynthConfig, il: int) -> list[TensorSpec]:
        return [*super().layer_tensors(c, il), norm(T.FFN_POST_NORM, il, c.n_embd)]


AFMOE = AfmoeArchSpec(
    MODEL_ARCH.AFMOE,
    AfmoeAttention(),
    Moe(gating=SIGMOID, shared=SharedExpert(lambda c: c.n_ff_exp * c.n_expert_shared)),
    derived={
        "n_layer": lambda g: max(4, g["n_layer"]),
        "n_dense_lead": lambda g: 1,
        "n_expert_shared": lambda g: 1,
        "expert_weights_scale": lambda g: ROUTE_SCALE,
    },
    metadata=EXPERT_FF | SIGMOID_ROUTING,
    checks=(
        (lambda c: c.rope_dim == c.head_dim, "afmoe rotates whole heads (rope_dim == head_dim)"),
        (lambda c: c.sliding_window > 0, "afmoe needs a sliding window (its sliding layers)"),
    ),
)
