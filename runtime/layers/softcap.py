"""Logit soft-capping: cap * tanh(x / cap), which bounds the output head's logits to (-cap, cap) smoothly (Gemma's
final_logit_softcapping)."""

from __future__ import annotations

import torch
from torch import nn

from moerun.layers.linear import Linear


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap) in float32, in llama.cpp's order: scale by 1/cap, tanh, scale by cap."""
    return torch.tanh(x.float() * (1.0 / cap)) * cap


class SoftCappedHead(nn.Module):
    """An output head whose logits are soft-capped: the Linear's own call, then softcap."""

    def __init__(self, head: Linear, cap: float) -> None:
        super().__init__()
        self.head, self.cap = head, cap

    def forward(self, x: torch.Tensor, i8=None) -> torch.Tensor:
        """x (T, D), and its int8 rounding where its norm made one -> (T, V) float32 logits."""
        return softcap(self.head(x, i8), self.cap)
