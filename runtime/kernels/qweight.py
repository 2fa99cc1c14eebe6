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
    names a second bank (`second`), whose matrix e the matrix-vector kernel's slot -2 - e runs, so that a decode
    step's missed experts run in the same launch as its cached ones: the layer's experts in page-locked host memory
    (the GPU reads them over the bus), or a staging bank on the device they were copied to for the step."""

    # uint8, (N, row_bytes) or (E, N, row_bytes): each matrix's rows contiguous; a bank's matrices contiguous too, or
    # slot_bytes apart (a fused ffn_gate_up_exps' gate or up half: a view whose slots lie a fused expert apart)
    data: torch.Tensor
    qtype: Q
    rows: int  # N, output features
    cols: int  # C, input features (a multiple of the type's block size)
    # uint8 (E2, N, row_bytes), contiguous, its matrices slot_bytes apart too: slot -2 - e of the matrix-vector kernel
    second: torch.Tensor | None = None

    @property
    def slot_bytes(self) -> int:
        """Bytes from one matrix of a bank to the next (a dense matrix: its own bytes)."""
        return self.data.stride(0) if self.data.dim() == 3 else self.data.numel()
