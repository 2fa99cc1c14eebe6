"""Perplexity over non-overlapping chunks, scored the way llama-perplexity scores them.

The text's tokens (BOS included when the vocabulary adds one) are cut into len // n_ctx chunks of n_ctx tokens.
Each chunk runs as a fresh sequence, its first token replaced by BOS when the vocabulary adds one, and only its
second half is scored: the logits at positions n_ctx/2 .. n_ctx-2 predict the tokens after them, so every scored
token has at least n_ctx/2 tokens of context.
"""

from __future__ import annotations

import math

import torch

from moeprep.errors import MoeprepError
from moerun.model import Model


def perplexity(model: Model, tokens: list[int], n_ctx: int) -> float:
    if len(tokens) < 2 * n_ctx:
        raise MoeprepError(
            f"perplexity with a context of {n_ctx} needs at least {2 * n_ctx} tokens; the text has {len(tokens)}"
        )
    bos = model.tokenizer.bos_id if model.tokenizer.add_bos else None
    first = n_ctx // 2
    nll, count = 0.0, 0
    for start in range(0, len(tokens) // n_ctx * n_ctx, n_ctx):
        chunk = torch.tensor(tokens[start : start + n_ctx], dtype=torch.long)
        inputs = chunk.clone()
        if bos is not None:
            inputs[0] = bos
        logits = model.forward(inputs, 0)[first : n_ctx - 1]  # (n_ctx - 1 - first, V)
        log_probs = torch.log_softmax(logits.double(), dim=-1)
        targets = chunk[first + 1 :].to(log_probs.device)
        nll -= float(log_probs.gather(-1, targets[:, None]).sum())
        count += len(targets)
    return math.exp(nll / count)
