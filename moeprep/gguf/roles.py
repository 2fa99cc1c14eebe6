"""What each tensor of a MoE model is for, by architecture: a table of name patterns, not a chain of ifs.

A tensor name is `blk.<i>.<base>.<suffix>` inside a block, or `<base>.<suffix>` outside one. Each architecture's
table maps base names to roles; the tables are built from shared groups (most MoE models share the decoder
layout and differ in their attention and their extras). An unknown architecture is classified with the union of
all groups, and `classify_tensors` says so.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass


class TensorRole(str, enum.Enum):
    ATTENTION = "attention"
    EXPERT = "expert"  # routed experts: *_exps, stacked over the expert axis
    SHARED_EXPERT = "shared_expert"
    ROUTER = "router"
    DENSE_FFN = "dense_ffn"
    NORM = "norm"
    EMBEDDING = "embedding"
    OUTPUT = "output"
    OTHER = "other"


R = TensorRole

# Shared groups: base name -> role.
DECODER = {
    "token_embd": R.EMBEDDING, "output": R.OUTPUT, "output_norm": R.NORM, "rope_freqs": R.OTHER,
    "attn_norm": R.NORM, "ffn_norm": R.NORM, "post_attention_norm": R.NORM, "post_ffw_norm": R.NORM,
    "attn_q": R.ATTENTION, "attn_k": R.ATTENTION, "attn_v": R.ATTENTION, "attn_output": R.ATTENTION,
    "attn_qkv": R.ATTENTION,
    "ffn_gate": R.DENSE_FFN, "ffn_up": R.DENSE_FFN, "ffn_down": R.DENSE_FFN,
    "ffn_gate_inp": R.ROUTER,
    "ffn_gate_exps": R.EXPERT, "ffn_up_exps": R.EXPERT, "ffn_down_exps": R.EXPERT, "ffn_gate_up_exps": R.EXPERT,
}
QK_NORM = {"attn_q_norm": R.NORM, "attn_k_norm": R.NORM}
SHARED_EXPERTS = {"ffn_gate_shexp": R.SHARED_EXPERT, "ffn_up_shexp": R.SHARED_EXPERT,
                  "ffn_down_shexp": R.SHARED_EXPERT, "ffn_gate_inp_shexp": R.ROUTER}
EXPERT_BIAS = {"exp_probs_b": R.ROUTER}  # sigmoid routing's selection bias (DeepSeek-V3, GLM-4.5)
MLA = {  # DeepSeek's multi-head latent attention
    "attn_q_a": R.ATTENTION, "attn_q_b": R.ATTENTION, "attn_kv_a_mqa": R.ATTENTION, "attn_kv_b": R.ATTENTION,
    "attn_k_b": R.ATTENTION, "attn_v_b": R.ATTENTION, "attn_q_a_norm": R.NORM, "attn_kv_a_norm": R.NORM,
}
SINKS = {"attn_sinks": R.ATTENTION}  # gpt-oss: learned per-head attention sinks
NEXTN = {  # multi-token-prediction layers (GLM-4.5, DeepSeek-V3)
    "nextn.eh_proj": R.OTHER, "nextn.embed_tokens": R.OTHER, "nextn.enorm": R.OTHER, "nextn.hnorm": R.OTHER,
    "nextn.shared_head_head": R.OTHER, "nextn.shared_head_norm": R.OTHER,
}
INDEXER = {  # DeepSeek-V3.2 sparse-attention indexer
    "indexer.k_norm": R.OTHER, "indexer.proj": R.OTHER, "indexer.attn_k": R.OTHER, "indexer.attn_q_b": R.OTHER,
}
# DeepSeek-V3.2's indexer matrices, which llama-quantize requantizes as it does attention (checked byte for byte on
# synthetic deepseek32 files, tests/quant/test_whole_file_peer.py)
DSA_INDEXER = {"indexer.k_norm": R.OTHER, "indexer.proj": R.ATTENTION, "indexer.attn_k": R.ATTENTION,
               "indexer.attn_q_b": R.ATTENTION}
LINEAR_ATTENTION = {  # Qwen3-Next / Qwen3.5-MoE gated delta-net layers
    "attn_gate": R.ATTENTION, "ssm_conv1d": R.OTHER, "ssm_dt": R.OTHER, "ssm_a": R.OTHER, "ssm_norm": R.OTHER,
    # the delta net's matrices, which llama-quantize requantizes as it does attention (checked byte for byte on
    # synthetic qwen3next and qwen35moe files, tests/quant/test_whole_file_peer.py)
    "ssm_in": R.ATTENTION, "ssm_ba": R.ATTENTION, "ssm_beta_alpha": R.ATTENTION, "ssm_out": R.ATTENTION,
    "ssm_beta": R.ATTENTION, "ssm_alpha": R.ATTENTION,
}
KDA = {  # GLM-5.3-Flash's Kimi delta attention layers: attn_q/k/v/output, short convolutions, low-rank gates
    "ssm_conv1d_q": R.OTHER, "ssm_conv1d_k": R.OTHER, "ssm_conv1d_v": R.OTHER,
    "ssm_f_a": R.ATTENTION, "ssm_f_b": R.ATTENTION, "ssm_g_a": R.ATTENTION, "ssm_g_b": R.ATTENTION,
    "ssm_beta": R.ATTENTION, "ssm_a": R.OTHER, "ssm_dt": R.OTHER, "ssm_norm": R.OTHER,
}
KPOOL_INDEXER = INDEXER | {  # GLM-5.3-Flash's DSA indexer also pools keys through a gate and a position bias
    "indexer_compressor_gate": R.OTHER, "indexer_compressor_ape": R.OTHER,
}
HYPER_CONNECTIONS = {  # 4-stream residual mixing (GLM-5.3-Flash): fn [mix, 4 D], base [mix], scale [3]
    "hc_attn_fn": R.OTHER, "hc_attn_base": R.OTHER, "hc_attn_scale": R.OTHER,
    "hc_ffn_fn": R.OTHER, "hc_ffn_base": R.OTHER, "hc_ffn_scale": R.OTHER,
}
GLM5_NEXT = DECODER | KDA | MLA | KPOOL_INDEXER | HYPER_CONNECTIONS | SHARED_EXPERTS | EXPERT_BIAS | NEXTN

ROLE_TABLES: dict[str, dict[str, TensorRole]] = {
    "qwen3moe": DECODER | QK_NORM,
    "qwen2moe": DECODER | SHARED_EXPERTS,
    "deepseek2": DECODER | MLA | SHARED_EXPERTS | EXPERT_BIAS | NEXTN | INDEXER,
    "deepseek32": DECODER | MLA | SHARED_EXPERTS | EXPERT_BIAS | NEXTN | DSA_INDEXER,
    "glm4moe": DECODER | QK_NORM | SHARED_EXPERTS | EXPERT_BIAS | NEXTN,
    "gpt-oss": DECODER | SINKS,
    "dots1": DECODER | QK_NORM | SHARED_EXPERTS | EXPERT_BIAS,
    "ernie4_5-moe": DECODER | SHARED_EXPERTS | EXPERT_BIAS,
    "hunyuan-moe": DECODER | QK_NORM | SHARED_EXPERTS,
    "minimax-m2": DECODER | QK_NORM | EXPERT_BIAS,
    "mimo2": DECODER | SINKS | EXPERT_BIAS | NEXTN | {"layer_out_norm": R.OTHER},  # its NextN block's head norm
    "llama": DECODER,  # Mixtral-style MoE under the llama architecture
    "llama4": DECODER | SHARED_EXPERTS,
    "olmoe": DECODER | QK_NORM,
    "qwen3next": DECODER | QK_NORM | SHARED_EXPERTS | LINEAR_ATTENTION,
    "qwen35moe": DECODER | QK_NORM | SHARED_EXPERTS | LINEAR_ATTENTION,
    "glm5-next": GLM5_NEXT,
    "glm5next": GLM5_NEXT,  # unsloth's dialect of the same files (see moeprep/gguf/dialect.py)
}
FALLBACK_TABLE: dict[str, TensorRole] = {k: v for table in ROLE_TABLES.values() for k, v in table.items()}


class QuantLimit(str, enum.Enum):
    """What llama.cpp's quantizer (llama-quant.cpp) allows for a tensor beyond its role, by architecture."""

    KEEP = "keep"  # never requantized, whatever the request (tensor_allows_quantization says no)
    Q8_0_FLOOR = "q8_0_floor"  # a requested quantized type becomes Q8_0, float types stay, unless a rule names it


GLM5_NEXT_LIMITS = {
    **dict.fromkeys(("hc_attn_fn", "hc_ffn_fn", "indexer.attn_q_b", "indexer.attn_k", "indexer.proj",
                     "indexer_compressor_gate", "indexer_compressor_ape", "ssm_f_a", "ssm_f_b", "ssm_g_a", "ssm_g_b",
                     "ssm_beta", "ssm_conv1d_q", "ssm_conv1d_k", "ssm_conv1d_v", "attn_kv_a_mqa", "attn_k_b",
                     "attn_v_b"), QuantLimit.KEEP),
    **dict.fromkeys(("attn_q_a", "attn_q_b", "nextn.eh_proj"), QuantLimit.Q8_0_FLOOR),
}
QUANT_LIMITS: dict[str, dict[str, QuantLimit]] = {"glm5-next": GLM5_NEXT_LIMITS, "glm5next": GLM5_NEXT_LIMITS}

# Hybrid architectures: the per-block metadata key that says which attention a block runs, and its values' names.
GLM5_NEXT_ATTENTION = ("attention.head_count_kv", {0: "KDA", 1: "DSA"})
ATTENTION_KINDS: dict[str, tuple[str, dict[int, str]]] = {"glm5-next": GLM5_NEXT_ATTENTION,
                                                          "glm5next": GLM5_NEXT_ATTENTION}

# blk.<i>.<base>.<suffix>, where base may itself contain dots (nextn.eh_proj).
TENSOR_NAME_RE = re.compile(r"^(?:blk\.(?P<block>\d+)\.)?(?P<base>.+?)(?:\.(?P<suffix>weight|bias|scale))?$")


@dataclass(frozen=True)
class TensorName:
    block: int | None
    base: str
    suffix: str | None


def parse_tensor_name(name: str) -> TensorName:
    m = TENSOR_NAME_RE.match(name)
    assert m is not None, name  # the pattern accepts any non-empty string
    block = m["block"]
    return TensorName(None if block is None else int(block), m["base"], m["suffix"])


def role_table(arch: str) -> tuple[dict[str, TensorRole], bool]:
    """The role table for `arch` and whether it is known (False: the name-pattern fallback)."""
    table = ROLE_TABLES.get(arch)
    return (table, True) if table is not None else (FALLBACK_TABLE, False)


def tensor_role(name: str, table: dict[str, TensorRole]) -> TensorRole:
    return table.get(parse_tensor_name(name).base, R.OTHER)


def quant_limit(arch: str, name: str) -> QuantLimit | None:
    """The quantizer's limit on tensor `name` of an `arch` model, None where its role alone decides."""
    return QUANT_LIMITS.get(arch, {}).get(parse_tensor_name(name).base)


def attention_kinds(arch: str, metadata: dict[str, object]) -> dict[str, list[int]]:
    """Blocks by attention kind for a hybrid architecture ({"KDA": [0, 1, 2, 4, ...], "DSA": [3, ...]}), else {}."""
    key, names = ATTENTION_KINDS.get(arch, ("", {}))
    per_block = metadata.get(f"{arch}.{key}")
    if not isinstance(per_block, list):
        return {}
    kinds: dict[str, list[int]] = {}
    for block, value in enumerate(per_block):
        kinds.setdefault(names.get(value, str(value)), []).append(block)
    return kinds
