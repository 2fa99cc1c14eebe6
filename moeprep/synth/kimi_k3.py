"""Moonshot's Kimi-K3 (`kimi-k3`) as a synthetic architecture: Kimi-Linear's hybrid of KDA and MLA layers, plus

  * cross-layer residual attention: every block scores the banked block inputs (one bank every
    `attn_res.block_size` blocks) and the current stream with attn_res_score / ffn_res_score [D], and the final norm
    reads the mix that output_res_score [D] scores;
  * a latent MoE: the routed experts run at `expert_latent_length` L < D, between ffn_routed_down [L, D] and
    ffn_routed_up [D, L] (with ffn_routed_norm [L] on the way back); the router and the shared expert read the
    full-width input;
  * the situ activation (`activation.situ_beta`, `activation.situ_linear_beta`) in place of SwiGLU everywhere;
  * a sigmoid output gate attn_gate [H Vh, D] on the MLA layers;
  * a full-rank KDA output gate ssm_g [Di, D] (Kimi-Linear factors it as ssm_g_b ssm_g_a), and the decay gate's
    lower bound (`kda.gate_lower_bound`).
KDA layers have attention.head_count_kv 0, MLA layers 1 (MQA over the latent, absorbed layout, no RoPE). Shapes and
keys follow the llama.cpp vendored by llama-cpp-python 0.3.36 (src/models/kimi-k3.cpp). Shapes are numpy order.

Letters as in parts.py, plus Hd the KDA head size (head_dim), Di = H Hd, L the experts' latent width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from gguf import Keys

from moeprep.synth.config import SynthConfig
from moeprep.synth.glm5_next import CONV_KERNEL, KDA_MLA_SIZES, blk, kda
from moeprep.synth.parts import (
    EXPERT_FF,
    MLA,
    SIGMOID,
    SIGMOID_ROUTING,
    ArchSpec,
    Moe,
    SharedExpert,
    T,
    TensorSpec,
    matrix_in,
    tensor_name,
)
from moeprep.synth.weights import NORM_NOISE, Normal

ARCH = "kimi-k3"
MLA_EVERY = 4  # layers 3, 7, ... are MLA, the rest KDA (Kimi-Linear: one MLA layer in four)
RES_BLOCK_SIZE = 2  # a bank every 2 blocks, so a 4-layer model mixes several
GATE_LOWER_BOUND = -5.0  # Kimi-K3's
# Synthetic activations are O(1): betas this small make both tanh saturations bite.
SITU_BETA = 2.0
SITU_LINEAR_BETA = 1.5


def latent(c: SynthConfig) -> int:
    """L: half of D, or all of it where half would break rows of 256 values that K-quants need (the small
    preset)."""
    half = c.n_embd // 2
    return half if half % 256 == 0 or c.n_embd % 256 else c.n_embd


def is_mla(il: int) -> bool:
    return il % MLA_EVERY == MLA_EVERY - 1


def res_score(name: str, c: SynthConfig) -> TensorSpec:
    """A residual-attention score vector [D]: the scores sum(rms_norm(x) w) come out O(1)."""
    return TensorSpec(name, (c.n_embd,), Normal(0.25 / math.sqrt(c.n_embd)))


def kda_full_gate(c: SynthConfig, il: int) -> list[TensorSpec]:
    """glm5-next's KDA layer with the one full-rank output gate ssm_g [Di, D] instead of ssm_g_a/ssm_g_b."""
    low_rank = {tensor_name(T.SSM_G_A, il), tensor_name(T.SSM_G_B, il)}
    kept = [t for t in kda(c, il) if t.name not in low_rank]
    return [*kept, matrix_in_named(blk(il, "ssm_g"), (c.n_head * c.head_dim, c.n_embd))]


def matrix_in_named(name: str, shape: tuple[int, ...]) -> TensorSpec:
    return TensorSpec(name, shape, Normal(1 / math.sqrt(shape[-1])))


@dataclass(frozen=True)
class KimiK3Mixer:
    """The attention part of a block: its two residual-attention scores, then KDA or gated MLA."""

    def tensors(self, c: SynthConfig, il: int) -> list[TensorSpec]:
        scores = [res_score(blk(il, "attn_res_score"), c), res_score(blk(il, "ffn_res_score"), c)]
        if not is_mla(il):
            return [*scores, *kda_full_gate(c, il)]
        gate = matrix_in(T.ATTN_GATE, il, (c.n_head * c.v_head_dim, c.n_embd))
        return [*scores, *MLA().tensors(c, il), gate]

    def metadata(self, c: SynthConfig) -> dict[str, Any]:
        return MLA().metadata(c) | {Keys.Attention.HEAD_COUNT_KV: [int(is_mla(il)) for il in range(c.n_layer)]}


@dataclass(frozen=True)
class LatentMoe(Moe):
    """Moe's router, probability bias and shared expert, with the routed experts at the latent width L."""

    def tensors(self, c: SynthConfig, il: int) -> list[TensorSpec]:
        E, I, D, L = c.n_expert, c.n_ff_exp, c.n_embd, latent(c)
        experts = {tensor_name(t, il) for t in (T.FFN_GATE_EXP, T.FFN_UP_EXP, T.FFN_DOWN_EXP)}
        kept = [t for t in super().tensors(c, il) if t.name not in experts]
        return [
            *kept,
            matrix_in(T.FFN_GATE_EXP, il, (E, I, L)),
            matrix_in(T.FFN_UP_EXP, il, (E, I, L)),
            # the experts' sum is RMS-normed before ffn_routed_up: its scale is the up projection's alone
            TensorSpec(tensor_name(T.FFN_DOWN_EXP, il), (E, L, I), Normal(1 / math.sqrt(I))),
            matrix_in_named(blk(il, "ffn_routed_down"), (L, D)),
            TensorSpec(blk(il, "ffn_routed_up"), (D, L), Normal(1 / math.sqrt(L * 2 * c.n_layer)), residual_axis=-2),
            TensorSpec(blk(il, "ffn_routed_norm"), (L,), Normal(NORM_NOISE, mean=1.0)),
        ]


@dataclass(frozen=True)
class KimiK3ArchSpec(ArchSpec):
    """The shared layer, with the final mix's output_res_score [D]."""

    def global_tensors(self, c: SynthConfig) -> list[TensorSpec]:
        return [res_score("output_res_score.weight", c)]


KIMI_K3 = KimiK3ArchSpec(
    ARCH,
    KimiK3Mixer(),
    LatentMoe(gating=SIGMOID, shared=SharedExpert(lambda c: c.n_ff_exp * c.n_expert_shared)),
    derived={
        "n_layer": lambda g: max(g["n_layer"], MLA_EVERY),
        **KDA_MLA_SIZES,
    },
    metadata=EXPERT_FF
    | SIGMOID_ROUTING
    | {
        Keys.SSM.CONV_KERNEL: lambda c: CONV_KERNEL,
        Keys.KDA.HEAD_DIM: lambda c: c.head_dim,
        # keys gguf-py 0.19 has no constant for
        "{arch}.kda.gate_lower_bound": lambda c: GATE_LOWER_BOUND,
        "{arch}.attn_res.block_size": lambda c: RES_BLOCK_SIZE,
        "{arch}.activation.situ_beta": lambda c: SITU_BETA,
        "{arch}.activation.situ_linear_beta": lambda c: SITU_LINEAR_BETA,
        "{arch}.expert_latent_length": lambda c: latent(c),
    },
    checks=(
        (lambda c: c.n_layer >= MLA_EVERY, f"kimi-k3 needs at least {MLA_EVERY} layers, so that one is MLA"),
        (lambda c: c.rope_dim == 0 and c.qk_rope_dim == 0, "kimi-k3's MLA has no RoPE: rope_dim must be 0"),
        (lambda c: c.mla_split, "kimi-k3's MLA is absorbed: mla_split must be true"),
    ),
)
