"""How llama.cpp's CPU backend rounds a matmul's input before its dot products, by the weight's GGUF type.

ggml converts the activations to the weight type's `vec_dot_type` first: F16 weights meet F16 activations,
block-quantized weights meet 8-bit blocks (Q8_0: 32 values and an F16 scale; Q8_K: 256 values and an F32 scale,
for the K-quants). Rounding our float32 inputs the same way makes near-tied routers and logits break the same way
llama.cpp breaks them; without it, quantized models pick a different expert at about 1% of (token, layer) pairs.

Each 8-bit rounding is written twice with the same float32 operations in the same order: in torch (any device), and
as a numba kernel (`q8_0_blocks`, `q8_k_blocks`) that runs on CPU tensors in one pass instead of about ten torch
ops, and that also hands the 8-bit values and scales to the CPU expert kernels' integer dot products (kernels/cpu/). The two
agree bit for bit (tests/runtime/test_cpu_experts.py); the comments on the torch versions name the operations the
kernels reproduce.
"""

from __future__ import annotations

from collections.abc import Callable

import numba
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from moeprep.quant.jit import F32, JIT
from moeprep.quant.scalars import fp16_bits, fp16_value

Rounding = Callable[[torch.Tensor], torch.Tensor]


def _round_q8_0_torch(x: torch.Tensor) -> torch.Tensor:
    blocks = x.float().unflatten(-1, (-1, 32))
    scale = blocks.abs().amax(-1, keepdim=True) / 127  # a float32 division
    q = torch.round(blocks / torch.where(scale == 0, 1.0, scale))  # division, then round half to even
    return (q * scale.half().float()).flatten(-2)


def _round_q8_k_torch(x: torch.Tensor) -> torch.Tensor:
    blocks = x.float().unflatten(-1, (-1, 256))
    peak = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))  # signed value of largest magnitude (the first)
    safe_peak = torch.where(peak == 0, 1.0, peak)
    # `-127 / tensor` is torch's __rdiv__: reciprocal(tensor) * -127, two roundings
    q = torch.round(blocks * (-127 / safe_peak)).clamp(max=127)
    return (q * torch.where(peak == 0, 0.0, -safe_peak / 127)).flatten(-2)


@numba.njit(**JIT)
def q8_0_blocks(x: np.ndarray, q: np.ndarray, d: np.ndarray) -> None:
    """One row x (n,) float32 as Q8_0 blocks of 32: q (n,) values (int8, or float32 keeping the sign of a zero as
    torch does) and d (n/32,) float32 scales, the F16 scale read back (value = q * d)."""
    for b in range(x.shape[0] // 32):
        amax = F32(0)
        for i in range(b * 32, b * 32 + 32):
            amax = max(amax, abs(x[i]))
        scale = amax / F32(127)
        div = scale if scale != F32(0) else F32(1)
        for i in range(b * 32, b * 32 + 32):
            q[i] = np.rint(x[i] / div)  # stored as q's type: int8 for the kernels, float32 to round
        d[b] = fp16_value(fp16_bits(scale))


@numba.njit(**JIT)
def q8_k_blocks(x: np.ndarray, q: np.ndarray, d: np.ndarray) -> None:
    """One row x (n,) float32 as Q8_K blocks of 256: q (n,) values (int8 or float32, as in q8_0_blocks) and d
    (n/256,) float32 scales (value = q * d); the value of largest magnitude maps to -127."""
    for b in range(x.shape[0] // 256):
        peak, amax = F32(0), F32(0)
        for i in range(b * 256, b * 256 + 256):
            if abs(x[i]) > amax:
                amax, peak = abs(x[i]), x[i]
        safe_peak = peak if peak != F32(0) else F32(1)
        iscale = (F32(1) / safe_peak) * F32(-127)
        for i in range(b * 256, b * 256 + 256):
            q[i] = min(np.rint(x[i] * iscale), F32(127))
        d[b] = -safe_peak / F32(127) if peak != F32(0) else F32(0)


# One kernel for both roundings, not one closure per rounding: numba keys a closure's cache entry on a pickle of the
# kernels it closes over, which carries an id fresh in every process, so each process compiled the closure again
# (0.6 s) and left one more file in the cache.
@numba.njit(**JIT)
def _round_rows(x: np.ndarray, out: np.ndarray, block: int) -> None:
    """Every row of x (R, n) rounded into out (R, n): Q8_0 blocks where block is 32, else Q8_K (256)."""
    n = x.shape[1]
    q = np.empty(n, F32)
    d = np.empty(n // block, F32)
    for r in range(x.shape[0]):
        if block == 32:
            q8_0_blocks(x[r], q, d)
        else:
            q8_k_blocks(x[r], q, d)
        for i in range(n):
            out[r, i] = q[i] * d[i // block]


def _on_cpu(torch_version: Rounding, block: int) -> Rounding:
    """The rounding: _round_rows for CPU tensors (one pass), `torch_version` elsewhere."""

    def rounding(x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":
            return torch_version(x)
        rows = x.float().reshape(-1, x.shape[-1]).contiguous()
        out = torch.empty_like(rows)
        _round_rows(rows.numpy(), out.numpy(), block)
        return out.view(x.shape)

    return rounding


round_q8_0 = _on_cpu(_round_q8_0_torch, 32)
round_q8_0.__doc__ = "Blocks of 32 as int8 times an F16 scale amax / 127 (Q8_0, and Q8_1's values)."
round_q8_k = _on_cpu(_round_q8_k_torch, 256)
round_q8_k.__doc__ = "Blocks of 256 scaled so that the value of largest magnitude maps to -127, clipped at 127 (Q8_K)."


def _round_f16(x: torch.Tensor) -> torch.Tensor:
    return x.half().float()


def _round_bf16(x: torch.Tensor) -> torch.Tensor:
    return x.bfloat16().float()


K_QUANTS = (
    Q.Q2_K,
    Q.Q3_K,
    Q.Q4_K,
    Q.Q5_K,
    Q.Q6_K,
    Q.IQ2_XXS,
    Q.IQ2_XS,
    Q.IQ2_S,
    Q.IQ3_XXS,
    Q.IQ3_S,
    Q.IQ1_S,
    Q.IQ1_M,
    Q.IQ4_XS,
    Q.TQ1_0,
    Q.TQ2_0,
)
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
