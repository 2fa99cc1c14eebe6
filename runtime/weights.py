"""Weights straight from the memory-mapped GGUF: dense tensors dequantized once, expert tensors kept as GGUF bytes.

A stacked expert tensor (`blk.N.ffn_*_exps.weight`, numpy shape (E, rows, cols)) stays in its GGUF bytes;
`ExpertTensor` dequantizes one expert's slice when the router picks it. That is the reference path the expert cache
replaces. Types moerun.kernels.dequant supports have their bytes copied to the compute device once and dequantized
there; the others stay in the memory map and go through gguf-py on the host.

A layer's gate and up experts are stored apart (`ffn_gate_exps`, `ffn_up_exps`, each (E, I, D)) or fused
(`ffn_gate_up_exps` (E, 2I, D): each expert's I gate rows, then its I up rows, as Gemma 4's converter writes them;
llama.cpp reads both). `expert_rows` is where every expert path opens a layer's experts: it names each of gate, up
and down as a row range of a stored tensor, and every path then reads that range as a view (of the memory map, of a
page-locked copy, of a device copy of the whole stored tensor), never a copy of one half.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from gguf import GGMLQuantizationType

from moeprep.errors import MoeprepError
from moeprep.gguf.reader import GGUFModel, TensorInfo, dequantize_raw
from moerun.kernels.dequant import dequantize, supports
from moerun.kernels.rounding import input_rounding

if TYPE_CHECKING:  # numba's, imported where the CPU kernels' bytes are made
    from moerun.kernels.cpu.formats import ExpertBytes

EXPERT_PARTS = ("gate", "up", "down")
FUSED_GATE_UP = "ffn_gate_up_exps"


@dataclass(frozen=True)
class ExpertRows:
    """One of a layer's expert tensors (gate, up or down) as stored: rows first .. first + rows - 1 of every expert
    of the stacked GGUF tensor `info` (E, stored rows, cols), and the same rows of its bias where it has one. A
    tensor stored alone is all of its rows; a fused ffn_gate_up_exps gives gate its first half, up its second."""

    info: TensorInfo
    bias: TensorInfo | None
    first: int
    rows: int

    @property
    def name(self) -> str:
        """The stored tensor's name (the fused tensor's for its halves: what llama.cpp's imatrix names too)."""
        return self.info.name

    @property
    def n_experts(self) -> int:
        return self.info.shape[0]

    @property
    def cols(self) -> int:
        return self.info.shape[2]

    def of_stack(self, stack):
        """These rows of `stack`, the stored tensor's (E, stored rows, ...) array or tensor (a view)."""
        return stack[:, self.first : self.first + self.rows]

    def data(self, g: GGUFModel) -> np.ndarray:
        """(E, rows, row bytes) uint8 view of the memory map (rows of a fused tensor: strided, not copied)."""
        return self.of_stack(g.raw(self.info).reshape(self.info.shape[0], self.info.shape[1], -1))

    def bias_values(self, g: GGUFModel) -> np.ndarray | None:
        """The bias rows (E, rows) float32, or None: the file has no bias for this tensor."""
        if self.bias is None:
            return None
        values = dequantize_raw(g.raw(self.bias), self.bias.ggml_type, self.bias.shape)
        return np.ascontiguousarray(self.of_stack(values), np.float32)


def expert_rows(g: GGUFModel, layer: int) -> tuple[ExpertRows, ExpertRows, ExpertRows]:
    """The gate, up and down experts of `layer`, stored apart or with gate and up fused (module docstring). Experts
    without a gate (Nemotron-H's, relu(up x)^2) give their up rows in the gate's place: their activation reads only
    up, so the gated experts' kernels, the expert cache's banks included, run them unchanged (one object for both)."""
    infos = {t.name: t for t in g.tensors}
    gate, up, down = (f"blk.{layer}.ffn_{part}_exps.weight" for part in EXPERT_PARTS)
    fused = f"blk.{layer}.{FUSED_GATE_UP}.weight"

    def stored(name: str) -> TensorInfo:
        if name not in infos:
            raise MoeprepError(f"{g.path}: tensor {name} is missing; the file is incomplete or not a {g.arch} model")
        info = infos[name]
        if len(info.shape) != 3:
            raise MoeprepError(f"{g.path}: {name} has shape {info.shape}, not (experts, rows, columns)")
        return info

    def whole(name: str) -> ExpertRows:
        info = stored(name)
        return ExpertRows(info, infos.get(name.removesuffix("weight") + "bias"), 0, info.shape[1])

    down_rows = whole(down)
    if gate not in infos and fused in infos:
        info = stored(fused)
        if info.shape[1] % 2:
            raise MoeprepError(f"{g.path}: {fused} has {info.shape[1]} rows per expert: not gate and up halves")
        if fused.removesuffix("weight") + "scale" in infos:
            raise MoeprepError(f"{g.path}: a scale of fused gate/up experts ({FUSED_GATE_UP}.scale) is not supported")
        bias = infos.get(fused.removesuffix("weight") + "bias")
        half = info.shape[1] // 2
        return ExpertRows(info, bias, 0, half), ExpertRows(info, bias, half, half), down_rows
    up_rows = whole(up)
    return (whole(gate) if gate in infos else up_rows), up_rows, down_rows


def expert_bytes(g: GGUFModel, layer: int) -> tuple[ExpertBytes, ExpertBytes, ExpertBytes]:
    """A layer's gate, up and down experts as the CPU kernels' host bytes: views of the memory map, with their
    biases (one object for an ungated layer's up given as its gate)."""
    from moerun.kernels.cpu.formats import ExpertBytes

    parts = expert_rows(g, layer)
    made: dict[ExpertRows, ExpertBytes] = {}
    for part in parts:
        if part not in made:
            made[part] = ExpertBytes(part.data(g), part.info.ggml_type, part.rows, part.cols, part.bias_values(g))
    return tuple(made[part] for part in parts)


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
    """One stacked expert weight, (E, rows, cols) in numpy order; `expert(e)` is expert e's (rows, cols) matrix.
    `stack`: the stored tensor's (E, stored rows, row bytes) bytes, on the device where `on_device`, else the memory
    map; this weight is `part`'s rows of it (a view: the halves of a fused gate/up share one copy)."""

    def __init__(self, part: ExpertRows, stack, dtype: torch.dtype, device: torch.device) -> None:
        self.name = part.name
        self.info = part.info
        self.n_experts, self.rows, self.cols = part.n_experts, part.rows, part.cols
        self.dtype, self.device = dtype, device
        self.on_device = supports(part.info.ggml_type)
        self._bytes = part.of_stack(stack)  # (E, rows, row bytes) uint8
        self.round_input = input_rounding(part.info.ggml_type)

    def expert(self, e: int) -> torch.Tensor:
        if self.on_device:
            return dequantize(self._bytes[e], self.info.ggml_type, self.cols, self.dtype)
        w = dequantize_bytes(self._bytes[e], self.info.ggml_type, (self.rows, self.cols))
        return w.to(device=self.device, dtype=self.dtype)

    @property
    def device_bytes(self) -> torch.Tensor:
        """(E, rows, row bytes) uint8 on the compute device (only where `on_device`); each expert's rows are
        contiguous, the experts `stride(0)` bytes apart (more than an expert's rows for a fused gate/up's half)."""
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

    def experts(self, layer: int) -> tuple[ExpertTensor, ExpertTensor, ExpertTensor]:
        """The gate, up and down experts of `layer` (expert_rows): each stored tensor's bytes go to the device once,
        so a fused gate/up's halves are views of one copy (one object for an ungated layer's up given as its gate)."""
        parts = expert_rows(self.gguf, layer)
        stacks: dict[str, object] = {}
        made: dict[ExpertRows, ExpertTensor] = {}
        for part in parts:
            if part.name not in stacks:
                raw = self.gguf.raw(part.info).reshape(part.info.shape[0], part.info.shape[1], -1)
                stacks[part.name] = device_bytes(raw, self.device) if supports(part.info.ggml_type) else raw
            if part not in made:
                made[part] = ExpertTensor(part, stacks[part.name], self.dtype, self.device)
        return tuple(made[part] for part in parts)

    def expert_biases(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """The biases (E, rows) float32 of `layer`'s gate, up and down experts, None where the file has none."""
        biases = (part.bias_values(self.gguf) for part in expert_rows(self.gguf, layer))
        return tuple(None if b is None else torch.from_numpy(b).to(self.device) for b in biases)
