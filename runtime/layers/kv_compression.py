"""DeepSeek-V4's compressed keys: every `ratio` consecutive positions of a sequence become one cached entry.

A compressor projects each token to a value kv(x) and a score gate(x) + ape[position % ratio], both per channel.
Once the last position of a block of `ratio` tokens is there, the block's entry is, channel by channel, the softmax
over its tokens' scores weighting their values; then RMS-normed (the compressor's norm) and rotated at the block's
first position (RoPE on the last channels of the entry, as `rotate_tail`). The overlapping kind (ratio 4) draws
twice as many channels per token: an entry reads the first half of the previous block's and the second half of its
own, 2 ratio tokens in one softmax (before position 0: nothing, a value 0 with score -inf).

What an entry needs beyond the step's own tokens (the last 2 ratio positions at most) is kept per sequence in a
ring of rows (`state`); the entries, one per completed block, in `cache`. Letters: W the entry's width, c 2 for the
overlapping kind (else 1), B blocks.
"""

from __future__ import annotations

import torch
from torch import nn

from moerun.layers.linear import Linear
from moerun.layers.norm import RMSNorm
from moerun.layers.rope import Rope


def rotate_tail(rope: Rope, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x (T, heads, d) with RoPE on its last rope.dim channels (adjacent pairs) at `positions` (T,), float32;
    `inverse` turns them back (DeepSeek-V4 takes the rotation off its attention output, whose values are keys)."""
    x = x.float()
    d = rope.dim
    cos, sin = rope.cos[positions][:, None, :], rope.sin[positions][:, None, :]  # (T, 1, d/2)
    if inverse:
        sin = -sin
    head, tail = x[..., : x.shape[-1] - d], x[..., x.shape[-1] - d :]
    x1, x2 = tail[..., 0::2], tail[..., 1::2]
    tail = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
    return torch.cat([head, tail], dim=-1)


class KVCompressor(nn.Module):
    """One layer's compressor (attn_compressor_* or indexer_compressor_*) with its state and its entries."""

    keeps_history = True  # its state folds in every token it ran: a sequence goes on only where it stopped (Model)

    def __init__(
        self,
        kv: Linear,
        gate: Linear,
        ape: torch.Tensor,
        norm: RMSNorm,
        rope: Rope,
        ratio: int,
        overlap: bool,
        n_ctx: int,
        n_seq: int,
    ) -> None:
        super().__init__()
        self.kv, self.gate, self.norm, self.rope = kv, gate, norm, rope
        self.ratio, self.overlap = ratio, overlap
        self.register_buffer("ape", ape.float(), persistent=False)  # (ratio, c W)
        self.width = ape.shape[1] // (2 if overlap else 1)
        self.state_size = 2 * ratio if overlap else ratio
        device = ape.device
        self.register_buffer(  # rows by position % state_size: [value, score] (c W each)
            "state", torch.zeros(n_seq, self.state_size, 2, ape.shape[1], device=device), persistent=False
        )
        self.register_buffer(
            "cache", torch.zeros(n_seq, n_ctx // ratio + 1, self.width, device=device), persistent=False
        )

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x (T, D) -> its rows (T, 2, cW): the values, and the scores with the ape row of each position."""
        return torch.stack([self.kv(x).float(), self.gate(x).float() + self.ape[positions % self.ratio]], dim=1)

    def update(self, x: torch.Tensor, seq: int, positions: torch.Tensor) -> None:
        """x (T, D) of sequence `seq` at consecutive `positions` (a prompt chunk): the entries of the blocks they
        complete into the cache, their rows into the state."""
        r = self.ratio
        rows, first = self.project(x, positions), positions[0]
        ends = positions[(positions + 1) % r == 0]
        if len(ends):
            blocks = (ends + 1) // r - 1  # (B,)
            own = blocks[:, None] * r + torch.arange(r, device=x.device)  # (B, r) the blocks' positions

            def read(pos: torch.Tensor) -> torch.Tensor:  # the step's own rows from `first` on, the state's before
                own_rows = rows[(pos - first).clamp(0, len(rows) - 1)]
                return torch.where((pos >= first)[..., None, None], own_rows, self.state[seq, pos % self.state_size])

            self.cache[seq, blocks] = self.entries(read, own, blocks)
        keep = min(len(positions), self.state_size)
        self.state[seq, positions[-keep:] % self.state_size] = rows[-keep:]

    def update_tokens(self, x: torch.Tensor, seqs: torch.Tensor, positions: torch.Tensor) -> None:
        """One token each of distinct sequences `seqs` (T,) (decode steps), without a host sync: each token's row
        into the state, then the entry of the block it is in into the cache, complete or not (an unfinished block's
        entry is seen by no query, and is written again when its last token comes)."""
        r = self.ratio
        self.state[seqs, positions % self.state_size] = self.project(x, positions)
        blocks = positions // r  # (T,)
        own = blocks[:, None] * r + torch.arange(r, device=x.device)  # (T, r)
        entries = self.entries(lambda pos: self.state[seqs[:, None], pos % self.state_size], own, blocks)
        self.cache[seqs, blocks] = entries

    def entries(self, read, own: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """The entries (B, W) of `blocks` (B,) whose positions are `own` (B, r), read(positions (B, n)) giving their
        rows (B, n, 2, cW): per channel the softmax over its own tokens' rows (n = ratio), or over the previous
        block's first halves and its own second halves (overlapping: n = 2 ratio); then normed and rotated."""
        if self.overlap:
            W = self.width
            prev, cur = self._masked(read, own - self.ratio), self._masked(read, own)
            values = torch.cat([prev[:, :, 0, :W], cur[:, :, 0, W:]], dim=1)
            scores = torch.cat([prev[:, :, 1, :W], cur[:, :, 1, W:]], dim=1)
        else:
            cur = self._masked(read, own)
            values, scores = cur[:, :, 0], cur[:, :, 1]
        entries = (torch.softmax(scores, dim=1) * values).sum(1)  # (B, W)
        return rotate_tail(self.rope, self.norm(entries)[:, None], blocks * self.ratio)[:, 0]

    @staticmethod
    def _masked(read, pos: torch.Tensor) -> torch.Tensor:
        """read(pos), with a zero value and score -inf before position 0."""
        out = read(pos)
        before = (pos < 0)[..., None]
        out[..., 0, :] = out[..., 0, :].masked_fill(before, 0.0)
        out[..., 1, :] = out[..., 1, :].masked_fill(before, float("-inf"))
        return out
