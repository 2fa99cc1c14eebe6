"""Settings every test that runs llama.cpp needs, Triton's interpreter where there is no GPU, and model files several
test folders share."""

from __future__ import annotations

import os
from pathlib import Path

import torch

# Triton kernels (moerun.kernels.gguf_matmul) run in Triton's interpreter on machines without a GPU, where compiled
# ones cannot run at all, so this changes no other test. Triton reads the variable when it decorates a function, its
# own library's included, so it is set here, before any test module can import triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import llama_cpp
import llama_cpp.llama_cpp as llama_cpp_api
import numpy as np
import pytest
from gguf import GGUFWriter

from moeprep.synth import write_synth_model
from moeprep.synth.tokenizer import load_vocab, vocab_metadata

_default_model_params = llama_cpp_api.llama_model_default_params


def _model_params_without_extra_buffers():
    """llama.cpp's defaults minus repacked/AMX weight buffers.

    Some of our machines' CPUs advertise AMX while their VM does not grant it, and llama.cpp's AMX path then dies
    with SIGILL on quantized weights. The plain CPU path computes the same model, so the oracle loses nothing.
    """
    params = _default_model_params()
    params.use_extra_bufts = False
    return params


# Both names: the low-level API (tests/oracle.py) and the Llama class look the function up separately.
llama_cpp.llama_model_default_params = _model_params_without_extra_buffers
llama_cpp_api.llama_model_default_params = _model_params_without_extra_buffers


# A real model's vocabulary size (Gemma 3's; Qwen3 has 151,936, gpt-oss 201,088): what the reader must open fast.
REAL_VOCAB = 262_144


@pytest.fixture(scope="session")
def real_vocab_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny qwen3moe whose vocabulary is padded to REAL_VOCAB tokens (metadata arrays of real size)."""
    return write_synth_model(tmp_path_factory.mktemp("real-vocab") / "real-vocab.gguf", "qwen3moe", n_vocab=REAL_VOCAB)


def write_dense_llama(path: Path, n_layer: int = 2, n_embd: int = 64, n_head: int = 4, n_ff: int = 128) -> Path:
    """A dense (non-MoE) llama GGUF with the synthetic models' tokenizer, random F32 weights."""
    vocab = load_vocab()
    rng = np.random.default_rng(0)
    w = GGUFWriter(path, "llama")
    w.add_context_length(256)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_count(n_embd // n_head)
    for key, kv in vocab_metadata(vocab).items():
        w.add_key_value(key, kv.value, kv.vtype, kv.sub_type)
    shapes = {
        "token_embd.weight": (vocab.size, n_embd),
        "output_norm.weight": (n_embd,),
        "output.weight": (vocab.size, n_embd),
    }
    for i in range(n_layer):
        shapes |= {
            f"blk.{i}.attn_norm.weight": (n_embd,),
            f"blk.{i}.ffn_norm.weight": (n_embd,),
            **{f"blk.{i}.attn_{p}.weight": (n_embd, n_embd) for p in "qkv"},
            f"blk.{i}.attn_output.weight": (n_embd, n_embd),
            f"blk.{i}.ffn_gate.weight": (n_ff, n_embd),
            f"blk.{i}.ffn_up.weight": (n_ff, n_embd),
            f"blk.{i}.ffn_down.weight": (n_embd, n_ff),
        }
    for name, shape in shapes.items():
        values = np.ones(shape) if name.endswith("norm.weight") else rng.normal(0, shape[-1] ** -0.5, shape)
        w.add_tensor(name, values.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="session")
def dense_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dense_llama(tmp_path_factory.mktemp("dense") / "dense-llama.gguf")
