"""DeepSeek-V4 (`deepseek4`, DeepSeek-V4-Flash) as a synthetic architecture.

What sets it apart from the shared parts of parts.py:
  * 4-stream hyper-connections around every block (hc_attn_* / hc_ffn_*, glm5-next's), and a head mix
    (output_hc_fn [4, 4 D], output_hc_base [4], output_hc_scale [1]) that sums the streams before the final norm;
  * one attention kind for every layer: a q LoRA (attn_q_a, attn_q_a_norm, attn_q_b [H d, Cq]), one shared KV head
    (attn_kv [d, D] and its norm attn_kv_a_norm [d]; the key is the value), attention sinks, a sliding window over
    the raw keys, and a grouped low-rank output: attn_output_a [G R, H d / G] per group of heads, then
    attn_output_b [D, G R];
  * compressed keys per layer (`attention.compress_ratios`): 0 none, 4 (overlapping blocks of 4 tokens, with a
    lightning indexer that picks top_k of them: indexer.proj, indexer.attn_q_b and its own compressor) or 128;
    a compressor is attn_compressor_kv / _gate [c d, D], _ape [ratio, c d] and _norm [d], c = 2 for ratio 4;
  * sqrt-softplus expert scores with exp_probs_b, except in the first `hash_layer_count` layers, whose experts come
    from the token id (ffn_gate_tid2eid [V, K], int32); clamped SwiGLU (swiglu_clamp_exp) and a shared expert;
  * a NextN (multi-token prediction) block at the end, which llama.cpp loads and its trunk graph skips.
llama.cpp accepts compression ratios 0, 4 and 128 only (src/models/deepseek4.cpp), so a test prompt longer than 128
tokens reaches both kinds of compression. Shapes and keys follow the llama.cpp vendored by llama-cpp-python 0.3.36.
Shapes are numpy order.

Letters as in parts.py, plus G output groups, R the output LoRA rank, Hi/di the indexer's heads and key size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import Keys

from moeprep.synth.config import SynthConfig
from moeprep.synth.glm5_next import HC, HC_EPS, HC_SINKHORN_ITERATIONS, blk, hyper_connections
from moeprep.synth.parts import (
    EXPERT_FF,
    ArchSpec,
    Gating,
    Moe,
    SharedExpert,
    T,
    TensorSpec,
    matrix_in,
    nextn,
    norm,
    tensor_name,
)
from moeprep.synth.weights import NORM_NOISE, SINK_STD, Normal, skew_offsets

ARCH = "deepseek4"
NEXTN = 1  # NextN blocks at the end
HASH_LAYERS = 1  # the first layer routes by token id (DeepSeek-V4-Flash: 3)
CSA_RATIO, HCA_RATIO = 4, 128  # the two compressions llama.cpp accepts
OUTPUT_GROUPS = 2
INDEXER_HEAD = 64  # llama.cpp rotates the indexer's keys by a Hadamard matrix of 64 or more
INDEXER_TOP_K = 2048  # more compressed blocks than a test has: every one is selected (V4-Flash: 512)
COMPRESS_ROPE_BASE = 40000.0  # a base of its own on compressed layers, so a mix-up with rope.freq_base shows
ROUTE_SCALE = 1.5  # DeepSeek-V4-Flash's routed_scaling_factor
# The real model clamps at 10; synthetic activations are O(1), so a smaller limit makes both clamps bite.
SWIGLU_CLAMP = 1.5
SQRT_SOFTPLUS = 4  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SQRT_SOFTPLUS (gguf-py 0.19 has no constant)
# sqrt(softplus(x)) flattens below 0 and grows slowly above: a wide logit spread keeps the scores apart
SQRT_SOFTPLUS_GATING = Gating(router_logit_std=3.0, skew_in_probs_bias=True, skew_scale=1.0, func=None)


def n_trunk(c: SynthConfig) -> int:
    return c.n_layer - NEXTN


def compress_ratio(c: SynthConfig, il: int) -> int:
    """Layer 0 and the NextN block keep raw keys only; the others alternate 4 and 128."""
    if il == 0 or il >= n_trunk(c):
        return 0
    return CSA_RATIO if il % 2 == 1 else HCA_RATIO


def o_lora_rank(c: SynthConfig) -> int:
    """R: half of D, so attn_output_b's rows (G R = D) fit the K-quants' blocks wherever D does."""
    return c.n_embd // OUTPUT_GROUPS


@dataclass(frozen=True)
class HashTable:
    """ffn_gate_tid2eid [V, K]: each token's K distinct experts, drawn with the skew's Zipf-like weights."""

    n_expert: int
    skew: float
    skew_scale: float
    std: float = 0.0
    exact: bool = True  # integer values, never random blocks

    def sample(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        weights = np.exp(skew_offsets(rng, self.n_expert, self.skew, self.skew_scale).astype(np.float64))
        p = weights / weights.sum()
        rows = [rng.choice(self.n_expert, size=shape[1], replace=False, p=p) for _ in range(shape[0])]
        return np.asarray(rows, dtype=np.int32)


def compressor(c: SynthConfig, il: int, prefix: str, width: int, ratio: int) -> list[TensorSpec]:
    """A KV compressor of `width` channels: kv and gate [c width, D], ape [ratio, c width], norm [width]."""
    wide = (2 if ratio == CSA_RATIO else 1) * width
    return [
        matrix_in_named(blk(il, f"{prefix}_compressor_kv"), (wide, c.n_embd)),
        matrix_in_named(blk(il, f"{prefix}_compressor_gate"), (wide, c.n_embd)),
        TensorSpec(blk(il, f"{prefix}_compressor_ape"), (ratio, wide), Normal(0.5)),
        TensorSpec(blk(il, f"{prefix}_compressor_norm"), (width,), Normal(NORM_NOISE, mean=1.0)),
    ]


def matrix_in_named(name: str, shape: tuple[int, ...]) -> TensorSpec:
    return TensorSpec(name, shape, Normal(1 / math.sqrt(shape[-1])))


@dataclass(frozen=True)
class Deepseek4Attention:
    """Hyper-connections, the attention with its compressors and indexer, and NextN's extras on the last block."""

    def tensors(self, c: SynthConfig, il: int) -> list[TensorSpec]:
        D, H, d, Cq = c.n_embd, c.n_head, c.head_dim, c.q_lora_rank
        R = o_lora_rank(c)
        out = [
            *hyper_connections(c, il),
            matrix_in(T.ATTN_Q_A, il, (Cq, D)),
            norm(T.ATTN_Q_A_NORM, il, Cq),
            matrix_in(T.ATTN_Q_B, il, (H * d, Cq)),
            matrix_in_named(blk(il, "attn_kv"), (d, D)),
            norm(T.ATTN_KV_A_NORM, il, d),
            TensorSpec(tensor_name(T.ATTN_SINKS, il), (H,), Normal(SINK_STD)),
            matrix_in_named(blk(il, "attn_output_a"), (OUTPUT_GROUPS * R, H * d // OUTPUT_GROUPS)),
            TensorSpec(blk(il, "attn_output_b"), (D, OUTPUT_GROUPS * R), Normal(1 / math.sqrt(R * 2 * c.n_layer)), -2),
        ]
        ratio = compress_ratio(c, il)
        if ratio:
            out += compressor(c, il, "attn", d, ratio)
        if ratio == CSA_RATIO:
            out += [
                matrix_in(T.INDEXER_PROJ, il, (c.n_head, D)),
                matrix_in(T.INDEXER_ATTN_Q_B, il, (c.n_head * INDEXER_HEAD, Cq)),
                *compressor(c, il, "indexer", INDEXER_HEAD, ratio),
            ]
        if il >= n_trunk(c):
            out += nextn(c, il)
        return out

    def metadata(self, c: SynthConfig) -> dict[str, Any]:
        layers = range(c.n_layer)
        return {
            Keys.Attention.HEAD_COUNT_KV: 1,
            Keys.Attention.KEY_LENGTH: c.head_dim,
            Keys.Attention.VALUE_LENGTH: c.head_dim,
            Keys.Attention.Q_LORA_RANK: c.q_lora_rank,
            Keys.Attention.SLIDING_WINDOW: c.sliding_window,
            Keys.Attention.Indexer.HEAD_COUNT: c.n_head,
            Keys.Attention.Indexer.KEY_LENGTH: INDEXER_HEAD,
            Keys.Attention.Indexer.TOP_K: INDEXER_TOP_K,
            Keys.LLM.SWIGLU_CLAMP_EXP: [SWIGLU_CLAMP for _ in layers],
            Keys.LLM.SWIGLU_CLAMP_SHEXP: [SWIGLU_CLAMP for _ in layers],
            Keys.LLM.NEXTN_PREDICT_LAYERS: NEXTN,
            # keys gguf-py 0.19 has no constant for
            "{arch}.attention.output_group_count": OUTPUT_GROUPS,
            "{arch}.attention.output_lora_rank": o_lora_rank(c),
            "{arch}.attention.compress_rope_freq_base": COMPRESS_ROPE_BASE,
            "{arch}.attention.compress_ratios": [compress_ratio(c, il) for il in layers],
            "{arch}.hyper_connection.count": HC,
            "{arch}.hyper_connection.sinkhorn_iterations": HC_SINKHORN_ITERATIONS,
            "{arch}.hyper_connection.epsilon": HC_EPS,
            "{arch}.hash_layer_count": HASH_LAYERS,
        }


@dataclass(frozen=True)
class HashRoutedMoe(Moe):
    """Moe's tensors, with the hash layers' token -> experts table in place of their selection bias."""

    def tensors(self, c: SynthConfig, il: int) -> list[TensorSpec]:
        if il >= HASH_LAYERS:
            return super().tensors(c, il)
        bias = tensor_name(T.FFN_EXP_PROBS_B, il, "bias")
        g = self.gating
        table = HashTable(c.n_expert, c.skew, g.skew_scale)
        kept = [t for t in super().tensors(c, il) if t.name != bias]
        return [*kept, TensorSpec(blk(il, "ffn_gate_tid2eid"), (c.n_vocab, c.n_expert_used), table)]


@dataclass(frozen=True)
class Deepseek4ArchSpec(ArchSpec):
    """The shared layer, with the head's hyper-connection mix."""

    def global_tensors(self, c: SynthConfig) -> list[TensorSpec]:
        return [
            TensorSpec("output_hc_fn.weight", (HC, HC * c.n_embd), Normal(1 / math.sqrt(HC * c.n_embd))),
            TensorSpec("output_hc_base.weight", (HC,), Normal(0.5)),
            TensorSpec("output_hc_scale.weight", (1,), Normal(NORM_NOISE, mean=1.0)),
        ]


DEEPSEEK4 = Deepseek4ArchSpec(
    ARCH,
    Deepseek4Attention(),
    HashRoutedMoe(gating=SQRT_SOFTPLUS_GATING, shared=SharedExpert(lambda c: c.n_ff_exp * c.n_expert_shared)),
    derived={
        "n_layer": lambda g: max(g["n_layer"], 3 + NEXTN),
        "n_head_kv": lambda g: 1,
        "n_expert_shared": lambda g: 1,
        "expert_weights_scale": lambda g: ROUTE_SCALE,
        "q_lora_rank": lambda g: g["n_embd"],
        "rope_dim": lambda g: g["head_dim"] // 2,
    },
    metadata=EXPERT_FF
    | {
        Keys.LLM.EXPERT_SHARED_COUNT: lambda c: c.n_expert_shared,
        Keys.LLM.EXPERT_WEIGHTS_SCALE: lambda c: c.expert_weights_scale,
        Keys.LLM.EXPERT_WEIGHTS_NORM: lambda c: True,
        Keys.LLM.EXPERT_GATING_FUNC: lambda c: SQRT_SOFTPLUS,
    },
    checks=(
        (lambda c: c.n_head % OUTPUT_GROUPS == 0, f"deepseek4 groups its heads in {OUTPUT_GROUPS}: n_head must split"),
        (lambda c: c.n_embd % OUTPUT_GROUPS == 0, f"deepseek4's output LoRA is n_embd / {OUTPUT_GROUPS} wide"),
        (lambda c: c.rope_dim <= INDEXER_HEAD, f"the indexer rotates rope_dim of its {INDEXER_HEAD} channels"),
        (lambda c: c.sliding_window > 0, "deepseek4 needs a sliding window over its raw keys"),
        (
            lambda c: n_trunk(c) >= 3,
            f"deepseek4 needs at least {3 + NEXTN} layers (raw keys, both compressions, and the NextN block)",
        ),
    ),
)
