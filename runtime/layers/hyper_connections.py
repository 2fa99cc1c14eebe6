"""Hyper-connections (GLM-5.3-Flash, DeepSeek-V4): the residual is N streams (T, N, D) instead of one.

The first block copies the embedding into all N streams. Before the attention and before the FFN, a mixing site
(hc_attn_* / hc_ffn_*) reads the RMS-normed streams (all N D values of a token) through fn and gives per token: N
`pre` weights that sum the streams into the sublayer's input, N `post` weights for the sublayer's output in each
stream, and an N x N stream mixing matrix made doubly stochastic by Sinkhorn iterations: stream d out = post_d y +
sum_s comb[s, d] stream s. The last block returns the streams' mean (glm5-next) or DeepSeek-V4's head mix (HyperHead)
for the final norm.
"""

from __future__ import annotations

import torch
from torch import nn

from moerun.hooks import Hooks
from moerun.layers.linear import Linear
from moerun.layers.norm import RMSNorm
from moerun.step import Step
from moerun.weights import Weights


class HyperConnection(nn.Module):
    """One mixing site (hc_attn_* or hc_ffn_*): streams (T, N, D) -> the sublayer input, then the new streams."""

    def __init__(
        self, fn: Linear, base: torch.Tensor, scale: torch.Tensor, n: int, norm_eps: float, eps: float, iterations: int
    ) -> None:
        super().__init__()
        self.fn, self.n, self.norm_eps, self.eps, self.iterations = fn, n, norm_eps, eps, iterations
        self.register_buffer("base", base, persistent=False)  # (N (2 + N),): pre, post, then the N x N mixing
        self.register_buffer("scale", scale, persistent=False)  # (3,)

    @classmethod
    def load(
        cls, w: Weights, hooks: Hooks, prefix: str, n: int, norm_eps: float, eps: float, iterations: int
    ) -> HyperConnection:
        """`prefix`_fn, _base and _scale (blk.N.hc_attn, blk.N.hc_ffn); n streams, the RMS epsilon of the model, the
        hyper-connections' own epsilon and Sinkhorn iterations."""
        return cls(
            Linear.load(w, f"{prefix}_fn", hooks, torch.float32),
            w.dense(f"{prefix}_base.weight", torch.float32),
            w.dense(f"{prefix}_scale.weight", torch.float32),
            n,
            norm_eps,
            eps,
            iterations,
        )

    def split(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams (T, N, D) -> sublayer input (T, D), post weights (T, N), mixing comb (T, N src, N dst)."""
        T, N, D = streams.shape
        flat = streams.reshape(T, N * D)
        mixes = self.fn(flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + self.norm_eps))  # (T, N (2 + N))
        pre = torch.sigmoid(mixes[:, :N] * self.scale[0] + self.base[:N]) + self.eps
        post = 2 * torch.sigmoid(mixes[:, N : 2 * N] * self.scale[1] + self.base[N : 2 * N])
        comb = (mixes[:, 2 * N :] * self.scale[2] + self.base[2 * N :]).view(T, N, N)  # [t, src, dst]
        return (streams * pre[:, :, None]).sum(1), post, self._sinkhorn(comb)

    def _sinkhorn(self, logits: torch.Tensor) -> torch.Tensor:
        """Softmax over destinations, then alternately columns (over sources) and rows normalised to 1."""
        comb = torch.softmax(logits, dim=-1) + self.eps
        comb = comb / (comb.sum(1, keepdim=True) + self.eps)
        for _ in range(self.iterations - 1):
            comb = comb / (comb.sum(2, keepdim=True) + self.eps)
            comb = comb / (comb.sum(1, keepdim=True) + self.eps)
        return comb

    @staticmethod
    def merge(y: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """Stream d: post_d y + sum_s comb[s, d] stream_s -> (T, N, D)."""
        return post[:, :, None] * y[:, None, :] + torch.einsum("tsd,tse->tde", comb, streams)


class HyperBlock(nn.Module):
    """hc_attn -> attn_norm -> attention -> hc_attn merge, then the same around ffn_norm and the FFN."""

    def __init__(
        self,
        hc_attn: HyperConnection,
        attn_norm: RMSNorm,
        attn: nn.Module,
        hc_ffn: HyperConnection,
        ffn_norm: RMSNorm,
        ffn: nn.Module,
        first: bool,
        last: bool,
        head: nn.Module | None = None,
    ) -> None:
        """`head`: what the last block returns of its streams (T, N, D) -> (T, D): their mean without one,
        DeepSeek-V4's weighted sum (its output_hc_*) with one."""
        super().__init__()
        self.hc_attn, self.attn_norm, self.attn = hc_attn, attn_norm, attn
        self.hc_ffn, self.ffn_norm, self.ffn = hc_ffn, ffn_norm, ffn
        self.first, self.last, self.head = first, last, head

    def forward(self, x: torch.Tensor, delta: None, step: Step) -> tuple[torch.Tensor, None]:
        """x (T, D) for the first block, else (T, N, D) -> (T, N, D), or their mean (T, D) (or the head's mix) from
        the last block. The merges sum their streams themselves: no pending delta (layers.Block's) comes in or goes
        out."""
        assert delta is None
        streams = x[:, None, :].expand(-1, self.hc_attn.n, -1) if self.first else x
        h, post, comb = self.hc_attn.split(streams)
        streams = self.hc_attn.merge(self.attn(self.attn_norm(h), step), streams, post, comb)
        h, post, comb = self.hc_ffn.split(streams)
        _, normed, i8 = self.ffn_norm.add_forward_i8(h, None)  # i8: normed's rounding for the FFN's products, or None
        streams = self.hc_ffn.merge(self.ffn(normed, step, i8), streams, post, comb)
        if not self.last:
            return streams, None
        return (streams.mean(1) if self.head is None else self.head(streams)), None


class HyperHead(nn.Module):
    """DeepSeek-V4's head mix (output_hc_*): the last streams (T, N, D) -> (T, D), summed with the weights
    sigmoid(fn(RMS-normed streams) scale + base) + eps."""

    def __init__(self, fn: Linear, base: torch.Tensor, scale: torch.Tensor, norm_eps: float, eps: float) -> None:
        super().__init__()
        self.fn, self.norm_eps, self.eps = fn, norm_eps, eps
        self.register_buffer("base", base, persistent=False)  # (N,)
        self.register_buffer("scale", scale, persistent=False)  # (1,)

    @classmethod
    def load(cls, w: Weights, hooks: Hooks, norm_eps: float, eps: float) -> HyperHead:
        return cls(
            Linear.load(w, "output_hc_fn", hooks, torch.float32),
            w.dense("output_hc_base.weight", torch.float32),
            w.dense("output_hc_scale.weight", torch.float32),
            norm_eps,
            eps,
        )

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        T, N, D = streams.shape
        flat = streams.reshape(T, N * D)
        mixes = self.fn(flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + self.norm_eps))  # (T, N)
        pre = torch.sigmoid(mixes * self.scale[0] + self.base) + self.eps
        return (streams * pre[:, :, None]).sum(1)
