"""Models whose layers keep per-sequence state besides the KV cache (recurrent states, short convolutions, indexer
key caches, DeepSeek-V4's compressors and raw-key ring) and models with sliding or chunked windows, served several
sequences at once: each answer equals the prompt's answer alone (a fresh model, sequence 0), whatever ran on its
sequence before and whatever rides with it in a pass."""

from __future__ import annotations

import pytest
import torch

import moerun
from moerun.graphs import state_kept
from moerun.serve.scheduler import Job, Scheduler
from tests.runtime.test_serve_prefix import greedy_alone

RECURRENT = ["qwen3next", "qwen35moe", "granitehybrid", "nemotron_h_moe", "lfm2moe", "glm5-next", "kimi-k3"]
WINDOWED = ["gpt-oss", "gemma4", "mimo2", "step35", "laguna", "llama4"]
INDEXED = ["deepseek32", "glm-dsa", "deepseek4"]  # DeepSeek-V4: its compressors' rings and raw-key ring too
# longer than the synthetic models' sliding window (16 positions) and than several of DeepSeek-V4's blocks of 4
PREAMBLE = "import os, sys, math, json, time, random, itertools, functools\n\n"
PROMPTS = ("def bisect(a, x):\n    lo, hi", "Once upon a time, in a land far away", "SELECT name FROM users WHERE")


@pytest.mark.parametrize("arch", RECURRENT)
def test_a_step_under_state_kept_leaves_no_trace(synth_model, arch):
    """A CUDA graph is captured the first time its step comes, in the middle of a sequence, after one uncaptured run
    of the step (graphs.capture_program); the replay then runs it again. Under state_kept that first run leaves the
    recurrent state as it was, so the sequence takes its token once (a KV slot, or DeepSeek-V4's rings, written
    twice by position hold the same either way)."""
    path = synth_model(arch, expert_type="F32", attn_type="F32")
    model, alone = moerun.load_model(path, n_ctx=128), moerun.load_model(path, n_ctx=128)
    prompt = model.tokenizer.encode(PROMPTS[0])
    for m in (model, alone):
        m.forward(torch.tensor(prompt))
    want = alone.decode(17, len(prompt))
    with state_kept(model.net):
        assert torch.equal(model.decode(17, len(prompt)), want)
    torch.testing.assert_close(model.decode(17, len(prompt)), want, rtol=1e-5, atol=1e-5)
    twice = model.decode(17, len(prompt))  # the token taken a second time: a state that differs
    assert (twice - want).abs().max() > 1e-3


@pytest.mark.parametrize("arch", RECURRENT + WINDOWED + INDEXED)
def test_served_answers_equal_each_prompt_alone(synth_model, arch):
    """Three sequences, four jobs, prompts prefilled 5 tokens a step beside the others' decode tokens; then jobs on
    the sequences they left: a shared prefix only, the whole of what a sequence ran and more, exactly what one ran;
    then a job cancelled while its prompt is prefilled, and one after it on its sequence."""
    path = synth_model(arch, expert_type="F32", attn_type="F32")
    alone, model = moerun.load_model(path, n_ctx=128), moerun.load_model(path, n_ctx=128, n_seq=3)
    sched = Scheduler(model, prefill_chunk=5)
    enc = model.tokenizer.encode

    def serve(prompts: list[list[int]], n: int, cancel_after: int | None = None) -> list[list[int]]:
        ids = [sched.add(Job(p, n, ignore_eos=True)) for p in prompts]
        tokens: dict[int, list[int]] = {i: [] for i in ids}
        steps = 0
        while sched.busy:
            if steps == cancel_after:
                sched.cancel(ids[0])
            for out in sched.step():
                tokens[out.job].append(out.token)
            steps += 1
        return [tokens[i] for i in ids]

    def check(prompts: list[list[int]], got: list[list[int]], n: int) -> None:
        for prompt, tokens in zip(prompts, got):
            assert tokens == greedy_alone(alone, prompt, n)

    first = [enc(PREAMBLE + p) for p in PROMPTS] + [enc("The cat sat on the mat")]
    check(first, serve(first, 4), 4)
    ran = [list(s.tokens) for s in sched.sequences]
    again = [ran[0][:6] + enc(" quietly beside"), ran[1] + enc(" and then"), list(ran[2])]
    check(again, serve(again, 4), 4)
    cancelled = enc(PREAMBLE + "A long prompt that is cancelled while it is still being read")
    after = serve([cancelled, enc("The dog barked")], 4, cancel_after=1)
    assert after[0] == []  # cancelled before its first token
    check([enc("The dog barked")], after[1:], 4)
    last = [cancelled[:9], first[1] + enc(" again")]
    check(last, serve(last, 4), 4)
