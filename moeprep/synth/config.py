"""What a synthetic model looks like: one flat `SynthConfig`, built from a preset, the arch's rules and overrides.

Resolution order: the preset's values, then the caller's explicit values; then each architecture's derived
fields (its MLA ranks, its head size rule, its leading dense layers) for fields the caller did not set; then the
common defaults for fields nobody set. `resolve_config` validates the result, so a bad combination fails here with
a MoeprepError instead of inside llama.cpp.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gguf import GGMLQuantizationType

from moeprep.errors import MoeprepError
from moeprep.synth.context_routing import CONTEXT_REGIMES, MIN_EMBD, MIN_HEAD_DIM, MIN_KV_HEADS
from moeprep.synth.tokenizer import VOCAB_SIZE

Q = GGMLQuantizationType
# Weight types a synthetic model can be written in (F32/F16 for norms etc. are chosen separately).
SYNTH_TYPES: dict[str, GGMLQuantizationType] = {
    t.name: t for t in (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q6_K, Q.MXFP4)
}


@dataclass(frozen=True)
class SynthConfig:
    """Every size and option of a synthetic model; field names follow llama.cpp's hparams where one exists."""

    arch: str
    preset: str
    seed: int
    expert_type: GGMLQuantizationType  # routed experts (*_exps)
    attn_type: GGMLQuantizationType  # the always-resident matrices: attention, shared experts, dense FFN
    skew: float  # 0..1: how unevenly the router favours some experts (see moeprep/synth/weights.py)
    fast_random_blocks: bool  # quantized tensors as valid random blocks, no float weights at all
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int  # one routed expert's hidden width
    n_ff: int  # dense FFN width (leading dense layers; llama/olmoe: the experts' width)
    n_ctx: int  # context_length
    rope_freq_base: float
    rms_eps: float
    sliding_window: int  # gpt-oss: window of its sliding-window layers (every other layer, starting with 0)
    rope_dim: int  # rotated dimensions per head (partial rotary when < head_dim)
    n_expert_shared: int
    n_ff_shexp: int  # qwen2moe's shared expert width (deepseek2/glm4moe use n_ff_exp * n_expert_shared)
    n_dense_lead: int  # leading layers with a dense FFN instead of experts
    expert_weights_scale: float
    q_lora_rank: int  # deepseek2 MLA sizes
    kv_lora_rank: int
    qk_nope_dim: int
    qk_rope_dim: int
    v_head_dim: int
    mla_split: bool  # deepseek2: write attn_k_b/attn_v_b (absorbed MLA) instead of attn_kv_b
    yarn: bool  # shorthand for rope_scaling="yarn"
    # the rope.scaling keys written: "none", "linear" (factor ROPE_SCALING_FACTOR), "yarn" or "longrope" (that factor
    # over n_ctx / ROPE_SCALING_FACTOR original positions; longrope: step35 only, with its long and short divisors)
    rope_scaling: str
    n_vocab: int  # the shipped tokenizer's tokens, then padding tokens (real models have 150k-260k)
    routing: str  # a key of moeprep.synth.routing.ROUTINGS: "random", "token-id" or a routing regime's name
    tensor_types: tuple[tuple[str, GGMLQuantizationType], ...]  # (tensor base name, type) over the role's type

    @property
    def model_name(self) -> str:
        return f"synth-{self.arch}-{self.preset}"


Rule = Callable[[Mapping[str, Any]], Any]

# Geometry shared by every architecture; a preset may also set expert_type/attn_type defaults.
PRESETS: dict[str, dict[str, Any]] = {
    # Unit tests: writes in milliseconds; 3 layers so a leading dense layer still leaves two MoE layers.
    "tiny": dict(
        n_layer=3,
        n_embd=64,
        n_head=4,
        n_head_kv=2,
        head_dim=16,
        n_expert=16,
        n_expert_used=4,
        n_ff_exp=32,
        n_ff=128,
        n_ctx=2048,
        sliding_window=16,
        rope_freq_base=10000.0,
        expert_type="F16",
        attn_type="F16",
    ),
    # Every attention and expert row is a multiple of 256, so K-quants (Q4_K, Q6_K) apply to all of them.
    "small": dict(
        n_layer=4,
        n_embd=256,
        n_head=4,
        n_head_kv=2,
        head_dim=64,
        n_expert=16,
        n_expert_used=4,
        n_ff_exp=256,
        n_ff=512,
        n_ctx=4096,
        sliding_window=64,
        rope_freq_base=10000.0,
        expert_type="F16",
        attn_type="F16",
    ),
    # The shape of Qwen3-30B-A3B (about 17 GB at Q4_K), routed as the qwen3-30b regime; meant for
    # fast_random_blocks=True.
    "qwen3-30b-a3b": dict(
        n_layer=48,
        n_embd=2048,
        n_head=32,
        n_head_kv=4,
        head_dim=128,
        n_expert=128,
        n_expert_used=8,
        n_ff_exp=768,
        n_ff=6144,
        n_ctx=40960,
        sliding_window=128,
        rope_freq_base=1_000_000.0,
        expert_type="Q4_K",
        attn_type="Q4_K",
        routing="qwen3-30b",
    ),
    # The 60 GB benchmark shape (9.28 MiB per expert), routed as the qwen3-30b regime so an expert cache meets a
    # real model's reuse; meant for fast_random_blocks=True.
    "bench-60g": dict(
        n_layer=46,
        n_embd=4096,
        n_head=32,
        n_head_kv=4,
        head_dim=128,
        n_expert=128,
        n_expert_used=8,
        n_ff_exp=1408,
        n_ff=11264,
        n_ctx=32768,
        sliding_window=128,
        rope_freq_base=1_000_000.0,
        expert_type="Q4_K",
        attn_type="Q8_0",
        n_vocab=32000,
        tensor_types=(("ffn_down_exps", "Q4_0"), ("output", "Q8_0")),
        routing="qwen3-30b",
    ),
}

# Fields no preset sets: their values unless the architecture or the caller sets them.
COMMON_DEFAULTS: dict[str, Rule] = {
    "rms_eps": lambda g: 1e-6,
    "rope_dim": lambda g: g["head_dim"],
    "n_expert_shared": lambda g: 0,
    "n_ff_shexp": lambda g: 0,
    "n_dense_lead": lambda g: 0,
    "expert_weights_scale": lambda g: 1.0,
    "q_lora_rank": lambda g: 0,
    "kv_lora_rank": lambda g: 0,
    "qk_nope_dim": lambda g: 0,
    "qk_rope_dim": lambda g: 0,
    "v_head_dim": lambda g: 0,
    "mla_split": lambda g: False,
    "yarn": lambda g: False,
    "rope_scaling": lambda g: "yarn" if g["yarn"] else "none",
    "n_vocab": lambda g: VOCAB_SIZE,
    "routing": lambda g: "random",
    "tensor_types": lambda g: (),
}
# the keys of moeprep.synth.routing.ROUTINGS: uniform, the token-id lookup, the regimes the weights can be built for
ROUTING_KINDS = ("random", "token-id", *CONTEXT_REGIMES)
ROPE_SCALINGS = ("none", "linear", "yarn", "longrope")  # the rope.scaling.type values the writer can give a model
LONGROPE_ARCHS = ("step35",)  # those whose writer gives LongRoPE its rope_factors_long/short tensors
CONTEXT_ROUTING_ARCHS = ("qwen3moe",)  # regime routing needs per-head Q/K norms and whole-head NeoX rotary

GEOMETRY_FIELDS = tuple(
    f.name
    for f in dataclasses.fields(SynthConfig)
    if f.name not in ("arch", "preset", "seed", "skew", "fast_random_blocks")
)


def parse_type(name: str | GGMLQuantizationType, what: str) -> GGMLQuantizationType:
    key = name.name if isinstance(name, GGMLQuantizationType) else str(name).upper()
    if key not in SYNTH_TYPES:
        raise MoeprepError(f"{what} {name!r} is not supported; choose one of {', '.join(SYNTH_TYPES)}")
    return SYNTH_TYPES[key]


# (what must hold, what to tell the user) for every architecture.
CHECKS: tuple[tuple[Callable[[SynthConfig], bool], str], ...] = (
    (lambda c: min(c.n_layer, c.n_embd, c.n_head, c.n_head_kv, c.head_dim, c.n_ff_exp) > 0, "sizes must be positive"),
    (lambda c: 0 < c.n_expert_used <= c.n_expert, "need 0 < n_expert_used <= n_expert"),
    (lambda c: c.n_head % c.n_head_kv == 0, "n_head must be a multiple of n_head_kv"),
    (lambda c: c.rope_dim % 2 == 0 and c.rope_dim <= c.head_dim, "rope_dim must be even and at most head_dim"),
    (lambda c: c.n_dense_lead < c.n_layer, "n_dense_lead must leave at least one MoE layer"),
    (lambda c: 0.0 <= c.skew <= 1.0, "skew must be between 0 and 1"),
    (lambda c: c.n_embd >= 2, "n_embd must be at least 2 (channel 0 is the router's bias channel)"),
    (lambda c: c.n_vocab >= VOCAB_SIZE, f"n_vocab must be at least the tokenizer's {VOCAB_SIZE} tokens"),
    (lambda c: c.routing in ROUTING_KINDS, f"routing must be one of {', '.join(ROUTING_KINDS)}"),
    (lambda c: c.rope_scaling in ROPE_SCALINGS, f"rope_scaling must be one of {', '.join(ROPE_SCALINGS)}"),
    (lambda c: not c.yarn or c.rope_scaling == "yarn", "yarn=True is rope_scaling='yarn'; give one of them"),
    (
        lambda c: c.rope_scaling != "longrope" or c.arch in LONGROPE_ARCHS,
        f"rope_scaling='longrope' is written for {', '.join(LONGROPE_ARCHS)} only",
    ),
    (
        lambda c: c.routing not in CONTEXT_REGIMES or c.arch in CONTEXT_ROUTING_ARCHS,
        f"routing by a regime is built for {', '.join(CONTEXT_ROUTING_ARCHS)} only (random and token-id: any)",
    ),
    (
        lambda c: (
            c.routing not in CONTEXT_REGIMES
            or (c.n_embd >= MIN_EMBD and c.head_dim >= MIN_HEAD_DIM and c.n_head_kv >= MIN_KV_HEADS)
        ),
        f"routing by a regime needs n_embd of at least {MIN_EMBD}, head_dim of at least {MIN_HEAD_DIM} and "
        f"{MIN_KV_HEADS} or more kv heads (its subspaces and attention heads: moeprep/synth/context_routing.py)",
    ),
)


def resolve_config(
    arch: str,
    preset: str,
    derived: Mapping[str, Rule],
    explicit: Mapping[str, Any],
    arch_checks: tuple[tuple[Callable[[SynthConfig], bool], str], ...] = (),
) -> SynthConfig:
    """Preset + explicit values, then the arch's `derived` rules and COMMON_DEFAULTS for fields left unset."""
    if preset not in PRESETS:
        raise MoeprepError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    unknown = sorted(set(explicit) - set(GEOMETRY_FIELDS) - {"seed", "skew", "fast_random_blocks"})
    if unknown:
        raise MoeprepError(f"unknown synth option(s) {', '.join(unknown)}; valid: {', '.join(GEOMETRY_FIELDS)}")
    values: dict[str, Any] = {**PRESETS[preset], **explicit}
    for field, rule in derived.items():
        if field not in explicit:
            values[field] = rule(values)
    for field, rule in COMMON_DEFAULTS.items():
        values.setdefault(field, rule(values))
    values["expert_type"] = parse_type(values["expert_type"], "expert type")
    values["attn_type"] = parse_type(values["attn_type"], "attention type")
    values["tensor_types"] = tuple((base, parse_type(t, f"{base} type")) for base, t in values["tensor_types"])
    config = SynthConfig(arch=arch, preset=preset, **values)
    for holds, message in CHECKS + arch_checks:
        if not holds(config):
            raise MoeprepError(f"synthetic {arch} model: {message} (got {explicit_summary(config)})")
    return config


def explicit_summary(c: SynthConfig) -> str:
    return (
        f"n_layer={c.n_layer} n_embd={c.n_embd} n_head={c.n_head} n_head_kv={c.n_head_kv} "
        f"head_dim={c.head_dim} n_expert={c.n_expert} n_expert_used={c.n_expert_used} rope_dim={c.rope_dim} "
        f"n_dense_lead={c.n_dense_lead} skew={c.skew} n_vocab={c.n_vocab}"
    )
