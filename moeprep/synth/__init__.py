"""Synthetic Mixture-of-Experts GGUF models that llama.cpp loads and runs: the fixtures of every test and benchmark.

    write_synth_model(path, arch="qwen3moe", preset="tiny", seed=0, expert_type=..., skew=0.3) -> Path

Modules: config (SynthConfig, PRESETS), parts (what architectures are built from), archs (the architecture table),
glm5_next (glm5-next's own parts), weights (value draws, bias channel and skew, quantized bytes), tokenizer (the
shipped byte-level BPE), model (writing), corpus (rebuilds package data).
"""

from moeprep.synth.archs import ARCHS
from moeprep.synth.config import PRESETS, SYNTH_TYPES, SynthConfig
from moeprep.synth.model import SYNTH_ARCHS, synth_config, tensor_data_size, write_synth_model
from moeprep.synth.weights import BIAS_CHANNEL, BIAS_CHANNEL_NORMED

__all__ = [
    "ARCHS",
    "BIAS_CHANNEL",
    "BIAS_CHANNEL_NORMED",
    "PRESETS",
    "SYNTH_ARCHS",
    "SYNTH_TYPES",
    "SynthConfig",
    "synth_config",
    "tensor_data_size",
    "write_synth_model",
]
