"""The `moeprep` command: each subcommand parses its options, calls one library function and prints.

MoeprepError (the user's input is wrong) becomes one line on stderr and exit code 2; set MOEPREP_DEBUG=1 for
the traceback.
"""

from __future__ import annotations

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
