"""The CPU's fused kernels (moerun.kernels.cpu_fused, numba) against the torch reference in layers.py, on random
inputs (never zeros): Q/K norm + RoPE + the KV cache's rows, the router's choice; and a model on them against the
same model on torch ops."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moeprep.gguf.reader import open_gguf
from moerun import layers
from moerun.cache.kv import KVCache
from moerun.config import GATING_SIGMOID, GATING_SOFTMAX, GATING_SOFTMAX_WEIGHT
from moerun.kernels import cpu_fused
from moerun.models import arch_module
from moerun.step import Step

RTOL = 2e-6  # float32 values through a different summation order


def close(got: torch.Tensor, ref: torch.Tensor, rtol: float = RTOL) -> None:
    got, ref = got.float(), ref.float()
    assert got.shape == ref.shape, (tuple(got.shape), tuple(ref.shape))
    scale = ref.abs().max().item()
    assert scale > 0, "reference is all zeros"
    err = (got - ref).abs().max().item()
    assert err <= rtol * scale * 4, f"max error {err:.3g} against max |ref| {scale:.3g}"


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def randn(*shape: int, gen: torch.Generator, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype)


@pytest.fixture(scope="module")
def qwen3_args(tmp_path_factory):
    from moeprep.synth import write_synth_model

    path = write_synth_model(tmp_path_factory.mktemp("cpu-fused") / "qwen3moe.gguf", "qwen3moe")
    return arch_module("qwen3moe", path).read_args(open_gguf(path))


@pytest.mark.parametrize("style,rope_dim", [("neox", 16), ("normal", 16), ("neox", 8), ("normal", 12)])
@pytest.mark.parametrize("norms", ["per-head", "whole-projection", "none"])
@pytest.mark.parametrize("step_kind", ["one-seq", "mixed-seqs", "bf16-cache"])
def test_norm_rope_store(qwen3_args, style, rope_dim, norms, step_kind, gen):
    """Per-head Q/K norm and RoPE (NeoX halves or adjacent pairs, over all or the first channels of a head), k and v
    written into the sequence's cache rows (float32, in place; bfloat16, or a step across sequences: through
    KVCache.update), against the torch reference: the same q, the same slots read and the same cache contents
    (olmoe's whole-projection norms take the reference's own path)."""
    args = dataclasses.replace(qwen3_args, rope_style=style, rope_dim=rope_dim)
    rope = layers.Rope(args, 16, torch.device("cpu"))
    T, H, G, Dh = 2, 4, 2, 16
    q, k, v = randn(T, H, Dh, gen=gen), randn(T, G, Dh, gen=gen), randn(T, G, Dh, gen=gen)
    widths = {"per-head": (Dh, Dh), "whole-projection": (H * Dh, G * Dh), "none": None}[norms]
    q_norm, k_norm = (None, None) if widths is None else (layers.RMSNorm(randn(widths[0], gen=gen), 1e-6),
                                                          layers.RMSNorm(randn(widths[1], gen=gen), 1e-6))
    positions = torch.tensor([3, 11])
    step = (Step(positions, n_slots=12, seqs=torch.tensor([1, 0])) if step_kind == "mixed-seqs"
            else Step(positions, n_slots=12, seq=1))
    dtype = torch.bfloat16 if step_kind == "bf16-cache" else torch.float32
    held = randn(2, 2, 16, G, Dh, gen=gen)  # what the cache rows held: the rows the step does not write keep it
    results = []
    for norm_rope_store in (cpu_fused.norm_rope_store, layers.norm_rope_store):
        cache = KVCache(16, G, Dh, Dh, dtype, torch.device("cpu"), n_seq=2)
        cache.k.copy_(held[0])
        cache.v.copy_(held[1])
        out = norm_rope_store(q, k, v, q_norm, k_norm, rope, step, cache)
        results.append((*out, cache.k, cache.v))
    for got, ref in zip(*results):
        close(got, ref, rtol=2 ** -8 if got.dtype == torch.bfloat16 else RTOL)


def router(args, gating: int, normalize: bool, scale: float, k: int) -> layers.Router:
    args = dataclasses.replace(args, gating=gating, expert_weights_norm=normalize, expert_weights_scale=scale,
                               n_experts_used=k)
    return layers.Router(layers.Linear(torch.zeros(1, 1), None, "gate", None), args)


@pytest.mark.parametrize("gating,normalize,scale", [(GATING_SOFTMAX, True, 0.0), (GATING_SOFTMAX, False, 2.5),
                                                    (GATING_SIGMOID, True, 1.0),
                                                    (GATING_SOFTMAX_WEIGHT, False, 0.0)])
def test_route(qwen3_args, gating, normalize, scale, gen):
    logits = randn(5, 48, gen=gen) * 2
    ids, weights = cpu_fused.route(logits, 6, gating, normalize, scale)
    ref = router(qwen3_args, gating, normalize, scale, 6).choose_general(logits)
    assert torch.equal(ids, ref[0]), (ids, ref[0])
    close(weights, ref[1])
    # equal logits: the lowest expert id first, in descending order
    tied = torch.tensor([[0.5, 2.0, 0.5, 2.0, 1.0, 0.5]])
    assert cpu_fused.route(tied, 4, gating, normalize, scale)[0].tolist() == [[1, 3, 4, 0]]


def test_model_with_cpu_kernels(synth_model, monkeypatch):
    """A qwen3moe prefill and decode steps with the CPU's fused kernels (the default there) against the same model
    on torch ops alone: the logits agree within float32 summation-order noise. F32 weights, whose inputs are not rounded to
    8-bit blocks (that rounding would turn a last-bit difference into a quantization step now and then)."""
    import moerun

    path = synth_model("qwen3moe", expert_type="F32", attn_type="F32")
    tokens = torch.tensor([3, 17, 99, 5, 250, 1000, 42, 7, 8, 9, 10, 11])
    model = moerun.load_model(path)
    assert model.net.blocks[0].attn_norm.kernels is layers.cpu_kernels()
    monkeypatch.setenv("MOERUN_FUSED", "0")
    reference = moerun.load_model(path)
    assert reference.net.blocks[0].attn_norm.kernels is layers.TORCH_KERNELS
    for m in (reference, model):
        m.logits = [m.forward(tokens, 0)[-1]] + [m.forward(torch.tensor([t]), len(tokens) + i)[0]
                                                  for i, t in enumerate([20, 21])]
    for got, ref in zip(model.logits, reference.logits):
        close(got, ref, rtol=1e-5)
