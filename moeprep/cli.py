"""The `moeprep` command: each subcommand parses its options, calls one library function and prints.

MoeprepError (the user's input is wrong) becomes one line on stderr and exit code 2; set MOEPREP_DEBUG=1 for
the traceback.
"""

from __future__ import annotations

import json
import os
import sys

import click

from moeprep import __version__
from moeprep.errors import MoeprepError


class MoeprepGroup(click.Group):
    """Click group that maps MoeprepError to one line and exit code 2 (see moeprep/errors.py)."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except MoeprepError as e:
            if os.environ.get("MOEPREP_DEBUG"):
                raise
            click.echo(f"moeprep: error: {e}", err=True)
            sys.exit(2)


@click.group(cls=MoeprepGroup)
@click.version_option(__version__, prog_name="moeprep")
def main() -> None:
    """Prepare Mixture-of-Experts GGUF models for expert-cached inference."""


# Commands are registered below, one block each; keep each block a thin wrapper around a library call.


@main.command()
@click.argument("model", type=click.Path(path_type=str))
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--vram", help="GPU memory sizes, comma-separated (24G,24G): show how many expert-cache slots fit.")
@click.option("--reserve", default="1.5G", show_default=True, help="Memory kept back per GPU (context, KV, activations).")
def inspect(model: str, as_json: bool, vram: str | None, reserve: str) -> None:
    """Show a GGUF MoE model's anatomy: layers, experts, bytes per tensor role, cache slots in VRAM."""
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
@click.option("--dir", "folder", type=click.Path(file_okay=False, path_type=str),
              help="Folder for the demo's files (default: a new temporary folder, kept afterwards).")
def demo(folder: str | None) -> None:
    """Show every moeprep capability on a small synthetic MoE model, step by step."""
    import tempfile
    from pathlib import Path

    from moeprep.demo import run_demo

    run_demo(Path(folder) if folder else Path(tempfile.mkdtemp(prefix="moeprep-demo-")))
