"""Click group classes shared by `moeprep`, `moeprep profile` and `moerun`."""

from __future__ import annotations

import os
import sys

import click

from moeprep.errors import MoeprepError


class UserErrorGroup(click.Group):
    """Maps MoeprepError (the user's input is wrong) and a subcommand's bad option or argument (a missing file, a
    wrong value) to one line on stderr and exit code 2, as pip-tools does.

    Set MOEPREP_DEBUG=1 for the traceback. `prog` names the program in the message."""

    prog = "moeprep"

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except MoeprepError as e:
            if os.environ.get("MOEPREP_DEBUG"):
                raise
            self.fail(str(e))
        except click.UsageError as e:
            hint = f" (see '{e.ctx.command_path} --help')" if e.ctx is not None else ""
            self.fail(e.format_message() + hint)

    def fail(self, message: str) -> None:
        click.echo(f"{self.prog}: error: {message}", err=True)
        sys.exit(2)


class DefaultCommandGroup(click.Group):
    """A group whose first argument, when it names no subcommand, goes to `default_command`: so that both
    `moeprep profile MODEL --dataset X` and `moeprep profile show P` work (and `moerun -m M -p P`)."""

    default_command = "run"

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ctx.help_option_names:
            args = [self.default_command, *args]
        return super().parse_args(ctx, args)
