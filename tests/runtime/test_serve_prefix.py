"""A new job keeps what its sequence already ran only where the model's state allows: any shared prefix for a model
whose layers read their past from per-position slots, only a prefix that is everything the sequence ran for one
whose state folds in every token (a recurrent state, a short convolution, a compressor's ring)."""

from __future__ import annotations

import pytest
import torch

import moerun
from moerun.serve.scheduler import Job, Scheduler


def greedy_alone(model, ids: list[int], n: int) -> list[int]:
    """n greedy tokens after `ids` from position 0 of sequence 0, none of them a near-tie."""
    logits = model.forward(torch.tensor(ids))[-1]
    out: list[int] = []
    for i in range(n):
        top = torch.topk(logits, 2).values
        assert top[0] - top[1] > 1e-4, "a near-tied greedy step: pick another prompt"
        out.append(int(logits.argmax()))
        logits = model.forward(torch.tensor([out[-1]]), len(ids) + i)[0]
    return out


@pytest.mark.parametrize(
    ("arch", "keeps_history"), [("qwen3moe", False), ("qwen3next", True), ("lfm2moe", True), ("deepseek4", True)]
)
def test_a_prompt_keeps_a_prefix_only_where_the_state_allows(synth_model, arch, keeps_history):
    path = synth_model(arch, expert_type="F32", attn_type="F32")
    model = moerun.load_model(path, n_ctx=128)
    assert model.keeps_history is keeps_history
    starts: list[int] = []  # the start position of every prompt chunk the scheduler runs
    prefill_chunks = model.prefill_chunks

    def record(chunks):
        starts.extend(start for _, start, _ in chunks)
        return prefill_chunks(chunks)

    model.prefill_chunks = record
    sched = Scheduler(model)

    def serve(prompt: list[int], n: int) -> list[int]:
        starts.clear()
        job = sched.add(Job(prompt, n, ignore_eos=True))
        tokens: list[int] = []
        while sched.busy:
            tokens += [o.token for o in sched.step() if o.job == job]
        return tokens

    enc = model.tokenizer.encode
    first = enc("The cat sat on the mat and purred at the dog")
    serve(first, 4)
    ran = list(sched.sequences[0].tokens)
    assert ran[: len(first)] == first and len(ran) == len(first) + 3  # the last token was picked, never run
    # a prompt sharing only part of what the sequence ran
    branch = first[:5] + enc(" quietly beside an open window")
    got = serve(branch, 5)
    assert starts[0] == (0 if keeps_history else 5)
    # a prompt going on from everything the sequence ran keeps all of it
    more = list(sched.sequences[0].tokens) + enc(" and then")
    went_on = serve(more, 5)
    assert starts[0] == len(more) - len(enc(" and then"))
    fresh = moerun.load_model(path, n_ctx=128)
    assert got == greedy_alone(fresh, branch, 5)
    assert went_on == greedy_alone(fresh, more, 5)
