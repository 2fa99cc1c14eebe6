"""Byte sizes as people type and read them: "24G", "1.5T", "512M" (powers of 1024, as GPU memory is sold)."""

from __future__ import annotations

import re

from moeprep.errors import MoeprepError

UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'24G' -> 25769803776; raises MoeprepError on anything else."""
    m = SIZE_RE.match(text)
    if m is None:
        raise MoeprepError(f"{text!r}: not a size; write it like 24G, 512M or 1.5T")
    return int(float(m[1]) * UNITS[m[2].upper()])


def format_size(n: float) -> str:
    """1536 -> '1.50 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"
