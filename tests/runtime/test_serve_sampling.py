"""The sampler's logit changes against hand-computed values (logit_bias, llama.cpp's repeat_penalty, the API's
presence and frequency penalties) and its cuts (top_k, min_p)."""

from __future__ import annotations

import pytest
import torch

import moerun
from moerun.generation import PenalizedSampler, make_sampler


def test_penalties_and_bias_change_the_logits_as_documented():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, 0.0])
    s = PenalizedSampler(
        0.0,
        1.0,
        0,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        repeat_penalty=2.0,
        repeat_last_n=3,
        logit_bias={4: 10.0},
        prompt=[0, 0, 1, 2],
    )
    # the prompt's last 3 tokens are 0, 1, 2: divided (positive) or multiplied (negative) by 2; no answer yet
    assert s.adjust(logits).tolist() == [1.0, -2.0, 0.25, 3.0, 10.0]
    assert s(logits) == 4  # the bias made token 4 the best
    s.logit_bias.clear()
    # the answer holds token 4 once; the window is now 1, 2, 4; 0 left it
    assert s.adjust(logits).tolist() == pytest.approx([2.0, -2.0, 0.25, 3.0, -0.75])
    assert s(logits) == 3
    # token 3 once in the answer and in the window (2, 4, 3): 3 / 2 - 0.5 - 0.25, below token 0's 2
    assert s.adjust(logits)[3] == pytest.approx(3.0 / 2.0 - 0.5 - 0.25)
    assert s(logits) == 0


def test_top_k_and_min_p_cut_the_distribution():
    logits = torch.tensor([1.0, 3.0, 2.0, 0.0])
    kept, order = PenalizedSampler(1.0, 1.0, 0, top_k=2).distribution(logits)
    assert order[:2].tolist() == [1, 2] and (kept[2:] == 0).all() and (kept[:2] > 0).all()
    probs = torch.softmax(logits, -1)
    kept, order = PenalizedSampler(1.0, 1.0, 0, min_p=0.3).distribution(logits)
    assert [int(t) for t, p in zip(order, kept) if p > 0] == [t for t in (1, 2, 0, 3) if probs[t] >= 0.3 * probs[1]]
    sample = make_sampler(1.0, seed=5, top_k=1)
    assert {sample(logits) for _ in range(20)} == {1}


def test_plain_settings_are_the_greedy_function():
    assert make_sampler(0.0) is moerun.greedy
    assert make_sampler(0.0, repeat_penalty=1.3, repeat_last_n=0) is moerun.greedy
    assert make_sampler(0.0, presence_penalty=0.1) is not moerun.greedy
