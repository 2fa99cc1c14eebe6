"""A synthetic model rewritten with its gate and up experts fused into one `ffn_gate_up_exps` per layer (weights, and
biases where it has them): the layout Gemma 4's converter writes, which llama.cpp and moerun read as they read the
split one. The inverse of `moeprep split-experts` (moeprep/gguf/split_experts.py), written with moeprep.gguf.writer."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from moeprep.gguf.reader import open_gguf
from moeprep.gguf.writer import OutputTensor, copied_tensor, write_gguf


def fuse_gate_up(src: Path, out: Path, extra: tuple[str, ...] = ()) -> Path:
    """`src` with each layer's gate and up experts (weights, and biases where it has them) concatenated per expert
    into ffn_gate_up_exps, gate rows first, at the gate tensor's place; `extra` names tensors to append (as copies
    of blk.0.ffn_down_exps.bias under that name)."""
    g = open_gguf(src)
    infos = {t.name: t for t in g.tensors}
    tensors = []
    for t in g.tensors:
        if ".ffn_up_exps." in t.name:
            continue
        if ".ffn_gate_exps." in t.name:
            up = infos[t.name.replace("ffn_gate_exps", "ffn_up_exps")]
            E, rows = t.shape[0], t.shape[1]
            halves = [g.raw(x).reshape(E, rows, -1) for x in (t, up)]
            fused = np.concatenate(halves, axis=1)
            name = t.name.replace("ffn_gate_exps", "ffn_gate_up_exps")
            shape = (E, 2 * rows, *t.shape[2:])
            tensors.append(OutputTensor(name, t.ggml_type, shape, lambda data=fused: [data]))
        else:
            tensors.append(copied_tensor(g, t))
    for name in extra:
        bias = infos["blk.0.ffn_down_exps.bias"]
        tensors.append(OutputTensor(name, bias.ggml_type, bias.shape, lambda b=bias: [g.raw(b)]))
    write_gguf(out, g, tensors=tensors)
    return out
