"""The synthetic architectures as data: which tensors each layer has, which metadata keys llama.cpp reads.

Each ArchSpec is assembled from the shared parts in moeprep/synth/parts.py (an attention kind, a MoE block, the norm
before the FFN), so an architecture is one table entry; one with parts of its own (glm5-next) is built in its own
module and joins the table here. Letters as in parts.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gguf import MODEL_ARCH, ExpertGatingFuncType, Keys

from moeprep.synth.afmoe import AFMOE
from moeprep.synth.config import SynthConfig
from moeprep.synth.deepseek4 import DEEPSEEK4
from moeprep.synth.gemma4 import GEMMA4
from moeprep.synth.glm5_next import GLM5_NEXT
from moeprep.synth.kimi_k3 import KIMI_K3
from moeprep.synth.laguna import LAGUNA
from moeprep.synth.lfm2moe import LFM2MOE
from moeprep.synth.llama4 import LLAMA4
from moeprep.synth.mamba2 import GRANITEHYBRID, NEMOTRON_H_MOE
from moeprep.synth.mimo2 import MIMO2
from moeprep.synth.parts import (
    DEEPSEEK_DERIVED,
    EXPERT_FF,
    GQA,
    MLA,
    SIGMOID,
    SIGMOID_ROUTING,
    ArchSpec,
    Gating,
    Moe,
    SharedExpert,
    T,
    TensorSpec,
    bias,
    matrix_in,
    norm,
    tensor_name,
)
from moeprep.synth.qwen35moe import QWEN3NEXT, QWEN35MOE
from moeprep.synth.step35 import STEP35

__all__ = ["ARCHS", "tensor_name"]  # tensor_name: moeprep/synth/routing.py looks it up beside the table

INDEXER_TOP_K = 2048  # as in DeepSeek-V3.2: more than a test's positions, so the indexer selects them all
INDEXER_HEAD = 64  # llama.cpp rotates the indexer's heads by a Hadamard matrix of 64 or more (V3.2: 128)


@dataclass(frozen=True)
class MLAWithIndexer:
    """DeepSeek-V3.2's attention: MLA (absorbed layout) plus its lightning indexer: k_norm [di] with a bias,
    proj [Hi, D], attn_k [di, D], attn_q_b [Hi di, Cq]; Hi = n_head, di = INDEXER_HEAD. shared_indexers (GLM-5):
    the odd blocks have no indexer and attend over the selection of the block before them
    (attention.indexer.types)."""

    shared_indexers: bool = False

    def has_indexer(self, il: int) -> bool:
        return not self.shared_indexers or il % 2 == 0

    def tensors(self, c: SynthConfig, il: int) -> list[TensorSpec]:
        Hi, di = c.n_head, INDEXER_HEAD
        if not self.has_indexer(il):
            return MLA().tensors(c, il)
        return [
            *MLA().tensors(c, il),
            norm(T.INDEXER_K_NORM, il, di),
            bias(T.INDEXER_K_NORM, il, (di,)),
            matrix_in(T.INDEXER_PROJ, il, (Hi, c.n_embd)),
            matrix_in(T.INDEXER_ATTN_K, il, (di, c.n_embd)),
            matrix_in(T.INDEXER_ATTN_Q_B, il, (Hi * di, c.q_lora_rank)),
        ]

    def metadata(self, c: SynthConfig) -> dict[str, Any]:
        return (
            MLA().metadata(c)
            | {
                Keys.Attention.Indexer.HEAD_COUNT: c.n_head,
                Keys.Attention.Indexer.KEY_LENGTH: INDEXER_HEAD,
                Keys.Attention.Indexer.TOP_K: INDEXER_TOP_K,
            }
            | (
                {"{arch}.attention.indexer.types": [int(self.has_indexer(il)) for il in range(c.n_layer)]}
                if self.shared_indexers
                else {}
            )
        )


# Softmax routing whose choice adds exp_probs_b to the probabilities (ERNIE 4.5): the skew goes there, in
# probability units.
SOFTMAX_BIASED = Gating(router_logit_std=3.0, skew_in_probs_bias=True, skew_scale=0.3, func=None)

# Softmax routing whose file names its gating function (SmallThinker's loader reads no default).
SOFTMAX_NAMED = Gating(
    router_logit_std=3.0, skew_in_probs_bias=False, skew_scale=6.0, func=ExpertGatingFuncType.SOFTMAX
)

FULL_ROTARY = (lambda c: c.rope_dim == c.head_dim, "this architecture rotates whole heads (rope_dim == head_dim)")
HEADS_SPAN_EMBD = (
    lambda c: c.n_head * c.head_dim == c.n_embd,
    "q and output are [n_embd, n_embd]: n_head * head_dim must equal n_embd",
)

ARCHS: dict[str, ArchSpec] = {
    spec.name: spec
    for spec in (
        # Qwen3-MoE: per-head q/k RMSNorm, no shared expert, softmax top-k renormalised.
        ArchSpec(MODEL_ARCH.QWEN3MOE, GQA(qk_norm="head"), Moe(), metadata=EXPERT_FF, checks=(FULL_ROTARY,)),
        # Qwen1.5/2-MoE: qkv biases, a shared expert scaled by sigmoid(ffn_gate_inp_shexp . x).
        ArchSpec(
            MODEL_ARCH.QWEN2MOE,
            GQA(qkv_bias=True),
            Moe(shared=SharedExpert(lambda c: c.n_ff_shexp, gated=True)),
            derived={"head_dim": lambda g: g["n_embd"] // g["n_head"], "n_ff_shexp": lambda g: 4 * g["n_ff_exp"]},
            metadata=EXPERT_FF | {Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH: lambda c: c.n_ff_shexp},
            checks=(FULL_ROTARY, HEADS_SPAN_EMBD),
        ),
        # DeepSeek-V2/V3: MLA, one leading dense layer, shared expert, sigmoid routing with exp_probs_b.
        ArchSpec(
            MODEL_ARCH.DEEPSEEK2,
            MLA(),
            Moe(gating=SIGMOID, shared=SharedExpert(lambda c: c.n_ff_exp * c.n_expert_shared)),
            derived={
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
            },
            metadata=EXPERT_FF
            | SIGMOID_ROUTING
            | {
                # llama.cpp divides this by 0.1 (its converters store 0.1 * mscale_all_dim); 0.1 means 1.0
                Keys.Rope.SCALING_YARN_LOG_MUL: lambda c: 0.1 if c.rope_scaling == "yarn" else None
            },
            checks=(
                (lambda c: c.rope_dim == c.qk_rope_dim, "rope_dim must equal qk_rope_dim"),
                (
                    lambda c: c.qk_nope_dim > 0 and c.q_lora_rank > 0 and c.kv_lora_rank > 0,
                    "MLA needs qk_nope_dim, q_lora_rank and kv_lora_rank > 0",
                ),
            ),
        ),
        # GLM-4.5: qkv biases, partial rotary (half of each head), one leading dense layer, sigmoid routing.
        ArchSpec(
            MODEL_ARCH.GLM4_MOE,
            GQA(qkv_bias=True),
            Moe(gating=SIGMOID, shared=SharedExpert(lambda c: c.n_ff_exp * c.n_expert_shared)),
            ffn_norm=T.ATTN_POST_NORM,
            derived={
                "n_dense_lead": lambda g: 1,
                "n_expert_shared": lambda g: 1,
                "rope_dim": lambda g: g["head_dim"] // 2,
            },
            metadata=EXPERT_FF | SIGMOID_ROUTING,
        ),
        # gpt-oss: biases everywhere, attention sinks, sliding window on even layers, SwiGLU-OAI experts,
        # softmax over the top-k logits only.
        ArchSpec(
            MODEL_ARCH.GPT_OSS,
            GQA(qkv_bias=True, out_bias=True, sinks=True),
            Moe(biases=True),
            ffn_norm=T.ATTN_POST_NORM,
            metadata=EXPERT_FF | {Keys.Attention.SLIDING_WINDOW: lambda c: c.sliding_window},
            checks=(FULL_ROTARY,),
        ),
        # Mixtral-style MoE under the llama architecture: the experts' width is feed_forward_length.
        ArchSpec(MODEL_ARCH.LLAMA, GQA(), Moe(), derived={"n_ff": lambda g: g["n_ff_exp"]}, checks=(FULL_ROTARY,)),
        # OLMoE: q/k RMSNorm over all heads at once (so kv heads = heads), experts' width is feed_forward_length.
        ArchSpec(
            MODEL_ARCH.OLMOE,
            GQA(qk_norm="full"),
            Moe(),
            derived={
                "head_dim": lambda g: g["n_embd"] // g["n_head"],
                "n_head_kv": lambda g: g["n_head"],
                "n_ff": lambda g: g["n_ff_exp"],
            },
            checks=(
                FULL_ROTARY,
                HEADS_SPAN_EMBD,
                (lambda c: c.n_head_kv == c.n_head, "q/k norms span all heads: n_head_kv must equal n_head"),
            ),
        ),
        # GLM-5.3-Flash: hyper-connections, KDA and DSA attention, a NextN block (moeprep/synth/glm5_next.py).
        GLM5_NEXT,
        # MiMo-V2-Flash: sliding and full attention layers with their own KV heads, sinks and RoPE base
        # (moeprep/synth/mimo2.py).
        MIMO2,
        # Qwen3.5/3.6-MoE: gated delta-net layers beside gated full attention (moeprep/synth/qwen35moe.py).
        QWEN35MOE,
        # MiniMax-M2: q/k RMSNorm over all heads at once, partial NeoX RoPE, sigmoid routing with exp_probs_b; the
        # experts' width is feed_forward_length.
        ArchSpec(
            MODEL_ARCH.MINIMAXM2,
            GQA(qk_norm="full"),
            Moe(gating=SIGMOID),
            derived={"n_ff": lambda g: g["n_ff_exp"], "rope_dim": lambda g: g["head_dim"] // 2},
            metadata=EXPERT_FF | {Keys.LLM.EXPERT_GATING_FUNC: lambda c: int(SIGMOID.func)},
        ),
        # Qwen3-Next: the same with NeoX RoPE and the delta net's projections grouped by key head.
        QWEN3NEXT,
        # DeepSeek-V3.2 (a name gguf-py 0.19 does not know): DeepSeek-V3 with DSA, MLA in the absorbed layout over
        # the positions its lightning indexer selects.
        ArchSpec(
            "deepseek32",
            MLAWithIndexer(),
            Moe(gating=SIGMOID, shared=SharedExpert(lambda c: c.n_ff_exp * c.n_expert_shared)),
            derived=DEEPSEEK_DERIVED | {"mla_split": lambda g: True},
            metadata=EXPERT_FF | SIGMOID_ROUTING,
            checks=(
                (lambda c: c.mla_split, "deepseek32 stores MLA absorbed: mla_split must be true"),
                (lambda c: c.rope_dim <= INDEXER_HEAD, f"the indexer rotates rope_dim of its {INDEXER_HEAD} channels"),
            ),
        ),
        # GLM-5 (glm-dsa): DeepSeek-V3.2's graph, the indexer with normal RoPE, every other block sharing the
        # indexer of the block before it.
        ArchSpec(
            "glm-dsa",
            MLAWithIndexer(shared_indexers=True),
            Moe(gating=SIGMOID, shared=SharedExpert(lambda c: c.n_ff_exp * c.n_expert_shared)),
            derived=DEEPSEEK_DERIVED | {"mla_split": lambda g: True},
            metadata=EXPERT_FF | SIGMOID_ROUTING,
            checks=(
                (lambda c: c.mla_split, "glm-dsa stores MLA absorbed: mla_split must be true"),
                (lambda c: c.rope_dim <= INDEXER_HEAD, f"the indexer rotates rope_dim of its {INDEXER_HEAD} channels"),
            ),
        ),
        # dots.llm1: Qwen3's attention (MHA here, as llama.cpp loads it) over DeepSeek-V3's FFN.
        ArchSpec(
            MODEL_ARCH.DOTS1,
            GQA(qk_norm="head"),
            Moe(gating=SIGMOID, shared=SharedExpert(lambda c: c.n_ff_exp * c.n_expert_shared)),
            derived={
                "n_head_kv": lambda g: g["n_head"],
                "n_dense_lead": lambda g: 1,
                "n_expert_shared": lambda g: 1,
                "expert_weights_scale": lambda g: 2.5,
            },
            metadata=EXPERT_FF | SIGMOID_ROUTING,
            checks=(FULL_ROTARY,),
        ),
        # ERNIE 4.5 MoE: plain GQA, a leading dense layer, softmax routing with exp_probs_b, a shared expert.
        ArchSpec(
            MODEL_ARCH.ERNIE4_5_MOE,
            GQA(),
            Moe(gating=SOFTMAX_BIASED, shared=SharedExpert(lambda c: c.n_ff_exp)),
            derived={"n_dense_lead": lambda g: 1},
            metadata=EXPERT_FF
            | {
                Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH: lambda c: c.n_ff_exp,
                Keys.LLM.LEADING_DENSE_BLOCK_COUNT: lambda c: c.n_dense_lead,
                Keys.LLM.INTERLEAVE_MOE_LAYER_STEP: lambda c: 1,
            },
            checks=(FULL_ROTARY,),
        ),
        # Hunyuan-A13B: per-head q/k RMSNorm (after RoPE), softmax routing, an ungated shared expert; the experts'
        # width is feed_forward_length.
        ArchSpec(
            MODEL_ARCH.HUNYUAN_MOE,
            GQA(qk_norm="head"),
            Moe(shared=SharedExpert(lambda c: c.n_ff_exp)),
            derived={"n_ff": lambda g: g["n_ff_exp"]},
            metadata=EXPERT_FF | {Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH: lambda c: c.n_ff_exp},
            checks=(FULL_ROTARY,),
        ),
        # Llama 4: dense and MoE layers interleaved, top-1 sigmoid routing (moeprep/synth/llama4.py).
        LLAMA4,
        # Ling 2.0 (bailingmoe2): q, k and v in one attn_qkv, per-head q/k RMSNorm, partial NeoX RoPE (half of each
        # head, as the released models rotate), DeepSeek-V3's FFN with group-limited sigmoid routing.
        ArchSpec(
            MODEL_ARCH.BAILINGMOE2,
            GQA(qk_norm="head", fused_qkv=True),
            Moe(gating=SIGMOID, shared=SharedExpert(lambda c: c.n_ff_exp * c.n_expert_shared)),
            derived={
                "n_dense_lead": lambda g: 1,
                "n_expert_shared": lambda g: 1,
                "expert_weights_scale": lambda g: 2.5,
                "rope_dim": lambda g: g["head_dim"] // 2,
            },
            metadata=EXPERT_FF
            | SIGMOID_ROUTING
            | {
                Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH: lambda c: c.n_ff_exp,
                Keys.LLM.EXPERT_GROUP_COUNT: lambda c: 4 if c.n_expert % 4 == 0 else 1,
                Keys.LLM.EXPERT_GROUP_USED_COUNT: lambda c: 2 if c.n_expert % 4 == 0 else 1,
            },
        ),
        # Gemma 4 (26B-A4B): sliding and full layers of different head sizes, a dense GELU MLP beside the experts,
        # norms after every sublayer, soft-capped logits, the gemma4 tokenizer (moeprep/synth/gemma4.py).
        GEMMA4,
        # Granite 4.0 hybrid: Mamba-2 layers beside GQA ones, softmax routing and a shared expert
        # (moeprep/synth/mamba2.py).
        GRANITEHYBRID,
        # Nemotron-H MoE (Nemotron-3-Nano): Mamba-2, attention and ungated relu^2 MoE layers by a per-layer pattern,
        # sigmoid routing with exp_probs_b (moeprep/synth/mamba2.py).
        NEMOTRON_H_MOE,
        # Arcee's AFMoE (Trinity): gated attention, sandwich norms, NoPE full-attention layers between sliding
        # ones, DeepSeek-V3-style routing beside a shared expert (moeprep/synth/afmoe.py).
        AFMOE,
        # SmallThinker, its sliding-window variant: plain GQA, every layer MoE with ReLU-gated experts routed from
        # the block's input, softmax top-k renormalised; the first layer of every 4 full and without RoPE.
        ArchSpec(
            MODEL_ARCH.SMALLTHINKER,
            GQA(),
            Moe(gating=SOFTMAX_NAMED),
            metadata=EXPERT_FF
            | {
                Keys.LLM.EXPERT_GATING_FUNC: lambda c: int(SOFTMAX_NAMED.func),
                Keys.Attention.SLIDING_WINDOW: lambda c: c.sliding_window,
            },
            checks=(FULL_ROTARY,),
        ),
        # LFM2 MoE: gated short-convolution layers beside GQA, sigmoid routing (moeprep/synth/lfm2moe.py).
        LFM2MOE,
        # Step-3.5: sliding and full layers with their own query heads and rotated widths, a per-head sigmoid gate
        # on the attention output, DeepSeek-V3-style routing beside a shared expert, clamped SwiGLU, a NextN block
        # (moeprep/synth/step35.py).
        STEP35,
        # poolside's Laguna: a softplus output gate, RoPE by layer kind, sliding layers with more heads (XS.2) or
        # none (M.1), DeepSeek-V3-style routing beside a shared expert of its own width (moeprep/synth/laguna.py).
        LAGUNA,
        # Kimi-K3: Kimi-Linear's KDA and MLA layers with cross-layer residual attention, a latent MoE, the situ
        # activation and gated MLA (moeprep/synth/kimi_k3.py).
        KIMI_K3,
        # DeepSeek-V4: hyper-connections, one shared KV head over a sliding window plus compressed keys (some chosen
        # by a lightning indexer), a grouped low-rank output, sqrt-softplus and hash routing (moeprep/synth/deepseek4.py).
        DEEPSEEK4,
    )
}
