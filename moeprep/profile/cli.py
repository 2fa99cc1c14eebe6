"""`moeprep profile`: the command group. `moeprep profile MODEL ...` runs a calibration pass (the `run` command);
`show`, `merge`, `export` and `bake` work on profiles. Each command parses, calls one library function, prints."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from moeprep.cli_groups import DefaultCommandGroup

EXPORT_FORMATS = ["moe-state-ini", "trace-csv", "json"]  # the keys of moeprep.profile.export.EXPORTERS (tested)


@click.group(cls=DefaultCommandGroup)
def profile() -> None:
    """Profile which experts a MoE model uses: `moeprep profile MODEL --dataset wikitext -o OUT.moeprof`.

    The subcommands read, combine, convert and bake profiles."""


def _weights(ctx: click.Context, param: click.Parameter, value: str | None) -> list[int] | None:
    if value is None:
        return None
    try:
        return [int(w) for w in value.split(",")]
    except ValueError as e:
        raise click.BadParameter(f"{value!r}: give comma-separated positive integers, e.g. 1,2") from e


@profile.command()
@click.argument("model", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--dataset",
    required=True,
    help="Hugging Face dataset name (wikitext), or a local .txt/.jsonl/.parquet file or folder of them.",
)
@click.option("--dataset-config", help="Dataset configuration (wikitext: wikitext-2-raw-v1 by default).")
@click.option("--split", default="train", show_default=True, help="Dataset split.")
@click.option("--text-column", default="text", show_default=True, help="Column holding the text.")
@click.option("-c", "--ctx", default=512, show_default=True, type=click.IntRange(min=2), help="Tokens per chunk.")
@click.option("--chunks", type=click.IntRange(min=1), help="Chunks to run (held-out ones included); default: all.")
@click.option("--tokens", type=click.IntRange(min=1), help="Instead of --chunks: enough chunks for this many tokens.")
@click.option(
    "--holdout",
    default=0.2,
    show_default=True,
    type=click.FloatRange(0, 1, max_open=True),
    help="Share of the chunks kept out of the counts and replayed through simulated caches; 0: none.",
)
@click.option("--device", default="cpu", show_default=True, help="Torch device: cpu, cuda, cuda:1 ...")
@click.option(
    "--imatrix-out",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Also write llama.cpp's GGUF importance matrix from the same pass.",
)
@click.option(
    "-o",
    "--output",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Profile to write (.moeprof).",
)
def run(
    model: Path,
    dataset: str,
    dataset_config: str | None,
    split: str,
    text_column: str,
    ctx: int,
    chunks: int | None,
    tokens: int | None,
    holdout: float,
    device: str,
    imatrix_out: Path | None,
    output: Path,
) -> None:
    """Run calibration text through MODEL and record which experts each MoE layer chose."""
    from moeprep.profile.analysis import format_heldout, format_summary
    from moeprep.profile.dataset import DatasetSpec
    from moeprep.profile.format import write_profile
    from moeprep.profile.run import ProfileRequest, profile_model

    if chunks is not None and tokens is not None:
        raise click.UsageError("--chunks and --tokens both say how much text to run; give one of them")
    spec = DatasetSpec(dataset, dataset_config, split, text_column)
    p = profile_model(ProfileRequest(model, spec, ctx, chunks, tokens, holdout, device, imatrix_out))
    write_profile(output, p)
    click.echo(format_summary(p))
    click.echo()
    click.echo(format_heldout(p.heldout))
    click.echo(f"\nwrote {output}" + (f" and {imatrix_out}" if imatrix_out else ""))


@profile.command()
@click.argument("path", type=click.Path(path_type=Path))
@click.option(
    "--plot",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write a PNG: layers x experts heatmap and per-layer coverage of the hottest experts.",
)
@click.option("--per-layer", is_flag=True, help="Also print the held-out hit rates of every layer.")
def show(path: Path, plot: Path | None, per_layer: bool) -> None:
    """Summarise a profile: per layer, how concentrated expert use is; the held-out cache table."""
    from moeprep.profile.analysis import format_heldout, format_summary, plot_profile
    from moeprep.profile.format import read_profile

    p = read_profile(path)
    click.echo(format_summary(p))
    click.echo()
    click.echo(format_heldout(p.heldout, per_layer))
    if plot:
        plot_profile(p, plot)
        click.echo(f"\nwrote {plot}")


@profile.command()
@click.argument("profiles", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--weights", callback=_weights, help="One positive integer per profile, e.g. 1,2 (default: all 1).")
def merge(profiles: tuple[Path, ...], output: Path, weights: list[int] | None) -> None:
    """Combine profiles of the same model into one (counts added with weights, traces kept)."""
    from moeprep.profile.format import read_profile, write_profile
    from moeprep.profile.profile import merge_profiles

    merged = merge_profiles([(str(p), read_profile(p)) for p in profiles], weights)
    write_profile(output, merged)
    click.echo(f"merged {len(profiles)} profiles into {output}")


@profile.command()
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--format", "fmt", required=True, type=click.Choice(EXPORT_FORMATS))
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), help="Output file (default: stdout).")
@click.option(
    "--model",
    type=click.Path(exists=True, dir_okay=False, path_type=str),
    help="Label the export with this GGUF's name and size (it must route like the profiled model).",
)
def export(path: Path, fmt: str, output: Path | None, model: str | None) -> None:
    """Write a profile as llama.cpp's moe-state.ini section, a CSV routing trace or JSON."""
    from moeprep.profile.export import EXPORTERS, export_label, write_export
    from moeprep.profile.format import read_profile

    p = read_profile(path)
    label = export_label(p, str(path), model)
    if output is None:
        EXPORTERS[fmt](p, label, sys.stdout)
    else:
        write_export(p, fmt, label, output)


@profile.command()
@click.argument("path", type=click.Path(path_type=Path))
@click.argument("model", type=click.Path(exists=True, dir_okay=False, path_type=str))
@click.argument("out", type=click.Path(dir_okay=False, path_type=Path))
def bake(path: Path, model: str, out: Path) -> None:
    """Copy MODEL to OUT with the profile's counts as the GGUF key moe_cache.expert_usage (a warm start)."""
    from moeprep.profile.export import EXPERT_USAGE_KEY, bake_profile
    from moeprep.profile.format import read_profile

    written = bake_profile(read_profile(path), str(path), model, out)
    click.echo(f"wrote {', '.join(map(str, written))} with {EXPERT_USAGE_KEY}")
