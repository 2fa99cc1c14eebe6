"""poolside's Laguna (`laguna`) as a synthetic architecture, in both released layouts.

What sets it apart from the shared parts of parts.py:
  * the attention's output is multiplied by softplus(attn_gate x) before attn_output, x the block's normed input;
  * Q and K have per-head RMSNorm weights (attn_q_norm, attn_k_norm [d]);
  * a leading dense layer, then sigmoid routing with exp_probs_b, renormalised and scaled, beside one shared expert
    of its own width (expert_shared_feed_forward_length);
  * RoPE by layer kind: YaRN over part of each head on the full-attention layers, plain RoPE over rope.
    dimension_count_swa channels with rope.freq_base_swa on the sliding ones.

The two layouts, chosen by sliding_window:
  * above 0, Laguna XS.2's: the first layer of every four attends to everything and the other three slide (the
    default pattern llama.cpp's loader fixes, so no sliding_window_pattern is written); the sliding layers have
    twice the query heads of the full ones (XS.2: 64 against 48; head_count is a per-layer array), and the gate
    gives one value per head (attn_gate [H, D]). The model has at least 5 layers, so a full-attention layer with
    experts appears after three sliding ones;
  * 0, Laguna M.1's: every layer attends to everything with one head count, and the gate gives one value per
    channel (attn_gate [H d, D]).
Shapes and keys follow the llama.cpp vendored by llama-cpp-python 0.3.36 (src/models/laguna.cpp).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gguf import Keys

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
    norm,
)

SWA_PERIOD = 4  # one full-attention layer, then three sliding ones (llama.cpp's default for laguna)
SWA_ROPE_BASE = 10000.0  # XS.2's sliding layers; its full layers use 500000
FULL_ROPE_BASE = 500000.0
ROUTE_SCALE = 2.5


def is_sliding(c: SynthConfig, il: int) -> bool:
    return c.sliding_window > 0 and il % SWA_PERIOD != 0


def heads(c: SynthConfig, il: int) -> int:
    """Query heads of layer il: twice as many on the sliding layers as on the full ones."""
    return 2 * c.n_head if is_sliding(c, il) else c.n_head


@dataclass(frozen=True)
class LagunaAttention:
    """GQA with per-layer query heads, per-head q/k norms and the softplus output gate, one value per head where
    the model slides (XS.2), one per channel where it does not (M.1)."""

    def tensors(self, c: SynthConfig, il: int) -> list[TensorSpec]:
        H, d = heads(c, il), c.head_dim
        gate_rows = H if c.sliding_window > 0 else H * d
        return [
            matrix_in(T.ATTN_Q, il, (H * d, c.n_embd)),
            matrix_in(T.ATTN_K, il, (c.n_head_kv * d, c.n_embd)),
            matrix_in(T.ATTN_V, il, (c.n_head_kv * d, c.n_embd)),
            norm(T.ATTN_Q_NORM, il, d),
            norm(T.ATTN_K_NORM, il, d),
            matrix_in(T.ATTN_GATE, il, (gate_rows, c.n_embd)),
            matrix_out(c, T.ATTN_OUT, il, (c.n_embd, H * d)),
        ]

    def metadata(self, c: SynthConfig) -> dict[str, Any]:
        keys: dict[str, Any] = {
            Keys.Attention.HEAD_COUNT_KV: c.n_head_kv,
            Keys.Attention.KEY_LENGTH: c.head_dim,
            Keys.Attention.VALUE_LENGTH: c.head_dim,
        }
        if c.sliding_window > 0:
            keys |= {
                Keys.Attention.HEAD_COUNT: [heads(c, il) for il in range(c.n_layer)],
                Keys.Attention.SLIDING_WINDOW: c.sliding_window,
                Keys.Rope.FREQ_BASE_SWA: SWA_ROPE_BASE,
                Keys.Rope.DIMENSION_COUNT_SWA: c.head_dim,
            }
        return keys


LAGUNA = ArchSpec(
    "laguna",  # a name gguf-py 0.19 does not know
    LagunaAttention(),
    Moe(gating=SIGMOID, shared=SharedExpert(lambda c: c.n_ff_shexp)),
    derived={
        "n_layer": lambda g: max(SWA_PERIOD + 1, g["n_layer"]) if g["sliding_window"] > 0 else g["n_layer"],
        "n_dense_lead": lambda g: 1,
        "n_expert_shared": lambda g: 1,
        "n_ff_shexp": lambda g: 2 * g["n_ff_exp"],  # a width of its own, so a mix-up with the routed one shows
        "expert_weights_scale": lambda g: ROUTE_SCALE,
        "rope_freq_base": lambda g: FULL_ROPE_BASE,
        "rope_dim": lambda g: g["head_dim"] // 2,  # XS.2's full layers rotate 64 of 128 channels
        "rope_scaling": lambda g: "yarn",  # the released models' (another scaling: rope_scaling=...)
    },
    metadata=EXPERT_FF | SIGMOID_ROUTING | {Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH: lambda c: c.n_ff_shexp},
    checks=(
        (lambda c: c.n_ff_shexp > 0, "laguna's shared expert needs n_ff_shexp > 0"),
        (lambda c: c.n_head % c.n_head_kv == 0, "n_head must be a multiple of n_head_kv"),
    ),
)
