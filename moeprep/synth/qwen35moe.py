"""Qwen3.5/3.6-MoE (`qwen35moe`) and Qwen3-Next (`qwen3next`) as synthetic architectures: gated delta-net layers
beside gated full attention.

Every `full_attention_interval`-th layer (here 2: layers 1, 3, ...) runs full attention whose attn_q gives, per head,
the query and then an output gate of the same size (so attn_q is [2 H d, D]), with per-head q/k RMSNorm and
partial rotary embedding described by `rope.dimension_sections`; the other layers run the gated delta net:
  attn_qkv [2 Dk Hk + Dv Hv, D] through a causal convolution ssm_conv1d [2 Dk Hk + Dv Hv, K], SiLU, q/k L2 norm;
  a decay per value head softplus(ssm_alpha x + ssm_dt.bias) * ssm_a, a write strength sigmoid(ssm_beta x);
  the output RMS-normed per head (ssm_norm [Dv]), gated by silu(attn_gate x) and projected by ssm_out [D, Dv Hv].
Every layer normalises before its FFN with post_attention_norm and routes softmax top-k, renormalised, beside a
shared expert scaled by sigmoid(ffn_gate_inp_shexp . x). Qwen3-Next differs in two places: plain NeoX RoPE (no
sections), and its delta net's projections grouped by key head: ssm_in [Hk (2 Dk + 2 r Dv), D] gives per key head
its q, k, then its r = Hv / Hk value heads' v and z; ssm_ba [Hk 2 r, D] per key head its r b then its r a.
Shapes and keys follow the llama.cpp vendored by llama-cpp-python 0.3.36 (src/models/qwen35moe.cpp, qwen3next.cpp).

Delta-net sizes come from the attention geometry: Dk = Dv = head_dim (ssm.state_size), Hk = n_head_kv key heads
(ssm.group_count), Hv = n_head value heads (ssm.time_step_rank), so a value head shares key head h mod Hk.
Letters as in parts.py, plus K the convolution's kernel size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from gguf import MODEL_ARCH, Keys

from moeprep.synth.config import SynthConfig
from moeprep.synth.parts import (
    EXPERT_FF,
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
from moeprep.synth.weights import Normal

FULL_ATTENTION_INTERVAL = 2  # Qwen3.5 has 4; 2 puts both kinds in the tiny preset's 4 layers twice
CONV_KERNEL = 4


def is_recurrent(il: int) -> bool:
    return (il + 1) % FULL_ATTENTION_INTERVAL != 0


def delta_net_sizes(c: SynthConfig) -> tuple[int, int, int]:
    """(key width Dk Hk, value width Dv Hv, convolution channels 2 Dk Hk + Dv Hv)."""
    key, value = c.head_dim * c.n_head_kv, c.head_dim * c.n_head
    return key, value, 2 * key + value


def rope_sections(c: SynthConfig) -> list[int]:
    """Multi-axis RoPE sections over the rotated pairs; for text every axis is the token position."""
    pairs = c.rope_dim // 2
    first = pairs - 2 * (pairs // 3)
    return [first, pairs // 3, pairs // 3, 0]


def gated_attention(c: SynthConfig, il: int) -> list[TensorSpec]:
    q, kv = c.n_head * c.head_dim, c.n_head_kv * c.head_dim
    return [
        matrix_in(T.ATTN_Q, il, (2 * q, c.n_embd)),
        matrix_in(T.ATTN_K, il, (kv, c.n_embd)),
        matrix_in(T.ATTN_V, il, (kv, c.n_embd)),
        norm(T.ATTN_Q_NORM, il, c.head_dim),
        norm(T.ATTN_K_NORM, il, c.head_dim),
        matrix_out(c, T.ATTN_OUT, il, (c.n_embd, q)),
    ]


def delta_net_state(c: SynthConfig, il: int) -> list[TensorSpec]:
    """What both delta-net layouts share: the convolution, the decay's bias and rate, the output norm and projection."""
    _, value, conv = delta_net_sizes(c)
    return [
        TensorSpec(tensor_name(T.SSM_CONV1D, il), (conv, CONV_KERNEL), Normal(1 / math.sqrt(CONV_KERNEL))),
        bias(T.SSM_DT, il, (c.n_head,)),
        # ssm_a holds -exp(A_log): negative, so the decay exp(softplus(.) * ssm_a) stays below 1
        TensorSpec(f"blk.{il}.ssm_a", (c.n_head,), Normal(0.3, mean=-1.0)),
        norm(T.SSM_NORM, il, c.head_dim),
        matrix_out(c, T.SSM_OUT, il, (c.n_embd, value)),
    ]


def delta_net(c: SynthConfig, il: int) -> list[TensorSpec]:
    _, value, conv = delta_net_sizes(c)
    return [
        matrix_in(T.ATTN_QKV, il, (conv, c.n_embd)),
        matrix_in(T.ATTN_GATE, il, (value, c.n_embd)),
        matrix_in(T.SSM_BETA, il, (c.n_head, c.n_embd)),
        matrix_in(T.SSM_ALPHA, il, (c.n_head, c.n_embd)),
        *delta_net_state(c, il),
    ]


def grouped_delta_net(c: SynthConfig, il: int) -> list[TensorSpec]:
    """Qwen3-Next's layout: the projections grouped by key head (ssm_in, ssm_ba)."""
    key, value, _ = delta_net_sizes(c)
    return [
        matrix_in(T.SSM_IN, il, (2 * key + 2 * value, c.n_embd)),
        matrix_in(T.SSM_BETA_ALPHA, il, (2 * c.n_head, c.n_embd)),
        *delta_net_state(c, il),
    ]


def hybrid_metadata(c: SynthConfig) -> dict[str, Any]:
    return {
        Keys.Attention.HEAD_COUNT_KV: c.n_head_kv,
        Keys.Attention.KEY_LENGTH: c.head_dim,
        Keys.Attention.VALUE_LENGTH: c.head_dim,
        Keys.SSM.CONV_KERNEL: CONV_KERNEL,
        Keys.SSM.STATE_SIZE: c.head_dim,
        Keys.SSM.GROUP_COUNT: c.n_head_kv,
        Keys.SSM.TIME_STEP_RANK: c.n_head,
        Keys.SSM.INNER_SIZE: c.head_dim * c.n_head,
        Keys.LLM.FULL_ATTENTION_INTERVAL: FULL_ATTENTION_INTERVAL,
    }


@dataclass(frozen=True)
class Qwen35Mixer:
    def tensors(self, c: SynthConfig, il: int) -> list[TensorSpec]:
        return delta_net(c, il) if is_recurrent(il) else gated_attention(c, il)

    def metadata(self, c: SynthConfig) -> dict[str, Any]:
        return hybrid_metadata(c) | {Keys.Rope.DIMENSION_SECTIONS: rope_sections(c)}


@dataclass(frozen=True)
class Qwen3NextMixer:
    def tensors(self, c: SynthConfig, il: int) -> list[TensorSpec]:
        return grouped_delta_net(c, il) if is_recurrent(il) else gated_attention(c, il)

    def metadata(self, c: SynthConfig) -> dict[str, Any]:
        return hybrid_metadata(c)


HYBRID_DERIVED = {
    "n_layer": lambda g: max(g["n_layer"], 2 * FULL_ATTENTION_INTERVAL),
    "rope_dim": lambda g: g["head_dim"] // 2,
    "n_ff_shexp": lambda g: 2 * g["n_ff_exp"],
}
HYBRID_METADATA = EXPERT_FF | {Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH: lambda c: c.n_ff_shexp}

QWEN35MOE = ArchSpec(
    MODEL_ARCH.QWEN35MOE,
    Qwen35Mixer(),
    Moe(shared=SharedExpert(lambda c: c.n_ff_shexp, gated=True)),
    ffn_norm=T.ATTN_POST_NORM,
    derived=HYBRID_DERIVED,
    metadata=HYBRID_METADATA,
    checks=((lambda c: c.n_dense_lead == 0, "qwen35moe has no dense layers"),),
)

QWEN3NEXT = ArchSpec(
    MODEL_ARCH.QWEN3NEXT,
    Qwen3NextMixer(),
    Moe(shared=SharedExpert(lambda c: c.n_ff_shexp, gated=True)),
    ffn_norm=T.ATTN_POST_NORM,
    derived=HYBRID_DERIVED,
    metadata=HYBRID_METADATA,
    checks=((lambda c: c.n_dense_lead == 0, "qwen3next's synthetic model has no dense layers"),),
)
