"""The Mamba-2 mixer (Granite 4.0 hybrid, Nemotron-H): a selective state-space layer whose per-head state decays by
one factor per token and takes an outer-product write, read out by a per-token query.

Per token, ssm_in gives z (d_inner), then xBC (d_inner + 2 G N: the input x, then B and C of every group), then dt
(H). xBC runs through a short causal convolution (its last K - 1 rows kept per sequence), its bias, and SiLU. Head h
(of H, each P = d_inner / H channels wide) reads group g = h // (H / G) of B and C (N each). With
dt_h = softplus(dt + dt_bias), the head's state S (P, N) goes

    S <- exp(dt_h A_h) S + dt_h x_h B_g^T,        y_h = S C_g + D_h x_h

(A_h < 0: the file stores -exp(A_log)). The output y * silu(z) is RMS-normed within each of the G groups of
d_inner / G channels (ssm_norm), then projected out by ssm_out.

The scan is linear in the state, so a step of several tokens runs it in chunks (`ssd_chunked`): within a chunk the
outputs are one masked matrix product of C against B weighted by the decays between the tokens, plus the carried
state read through C; the state moves on once per chunk. A single token (decode) takes the recurrence once
(`ssd_recurrent`, also the reference the chunked form is tested against). Both run in float64: the state's long
memory otherwise lets a prompt's chunked prefill and its token-by-token decode drift apart.

The states live in the module, per sequence, beside the KV caches of the attention layers (as the gated delta net's,
layers/delta_net.py); a step whose first position is 0 starts its sequence anew.

Letters: T tokens, H heads, P head channels, G groups, N state size, C convolution channels, K its kernel size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moerun.layers.delta_net import causal_conv
from moerun.layers.linear import Linear
from moerun.layers.norm import rms_norm
from moerun.step import Step

CHUNK = 64  # prefill tokens per chunk of the scan


def ssd_recurrent(
    x: torch.Tensor, log_decay: torch.Tensor, B: torch.Tensor, C: torch.Tensor, S: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan token by token: x (T, H, P) already scaled by dt, log_decay (T, H) = dt A <= 0, B and C (T, H, N) per
    head, state S (H, P, N) -> outputs S_t C_t (T, H, P) and the last state."""
    out = torch.empty_like(x)
    for t in range(x.shape[0]):
        S = S * log_decay[t].exp()[:, None, None] + x[t, :, :, None] * B[t, :, None, :]
        out[t] = torch.einsum("hpn,hn->hp", S, C[t])
    return out, S


def ssd_chunked(
    x: torch.Tensor, log_decay: torch.Tensor, B: torch.Tensor, C: torch.Tensor, S: torch.Tensor, chunk: int = CHUNK
) -> tuple[torch.Tensor, torch.Tensor]:
    """ssd_recurrent's result, a chunk of tokens at a time. Within a chunk, with c_t the cumulative log-decay up to
    and including token t: y_t = exp(c_t) S C_t + sum_{s <= t} exp(c_t - c_s) (C_t . B_s) x_s, and the state after
    it exp(c_last) S + sum_s exp(c_last - c_s) x_s B_s^T."""
    outs = []
    for a in range(0, x.shape[0], chunk):
        xc, Bc, Cc = x[a : a + chunk], B[a : a + chunk], C[a : a + chunk]
        cum = log_decay[a : a + chunk].cumsum(0)  # (L, H)
        L = cum.shape[0]
        causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
        gaps = (cum[:, None, :] - cum[None, :, :]).masked_fill(~causal[:, :, None], float("-inf"))  # (t, s, H)
        weights = torch.einsum("thn,shn->hts", Cc, Bc) * gaps.permute(2, 0, 1).exp()  # (H, t, s)
        within = torch.einsum("hts,shp->thp", weights, xc)
        carried = torch.einsum("hpn,thn->thp", S, Cc) * cum.exp()[:, :, None]
        outs.append(within + carried)
        to_end = (cum[-1][None, :] - cum).exp()  # (L, H): decay from each token to the chunk's end
        S = S * cum[-1].exp()[:, None, None] + torch.einsum("sh,shp,shn->hpn", to_end, xc, Bc)
    return torch.cat(outs), S


class Mamba2(nn.Module):
    seq_on_host = True  # its recurrent state is indexed by step.seq as a number: no captured prompt steps
    keeps_history = True  # its state folds in every token it ran: a sequence goes on only where it stopped (Model)

    def __init__(
        self,
        *,
        in_proj: Linear,
        conv: torch.Tensor,
        conv_bias: torch.Tensor | None,
        dt_bias: torch.Tensor,
        A: torch.Tensor,
        D: torch.Tensor,
        norm: torch.Tensor,
        out: Linear,
        n_heads: int,
        n_groups: int,
        state_size: int,
        inner_size: int,
        eps: float,
        n_seq: int,
    ) -> None:
        """conv (C, K) with C = d_inner + 2 G N; dt_bias, A, D (H,); norm (d_inner,) the grouped norm's weight."""
        super().__init__()
        self.in_proj, self.out = in_proj, out
        self.H, self.G, self.N, self.d_inner, self.eps = n_heads, n_groups, state_size, inner_size, eps
        self.P = inner_size // n_heads
        device = dt_bias.device
        C, K = conv.shape
        bias = conv_bias if conv_bias is not None else torch.zeros(C, device=device)
        self.register_buffer("conv", conv.float(), persistent=False)
        for name, value in (("conv_bias", bias), ("dt_bias", dt_bias), ("A", A), ("D", D)):
            self.register_buffer(name, value.float().reshape(-1), persistent=False)
        self.register_buffer("norm", norm.float().reshape(n_groups, -1), persistent=False)  # (G, d_inner / G)
        self.register_buffer("conv_state", torch.zeros(n_seq, K - 1, C, device=device), persistent=False)
        self.register_buffer(
            "state",
            torch.zeros(n_seq, n_heads, self.P, state_size, dtype=torch.float64, device=device),
            persistent=False,
        )

    def forward(self, x: torch.Tensor, step: Step, i8=None) -> torch.Tensor:
        """x (T, D), and its int8 rounding where its norm made one (for ssm_in) -> (T, D)."""
        T = x.shape[0]
        z, xBC, dt = self.in_proj(x, i8).float().split([self.d_inner, self.d_inner + 2 * self.G * self.N, self.H], -1)
        if step.seqs is None:
            y = self._segment(xBC, dt, step.seq, step.positions[0])
        else:  # tokens of several sequences: each one continues its own sequence's state
            y = torch.cat(
                [self._segment(xBC[t : t + 1], dt[t : t + 1], step.seqs[t], step.positions[t]) for t in range(T)]
            )
        gated = (y * F.silu(z)).view(T, self.G, -1)
        return self.out(rms_norm(gated, self.norm, self.eps).reshape(T, self.d_inner))

    def _segment(
        self, xBC: torch.Tensor, dt: torch.Tensor, seq: int | torch.Tensor, first_pos: torch.Tensor
    ) -> torch.Tensor:
        """Consecutive tokens of one sequence: convolution and scan from its state -> y + D x (T, d_inner)."""
        T, H, P, G, N = xBC.shape[0], self.H, self.P, self.G, self.N
        keep = (first_pos != 0).float()  # position 0 starts the sequence anew
        rows = torch.cat([self.conv_state[seq] * keep, xBC])  # (K - 1 + T, C)
        self.conv_state[seq] = rows[T:]
        mixed = F.silu(causal_conv(rows, self.conv) + self.conv_bias)  # (T, C)
        xs, B, C = mixed.split([self.d_inner, G * N, G * N], dim=-1)
        xs = xs.view(T, H, P)
        B = B.view(T, G, N).repeat_interleave(H // G, dim=1)  # head h reads group h // (H / G)
        C = C.view(T, G, N).repeat_interleave(H // G, dim=1)
        dt = F.softplus(dt + self.dt_bias).double()  # (T, H)
        S = self.state[seq] * keep.double()
        y, self.state[seq] = (ssd_recurrent if T == 1 else ssd_chunked)(
            xs.double() * dt[:, :, None], dt * self.A.double(), B.double(), C.double(), S
        )
        return (y.float() + xs * self.D[:, None]).reshape(T, self.d_inner)
