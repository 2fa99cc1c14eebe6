"""pyproject lists every package by hand (runtime/ installs as `moerun`): keep that list complete."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INSTALLED_AS = {"moeprep": "moeprep", "runtime": "moerun"}


def test_every_package_is_listed() -> None:
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set()
    for folder, name in INSTALLED_AS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((name, *parts)))
    assert found == listed, f"pyproject packages: missing {sorted(found - listed)}, stale {sorted(listed - found)}"
