"""Text generation as plain functions: prefill the prompt, then decode one token at a time with a sampler.

A sampler is any callable from next-token logits (V,) to a token id: `greedy`, or `make_sampler(...)` for
temperature, top-k, nucleus (top-p) and min-p sampling with its own seeded generator, optionally after logit biases
and repetition penalties over the tokens it has picked so far.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch

from moerun.model import Model

Sampler = Callable[[torch.Tensor], int]


def greedy(logits: torch.Tensor) -> int:
    return int(torch.argmax(logits))


class PenalizedSampler:
    """A sampler with a memory: the tokens it picked (and the prompt's last ones, for repeat_penalty) change the
    logits of the next pick. One per request: it is stateful.

    The logits are changed in this order: logit_bias added; repeat_penalty over the last `repeat_last_n` tokens of
    prompt and answer (llama.cpp's: a positive logit divided by it, a negative one multiplied); presence_penalty once
    and frequency_penalty per occurrence, subtracted for the tokens of the answer so far (the OpenAI API's). Then
    temp <= 0 takes the argmax; otherwise softmax(logits / temp) is cut to the top_k most likely tokens, the top_p
    probability mass and the tokens at least min_p times as likely as the most likely one, and sampled.
    """

    def __init__(
        self,
        temp: float,
        top_p: float,
        seed: int | None,
        top_k: int = 0,
        min_p: float = 0.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repeat_penalty: float = 1.0,
        repeat_last_n: int = 64,
        logit_bias: Mapping[int, float] | None = None,
        prompt: Sequence[int] = (),
    ) -> None:
        self.temp, self.top_p, self.top_k, self.min_p = temp, top_p, top_k, min_p
        self.presence, self.frequency, self.repeat = presence_penalty, frequency_penalty, repeat_penalty
        self.logit_bias = dict(logit_bias or {})
        self.generator = torch.Generator()
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)
        # the prompt's and answer's last repeat_last_n tokens (< 0: all of them)
        self.recent: deque[int] = deque(prompt, maxlen=None if repeat_last_n < 0 else repeat_last_n)
        self.answer: Counter[int] = Counter()

    def adjust(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits after the biases and penalties (a float32 copy on the CPU)."""
        logits = logits.float().cpu().clone()
        if self.logit_bias:
            ids = torch.tensor(list(self.logit_bias))
            logits[ids] += torch.tensor(list(self.logit_bias.values()))
        if self.repeat != 1.0 and self.recent:
            ids = torch.tensor(sorted(set(self.recent)))
            seen = logits[ids]
            logits[ids] = torch.where(seen > 0, seen / self.repeat, seen * self.repeat)
        if (self.presence or self.frequency) and self.answer:
            ids = torch.tensor(list(self.answer))
            counts = torch.tensor(list(self.answer.values()), dtype=torch.float32)
            logits[ids] -= self.presence + self.frequency * counts
        return logits

    def __call__(self, logits: torch.Tensor) -> int:
        logits = self.adjust(logits)
        token = int(torch.argmax(logits)) if self.temp <= 0 else self._sample(logits)
        self.recent.append(token)
        self.answer[token] += 1
        return token

    def distribution(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (the kept probabilities, most likely first, zero where cut; their token ids) of adjusted logits."""
        probs = torch.softmax(logits / self.temp, dim=-1)
        sorted_probs, order = torch.sort(probs, descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least the most likely token)
        outside = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= self.top_p
        if self.top_k > 0:
            outside[self.top_k :] = True
        if self.min_p > 0:
            outside |= sorted_probs < self.min_p * sorted_probs[0]
        return sorted_probs.masked_fill(outside, 0.0), order

    def _sample(self, logits: torch.Tensor) -> int:
        """One uniform draw from the generator per token, through the kept probabilities' cumulative sum."""
        kept, order = self.distribution(logits)
        cumulative = torch.cumsum(kept, dim=-1)
        u = float(torch.rand(1, generator=self.generator)) * float(cumulative[-1])
        return int(order[min(int(torch.searchsorted(cumulative, u, right=True)), int((kept > 0).sum()) - 1)])


def make_sampler(
    temp: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    *,
    top_k: int = 0,
    min_p: float = 0.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    repeat_penalty: float = 1.0,
    repeat_last_n: int = 64,
    logit_bias: Mapping[int, float] | None = None,
    prompt: Sequence[int] = (),
) -> Sampler:
    """temp <= 0 is greedy (`greedy` itself when nothing else changes the logits); otherwise sample from
    softmax(logits / temp) cut by top_k (0: off), top_p and min_p. See PenalizedSampler for the rest; `prompt` is
    the request's prompt ids, which repeat_penalty looks back into."""
    plain = (
        not logit_bias
        and presence_penalty == 0
        and frequency_penalty == 0
        and (repeat_penalty == 1.0 or repeat_last_n == 0)
    )
    if temp <= 0 and plain:
        return greedy
    return PenalizedSampler(
        temp,
        top_p,
        seed,
        top_k,
        min_p,
        presence_penalty,
        frequency_penalty,
        repeat_penalty if repeat_last_n else 1.0,
        repeat_last_n,
        logit_bias,
        prompt,
    )


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
