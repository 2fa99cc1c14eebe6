"""The `moeprep` command: each subcommand parses its options, calls one library function and prints.

MoeprepError (the user's input is wrong) becomes one line on stderr and exit code 2; set MOEPREP_DEBUG=1 for
the traceback.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

from moeprep import __version__
from moeprep.cli_groups import MoeprepGroup
from moeprep.profile.cli import profile
from moeprep.routing_cli import routing
from moeprep.synth.config import ROPE_SCALINGS, ROUTING_KINDS


@click.group(cls=MoeprepGroup)
@click.version_option(__version__, prog_name="moeprep")
def main() -> None:
    """Prepare Mixture-of-Experts GGUF models for expert-cached inference."""


# Commands are registered below, one block each; keep each block a thin wrapper around a library call.


@main.command()
@click.argument("model", type=click.Path(path_type=str))
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--vram", help="GPU memory sizes, comma-separated (24G,24G): show how many expert-cache slots fit.")
@click.option(
    "--reserve", default="1.5G", show_default=True, help="Memory kept back per GPU (context, KV, activations)."
)
def inspect(model: str, as_json: bool, vram: str | None, reserve: str) -> None:
    """Show a GGUF model's anatomy: layers, experts, bytes per tensor role, cache slots in VRAM (MoE or dense)."""
    from moeprep.gguf.anatomy import describe_model, format_anatomy, plan_vram
    from moeprep.gguf.reader import open_gguf
    from moeprep.units import parse_size

    anatomy = describe_model(open_gguf(model))
    plan = plan_vram(anatomy, [parse_size(v) for v in vram.split(",")], parse_size(reserve)) if vram else None
    if as_json:
        click.echo(json.dumps({**anatomy.to_dict(), "vram": plan.to_dict() if plan else None}, indent=2))
    else:
        click.echo(format_anatomy(anatomy, plan))


@main.command()
@click.option(
    "--dir",
    "folder",
    type=click.Path(file_okay=False, path_type=str),
    help="Folder for the demo's files (default: a new temporary folder, kept afterwards).",
)
def demo(folder: str | None) -> None:
    """Show every moeprep capability on a small synthetic MoE model, step by step."""
    import tempfile

    from moeprep.demo import run_demo

    run_demo(Path(folder) if folder else Path(tempfile.mkdtemp(prefix="moeprep-demo-")))


@main.command()
@click.argument("source", metavar="IN", type=click.Path(path_type=str))
@click.argument("out", metavar="OUT", type=click.Path(path_type=str))
@click.option(
    "--attn",
    "attn_type",
    default="Q4_K",
    show_default=True,
    help="Type for every attention tensor: Q4_K, Q5_K, Q6_K, Q8_0, Q4_0, Q5_0...",
)
@click.option("--imatrix", type=click.Path(path_type=str), help="Importance matrix (llama.cpp GGUF or legacy .dat).")
@click.option(
    "--type",
    "type_rules",
    multiple=True,
    metavar="REGEX=TYPE",
    help="Requantize tensors whose name matches REGEX to TYPE (first match wins; experts never change).",
)
@click.option("--split-max-size", help="Write llama.cpp shards of at most this size (48G).")
@click.option("--dry-run", is_flag=True, help="Print the plan and write nothing.")
@click.option("--threads", default=os.cpu_count() or 1, show_default=True, help="Quantizer threads.")
@click.option(
    "--device",
    type=click.Choice(["cpu", "cuda"]),
    default="cpu",
    show_default=True,
    help="Where Q4_K/Q5_K/Q6_K are quantized (cuda: torch on the GPU, the same bytes).",
)
@click.option(
    "--no-verify",
    is_flag=True,
    help="Skip the verification of the output against IN (done before OUT is renamed into place).",
)
def quantize(
    source: str,
    out: str,
    attn_type: str,
    imatrix: str | None,
    type_rules: tuple[str, ...],
    split_max_size: str | None,
    dry_run: bool,
    threads: int,
    device: str,
    no_verify: bool,
) -> None:
    """Requantize the attention tensors of IN into OUT; routed experts are copied byte for byte."""
    from moeprep.gguf.reader import open_gguf
    from moeprep.quant.imatrix import read_imatrix
    from moeprep.quant.plan import format_plan, parse_rule, parse_type, plan_requant
    from moeprep.quant.quantize import format_summary, quantize_model
    from moeprep.units import parse_size

    model = open_gguf(source)
    plan = plan_requant(model, parse_type(attn_type), [parse_rule(r) for r in type_rules])
    if dry_run:
        click.echo(format_plan(plan))
        return
    matrix = read_imatrix(imatrix) if imatrix else None
    result = quantize_model(
        model,
        Path(out),
        plan,
        imatrix=matrix,
        threads=threads,
        device=device,
        split_max_size=parse_size(split_max_size) if split_max_size else None,
        verify=not no_verify,
    )
    click.echo(format_summary(result, Path(out)))
    if result.report is not None and not result.report.ok:
        sys.exit(1)


@main.command()
@click.argument("out", metavar="OUT", type=click.Path(path_type=str))
@click.option("--against", "source", required=True, type=click.Path(path_type=str), help="The source model.")
@click.option("--threads", default=os.cpu_count() or 1, show_default=True, help="Tensors checked at once.")
def verify(out: str, source: str, threads: int) -> None:
    """Check that OUT kept IN's experts, untouched tensors and metadata, and that requantized tensors are close."""
    from moeprep.gguf.reader import open_gguf
    from moeprep.quant.verify import verify_model

    report = verify_model(open_gguf(out), open_gguf(source), threads=threads, progress=True)
    click.echo(report.summary())
    if not report.ok:
        sys.exit(1)


@main.command("to-mainline")
@click.argument("source", metavar="IN", type=click.Path(path_type=str))
@click.argument("out", metavar="OUT", type=click.Path(path_type=str))
@click.option("--split-max-size", help="Write llama.cpp shards of at most this size (48G).")
def to_mainline(source: str, out: str, split_max_size: str | None) -> None:
    """Rewrite a fork's GGUF (unsloth's glm5next) as mainline llama.cpp's (glm5-next): metadata only."""
    from moeprep.gguf.dialect import to_mainline as rewrite
    from moeprep.units import parse_size

    dialect, paths = rewrite(source, out, parse_size(split_max_size) if split_max_size else None)
    click.echo(f"{dialect.fork} -> {dialect.mainline}: {', '.join(map(str, paths))} (tensors copied byte for byte)")


@main.command("split-experts")
@click.argument("source", metavar="IN", type=click.Path(path_type=str))
@click.argument("out", metavar="OUT", type=click.Path(path_type=str))
@click.option("--split-max-size", help="Write llama.cpp shards of at most this size (48G).")
def split_experts(source: str, out: str, split_max_size: str | None) -> None:
    """Rewrite fused ffn_gate_up_exps experts (Gemma 4's converter writes them) as ffn_gate_exps and ffn_up_exps, for
    tools that want the split layout (moerun and llama.cpp run both): the same bytes, nothing requantized."""
    from tqdm import tqdm

    from moeprep.gguf.reader import open_gguf
    from moeprep.gguf.split_experts import split_experts as rewrite
    from moeprep.units import parse_size

    total = sum(t.n_bytes for t in open_gguf(source).tensors)
    with tqdm(total=total, unit="B", unit_scale=True, desc="split", dynamic_ncols=True) as bar:
        paths = rewrite(source, out, parse_size(split_max_size) if split_max_size else None, bar.update)
    click.echo(f"{', '.join(map(str, paths))}: experts' gate and up split (tensors copied byte for byte)")


main.add_command(profile)  # the `moeprep profile` group lives with its package
main.add_command(routing)  # `moeprep routing`: traces of named regimes and their statistics


@main.command()
@click.argument("out", metavar="OUT", type=click.Path(dir_okay=False, path_type=str))
@click.option(
    "--arch",
    default="qwen3moe",
    show_default=True,
    help="Architecture as GGUF names it (qwen3moe, deepseek2, gpt-oss, ...).",
)
@click.option(
    "--preset", default="tiny", show_default=True, help="Size preset (tiny, small, qwen3-30b-a3b, bench-60g)."
)
@click.option("--expert-type", default=None, help="Routed experts' type, e.g. F16, Q8_0, Q4_K (default: the preset's).")
@click.option("--attn-type", default=None, help="Attention, shared-expert and dense-FFN type (default: the preset's).")
@click.option(
    "--skew",
    default=0.0,
    show_default=True,
    type=click.FloatRange(0.0, 1.0),
    help="How strongly the routers favour a few experts.",
)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--layers", "n_layer", default=None, type=click.IntRange(min=1), help="Override the layer count.")
@click.option("--experts", "n_expert", default=None, type=click.IntRange(min=1), help="Override the expert count.")
@click.option(
    "--experts-used",
    "n_expert_used",
    default=None,
    type=click.IntRange(min=1),
    help="Override the experts chosen per token.",
)
@click.option("--fast-random-blocks", is_flag=True, help="Write quantized tensors as random valid blocks (fast).")
@click.option(
    "--vocab-size",
    "n_vocab",
    default=None,
    type=click.IntRange(min=1),
    help="Vocabulary size: the tokenizer's 2048 tokens padded with unused ones (real models: 150k-262k).",
)
@click.option(
    "--routing",
    type=click.Choice(ROUTING_KINDS),
    default=None,
    help="How the routers pick experts: random (uniform), token-id (a lookup from the token), or a routing regime "
    "built into the weights (qwen3-30b, fine-512, skewed-256: `moeprep routing regimes`; docs/synth.md). Default: "
    "the preset's (bench-60g and qwen3-30b-a3b: qwen3-30b; others: random).",
)
@click.option(
    "--rope-scaling",
    type=click.Choice(ROPE_SCALINGS),
    default=None,
    help="Context scaling the file declares, with factor 4 (docs/synth.md); longrope: step35 only. Default: the "
    "architecture's (laguna: yarn; others: none).",
)
@click.option(
    "--chat-template",
    is_flag=True,
    help="Write a ChatML chat template with tool calls (<tool_call>{json}</tool_call>), so `moerun serve` can serve "
    "the model to chat and tool-calling clients.",
)
def synth(
    out: str,
    arch: str,
    preset: str,
    expert_type: str | None,
    attn_type: str | None,
    skew: float,
    seed: int,
    n_layer: int | None,
    n_expert: int | None,
    n_expert_used: int | None,
    fast_random_blocks: bool,
    n_vocab: int | None,
    routing: str | None,
    rope_scaling: str | None,
    chat_template: bool,
) -> None:
    """Write a synthetic MoE model (random weights, real tokenizer) that llama.cpp loads: test and demo fixtures."""
    from moeprep.synth import write_synth_model
    from moeprep.units import format_size

    path = write_synth_model(
        out,
        arch,
        preset=preset,
        seed=seed,
        expert_type=expert_type,
        attn_type=attn_type,
        skew=skew,
        n_layer=n_layer,
        n_expert=n_expert,
        n_expert_used=n_expert_used,
        fast_random_blocks=fast_random_blocks,
        n_vocab=n_vocab,
        routing=routing,
        rope_scaling=rope_scaling,
        chat_template=chat_template,
    )
    click.echo(f"{path}  {format_size(Path(path).stat().st_size)}")


@main.command()
@click.argument("model", required=False, type=click.Path(dir_okay=False, path_type=Path))
@click.argument("outdir", required=False, type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--check",
    "check_dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Validate a publish folder instead: shards, checksums, card metadata. Exit 1 on problems.",
)
@click.option(
    "--base-model",
    help="Hugging Face repo the GGUF was made from, ORG/NAME (default: the GGUF's "
    "general.source.repo_url when it is on the Hub).",
)
@click.option("--profile", type=click.Path(dir_okay=False, path_type=Path), help="The model's .moeprof.")
@click.option("--imatrix", type=click.Path(dir_okay=False, path_type=Path), help="The importance matrix used.")
@click.option("--recipe", type=click.Path(dir_okay=False, path_type=Path), help="The recipe used.")
@click.option("--quantized-by", help="The card's quantized_by (default: moeprep).")
@click.option("--repo-id", help="USER/REPO it will be uploaded to: fills in the card's commands.")
@click.option("--tag", "tags", multiple=True, help="Extra card tag (repeatable).")
@click.option("--license", "license_id", help="Card license (default: the GGUF's general.license).")
@click.option("--language", "languages", multiple=True, help="Card language (repeatable; default: the GGUF's).")
@click.option("--split-max-size", help="Largest file to write (default 46G, under the Hub's 50 GB limit).")
@click.option(
    "--hardlink",
    is_flag=True,
    help="Hard-link the model's files instead of reflinking or copying them "
    "(no bytes written, but an edit in place of the folder's copy then edits MODEL too).",
)
def publish(
    model: Path | None,
    outdir: Path | None,
    check_dir: Path | None,
    base_model: str | None,
    profile: Path | None,
    imatrix: Path | None,
    recipe: Path | None,
    quantized_by: str | None,
    repo_id: str | None,
    tags: tuple[str, ...],
    license_id: str | None,
    languages: tuple[str, ...],
    split_max_size: str | None,
    hardlink: bool,
) -> None:
    """Write OUTDIR for `hf upload USER/REPO OUTDIR`: shards, model card, profile, imatrix, recipe, SHA256SUMS.

    `moeprep publish --check OUTDIR` validates such a folder before upload."""
    from moeprep.publish import PublishRequest, check_folder, format_published, publish_folder
    from moeprep.units import parse_size

    if check_dir is not None:
        if model or outdir:
            raise click.UsageError("--check takes only the folder: moeprep publish --check OUTDIR")
        report = check_folder(check_dir)
        click.echo(report.summary())
        sys.exit(0 if report.ok else 1)
    if model is None or outdir is None:
        raise click.UsageError(
            "give MODEL and OUTDIR (moeprep publish MODEL OUTDIR --base-model ORG/NAME), or --check OUTDIR"
        )
    result = publish_folder(
        PublishRequest(
            model,
            outdir,
            base_model,
            quantized_by,
            profile,
            imatrix,
            recipe,
            parse_size(split_max_size) if split_max_size else None,
            tags,
            license_id,
            languages,
            repo_id,
            hardlink,
        )
    )
    click.echo(format_published(result, repo_id))


@main.command()
@click.argument("recipe", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("model", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("outdir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--base-model", help="Hugging Face repo MODEL was made from, ORG/NAME (overrides the recipe).")
@click.option("--quantized-by", help="The card's quantized_by (overrides the recipe).")
@click.option("--repo-id", help="USER/REPO it will be uploaded to: fills in the card's commands.")
@click.option("--dataset", help="Calibration text, a Hub dataset or a local file/folder (overrides the recipe).")
@click.option("--dataset-config", help="Its configuration (overrides the recipe).")
@click.option("-c", "--ctx", type=click.IntRange(min=2), help="Tokens per calibration chunk (overrides the recipe).")
@click.option("--chunks", type=click.IntRange(min=1), help="Calibration chunks (overrides the recipe).")
@click.option("--holdout", type=click.FloatRange(0, 1, max_open=True), help="Held-out share (overrides the recipe).")
@click.option("--split-max-size", help="Largest published file (overrides the recipe).")
@click.option("--device", default="cpu", show_default=True, help="Torch device of the calibration passes.")
@click.option("--threads", default=os.cpu_count() or 1, show_default=True, help="Quantizer threads.")
def prepare(
    recipe: Path,
    model: Path,
    outdir: Path,
    base_model: str | None,
    quantized_by: str | None,
    repo_id: str | None,
    dataset: str | None,
    dataset_config: str | None,
    ctx: int | None,
    chunks: int | None,
    holdout: float | None,
    split_max_size: str | None,
    device: str,
    threads: int,
) -> None:
    """Calibrate, quantize with the imatrix, profile, bake and publish MODEL into OUTDIR/upload, as RECIPE says.

    Finished steps are recorded in OUTDIR/work/state.json; a rerun skips them unless their inputs changed."""
    from moeprep.prepare import PrepareJob, format_prepared
    from moeprep.prepare import prepare as run_prepare
    from moeprep.recipe import load_recipe

    overrides = {
        "publish.base_model": base_model,
        "publish.quantized_by": quantized_by,
        "publish.split_max_size": split_max_size,
        "calibration.dataset": dataset,
        "calibration.config": dataset_config,
        "calibration.ctx": ctx,
        "calibration.chunks": chunks,
        "calibration.holdout": holdout,
    }
    job = PrepareJob(load_recipe(recipe, overrides), model, outdir, repo_id, device, threads)
    results = run_prepare(job, log=click.echo)
    click.echo(format_prepared(job, results))
