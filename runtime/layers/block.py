"""The pre-norm decoder block."""

from __future__ import annotations

import torch
from torch import nn

from moerun.layers.norm import RMSNorm
from moerun.step import Step


class Block(nn.Module):
    """Pre-norm decoder block: h = x + attn(norm(x)); out = h + ffn(norm(h)).

    The block hands on (h, ffn(norm(h))) and leaves the sum to whoever reads it next (the next block's attn_norm, or
    the final norm), whose fused add_rms_norm does it in the same kernel: one launch fewer per layer of a decode step.
    """

    def __init__(self, attn_norm: RMSNorm, attn: nn.Module, ffn_norm: RMSNorm, ffn: nn.Module) -> None:
        super().__init__()
        self.attn_norm, self.attn, self.ffn_norm, self.ffn = attn_norm, attn, ffn_norm, ffn

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream is x + delta (x alone where delta is None) -> (h, delta') whose sum is the output."""
        x, normed, i8 = self.attn_norm.add_forward_i8(x, delta)  # i8: normed's rounding for the products, or None
        h, normed, i8 = self.ffn_norm.add_forward_i8(x, self.attn(normed, step, i8))
        return h, self.ffn(normed, step, i8)


class SandwichBlock(Block):
    """A pre-norm block whose sublayer outputs are RMS-normalised again before they join the residual stream
    (post-norms, as in Gemma and AFMoE): h = x + attn_post_norm(attn(attn_norm(x)));
    out = h + ffn_post_norm(ffn(ffn_norm(h))), handed on as the pair (h, ffn_post_norm(...)) as in Block."""

    def __init__(
        self,
        attn_norm: RMSNorm,
        attn: nn.Module,
        attn_post_norm: RMSNorm,
        ffn_norm: RMSNorm,
        ffn: nn.Module,
        ffn_post_norm: RMSNorm,
    ) -> None:
        super().__init__(attn_norm, attn, ffn_norm, ffn)
        self.attn_post_norm, self.ffn_post_norm = attn_post_norm, ffn_post_norm

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        x, normed, i8 = self.attn_norm.add_forward_i8(x, delta)
        h, normed, i8 = self.ffn_norm.add_forward_i8(x, self.attn_post_norm(self.attn(normed, step, i8)))
        return h, self.ffn_post_norm(self.ffn(normed, step, i8))
