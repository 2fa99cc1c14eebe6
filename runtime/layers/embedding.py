"""The token embedding, as GGUF rows dequantized per step."""

from __future__ import annotations

import torch
from torch import nn

from moerun.kernels.dequant import dequantize
from moerun.kernels.dequant import supports as dequantizes
from moerun.weights import Weights, device_bytes


class Embedding(nn.Module):
    """The token embedding, kept as its GGUF rows on the device (on the CPU, the memory map itself): a step
    dequantizes only its tokens' rows (kernels/dequant.py, bit-identical to gguf-py). As a float32 table it took 4
    bytes a value wherever it lived: 1.2 GB for a 152k-token vocabulary of 2048, on a GPU VRAM the expert cache could
    have used. A type the device dequantizer does not read (IQ4_XS) is kept as that float32 table."""

    def __init__(self, w: Weights, name: str, scale: float = 0.0) -> None:
        """`scale`: multiplies every embedding (Granite's embedding_scale); 0 means none."""
        super().__init__()
        self.scale = scale
        info = w.info(name)
        self.n_vocab, self.dim = info.shape
        self.qtype = info.ggml_type if dequantizes(info.ggml_type) else None
        rows = (
            device_bytes(w.gguf.raw(info).reshape(self.n_vocab, -1), w.device)
            if self.qtype is not None
            else w.dense(name, torch.float32)
        )
        self.register_buffer("rows", rows, persistent=False)  # (V, row bytes) uint8, or (V, D) float32

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (T,) -> (T, D) float32."""
        rows = self.rows[tokens]
        x = rows if self.qtype is None else dequantize(rows, self.qtype, self.dim)
        return x * self.scale if self.scale else x
