"""Outputs that appear whole or not at all: write to temp files beside the destinations, rename at the end.

Every file or folder moeprep writes (models, profiles, exports, importance matrices, prepare's state, publish
folders) goes through here, so an error, Ctrl-C or SIGTERM never leaves a partial or clobbered output. The renames of
one output set are shielded from both signals (they take effect right after them), so a split model never appears in
part.

While a command runs under `logged_outputs`, what happened to each output is logged; after a Ctrl-C or SIGTERM the
CLIs print the log's one-line summary (cli_groups.UserErrorGroup). SIGTERM matters for background jobs: a shell
script's `cmd &` starts cmd with SIGINT ignored, and Python keeps it so (a terminal's Ctrl-C is the foreground's),
so `kill PID` is how such a job is stopped; `sigterm_raises` turns it into an exception that cleans up on the way
out, as Ctrl-C's KeyboardInterrupt does.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class OutputLog:
    """The outputs of one command so far: those renamed into place, those given up (temp files removed)."""

    written: list[Path] = field(default_factory=list)
    not_written: list[Path] = field(default_factory=list)
    temps: list[Path] = field(default_factory=list)  # in progress: outputs written inside them are not the user's

    def record(self, paths: list[Path], done: bool) -> None:
        paths = [p for p in paths if not any(p.is_relative_to(t) for t in self.temps)]
        (self.written if done else self.not_written).extend(paths)

    def summary(self) -> str:
        """What state the files are in, one line: '<X> written complete; <Y> not written; the inputs are unchanged'."""

        def names(paths: list[Path]) -> str:
            return ", ".join(dict.fromkeys(map(str, paths)))  # prepare rewrites its state file: name it once

        parts = [f"{names(self.written)} written complete"] if self.written else []
        parts.append(
            f"{names(self.not_written)} not written (no temp files left)"
            if self.not_written
            else "nothing half-written"
        )
        return "; ".join(parts) + "; the inputs are unchanged"


_log: OutputLog | None = None
SHIELDED = (signal.SIGINT, signal.SIGTERM)  # held back while an output set is renamed into place


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread like Ctrl-C's KeyboardInterrupt, so every cleanup path handles it."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """SIGTERM raises Terminated inside the block, where its default action would kill the process at once and
    leave temp files behind. A SIGTERM handler someone else set, or an ignored SIGTERM, is left as it is."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        yield
        return
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextlib.contextmanager
def logged_outputs() -> Iterator[OutputLog]:
    """Log the outputs written or given up inside the block."""
    global _log
    outer, _log = _log, OutputLog()
    try:
        yield _log
    finally:
        _log = outer


def _record(paths: list[Path], done: bool) -> None:
    if _log is not None:
        _log.record(paths, done)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


@contextlib.contextmanager
def _interrupts_after() -> Iterator[None]:
    """A Ctrl-C or SIGTERM during the block takes effect when it ends, so a set of renames is never left half done.
    An ignored signal stays ignored."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread gets Python's signals
        yield
        return
    caught: list[int] = []
    previous = {signum: signal.signal(signum, lambda signum, frame: caught.append(signum)) for signum in SHIELDED}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if caught:
        handler = previous[caught[0]]
        if callable(handler):
            handler(caught[0], None)  # Python's SIGINT handler raises KeyboardInterrupt, sigterm_raises' Terminated
        elif handler == signal.SIG_DFL:
            signal.raise_signal(caught[0])  # the default action, now that the renames are done


@contextlib.contextmanager
def atomic_outputs(paths: list[Path]) -> Iterator[list[Path]]:
    """Temp paths beside `paths`; renamed over them only if the block finishes, removed on any error or Ctrl-C.

    The block may make a temp path a file or a folder (a folder replaces a missing or empty one)."""
    paths = [Path(p) for p in paths]
    temps = [p.with_name(f".{p.name}.tmp-{os.getpid()}") for p in paths]
    if _log is not None:
        _log.temps += temps
    done = False
    try:
        yield temps
        with _interrupts_after():
            for tmp, final in zip(temps, paths):
                os.replace(tmp, final)
            done = True
    finally:
        for tmp in temps:
            _remove(tmp)
        if _log is not None:
            _log.temps = [t for t in _log.temps if t not in temps]
        _record(paths, done)


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike[str]) -> Iterator[Path]:
    """atomic_outputs for one file or folder: yields its temp path."""
    with atomic_outputs([Path(path)]) as (tmp,):
        yield tmp


@contextlib.contextmanager
def staged_outputs(out: Path) -> Iterator[Path]:
    """For outputs named only as they are written (a model's shards): an empty hidden folder beside `out` to write
    them in, under their final names. When the block finishes, every file in it is renamed into out's folder; on
    any error or Ctrl-C they are all removed. The log names `out` when nothing was moved."""
    stage = out.with_name(f".{out.name}.stage-{os.getpid()}")
    stage.mkdir()
    if _log is not None:
        _log.temps.append(stage)
    moved: list[Path] = []
    try:
        yield stage
        with _interrupts_after():
            for f in sorted(stage.iterdir()):
                os.replace(f, out.parent / f.name)
                moved.append(out.parent / f.name)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
        if _log is not None:
            _log.temps.remove(stage)
        _record(moved or [out], bool(moved))
