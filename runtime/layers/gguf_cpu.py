"""Layers that compute straight from GGUF bytes in host memory on the CPU (the kernels of kernels/cpu/):
`CPUExperts` replaces the reference expert path, `CPUQuantLinear` a Linear whose type has a row kernel. The backend
(backend.py) picks them where the kernels read the tensors' types."""

from __future__ import annotations

import numba
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from moerun.hooks import Hooks
from moerun.kernels.cpu.formats import ExpertBytes, integer_kernel, supports
from moerun.kernels.cpu.moe_rows import expert_matmul, ggml_kernel, moe_rows
from moerun.kernels.ggml_cpu import GgmlCPU
from moerun.kernels.rounding import input_rounding
from moerun.layers.ffn import Activation
from moerun.layers.linear import Linear
from moerun.layers.moe import GGUFExperts
from moerun.layers.ops import Kernels
from moerun.step import Step
from moerun.weights import Weights, expert_bytes, expert_rows

# ------------------------------------------------------------------------------------------- the ExpertCompute


class CPUExperts(GGUFExperts):
    """ExpertCompute on the CPU through moe_rows, straight from the memory-mapped GGUF, with torch's thread count,
    on the row dots of the ggml library `ggml` where it has them (None: moerun's numba kernels). With activation
    hooks registered (imatrix collection) it runs the reference path, which reports each expert's inputs."""

    ggml: GgmlCPU | None = None

    @classmethod
    def can_run(cls, w: Weights, layer: int) -> bool:
        return all(supports(part.info.ggml_type) for part in expert_rows(w.gguf, layer))

    @classmethod
    def load(
        cls, w: Weights, hooks: Hooks, layer: int, activation: Activation, kernels: Kernels, ggml: GgmlCPU | None = None
    ) -> CPUExperts:
        experts = super().load(w, hooks, layer, activation, kernels)
        experts.ggml = ggml
        experts.host = expert_bytes(w.gguf, layer)
        return experts

    def forward(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, step: Step | None = None, i8=None
    ) -> torch.Tensor:  # i8: the GPU's rounding, never made on the CPU
        if self.hooks.activation:
            return super().forward(x, ids, weights)
        out = torch.zeros(x.shape, dtype=torch.float32)
        moe_rows(
            x.float().contiguous().numpy(),
            ids.numpy(),
            weights.float().contiguous().numpy(),
            *self.host,
            self.activation.name,
            out.numpy(),
            threads=_torch_threads(),
            limit=self.activation.limit,
            up_limit=self.activation.up_limit,
            ggml=self.ggml,
        )
        return out


# ----------------------------------------------------------------------------------- dense products on the CPU

# Up to this many tokens a CPU Linear runs the integer kernels on the GGUF bytes; more take the float32 copy's GEMM.
# Measured on a 2-core VM, 4096x2048, 2 threads (expert_matmul against F.linear): Q4_K 0.43 against 1.73
# ms for 1 token, 1.51 against 3.98 for 4, 9.0 against 5.8 for 32 (Q8_0 alike; Q6_K 0.88 against 1.74 for 1).
# Through ggml's row dots (ggml_cpu.py), same VM and shape: 0.18 against 1.57 ms for 1 token, 3.7 against 5.1 for
# 32, 15.0 against 17.4 for 128, 60.8 against 52.1 for 512: no float32 copy then (CPUQuantLinear).
QUANT_MAX_TOKENS = 8


# F16 and BF16 weights run ggml's row dots too where they are there (moerun's numba float kernels do not beat torch's
# float32 product): 8192 x 2048 F16, 2 threads, a 2-core VM, 0.29 against 1.65 ms for 1 token, 2.0
# against 3.5 for 8, 16.2 against 7.8 for 64, 126 against 50 for 512. Row dots for every token count all the same, as
# for the integer types: a token's product then does not depend on how many tokens share its step (a server's batch
# and the same prompt alone sample the same tokens), and no copy is kept (a 152k-token F16 output head's would be
# 1.2 GB; heads multiply one row per sequence anyway).
HALF_TYPES = (Q.F16, Q.BF16)


class CPUQuantLinear(Linear):
    """A Linear on the CPU whose weight has an integer kernel (the block-quantized types), or a half-precision one
    where ggml's row dots are there (the library `ggml`), multiplying the memory-mapped GGUF bytes (a Q4_K matrix is
    a seventh of its float32 copy's bytes; one "expert" of expert_matmul). On ggml's row dots it takes any number of tokens and keeps
    no float32 copy (a 30B model's attention alone would take 3.6 GB more); on the numba kernels a step of more than
    QUANT_MAX_TOKENS tokens (a prompt) goes through a float32 copy's GEMM, which computes it faster. Both round the
    input as llama.cpp does for the weight's type."""

    host: ExpertBytes

    def __init__(
        self,
        host: ExpertBytes,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        name: str,
        hooks: Hooks,
        round_input,
        ggml: GgmlCPU | None = None,
    ) -> None:
        torch.nn.Module.__init__(self)  # not Linear.__init__: the weight may be absent
        self.ggml = ggml
        self.weight = None if weight is None else torch.nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        self.name, self.hooks, self.round_input, self.host = name, hooks, round_input, host

    @classmethod
    def can_run(cls, qtype: Q, ggml: GgmlCPU | None) -> bool:
        return integer_kernel(qtype) or (qtype in HALF_TYPES and ggml is not None and ggml.row_dot(qtype) is not None)

    @classmethod
    def load(
        cls, w: Weights, prefix: str, hooks: Hooks, bias: torch.Tensor | None, ggml: GgmlCPU | None
    ) -> CPUQuantLinear:
        """GGUF tensor `prefix`.weight's bytes, and its float32 copy where the numba kernels would need it."""
        host = _host_bytes(w, prefix, bias)
        name = f"{prefix}.weight"
        weight = None if ggml_kernel(host, ggml) is not None else w.dense(name, torch.float32)
        return cls(host, weight, bias, name, hooks, input_rounding(host.qtype), ggml)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is not None and (x.dim() != 2 or x.shape[0] > QUANT_MAX_TOKENS):
            return super().product(x)
        rows = x.reshape(-1, x.shape[-1]).float().contiguous().numpy()
        y = expert_matmul(rows, self.host, np.zeros(len(rows), np.int64), _torch_threads(), self.ggml)
        return torch.from_numpy(y).reshape(*x.shape[:-1], self.host.rows)


def _torch_threads() -> int:
    """The kernels' threads for a layer's call: torch's count (moerun's -t), within numba's pool."""
    return min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)


def _host_bytes(w: Weights, prefix: str, bias: torch.Tensor | None) -> ExpertBytes:
    """`prefix.weight` as (E, rows, row_bytes) in the memory map (a 2-D weight as one expert), with `prefix.bias` as
    the caller read it (None: the file has none)."""
    info = w.info(f"{prefix}.weight")
    n_experts, rows, cols = info.shape if len(info.shape) == 3 else (1, *info.shape)
    return ExpertBytes(
        w.gguf.raw(info).reshape(n_experts, rows, -1),
        info.ggml_type,
        rows,
        cols,
        None if bias is None else bias.cpu().numpy().reshape(n_experts, rows),
    )
