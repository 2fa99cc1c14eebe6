"""Weights straight from the memory-mapped GGUF: dense tensors dequantized once, expert tensors kept as GGUF bytes.

A stacked expert tensor (`blk.N.ffn_*_exps.weight`, numpy shape (E, rows, cols)) stays in its GGUF bytes;
`ExpertTensor` dequantizes one expert's slice when the router picks it. That is the reference path the expert cache
replaces. Types moerun.kernels.dequant supports have their bytes copied to the compute device once and dequantized
there; the others stay in the memory map and go through gguf-py on the host.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from gguf import GGMLQuantizationType

from moeprep.errors import MoeprepError
from moeprep.gguf.reader import GGUFModel, TensorInfo, dequantize_raw
from moerun.kernels.dequant import dequantize, supports
from moerun.kernels.rounding import input_rounding

EXPERT_PARTS = ("gate", "up", "down")


def expert_tensor_names(names, layer: int) -> tuple[str, str, str]:
    """The gate, up and down expert tensors of `layer` (`names`: the file's tensor names, or anything answering `in`).
    Experts without a gate (Nemotron-H's, relu(up x)^2) name their up tensor in the gate's place: their activation
    reads only up, so the gated experts' kernels, the expert cache's banks included, run them unchanged."""
    gate, up, down = (f"blk.{layer}.ffn_{part}_exps.weight" for part in EXPERT_PARTS)
    return (gate if gate in names else up), up, down


def dequantize_bytes(raw: np.ndarray, ggml_type: GGMLQuantizationType, shape: tuple[int, ...]) -> torch.Tensor:
    """float32 tensor of `shape` from its GGUF bytes, on the host (a writable copy where the bytes are the map's)."""
    return torch.from_numpy(np.require(dequantize_raw(raw, ggml_type, shape), requirements="W"))


def device_bytes(raw: np.ndarray, device: torch.device) -> torch.Tensor:
    """The mapped bytes as a uint8 tensor on `device`: a copy on a GPU, the memory map itself on the CPU."""
    with warnings.catch_warnings():
        # The map is read-only and the tensor is only ever read, which is all torch's warning is about.
        warnings.filterwarnings("ignore", "The given NumPy array is not writable", UserWarning)
        return torch.from_numpy(raw).to(device)


class ExpertTensor:
    """One stacked expert weight, (E, rows, cols) in numpy order; `expert(e)` is expert e's (rows, cols) matrix."""

    def __init__(self, g: GGUFModel, info: TensorInfo, dtype: torch.dtype, device: torch.device) -> None:
        assert len(info.shape) == 3, info
        self.name = info.name
        self.info = info
        self.n_experts, self.rows, self.cols = info.shape
        self.dtype, self.device = dtype, device
        raw = g.raw(info).reshape(self.n_experts, self.rows, -1)  # (E, rows, row bytes) view of the memory map
        self.on_device = supports(info.ggml_type)
        self._bytes = device_bytes(raw, device) if self.on_device else raw  # on_device: (E, rows, row bytes) uint8
        self.round_input = input_rounding(info.ggml_type)

    def expert(self, e: int) -> torch.Tensor:
        if self.on_device:
            return dequantize(self._bytes[e], self.info.ggml_type, self.cols, self.dtype)
        w = dequantize_bytes(self._bytes[e], self.info.ggml_type, (self.rows, self.cols))
        return w.to(device=self.device, dtype=self.dtype)

    @property
    def device_bytes(self) -> torch.Tensor:
        """(E, rows, row bytes) uint8 on the compute device (only where `on_device`)."""
        assert self.on_device, self.name
        return self._bytes

    def experts(self, ids: torch.Tensor) -> torch.Tensor:
        """The experts `ids` (K,) as one (K, rows, cols) tensor: one dequantization for all of them, no host sync
        when the bytes live on the device."""
        if self.on_device:
            return dequantize(self._bytes[ids], self.info.ggml_type, self.cols, self.dtype)
        return torch.stack([self.expert(e) for e in ids.tolist()])


class Weights:
    """Looks tensors up by GGUF name and hands them out in the compute dtype on the compute device."""

    def __init__(self, g: GGUFModel, dtype: torch.dtype, device: torch.device) -> None:
        self.gguf, self.dtype, self.device = g, dtype, device
        self._infos = {t.name: t for t in g.tensors}

    def __contains__(self, name: str) -> bool:
        return name in self._infos

    def info(self, name: str) -> TensorInfo:
        if name not in self._infos:
            raise MoeprepError(
                f"{self.gguf.path}: tensor {name} is missing; the file is incomplete or not a {self.gguf.arch} model"
            )
        return self._infos[name]

    def dense(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole tensor, dequantized (numpy shape: a Linear weight is (out, in))."""
        info = self.info(name)
        w = dequantize_bytes(self.gguf.raw(info), info.ggml_type, info.shape)
        return w.to(device=self.device, dtype=dtype or self.dtype)

    def blocks(self, name: str):
        """The 2-D tensor `name` as a QWeight (its GGUF bytes on the GPU) where the GPU kernels multiply its type
        directly; None on the CPU and for types they do not decode (those are dequantized once, see `dense`)."""
        if self.device.type != "cuda":
            return None
        from moerun.kernels.gguf_matmul import QWeight, supports  # Triton: present where CUDA is

        info = self.info(name)
        if len(info.shape) != 2 or not supports(info.ggml_type):
            return None
        rows, cols = info.shape
        return QWeight(device_bytes(self.gguf.raw(info).reshape(rows, -1), self.device), info.ggml_type, rows, cols)

    def optional(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor | None:
        return self.dense(name, dtype) if name in self else None

    def experts(self, name: str) -> ExpertTensor:
        return ExpertTensor(self.gguf, self.info(name), self.dtype, self.device)
