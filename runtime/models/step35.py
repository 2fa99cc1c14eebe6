"""StepFun's Step-3.5 (Step-3.5-Flash), as llama.cpp's step35 graph (src/models/step35.cpp) computes it.

Sliding-window and full-attention layers by the file's per-layer sliding_window_pattern, each kind with its own
query head count (head_count is a per-layer array: 96 sliding, 64 full in Step-3.5-Flash) and RoPE: NeoX over the
whole rope.dimension_count (or rope.dimension_count_swa) on the sliding layers with base freq_base_swa (10000
without it), over half of it on the full layers with the file's base and, where the file has rope_freqs, its
first divisors. Per-head Q/K RMSNorm; each head's output multiplied by sigmoid(attn_gate x) before attn_output.

Context scaling (rope.scaling.type) as llama.cpp applies it to step35: linear and YaRN scale the full layers'
positions by the file's factor (YaRN blending per channel pair, with llama.cpp's beta_fast 32 and beta_slow 1 and
no log multiplier: config.py); LongRoPE does the same linearly and takes the full layers' divisors from
rope_factors_long when a sequence's context exceeds the original one, else from rope_factors_short. The sliding
layers keep their positions unscaled (llama.cpp has no sliding-layer factor for step35) but share the magnitude
factor of the model's rope op, rope.scaling.attn_factor included.

A layer without a router (ffn_gate_inp) has a dense SwiGLU FFN; the others route with the file's gating function
(sigmoid without one), exp_probs_b, renormalised and scaled as the file's keys say, beside a shared expert. Where
swiglu_clamp_exp / swiglu_clamp_shexp give a layer a limit above zero, its routed experts / its shared expert and
dense FFN use the clamped SwiGLU (layers.ffn.swiglu_limited). The file's NextN (multi-token prediction) blocks are
not run."""

from __future__ import annotations

import math

from moeprep.errors import MoeprepError
from moeprep.gguf.reader import GGUFModel
from moerun.config import GATING_SIGMOID, ModelArgs
from moerun.layers import SWIGLU, Activation, Block, MoE, yarn_attn_factor
from moerun.models.base import BuildContext

CLAMP_EPS = 1e-6  # a limit at or below it is no clamp (llama.cpp's test)
SWA_ROPE_BASE = 10000.0  # llama.cpp's base for the sliding layers when the file has no freq_base_swa


def read_args(g: GGUFModel) -> ModelArgs:
    names = {t.name for t in g.tensors}
    n_blocks = int(g.get(f"{g.arch}.block_count", 0)) - int(g.get(f"{g.arch}.nextn_predict_layers", 0))
    dense = 0  # the leading layers without a router
    while dense < n_blocks and f"blk.{dense}.ffn_gate_inp.weight" not in names:
        dense += 1
    args = ModelArgs.from_gguf(
        g,
        fixed={"rope_style": "neox", "n_dense_lead": dense, "output_required": True},
        defaults={"gating": GATING_SIGMOID, "rope_base_swa": SWA_ROPE_BASE},
        kv_heads_vary=True,
        heads_vary=True,
    )
    if args.rope_dim % 4:
        raise MoeprepError(f"{g.path}: step35's full layers rotate half of rope.dimension_count ({args.rope_dim})")
    pattern = g.get(f"{g.arch}.attention.sliding_window_pattern")
    if not args.sliding_window or not isinstance(pattern, list) or len(pattern) < args.n_layers:
        # llama.cpp's step35 loader requires both as well
        raise MoeprepError(
            f"{g.path}: step35 needs attention.sliding_window and a per-layer attention.sliding_window_pattern"
        )
    return args


def per_layer(g: GGUFModel, name: str, n_layers: int) -> tuple[float, ...]:
    """Metadata key `name` of g's architecture as one value per layer: its array, or its one value for every layer,
    or 0 where the file has no such key."""
    value = g.get(f"{g.arch}.{name}", 0.0)
    return tuple(float(v) for v in value[:n_layers]) if isinstance(value, list) else (float(value),) * n_layers


def full_layer_divisors(ctx: BuildContext) -> str | None:
    """The tensor of frequency divisors the full layers read, as llama.cpp picks it: rope_freqs; with LongRoPE,
    rope_factors_long when a sequence's context (ctx.n_ctx) exceeds the original one, else rope_factors_short;
    None where the file has not that tensor."""
    name = "rope_freqs.weight"
    if ctx.args.rope_scaling == "longrope":
        name = "rope_factors_long.weight" if ctx.n_ctx > ctx.args.rope_orig_ctx else "rope_factors_short.weight"
    return name if name in ctx.weights else None


def swiglu(limit: float) -> Activation:
    return Activation("swiglu_limited", limit) if limit > CLAMP_EPS else SWIGLU


def build_block(ctx: BuildContext, layer: int) -> Block:
    a, w, p = ctx.args, ctx.weights, f"blk.{layer}"
    g = w.gguf
    sliding = a.swa_layers[layer]
    if sliding:  # positions unscaled, the magnitude factor of every layer's rope op
        rope = ctx.rope(base=a.rope_base_swa, dim=a.rope_dim_swa, scaled=False, attn_factor=yarn_attn_factor(a))
    else:
        rope = ctx.rope(dim=a.rope_dim // 2, freq_factors=full_layer_divisors(ctx))
    gate = ctx.output_gate(layer, "sigmoid") if f"{p}.attn_gate.weight" in w else None  # one value per head
    attn = ctx.attention(layer, rope, scale=1.0 / math.sqrt(a.head_dim), gate=gate)
    shared = swiglu(per_layer(g, "swiglu_clamp_shexp", a.n_layers)[layer])  # the dense FFN's and the shared expert's
    if f"{p}.ffn_gate_inp.weight" not in w:
        return ctx.block(layer, attn, ctx.feed_forward(layer, activation=shared))
    routed = swiglu(per_layer(g, "swiglu_clamp_exp", a.n_layers)[layer])
    moe = MoE(
        layer,
        ctx.router(layer),
        ctx.experts(layer, routed),
        ctx.hooks,
        shared=ctx.feed_forward(layer, "_shexp", shared),
    )
    return ctx.block(layer, attn, moe)
