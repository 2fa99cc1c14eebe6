"""Preallocated KV cache: one slot per position, written with `update`; the buffers never change shape.

Slot s holds position s, so a step writes its rows in place and attention reads a prefix of the slots under a
mask built from the query positions (see layers.Step); stale slots of an earlier sequence sit at later positions
and are masked out, so starting over at position 0 needs no reset. The buffers' fixed shapes are what lets a
CUDA graph capture the decode step.
"""

from __future__ import annotations

import torch
from torch import nn


class KVCache(nn.Module):
    def __init__(self, n_ctx: int, n_kv_heads: int, k_dim: int, v_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.register_buffer("k", torch.zeros(n_ctx, n_kv_heads, k_dim, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(n_ctx, n_kv_heads, v_dim, dtype=dtype, device=device), persistent=False)

    def update(self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k (T, Hkv, Dk) and v (T, Hkv, Dv) at `positions` (T,); return the whole cache (S, Hkv, D*)."""
        self.k.index_copy_(0, positions, k.to(self.k.dtype))
        self.v.index_copy_(0, positions, v.to(self.v.dtype))
        return self.k, self.v
