"""`Kernels`: the elementwise, normalization, attention and routing work a layer hands to a kernel, as a value the
backend picks once per device (backend.py) and passes to each layer it builds. Layers never choose their kernels."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from moerun.kernels.act_i8 import QAct
    from moerun.layers.linear import Linear


@dataclass(frozen=True)
class Kernels:
    """The layers' elementwise and normalization work, as torch ops (the reference, TORCH_KERNELS in
    layers/__init__.py) or as fused kernels (Triton on a GPU, numba on the CPU: backend.py).

    `route` chooses experts for the plain gatings (no selection bias, no expert groups; None: the Router's torch
    code); `activations` are the fused versions of activations by name (layers/ffn.py's `Activation.name`; an
    activation not in it runs its torch reference); `stack_rows` makes one Linear of several that share their input
    (returning None: they run apart). `add_rms_norm_i8` and `attend_i8` (None: not made) also return their output's
    int8 rounding for the products reading it (kernels/fused.py's add_rms_norm_i8, attend_decode_i8): the GGUF
    products' 8-bit routes then skip rounding it again.
    """

    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    add_rms_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]
    norm_rope_store: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    attend: Callable[..., torch.Tensor]
    route: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None
    activations: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]
    stack_rows: Callable[[list[Linear]], Linear | None]
    add_rms_norm_i8: Callable[..., tuple[torch.Tensor, torch.Tensor, QAct | None]] | None = None
    attend_i8: Callable[..., tuple[torch.Tensor, QAct | None]] | None = None


def device_of(module: nn.Module) -> torch.device:
    """Where a module's weights are: its parameters, or its buffers (QuantLinear's GGUF blocks); the CPU for a module
    with neither (CPUQuantLinear on the memory-mapped bytes alone)."""
    first = next(itertools.chain(module.parameters(), module.buffers()), None)
    return torch.device("cpu") if first is None else first.device
