"""QWeight: a matrix (or a bank of expert matrices) as GGUF bytes on a device, what the GGUF kernels multiply.

Its own module, free of Triton, so that code which only holds such bytes (the expert cache on a CPU standing in for
the GPU) imports without it; kernels/gguf_matmul.py multiplies them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType as Q


@dataclass(frozen=True)
class QWeight:
    """GGUF bytes of one matrix or of a bank of expert matrices, on the device. A bank of the expert cache also
    names its layer's experts in host memory (`host`, (E_all, N, row_bytes) page-locked, which the GPU reads over
    the bus), so that a decode step's missed experts run in the same launch as its cached ones."""

    data: torch.Tensor  # uint8, (N, row_bytes) or (E, N, row_bytes), contiguous
    qtype: Q
    rows: int  # N, output features
    cols: int  # C, input features (a multiple of the type's block size)
    host: torch.Tensor | None = None  # uint8 (E_all, N, row_bytes): slot -2 - e of the matrix-vector kernel
