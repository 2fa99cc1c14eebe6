"""The parts every synthetic architecture is assembled from: tensor specs, attention kinds, the MoE block, the
metadata rules, the ArchSpec that joins them, and the functions that turn an ArchSpec into a file's tensors and keys.

moeprep/synth/archs.py holds the table of architectures built from these parts; an architecture with parts of its
own (glm5_next.py) keeps them in its own module, which imports this one. Tensor shapes and keys follow what the
llama.cpp vendored by llama-cpp-python 0.3.36 (ggml-org/llama.cpp 0c1e570) loads for each architecture: its
src/models/<arch>.cpp `load_arch_hparams` and `load_arch_tensors`. Shapes here are numpy order (row length last),
the reverse of ggml's ne[].

Letters: L layers, D n_embd, V vocabulary, E experts, I expert hidden, F dense FFN hidden, H heads,
Hkv kv heads, d head_dim, C kv_lora_rank, Cq q_lora_rank, N qk_nope, R qk_rope, Vh v_head.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from gguf import MODEL_ARCH, MODEL_ARCH_NAMES, MODEL_TENSOR, TENSOR_NAMES, ExpertGatingFuncType, GGUFValueType, Keys

from moeprep.gguf.writer import KVValue
from moeprep.synth.config import Rule, SynthConfig
from moeprep.synth.weights import BIAS_STD, NORM_NOISE, SINK_STD, Embedding, Init, KvBPart, Normal, ProbsBias, Router

T = MODEL_TENSOR
ROPE_SCALING_FACTOR = 4.0  # rope.scaling.factor of a model written with rope_scaling (linear or YaRN)


@dataclass(frozen=True)
class TensorSpec:
    """One tensor to synthesize. `residual_axis`: it writes into the residual stream, so its entries for the
    bias channel (index BIAS_CHANNEL along that axis) are zero. `seed_name` names the draw it comes from."""

    name: str
    shape: tuple[int, ...]
    init: Init
    residual_axis: int | None = None
    seed_name: str = ""

    @property
    def draw(self) -> str:
        return self.seed_name or self.name


def tensor_name(tensor: MODEL_TENSOR, il: int | None = None, suffix: str = "weight") -> str:
    return f"{TENSOR_NAMES[tensor].format(bid=il)}.{suffix}"


def norm(tensor: MODEL_TENSOR, il: int | None, size: int) -> TensorSpec:
    return TensorSpec(tensor_name(tensor, il), (size,), Normal(NORM_NOISE, mean=1.0))


def bias(tensor: MODEL_TENSOR, il: int, shape: tuple[int, ...], residual: bool = False) -> TensorSpec:
    return TensorSpec(tensor_name(tensor, il, "bias"), shape, Normal(BIAS_STD), -1 if residual else None)


def matrix_in(tensor: MODEL_TENSOR, il: int, shape: tuple[int, ...]) -> TensorSpec:
    """A projection reading a normed activation of shape[-1] values: N(0, 1/fan_in)."""
    return TensorSpec(tensor_name(tensor, il), shape, Normal(1 / math.sqrt(shape[-1])))


def matrix_out(c: SynthConfig, tensor: MODEL_TENSOR, il: int, shape: tuple[int, ...]) -> TensorSpec:
    """A projection writing into the residual stream (rows = D): also scaled by 1/sqrt(2 L)."""
    std = 1 / math.sqrt(shape[-1] * 2 * c.n_layer)
    return TensorSpec(tensor_name(tensor, il), shape, Normal(std), residual_axis=-2)


def ffn(
    c: SynthConfig, il: int, gate: MODEL_TENSOR, up: MODEL_TENSOR, down: MODEL_TENSOR, width: int
) -> list[TensorSpec]:
    """A SwiGLU FFN: gate and up [width, D], down [D, width]."""
    return [
        matrix_in(gate, il, (width, c.n_embd)),
        matrix_in(up, il, (width, c.n_embd)),
        matrix_out(c, down, il, (c.n_embd, width)),
    ]


# --- attention kinds --------------------------------------------------------------------------------------------------

QK_NORM_SIZES: dict[str, Callable[[SynthConfig], tuple[int, int]]] = {
    "head": lambda c: (c.head_dim, c.head_dim),  # one [d] weight shared by every head (Qwen3)
    "full": lambda c: (c.n_head * c.head_dim, c.n_head_kv * c.head_dim),  # over all heads at once (OLMoE)
}


@dataclass(frozen=True)
class GQA:
    """Grouped-query attention: q [H d, D], k and v [Hkv d, D], output [D, H d]; optional extras."""

    qkv_bias: bool = False
    out_bias: bool = False
    qk_norm: str | None = None  # a key of QK_NORM_SIZES
    sinks: bool = False  # gpt-oss: one learned logit per head [H] that joins every softmax
    fused_qkv: bool = False  # bailingmoe2: q, k and v rows in one attn_qkv [H d + 2 Hkv d, D]

    def tensors(self, c: SynthConfig, il: int) -> list[TensorSpec]:
        q, kv = c.n_head * c.head_dim, c.n_head_kv * c.head_dim
        if self.fused_qkv:
            out = [matrix_in(T.ATTN_QKV, il, (q + 2 * kv, c.n_embd))]
        else:
            out = [
                matrix_in(T.ATTN_Q, il, (q, c.n_embd)),
                matrix_in(T.ATTN_K, il, (kv, c.n_embd)),
                matrix_in(T.ATTN_V, il, (kv, c.n_embd)),
            ]
        if self.qkv_bias:
            out += [bias(T.ATTN_Q, il, (q,)), bias(T.ATTN_K, il, (kv,)), bias(T.ATTN_V, il, (kv,))]
        if self.qk_norm:
            q_size, k_size = QK_NORM_SIZES[self.qk_norm](c)
            out += [norm(T.ATTN_Q_NORM, il, q_size), norm(T.ATTN_K_NORM, il, k_size)]
        out.append(matrix_out(c, T.ATTN_OUT, il, (c.n_embd, q)))
        if self.out_bias:
            out.append(bias(T.ATTN_OUT, il, (c.n_embd,), residual=True))
        if self.sinks:
            out.append(TensorSpec(tensor_name(T.ATTN_SINKS, il), (c.n_head,), Normal(SINK_STD)))
        return out

    def metadata(self, c: SynthConfig) -> dict[str, Any]:
        return {
            Keys.Attention.HEAD_COUNT_KV: c.n_head_kv,
            Keys.Attention.KEY_LENGTH: c.head_dim,
            Keys.Attention.VALUE_LENGTH: c.head_dim,
        }


def nextn(c: SynthConfig, il: int) -> list[TensorSpec]:
    """A NextN (multi-token prediction) block's own tensors: eh_proj [D, 2 D] joins the embedding and the hidden state; the optional embed/head copies are left out."""
    return [
        matrix_in(T.NEXTN_EH_PROJ, il, (c.n_embd, 2 * c.n_embd)),
        norm(T.NEXTN_ENORM, il, c.n_embd),
        norm(T.NEXTN_HNORM, il, c.n_embd),
    ]


# The sizes of the synthetic DeepSeek-style MLA models: a leading dense layer, one shared expert, MLA over a latent
# of the model's width with half of each head rotated.
DEEPSEEK_DERIVED = {
    "n_head_kv": lambda g: g["n_head"],
    "n_dense_lead": lambda g: 1,
    "n_expert_shared": lambda g: 1,
    "expert_weights_scale": lambda g: 2.5,
    "q_lora_rank": lambda g: g["n_embd"],
    "kv_lora_rank": lambda g: min(g["n_embd"], 512),
    "qk_nope_dim": lambda g: g["head_dim"],
    "qk_rope_dim": lambda g: g["head_dim"] // 2,
    "v_head_dim": lambda g: g["head_dim"],
    "rope_dim": lambda g: g["qk_rope_dim"],
}


def mla_kv_b(c: SynthConfig, il: int) -> list[TensorSpec]:
    """The classic layout: attn_kv_b [H (N + Vh), C] expands the latent into per-head K (no-rope part) and V."""
    return [matrix_in(T.ATTN_KV_B, il, (c.n_head * (c.qk_nope_dim + c.v_head_dim), c.kv_lora_rank))]


def mla_split_kv_b(c: SynthConfig, il: int) -> list[TensorSpec]:
    """The absorbed layout newer converters write: attn_k_b [H, C, N] and attn_v_b [H, Vh, C], cut from the same
    draw as attn_kv_b so the two layouts of one seed compute the same function."""
    kv_b = mla_kv_b(c, il)[0]
    parts = {
        "k": (T.ATTN_K_B, (c.n_head, c.kv_lora_rank, c.qk_nope_dim)),
        "v": (T.ATTN_V_B, (c.n_head, c.v_head_dim, c.kv_lora_rank)),
    }
    return [
        TensorSpec(
            tensor_name(tensor, il),
            shape,
            KvBPart(kv_b.init.std, c.n_head, c.qk_nope_dim, c.v_head_dim, c.kv_lora_rank, part),
            seed_name=kv_b.name,
        )
        for part, (tensor, shape) in parts.items()
    ]


MLA_LAYOUTS: dict[bool, Callable[[SynthConfig, int], list[TensorSpec]]] = {False: mla_kv_b, True: mla_split_kv_b}


@dataclass(frozen=True)
class MLA:
    """DeepSeek multi-head latent attention with a q LoRA; K/V pass through a C-wide latent plus R rope dims."""

    def tensors(self, c: SynthConfig, il: int) -> list[TensorSpec]:
        k_head = c.qk_nope_dim + c.qk_rope_dim
        return [
            matrix_in(T.ATTN_Q_A, il, (c.q_lora_rank, c.n_embd)),
            norm(T.ATTN_Q_A_NORM, il, c.q_lora_rank),
            matrix_in(T.ATTN_Q_B, il, (c.n_head * k_head, c.q_lora_rank)),
            matrix_in(T.ATTN_KV_A_MQA, il, (c.kv_lora_rank + c.qk_rope_dim, c.n_embd)),
            norm(T.ATTN_KV_A_NORM, il, c.kv_lora_rank),
            *MLA_LAYOUTS[c.mla_split](c, il),
            matrix_out(c, T.ATTN_OUT, il, (c.n_embd, c.n_head * c.v_head_dim)),
        ]

    def metadata(self, c: SynthConfig) -> dict[str, Any]:
        """Classic layout: MHA with head sizes N + R and Vh. Split layout: MQA over the latent (one kv head of
        C + R for K, C for V), the per-head sizes moved to the *_mla keys."""
        k_head = c.qk_nope_dim + c.qk_rope_dim
        keys = {Keys.Attention.Q_LORA_RANK: c.q_lora_rank, Keys.Attention.KV_LORA_RANK: c.kv_lora_rank}
        if c.mla_split:
            return keys | {
                Keys.Attention.HEAD_COUNT_KV: 1,
                Keys.Attention.KEY_LENGTH: c.kv_lora_rank + c.qk_rope_dim,
                Keys.Attention.VALUE_LENGTH: c.kv_lora_rank,
                Keys.Attention.KEY_LENGTH_MLA: k_head,
                Keys.Attention.VALUE_LENGTH_MLA: c.v_head_dim,
            }
        return keys | {
            Keys.Attention.HEAD_COUNT_KV: c.n_head,
            Keys.Attention.KEY_LENGTH: k_head,
            Keys.Attention.VALUE_LENGTH: c.v_head_dim,
        }


# --- MoE block --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Gating:
    """How a router's logits pick experts, and where `skew` goes for it (see moeprep/synth/weights.py)."""

    router_logit_std: float  # spread of router logits: wide enough that near-ties between experts are rare
    skew_in_probs_bias: bool  # True: skew via exp_probs_b; False: via the router's bias-channel column
    skew_scale: float
    func: ExpertGatingFuncType | None  # written as expert_gating_func when the arch reads it


# skew_scale: at skew 1 the quarter of the experts with the lowest ranks take ~80% of the choices (tiny preset).
SOFTMAX = Gating(router_logit_std=3.0, skew_in_probs_bias=False, skew_scale=6.0, func=None)
# Sigmoid scores saturate: a narrower logit spread keeps them distinct; the skew moves scores in (0, 1).
SIGMOID = Gating(router_logit_std=2.0, skew_in_probs_bias=True, skew_scale=1.0, func=ExpertGatingFuncType.SIGMOID)


@dataclass(frozen=True)
class SharedExpert:
    """An always-on expert beside the routed ones. gated: qwen2moe's sigmoid gate vector ffn_gate_inp_shexp [D]."""

    width: Callable[[SynthConfig], int]
    gated: bool = False


@dataclass(frozen=True)
class Moe:
    gating: Gating = SOFTMAX
    shared: SharedExpert | None = None
    biases: bool = False  # gpt-oss: router bias [E] and per-expert biases [E, I] / [E, D]

    def tensors(self, c: SynthConfig, il: int) -> list[TensorSpec]:
        E, I, D = c.n_expert, c.n_ff_exp, c.n_embd
        g = self.gating
        router_scale = 0.0 if g.skew_in_probs_bias else g.skew_scale
        out = [
            TensorSpec(
                tensor_name(T.FFN_GATE_INP, il), (E, D), Router(g.router_logit_std / math.sqrt(D), c.skew, router_scale)
            )
        ]
        if g.skew_in_probs_bias:
            out.append(TensorSpec(tensor_name(T.FFN_EXP_PROBS_B, il, "bias"), (E,), ProbsBias(c.skew, g.skew_scale)))
        out += [
            matrix_in(T.FFN_GATE_EXP, il, (E, I, D)),
            matrix_in(T.FFN_UP_EXP, il, (E, I, D)),
            matrix_out(c, T.FFN_DOWN_EXP, il, (E, D, I)),
        ]
        if self.biases:
            out += [
                bias(T.FFN_GATE_INP, il, (E,)),
                bias(T.FFN_GATE_EXP, il, (E, I)),
                bias(T.FFN_UP_EXP, il, (E, I)),
                bias(T.FFN_DOWN_EXP, il, (E, D), residual=True),
            ]
        if self.shared:
            if self.shared.gated:
                out.append(matrix_in(T.FFN_GATE_INP_SHEXP, il, (D,)))
            out += ffn(c, il, T.FFN_GATE_SHEXP, T.FFN_UP_SHEXP, T.FFN_DOWN_SHEXP, self.shared.width(c))
        return out


# --- an architecture and what it writes -----------------------------------------------------------------------------

MetaRule = Callable[[SynthConfig], Any]  # a value, or None to leave the key out


class Mixer(Protocol):
    """A block's attention part: its tensors and the keys that describe them (GQA, MLA, glm5_next's mixer)."""

    def tensors(self, c: SynthConfig, il: int) -> list[TensorSpec]: ...

    def metadata(self, c: SynthConfig) -> dict[str, Any]: ...


@dataclass(frozen=True)
class ArchSpec:
    arch: MODEL_ARCH | str  # a name: an architecture gguf-py 0.19 does not know (glm5-next)
    attention: Mixer
    moe: Moe
    ffn_norm: MODEL_TENSOR = T.FFN_NORM  # glm4moe and gpt-oss name it post_attention_norm
    derived: Mapping[str, Rule] = field(default_factory=dict)  # config fields this arch sets (see config.py)
    metadata: Mapping[str, MetaRule] = field(default_factory=dict)  # extra keys, templates of gguf.Keys
    checks: tuple[tuple[Callable[[SynthConfig], bool], str], ...] = ()
    output_norm: MODEL_TENSOR = T.OUTPUT_NORM  # lfm2moe stores its final norm as token_embd_norm
    tokenizer: str = "gpt2"  # tokenizer.ggml.model: "gpt2" (byte-level BPE) or "gemma4" (moeprep/synth/tokenizer.py)

    @property
    def name(self) -> str:
        return self.arch if isinstance(self.arch, str) else MODEL_ARCH_NAMES[self.arch]

    def global_tensors(self, c: SynthConfig) -> list[TensorSpec]:
        """Tensors outside the blocks besides the embedding, output norm and head (Gemma 4's rope_freqs)."""
        return []

    def layer_tensors(self, c: SynthConfig, il: int) -> list[TensorSpec]:
        """attn_norm, attention, the FFN norm, then a dense FFN (leading layers) or the MoE block."""
        ffn_part = (
            ffn(c, il, T.FFN_GATE, T.FFN_UP, T.FFN_DOWN, c.n_ff) if il < c.n_dense_lead else self.moe.tensors(c, il)
        )
        return [
            norm(T.ATTN_NORM, il, c.n_embd),
            *self.attention.tensors(c, il),
            norm(self.ffn_norm, il, c.n_embd),
            *ffn_part,
        ]


def model_tensors(spec: ArchSpec, c: SynthConfig, n_vocab: int) -> list[TensorSpec]:
    """Every tensor in file order: token_embd [V, D], the arch's global tensors, the layers, output_norm [D],
    output [V, D]."""
    out = [TensorSpec(tensor_name(T.TOKEN_EMBD), (n_vocab, c.n_embd), Embedding()), *spec.global_tensors(c)]
    for il in range(c.n_layer):
        out += spec.layer_tensors(c, il)
    out += [
        norm(spec.output_norm, None, c.n_embd),
        TensorSpec(tensor_name(T.OUTPUT), (n_vocab, c.n_embd), Normal(1 / math.sqrt(c.n_embd))),
    ]
    return out


# --- metadata ---------------------------------------------------------------------------------------------------------

# Python value type -> GGUF scalar type, for the architecture keys (all of llama.cpp's are u32, f32 or bool).
VALUE_TYPES: dict[type, GGUFValueType] = {
    bool: GGUFValueType.BOOL,
    int: GGUFValueType.UINT32,
    float: GGUFValueType.FLOAT32,
    str: GGUFValueType.STRING,
}

COMMON_METADATA: dict[str, MetaRule] = {
    Keys.LLM.CONTEXT_LENGTH: lambda c: c.n_ctx,
    Keys.LLM.EMBEDDING_LENGTH: lambda c: c.n_embd,
    Keys.LLM.BLOCK_COUNT: lambda c: c.n_layer,
    Keys.LLM.FEED_FORWARD_LENGTH: lambda c: c.n_ff,
    Keys.Attention.HEAD_COUNT: lambda c: c.n_head,
    Keys.Attention.LAYERNORM_RMS_EPS: lambda c: c.rms_eps,
    Keys.Rope.DIMENSION_COUNT: lambda c: c.rope_dim,
    Keys.Rope.FREQ_BASE: lambda c: c.rope_freq_base,
    Keys.LLM.EXPERT_COUNT: lambda c: c.n_expert,
    Keys.LLM.EXPERT_USED_COUNT: lambda c: c.n_expert_used,
    Keys.Rope.SCALING_TYPE: lambda c: None if c.rope_scaling == "none" else c.rope_scaling,
    Keys.Rope.SCALING_FACTOR: lambda c: None if c.rope_scaling == "none" else ROPE_SCALING_FACTOR,
    Keys.Rope.SCALING_ORIG_CTX_LEN: lambda c: (
        int(c.n_ctx / ROPE_SCALING_FACTOR) if c.rope_scaling in ("yarn", "longrope") else None
    ),
}
EXPERT_FF: dict[str, MetaRule] = {Keys.LLM.EXPERT_FEED_FORWARD_LENGTH: lambda c: c.n_ff_exp}
# DeepSeek-V3-style routing: sigmoid scores, weights renormalised over the chosen experts, then scaled.
SIGMOID_ROUTING: dict[str, MetaRule] = {
    Keys.LLM.LEADING_DENSE_BLOCK_COUNT: lambda c: c.n_dense_lead,
    Keys.LLM.EXPERT_SHARED_COUNT: lambda c: c.n_expert_shared,
    Keys.LLM.EXPERT_WEIGHTS_SCALE: lambda c: c.expert_weights_scale,
    Keys.LLM.EXPERT_WEIGHTS_NORM: lambda c: True,
    Keys.LLM.EXPERT_GATING_FUNC: lambda c: int(SIGMOID.func),
}


def model_metadata(spec: ArchSpec, c: SynthConfig) -> dict[str, KVValue]:
    """The architecture's keys, as llama.cpp reads them; rules returning None are left out."""
    rules: dict[str, MetaRule] = {**COMMON_METADATA, **spec.metadata}
    values = {key: rule(c) for key, rule in rules.items()} | spec.attention.metadata(c)
    return {key.format(arch=spec.name): _kv(value) for key, value in values.items() if value is not None}


def _kv(value: Any) -> KVValue:
    """A scalar, or a per-layer list (glm5-next's head_count_kv) as an array of its elements' type."""
    if isinstance(value, list):
        return KVValue(value, GGUFValueType.ARRAY, VALUE_TYPES[type(value[0])])
    return KVValue(value, VALUE_TYPES[type(value)])
