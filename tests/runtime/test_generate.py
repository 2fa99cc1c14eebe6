"""Generation (greedy and seeded sampling) and perplexity, the latter against llama.cpp's logits."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import moerun
from moeprep.errors import MoeprepError
from moerun.generation import make_sampler
from tests.oracle import llama_eval
from tests.runtime.conftest import SMOKE_ARCHS


def test_greedy_generation_follows_the_argmax(synth_model):
    model = moerun.load_model(synth_model("qwen3moe", expert_type="F32", attn_type="F32"))
    prompt = model.tokenizer.encode("def bisect(a, x):")
    out = list(moerun.generate(model, prompt, 12, moerun.greedy))
    assert len(out) <= 12
    # each token is the argmax of a fresh, uncached run over everything before it
    seq = list(prompt)
    for token in out:
        assert token == int(model.forward(torch.tensor(seq))[-1].argmax())
        seq.append(token)


def test_seeded_sampling_is_reproducible(synth_model):
    model = moerun.load_model(synth_model("qwen3moe"))
    prompt = model.tokenizer.encode("Once upon a time")
    runs = [list(moerun.generate(model, prompt, 16, make_sampler(1.0, 0.9, seed=7))) for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 16
    assert make_sampler(0.0) is moerun.greedy


def test_top_p_keeps_the_nucleus():
    logits = torch.tensor([5.0, 4.0, -10.0, -10.0])
    sample = make_sampler(1.0, top_p=0.5, seed=0)
    assert {sample(logits) for _ in range(50)} == {0}  # token 0 alone holds over half the mass


def _llama_cpp_perplexity(path, tokens: list[int], n_ctx: int, bos: int | None) -> float:
    """llama-perplexity's rule computed from llama.cpp's logits: non-overlapping chunks of n_ctx tokens, the first
    replaced by BOS when the vocabulary adds one, the second half of each chunk scored."""
    first, nll, count = n_ctx // 2, 0.0, 0
    for start in range(0, len(tokens) // n_ctx * n_ctx, n_ctx):
        chunk = tokens[start : start + n_ctx]
        logits = llama_eval(path, [bos, *chunk[1:]] if bos is not None else chunk).logits.astype(np.float64)
        for j in range(first, n_ctx - 1):
            row = logits[j]
            nll -= row[chunk[j + 1]] - (row.max() + math.log(np.exp(row - row.max()).sum()))
            count += 1
    return math.exp(nll / count)


@pytest.mark.parametrize("arch", SMOKE_ARCHS)
def test_perplexity_matches_llama_cpp(arch, synth_model, calibration_text):
    path = synth_model(arch)
    model = moerun.load_model(path, n_ctx=128)
    tokens = model.tokenizer.encode(calibration_text[:3000])[: 3 * 128 + 17]
    ours = moerun.perplexity(model, tokens, 128)
    bos = model.tokenizer.bos_id if model.tokenizer.add_bos else None
    reference = _llama_cpp_perplexity(path, tokens, 128, bos)
    # Robust on any machine's llama.cpp build: a routing near-tie that goes the other way there (tests/near_ties.py)
    # moves one position's logits by about 1e-2 of their range, its loss by under 0.1, and so the perplexity of the
    # ~190 scored positions by under 1e-3 of itself; the bar leaves room for several such ties.
    assert abs(ours / reference - 1) <= 0.005, f"perplexity {ours:.4f} vs llama.cpp's {reference:.4f}"


def test_perplexity_needs_two_chunks(synth_model):
    model = moerun.load_model(synth_model("qwen3moe"), n_ctx=64)
    with pytest.raises(MoeprepError, match="needs at least 128 tokens"):
        moerun.perplexity(model, list(range(100)), 64)
