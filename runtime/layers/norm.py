"""RMSNorm, and the residual add fused before it (the torch reference of the Kernels' rms_norm/add_rms_norm)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from moerun.layers.ops import Kernels
from moerun.weights import Weights

if TYPE_CHECKING:  # Triton's, which only CUDA builds of torch bring
    from moerun.kernels.act_i8 import QAct
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS normalisation over the last axis without a weight (ggml_rms_norm), float32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def add_rms_norm(
    x: torch.Tensor,
    delta: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream plus a layer's output, and its norm: (x + delta, rms_norm(x + delta))."""
    h = x + delta
    return h, rms_norm(h, weight, eps)


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float, kernels: Kernels) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.float(), requires_grad=False)
        self.eps, self.kernels = eps, kernels

    @classmethod
    def load(cls, w: Weights, name: str, eps: float, kernels: Kernels) -> RMSNorm:
        return cls(w.dense(name, torch.float32), eps, kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, its norm): x, delta (T, D) float32; (x, its norm) where delta is None."""
        if delta is None:
            return x, self.forward(x)
        return self.kernels.add_rms_norm(x, delta, self.weight, self.eps)

    def add_forward_i8(
        self,
        x: torch.Tensor,
        delta: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, QAct | None]:
        """add_forward for a norm whose output products read: also that output's int8 rounding where the kernels
        make it in the same pass (None: the products round it themselves)."""
        if self.kernels.add_rms_norm_i8 is None:
            return (*self.add_forward(x, delta), None)
        return self.kernels.add_rms_norm_i8(x, delta, self.weight, self.eps)
