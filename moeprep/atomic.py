"""Outputs that appear whole or not at all: write to temp files beside the destinations, rename at the end.

Every file moeprep writes (models, profiles, exports, importance matrices, prepare's state) goes through here, so
an error or Ctrl-C never leaves a partial or clobbered output.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_outputs(paths: list[Path]) -> Iterator[list[Path]]:
    """Temp paths beside `paths`; renamed over them only if the block finishes, removed on any error or Ctrl-C."""
    temps = [p.with_name(f".{p.name}.tmp-{os.getpid()}") for p in paths]
    try:
        yield temps
        for tmp, final in zip(temps, paths):
            os.replace(tmp, final)
    finally:
        for tmp in temps:
            tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike[str]) -> Iterator[Path]:
    """atomic_outputs for one file: yields its temp path."""
    with atomic_outputs([Path(path)]) as (tmp,):
        yield tmp
