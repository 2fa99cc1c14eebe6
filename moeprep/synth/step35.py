"""StepFun's Step-3.5 (`step35`, Step-3.5-Flash) as a synthetic architecture.

What sets it apart from the shared parts of parts.py, all per layer:
  * sliding-window and full-attention layers (`attention.sliding_window_pattern`, a per-layer bool array), each
    kind with its own query head count (`attention.head_count`, a per-layer array; Step-3.5-Flash: 96 on the
    sliding layers, 64 on the full ones) and RoPE base (`rope.freq_base_swa` on the sliding ones);
  * the full layers rotate half of each head, the sliding ones all of it, from one rope.dimension_count;
  * Llama-3-style frequency divisors (rope_freqs [d/2], one tensor for the model) on the full layers only, which
    read the first quarter of it, as the converter writes it; with rope_scaling="longrope", LongRoPE's two such
    tensors instead (rope_factors_long, rope_factors_short), which llama.cpp's step35 loader then reads;
  * per-head q/k RMSNorm (attn_q_norm, attn_k_norm [d]) and a per-head output gate: sigmoid(attn_gate x) multiplies
    each head's attention output before attn_output (attn_gate [H(il), D]);
  * a leading dense layer, then sigmoid routing with exp_probs_b, renormalised and scaled, beside a shared expert;
  * clamped SwiGLU on the last trunk layer (`swiglu_clamp_exp` and `swiglu_clamp_shexp`, per-layer arrays, 0 where
    there is none), as Step-3.5-Flash clamps its last layers;
  * the last block is a NextN (multi-token prediction) block: a full decoder layer plus nextn.*, which llama.cpp
    loads but does not run in the main pass.
Shapes and keys follow the llama.cpp vendored by llama-cpp-python 0.3.36 (src/models/step35.cpp) and its
converter (conversion/step3.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import MODEL_ARCH, Keys

from moeprep.synth.config import SynthConfig
from moeprep.synth.parts import (
    EXPERT_FF,
    SIGMOID,
    SIGMOID_ROUTING,
    ArchSpec,
    Moe,
    SharedExpert,
    T,
    TensorSpec,
    matrix_in,
    matrix_out,
    nextn,
    norm,
    tensor_name,
)

NEXTN = 1  # NextN blocks at the end
SWA_ROPE_BASE = 5000.0  # a base of its own on the sliding layers, so a mix-up of the two shows
ROUTE_SCALE = 3.0  # Step-3.5-Flash's moe_router_scaling_factor
# The real model clamps at 7; synthetic activations are O(1), so a smaller limit makes both clamps bite.
SWIGLU_CLAMP = 1.5
ROPE_DIVISOR_RANGE = (1.0, 8.0)  # Llama-3 factors run from 1 (high frequencies) to the scaling factor
SHORT_DIVISOR_RANGE = (1.0, 2.0)  # LongRoPE's short factors stay near 1, its long ones span ROPE_DIVISOR_RANGE


def n_trunk(c: SynthConfig) -> int:
    return c.n_layer - NEXTN


def is_sliding(c: SynthConfig, il: int) -> bool:
    """Odd trunk layers slide, so both kinds appear after the dense leading layer; the NextN block attends fully."""
    return il < n_trunk(c) and il % 2 == 1


def heads(c: SynthConfig, il: int) -> int:
    """Sliding layers have twice the full layers' query heads (Step-3.5-Flash: 96 against 64; twice here keeps the
    small preset's attn_output rows a multiple of 256 for the K-quants)."""
    return 2 * c.n_head if is_sliding(c, il) else c.n_head


@dataclass(frozen=True)
class RopeDivisors:
    """rope_freqs [d/2]: divisors drawn from ROPE_DIVISOR_RANGE for the d/4 pairs the full layers rotate, 1 for the
    rest (the converter's padding)."""

    std: float = 0.0
    span: tuple[float, float] = ROPE_DIVISOR_RANGE

    def sample(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        values = np.ones(shape, dtype=np.float32)
        used = shape[0] // 2
        values[:used] = rng.uniform(*self.span, used).astype(np.float32)
        return values


@dataclass(frozen=True)
class Step35Attention:
    """GQA with per-layer query heads, per-head q/k norms and the per-head output gate; NextN's extras on the
    last block."""

    def tensors(self, c: SynthConfig, il: int) -> list[TensorSpec]:
        h, kv, D = heads(c, il) * c.head_dim, c.n_head_kv * c.head_dim, c.n_embd
        out = [
            matrix_in(T.ATTN_Q, il, (h, D)),
            matrix_in(T.ATTN_K, il, (kv, D)),
            matrix_in(T.ATTN_V, il, (kv, D)),
            norm(T.ATTN_Q_NORM, il, c.head_dim),
            norm(T.ATTN_K_NORM, il, c.head_dim),
            matrix_out(c, T.ATTN_OUT, il, (D, h)),
            matrix_in(T.ATTN_GATE, il, (heads(c, il), D)),
        ]
        if il >= n_trunk(c):
            out += nextn(c, il)
        return out

    def metadata(self, c: SynthConfig) -> dict[str, Any]:
        layers = range(c.n_layer)
        clamps = [SWIGLU_CLAMP if il == n_trunk(c) - 1 else 0.0 for il in layers]
        return {
            Keys.Attention.HEAD_COUNT: [heads(c, il) for il in layers],
            Keys.Attention.HEAD_COUNT_KV: [c.n_head_kv for _ in layers],
            Keys.Attention.KEY_LENGTH: c.head_dim,
            Keys.Attention.VALUE_LENGTH: c.head_dim,
            Keys.Attention.SLIDING_WINDOW: c.sliding_window,
            Keys.Attention.SLIDING_WINDOW_PATTERN: [is_sliding(c, il) for il in layers],
            Keys.Rope.FREQ_BASE_SWA: SWA_ROPE_BASE,
            Keys.LLM.SWIGLU_CLAMP_EXP: clamps,
            Keys.LLM.SWIGLU_CLAMP_SHEXP: clamps,
            Keys.LLM.NEXTN_PREDICT_LAYERS: NEXTN,
        }


@dataclass(frozen=True)
class Step35ArchSpec(ArchSpec):
    """The shared layer, with the model's one rope_freqs tensor (LongRoPE: its long and short divisors)."""

    def global_tensors(self, c: SynthConfig) -> list[TensorSpec]:
        shape = (c.head_dim // 2,)
        if c.rope_scaling == "longrope":
            return [
                TensorSpec(tensor_name(T.ROPE_FACTORS_LONG), shape, RopeDivisors()),
                TensorSpec(tensor_name(T.ROPE_FACTORS_SHORT), shape, RopeDivisors(span=SHORT_DIVISOR_RANGE)),
            ]
        return [TensorSpec(tensor_name(T.ROPE_FREQS), shape, RopeDivisors())]


STEP35 = Step35ArchSpec(
    MODEL_ARCH.STEP35,
    Step35Attention(),
    Moe(gating=SIGMOID, shared=SharedExpert(lambda c: c.n_ff_exp * c.n_expert_shared)),
    derived={
        "n_layer": lambda g: max(g["n_layer"], 3 + NEXTN),
        "n_dense_lead": lambda g: 1,
        "n_expert_shared": lambda g: 1,
        "expert_weights_scale": lambda g: ROUTE_SCALE,
    },
    metadata=EXPERT_FF
    | SIGMOID_ROUTING
    | {Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH: lambda c: c.n_ff_exp * c.n_expert_shared},
    checks=(
        (lambda c: c.rope_dim == c.head_dim, "step35 rotates whole heads on its sliding layers (rope_dim == head_dim)"),
        (
            lambda c: c.head_dim % 4 == 0,
            "step35's full layers rotate half of each head: head_dim must be a multiple of 4",
        ),
        (lambda c: c.sliding_window > 0, "step35 needs a sliding window (its sliding layers)"),
        (
            lambda c: n_trunk(c) >= 3,
            f"step35 needs at least {3 + NEXTN} layers (a dense one, then both attention kinds, and the NextN block)",
        ),
    ),
)
