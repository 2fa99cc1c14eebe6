"""ModelArgs: every size and switch a model needs, read from GGUF metadata into one flat dataclass.

Metadata keys come from gguf-py's `Keys` tables. Facts an architecture never writes into its metadata (RoPE layout,
whether top-k weights are renormalised, the gating function when the key is missing) are given by the arch module
as `fixed` values or as `defaults` for absent keys, so this module never branches on the architecture.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from gguf import Keys

from moeprep.errors import MoeprepError
from moeprep.gguf.reader import GGUFModel

LLM, ATT, ROPE = Keys.LLM, Keys.Attention, Keys.Rope

# gguf's ExpertGatingFuncType values, plus the gpt-oss rule (softmax over the chosen experts' logits only).
GATING_SOFTMAX = 1
GATING_SIGMOID = 2
GATING_SOFTMAX_WEIGHT = 3
GATING_SQRT_SOFTPLUS = 4  # DeepSeek-V4: sqrt(softplus(logit))

# Fixed values for architectures whose llama.cpp loader ignores the DeepSeek-style MoE keys (weights scale,
# gating function, leading dense blocks) even when a file carries them; each such arch also fixes whether it
# renormalises the top-k weights (expert_weights_norm).
PLAIN_MOE: dict[str, Any] = {"expert_weights_scale": 0.0, "gating": GATING_SOFTMAX, "n_dense_lead": 0}

# The rope.scaling.type values llama.cpp's loader knows (it stops on any other); a file without the key is "linear"
# (scaled only where it gives a factor). LongRoPE's divisor tables only where an arch module reads them (step35):
# elsewhere llama.cpp has none for it either and scales the positions linearly.
ROPE_SCALINGS = ("none", "linear", "yarn", "longrope")
# YaRN's correction range as llama.cpp's context sets it: only its grok and mistral3 loaders, which moerun does not
# run, read rope.scaling.yarn_beta_fast / yarn_beta_slow from a file. Its yarn_log_multiplier likewise stays 0 but
# where an arch module reads it (deepseek2's, for DeepSeek-V2/V3 and V3.2).
YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0


def missing_key(g: GGUFModel, key: str) -> MoeprepError:
    """The error of a metadata key (its full name) a complete file of g's architecture has."""
    return MoeprepError(f"{g.path}: metadata key {key} is missing; is this a complete {g.arch} GGUF?")


def required_key(g: GGUFModel, key: str) -> Any:
    """The value of metadata key `key` (its full name), refused in one line where the file lacks it."""
    value = g.get(key)
    if value is None:
        raise missing_key(g, key)
    return value


@dataclass(frozen=True)
class ModelArgs:
    arch: str
    n_vocab: int
    dim: int  # D
    n_layers: int  # L, decoder blocks run (nextn/MTP blocks excluded)
    n_heads: int  # H, the most any layer has
    heads_by_layer: tuple[int, ...]  # per layer (step35's and laguna's sliding and full layers differ)
    n_kv_heads: int  # the most any layer has
    kv_heads_by_layer: tuple[int, ...]  # per layer (mimo2's sliding and full layers differ)
    head_dim: int  # Dh for Q and K
    v_head_dim: int
    n_ctx_train: int
    norm_eps: float
    ffn_dim: int  # dense FFN hidden size (leading dense layers)
    # RoPE
    rope_style: str  # "normal" (adjacent pairs) or "neox" (halves)
    rope_dim: int
    rope_dim_swa: int  # rotated channels on the sliding-window layers (laguna's differ from the full layers')
    rope_base: float
    rope_base_swa: float
    rope_scaling: str  # one of ROPE_SCALINGS
    rope_factor: float  # context extension factor; 0 or 1 means none
    rope_orig_ctx: int
    rope_attn_factor: float
    yarn_beta_fast: float
    yarn_beta_slow: float
    yarn_log_mul: float
    attn_scale: float  # 0: 1/sqrt(head_dim)
    attn_value_scale: float  # multiplies the attention output (mimo2); 0 or 1: none
    sliding_window: int  # 0: none
    swa_layers: tuple[bool, ...]  # per layer: does it use the sliding window
    # MoE
    n_experts: int  # E
    n_experts_used: int  # K
    expert_dim: int  # I
    n_shared_experts: int
    shared_expert_dim: int  # all shared experts of a layer together
    n_dense_lead: int
    expert_weights_scale: float
    expert_weights_norm: bool
    gating: int
    n_expert_groups: int
    n_group_used: int
    # MLA (deepseek2)
    q_lora_rank: int
    kv_lora_rank: int
    head_dim_mla: int
    v_head_dim_mla: int
    n_nextn_layers: int
    # Gemma: the token embedding is multiplied by embed_scale (1: none); logits are soft-capped at logit_softcap
    # (0: none)
    embed_scale: float = 1.0
    logit_softcap: float = 0.0
    # Granite's multipliers (0: none); llama.cpp reads them for the Granite family only, so its arch modules set them
    # (its embedding multiplier goes to embed_scale)
    residual_scale: float = 0.0  # multiplies each layer's attention and FFN outputs before their residual adds
    logit_scale: float = 0.0  # divides the logits
    # attn_q_norm and attn_k_norm on every attention layer: required where the arch's llama.cpp loader requires them
    # (an arch fact its module fixes), else used where present
    qk_norms_required: bool = False
    # the final norm's tensor (LFM2 files store it as token_embd_norm.weight)
    final_norm: str = "output_norm.weight"
    # exp_probs_b on every routed layer: required where the arch's llama.cpp loader requires it (an arch fact its
    # module fixes), else used where present
    selection_bias_required: bool = False
    # output.weight required where the arch's llama.cpp loader has no tied-embedding fallback; else token_embd stands
    # in for a missing head
    output_required: bool = False

    @classmethod
    def from_gguf(
        cls,
        g: GGUFModel,
        *,
        fixed: dict[str, Any] | None = None,
        defaults: dict[str, Any] | None = None,
        kv_heads_vary: bool = False,
        heads_vary: bool = False,
    ) -> ModelArgs:
        """Read the metadata of `g`. `defaults` fill keys the file lacks; `fixed` are arch facts that win over it.
        `kv_heads_vary`, `heads_vary`: the arch builds each layer with its own KV head count (kv_heads_by_layer) or
        query head count (heads_by_layer), so a per-layer head_count_kv or head_count need not be uniform.
        defaults["swa_pattern"] is the arch's period of sliding layers where the file gives none, and
        defaults["swa_full_first"] says the full layer comes first in each period (llama.cpp's dense_first)."""
        arch = g.arch
        defaults = defaults or {}
        varying = {ATT.HEAD_COUNT_KV} if kv_heads_vary else set()
        varying |= {ATT.HEAD_COUNT} if heads_vary else set()

        def get(key: str, field: str, default: Any) -> Any:
            value = g.get(key.format(arch=arch))
            if value is None:
                return defaults.get(field, default)
            if isinstance(value, list) and key in varying:
                return max(value)
            if isinstance(value, list):  # per-layer arrays: supported when uniform over the layers that use them
                used = [v for v in value if v] or [0]
                if len(set(used)) != 1:
                    raise MoeprepError(f"{g.path}: per-layer {key.format(arch=arch)} = {value} is not supported")
                value = used[0]
            return value

        def need(key: str) -> Any:
            value = get(key, "", None)
            if value is None:
                raise missing_key(g, key.format(arch=arch))
            return value

        dim, n_heads = int(need(LLM.EMBEDDING_LENGTH)), int(need(ATT.HEAD_COUNT))
        head_list = g.get(ATT.HEAD_COUNT.format(arch=arch))
        first_heads = (int(head_list[0]) or n_heads) if isinstance(head_list, list) else n_heads  # llama.cpp's n_head()
        head_dim = int(get(ATT.KEY_LENGTH, "head_dim", dim // first_heads))
        n_ctx_train = int(get(LLM.CONTEXT_LENGTH, "n_ctx_train", 4096))
        rope_base = float(get(ROPE.FREQ_BASE, "rope_base", 10000.0))
        n_nextn = int(get(LLM.NEXTN_PREDICT_LAYERS, "n_nextn_layers", 0))
        n_vocab = int(get(LLM.VOCAB_SIZE, "n_vocab", len(g.get(Keys.Tokenizer.LIST, ()))))
        n_experts_used = int(get(LLM.EXPERT_USED_COUNT, "n_experts_used", 0))
        ffn_dim = int(get(LLM.FEED_FORWARD_LENGTH, "ffn_dim", 0))
        n_layers = int(need(LLM.BLOCK_COUNT)) - n_nextn
        n_kv_heads = int(get(ATT.HEAD_COUNT_KV, "n_kv_heads", n_heads))
        kv_list = g.get(ATT.HEAD_COUNT_KV.format(arch=arch))
        heads = tuple(int(v) for v in head_list[:n_layers]) if isinstance(head_list, list) else (n_heads,) * n_layers
        if isinstance(kv_list, list):
            kv_heads = tuple(int(v) for v in kv_list[:n_layers])
        elif kv_list is None and isinstance(head_list, list):  # llama.cpp: each layer's KV heads default to its heads
            kv_heads = heads
        else:
            kv_heads = (n_kv_heads,) * n_layers
        rope_dim = int(get(ROPE.DIMENSION_COUNT, "rope_dim", head_dim))
        values = dict(
            arch=arch,
            n_vocab=n_vocab,
            dim=dim,
            n_layers=n_layers,
            n_heads=n_heads,
            heads_by_layer=heads,
            n_kv_heads=n_kv_heads,
            kv_heads_by_layer=kv_heads,
            head_dim=head_dim,
            v_head_dim=int(get(ATT.VALUE_LENGTH, "v_head_dim", dim // first_heads)),
            n_ctx_train=n_ctx_train,
            norm_eps=float(get(ATT.LAYERNORM_RMS_EPS, "norm_eps", 1e-6)),
            ffn_dim=ffn_dim,
            rope_style="normal",
            rope_dim=rope_dim,
            rope_dim_swa=int(get(ROPE.DIMENSION_COUNT_SWA, "rope_dim_swa", rope_dim)),
            rope_base=rope_base,
            rope_base_swa=float(get(ROPE.FREQ_BASE_SWA, "rope_base_swa", rope_base)),
            rope_scaling=str(get(ROPE.SCALING_TYPE, "rope_scaling", "linear")),
            rope_factor=float(get(ROPE.SCALING_FACTOR, "rope_factor", 0.0)),
            rope_orig_ctx=int(get(ROPE.SCALING_ORIG_CTX_LEN, "rope_orig_ctx", n_ctx_train)),
            rope_attn_factor=float(get(ROPE.SCALING_ATTN_FACTOR, "rope_attn_factor", 1.0)),
            yarn_beta_fast=YARN_BETA_FAST,
            yarn_beta_slow=YARN_BETA_SLOW,
            yarn_log_mul=0.0,
            attn_scale=float(get(ATT.SCALE, "attn_scale", 0.0)),
            attn_value_scale=float(get("{arch}.attention.value_scale", "attn_value_scale", 0.0)),  # no gguf-py constant
            sliding_window=int(get(ATT.SLIDING_WINDOW, "sliding_window", 0)),
            swa_layers=(),
            n_experts=int(get(LLM.EXPERT_COUNT, "n_experts", 0)),
            n_experts_used=n_experts_used,
            expert_dim=int(get(LLM.EXPERT_FEED_FORWARD_LENGTH, "expert_dim", ffn_dim // max(n_experts_used, 1))),
            n_shared_experts=int(get(LLM.EXPERT_SHARED_COUNT, "n_shared_experts", 0)),
            shared_expert_dim=int(get(LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH, "shared_expert_dim", 0)),
            n_dense_lead=int(get(LLM.LEADING_DENSE_BLOCK_COUNT, "n_dense_lead", 0)),
            expert_weights_scale=float(get(LLM.EXPERT_WEIGHTS_SCALE, "expert_weights_scale", 0.0)),
            expert_weights_norm=bool(get(LLM.EXPERT_WEIGHTS_NORM, "expert_weights_norm", False)),
            gating=int(get(LLM.EXPERT_GATING_FUNC, "gating", 0)) or defaults.get("gating", GATING_SOFTMAX),
            n_expert_groups=int(get(LLM.EXPERT_GROUP_COUNT, "n_expert_groups", 0)),
            n_group_used=int(get(LLM.EXPERT_GROUP_USED_COUNT, "n_group_used", 0)),
            q_lora_rank=int(get(ATT.Q_LORA_RANK, "q_lora_rank", 0)),
            kv_lora_rank=int(get(ATT.KV_LORA_RANK, "kv_lora_rank", 0)),
            head_dim_mla=int(get(ATT.KEY_LENGTH_MLA, "head_dim_mla", 0)),
            v_head_dim_mla=int(get(ATT.VALUE_LENGTH_MLA, "v_head_dim_mla", 0)),
            n_nextn_layers=n_nextn,
        )
        scaling = values["rope_scaling"]
        if scaling not in ROPE_SCALINGS:  # even where the arch fixes it: llama.cpp's loader stops first
            known = ", ".join(ROPE_SCALINGS)
            raise MoeprepError(f"{g.path}: unknown rope.scaling.type {scaling!r}; llama.cpp knows {known}")
        values.update(fixed or {})
        values["swa_layers"] = _swa_layers(
            g,
            values["n_layers"],
            values["sliding_window"],
            defaults.get("swa_pattern", 0),
            defaults.get("swa_full_first", False),
        )
        return cls(**values)

    def replace(self, **changes: Any) -> ModelArgs:
        return dataclasses.replace(self, **changes)

    @property
    def rope_freq_scale(self) -> float:
        """Position scale of RoPE (llama.cpp's freq_scale): 1/factor, or 1 when there is no scaling."""
        if self.rope_scaling == "none" or self.rope_factor in (0.0, 1.0):
            return 1.0
        return 1.0 / self.rope_factor

    @property
    def context_covered(self) -> int:
        """The longest context the file declares the model for: its training context, or, where it declares RoPE
        scaling, the original context times the factor when that is longer (a file may give the pre-scaling
        context_length)."""
        if self.rope_freq_scale == 1.0:
            return self.n_ctx_train
        return max(self.n_ctx_train, round(self.rope_orig_ctx * self.rope_factor))


def _swa_layers(g: GGUFModel, n_layers: int, window: int, default_pattern: int, full_first: bool) -> tuple[bool, ...]:
    """Which layers use the sliding window: an explicit per-layer list, or a period n where all but the last layer
    of every n use it (gpt-oss: n = 2, even layers slide), or with `full_first` all but the first (laguna); period 0
    means every layer."""
    if not window:
        return (False,) * n_layers
    pattern = g.get(ATT.SLIDING_WINDOW_PATTERN.format(arch=g.arch), default_pattern)
    if isinstance(pattern, list):
        return tuple(bool(p) for p in pattern[:n_layers])
    n = int(pattern)
    if full_first:
        return tuple(n == 0 or layer % n != 0 for layer in range(n_layers))
    return tuple(n == 0 or layer % n < n - 1 for layer in range(n_layers))
