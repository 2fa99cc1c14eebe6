"""gpt-oss: biases on every projection, per-head attention sinks, a sliding window on all but the last layer of
every `sliding_window_pattern` (default 2: the even layers), NeoX RoPE (YaRN in the released models, with its own
base on sliding layers); the router picks the top-k logits and softmaxes over those alone; experts use the
clamped SwiGLU (alpha 1.702, limit 7) with biases, usually stored as MXFP4."""

from __future__ import annotations

from moeprep.gguf.reader import GGUFModel
from moerun.config import GATING_SOFTMAX_WEIGHT, PLAIN_MOE, ModelArgs
from moerun.layers import Activation, Block
from moerun.models.base import BuildContext
from moerun.weights import FUSED_GATE_UP


def read_args(g: GGUFModel) -> ModelArgs:
    fixed = {**PLAIN_MOE, "expert_weights_norm": False, "rope_style": "neox", "gating": GATING_SOFTMAX_WEIGHT}
    fixed["output_required"] = True
    return ModelArgs.from_gguf(g, fixed=fixed, defaults={"swa_pattern": 2})


def build_block(ctx: BuildContext, layer: int) -> Block:
    args, p = ctx.args, f"blk.{layer}"
    # llama.cpp's gpt-oss loader requires these; the shared loaders read them where present
    experts = [f"{p}.{part}" for part in ("ffn_gate_exps", "ffn_up_exps", FUSED_GATE_UP)]
    ctx.require(
        f"{p}.attn_output.bias",
        f"{p}.attn_sinks.weight",
        f"{p}.ffn_gate_inp.bias",
        f"{p}.ffn_down_exps.bias",
        *(f"{name}.bias" for name in experts if f"{name}.weight" in ctx.weights),
    )
    rope = ctx.rope(base=args.rope_base_swa) if args.swa_layers[layer] else ctx.rope()
    attn = ctx.attention(layer, rope, scale=args.rope_dim**-0.5)
    moe = ctx.routed_experts(layer, activation=Activation("swiglu_oai"))
    return ctx.block(layer, attn, moe, ffn_norm="post_attention_norm")
