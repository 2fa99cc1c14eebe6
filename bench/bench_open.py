"""Opening a GGUF with a real model's vocabulary: moeprep's reader vs gguf-py's GGUFReader vs llama.cpp's vocab load.

    python bench/bench_open.py [--vocab 262144] [--repeat 5] [--dir DIR]

Writes (once, into --dir) a tiny synthetic qwen3moe whose vocabulary is padded to --vocab tokens (Gemma 3 has
262,144; the metadata then holds that many token strings and token types), plus two copies of it: one whose
architecture moerun does not run and one with the shipped 2,048-token vocabulary. In one run, on the same file:

- open_gguf: moeprep's parser, metadata and tensor infos (strings not decoded yet); best of --repeat.
- open_gguf + decode: the same, then every token string decoded.
- moerun tokenizer: open_gguf + moerun's Tokenizer built from the metadata (what llama.cpp's vocab load does).
- gguf.GGUFReader: gguf-py's reader, which moeprep used before (once: it takes seconds).
- llama.cpp vocab_only: llama_cpp.Llama(path, vocab_only=True), vocabulary and tokenizer; best of --repeat.

Then the two readers at equal work, each doing the least its API allows for the same result:

- the tensor table (names, types, shapes, offsets): `open_gguf(path).tensors` against `GGUFReader(path).tensors`
  (gguf-py has no way to read the tensor table without parsing every key first);
- every key as plain Python values (all 262,144 token strings and types among them): `open_gguf(path).kv` against
  `GGUFReader(path)` plus `field.contents()` of every field.

Then whole commands in fresh processes, to show the fixed cost a real vocabulary adds: `moeprep inspect` on the
real-vocabulary file and on the 2,048-token one, and `moerun -m` on the file of an unsupported architecture (refused
with one line, exit 2, before torch is imported); Python's own start and torch's import for scale.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import llama_cpp
from gguf import GGUFReader, GGUFValueType, Keys

from moeprep.gguf.reader import open_gguf
from moeprep.gguf.writer import KVValue, write_gguf
from moeprep.synth import write_synth_model
from moerun.tokenizer import Tokenizer


def best_seconds(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def command_seconds(args: list[str], repeat: int) -> tuple[float, int, str]:
    """Best wall time of a command in a fresh process, its exit code and its last stderr line."""
    best, result = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = subprocess.run(args, capture_output=True, text=True)
        best = min(best, time.perf_counter() - t0)
    assert result is not None
    return best, result.returncode, (result.stderr.strip().splitlines() or [""])[-1]


def files(folder: Path, n_vocab: int) -> tuple[Path, Path, Path]:
    real = folder / f"bench-open-vocab{n_vocab}.gguf"
    small = folder / "bench-open-vocab2048.gguf"
    foreign = folder / f"bench-open-vocab{n_vocab}-gemma3.gguf"
    if not real.exists():
        write_synth_model(real, "qwen3moe", n_vocab=n_vocab)
    if not small.exists():
        write_synth_model(small, "qwen3moe")
    if not foreign.exists():
        write_gguf(
            foreign, open_gguf(real), kv_set={Keys.General.ARCHITECTURE: KVValue("gemma3", GGUFValueType.STRING)}
        )
    return real, small, foreign


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=262_144)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    a = ap.parse_args()
    real, small, foreign = files(a.dir, a.vocab)
    print(f"{real.name}: {real.stat().st_size / 2**20:.1f} MiB, {a.vocab} tokens")

    def ours_decoded() -> None:
        open_gguf(real).get(Keys.Tokenizer.LIST)

    llm = llama_cpp.Llama(model_path=str(real), vocab_only=True, verbose=False)
    assert llm.n_vocab() == a.vocab, llm.n_vocab()
    del llm
    rows = [
        ("open_gguf (moeprep)", best_seconds(lambda: open_gguf(real), a.repeat)),
        ("open_gguf + decode all tokens", best_seconds(ours_decoded, a.repeat)),
        ("open_gguf + moerun Tokenizer", best_seconds(lambda: Tokenizer(open_gguf(real)), a.repeat)),
        ("gguf.GGUFReader", best_seconds(lambda: GGUFReader(real), 1)),
        (
            "llama.cpp vocab_only load",
            best_seconds(lambda: llama_cpp.Llama(model_path=str(real), vocab_only=True, verbose=False), a.repeat),
        ),
    ]
    for label, seconds in rows:
        print(f"  {label:34} {seconds:8.3f} s")

    def gguf_py_every_key() -> None:
        reader = GGUFReader(real)
        {name: field.contents() for name, field in reader.fields.items()}

    print("equal work (gguf-py once: it takes seconds):")
    for label, ours, theirs in [
        ("tensor table", lambda: open_gguf(real).tensors, lambda: GGUFReader(real).tensors),
        ("every key as Python values", lambda: open_gguf(real).kv, gguf_py_every_key),
    ]:
        ours_s, theirs_s = best_seconds(ours, a.repeat), best_seconds(theirs, 1)
        print(f"  {label:28} moeprep {ours_s:8.3f} s   gguf-py {theirs_s:8.3f} s   ratio {theirs_s / ours_s:6.1f}x")

    print("whole commands, fresh processes (best of 3):")
    for label, args in [
        (f"moeprep inspect ({a.vocab} tokens)", ["moeprep", "inspect", str(real)]),
        ("moeprep inspect (2048 tokens)", ["moeprep", "inspect", str(small)]),
        ("moerun -m (unsupported arch)", ["moerun", "-m", str(foreign), "-p", "hi", "-n", "1"]),
        ("python -c pass (for scale)", [sys.executable, "-c", "pass"]),
        ("python -c 'import torch' (for scale)", [sys.executable, "-c", "import torch"]),
    ]:
        seconds, code, last = command_seconds(args, 3)
        print(f"  {label:38} {seconds:8.3f} s  exit {code}  {last[:90] if code else ''}")


if __name__ == "__main__":
    main()
