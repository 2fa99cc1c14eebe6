"""Text generation as plain functions: prefill the prompt, then decode one token at a time with a sampler.

A sampler is any callable from next-token logits (V,) to a token id: `greedy`, or `make_sampler(temp, top_p,
seed)` for temperature / nucleus sampling with its own seeded generator.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from moerun.model import Model

Sampler = Callable[[torch.Tensor], int]


def greedy(logits: torch.Tensor) -> int:
    return int(torch.argmax(logits))


def make_sampler(temp: float = 0.0, top_p: float = 1.0, seed: int | None = None) -> Sampler:
    """temp <= 0 is greedy; otherwise sample from softmax(logits / temp) cut to the top-p probability mass."""
    if temp <= 0:
        return greedy
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)

    def sample(logits: torch.Tensor) -> int:
        probs = torch.softmax(logits.float().cpu() / temp, dim=-1)
        sorted_probs, order = torch.sort(probs, descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least the most likely token)
        outside = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= top_p
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        return int(order[torch.multinomial(sorted_probs, 1, generator=generator)])

    return sample


def prefill(model: Model, prompt_ids: list[int]) -> torch.Tensor:
    """Run the prompt from position 0; the logits (V,) for the token after it."""
    tokens = torch.tensor(prompt_ids, dtype=torch.long)
    return model.forward(tokens, 0, last_only=True)[0]


def decode_one(model: Model, token: int, pos: int) -> torch.Tensor:
    """Feed one token at position `pos`; the logits (V,) for the next."""
    return model.decode(token, pos)


def generate(model: Model, prompt_ids: list[int], n_predict: int, sampler: Sampler = greedy) -> Iterator[int]:
    """Yield up to n_predict new token ids, stopping after an end-of-generation token."""
    if not prompt_ids:
        raise ValueError("generate needs at least one prompt token")
    logits = prefill(model, prompt_ids)
    for i in range(n_predict):
        token = sampler(logits)
        yield token
        if token in model.tokenizer.eog_ids or i == n_predict - 1:
            return
        logits = decode_one(model, token, len(prompt_ids) + i)
