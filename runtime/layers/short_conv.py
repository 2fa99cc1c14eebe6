"""LFM2's gated short convolution: a token mixer without attention, whose only memory is the last K - 1 rows of its
convolution input, kept per sequence.

Per token: in_proj gives three D-wide rows b, c and x; b * x runs through a causal depthwise convolution of K taps
per channel (the K - 1 rows before the step from the sequence's state, tap K - 1 on the current token); the result
is multiplied by c and projected by out_proj. A step whose first position is 0 starts its sequence anew.

Letters: T tokens, D channels, K taps.
"""

from __future__ import annotations

import torch
from torch import nn

from moerun.layers.delta_net import causal_conv
from moerun.layers.linear import Linear
from moerun.step import Step


class ShortConv(nn.Module):
    seq_on_host = True  # its state is indexed by step.seq as a number: no captured prompt steps
    keeps_history = True  # its state folds in every token it ran: a sequence goes on only where it stopped (Model)

    def __init__(self, *, in_proj: Linear, conv: torch.Tensor, out_proj: Linear, n_seq: int) -> None:
        """conv (D, K): tap K - 1 reads the current token."""
        super().__init__()
        self.in_proj, self.out_proj = in_proj, out_proj
        self.register_buffer("conv", conv.float(), persistent=False)
        D, K = conv.shape
        self.register_buffer("conv_state", torch.zeros(n_seq, K - 1, D, device=conv.device), persistent=False)

    def forward(self, x: torch.Tensor, step: Step, i8=None) -> torch.Tensor:
        """x (T, D), and its int8 rounding where its norm made one (for in_proj) -> (T, D)."""
        b, c, v = self.in_proj(x, i8).float().chunk(3, dim=-1)  # (T, D) each
        bx = b * v
        if step.seqs is None:
            mixed = self._segment(bx, step.seq, step.positions[0])
        else:  # tokens of several sequences: each one continues its own sequence's state
            mixed = torch.cat(
                [self._segment(bx[t : t + 1], step.seqs[t], step.positions[t]) for t in range(x.shape[0])]
            )
        return self.out_proj(c * mixed)

    def _segment(self, bx: torch.Tensor, seq: int | torch.Tensor, first_pos: torch.Tensor) -> torch.Tensor:
        """Consecutive tokens of one sequence: the convolution from its state, which keeps their last K - 1 rows."""
        keep = (first_pos != 0).float()  # position 0 starts the sequence anew
        rows = torch.cat([self.conv_state[seq] * keep, bx])  # (K - 1 + T, D)
        self.conv_state[seq] = rows[bx.shape[0] :]
        return causal_conv(rows, self.conv)
