"""The `moerun` command, with llama.cpp's flags.

    moerun -m MODEL -p PROMPT -n N [-c CTX] [--device cpu|cuda] [--temp T] [--top-p P] [--seed S] [-t THREADS]
    moerun perplexity -m MODEL -f TEXT [-c 512] [-t THREADS]
    moerun serve -m MODEL [--host 127.0.0.1] [--port 8080] [--api-key KEY] [-c CTX] [-np N] [--device ...]

Generation is the default command (`moerun run ...` names it). MoeprepError becomes one line on stderr and exit
code 2; set MOEPREP_DEBUG=1 for the traceback.
"""

from __future__ import annotations

import codecs
import functools
import time
from dataclasses import dataclass

import click

from moeprep.cli_groups import DefaultCommandGroup, UserErrorGroup
from moeprep.errors import MoeprepError


class MoerunGroup(DefaultCommandGroup, UserErrorGroup):
    """Runs `run` when the first argument names no command; MoeprepError becomes one line and exit 2."""

    prog = "moerun"


model_option = click.option("-m", "--model", "model_path", required=True, type=click.Path(),
                            help="GGUF model file (or the first shard of a split set).")
device_option = click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
threads_option = click.option("-t", "--threads", type=click.IntRange(min=1), help="CPU threads (default: torch's).")
ctx_option = click.option("-c", "--ctx-size", type=click.IntRange(min=1),
                          help="Context size of a sequence (default: the model's, at most 4096).")


def set_threads(threads: int | None) -> None:
    if threads:
        import torch

        torch.set_num_threads(threads)


def open_model_file(model_path: str):
    """The GGUF, opened once; a file of an architecture moerun does not run is refused here, before torch is
    imported (moerun's package imports lazily), so the refusal takes a fraction of a second."""
    from moeprep.gguf.reader import open_gguf
    from moerun.models import check_arch

    g = open_gguf(model_path)
    check_arch(g.arch, g.path)
    return g


@dataclass(frozen=True)
class ModelOptions:
    """The options of every command that loads a model to generate with, as `model_options` collects them."""

    model_path: str
    ctx_size: int | None
    device: str
    threads: int | None

    def load(self, n_seq: int = 1):
        import moerun

        g = open_model_file(self.model_path)
        set_threads(self.threads)
        return moerun.load_model(g, device=self.device, n_ctx=self.ctx_size, n_seq=n_seq)


MODEL_OPTIONS = (model_option, ctx_option, device_option, threads_option)


def model_options(command):
    """The options `run`, `bench` and `serve` share, defined once: the command gets them as one ModelOptions,
    `model_opts`, so an option added here reaches every command without touching their signatures."""

    @functools.wraps(command)
    def with_model_options(*args, model_path, ctx_size, device, threads, **kwargs):
        return command(*args, model_opts=ModelOptions(model_path, ctx_size, device, threads), **kwargs)

    for option in reversed(MODEL_OPTIONS):
        with_model_options = option(with_model_options)
    return with_model_options


@click.group(cls=MoerunGroup, context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Run a GGUF Mixture-of-Experts model: generate text (default), measure perplexity, or serve the OpenAI API."""


@main.command()
@model_options
@click.option("-p", "--prompt", required=True, help="Prompt text.")
@click.option("-n", "--n-predict", default=128, show_default=True, type=click.IntRange(min=1), help="Tokens to generate.")
@click.option("--temp", default=0.8, show_default=True, type=click.FloatRange(min=0.0), help="Temperature; 0 is greedy.")
@click.option("--top-p", default=0.95, show_default=True, type=click.FloatRange(0.0, 1.0, min_open=True))
@click.option("--seed", type=int, help="Sampling seed (default: random).")
def run(model_opts: ModelOptions, prompt: str, n_predict: int, temp: float, top_p: float, seed: int | None) -> None:
    """Generate text from a prompt, streaming it, then print prompt and generation speed."""
    import moerun

    model = model_opts.load()
    prompt_ids = model.tokenizer.encode(prompt)
    if len(prompt_ids) + n_predict > model.n_ctx:
        raise MoeprepError(f"prompt ({len(prompt_ids)} tokens) plus -n {n_predict} exceed the context of {model.n_ctx}; raise -c or lower -n")
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    click.echo(prompt, nl=False)
    start = time.perf_counter()
    first = end = start
    n_generated = 0
    for token in moerun.generate(model, prompt_ids, n_predict, moerun.make_sampler(temp, top_p, seed)):
        end = time.perf_counter()
        first = end if n_generated == 0 else first
        n_generated += 1
        click.echo(decoder.decode(model.tokenizer.token_bytes(token)), nl=False)
    click.echo(decoder.decode(b"", final=True))
    prefill_s, decode_s = first - start, end - first
    click.echo(f"prompt: {len(prompt_ids)} tokens in {prefill_s:.2f} s, {len(prompt_ids) / prefill_s:.1f} tokens/s", err=True)
    if n_generated > 1:  # every token after the first costs one decode step
        click.echo(f"generation: {n_generated - 1} tokens in {decode_s:.2f} s, {(n_generated - 1) / decode_s:.1f} tokens/s", err=True)


@main.command()
@model_option
@click.option("-f", "--file", "text_file", required=True, type=click.Path(), help="Text file to score.")
@click.option("-c", "--ctx-size", default=512, show_default=True, type=click.IntRange(min=4), help="Chunk size in tokens.")
@device_option
@threads_option
def perplexity(model_path: str, text_file: str, ctx_size: int, device: str, threads: int | None) -> None:
    """Perplexity over non-overlapping chunks, scored like llama-perplexity (second half of each chunk)."""
    import moerun

    g = open_model_file(model_path)
    set_threads(threads)
    model = moerun.load_model(g, device=device, n_ctx=ctx_size)
    try:
        with open(text_file, encoding="utf-8", errors="replace") as f:
            tokens = model.tokenizer.encode(f.read())
    except OSError as e:
        raise MoeprepError(f"{text_file}: cannot read ({e.strerror})") from e
    start = time.perf_counter()
    ppl = moerun.perplexity(model, tokens, ctx_size)
    n_chunks = len(tokens) // ctx_size
    click.echo(f"perplexity: {ppl:.4f} over {n_chunks} chunks of {ctx_size} tokens "
               f"({n_chunks * ctx_size / (time.perf_counter() - start):.1f} tokens/s)")


@main.command()
@model_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: every interface).")
@click.option("--port", default=8080, show_default=True, type=click.IntRange(1, 65535))
@click.option("--api-key", envvar="MOERUN_API_KEY", help="Require 'Authorization: Bearer KEY' on /v1 requests "
              "(default: $MOERUN_API_KEY, else none).")
@click.option("-np", "--parallel", default=4, show_default=True, type=click.IntRange(min=1),
              help="Sequences decoded together, each with its own KV cache of -c positions.")
@click.option("--max-queue", default=64, show_default=True, type=click.IntRange(min=0),
              help="Requests that may wait for a free sequence; past that the server answers 503.")
def serve(model_opts: ModelOptions, host: str, port: int, api_key: str | None, parallel: int, max_queue: int) -> None:
    """Serve the model over the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models, /health)."""
    from moerun.serve import serve as serve_model

    serve_model(model_opts.load(n_seq=parallel), host, port, api_key, max_queue)
