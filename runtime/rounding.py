"""How llama.cpp's CPU backend rounds a matmul's input before its dot products, by the weight's GGUF type.

ggml converts the activations to the weight type's `vec_dot_type` first: F16 weights meet F16 activations,
block-quantized weights meet 8-bit blocks (Q8_0: 32 values and an F16 scale; Q8_K: 256 values and an F32 scale,
for the K-quants). Rounding our float32 inputs the same way makes near-tied routers and logits break the same way
llama.cpp breaks them; without it, quantized models pick a different expert at about 1% of (token, layer) pairs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from gguf import GGMLQuantizationType as Q

Rounding = Callable[[torch.Tensor], torch.Tensor]


def round_q8_0(x: torch.Tensor) -> torch.Tensor:
    """Blocks of 32 as int8 times an F16 scale amax / 127 (Q8_0, and Q8_1's values)."""
    blocks = x.float().unflatten(-1, (-1, 32))
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.round(blocks / torch.where(scale == 0, 1.0, scale))
    return (q * scale.half().float()).flatten(-2)


def round_q8_k(x: torch.Tensor) -> torch.Tensor:
    """Blocks of 256 scaled so that the value of largest magnitude maps to -127, clipped at 127 (Q8_K)."""
    blocks = x.float().unflatten(-1, (-1, 256))
    peak = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))  # signed value of largest magnitude
    safe_peak = torch.where(peak == 0, 1.0, peak)
    q = torch.round(blocks * (-127 / safe_peak)).clamp(max=127)
    return (q * torch.where(peak == 0, 0.0, -safe_peak / 127)).flatten(-2)


def _round_f16(x: torch.Tensor) -> torch.Tensor:
    return x.half().float()


def _round_bf16(x: torch.Tensor) -> torch.Tensor:
    return x.bfloat16().float()


K_QUANTS = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ1_S,
            Q.IQ1_M, Q.IQ4_XS, Q.TQ1_0, Q.TQ2_0)
Q8_0_FAMILY = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q8_1, Q.MXFP4, Q.NVFP4, Q.IQ4_NL)

# Weight type -> rounding of the matmul input; F32 weights take the input as it is.
INPUT_ROUNDING: dict[Q, Rounding] = {
    Q.F16: _round_f16,
    Q.BF16: _round_bf16,
    **{t: round_q8_0 for t in Q8_0_FAMILY},
    **{t: round_q8_k for t in K_QUANTS},
}


def input_rounding(ggml_type: Q) -> Rounding | None:
    return INPUT_ROUNDING.get(ggml_type)
