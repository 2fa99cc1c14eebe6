"""`moerun bench`: llama-bench's two tests (prefill of -p tokens, decode of -n tokens) on a loaded model, and with the
expert cache what it did: hit rate overall and per layer, uploads per token, and where a decode step's time went.

Decode is teacher-forced: step i feeds token i of the stream rather than the model's own choice, so every engine
and every cache setting sees the same tokens. The stream is a text's tokens (`-f TEXT`: routing as real text makes
it, which is what a cache's hit rate depends on) or seeded random tokens (llama-bench's choice, fine without a
cache). A warm-up of a few tokens first compiles the CPU kernels and captures the decode step's graph.

With a routing trace (`--routing TRACE`, runtime/replay.py) every MoE layer takes its experts from the trace instead
of its router (which still runs): position p reads row p of the trace's first chunk long enough for the test, so
prefill, warm-up and decode see the trace's routing in its order, and the cache's hit rate is the trace's.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from moeprep.errors import MoeprepError
from moerun.cache.stats import TIMED

WARMUP_TOKENS = 8


@dataclass
class BenchResult:
    prompt_tokens: int
    prefill_s: float
    gen_tokens: int
    decode_s: float
    cache: dict | None = None  # the expert cache's statistics over the decode test (see cache_report)
    prefill_cache: dict | None = None
    vram_bytes: int | None = None  # the most GPU memory torch's allocator held over the run (its own, all GPUs)
    extra: dict = field(default_factory=dict)

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.gen_tokens / self.decode_s if self.decode_s else 0.0

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "prefill_tok_s": round(self.prefill_tok_s, 2),
            "gen_tokens": self.gen_tokens,
            "decode_tok_s": round(self.decode_tok_s, 2),
            "cache_decode": self.cache,
            "cache_prefill": self.prefill_cache,
            "vram_bytes": self.vram_bytes,
            **self.extra,
        }


def token_stream(model, n: int, text: str | None, seed: int = 0) -> torch.Tensor:
    """n tokens: the text's first n (an error if it has fewer), or seeded random ids."""
    if text is None:
        return torch.randint(1, model.args.n_vocab, (n,), generator=torch.Generator().manual_seed(seed))
    tokens = model.tokenizer.encode(text)
    if len(tokens) < n:
        raise MoeprepError(f"the text has {len(tokens)} tokens; -p plus -n need {n}: give a longer -f or lower them")
    return torch.tensor(tokens[:n], dtype=torch.long)


def run_bench(
    model,
    n_prompt: int,
    n_gen: int,
    text: str | None = None,
    warmup: bool = True,
    routing=None,
    routing_name: str = "the routing trace",
) -> BenchResult:
    """Prefill n_prompt tokens at position 0, then decode n_gen tokens teacher-forced after them. routing: a
    moeprep TraceFile every MoE layer's choice is taken from (refused if its shape is not the model's)."""
    if n_prompt + n_gen > model.n_ctx:
        raise MoeprepError(f"-p {n_prompt} plus -n {n_gen} exceed the context of {model.n_ctx}; raise -c")
    tokens = token_stream(model, n_prompt + n_gen, text)
    replay = None
    if routing is not None:  # for good: the decode graphs captured from here on replay the trace
        from moerun.replay import install_replay

        # the warm-up's positions too: a prompt of at least WARMUP_TOKENS, two decode steps after the prompt
        replay = install_replay(model, routing, max(n_prompt + max(n_gen, 2), WARMUP_TOKENS), routing_name)
    result = _run(model, n_prompt, n_gen, tokens, warmup)
    if replay is not None:
        result.extra["routing"] = {
            "trace": routing_name,
            "regime": routing.regime,
            "source": routing.source,
            "chunk": replay.chunk,
        }
    return result


def _run(model, n_prompt: int, n_gen: int, tokens: torch.Tensor, warmup: bool) -> BenchResult:
    cache = model.expert_cache
    if cache is not None:
        cache.timing = True
    if warmup:
        _warm_up(model, tokens, n_prompt)
    result = BenchResult(n_prompt, 0.0, n_gen, 0.0)
    if n_prompt:
        _reset(model)
        start = time.perf_counter()
        model.forward(tokens[:n_prompt], 0, last_only=True)
        model.synchronize()
        result.prefill_s = time.perf_counter() - start
        result.prefill_cache = cache_report(cache, n_prompt)
    if n_gen:
        _reset(model)
        start = time.perf_counter()
        for i in range(n_gen):
            model.decode(int(tokens[n_prompt + i]), n_prompt + i)
        model.synchronize()
        result.decode_s = time.perf_counter() - start
        result.cache = cache_report(cache, n_gen, result.decode_s)
    gpus = model.gpus
    if gpus:
        result.vram_bytes = sum(torch.cuda.max_memory_reserved(d) for d in gpus)
    return result


def _warm_up(model, tokens: torch.Tensor, n_prompt: int) -> None:
    """A prefill as long as the test's (Triton compiles a kernel per shape: a 512-token prompt's first run spends
    seconds compiling) over the prompt reversed, so its routing is not the test's own, and two decode steps in the
    decode test's KV bucket; the tests overwrite what they write to the KV cache. The expert cache's policy does not
    see these steps: a cold cache starts the prompt empty, and a replayed trace's routing (taken by position) is not
    taught to the policy twice, which would make its experts look reused."""
    cache = model.expert_cache
    with cache.pause() if cache is not None else contextlib.nullcontext():
        model.forward(tokens[: max(n_prompt, WARMUP_TOKENS)].flip(0), 0, last_only=True)
        for i in range(2):
            model.decode(int(tokens[i]), n_prompt + i)
        model.synchronize()


def _reset(model) -> None:
    model.synchronize()
    if model.expert_cache is not None:
        model.expert_cache.reset_stats()


def cache_report(cache, n_tokens: int, wall_s: float | None = None) -> dict | None:
    """The cache's statistics since its last reset, per token: hit rate, uploads, and (with wall_s) milliseconds of
    each kind of host time, the GPU experts' device time, and the rest (Python and the other layers' enqueueing)."""
    if cache is None:
        return None
    stats = cache.stats
    per_layer = stats.per_layer()[stats.lookups > 0]
    report = {
        "hit_rate": round(stats.hit_rate, 4),
        "uploads_per_token": round(stats.uploads / n_tokens, 2),
        "staged_per_token": round(stats.staged / n_tokens, 2),
        "streamed_per_token": round(stats.streamed / n_tokens, 2),
        "hit_rate_per_layer": [round(float(h), 3) for h in per_layer],
    }
    if wall_s is not None:
        ms = {name: 1000 * stats.seconds[name] / n_tokens for name in TIMED}
        ms["GPU experts (device)"] = 1000 * stats.gpu_expert_seconds() / n_tokens
        ms["rest"] = 1000 * wall_s / n_tokens - sum(ms[name] for name in TIMED)
        report["ms_per_token"] = {name: round(v, 3) for name, v in ms.items()}
    return report


def format_result(result: BenchResult) -> str:
    """llama-bench's table, then the cache's lines."""
    lines = ["| test | tokens | seconds | tok/s |", "| --- | ---: | ---: | ---: |"]
    routing = result.extra.get("routing")
    if routing:
        lines.insert(
            0,
            f"routing replayed from {routing['trace']} (chunk {routing['chunk']}"
            + (f", regime {routing['regime']}" if routing["regime"] else "")
            + "): the routers run, their "
            "choice is the trace's",
        )
    if result.prompt_tokens:
        lines.append(
            f"| pp{result.prompt_tokens} | {result.prompt_tokens} | {result.prefill_s:.3f} | "
            f"{result.prefill_tok_s:.2f} |"
        )
    if result.gen_tokens:
        lines.append(
            f"| tg{result.gen_tokens} | {result.gen_tokens} | {result.decode_s:.3f} | {result.decode_tok_s:.2f} |"
        )
    for name, report in (("prefill", result.prefill_cache), ("decode", result.cache)):
        if report is None:
            continue
        layers = np.array(report["hit_rate_per_layer"])
        spread = (
            f" (per layer {layers.min():.1%} to {layers.max():.1%}, median {np.median(layers):.1%})"
            if len(layers)
            else ""
        )
        staged = report["staged_per_token"]
        lines.append(
            f"expert cache, {name}: hit rate {report['hit_rate']:.1%}{spread}, "
            f"{report['uploads_per_token']:.2f} uploads per token"
            + (f", {staged:.2f} experts staged per token" if staged else "")
            + (
                f", {report['streamed_per_token']:.2f} read from host RAM per token (streamed)"
                if report["streamed_per_token"]
                else ""
            )
        )
        if "ms_per_token" in report:
            lines.append("  ms per token: " + ", ".join(f"{k} {v:.2f}" for k, v in report["ms_per_token"].items()))
    if result.vram_bytes is not None:
        lines.append(
            f"VRAM at most held by torch's allocator (weights, slots, KV, graphs, activations): "
            f"{result.vram_bytes / 2**30:.2f} GiB"
        )
    return "\n".join(lines)
