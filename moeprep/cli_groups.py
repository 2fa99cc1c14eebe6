"""Click group classes shared by `moeprep`, `moeprep profile` and `moerun`."""

from __future__ import annotations

import contextlib
import os
import sys
import traceback

import click

from moeprep.atomic import Terminated, logged_outputs, sigterm_raises
from moeprep.errors import MoeprepError

INTERRUPTED = 130  # 128 + SIGINT: the exit code shells give a Ctrl-C'd command
TERMINATED = 143  # 128 + SIGTERM


class UserErrorGroup(click.Group):
    """Maps MoeprepError (the user's input is wrong) and a subcommand's bad option or argument (a missing file, a
    wrong value) to one line on stderr and exit code 2, as pip-tools does; and Ctrl-C to one line saying what state
    the files are in (moeprep.atomic's log of the outputs) and exit code 130, as a shell reports SIGINT.

    Set MOEPREP_DEBUG=1 for the traceback. `prog` names the program in the message. With `stops_on_sigterm`,
    SIGTERM (`kill PID`, the way to stop a background job) is handled as Ctrl-C is, with its own word and exit code."""

    prog = "moeprep"
    stops_on_sigterm = False

    def invoke(self, ctx: click.Context):
        sigterm = sigterm_raises() if self.stops_on_sigterm else contextlib.nullcontext()
        with logged_outputs() as outputs, sigterm:
            try:
                return super().invoke(ctx)
            except MoeprepError as e:
                if os.environ.get("MOEPREP_DEBUG"):
                    raise
                self.fail(str(e))
            except click.UsageError as e:
                hint = f" (see '{e.ctx.command_path} --help')" if e.ctx is not None else ""
                self.fail(e.format_message() + hint)
            except KeyboardInterrupt as e:
                if os.environ.get("MOEPREP_DEBUG"):
                    traceback.print_exc()  # where it was (click would print only "Aborted!")
                terminated = isinstance(e, Terminated)
                click.echo(
                    f"{self.prog}: {'terminated' if terminated else 'interrupted'}: {outputs.summary()}", err=True
                )
                sys.exit(TERMINATED if terminated else INTERRUPTED)

    def fail(self, message: str) -> None:
        click.echo(f"{self.prog}: error: {message}", err=True)
        sys.exit(2)


class MoeprepGroup(UserErrorGroup):
    """`moeprep`: its commands write big files for minutes to hours, often as background jobs, so SIGTERM cleans up
    as Ctrl-C does."""

    stops_on_sigterm = True


class DefaultCommandGroup(click.Group):
    """A group whose first argument, when it names no subcommand, goes to `default_command`: so that both
    `moeprep profile MODEL --dataset X` and `moeprep profile show P` work (and `moerun -m M -p P`)."""

    default_command = "run"

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ctx.help_option_names:
            args = [self.default_command, *args]
        return super().parse_args(ctx, args)
