"""The project's lint and format rules (pyproject.toml's [tool.ruff]) hold on every file: `ruff check` and
`ruff format --check` over the repository, as a contributor runs them before committing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args, "--no-cache", str(ROOT)], capture_output=True, text=True, cwd=ROOT
    )


@pytest.mark.parametrize("command", [("check",), ("format", "--check")], ids=["lint", "format"])
def test_ruff(command):
    result = ruff(*command)
    assert result.returncode == 0, result.stdout + result.stderr
