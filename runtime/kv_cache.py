"""Preallocated KV cache for n_seq independent sequences: one slot per position, written with `update`; the
buffers never change shape.

Slot s of a sequence holds its position s, so a step writes its rows in place and attention reads a prefix of the
slots under a mask built from the query positions (see layers.Step); stale slots of an earlier request sit at later
positions and are masked out, so starting over (or going on after a shared prefix) needs no reset. The buffers' fixed
shapes are what lets a CUDA graph capture the decode step.
"""

from __future__ import annotations

import torch
from torch import nn

from moerun.step import Step


class KVCache(nn.Module):
    def __init__(
        self,
        n_ctx: int,
        n_kv_heads: int,
        k_dim: int,
        v_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        n_seq: int = 1,
    ) -> None:
        super().__init__()
        for name, dim in (("k", k_dim), ("v", v_dim)):
            self.register_buffer(
                name, torch.zeros(n_seq, n_ctx, n_kv_heads, dim, dtype=dtype, device=device), persistent=False
            )

    def update(self, step: Step, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k (T, Hkv, Dk) and v (T, Hkv, Dv) at the step's positions of its sequences; return the slots
        attention reads: (n_slots, Hkv, D*) of the step's one sequence, or, when the step has several (Step.blocks:
        a token each in a decode batch, B chunks in a captured prompt step), the first n_slots of every sequence,
        (n_seq, n_slots, Hkv, D*), which attention reads by block (layers.attend's `seqs`): no copy."""
        n = step.n_slots
        if step.in_place:
            k_seq, v_seq = self.k[step.seq], self.v[step.seq]
            k_seq.index_copy_(0, step.positions, k.to(k_seq.dtype))
            v_seq.index_copy_(0, step.positions, v.to(v_seq.dtype))
            return k_seq[:n], v_seq[:n]
        blocks = step.blocks
        seqs = blocks[:, None].expand(-1, len(step.positions) // len(blocks)).reshape(-1)  # each token's
        self.k.index_put_((seqs, step.positions), k.to(self.k.dtype))
        self.v.index_put_((seqs, step.positions), v.to(self.v.dtype))
        return self.k[:, :n], self.v[:, :n]
