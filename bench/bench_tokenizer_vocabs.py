"""moerun's tokenizer against llama.cpp's own tokenizer test vectors, on the real vocabularies llama.cpp ships.

llama-cpp-python's source package carries `vendor/llama.cpp/models/ggml-vocab-*.gguf` (vocabulary-only GGUF files
of real models) with `.inp`/`.out` pairs: texts and the token ids llama.cpp gives them (add_special=False,
special=False). This script downloads that package when it runs (pip's cache answers after the first time; the
repository never stores it), tokenizes every input with moerun.tokenizer.Tokenizer and reports, per vocabulary,
how many vectors agree, the first disagreement, or why the vocabulary is refused.

With --fuzz N it also tokenizes N random texts (drawn from letters of many scripts and cases, digits, marks,
emoji, controls, Unicode spaces and contractions) with both moerun and the installed llama-cpp-python, on every
vocabulary (those without vectors too) and on the qwen2 vocabulary (gemma-4's for the raw-UTF-8 ones) written
under every pre-tokenizer name llama.cpp accepts. Exit status 1 if anything differs.

    python bench/bench_tokenizer_vocabs.py [--sdist PATH.tar.gz] [--show N] [--fuzz N]
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from gguf import GGUFValueType

from moeprep.errors import MoeprepError
from moeprep.gguf.reader import open_gguf
from moeprep.gguf.writer import KVValue, write_gguf
from moerun.tokenizer import Tokenizer
from moerun.tokenizer.pretokenizers import PRE_TOKENIZERS

PACKAGE = "llama-cpp-python==0.3.36"
SEPARATOR = "\n__ggml_vocab_test__\n"
# Pieces random texts are drawn from: cased letters of several scripts, digits of several systems, marks, emoji
# (newer ones too), control characters, Unicode spaces, contractions in both cases.
FUZZ_PIECES = [
    *"abcXYZ'sStT  \t\n\r0123456789.,!?-_/$+<=>^`|~()[]{}\"#%&*:;@\\",
    *"éÉßǅǄŉ日本語中文한국어ΑβГдיעبالعربيةहिन्दी१२३٣٤、。！？・ーｶﾞ０１ＡＢａｂ",
    *"\u3000\u00a0\u2003\u200b\u0301\u0308\u093f\u094d🙂👍🏽🧑‍💻\U0001fa77\x01\x1f\x7f\u2028\u0085",
    "'re",
    "'LL",
    "'Ve",
    "IT'S",
    " 'd",
]


def fetch_sdist(into: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-q", "-d", str(into), PACKAGE],
        check=True,
    )
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


def fuzz(vocab: Path, n: int, seed: int = 0) -> tuple[str, bool]:
    """`n` random texts through moerun and llama-cpp-python (vocabulary-only load); the count that differ."""
    import llama_cpp  # the oracle: installed with moeprep's test extra

    g = open_gguf(vocab)
    kind = f"{g.get('tokenizer.ggml.model')}/{g.get('tokenizer.ggml.pre') or '-'}"
    try:
        tokenizer = Tokenizer(g)
    except MoeprepError as e:
        return f"{vocab.name:34s} {kind:24s} refused: {str(e).split(': ', 1)[1][:90]}", True
    llm = llama_cpp.Llama(str(vocab), vocab_only=True, verbose=False)
    rng = random.Random(seed)
    bad = []
    for _ in range(n):
        text = "".join(rng.choice(FUZZ_PIECES) for _ in range(rng.randint(1, 40)))
        if tokenizer.encode(text, add_bos=False) != list(llm.tokenize(text.encode(), add_bos=False, special=False)):
            bad.append(text)
    line = f"{vocab.name:34s} {kind:24s} {n - len(bad)}/{n} random texts agree"
    return line + "".join(f"\n    {t!r}" for t in bad[:3]), not bad


def every_pre_tokenizer(models: Path, into: Path) -> list[Path]:
    """The real qwen2 vocabulary (gemma-4's for raw-UTF-8 pre-tokenizers) under each pre-tokenizer name. "whitespace"
    is left out: it belongs to the "whitespace" tokenizer model, and under "gpt2" llama.cpp aborts on a run of
    two whitespace characters."""
    byte_level, raw = open_gguf(models / "ggml-vocab-qwen2.gguf"), open_gguf(models / "ggml-vocab-gemma-4.gguf")
    paths = []
    for name, pre in sorted(PRE_TOKENIZERS.items()):
        if name == "whitespace":
            continue
        path = into / f"pre-{name}.gguf"
        write_gguf(
            path,
            byte_level if pre.byte_level else raw,
            kv_set={
                "tokenizer.ggml.model": KVValue("gpt2", GGUFValueType.STRING),
                "tokenizer.ggml.pre": KVValue(name, GGUFValueType.STRING),
            },
        )
        paths.append(path)
    return paths


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sdist", type=Path, help="a llama-cpp-python 0.3.36 source package already on disk")
    ap.add_argument("--show", type=int, default=3, help="disagreements to print per vocabulary")
    ap.add_argument("--fuzz", type=int, default=0, help="random texts per vocabulary checked against llama-cpp-python")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sdist = args.sdist or fetch_sdist(Path(tmp))
        models = extract_vocabs(sdist, Path(tmp))
        vocabs = sorted(models.glob("ggml-vocab-*.gguf"))
        ok = True
        print("llama.cpp's test vectors:")
        for vocab in vocabs:
            line, passed = check(vocab, args.show)
            ok &= passed
            print(line, flush=True)
        if args.fuzz:
            print(f"\n{args.fuzz} random texts per vocabulary, against llama-cpp-python:")
            for vocab in vocabs + every_pre_tokenizer(models, Path(tmp)):
                line, passed = fuzz(vocab, args.fuzz)
                ok &= passed
                print(line, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
