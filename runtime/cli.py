"""The `moerun` command, with llama.cpp's flags.

    moerun -m MODEL -p PROMPT -n N [-c CTX] [--device cpu|cuda] [--temp T] [--top-p P] [--seed S] [-t THREADS]
    moerun perplexity -m MODEL -f TEXT [-c 512] [-t THREADS]

Generation is the default command (`moerun run ...` names it). MoeprepError becomes one line on stderr and exit
code 2; set MOEPREP_DEBUG=1 for the traceback.
"""

from __future__ import annotations

import codecs
import time

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


def set_threads(threads: int | None) -> None:
    if threads:
        import torch

        torch.set_num_threads(threads)


@click.group(cls=MoerunGroup, context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Run a GGUF Mixture-of-Experts model: generate text (default) or measure perplexity."""


@main.command()
@model_option
@click.option("-p", "--prompt", required=True, help="Prompt text.")
@click.option("-n", "--n-predict", default=128, show_default=True, type=click.IntRange(min=1), help="Tokens to generate.")
@click.option("-c", "--ctx-size", type=click.IntRange(min=1), help="Context size (default: the model's, at most 4096).")
@device_option
@click.option("--temp", default=0.8, show_default=True, type=click.FloatRange(min=0.0), help="Temperature; 0 is greedy.")
@click.option("--top-p", default=0.95, show_default=True, type=click.FloatRange(0.0, 1.0, min_open=True))
@click.option("--seed", type=int, help="Sampling seed (default: random).")
@threads_option
def run(model_path: str, prompt: str, n_predict: int, ctx_size: int | None, device: str, temp: float, top_p: float,
        seed: int | None, threads: int | None) -> None:
    """Generate text from a prompt, streaming it, then print prompt and generation speed."""
    import moerun

    set_threads(threads)
    model = moerun.load_model(model_path, device=device, n_ctx=ctx_size)
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

    set_threads(threads)
    model = moerun.load_model(model_path, device=device, n_ctx=ctx_size)
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
