"""GLM-5.3-Flash (`glm5-next`) as a synthetic architecture: its own parts, beside the shared ones of parts.py.

Every trunk block mixes 4 residual streams through hyper-connections (hc_attn_* before attention, hc_ffn_* before
the FFN) and runs one of two attentions, chosen per layer by `attention.head_count_kv`:
  * KDA (0): Kimi delta attention: attn_q/k/v through short causal convolutions, a low-rank decay gate
    (ssm_f_a/ssm_f_b + ssm_dt.bias, ssm_a), a write strength ssm_beta, a low-rank output gate (ssm_g_a/ssm_g_b)
    and a per-head norm ssm_norm, then attn_output;
  * DSA (1): MLA without RoPE (attn_k_b/attn_v_b absorbed into the latent) plus the pooled lightning indexer
    (indexer.*, indexer_compressor_gate/ape), which selects every position below INDEXER_TOP_K + KPOOL - 1 tokens.
The last block is the NextN (multi-token prediction) block: a DSA block without hyper-connections, plus nextn.*;
llama.cpp loads it and its trunk graph skips it. Shapes and keys follow the llama.cpp vendored by llama-cpp-python
0.3.36 (src/models/glm5-next.cpp). Shapes are numpy order (row length last), the reverse of ggml's ne[].

Letters as in parts.py, plus Hd the KDA head size (head_dim), Di = H Hd, Hi/di the indexer's heads and key size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from gguf import Keys

from moeprep.synth.config import SynthConfig
from moeprep.synth.parts import (
    DEEPSEEK_DERIVED,
    EXPERT_FF,
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
    mla_split_kv_b,
    nextn,
    norm,
    tensor_name,
)
from moeprep.synth.weights import NORM_NOISE, Normal

ARCH = "glm5-next"
HC = 4  # residual streams; llama.cpp supports only 4
HC_MIX = (2 + HC) * HC  # per token: 4 pre weights, 4 post weights, a 4x4 stream-mixing matrix
HC_SINKHORN_ITERATIONS = 20
HC_EPS = 1e-6
CONV_KERNEL = 4
DSA_EVERY = 4  # trunk layers 3, 7, 11, ... are DSA, as in GLM-5.3-Flash; the rest KDA
NEXTN = 1  # NextN blocks at the end
INDEXER_TOP_K, KPOOL = 2048, 4  # as in GLM-5.3-Flash: dense attention below 2048 + 3 cached tokens
# The real model clamps at 10; synthetic activations are O(1), so a smaller limit makes both clamps bite.
SWIGLU_CLAMP = 1.5


def n_trunk(c: SynthConfig) -> int:
    return c.n_layer - NEXTN


def is_dsa(c: SynthConfig, il: int) -> bool:
    return il >= n_trunk(c) or il % DSA_EVERY == DSA_EVERY - 1


def blk(il: int, base: str, suffix: str | None = "weight") -> str:
    """Names gguf-py 0.19 has no constant for (hc_*, indexer_compressor_*, the suffix-less ssm_a)."""
    return f"blk.{il}.{base}" + (f".{suffix}" if suffix else "")


def hyper_connections(c: SynthConfig, il: int) -> list[TensorSpec]:
    """fn [HC_MIX, 4 D] reads the RMS-normed streams; base [HC_MIX] and scale [3] (pre, post, mixing) shape it."""
    out = []
    for part in ("attn", "ffn"):
        out += [
            TensorSpec(blk(il, f"hc_{part}_fn"), (HC_MIX, HC * c.n_embd), Normal(1 / math.sqrt(HC * c.n_embd))),
            TensorSpec(blk(il, f"hc_{part}_base"), (HC_MIX,), Normal(0.5)),
            TensorSpec(blk(il, f"hc_{part}_scale"), (3,), Normal(NORM_NOISE, mean=1.0)),
        ]
    return out


def kda(c: SynthConfig, il: int) -> list[TensorSpec]:
    D, H, Hd = c.n_embd, c.n_head, c.head_dim
    Di = H * Hd
    convs = [
        TensorSpec(tensor_name(t, il), (Di, 1, CONV_KERNEL), Normal(1 / math.sqrt(CONV_KERNEL)))
        for t in (T.SSM_CONV1D_Q, T.SSM_CONV1D_K, T.SSM_CONV1D_V)
    ]
    return [
        matrix_in(T.ATTN_Q, il, (Di, D)),
        matrix_in(T.ATTN_K, il, (Di, D)),
        matrix_in(T.ATTN_V, il, (Di, D)),
        *convs,
        matrix_in(T.SSM_F_A, il, (Hd, D)),
        matrix_in(T.SSM_F_B, il, (Di, Hd)),
        bias(T.SSM_DT, il, (Di,)),
        # ssm_a holds -exp(A_log): negative, so the decay exp(softplus(.) * ssm_a) stays below 1
        TensorSpec(blk(il, "ssm_a", None), (H,), Normal(0.3, mean=-1.0)),
        matrix_in(T.SSM_BETA, il, (H, D)),
        matrix_in(T.SSM_G_A, il, (Hd, D)),
        matrix_in(T.SSM_G_B, il, (Di, Hd)),
        norm(T.SSM_NORM, il, Hd),
        matrix_out(c, T.ATTN_OUT, il, (D, Di)),
    ]


def dsa(c: SynthConfig, il: int) -> list[TensorSpec]:
    D, H, Cq, C = c.n_embd, c.n_head, c.q_lora_rank, c.kv_lora_rank
    Hi, di = c.n_head, c.head_dim
    return [
        matrix_in(T.ATTN_Q_A, il, (Cq, D)),
        norm(T.ATTN_Q_A_NORM, il, Cq),
        matrix_in(T.ATTN_Q_B, il, (H * c.qk_nope_dim, Cq)),
        matrix_in(T.ATTN_KV_A_MQA, il, (C, D)),
        norm(T.ATTN_KV_A_NORM, il, C),
        *mla_split_kv_b(c, il),
        matrix_out(c, T.ATTN_OUT, il, (D, H * c.v_head_dim)),
        norm(T.INDEXER_K_NORM, il, di),
        bias(T.INDEXER_K_NORM, il, (di,)),
        matrix_in(T.INDEXER_PROJ, il, (Hi, D)),
        matrix_in(T.INDEXER_ATTN_K, il, (di, D)),
        matrix_in(T.INDEXER_ATTN_Q_B, il, (Hi * di, Cq)),
        matrix_in_named(blk(il, "indexer_compressor_gate"), (di, D)),
        TensorSpec(blk(il, "indexer_compressor_ape"), (KPOOL, di), Normal(0.5)),
    ]


def matrix_in_named(name: str, shape: tuple[int, ...]) -> TensorSpec:
    return TensorSpec(name, shape, Normal(1 / math.sqrt(shape[-1])))


@dataclass(frozen=True)
class Glm5NextMixer:
    """The attention part of a block: hyper-connections (trunk blocks), then KDA or DSA, then NextN's extras."""

    def tensors(self, c: SynthConfig, il: int) -> list[TensorSpec]:
        trunk = il < n_trunk(c)
        return [
            *(hyper_connections(c, il) if trunk else []),
            *(dsa(c, il) if is_dsa(c, il) else kda(c, il)),
            *([] if trunk else nextn(c, il)),
        ]

    def metadata(self, c: SynthConfig) -> dict[str, Any]:
        """head_count_kv per block: 0 for KDA, 1 for DSA (MQA over the latent, whose size key/value_length give)."""
        return {
            Keys.Attention.HEAD_COUNT_KV: [int(is_dsa(c, il)) for il in range(c.n_layer)],
            Keys.Attention.Q_LORA_RANK: c.q_lora_rank,
            Keys.Attention.KV_LORA_RANK: c.kv_lora_rank,
            Keys.Attention.KEY_LENGTH: c.kv_lora_rank,
            Keys.Attention.VALUE_LENGTH: c.kv_lora_rank,
            Keys.Attention.KEY_LENGTH_MLA: c.qk_nope_dim,
            Keys.Attention.VALUE_LENGTH_MLA: c.v_head_dim,
        }


GLM5_NEXT_METADATA = (
    EXPERT_FF
    | SIGMOID_ROUTING
    | {
        Keys.LLM.NEXTN_PREDICT_LAYERS: lambda c: NEXTN,
        Keys.LLM.SWIGLU_CLAMP_EXP: lambda c: SWIGLU_CLAMP,
        Keys.LLM.SWIGLU_CLAMP_SHEXP: lambda c: SWIGLU_CLAMP,
        Keys.SSM.CONV_KERNEL: lambda c: CONV_KERNEL,
        Keys.KDA.HEAD_DIM: lambda c: c.head_dim,
        Keys.Attention.Indexer.HEAD_COUNT: lambda c: c.n_head,
        Keys.Attention.Indexer.KEY_LENGTH: lambda c: c.head_dim,
        Keys.Attention.Indexer.TOP_K: lambda c: INDEXER_TOP_K,
        # keys gguf-py 0.19 has no constant for
        "{arch}.attention.indexer.kpool": lambda c: KPOOL,
        "{arch}.attention.indexer.kpool_select_tail": lambda c: True,
        "{arch}.hyper_connection.count": lambda c: HC,
        "{arch}.hyper_connection.sinkhorn_iterations": lambda c: HC_SINKHORN_ITERATIONS,
        "{arch}.hyper_connection.epsilon": lambda c: HC_EPS,
    }
)

# The sizes of the synthetic KDA + MLA hybrids (glm5-next, kimi-k3): one KV head (KDA's and MLA's latent), a leading
# dense layer, one shared expert, MLA with whole-head latents and no rotated part, absorbed (attn_k_b / attn_v_b).
KDA_MLA_SIZES = DEEPSEEK_DERIVED | {
    "n_head_kv": lambda g: 1,
    "qk_rope_dim": lambda g: 0,  # and so rope_dim
    "mla_split": lambda g: True,
}


GLM5_NEXT = ArchSpec(
    ARCH,
    Glm5NextMixer(),
    Moe(gating=SIGMOID, shared=SharedExpert(lambda c: c.n_ff_exp * c.n_expert_shared)),
    derived={
        "n_layer": lambda g: max(g["n_layer"], DSA_EVERY + 1 + NEXTN),
        **KDA_MLA_SIZES,
    },
    metadata=GLM5_NEXT_METADATA,
    checks=(
        (
            lambda c: n_trunk(c) >= DSA_EVERY,
            f"glm5-next needs at least {DSA_EVERY + NEXTN} layers "
            f"({DSA_EVERY} trunk layers, so that one is DSA, and the NextN block)",
        ),
        (lambda c: c.rope_dim == 0 and c.qk_rope_dim == 0, "glm5-next's MLA has no RoPE: rope_dim must be 0"),
        (lambda c: c.mla_split, "glm5-next's MLA is absorbed: mla_split must be true"),
    ),
)
