"""Build the package data the synthetic models rely on: calibration text and the byte-level BPE tokenizer.

Run once by a maintainer (`python -m moeprep.synth.corpus`); the results are committed under moeprep/data/, so
writing a synthetic model never retrains anything. The text is whole modules of the Python standard library
(PSF license, redistributable with its notice; see moeprep/data/README.md): English docstrings and essays mixed
with real code, which is what a calibration set for a general model should look like.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

from moeprep.synth.tokenizer import DATA_DIR, TOKENIZER_PATH, train_tokenizer

CALIBRATION_PATH = DATA_DIR / "calibration.txt"
# Prose-heavy modules first (heapq's essay, statistics' docstrings), then code-heavy ones; ~160 KB in all.
STDLIB_MODULES = ("heapq", "textwrap", "statistics", "fractions", "bisect", "string", "graphlib", "colorsys", "shlex")
DOCUMENT_SEPARATOR = "\n\n"


def collect_calibration_text(stdlib: Path | None = None) -> str:
    """The shipped modules' source, one document each, separated by a blank line."""
    stdlib = stdlib or Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / f"{name}.py").read_text(encoding="utf-8").strip() for name in STDLIB_MODULES]
    return DOCUMENT_SEPARATOR.join(texts) + "\n"


def main() -> None:
    text = collect_calibration_text()
    CALIBRATION_PATH.write_text(text, encoding="utf-8")
    tokenizer = train_tokenizer(text)
    tokenizer.save(str(TOKENIZER_PATH), pretty=False)
    print(f"{CALIBRATION_PATH}: {len(text.encode())} bytes; {TOKENIZER_PATH}: {tokenizer.get_vocab_size()} tokens")


if __name__ == "__main__":
    main()
