"""Continuous batching as a plain object: `add` jobs, call `step` until it has nothing to do, `cancel` at any time.

The model's KV cache holds n_seq sequences. A job waits in a bounded queue until a sequence is free, then runs its
prompt through that sequence in chunks, and from its first token on decodes one token per step. Every step runs one
token of each decoding job, plus up to `prefill_chunk` prompt tokens of the jobs still prefilling (the oldest
first), so a long prompt rides along with the others' decode steps instead of stalling them, and the output head
runs only on the rows that give a token. Eagerly that is one pass through the model (`forward_batch`); where the
model replays prompt chunks as CUDA graphs (`moerun serve` on a GPU), the decode tokens are one graph and each chunk
another. A job leaves the moment it finishes
(an end-of-generation token, a stop string, its token limit or the end of the context) or is cancelled, and its
sequence takes the next job at the next step.

On a GPU a waiting prompt may be held back a few milliseconds for others to come (`gather_s`): while fewer prompts
wait than there are sequences running or freed within that time (clients that were just answered, and who send their
next request a round trip later), the decoding goes on and the prompts that arrive meanwhile start together, in one
pass, where one by one each would hold every decoding stream for a whole prompt pass.

Each sequence remembers the token ids whose KV its slots hold. A new job goes to the free sequence that shares the
longest prefix with its prompt and starts at the end of that prefix: a chat that goes on prefills only its new turn.
A model with recurrent state (Model.keeps_history) can go on only from where a sequence stopped: there the prefix
is kept only when it is all the sequence ran.

Text comes out in whole UTF-8 characters, and a stop string ends the job where it starts (the string itself is not
returned); text that could still turn out to begin a stop string is held back until it cannot.
"""

from __future__ import annotations

import codecs
import itertools
import math
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from moerun.generation import Sampler, greedy
from moerun.model import Model

# Prompt tokens one step runs, over all the jobs still prefilling, by the device the model runs on
# (docs/history/benchmarks-log.md has the measurements).
# On a GPU, where prompt steps replay CUDA graphs, more prompts in a step cost little more than one (the routed
# experts' weights are read once a step): eight 64-token prompts took 65 ms as one step of the 30B-shaped model on
# the H200, 87 as two; llama.cpp's default micro-batch is 512 tokens too. On the CPU a step's time grows with its
# tokens and a longer one only holds the decoding streams longer: 8 streams made 3.69-3.72x one stream's tok/s with
# 256, 3.46-3.50x with 512 (the trained bench model, a 2-core VM).
PREFILL_CHUNK = {"cuda": 512, "cpu": 256}
# Seconds a waiting prompt may be held back for more to come (see the module docstring), by device: on a GPU eight
# 64-token prompts in one step took 65 ms against 21.5 for one alone (the 30B-shaped model, H200), so gathering a few
# costs the first one's client a few milliseconds and saves the others a pass each; on the CPU a step's time grows
# with its tokens, and gathering would only delay. On the H200: 8 streams 876.3 -> 928.1 tok/s, 4 streams
# 609.1 -> 638.2, one unchanged, against 0 in the same run; 40 ms gathered no more (docs/history/benchmarks-log.md).
GATHER_S = {"cuda": 0.02, "cpu": 0.0}


class QueueFull(Exception):
    """Every sequence is busy and the waiting queue is at its limit."""


@dataclass(frozen=True)
class Job:
    prompt: list[int]
    max_tokens: int | None  # None: until the context is full
    sampler: Sampler = greedy
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # the end-of-generation tokens are never sampled: the job ends on its limit or a stop
    logprobs: int | None = None  # None: none; k: each token's log-probability and the k most likely tokens' too
    control_text: dict[int, bytes] = field(default_factory=dict)  # control tokens whose text the answer shows
    grammar: Any = None  # a grammar.Constraint: each step's token is picked among those its grammar allows


@dataclass(frozen=True)
class Output:
    """What one step produced for one job: new text, and finish_reason once it is done ("stop" or "length")."""

    job: int
    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens whose KV was already in the sequence
    token: int = -1  # the token this step picked
    logprobs: TokenLogprobs | None = None  # where the job asked for them


@dataclass(frozen=True)
class TokenLogprobs:
    """A picked token's log-probability under the model (the log-softmax of its logits, before any sampling
    setting or penalty) and the `top` most likely tokens' (id, log-probability), most likely first."""

    logprob: float
    top: tuple[tuple[int, float], ...]


class TextStream:
    """Token bytes -> text deltas: whole characters only, cut at the first stop string, holding back any tail that
    could be the start of one."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stops = stops
        self._held = ""

    def push(self, data: bytes) -> tuple[str, bool]:
        """-> (text to send, whether a stop string was reached)."""
        held = self._held + self._decoder.decode(data)
        hits = [i for s in self._stops if (i := held.find(s)) >= 0]
        if hits:
            self._held = ""
            return held[: min(hits)], True
        keep = max((k for s in self._stops for k in range(1, len(s)) if held.endswith(s[:k])), default=0)
        self._held = held[len(held) - keep :]
        return held[: len(held) - keep], False

    def flush(self) -> str:
        """The held-back text, and a replacement character for an unfinished UTF-8 sequence: the job is over."""
        text, self._held = self._held + self._decoder.decode(b"", final=True), ""
        return text


@dataclass
class _Running:
    id: int
    job: Job
    feed: list[int]  # tokens to run next: the rest of the prompt, then the last sampled token
    limit: int  # completion tokens allowed: max_tokens within the context
    cached: int
    text: TextStream
    generated: int = 0


@dataclass
class _Sequence:
    tokens: list[int] = field(default_factory=list)  # the ids whose KV sits at positions 0.. of this sequence
    job: _Running | None = None
    last_used: int = 0
    freed_at: float = -math.inf  # when its last job finished (the `now` clock's seconds)


class Scheduler:
    def __init__(
        self,
        model: Model,
        max_queue: int = 64,
        prefill_chunk: int | None = None,
        gather_s: float | None = None,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        self.model, self.max_queue = model, max_queue
        self.prefill_chunk = prefill_chunk or PREFILL_CHUNK[model.device.type]
        self.gather_s = GATHER_S[model.device.type] if gather_s is None else gather_s
        self.sequences = [_Sequence() for _ in range(model.n_seq)]
        self.waiting: deque[tuple[int, Job]] = deque()
        self._arrived: dict[int, float] = {}  # waiting job id -> when it was added
        self._ids = itertools.count()
        self._clock = itertools.count(1)
        self._now = now
        self._step_s = math.inf  # the time between the last two steps
        self._mask_thread: ThreadPoolExecutor | None = None  # grammar masks (_start_masks), started on first use
        self._last_step = -math.inf

    @property
    def busy(self) -> bool:
        return bool(self.waiting) or self.running

    @property
    def running(self) -> bool:
        return any(s.job for s in self.sequences)

    def held_s(self) -> float:
        """Seconds for which the waiting prompts are still held back for more to come (0: they start at the next
        step): at most gather_s after the first of them arrived, while a sequence is free for them and fewer wait
        than there are sequences whose clients may send one meanwhile: freed within gather_s, or decoding a job
        whose token limit comes before the hold ends (at the last step's pace)."""
        free = sum(s.job is None for s in self.sequences)
        if not (self.waiting and free and self.gather_s):
            return 0.0
        now = self._now()
        left = self._arrived[self.waiting[0][0]] + self.gather_s - now
        if left <= 0:
            return 0.0
        coming = sum(
            now - s.freed_at < self.gather_s
            if s.job is None
            else s.job.generated > 0 and (s.job.limit - s.job.generated) * self._step_s <= left
            for s in self.sequences
        )
        return left if len(self.waiting) < coming else 0.0

    def counts(self) -> dict[str, int]:
        return {
            "sequences": len(self.sequences),
            "running": sum(s.job is not None for s in self.sequences),
            "waiting": len(self.waiting),
        }

    def add(self, job: Job) -> int:
        """Queue a job; its id. Raises QueueFull when max_queue jobs wait already with no sequence free."""
        assert 0 < len(job.prompt) < self.model.n_ctx, "the caller checks the prompt against the context"
        free = sum(s.job is None for s in self.sequences)  # jobs up to this many wait only for the next step
        if len(self.waiting) >= self.max_queue + free:
            raise QueueFull(f"{len(self.waiting)} requests are waiting for one of {len(self.sequences)} sequences")
        job_id = next(self._ids)
        self.waiting.append((job_id, job))
        self._arrived[job_id] = self._now()
        return job_id

    def cancel(self, job_id: int) -> None:
        """Drop a waiting or running job (a client that went away); its sequence is free at once."""
        self.waiting = deque((i, j) for i, j in self.waiting if i != job_id)
        self._arrived.pop(job_id, None)
        for s in self.sequences:
            if s.job and s.job.id == job_id:
                s.job = None

    def reset(self) -> list[int]:
        """Drop every job and forget every sequence's contents (after a failed step); the ids dropped."""
        dropped = [i for i, _ in self.waiting] + [s.job.id for s in self.sequences if s.job]
        self.waiting.clear()
        self._arrived.clear()
        self.sequences = [_Sequence() for _ in self.sequences]
        return dropped

    def step(self, launched: Callable[[], None] = lambda: None) -> list[Output]:
        """Admit waiting jobs to free sequences, then run a token of every decoding job and the next prompt chunks
        of the prefilling ones, within prefill_chunk prompt tokens: in one pass, or where the model runs prompt
        chunks as CUDA graphs (Model.capture_prompt_steps), the decode tokens in one pass and the prompt chunks in
        another (two graph replays cost less than one eager pass). `launched` is called once the first pass is on
        its way on the device, before the step waits for it (on the CPU: once it has run): the caller's work there
        overlaps the step's."""
        now = self._now()
        self._step_s, self._last_step = now - self._last_step, now
        self._admit()
        runs = sorted((seq.job.id, s) for s, seq in enumerate(self.sequences) if seq.job)
        budget = self.prefill_chunk
        chunks: list[tuple[int, list[int]]] = []  # (sequence, the tokens it runs now)
        for _, s in runs:
            r = self.sequences[s].job
            if r.generated:
                chunk = r.feed
            else:
                chunk, budget = r.feed[:budget], budget - min(budget, len(r.feed))
            if chunk:
                chunks.append((s, chunk))
        if self.model.prompt_graphs is None:
            passes = [chunks] if chunks else []
        else:  # the decode tokens, then the prompt chunks (Model.prefill_chunks runs them together where they fit)
            single, prompts = [c for c in chunks if len(c[1]) == 1], [c for c in chunks if len(c[1]) > 1]
            passes = [p for p in (single, prompts) if p]
        outputs = [out for i, part in enumerate(passes) for out in self._pass(part, launched if i == 0 else None)]
        if not passes:
            launched()
        return outputs

    def _pass(self, chunks: list[tuple[int, list[int]]], launched: Callable[[], None] | None) -> list[Output]:
        """One pass through the model of these sequences' tokens; a token for each that finished its feed."""
        starts: list[int] = []
        ready: list[tuple[int, int]] = []  # (chunk, sequence) of the chunks whose last logits give a token
        for i, (s, chunk) in enumerate(chunks):
            seq = self.sequences[s]
            starts.append(len(seq.tokens))
            seq.tokens += chunk
            seq.job.feed = seq.job.feed[len(chunk) :]
            if not seq.job.feed:
                ready.append((i, s))
        runs = [self.sequences[s].job for _, s in ready]
        masks = self._start_masks(runs)  # in a worker thread, while the pass runs
        logits = self._forward(chunks, starts, [i for i, _ in ready])
        if launched is not None:
            launched()
        picked = self._sample(runs, logits, masks)
        return [self._emit(self.sequences[s], token, lp) for (_, s), (token, lp) in zip(ready, picked)]

    def _forward(self, chunks: list[tuple[int, list[int]]], starts: list[int], rows: list[int]) -> torch.Tensor:
        """One pass -> the logits (R, V) of the last tokens of the chunks `rows`: a decode step when each chunk is
        one token (CUDA graphs where they run); one prompt chunk, or the prompt chunks of a model running prompt
        graphs, through Model.prefill_chunks; otherwise one forward_batch of them all."""
        if all(len(chunk) == 1 for _, chunk in chunks):
            logits = self.model.decode_batch([c[0] for _, c in chunks], starts, [s for s, _ in chunks])
            return logits if len(rows) == len(chunks) else logits[rows]  # (a list index waits for the device)
        if len(chunks) == 1 or self.model.prompt_graphs is not None:  # (step() gave this pass prompt chunks only)
            return self.model.prefill_chunks([(c, p, s) for (s, c), p in zip(chunks, starts)])[rows]
        tokens = [t for _, chunk in chunks for t in chunk]
        positions = [p for (_, chunk), start in zip(chunks, starts) for p in range(start, start + len(chunk))]
        seqs = [s for s, chunk in chunks for _ in chunk]
        ends = list(itertools.accumulate(len(chunk) for _, chunk in chunks))
        outputs = torch.tensor([ends[i] - 1 for i in rows] or [len(tokens) - 1])  # none: one cheap row, unread
        return self.model.forward_batch(torch.tensor(tokens), torch.tensor(positions), torch.tensor(seqs), outputs)[
            : len(rows)
        ]

    def _admit(self) -> None:
        """Give each waiting job, in order, the free sequence sharing the longest prefix with its prompt (the least
        recently used one where none shares any); none while they are held back (held_s)."""
        if self.held_s():
            return
        free = [s for s, seq in enumerate(self.sequences) if seq.job is None]
        while self.waiting and free:
            job_id, job = self.waiting.popleft()
            del self._arrived[job_id]
            shared = {s: self._usable_prefix(self.sequences[s].tokens, job.prompt) for s in free}
            s = max(free, key=lambda s: (shared[s], -self.sequences[s].last_used))
            free.remove(s)
            seq = self.sequences[s]
            keep = min(shared[s], len(job.prompt) - 1)  # the last prompt token always runs: it gives the logits
            if self.model.keeps_history and keep < len(seq.tokens):
                keep = 0  # its recurrent state holds tokens past `keep`: start anew
            del seq.tokens[keep:]
            limit = self.model.n_ctx - len(job.prompt)
            seq.job = _Running(
                job_id, job, job.prompt[keep:], min(job.max_tokens or limit, limit), keep, TextStream(job.stop)
            )

    def _usable_prefix(self, tokens: list[int], prompt: list[int]) -> int:
        """How many of a sequence's tokens a prompt can keep: their common prefix, or, for a model whose state folds
        in every token it ran (Model.keeps_history), all of them or none."""
        shared = _common_prefix(tokens, prompt)
        return shared if not self.model.keeps_history or shared == len(tokens) else 0

    def _start_masks(self, runs: list[_Running]) -> tuple[list[int], Future | None]:
        """The rows among `runs` under a grammar, and their next-token masks, computed in a worker thread (the
        grammar engine lets go of the GIL): they are known before the pass, whose tokens they do not depend on,
        so they take no time of their own where the pass runs meanwhile (on a GPU, or on the other CPU cores)."""
        rows = [i for i, r in enumerate(runs) if r.job.grammar is not None]
        if not rows:
            return rows, None
        if self._mask_thread is None:
            self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="moerun-masks")
        grammars = runs[rows[0]].job.grammar.grammars
        return rows, self._mask_thread.submit(grammars.masks, [runs[i].job.grammar.matcher for i in rows])

    def _sample(
        self, runs: list[_Running], logits: torch.Tensor, masks: tuple[list[int], Future | None] = ([], None)
    ) -> list[tuple[int, TokenLogprobs | None]]:
        """One token per row, with its log-probabilities where the job wants them; the greedy rows with one argmax
        (one host sync) for all. The rows under a grammar (`masks`, from _start_masks) have their disallowed
        tokens' logits set to -inf, as the end-of-generation ones of ignore_eos jobs (in a copy: `logits` may be a
        graph's output buffer); log-probabilities are the model's, before any of that."""
        raw = logits
        constrained, pending = masks
        allowed = pending.result() if pending is not None else None
        ignoring = [i for i, r in enumerate(runs) if r.job.ignore_eos]
        eog = sorted(self.model.tokenizer.eog_ids) if ignoring else []
        if eog or constrained:
            logits = logits.clone()
        if eog:
            logits[
                torch.tensor(ignoring, device=logits.device)[:, None], torch.tensor(eog, device=logits.device)
            ] = -math.inf
        if constrained:
            rows = torch.tensor(constrained, device=logits.device)
            logits[rows] = logits[rows].masked_fill(~allowed.to(logits.device), -math.inf)
        best = logits.argmax(-1).tolist()
        picked = [b if r.job.sampler is greedy else r.job.sampler(row) for r, b, row in zip(runs, best, logits)]
        for r, token in zip(runs, picked):
            if r.job.grammar is not None:
                r.job.grammar.follow(token)
        return list(zip(picked, _logprobs(runs, raw, picked)))

    def _emit(self, seq: _Sequence, token: int, logprobs: TokenLogprobs | None) -> Output:
        r = seq.job
        r.generated += 1
        tokenizer = self.model.tokenizer
        if token in tokenizer.eog_ids:
            text, finish = r.text.flush(), "stop"
        else:
            text, stopped = r.text.push(tokenizer.token_bytes(token) or r.job.control_text.get(token, b""))
            finish = "stop" if stopped else "length" if r.generated >= r.limit else None
            text += r.text.flush() if finish == "length" else ""
        if finish:
            seq.job, seq.last_used, seq.freed_at = None, next(self._clock), self._now()
        else:
            r.feed = [token]
        return Output(r.id, text, finish, len(r.job.prompt), r.generated, r.cached, token, logprobs)


def _logprobs(runs: list[_Running], logits: torch.Tensor, picked: list[int]) -> list[TokenLogprobs | None]:
    """The log-probabilities of the rows whose jobs want them, in one log-softmax and one host sync."""
    rows = [i for i, r in enumerate(runs) if r.job.logprobs is not None]
    if not rows:
        return [None] * len(runs)
    index = torch.tensor(rows, device=logits.device)
    logp = torch.log_softmax(logits[index].float(), dim=-1)
    chosen = logp.gather(1, torch.tensor([picked[i] for i in rows], device=logits.device)[:, None])[:, 0].tolist()
    k = max(runs[i].job.logprobs for i in rows)
    top_values, top_ids = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    out: list[TokenLogprobs | None] = [None] * len(runs)
    for j, i in enumerate(rows):
        n = runs[i].job.logprobs
        out[i] = TokenLogprobs(chosen[j], tuple(zip(top_ids[j][:n], top_values[j][:n])))
    return out


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
