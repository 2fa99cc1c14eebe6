"""Fused gate/up experts rewritten as two tensors, byte for byte.

Converters that read checkpoints storing each layer's experts' gate and up projections as one `gate_up_proj`
(Gemma 4's, and other models in that checkpoint layout) write `blk.N.ffn_gate_up_exps` [E, 2I, D]: each expert's I
gate rows, then its I up rows. llama.cpp reads that layout and the split one (`ffn_gate_exps` and `ffn_up_exps`,
[E, I, D] each) alike, and so does moerun; some tools want the split one. A row of a GGUF tensor is a
whole number of blocks in any type, so the split is a byte copy of row ranges: nothing is requantized, and the model
computes exactly what it did.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from moeprep.errors import MoeprepError
from moeprep.gguf.reader import GGUFModel, TensorInfo, open_gguf
from moeprep.gguf.writer import OutputTensor, copied_tensor, write_gguf

FUSED = "ffn_gate_up_exps"


def _half(model: GGUFModel, t: TensorInfo, part: str) -> OutputTensor:
    """The gate (first) or up (second) half of each expert's rows of fused tensor `t`, streamed expert by expert."""
    n_expert, rows = t.shape[0], t.shape[1]
    half = rows // 2
    start = 0 if part == "gate" else half

    def chunks() -> Iterator[np.ndarray]:
        data = model.raw(t).reshape(n_expert, rows, -1)  # (E, 2I, row bytes) view of the memory map
        for e in range(n_expert):
            yield data[e, start : start + half]

    return OutputTensor(t.name.replace(FUSED, f"ffn_{part}_exps"), t.ggml_type, (n_expert, half, *t.shape[2:]), chunks)


def split_tensors(model: GGUFModel) -> list[OutputTensor]:
    """Every tensor of `model` in order, each fused ffn_gate_up_exps weight (and bias) replaced by its gate and up
    halves; refuses a model without one, and fused tensors it cannot halve."""
    out = []
    for t in model.tensors:
        if f".{FUSED}." not in t.name:
            out.append(copied_tensor(model, t))
            continue
        if t.name.endswith(".scale"):
            raise MoeprepError(f"{model.path}: {t.name}: a scale of fused gate/up experts cannot be split")
        if len(t.shape) < 2 or t.shape[1] % 2:
            raise MoeprepError(f"{model.path}: {t.name} has shape {t.shape}: not an even number of gate/up rows")
        out += [_half(model, t, "gate"), _half(model, t, "up")]
    if len(out) == len(model.tensors):
        raise MoeprepError(f"{model.path}: no fused {FUSED} tensors; its experts are already split")
    return out


def split_experts(
    source: str | Path,
    out: str | Path,
    split_max_size: int | None = None,
    on_bytes: Callable[[int], None] = lambda n: None,
) -> list[Path]:
    """Write `source` with every fused ffn_gate_up_exps split into ffn_gate_exps and ffn_up_exps, its metadata and
    other tensors unchanged; returns the written paths."""
    model = open_gguf(source)
    return write_gguf(out, model, tensors=split_tensors(model), split_max_size=split_max_size, on_bytes=on_bytes)
