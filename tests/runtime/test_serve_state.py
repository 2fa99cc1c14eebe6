"""Models whose layers keep per-sequence state besides the KV cache (recurrent states, short convolutions, indexer
key caches, DeepSeek-V4's compressors and raw-key ring) and models with sliding or chunked windows, served several
sequences at once: each answer equals the prompt's answer alone (a fresh model, sequence 0), whatever ran on its
sequence before and whatever rides with it in a pass."""

from __future__ import annotations

import dataclasses
from unittest.mock import MagicMock

import pytest
import torch

import moerun
from moerun import graphs
from moerun.capture import Program
from moerun.serve.scheduler import Job, Scheduler
from tests.runtime.test_serve_prefix import greedy_alone

RECURRENT = ["qwen3next", "qwen35moe", "granitehybrid", "nemotron_h_moe", "lfm2moe", "glm5-next", "kimi-k3"]
WINDOWED = ["gpt-oss", "gemma4", "mimo2", "step35", "laguna", "llama4"]
INDEXED = ["deepseek32", "glm-dsa", "deepseek4"]  # DeepSeek-V4: its compressors' rings and raw-key ring too
# longer than the synthetic models' sliding window (16 positions) and than several of DeepSeek-V4's blocks of 4
PREAMBLE = "import os, sys, math, json, time, random, itertools, functools\n\n"
PROMPTS = ("def bisect(a, x):\n    lo, hi", "Once upon a time, in a land far away", "SELECT name FROM users WHERE")


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


class WithoutCuda:
    """torch, its CUDA streams, pools and waits stood in for (graphs.py's only CUDA calls besides the capture)."""

    cuda = MagicMock()

    def __getattr__(self, name: str):
        return getattr(torch, name)


class RecordedCapture:
    """A stand-in for capture.Capture on a machine without CUDA, as a capture behaves: what runs under it leaves no
    trace in the model's buffers (a capture records the kernels, it does not run them), and the program replays the
    step for real (the test's recording_forward)."""

    def __init__(self, net: torch.nn.Module) -> None:
        self.net, self.program = net, Program()

    def __enter__(self) -> RecordedCapture:
        self.kept = [(b, b.clone()) for b in self.net.buffers()]
        return self

    def __exit__(self, *exc) -> None:
        for buffer, saved in self.kept:
            if not torch.equal(buffer, saved):  # (the weights' buffers may be read-only maps of the file)
                buffer.copy_(saved)


@pytest.mark.parametrize("arch", RECURRENT)
def test_decode_graphs_first_met_mid_sequence_take_each_token_once(synth_model, arch, monkeypatch):
    """DecodeGraphs capture a step the first time its key comes, in the middle of a sequence (here: after a prompt,
    the first decode step of a sequence alone, then of two sequences), after one uncaptured run of the step: each
    step, captured or replayed, gives the eager step's logits, its tokens fed to the recurrent states once. The CUDA
    calls are stood in for, so this runs on the CPU: a capture that records without running, a replay that runs."""
    path = synth_model(arch, expert_type="F32", attn_type="F32")
    graphed, eager = (moerun.load_model(path, n_ctx=128, n_seq=2) for _ in range(2))
    monkeypatch.setattr(graphs, "torch", WithoutCuda())
    net, forward = graphed.net, graphed.net.forward

    def recording_forward(tokens, step, outputs=None):  # the capture's program replays the step
        out = forward(tokens, step, outputs)
        if step.capture is not None:  # a replay reads the static inputs anew (its masks too)
            step.capture.program.parts.append(lambda: out.copy_(forward(tokens, uncaptured(step), outputs)))
        return out

    def uncaptured(step):
        return dataclasses.replace(step, capture=None, _masks={}, _copies={}, _parts=[])

    monkeypatch.setattr(net, "forward", recording_forward)
    monkeypatch.setattr(graphs, "Capture", lambda pool: RecordedCapture(net))
    decode_graphs = graphs.DecodeGraphs(graphed)
    prompts = [graphed.tokenizer.encode(p) for p in PROMPTS[:2]]
    for model in (graphed, eager):
        for s, prompt in enumerate(prompts):
            model.forward(torch.tensor(prompt), 0, seq=s)
    a, b = (len(p) for p in prompts)
    steps = [([17], [a], [0]), ([5], [a + 1], [0]), ([9, 40], [a + 2, b], [0, 1]), ([11, 3], [a + 3, b + 1], [0, 1])]
    for tokens, positions, seqs in steps:
        want = eager.forward_batch(torch.tensor(tokens), torch.tensor(positions), torch.tensor(seqs))
        torch.testing.assert_close(decode_graphs(tokens, positions, seqs), want, rtol=1e-4, atol=1e-4)
    assert len(decode_graphs.graphs) == 2  # each key captured once, the first time it came


@pytest.mark.parametrize("arch", RECURRENT + WINDOWED + INDEXED)
def test_one_pass_of_a_token_a_restart_and_a_chunk_equals_each_sequence_alone(synth_model, arch):
    """One forward_batch holding, in this order, a decode token of sequence 2, sequence 1 started anew at position 0
    (over what it ran before) and four more tokens of sequence 0: the two chunks' rows equal each sequence run alone,
    and so does sequence 2's next token after it. (The decode token's own row is left out: a product of one row and
    one of many take different kernels, whose roundings differ.)"""
    path = synth_model(arch, expert_type="F32", attn_type="F32")
    alone, batched = moerun.load_model(path, n_ctx=128), moerun.load_model(path, n_ctx=128, n_seq=3)
    first, second, third = (batched.tokenizer.encode(PREAMBLE + p) for p in PROMPTS)
    batched.forward(torch.tensor(first), 0, seq=0)
    batched.forward(torch.tensor(third[::-1]), 0, seq=1)  # what sequence 1 ran before it starts anew
    batched.forward(torch.tensor(third), 0, seq=2)
    more = [5, 17, 99, 7]
    tokens = torch.tensor([40] + second + more)
    positions = torch.tensor([len(third)] + list(range(len(second))) + list(range(len(first), len(first) + 4)))
    seqs = torch.tensor([2] + [1] * len(second) + [0] * 4)
    got = batched.forward_batch(tokens, positions, seqs, outputs=torch.arange(1, len(tokens)))
    want = [alone.forward(torch.tensor(second))]
    alone.forward(torch.tensor(first))
    want.append(alone.forward(torch.tensor(more), len(first)))  # in the same chunks as the batched sequence
    torch.testing.assert_close(got, torch.cat(want), rtol=1e-4, atol=1e-4)
    alone.forward(torch.tensor(third))
    alone.forward(torch.tensor([40]), len(third))
    torch.testing.assert_close(
        batched.decode(3, len(third) + 1, seq=2), alone.decode(3, len(third) + 1), rtol=1e-4, atol=1e-4
    )
