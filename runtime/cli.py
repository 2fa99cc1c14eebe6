"""The `moerun` command, with llama.cpp's flags.

    moerun -m MODEL -p PROMPT -n N [-c CTX] [--device cpu|cuda] [--temp T] [--top-p P] [--seed S] [-t THREADS]
    moerun perplexity -m MODEL -f TEXT [-c 512] [-t THREADS]
    moerun bench -m MODEL [-p 512] [-n 128] [-f TEXT] [--device cuda] [--vram-budget 24G] [--expert-profile P]
    moerun serve -m MODEL [--host 127.0.0.1] [--port 8080] [--api-key KEY] [-c CTX] [-np N] [--device ...]

Every command that loads a model to generate with takes the same model options (`model_options`), the expert
cache's among them: `--vram-budget 24G[,24G]`, `--cache-slots auto|N`, `--expert-profile P.moeprof`,
`--cache-policy auto|NAME`, `--cache-plan auto|cache|blend|static`, `--cache-gbps BUS,CPU[,SPLIT]`; and
`--no-dense-bf16`, which keeps a GPU from holding bfloat16 copies of the dense weights.

Generation is the default command (`moerun run ...` names it). MoeprepError becomes one line on stderr and exit
code 2; set MOEPREP_DEBUG=1 for the traceback.
"""

from __future__ import annotations

import codecs
import dataclasses
import functools
import time
from dataclasses import dataclass, replace
from pathlib import Path

import click

from moeprep.cli_groups import DefaultCommandGroup, UserErrorGroup
from moeprep.errors import MoeprepError
from moeprep.profile.policy import DEFAULT_POLICY, POLICIES
from moeprep.units import format_size
from moerun.options import RuntimeOptions


class MoerunGroup(DefaultCommandGroup, UserErrorGroup):
    """Runs `run` when the first argument names no command; MoeprepError becomes one line and exit 2."""

    prog = "moerun"


model_option = click.option(
    "-m",
    "--model",
    "model_path",
    required=True,
    type=click.Path(),
    help="GGUF model file (or the first shard of a split set).",
)
device_option = click.option(
    "--device",
    type=click.Choice(["cpu", "cuda"]),
    help="Where the model runs (default: cuda when torch sees a GPU, else cpu).",
)
threads_option = click.option("-t", "--threads", type=click.IntRange(min=1), help="CPU threads (default: torch's).")
ctx_option = click.option(
    "-c",
    "--ctx-size",
    type=click.IntRange(min=1),
    help="Context size of a sequence (default: the model's, at most 4096).",
)


def set_threads(threads: int | None) -> None:
    if threads:
        import torch

        torch.set_num_threads(threads)


def resolve_device(asked: str | None) -> str:
    """--device as given; without it a GPU when torch sees one, as llama.cpp's CUDA builds and vLLM do, else the CPU."""
    if asked is not None:
        return asked
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def device_line(device: str, asked: str | None) -> str | None:
    """The line saying which device runs and why; None for --device cuda without a GPU, which loading refuses."""
    import torch

    if device == "cpu":
        return f"moerun: running on cpu ({'--device cpu' if asked else 'no GPU found'})"
    if not torch.cuda.is_available():
        return None
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    gpus = ", ".join(names) if len(set(names)) > 1 else names[0] if len(names) == 1 else f"{len(names)} x {names[0]}"
    return f"moerun: running on cuda ({gpus})"


def announce_device(device: str, asked: str | None) -> None:
    """device_line on stderr, just before the model loads: a big model takes a while, and the user sees where."""
    line = device_line(device, asked)
    if line is not None:
        click.echo(line, err=True)


def open_model_file(model_path: str):
    """The GGUF, opened once; a file of an architecture moerun does not run is refused here, before torch is
    imported (moerun's package imports lazily), so the refusal takes a fraction of a second."""
    from moeprep.gguf.reader import open_gguf
    from moerun.models import check_arch

    g = open_gguf(model_path)
    check_arch(g.arch, g.path)
    return g


vram_budget_option = click.option(
    "--vram-budget",
    help="Turn on the expert cache: bytes each GPU may use, e.g. 24G or 24G,24G for two GPUs "
    "(emulates a smaller card on a big one). Default with --device cuda: the cache turns on by itself when the "
    "model does not fit, and fills the free VRAM.",
)
cache_slots_option = click.option(
    "--cache-slots",
    default="auto",
    show_default=True,
    help="Expert-cache slots per MoE layer: auto (the budget decides, hot layers get more) or a number for every "
    "layer, at most its experts.",
)
expert_profile_option = click.option(
    "--expert-profile",
    type=click.Path(),
    help="A profile of this model (moeprep profile): warms the expert cache "
    "with its hottest experts before the first token and splits the slots by its counts.",
)
cache_policy_option = click.option(
    "--cache-policy",
    type=click.Choice(["auto", *sorted(POLICIES)]),
    default="auto",
    show_default=True,
    help="Which missed experts the cache uploads, and which residents they evict. auto: the one of least predicted "
    "expert traffic on the profile's held-out routing (or the --routing trace of bench), else "
    f"{DEFAULT_POLICY}; the start says which and why.",
)
cache_plan_option = click.option(
    "--cache-plan",
    type=click.Choice(["auto", "cache", "blend", "static"]),
    default="auto",
    show_default=True,
    help="cache: every layer's slots under the policy; static: llama.cpp's --n-cpu-moe split (whole layers' experts "
    "on the GPU, the rest on the CPU); blend: some whole layers pinned, the rest cached. auto: the one of least "
    "predicted expert traffic (docs/expert-cache.md); the start says which, with the numbers.",
)
cache_gbps_option = click.option(
    "--cache-gbps",
    metavar="BUS,CPU[,SPLIT]",
    help="The plan's cost model, GB/s of expert bytes: host-to-GPU copies, "
    "moerun's CPU computing misses, and llama.cpp's CPU for the split it is compared with (default 48,7.4,60, the "
    "H200 machine's, docs/expert-cache.md).",
)

dense_bf16_option = click.option(
    "--dense-bf16/--no-dense-bf16",
    default=True,
    show_default=True,
    help="On a GPU without the expert cache, also keep the quantized dense weights (attention, dense FFNs, output "
    "head) decoded to bfloat16 if the copies fit the free VRAM: decode batches of several sequences (serve) and "
    "prompts run faster on them, for 2 bytes of VRAM a weight.",
)


@dataclass(frozen=True)
class ModelOptions:
    """The options of every command that loads a model to generate with, as `model_options` collects them."""

    model_path: str
    ctx_size: int | None
    device: str | None  # None until load(): cuda when torch sees a GPU, else cpu
    threads: int | None
    vram_budget: str | None = None
    cache_slots: str = "auto"
    expert_profile: str | None = None
    cache_policy: str = "auto"
    dense_bf16: bool = True
    cache_plan: str = "auto"
    cache_gbps: str | None = None

    def cache_config(self, g, trace=None):
        """The expert cache's configuration, or None for every expert on the device: the cache is on when a cache
        option asks for it, or on CUDA when the model does not fit the free VRAM. trace: routing the policy and plan
        are measured on (bench --routing)."""
        from moerun.cache.config import CacheConfig
        from moerun.cache.host import fits_device
        from moerun.cache.plan import Bandwidths

        slots = None if self.cache_slots == "auto" else _slot_count(self.cache_slots)
        asked = (
            self.vram_budget is not None
            or slots is not None
            or self.expert_profile is not None
            or self.cache_policy != "auto"
            or self.cache_plan != "auto"
            or self.cache_gbps is not None
        )
        if not asked and (self.device == "cpu" or fits_device(g, self.device)):
            return None
        if self.device == "cpu" and self.vram_budget is None:
            raise MoeprepError("the expert cache with --device cpu needs --vram-budget (the CPU stands in for the GPU)")
        budgets = None if self.vram_budget is None else parse_budgets(self.vram_budget)
        bandwidths = Bandwidths() if self.cache_gbps is None else parse_gbps(self.cache_gbps)
        return CacheConfig(
            budgets=budgets,
            slots_per_layer=slots,
            profile=self.expert_profile,
            policy=self.cache_policy,
            plan=self.cache_plan,
            bandwidths=bandwidths,
            trace=trace,
            cpu_threads=self.threads,
        )

    def load(self, n_seq: int = 1, trace=None):
        g = open_model_file(self.model_path)
        set_threads(self.threads)
        device = resolve_device(self.device)
        cache = replace(self, device=device).cache_config(g, trace)  # its option errors come before the device line
        import moerun
        from moerun.cache.controller import describe_cache

        announce_device(device, self.device)
        model = moerun.load_model(
            g,
            device=device,
            n_ctx=self.ctx_size,
            n_seq=n_seq,
            cache=cache,
            dense_bf16=self.dense_bf16,
            options=RuntimeOptions.from_environment(),
        )
        warn_past_training_context(model)
        if model.expert_cache is not None:
            click.echo(describe_cache(model.expert_cache), err=True)
        if model.decoded_bytes:
            click.echo(
                f"dense weights also kept in bfloat16: {format_size(model.decoded_bytes)} of VRAM "
                "(--no-dense-bf16 keeps them in their blocks alone)",
                err=True,
            )
        return model


def warn_past_training_context(model) -> None:
    """One line on stderr when the context is longer than the file declares the model for (its training context, or
    what its RoPE scaling covers): as llama.cpp, moerun runs it, since a user may mean it, but says so."""
    args = model.args
    covered = args.context_covered
    if model.n_ctx <= covered:
        return
    if covered == args.n_ctx_train:
        limit = f"the {covered} positions the model was trained for (context_length)"
    else:
        limit = (
            f"the {covered} positions the file's {args.rope_scaling} RoPE scaling covers "
            f"({args.rope_orig_ctx} x {args.rope_factor:g})"
        )
    click.echo(f"moerun: warning: a context of {model.n_ctx} is above {limit}; past them output may degrade", err=True)


def _slot_count(text: str) -> int:
    try:
        slots = int(text)
    except ValueError:
        slots = 0
    if slots < 1:
        raise MoeprepError(f"--cache-slots {text!r}: give auto or a number of slots per layer (at least 1)")
    return slots


def parse_gbps(text: str):
    from moerun.cache.plan import Bandwidths

    try:
        speeds = [float(part) for part in text.split(",")]
    except ValueError:
        speeds = []
    if len(speeds) not in (2, 3) or min(speeds) <= 0:
        raise MoeprepError(
            f"--cache-gbps {text!r}: give the bus's and the CPU experts' GB/s, and optionally "
            "llama.cpp's CPU experts', e.g. 25,6 or 25,6,40"
        )
    return Bandwidths(*speeds)


def parse_budgets(text: str) -> list[int]:
    from moerun.cache.placement import parse_budgets as parse

    try:
        budgets = parse(text)
    except MoeprepError as e:
        raise MoeprepError(f"--vram-budget: {e}") from e
    if any(b <= 0 for b in budgets):
        raise MoeprepError(f"--vram-budget {text!r}: every GPU's budget must be more than 0")
    return budgets


MODEL_OPTIONS = (
    model_option,
    ctx_option,
    device_option,
    threads_option,
    vram_budget_option,
    cache_slots_option,
    expert_profile_option,
    cache_policy_option,
    dense_bf16_option,
    cache_plan_option,
    cache_gbps_option,
)


def model_options(command):
    """The options `run`, `bench` and `serve` share, defined once: the command gets them as one ModelOptions,
    `model_opts`, so an option added here reaches every command without touching their signatures."""

    @functools.wraps(command)
    def with_model_options(*args, **kwargs):
        options = ModelOptions(**{f.name: kwargs.pop(f.name) for f in dataclasses.fields(ModelOptions)})
        return command(*args, model_opts=options, **kwargs)

    for option in reversed(MODEL_OPTIONS):
        with_model_options = option(with_model_options)
    return with_model_options


@click.group(cls=MoerunGroup, context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Run a GGUF Mixture-of-Experts model: generate text (default), benchmark it, measure perplexity, or serve the
    OpenAI API."""


# A warm-up longer than this compiled kernels (a cached run loads them in well under a second): `run` says so.
COMPILE_NOTICE_S = 3.0


@main.command()
@model_options
@click.option("-p", "--prompt", required=True, help="Prompt text.")
@click.option(
    "-n", "--n-predict", default=128, show_default=True, type=click.IntRange(min=1), help="Tokens to generate."
)
@click.option(
    "--temp", default=0.8, show_default=True, type=click.FloatRange(min=0.0), help="Temperature; 0 is greedy."
)
@click.option("--top-p", default=0.95, show_default=True, type=click.FloatRange(0.0, 1.0, min_open=True))
@click.option("--seed", type=int, help="Sampling seed (default: random).")
def run(model_opts: ModelOptions, prompt: str, n_predict: int, temp: float, top_p: float, seed: int | None) -> None:
    """Generate text from a prompt, streaming it, then print prompt and generation speed."""
    import moerun

    model = model_opts.load()
    prompt_ids = model.tokenizer.encode(prompt)
    if not prompt_ids:
        raise MoeprepError("the prompt has no tokens (an empty -p, and the model adds no BOS): give it some text")
    if len(prompt_ids) + n_predict > model.n_ctx:
        raise MoeprepError(
            f"prompt ({len(prompt_ids)} tokens) plus -n {n_predict} exceed the context of {model.n_ctx}; raise -c or lower -n"
        )
    compiling = model.warm_up()  # so that the speeds below are the model's, not the kernels' compilation
    if compiling > COMPILE_NOTICE_S:
        click.echo(
            f"moerun: {compiling:.1f} s compiling kernels (once: they are cached on disk for the next runs)", err=True
        )
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
    click.echo(
        f"prompt: {len(prompt_ids)} tokens in {prefill_s:.2f} s, {len(prompt_ids) / prefill_s:.1f} tokens/s", err=True
    )
    if n_generated > 1:  # every token after the first costs one decode step
        click.echo(
            f"generation: {n_generated - 1} tokens in {decode_s:.2f} s, {(n_generated - 1) / decode_s:.1f} tokens/s",
            err=True,
        )


@main.command()
@model_options
@click.option(
    "-p", "--n-prompt", default=512, show_default=True, type=click.IntRange(min=0), help="Prefill test: prompt tokens."
)
@click.option("-n", "--n-gen", default=128, show_default=True, type=click.IntRange(min=0), help="Decode test: tokens.")
@click.option(
    "-f",
    "--file",
    "text_file",
    type=click.Path(),
    help="Teacher-force prefill and decode over this text's tokens (routing of real text); default: "
    "seeded random tokens.",
)
@click.option("--json", "json_path", type=click.Path(), help="Also write the results as JSON here.")
@click.option(
    "--routing",
    "routing_path",
    type=click.Path(),
    help="Replay this routing trace (moeprep routing generate/extract, or a .moeprof): every MoE layer uses "
    "the trace's experts instead of its router's (the router still runs). Its layers, experts and top-k "
    "must be the model's.",
)
def bench(
    model_opts: ModelOptions,
    n_prompt: int,
    n_gen: int,
    text_file: str | None,
    json_path: str | None,
    routing_path: str | None,
) -> None:
    """llama-bench's prefill (pp) and decode (tg) tests; with the expert cache also its hit rate, uploads per token
    and where a decode step's time goes."""
    import json

    from moeprep.atomic import atomic_output
    from moerun.bench import format_result, run_bench

    if n_prompt + n_gen == 0:
        raise MoeprepError("-p and -n are both 0: nothing to measure")
    if json_path and not Path(json_path).resolve().parent.is_dir():  # before the benchmark, not after it
        raise MoeprepError(f"{Path(json_path).parent}: output folder does not exist")
    text = read_text(text_file) if text_file else None
    routing = read_routing(routing_path, model_opts.model_path) if routing_path else None
    model = replace(model_opts, ctx_size=model_opts.ctx_size or n_prompt + n_gen).load(trace=routing)
    result = run_bench(model, n_prompt, n_gen, text, routing=routing, routing_name=routing_path or "")
    click.echo(format_result(result))
    if model.device.type == "cpu" or model.expert_cache is not None:  # whose dot products the CPU's experts ran
        from moerun.kernels.ggml_cpu import describe

        options = model.options
        click.echo(describe(options.ggml_library(), turned_off=not options.ggml_cpu))
    if json_path:
        with atomic_output(json_path) as tmp:
            tmp.write_text(json.dumps(result.as_dict(), indent=1))


def read_routing(path: str, model_path: str):
    """The trace, checked against the model file's shape before the model is loaded."""
    from moeprep.gguf.anatomy import model_geometry
    from moeprep.profile.tracefile import read_trace

    t = read_trace(path)
    geometry = model_geometry(open_model_file(model_path))
    t.check_shape(len(geometry.moe_layers), geometry.n_expert, geometry.n_expert_used, path)
    return t


def read_text(path: str) -> str:
    """The file's text, decoded strictly: a binary file (or text in another encoding) is refused with the offset of
    its first byte that is not UTF-8, rather than scored or replayed as replacement characters."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise MoeprepError(f"{path}: cannot read ({e.strerror})") from e
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise MoeprepError(
            f"{path}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); give a UTF-8 text file"
        ) from e


@main.command()
@model_option
@click.option("-f", "--file", "text_file", required=True, type=click.Path(), help="UTF-8 text file to score.")
@click.option(
    "-c", "--ctx-size", default=512, show_default=True, type=click.IntRange(min=4), help="Chunk size in tokens."
)
@device_option
@threads_option
def perplexity(model_path: str, text_file: str, ctx_size: int, device: str | None, threads: int | None) -> None:
    """Perplexity over non-overlapping chunks, scored like llama-perplexity (second half of each chunk)."""
    import moerun

    g = open_model_file(model_path)
    text = read_text(text_file)  # a file that is not text is refused before the model loads
    set_threads(threads)
    chosen = resolve_device(device)
    announce_device(chosen, device)
    model = moerun.load_model(g, device=chosen, n_ctx=ctx_size, options=RuntimeOptions.from_environment())
    warn_past_training_context(model)
    tokens = model.tokenizer.encode(text)
    start = time.perf_counter()
    ppl = moerun.perplexity(model, tokens, ctx_size)
    n_chunks = len(tokens) // ctx_size
    click.echo(
        f"perplexity: {ppl:.4f} over {n_chunks} chunks of {ctx_size} tokens "
        f"({n_chunks * ctx_size / (time.perf_counter() - start):.1f} tokens/s)"
    )


@main.command()
@model_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: every interface).")
@click.option("--port", default=8080, show_default=True, type=click.IntRange(1, 65535))
@click.option(
    "--api-key",
    envvar="MOERUN_API_KEY",
    help="Require 'Authorization: Bearer KEY' on /v1 requests (default: $MOERUN_API_KEY, else none).",
)
@click.option(
    "-np",
    "--parallel",
    default=4,
    show_default=True,
    type=click.IntRange(min=1),
    help="Sequences decoded together, each with its own KV cache of -c positions.",
)
@click.option(
    "--max-queue",
    default=64,
    show_default=True,
    type=click.IntRange(min=0),
    help="Requests that may wait for a free sequence; past that the server answers 503.",
)
@click.option(
    "--prefill-chunk",
    type=click.IntRange(min=1),
    help="Prompt tokens one step runs beside the decoding sequences' tokens (a long prompt takes several "
    "steps, and the other streams keep going meanwhile; default: 512 on a GPU, 256 on the CPU).",
)
@click.option(
    "--gather-ms",
    type=click.FloatRange(min=0),
    help="How long a new prompt may wait for the next requests of clients just answered, so that their "
    "prompts start in one step (0: never; default: 20 on a GPU, 0 on the CPU).",
)
def serve(
    model_opts: ModelOptions,
    host: str,
    port: int,
    api_key: str | None,
    parallel: int,
    max_queue: int,
    prefill_chunk: int | None,
    gather_ms: float | None,
) -> None:
    """Serve the model over the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models, /health)."""
    from moerun.serve import serve as serve_model

    serve_model(
        model_opts.load(n_seq=parallel),
        host,
        port,
        api_key,
        max_queue,
        prefill_chunk,
        None if gather_ms is None else gather_ms / 1000,
    )
