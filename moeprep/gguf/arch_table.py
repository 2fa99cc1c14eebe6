"""Every MoE architecture llama.cpp knows, as data: what each of its tensors is for, and what llama.cpp's quantizer
refuses to requantize.

A tensor name is `blk.<i>.<base>.<suffix>` inside a block, `<base>.<suffix>` outside one. An architecture's role
table maps base names to roles; it is the union of the shared groups below, one group per building block (the
decoder's usual tensors, MLA, a shared expert, a Mamba-2 mixer, ...), because most MoE models share their decoder
layout and differ in their attention and extras. The base names of each group are those llama.cpp's tensor-name
table gives its tensor ids (src/llama-arch.cpp, LLM_TENSOR_NAMES); which groups an architecture has follows the
tensors its loader creates (src/models/<file>.cpp, load_arch_tensors, named in each ARCHITECTURES row).
tests/gguf/test_arch_table.py checks every row against llama.cpp's own tensor lists (tests/gguf/
llama_cpp_moe_tensors.json, written by bench/llama_cpp_moe_tensors.py) and llama.cpp's quantizer through its library.

Role choices that llama.cpp does not make for us, kept the same in every row:
- ATTENTION is the token mixer's projections that `--attn` requantizes: softmax attention and MLA (q/k/v/output,
  fused qkv, output gates, sinks), and the linear-attention layers' q/k/v/output and KDA's low-rank gates;
- a Mamba/SSM mixer, a short convolution, an indexer, a KV compressor, hyper-connections, per-layer embeddings and
  the NextN (multi-token prediction) blocks are OTHER: copied unless a `--type` rule names them;
- NORM is every norm weight of the decoder; routers are the expert-choice tensors (gate, selection bias, hash table).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


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


class QuantLimit(str, enum.Enum):
    """What llama.cpp's quantizer (src/llama-quant.cpp) allows for a tensor beyond its role."""

    KEEP = "keep"  # never requantized, whatever the request (tensor_allows_quantization says no)
    Q8_0_FLOOR = "q8_0_floor"  # a requested quantized type becomes Q8_0, float types stay, unless a rule names it


R = TensorRole

# ---- shared groups: base name -> role --------------------------------------------------------------------------
DECODER = {
    "token_embd": R.EMBEDDING,
    "output": R.OUTPUT,
    "output_norm": R.NORM,
    "rope_freqs": R.OTHER,
    "attn_norm": R.NORM,
    "ffn_norm": R.NORM,
    "post_attention_norm": R.NORM,
    "post_ffw_norm": R.NORM,
    "attn_q": R.ATTENTION,
    "attn_k": R.ATTENTION,
    "attn_v": R.ATTENTION,
    "attn_output": R.ATTENTION,
    "attn_qkv": R.ATTENTION,
    "ffn_gate": R.DENSE_FFN,
    "ffn_up": R.DENSE_FFN,
    "ffn_down": R.DENSE_FFN,
    "ffn_gate_inp": R.ROUTER,
    "ffn_gate_exps": R.EXPERT,
    "ffn_up_exps": R.EXPERT,
    "ffn_down_exps": R.EXPERT,
    "ffn_gate_up_exps": R.EXPERT,
}
QK_NORM = {"attn_q_norm": R.NORM, "attn_k_norm": R.NORM}
ATTN_GATE = {"attn_gate": R.ATTENTION}  # a sigmoid gate on the attention output (Qwen3-Next, MiniMax, Step)
SINKS = {"attn_sinks": R.ATTENTION}  # learned per-head attention sinks (gpt-oss, MiMo-V2)
ROPE_FACTORS = {"rope_factors_long": R.OTHER, "rope_factors_short": R.OTHER}  # LongRoPE tables
SHARED_EXPERTS = {
    "ffn_gate_shexp": R.SHARED_EXPERT,
    "ffn_up_shexp": R.SHARED_EXPERT,
    "ffn_down_shexp": R.SHARED_EXPERT,
    "ffn_gate_inp_shexp": R.ROUTER,
}
EXPERT_BIAS = {"exp_probs_b": R.ROUTER}  # sigmoid routing's selection bias (DeepSeek-V3, GLM-4.5)
CHUNK_EXPERTS = {"ffn_gate_chexps": R.EXPERT, "ffn_up_chexps": R.EXPERT, "ffn_down_chexps": R.EXPERT}  # GroveMoE
EXPERT_NORM = {"ffn_norm_exps": R.NORM}  # Arctic: the residual MoE branch's own norm
LAYER_OUTPUT_NORMS = {"layer_output_norm": R.NORM, "attn_output_norm": R.NORM}  # post-sublayer norms (Grok, BERT)
LATENT_MOE = {"ffn_latent_down": R.DENSE_FFN, "ffn_latent_up": R.DENSE_FFN}  # Nemotron 3: experts in a latent space
MLA = {  # DeepSeek's multi-head latent attention
    "attn_q_a": R.ATTENTION,
    "attn_q_b": R.ATTENTION,
    "attn_kv_a_mqa": R.ATTENTION,
    "attn_kv_b": R.ATTENTION,
    "attn_k_b": R.ATTENTION,
    "attn_v_b": R.ATTENTION,
    "attn_q_a_norm": R.NORM,
    "attn_kv_a_norm": R.NORM,
}
NEXTN = {  # multi-token-prediction layers (GLM-4.5, DeepSeek-V3): no decoder runs them
    "nextn.eh_proj": R.OTHER,
    "nextn.embed_tokens": R.OTHER,
    "nextn.enorm": R.OTHER,
    "nextn.hnorm": R.OTHER,
    "nextn.shared_head_head": R.OTHER,
    "nextn.shared_head_norm": R.OTHER,
}
INDEXER = {  # DeepSeek-V3.2 sparse-attention indexer: its matrices requantized as attention's (llama-quantize does
    # so; tests/quant/test_whole_file_peer.py checks the bytes on synthetic deepseek32 files)
    "indexer.k_norm": R.OTHER,
    "indexer.proj": R.ATTENTION,
    "indexer.attn_k": R.ATTENTION,
    "indexer.attn_q_b": R.ATTENTION,
}
PROJ_INDEXER = {  # MiniMax-M3 / Qwen4-exp indexer: q/k projections with their norms
    "indexer.q_proj": R.OTHER,
    "indexer.k_proj": R.OTHER,
    "indexer.q_norm": R.OTHER,
    "indexer.k_norm": R.OTHER,
}
KPOOL_INDEXER = INDEXER | {  # GLM-5.3-Flash's DSA indexer also pools keys through a gate and a position bias; its
    # matrices are kept as they are (GLM5_NEXT_KEEP below), so `--attn` does not count them
    "indexer.proj": R.OTHER,
    "indexer.attn_k": R.OTHER,
    "indexer.attn_q_b": R.OTHER,
    "indexer_compressor_gate": R.OTHER,
    "indexer_compressor_ape": R.OTHER,
}
LINEAR_ATTENTION = {  # Qwen3-Next / Qwen3.5-MoE gated delta-net layers (q/k/v in attn_qkv, output gate attn_gate);
    # their matrices are requantized as attention's (llama-quantize does so; tests/quant/test_whole_file_peer.py checks
    # the bytes on synthetic qwen3next and qwen35moe files)
    "attn_gate": R.ATTENTION,
    "ssm_in": R.ATTENTION,
    "ssm_conv1d": R.OTHER,
    "ssm_dt": R.OTHER,
    "ssm_a": R.OTHER,
    "ssm_ba": R.ATTENTION,
    "ssm_alpha": R.ATTENTION,
    "ssm_beta": R.ATTENTION,
    "ssm_norm": R.OTHER,
    "ssm_out": R.ATTENTION,
}
KDA = {  # Kimi delta attention layers: attn_q/k/v/output, short convolutions, low-rank gates
    "ssm_conv1d_q": R.OTHER,
    "ssm_conv1d_k": R.OTHER,
    "ssm_conv1d_v": R.OTHER,
    "ssm_f_a": R.ATTENTION,
    "ssm_f_b": R.ATTENTION,
    "ssm_g_a": R.ATTENTION,
    "ssm_g_b": R.ATTENTION,
    "ssm_g": R.ATTENTION,
    "ssm_beta": R.ATTENTION,
    "ssm_a": R.OTHER,
    "ssm_dt": R.OTHER,
    "ssm_norm": R.OTHER,
}
MAMBA2 = {  # Mamba-2 mixer layers beside attention (Granite 4, Nemotron-H); their in and out projections are
    # requantized as attention's (llama-quantize does so; tests/quant/test_whole_file_peer.py checks the bytes on
    # synthetic granitehybrid files)
    "ssm_in": R.ATTENTION,
    "ssm_conv1d": R.OTHER,
    "ssm_dt": R.OTHER,
    "ssm_a": R.OTHER,
    "ssm_d": R.OTHER,
    "ssm_norm": R.OTHER,
    "ssm_out": R.ATTENTION,
}
MAMBA1 = MAMBA2 | {  # Jamba's Mamba-1 mixer: x projection and the dt/B/C norms
    "ssm_x": R.OTHER,
    "ssm_dt_norm": R.OTHER,
    "ssm_b_norm": R.OTHER,
    "ssm_c_norm": R.OTHER,
}
SHORT_CONV = {  # LFM2's gated short-convolution layers; its final norm is stored as token_embd_norm
    "shortconv.conv": R.OTHER,
    "shortconv.in_proj": R.OTHER,
    "shortconv.out_proj": R.OTHER,
    "token_embd_norm": R.NORM,
    "dense_2": R.OTHER,
}
HYPER_CONNECTIONS = {  # 4-stream residual mixing (GLM-5.3-Flash, DeepSeek-V4): fn [mix, 4 D], base [mix], scale [3]
    "hc_attn_fn": R.OTHER,
    "hc_attn_base": R.OTHER,
    "hc_attn_scale": R.OTHER,
    "hc_ffn_fn": R.OTHER,
    "hc_ffn_base": R.OTHER,
    "hc_ffn_scale": R.OTHER,
}
HEAD_HYPER_CONNECTIONS = {"output_hc_fn": R.OTHER, "output_hc_base": R.OTHER, "output_hc_scale": R.OTHER}
LOW_RANK_HYPER_CONNECTIONS = {  # Qwen4-exp: hyper-connections through a low-rank down/up pair
    **{f"hc_{part}_{w}": R.OTHER for part in ("attn", "ffn") for w in ("down", "up", "inject", "norm")},
    "output_hc_down": R.OTHER,
    "output_hc_up": R.OTHER,
    "output_hc_norm": R.OTHER,
}
PER_LAYER_CONV_EMBEDDINGS = {  # Qwen4-exp: a per-layer token embedding read through a convolution and key/value
    "per_layer_token_embd": R.EMBEDDING,
    "ple_conv1d": R.OTHER,
    "ple_key": R.OTHER,
    "ple_value": R.OTHER,
    "ple_norm_conv": R.OTHER,
    "ple_norm_key": R.OTHER,
    "ple_norm_query": R.OTHER,
}
GEMMA_PER_LAYER = {  # Gemma 4: per-layer embeddings, the dense and MoE FFNs' own pre/post norms, layer scale
    "per_layer_token_embd": R.EMBEDDING,
    "per_layer_model_proj": R.OTHER,
    "per_layer_proj_norm": R.NORM,
    "inp_gate": R.OTHER,
    "proj": R.OTHER,
    "post_norm": R.NORM,
    "layer_output_scale": R.OTHER,
    "post_ffw_norm_1": R.NORM,
    "post_ffw_norm_2": R.NORM,
    "pre_ffw_norm_2": R.NORM,
}
BERT = {"token_types": R.EMBEDDING, "token_embd_norm": R.NORM}  # nomic-bert-moe: token types, embedding norm
PARALLEL_NORM = {"attn_norm_2": R.NORM}  # MiniMax-01: the linear-attention layers' output norm
ATTENTION_RESIDUALS = {  # Kimi-K3: learned scores that mix earlier layers' outputs, latent routed experts
    "attn_res_score": R.OTHER,
    "ffn_res_score": R.OTHER,
    "output_res_score": R.OTHER,
    "ffn_routed_down": R.DENSE_FFN,
    "ffn_routed_up": R.DENSE_FFN,
    "ffn_routed_norm": R.NORM,
}
COMPRESSED_ATTENTION = {  # DeepSeek-V4: a shared-KV attention with low-rank output and compressed KV
    "attn_q_a": R.ATTENTION,
    "attn_q_b": R.ATTENTION,
    "attn_q_a_norm": R.NORM,
    "attn_kv": R.ATTENTION,
    "attn_kv_a_norm": R.NORM,
    "attn_output_a": R.ATTENTION,
    "attn_output_b": R.ATTENTION,
    "attn_compressor_kv": R.OTHER,
    "attn_compressor_gate": R.OTHER,
    "attn_compressor_ape": R.OTHER,
    "attn_compressor_norm": R.NORM,
    "indexer_compressor_kv": R.OTHER,
    "indexer_compressor_gate": R.OTHER,
    "indexer_compressor_ape": R.OTHER,
    "indexer_compressor_norm": R.NORM,
    "exp_probs_b_vl": R.ROUTER,
    "ffn_gate_tid2eid": R.ROUTER,  # a second selection bias; hash routing's table
}
DRAFTER = {  # DFlash: a speculative-decoding drafter with convolutions and a token selector beside its layers
    "attn_conv_base": R.OTHER,
    "attn_conv_proj": R.OTHER,
    "ffn_conv_base": R.OTHER,
    "ffn_conv_proj": R.OTHER,
    "conf_proj": R.OTHER,
    "d2t": R.OTHER,
    "fc": R.OTHER,
    "markov_w1": R.OTHER,
    "markov_w2": R.OTHER,
    "selector_hidden": R.OTHER,
    "selector_predecessor": R.OTHER,
    "selector_successor": R.OTHER,
    "enc.output_norm": R.NORM,
    "layer_output_scale": R.OTHER,
}

# ---- the token mixer a block runs, told by a tensor only that mixer has ------------------------------------------
# For `inspect` on hybrids without a per-block metadata key for it (Architecture.attention_kinds): the first entry
# whose base name a block has names its mixer (KDA and delta-net layers also hold attn_* tensors, so they come first);
# a block with none runs no mixer (Nemotron-H's FFN-only layers).
MIXERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("KDA", ("ssm_conv1d_q",)),
    ("gated delta-net", ("ssm_ba", "ssm_alpha")),
    ("Mamba", ("ssm_in", "ssm_x")),
    ("short conv", ("shortconv.conv", "shortconv.in_proj")),
    ("lightning attention", ("attn_norm_2",)),  # MiniMax-01's linear-attention layers
    ("MLA", ("attn_kv_a_mqa", "attn_kv")),
    ("attention", ("attn_q", "attn_qkv")),
)
NO_MIXER = "FFN only"

# ---- llama.cpp's quantizer: the tensors it never requantizes, whatever the architecture ------------------------
# src/llama-quant.cpp, tensor_allows_quantization: a weight is requantized only if its name ends in "weight" and
# contains none of these (1-D tensors are never requantized either; moeprep's plan copies them first).
KEEP_EVERYWHERE = (
    "_norm.weight",  # norms
    "ffn_gate_inp.weight",  # expert gates
    "ffn_gate_tid2eid.weight",  # DeepSeek-V4's token -> expert table
    "altup",
    "laurel",
    "per_layer_model_proj",  # Gemma 3n/4 small projections
    "ssm_conv1d",
    "shortconv.conv.weight",  # Mamba/KDA and LFM2 convolutions
    "indexer.k_proj.weight",
    "indexer.q_proj.weight",  # MiniMax's tiny indexer projections
    "time_mix_first.weight",
    "time_mix_w0.weight",
    "time_mix_w1.weight",
    "time_mix_w2.weight",  # RWKV
    "time_mix_v0.weight",
    "time_mix_v1.weight",
    "time_mix_v2.weight",
    "time_mix_a0.weight",
    "time_mix_a1.weight",
    "time_mix_a2.weight",
    "time_mix_g1.weight",
    "time_mix_g2.weight",
    "time_mix_decay_w1.weight",
    "time_mix_decay_w2.weight",
    "time_mix_lerp_fused.weight",
    "attn_rel_b.weight",  # T5 relative position bias
    ".position_embd",
    "sam.pos_embd",
    "sam.neck.",
    "sam.net_",
    ".rel_pos",
    ".patch_embd",
    ".patch_merger",  # vision
    "a.rvq.codebook",
    "mm.a.code_embd",  # audio codebooks
)
KEEP_NAMES = ("position_embd.weight", "token_types.weight")  # same function: BERT's position and type embeddings

# glm5-next's own rules: src/llama-quant.cpp, tensor_allows_quantization (kept) and llama_tensor_get_type_impl
# (attn_q_a, attn_q_b and nextn.eh_proj not below Q8_0).
GLM5_NEXT_KEEP = (
    "hc_",
    "indexer.attn_q_b",
    "indexer.attn_k",
    "indexer.proj",
    "indexer_compressor_gate",
    "indexer_compressor_ape",
    "ssm_f_a.weight",
    "ssm_f_b.weight",
    "ssm_g_a.weight",
    "ssm_g_b.weight",
    "ssm_beta.weight",
    "attn_kv_a_mqa.weight",
    "attn_k_b.weight",
    "attn_v_b.weight",
)
GLM5_NEXT_Q8_0_FLOOR = ("attn_q_a", "attn_q_b", "nextn.eh_proj")


@dataclass(frozen=True)
class WindowRule:
    """How an architecture's loader tells its blocks that attend to recent positions only (a sliding window, or
    llama4's chunks) from those that attend to every position, where the file does not list them
    (attention.sliding_window_pattern): with attention.sliding_window above 0, in each `period` blocks all slide but
    one, the last (or the first with `full_first`); period 0: every block slides."""

    period: int = 0
    full_first: bool = False
    window: int = 0  # the loader's window whatever the file's attention.sliding_window says (0: the file's)
    # llama4: blocks attend within chunks of `chunk` positions, every `full_every`-th block to every position; a file
    # whose attention.sliding_window is 0 has no chunks
    chunk: int = 0
    full_every: int = 0


DEFAULT_WINDOWS = WindowRule()  # every block slides where the file has a window and no pattern
# The architectures whose loader sets the pattern itself (src/models/<arch>.cpp; moerun's arch modules read the same).
WINDOW_RULES: dict[str, WindowRule] = {
    "afmoe": WindowRule(period=4),
    "gpt-oss": WindowRule(period=2),
    "laguna": WindowRule(period=4, full_first=True),
    "lfm2moe": WindowRule(window=-1),  # -1: the loader ignores the key; no block slides
    "llama4": WindowRule(chunk=8192, full_every=4),
    "smallthinker": WindowRule(period=4, full_first=True, window=4096),
}


@dataclass(frozen=True)
class Architecture:
    """One MoE architecture: its loader in llama.cpp, its role table and its quantizer rules beyond the shared ones."""

    source: str  # llama.cpp's loader (src/models/<file>.cpp, load_arch_tensors) the groups follow
    groups: tuple[dict[str, TensorRole], ...]
    keep: tuple[str, ...] = ()  # name substrings llama.cpp never requantizes for this architecture only
    q8_0_floor: tuple[str, ...] = ()  # name substrings llama.cpp keeps at Q8_0 or better by default
    # hybrids: the per-block metadata key that says which attention a block runs, and its values' names
    attention_kinds: tuple[str, dict[int, str]] | None = None
    roles: dict[str, TensorRole] = field(init=False, compare=False)

    def __post_init__(self) -> None:
        roles: dict[str, TensorRole] = {}
        for group in self.groups:
            roles |= group
        object.__setattr__(self, "roles", roles)


def _arch(
    source: str,
    *groups: dict[str, TensorRole],
    keep: tuple[str, ...] = (),
    q8_0_floor: tuple[str, ...] = (),
    attention_kinds: tuple[str, dict[int, str]] | None = None,
) -> Architecture:
    """An architecture whose loader is src/models/<source>.cpp: the decoder's tensors and `groups`."""
    return Architecture(f"src/models/{source}.cpp", (DECODER, *groups), keep, q8_0_floor, attention_kinds)


GLM5_NEXT = _arch(
    "glm5-next",
    KDA,
    MLA,
    KPOOL_INDEXER,
    HYPER_CONNECTIONS,
    SHARED_EXPERTS,
    EXPERT_BIAS,
    NEXTN,
    keep=GLM5_NEXT_KEEP,
    q8_0_floor=GLM5_NEXT_Q8_0_FLOOR,
    attention_kinds=("attention.head_count_kv", {0: "KDA", 1: "DSA"}),
)
DEEPSEEK_V3 = (MLA, SHARED_EXPERTS, EXPERT_BIAS, NEXTN)
DSA = DEEPSEEK_V3 + (INDEXER,)  # DeepSeek-V3.2's sparse attention

# Every architecture whose llama.cpp loader creates stacked experts (bench/llama_cpp_moe_tensors.py lists them).
# Several dense families share a loader that accepts experts (granite, minicpm, llama-embed...): they are here too.
ARCHITECTURES: dict[str, Architecture] = {
    "afmoe": _arch("afmoe", QK_NORM, ATTN_GATE, SHARED_EXPERTS, EXPERT_BIAS),
    "arctic": _arch("arctic", EXPERT_NORM),
    "bailingmoe": _arch("bailingmoe", SHARED_EXPERTS),
    "bailingmoe2": _arch("bailingmoe2", QK_NORM, SHARED_EXPERTS, EXPERT_BIAS, NEXTN, LAYER_OUTPUT_NORMS),
    "bailingmoe3": _arch("bailingmoe3", KDA, ATTN_GATE, *DEEPSEEK_V3, LAYER_OUTPUT_NORMS),
    "cohere2moe": _arch("cohere2moe", SHARED_EXPERTS, NEXTN),
    "dbrx": _arch("dbrx", LAYER_OUTPUT_NORMS),
    "deepseek": _arch("deepseek", SHARED_EXPERTS),
    "deepseek2": _arch("deepseek2", *DSA),  # the indexer: DeepSeek-V3.2 files converted as deepseek2
    "deepseek2-ocr": _arch("deepseek2ocr", SHARED_EXPERTS, EXPERT_BIAS),
    "deepseek32": _arch("deepseek32", *DSA),
    "deepseek4": _arch(
        "deepseek4",
        COMPRESSED_ATTENTION,
        SINKS,
        SHARED_EXPERTS,
        EXPERT_BIAS,
        NEXTN,
        INDEXER,
        HYPER_CONNECTIONS,
        HEAD_HYPER_CONNECTIONS,
        # every block attends to a sliding window of raw keys, most also to compressed ones
        attention_kinds=(
            "attention.compress_ratios",
            {0: "window", 4: "window + 1/4 compressed, indexed", 128: "window + 1/128 compressed"},
        ),
    ),
    "dflash": _arch(
        "dflash",
        DRAFTER,
        COMPRESSED_ATTENTION,
        QK_NORM,
        SINKS,
        SHARED_EXPERTS,
        EXPERT_BIAS,
        HYPER_CONNECTIONS,
        HEAD_HYPER_CONNECTIONS,
    ),
    "dots1": _arch("dots1", QK_NORM, SHARED_EXPERTS, EXPERT_BIAS),
    "dots3note": _arch("dots3note", *DSA, QK_NORM, ATTN_GATE),
    "ernie4_5": _arch("ernie4-5", SHARED_EXPERTS, EXPERT_BIAS),
    "ernie4_5-moe": _arch("ernie4-5", SHARED_EXPERTS, EXPERT_BIAS),  # ernie4_5's loader
    "exaone-moe": _arch("exaone-moe", QK_NORM, SHARED_EXPERTS, EXPERT_BIAS, NEXTN),
    "gemma4": _arch("gemma4", QK_NORM, GEMMA_PER_LAYER),
    "glm-dsa": _arch("glm-dsa", *DSA),
    "glm4moe": _arch("glm4-moe", QK_NORM, SHARED_EXPERTS, EXPERT_BIAS, NEXTN),
    "glm5-next": GLM5_NEXT,
    "glm5next": GLM5_NEXT,  # unsloth's dialect of the same files (see moeprep/gguf/dialect.py)
    "gpt-oss": _arch("openai-moe", SINKS),
    "granite": _arch("granite", SHARED_EXPERTS, ROPE_FACTORS),
    "granite_swa": _arch("granite-swa", SHARED_EXPERTS, ROPE_FACTORS, SINKS),
    "granitehybrid": _arch("granite-hybrid", MAMBA2, SHARED_EXPERTS),
    "granitemoe": _arch("granite-moe", SHARED_EXPERTS, ROPE_FACTORS),
    "grok": _arch("grok", LAYER_OUTPUT_NORMS),
    "grovemoe": _arch("grovemoe", QK_NORM, CHUNK_EXPERTS),
    "hunyuan-moe": _arch("hunyuan-moe", QK_NORM, SHARED_EXPERTS),
    "hy_v3": _arch("hy-v3", QK_NORM, SHARED_EXPERTS, EXPERT_BIAS, NEXTN),
    "hy_v4": _arch("hy-v4", *DSA, ATTN_GATE, SINKS, HYPER_CONNECTIONS, HEAD_HYPER_CONNECTIONS),
    "jamba": _arch("jamba", MAMBA1),
    "kimi-k3": _arch("kimi-k3", KDA, ATTN_GATE, MLA, SHARED_EXPERTS, EXPERT_BIAS, ATTENTION_RESIDUALS),
    "kimi-linear": _arch("kimi-linear", KDA, MLA, SHARED_EXPERTS, EXPERT_BIAS),
    "laguna": _arch("laguna", QK_NORM, ATTN_GATE, SHARED_EXPERTS, EXPERT_BIAS),
    "lfm2": _arch("lfm2", QK_NORM, SHORT_CONV, EXPERT_BIAS),
    "lfm2moe": _arch("lfm2moe", QK_NORM, SHORT_CONV, EXPERT_BIAS),
    "llada-moe": _arch("llada-moe", QK_NORM),
    "llama": _arch("llama", SHARED_EXPERTS, ROPE_FACTORS),  # Mixtral-style MoE under the llama architecture
    "llama-embed": _arch("llama", SHARED_EXPERTS, ROPE_FACTORS),  # llama's loader
    "llama4": _arch("llama4", SHARED_EXPERTS),
    "maple": _arch("maple", QK_NORM),
    "mellum": _arch("mellum", QK_NORM),
    "mimo2": _arch("mimo2", SINKS, EXPERT_BIAS, NEXTN, LAYER_OUTPUT_NORMS),
    "minicpm": _arch("minicpm", SHARED_EXPERTS, ROPE_FACTORS),
    "minimax-01": _arch("minimax-01", ATTN_GATE, PARALLEL_NORM),
    "minimax-m2": _arch("minimax-m2", QK_NORM, EXPERT_BIAS),
    "minimax-m3": _arch("minimax-m3", QK_NORM, SHARED_EXPERTS, EXPERT_BIAS, PROJ_INDEXER),
    "mistral3": _arch("mistral3", SHARED_EXPERTS, ROPE_FACTORS),
    "mistral4": _arch("deepseek2", *DEEPSEEK_V3),  # deepseek2's loader
    "nemotron_h": _arch("nemotron-h", MAMBA2, SHARED_EXPERTS, EXPERT_BIAS, LATENT_MOE, NEXTN),
    "nemotron_h_moe": _arch("nemotron-h", MAMBA2, SHARED_EXPERTS, EXPERT_BIAS, LATENT_MOE, NEXTN),  # its loader
    "nomic-bert-moe": _arch("nomic-bert-moe", BERT, LAYER_OUTPUT_NORMS),
    "olmoe": _arch("olmoe", QK_NORM),
    "paddleocr": _arch("ernie4-5", SHARED_EXPERTS, EXPERT_BIAS),  # ernie4_5's loader
    "phimoe": _arch("phimoe", ROPE_FACTORS),
    "qwen2moe": _arch("qwen2moe", SHARED_EXPERTS),
    "qwen35moe": _arch("qwen35moe", QK_NORM, SHARED_EXPERTS, LINEAR_ATTENTION, NEXTN),
    "qwen3moe": _arch("qwen3moe", QK_NORM),
    "qwen3next": _arch("qwen3next", QK_NORM, SHARED_EXPERTS, LINEAR_ATTENTION, NEXTN),
    "qwen3vlmoe": _arch("qwen3vlmoe", QK_NORM),
    "qwen4exp": _arch(
        "qwen4exp",
        QK_NORM,
        SHARED_EXPERTS,
        LINEAR_ATTENTION,
        PROJ_INDEXER,
        LOW_RANK_HYPER_CONNECTIONS,
        PER_LAYER_CONV_EMBEDDINGS,
    ),
    "refact": _arch("refact", SHARED_EXPERTS, ROPE_FACTORS),
    "rnd1": _arch("rnd1", QK_NORM),
    "smallthinker": _arch("smallthinker"),
    "step35": _arch("step35", QK_NORM, ATTN_GATE, SHARED_EXPERTS, EXPERT_BIAS, NEXTN, ROPE_FACTORS),
}
