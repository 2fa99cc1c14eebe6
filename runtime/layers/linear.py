"""The float32 reference Linear: y = x W^T (+ b) for one GGUF tensor, its input rounded as llama.cpp rounds it for
the stored weight type (kernels/rounding.py). Its GGUF-backed twins (layers/gguf_gpu.py, layers/gguf_cpu.py) multiply
the blocks themselves; which one a tensor gets is the backend's choice (backend.py), never this module's."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from moerun.hooks import Hooks
from moerun.kernels.rounding import Rounding, input_rounding
from moerun.kernels.tuning import GEMV_MAX_TOKENS
from moerun.weights import Weights

if TYPE_CHECKING:  # Triton's, which only CUDA builds of torch bring
    from moerun.kernels.act_i8 import QAct
from torch import nn


class Linear(nn.Module):
    """y = x W^T (+ b) for the GGUF tensor `name`; reports its input to activation hooks, then rounds it as
    llama.cpp does for the stored weight type (see kernels/rounding.py)."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        name: str,
        hooks: Hooks,
        round_input: Rounding | None = None,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # (out, in)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.name, self.hooks, self.round_input = name, hooks, round_input

    @classmethod
    def load(
        cls,
        w: Weights,
        prefix: str,
        hooks: Hooks,
        dtype: torch.dtype | None = None,
        shape: tuple[int, ...] | None = None,
    ) -> Linear:
        """`prefix.weight` as a dense `dtype` matrix (reshaped to `shape` if given) and, if the file has it,
        `prefix.bias`."""
        name = f"{prefix}.weight"
        weight, bias = w.dense(name, dtype), w.optional(f"{prefix}.bias", torch.float32)
        return cls(
            weight if shape is None else weight.reshape(shape),
            bias,
            name,
            hooks,
            input_rounding(w.info(name).ggml_type),
        )

    def forward(self, x: torch.Tensor, i8: QAct | None = None) -> torch.Tensor:
        """`i8`: x's int8 rounding where its writer made one, which QuantLinear's products take; the others round x
        as kernels/rounding.py says."""
        if self.hooks.activation:
            self.hooks.fire_activation(self.name, x)
        return self.product(x)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T (+ b), the input rounded as llama.cpp rounds it, without reporting x to the hooks (a second use
        of a matrix already reported)."""
        if self.round_input is not None:
            x = self.round_input(x)
        x = x.to(self.weight.dtype)
        rows = x.shape[0]
        float32_rows = x.is_cuda and x.dtype == torch.float32 and x.dim() == 2  # a router on a GPU
        if float32_rows and 0 < rows <= GEMV_MAX_TOKENS and x.shape[1] % 32 == 0 and self.weight.is_contiguous():
            # the router of a decode step, on the matrix-vector kernel over its float32 values: the 30B shape's
            # (128 x 2048) took 2.4 / 4.3 us at 1 / 8 rows there against cuBLAS's 4.5 / 7.6 (a GEMM and its split-K
            # reduce past one row), and a decode step of 2-7 sequences 0.25-0.3 ms less (H200, docs/history/benchmarks-log.md)
            from moerun.kernels.gguf_matmul import (  # Triton: present where CUDA is
                QWeight,
                gguf_mv,
            )

            n, k = self.weight.shape
            y = gguf_mv(x, QWeight(self.weight.view(torch.uint8).view(n, 4 * k), GGMLQuantizationType.F32, n, k))
        elif float32_rows and rows > 1 and rows % 8:
            # cuBLAS (torch 2.11, H200) ran 7 rows of the 30B model's float32 router on a kernel ten times slower
            # than the one it takes for 6 or 8 (52 us against 5 a layer: 2.5 ms of a decode step of 7 sequences,
            # docs/history/benchmarks-log.md); rows padded to a multiple of 8 take the fast one.
            y = F.linear(F.pad(x, (0, 0, 0, -rows % 8)), self.weight)[:rows]
        else:
            y = F.linear(x, self.weight)
        y = y.float()
        return y if self.bias is None else y + self.bias
