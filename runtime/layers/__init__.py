"""The torch modules every architecture file builds on: linear, norm, RoPE, attention, router, experts, blocks.

Letters in shape comments: T tokens in the step, S KV cache slots read (at most n_ctx), D hidden size, H query heads,
G KV heads, Dh head size, E experts, K experts per token, I expert hidden size, V vocabulary.

The residual stream is float32; each matmul runs in the weights' compute dtype (float32 on CPU, bfloat16 on CUDA)
after rounding its input as llama.cpp does for the stored weight type (kernels/rounding.py); norms, softmaxes, RoPE
and the router run in float32, as in llama.cpp.

Each module here is either the float32 reference or a GGUF-backed twin of one (gguf_gpu.py: Triton kernels on the
GGUF blocks; gguf_cpu.py: numba or ggml row dots on the memory-mapped bytes). Layers never choose: the backend
(backend.py) picks, once per device at build time, which Linear and which ExpertCompute a tensor gets and which
`Kernels` (ops.py) every layer runs its norms, RoPE, attention, routing and activations with.

The reference modules are importable from here; the twins, which need numba or Triton, from their own modules.
"""

from moerun.layers.attention import (
    Attention,
    OutputGate,
    attend,
    norm_rope,
    norm_rope_store,
    qk_norms_per_head,
)
from moerun.layers.block import Block, SandwichBlock
from moerun.layers.embedding import Embedding
from moerun.layers.ffn import (
    ACTIVATIONS,
    RELU_SQR,
    SWIGLU,
    Activation,
    FeedForward,
    UngatedFeedForward,
    geglu,
    reglu,
    situ,
    swiglu,
    swiglu_clamp,
    swiglu_limited,
    swiglu_oai,
)
from moerun.layers.linear import Linear
from moerun.layers.moe import ExpertCompute, GGUFExperts, HashRouter, LatentMoE, MoE, Router
from moerun.layers.norm import RMSNorm, add_rms_norm, rms_norm
from moerun.layers.ops import Kernels, device_of
from moerun.layers.reference import TORCH_KERNELS
from moerun.layers.rope import Rope, yarn_attn_factor

__all__ = [
    "ACTIVATIONS",
    "RELU_SQR",
    "SWIGLU",
    "TORCH_KERNELS",
    "UngatedFeedForward",
    "Activation",
    "Attention",
    "Block",
    "Embedding",
    "ExpertCompute",
    "FeedForward",
    "GGUFExperts",
    "HashRouter",
    "Kernels",
    "LatentMoE",
    "Linear",
    "MoE",
    "OutputGate",
    "RMSNorm",
    "SandwichBlock",
    "Rope",
    "Router",
    "add_rms_norm",
    "attend",
    "device_of",
    "geglu",
    "reglu",
    "norm_rope",
    "norm_rope_store",
    "qk_norms_per_head",
    "rms_norm",
    "situ",
    "swiglu",
    "swiglu_clamp",
    "swiglu_limited",
    "swiglu_oai",
    "yarn_attn_factor",
]
