"""Hybrid Mamba-2 architectures as synthetic ones: Granite 4.0 hybrid (`granitehybrid`), Mamba-2 layers beside
attention layers, every one with its MoE FFN; and Nemotron-H MoE (`nemotron_h_moe`, Nemotron-3-Nano), whose layers are
each one of Mamba-2, attention or MoE.

A Mamba-2 layer (a layer whose attention.head_count_kv entry is 0) has
  ssm_in [2 d_inner + 2 G N + Hs, D]: z, then x, B, C (the convolution's channels), then dt per head;
  ssm_conv1d [d_inner + 2 G N, K] with its bias, ssm_dt.bias [Hs], ssm_a and ssm_d [Hs, 1] (ssm_a = -exp(A_log) < 0);
  ssm_norm [G, d_inner / G] (the gated output RMS-normed per group) and ssm_out [D, d_inner].
The other layers run plain GQA. Sizes: d_inner = 2 D (llama.cpp's granite loader insists), heads of P = head_dim
channels (Hs = d_inner / head_dim, ssm.time_step_rank), G = 2 groups, N = head_dim (ssm.state_size).

Granite's scales are written too: embedding_scale multiplies the token embeddings, residual_scale each layer's two
outputs before their residual adds, logit_scale divides the logits, attention.scale replaces 1/sqrt(head_dim).
Its router is softmax top-k renormalised, beside a SwiGLU shared expert.
Nemotron-H MoE layers have one norm (attn_norm) and one part each, by a per-layer pattern that the file spells with
two per-layer arrays: Mamba-2 where head_count_kv and feed_forward_length are both 0, attention (GQA without RoPE)
where only feed_forward_length is 0, MoE elsewhere. Its MoE is ungated: ffn_up_exps and ffn_down_exps with relu(.)^2
between them, routed by sigmoid scores with exp_probs_b, renormalised and scaled by expert_weights_scale, beside an
ungated relu^2 shared expert (ffn_up_shexp, ffn_down_shexp).
Shapes and keys follow the llama.cpp vendored by llama-cpp-python 0.3.36 (src/models/granite-hybrid.cpp,
src/models/nemotron-h.cpp, src/models/mamba-base.cpp). Letters as in parts.py, plus K the convolution's kernel size.
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
    SIGMOID_ROUTING,
    ArchSpec,
    Moe,
    SharedExpert,
    T,
    TensorSpec,
    bias,
    matrix_in,
    matrix_out,
    norm,
    tensor_name,
)
from moeprep.synth.weights import NORM_NOISE, Normal

ATTENTION_EVERY = 2  # layers 1, 3, ... attend; Granite-4.0-H has one attention layer in about ten
CONV_KERNEL = 4
N_GROUPS = 2  # Granite 4.0 has 1 and Nemotron-H 8: 2 tells heads of different groups apart
# Granite's multipliers, of the size the released models use them at for the synthetic model's scale
EMBEDDING_SCALE, RESIDUAL_SCALE, LOGIT_SCALE = 2.0, 0.5, 1.5


def is_mamba(il: int) -> bool:
    return (il + 1) % ATTENTION_EVERY != 0


@dataclass(frozen=True)
class Mamba2Sizes:
    inner: int  # d_inner
    heads: int  # Hs
    state: int  # N

    @property
    def conv_channels(self) -> int:
        return self.inner + 2 * N_GROUPS * self.state


def mamba2_sizes(c: SynthConfig) -> Mamba2Sizes:
    inner = 2 * c.n_embd
    return Mamba2Sizes(inner, inner // c.head_dim, c.head_dim)


def mamba2_layer(c: SynthConfig, il: int) -> list[TensorSpec]:
    s = mamba2_sizes(c)
    return [
        matrix_in(T.SSM_IN, il, (2 * s.inner + 2 * N_GROUPS * s.state + s.heads, c.n_embd)),
        TensorSpec(tensor_name(T.SSM_CONV1D, il), (s.conv_channels, CONV_KERNEL), Normal(1 / math.sqrt(CONV_KERNEL))),
        bias(T.SSM_CONV1D, il, (s.conv_channels,)),
        bias(T.SSM_DT, il, (s.heads,)),
        # -exp(A_log): negative, so the decay exp(softplus(dt) * ssm_a) stays below 1
        TensorSpec(f"blk.{il}.ssm_a", (s.heads, 1), Normal(0.3, mean=-1.0)),
        TensorSpec(f"blk.{il}.ssm_d", (s.heads, 1), Normal(NORM_NOISE, mean=1.0)),
        TensorSpec(tensor_name(T.SSM_NORM, il), (N_GROUPS, s.inner // N_GROUPS), Normal(NORM_NOISE, mean=1.0)),
        matrix_out(c, T.SSM_OUT, il, (c.n_embd, s.inner)),
    ]


def mamba2_metadata(c: SynthConfig) -> dict[str, Any]:
    s = mamba2_sizes(c)
    return {
        Keys.SSM.CONV_KERNEL: CONV_KERNEL,
        Keys.SSM.INNER_SIZE: s.inner,
        Keys.SSM.STATE_SIZE: s.state,
        Keys.SSM.TIME_STEP_RANK: s.heads,
        Keys.SSM.GROUP_COUNT: N_GROUPS,
    }


@dataclass(frozen=True)
class GraniteHybridMixer:
    """Mamba-2 or GQA by layer; a Mamba-2 layer says so with 0 KV heads."""

    def tensors(self, c: SynthConfig, il: int) -> list[TensorSpec]:
        return mamba2_layer(c, il) if is_mamba(il) else GQA().tensors(c, il)

    def metadata(self, c: SynthConfig) -> dict[str, Any]:
        return (
            GQA().metadata(c)
            | mamba2_metadata(c)
            | {
                Keys.Attention.HEAD_COUNT_KV: [0 if is_mamba(il) else c.n_head_kv for il in range(c.n_layer)],
                Keys.Attention.SCALE: 1.0 / c.head_dim,  # Granite's attention_multiplier is 1/head_dim
                Keys.LLM.EMBEDDING_SCALE: EMBEDDING_SCALE,
                Keys.LLM.RESIDUAL_SCALE: RESIDUAL_SCALE,
                Keys.LLM.LOGIT_SCALE: LOGIT_SCALE,
            }
        )


GRANITEHYBRID = ArchSpec(
    MODEL_ARCH.GRANITE_HYBRID,
    GraniteHybridMixer(),
    Moe(shared=SharedExpert(lambda c: c.n_ff_shexp)),
    derived={
        "n_layer": lambda g: max(g["n_layer"], 2 * ATTENTION_EVERY),
        "n_ff": lambda g: g["n_ff_exp"],  # granite's experts are feed_forward_length wide
        "n_ff_shexp": lambda g: 2 * g["n_ff_exp"],
    },
    metadata={Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH: lambda c: c.n_ff_shexp},
    checks=(
        (lambda c: c.n_dense_lead == 0, "granitehybrid's synthetic model has no dense layers"),
        (lambda c: c.rope_dim == c.head_dim, "granitehybrid rotates whole heads (rope_dim == head_dim)"),
        (lambda c: (2 * c.n_embd) % (c.head_dim * N_GROUPS) == 0, "d_inner = 2 n_embd must split into heads"),
    ),
)


# Nemotron-H MoE's layer pattern, repeated: Nemotron-3-Nano's 52 layers run mostly Mamba-2 and MoE in turn, with an
# attention layer every few; four layers show every kind, MoE twice.
NEMOTRON_PATTERN = ("mamba", "moe", "attention", "moe")


def nemotron_kind(il: int) -> str:
    return NEMOTRON_PATTERN[il % len(NEMOTRON_PATTERN)]


NEMOTRON_MOE = Moe(gating=SIGMOID, shared=SharedExpert(lambda c: c.n_ff_shexp))
UNGATED = ("ffn_gate_exps", "ffn_gate_shexp")  # what NEMOTRON_MOE's gated template has and Nemotron-H has not


@dataclass(frozen=True)
class NemotronMixer:
    """What each layer's single part is made of, and the per-layer arrays that tell the kinds apart."""

    def tensors(self, c: SynthConfig, il: int) -> list[TensorSpec]:
        kind = nemotron_kind(il)
        if kind == "mamba":
            return mamba2_layer(c, il)
        if kind == "attention":
            return GQA().tensors(c, il)
        return [t for t in NEMOTRON_MOE.tensors(c, il) if not any(f".{base}." in t.name for base in UNGATED)]

    def metadata(self, c: SynthConfig) -> dict[str, Any]:
        kinds = [nemotron_kind(il) for il in range(c.n_layer)]
        return (
            GQA().metadata(c)
            | mamba2_metadata(c)
            | {
                Keys.Attention.HEAD_COUNT_KV: [c.n_head_kv if kind == "attention" else 0 for kind in kinds],
                Keys.LLM.FEED_FORWARD_LENGTH: [c.n_ff if kind == "moe" else 0 for kind in kinds],
                Keys.Attention.LAYERNORM_EPS: c.rms_eps,  # llama.cpp requires it (the MTP head's LayerNorm)
            }
        )


@dataclass(frozen=True)
class SinglePartArchSpec(ArchSpec):
    """An ArchSpec whose layers are attn_norm and one part (the mixer's tensors for that layer), no FFN norm."""

    def layer_tensors(self, c: SynthConfig, il: int) -> list[TensorSpec]:
        return [norm(T.ATTN_NORM, il, c.n_embd), *self.attention.tensors(c, il)]


NEMOTRON_H_MOE = SinglePartArchSpec(
    MODEL_ARCH.NEMOTRON_H_MOE,
    NemotronMixer(),
    NEMOTRON_MOE,
    derived={
        "n_layer": lambda g: max(g["n_layer"], len(NEMOTRON_PATTERN)),
        "n_expert_shared": lambda g: 1,
        "expert_weights_scale": lambda g: 2.5,
        "n_ff_shexp": lambda g: 2 * g["n_ff_exp"],
    },
    metadata=EXPERT_FF | SIGMOID_ROUTING | {Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH: lambda c: c.n_ff_shexp},
    checks=((lambda c: c.n_dense_lead == 0, "nemotron_h_moe's synthetic model has no dense layers"),),
)
