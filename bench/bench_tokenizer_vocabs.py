"""moerun's tokenizer against llama.cpp's own tokenizer test vectors, on the real vocabularies llama.cpp ships.

llama-cpp-python's source package carries `vendor/llama.cpp/models/ggml-vocab-*.gguf` (vocabulary-only GGUF files
of real models) with `.inp`/`.out` pairs: texts and the token ids llama.cpp gives them (add_special=False,
special=False). This script downloads that package when it runs (pip's cache answers after the first time; the
repository never stores it), tokenizes every input with moerun.tokenizer.Tokenizer and reports, per vocabulary,
how many vectors agree, the first disagreement, or why the vocabulary is refused. Exit status 1 if any differs.

    python bench/bench_tokenizer_vocabs.py [--sdist PATH.tar.gz] [--show N]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from moeprep.errors import MoeprepError
from moeprep.gguf.reader import open_gguf
from moerun.tokenizer import Tokenizer

PACKAGE = "llama-cpp-python==0.3.36"
SEPARATOR = "\n__ggml_vocab_test__\n"


def fetch_sdist(into: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-q", "-d",
                    str(into), PACKAGE], check=True)
    return next(into.glob("llama_cpp_python-*.tar.gz"))


def extract_vocabs(sdist: Path, into: Path) -> Path:
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if "/vendor/llama.cpp/models/ggml-vocab-" in m.name and m.isfile()]
        tar.extractall(into, members=members, filter="data")
    return next(into.glob("*/vendor/llama.cpp/models"))


def read_vectors(vocab: Path) -> list[tuple[str, list[int]]]:
    raw = vocab.with_name(vocab.name + ".inp").read_text(encoding="utf-8")
    texts = raw.split(SEPARATOR)
    if texts and texts[-1] == "":
        texts.pop()  # the file ends with a separator
    outs = vocab.with_name(vocab.name + ".out").read_text(encoding="utf-8").split("\n")[: len(texts)]
    return [(t, [int(x) for x in o.split()]) for t, o in zip(texts, outs)]


def check(vocab: Path, show: int) -> tuple[str, bool]:
    g = open_gguf(vocab)
    kind = f"{g.get('tokenizer.ggml.model')}/{g.get('tokenizer.ggml.pre') or '-'}"
    if not vocab.with_name(vocab.name + ".inp").exists():
        return f"{vocab.name:34s} {kind:24s} no test vectors", True
    try:
        tokenizer = Tokenizer(g)
    except MoeprepError as e:
        return f"{vocab.name:34s} {kind:24s} refused: {str(e).split(': ', 1)[1][:90]}", True
    vectors = read_vectors(vocab)
    bad = [(t, want, tokenizer.encode(t, add_bos=False)) for t, want in vectors]
    bad = [b for b in bad if b[1] != b[2]]
    line = f"{vocab.name:34s} {kind:24s} {len(vectors) - len(bad)}/{len(vectors)} agree"
    for text, want, got in bad[:show]:
        line += f"\n    {text[:60]!r}\n      llama.cpp {want[:16]}\n      moerun    {got[:16]}"
    return line, not bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sdist", type=Path, help="a llama-cpp-python 0.3.36 source package already on disk")
    ap.add_argument("--show", type=int, default=3, help="disagreements to print per vocabulary")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sdist = args.sdist or fetch_sdist(Path(tmp))
        models = extract_vocabs(sdist, Path(tmp))
        ok = True
        for vocab in sorted(models.glob("ggml-vocab-*.gguf")):
            line, passed = check(vocab, args.show)
            ok &= passed
            print(line, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
