"""The gated delta net (Qwen3-Next, Qwen3.5/3.6-MoE): a linear-attention layer whose per-head state takes delta-rule
writes (layers/delta_rule.py) and decays by one factor per head and token.

Per token: the projections give a row of 2 Dk Hk + Dv Hv channels (q, k and v of every head, in that order), an
output gate z (Hv Dv), and per value head a write strength logit b and a decay logit a. The row runs through a short
causal convolution (its last K - 1 rows kept per sequence) and SiLU; q and k are L2-normalised per head, q is scaled
by 1/sqrt(Dk); value head h reads key head h mod Hk (llama.cpp's qwen35moe tiles the key heads) or, with
`grouped_heads`, key head h // (Hv / Hk) (its qwen3next repeats each in place). The decay is
exp(softplus(a + dt_bias) * A) with A = -exp(A_log) < 0, the write strength sigmoid(b). The output is RMS-normed per
head, multiplied by silu(z) and projected out. The state lives in the module, per sequence; a step whose first
position is 0 starts its sequence anew. A step of several tokens runs the delta rule in chunks (prefill), a single
token step by step (decode).

Letters: T tokens, Hk key heads, Hv value heads, Dk/Dv their sizes, C convolution channels, K its kernel size.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from moerun.layers.delta_rule import delta_rule_chunked, delta_rule_recurrent
from moerun.layers.linear import Linear
from moerun.layers.norm import RMSNorm
from moerun.step import Step


def l2_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last axis (llama.cpp's delta-net q/k norm)."""
    return x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def causal_conv(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """rows (K - 1 + T, C), the K - 1 before the step first; weight (C, K), tap K - 1 on the current token -> (T, C)."""
    return (rows.unfold(0, weight.shape[1], 1) * weight).sum(-1)


class GatedDeltaNet(nn.Module):
    seq_on_host = True  # its recurrent state is indexed by step.seq as a number: no captured prompt steps
    keeps_history = True  # its state folds in every token it ran: a sequence goes on only where it stopped (Model)

    def __init__(
        self,
        *,
        project: nn.Module,
        conv: torch.Tensor,
        dt_bias: torch.Tensor,
        A: torch.Tensor,
        norm: RMSNorm,
        out: Linear,
        n_k_heads: int,
        n_v_heads: int,
        k_dim: int,
        v_dim: int,
        eps: float,
        n_seq: int,
        grouped_heads: bool = False,
    ) -> None:
        """`project` maps x (T, D) to (qkv (T, C), z (T, Hv Dv), b (T, Hv), a (T, Hv)) in the layout above."""
        super().__init__()
        self.project, self.norm, self.out = project, norm, out
        self.Hk, self.Hv, self.Dk, self.Dv, self.eps = n_k_heads, n_v_heads, k_dim, v_dim, eps
        self.grouped_heads = grouped_heads
        device = dt_bias.device
        self.register_buffer("conv", conv.float(), persistent=False)  # (C, K)
        self.register_buffer("dt_bias", dt_bias.float(), persistent=False)  # (Hv,)
        self.register_buffer("A", A.float(), persistent=False)  # (Hv,)
        C, K = conv.shape
        self.register_buffer("conv_state", torch.zeros(n_seq, K - 1, C, device=device), persistent=False)
        self.register_buffer("state", torch.zeros(n_seq, n_v_heads, k_dim, v_dim, device=device), persistent=False)

    def forward(self, x: torch.Tensor, step: Step, i8=None) -> torch.Tensor:
        # i8: the norm's int8 rounding of x, unused here: its products round x themselves
        T = x.shape[0]
        qkv, z, b, a = self.project(x)
        g = F.softplus(a.float() + self.dt_bias) * self.A  # (T, Hv) log-decay, <= 0
        beta = torch.sigmoid(b.float())  # (T, Hv)
        if step.seqs is None:
            out = self._segment(qkv.float(), g, beta, step.seq, step.positions[0])
        else:  # tokens of several sequences: each one continues its own sequence's state
            out = torch.cat(
                [
                    self._segment(
                        qkv[t : t + 1].float(), g[t : t + 1], beta[t : t + 1], step.seqs[t], step.positions[t]
                    )
                    for t in range(T)
                ]
            )
        gated = self.norm(out) * F.silu(z.float()).view(T, self.Hv, self.Dv)
        return self.out(gated.reshape(T, self.Hv * self.Dv))

    def _segment(
        self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, seq: int | torch.Tensor, first_pos: torch.Tensor
    ) -> torch.Tensor:
        """Consecutive tokens of one sequence: convolution and delta rule from its state -> (T, Hv, Dv)."""
        T, Hk, Hv, Dk, Dv = qkv.shape[0], self.Hk, self.Hv, self.Dk, self.Dv
        keep = (first_pos != 0).float()  # position 0 starts the sequence anew
        rows = torch.cat([self.conv_state[seq] * keep, qkv])  # (K - 1 + T, C)
        self.conv_state[seq] = rows[T:]
        mixed = F.silu(causal_conv(rows, self.conv))  # (T, C)
        q, k, v = mixed.split([Hk * Dk, Hk * Dk, Hv * Dv], dim=-1)
        q = l2_normalize(q.view(T, Hk, Dk), self.eps) / math.sqrt(Dk)
        k = l2_normalize(k.view(T, Hk, Dk), self.eps)
        if self.grouped_heads:  # value head h reads key head h // (Hv / Hk)
            q, k = q.repeat_interleave(Hv // Hk, dim=1), k.repeat_interleave(Hv // Hk, dim=1)
        else:  # value head h reads key head h mod Hk
            q, k = q.repeat(1, Hv // Hk, 1), k.repeat(1, Hv // Hk, 1)
        decay = g[:, :, None].expand(T, Hv, Dk)  # one decay per head, on every key channel
        S = self.state[seq] * keep  # (Hv, Dk, Dv)
        # In float64: in float32 a prompt's chunked prefill and its token-by-token decode drift apart by ~1e-4 of the
        # logits' range through the state's long memory; the rule is a small share of a step's work.
        out, self.state[seq] = (delta_rule_recurrent if T == 1 else delta_rule_chunked)(
            q.double(), k.double(), v.reshape(T, Hv, Dv).double(), decay.double(), beta.double(), S.double()
        )
        return out.float()
