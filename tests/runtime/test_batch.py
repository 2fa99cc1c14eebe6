"""Several sequences in one KV cache: a batch of their tokens gives each the logits it gets alone."""

from __future__ import annotations

import pytest
import torch

import moerun
from moeprep.errors import MoeprepError
from moerun.step import Step, group_rows

PROMPTS = ("def bisect(a, x):", "Once upon a time, in a land", "SELECT name FROM users WHERE")


@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss", "deepseek2"])
def test_batched_decode_equals_each_sequence_alone(synth_model, arch):
    path = synth_model(arch, expert_type="F32", attn_type="F32")
    alone = moerun.load_model(path)
    batched = moerun.load_model(path, n_seq=len(PROMPTS))
    prompts = [alone.tokenizer.encode(p) for p in PROMPTS]
    # each sequence alone: prefill, then three fixed continuation tokens one at a time
    continuation = [[5, 17, 99], [40, 41, 42], [7, 7, 7]]
    expected = []
    for prompt, extra in zip(prompts, continuation):
        rows = [alone.forward(torch.tensor(prompt))[-1]]
        rows += [alone.forward(torch.tensor([t]), len(prompt) + i)[0] for i, t in enumerate(extra)]
        expected.append(torch.stack(rows))
    # batched: the prompts prefilled into their own sequences (in another order, to catch a mix-up), then every
    # decode step runs all three sequences' tokens in one pass (forward_batch, and decode_batch, which moerun serve
    # calls: a CUDA graph where it can run, forward_batch here), the sequences in another order each step
    got = [[] for _ in prompts]
    for s in reversed(range(len(prompts))):
        got[s].append(batched.forward(torch.tensor(prompts[s]), 0, seq=s)[-1])
    for i, seqs in enumerate([[0, 1, 2], [2, 0, 1], [1, 2, 0]]):
        tokens = [continuation[s][i] for s in seqs]
        positions = [len(prompts[s]) + i for s in seqs]
        if i == 0:
            logits = batched.forward_batch(torch.tensor(tokens), torch.tensor(positions), torch.tensor(seqs))
        else:
            logits = batched.decode_batch(tokens, positions, seqs)
        for row, s in enumerate(seqs):
            got[s].append(logits[row])
    for s in range(len(prompts)):
        torch.testing.assert_close(torch.stack(got[s]), expected[s], rtol=1e-4, atol=1e-4)


def test_a_shared_prefix_is_kept_and_the_rest_overwritten(synth_model):
    model = moerun.load_model(synth_model("qwen3moe", expert_type="F32", attn_type="F32"), n_seq=2)
    a = model.tokenizer.encode("The cat sat on the mat and purred")
    b = a[:4] + model.tokenizer.encode(" dog barked loudly")
    model.forward(torch.tensor(a), 0, seq=1)
    went_on = model.forward(torch.tensor(b[4:]), 4, seq=1)  # the first four slots of `a` serve `b`
    fresh = model.forward(torch.tensor(b), 0, seq=0)[4:]
    torch.testing.assert_close(went_on, fresh, rtol=1e-4, atol=1e-4)


def test_unknown_sequences_are_refused(synth_model):
    model = moerun.load_model(synth_model("qwen3moe"), n_seq=2)
    with pytest.raises(MoeprepError, match="sequence 2 does not exist"):
        model.forward(torch.tensor([1, 2]), 0, seq=2)
    with pytest.raises(MoeprepError, match="does not exist"):
        model.forward_batch(torch.tensor([1, 2]), torch.tensor([0, 0]), torch.tensor([0, -1]))
    with pytest.raises(MoeprepError, match="one token per sequence"):
        model.decode_batch([1, 2], [0, 1], [1, 1])


@pytest.mark.parametrize("arch", ["qwen3moe", "deepseek2", "glm5-next"])
def test_a_prompt_chunk_rides_with_decode_tokens_and_only_chosen_rows_get_logits(synth_model, arch):
    """One forward_batch holding decode tokens of sequences 0 and 2 around a prompt chunk of sequence 1, asking for
    the logits of three rows only, gives those rows' logits as each sequence alone does (forward's last_only too)."""
    path = synth_model(arch, expert_type="F32", attn_type="F32")
    alone, batched = moerun.load_model(path), moerun.load_model(path, n_seq=3)
    first, second, third = (alone.tokenizer.encode(p) for p in PROMPTS)
    expected = [
        alone.forward(torch.tensor(first + [17]))[-1],
        alone.forward(torch.tensor(second))[-1],
        alone.forward(torch.tensor(third + [40]))[-1],
    ]
    torch.testing.assert_close(alone.forward(torch.tensor(second), 0, last_only=True), expected[1][None])
    batched.forward(torch.tensor(first), 0, seq=0)
    batched.forward(torch.tensor(third), 0, seq=2)
    tokens = torch.tensor([17] + second + [40])
    positions = torch.tensor([len(first)] + list(range(len(second))) + [len(third)])
    seqs = torch.tensor([0] + [1] * len(second) + [2])
    logits = batched.forward_batch(tokens, positions, seqs, outputs=torch.tensor([0, len(second), len(second) + 1]))
    assert logits.shape == (3, alone.args.n_vocab)
    torch.testing.assert_close(logits, torch.stack(expected), rtol=1e-4, atol=1e-4)


def test_group_rows_splits_prompt_chunks_from_single_tokens():
    assert group_rows([5, 9, 0, 1, 2, 7], [0, 2, 1, 1, 1, 3]) == ((0, 2, -1, 10), (2, 5, 1, 3), (5, 6, -1, 8))
    assert group_rows([5, 9, 4], [0, 2, 1]) == ()  # decode tokens only: one mixed step, as it is
    assert group_rows([0, 1, 2], [1, 1, 1]) == ((0, 3, 1, 3),)


@pytest.mark.parametrize("arch", ["qwen3moe", "deepseek2", "gpt-oss"])
def test_prompt_chunks_as_blocks_of_a_step_equal_each_chunk_alone(synth_model, arch):
    """A captured prompt step (graphs.PromptGraphs) runs B chunks of distinct sequences as B blocks of one length,
    naming the sequences with a (B,) tensor, each chunk padded with repeats of its last token at the positions after
    it: each chunk's last-token logits and the KV slots it writes equal the chunk run alone (a kept prefix too)."""
    path = synth_model(arch, expert_type="F32", attn_type="F32")
    alone, blocked = (moerun.load_model(path, n_seq=3) for _ in range(2))
    first, second = (alone.tokenizer.encode(p) for p in PROMPTS[:2])
    for model in (alone, blocked):
        model.forward(torch.tensor(first[:3]), 0, seq=2)  # a kept prefix the chunk of sequence 2 attends to
    chunks = [(first[3:], 3, 2), (second, 0, 0)]  # (tokens, start, sequence)
    expected = torch.cat([alone.forward(torch.tensor(t), p, seq=s, last_only=True) for t, p, s in chunks])
    tb = max(len(t) for t, _, _ in chunks) + 2
    tokens = torch.tensor([x for t, _, _ in chunks for x in t + [t[-1]] * (tb - len(t))])
    positions = torch.tensor([q for _, p, _ in chunks for q in range(p, p + tb)])
    last = torch.tensor([i * tb + len(t) - 1 for i, (t, _, _) in enumerate(chunks)])
    got = blocked.net(tokens, Step(positions, n_slots=3 + tb + 4, seq=torch.tensor([2, 0])), outputs=last)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    for block_a, block_b in zip(alone.net.blocks, blocked.net.blocks):
        for a, b in zip(block_a.attn.attn.cache.buffers(), block_b.attn.attn.cache.buffers()):
            for seq, end in ((2, len(first)), (0, len(second))):  # the slots the real tokens wrote
                torch.testing.assert_close(a[seq, :end], b[seq, :end], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["qwen3moe", "deepseek2"])
def test_a_step_given_its_sequence_as_a_device_value_equals_the_plain_step(synth_model, arch):
    """A captured prompt step (graphs.PromptGraphs) names its sequence with a (1,) tensor, so that one graph serves
    every sequence: the same chunk gives the same logits and writes the same KV slots as with the number."""
    path = synth_model(arch, expert_type="F32", attn_type="F32")
    plain, valued = (moerun.load_model(path, n_seq=3) for _ in range(2))
    prompt = plain.tokenizer.encode(PROMPTS[0])
    for model in (plain, valued):
        model.forward(torch.tensor(prompt[:3]), 0, seq=2)  # a kept prefix the chunk attends to
    positions = torch.arange(3, len(prompt))
    chunk = torch.tensor(prompt[3:])
    expected = plain.net(chunk, Step(positions, n_slots=len(prompt) + 5, seq=2))
    got = valued.net(chunk, Step(positions, n_slots=len(prompt) + 5, seq=torch.tensor([2])))
    torch.testing.assert_close(got, expected)
    for a, b in zip(plain.net.buffers(), valued.net.buffers()):
        torch.testing.assert_close(a, b)  # the KV caches: sequence 2's slots written alike, the others untouched
