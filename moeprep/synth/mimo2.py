"""Xiaomi MiMo-V2-Flash (`mimo2`) as a synthetic architecture: hybrid sliding-window and full attention layers.

What sets it apart from the shared GQA of parts.py, all per layer:
  * full-attention and sliding-window layers alternate (`attention.sliding_window_pattern`, a per-layer bool
    array), each kind with its own KV head count (`attention.head_count_kv`, a per-layer array) and RoPE base
    (`rope.freq_base_swa` on the sliding ones);
  * the sliding layers carry learned attention sinks (attn_sinks [H]), the full ones none;
  * keys are wider than values (head_dim > v_head_dim) and only part of each key is rotated;
  * the attention output is scaled by `attention.value_scale`;
  * the leading layer has a dense FFN; the rest route with sigmoid scores plus exp_probs_b, renormalised top-k.
Shapes and keys follow the llama.cpp vendored by llama-cpp-python 0.3.36 (src/models/mimo2.cpp): there the router
is always sigmoid and renormalised and no weights scale is read, so those keys are not written.

Letters as in parts.py, plus Vh the value head size and Hkv(il) the layer's KV heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gguf import MODEL_ARCH, Keys

from moeprep.synth.config import SynthConfig
from moeprep.synth.parts import EXPERT_FF, SIGMOID, ArchSpec, Moe, T, TensorSpec, matrix_in, matrix_out, tensor_name
from moeprep.synth.weights import SINK_STD, Normal

VALUE_SCALE = 0.707  # MiMo-V2-Flash's attention_value_scale
SWA_ROPE_BASE = 5000.0  # a base of its own on the sliding layers, so a mix-up of the two shows


def is_sliding(il: int) -> bool:
    """Odd layers slide: with 3 or 4 layers both kinds appear, and both after the dense leading layer."""
    return il % 2 == 1


def kv_heads(c: SynthConfig, il: int) -> int:
    """Sliding layers have twice the KV heads of full ones, as in MiMo-V2-Flash (8 against 4)."""
    return min(c.n_head, 2 * c.n_head_kv) if is_sliding(il) else c.n_head_kv


@dataclass(frozen=True)
class Mimo2Attention:
    """GQA with per-layer KV heads, keys of head_dim and values of v_head_dim, sinks on the sliding layers."""

    def tensors(self, c: SynthConfig, il: int) -> list[TensorSpec]:
        g = kv_heads(c, il)
        out = [
            matrix_in(T.ATTN_Q, il, (c.n_head * c.head_dim, c.n_embd)),
            matrix_in(T.ATTN_K, il, (g * c.head_dim, c.n_embd)),
            matrix_in(T.ATTN_V, il, (g * c.v_head_dim, c.n_embd)),
            matrix_out(c, T.ATTN_OUT, il, (c.n_embd, c.n_head * c.v_head_dim)),
        ]
        if is_sliding(il):
            out.append(TensorSpec(tensor_name(T.ATTN_SINKS, il), (c.n_head,), Normal(SINK_STD)))
        return out

    def metadata(self, c: SynthConfig) -> dict[str, Any]:
        return {
            Keys.Attention.HEAD_COUNT_KV: [kv_heads(c, il) for il in range(c.n_layer)],
            Keys.Attention.KEY_LENGTH: c.head_dim,
            Keys.Attention.VALUE_LENGTH: c.v_head_dim,
            Keys.Attention.SLIDING_WINDOW: c.sliding_window,
            Keys.Attention.SLIDING_WINDOW_PATTERN: [is_sliding(il) for il in range(c.n_layer)],
            Keys.Rope.FREQ_BASE_SWA: SWA_ROPE_BASE,
            "{arch}.attention.value_scale": VALUE_SCALE,
        }  # a key gguf-py 0.19 has no constant for


MIMO2 = ArchSpec(
    MODEL_ARCH.MIMO2,
    Mimo2Attention(),
    Moe(gating=SIGMOID),
    # Keys 3/2 as wide as values and a third of each key rotated, as MiMo-V2-Flash's 192/128 and 64; the preset's
    # head_dim goes to the values, so the small preset's attn_output rows stay a multiple of 256 (K-quants).
    # The rules run in this order, each reading the preset's head_dim before the last one widens it.
    derived={
        "n_dense_lead": lambda g: 1,
        "v_head_dim": lambda g: g["head_dim"],
        "rope_dim": lambda g: g["head_dim"] // 2,
        "head_dim": lambda g: g["head_dim"] * 3 // 2,
    },
    metadata=EXPERT_FF,
    checks=(
        (lambda c: c.v_head_dim > 0, "v_head_dim must be positive"),
        (lambda c: c.n_head % kv_heads(c, 1) == 0, "n_head must be a multiple of both layers' KV heads"),
        (lambda c: c.n_layer >= 3, "mimo2 needs at least 3 layers (a dense one, then both attention kinds)"),
    ),
)
