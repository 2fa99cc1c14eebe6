"""Build the training corpus of the bench model: collect, split, train the tokenizer, tokenize.

Text is what every machine of this project has without downloads: every `.py` file of CPython 3.11.7's standard
library (site-packages excluded; PSF license) and the licence texts in /usr/share/common-licenses. Each file is one
document. A file is held out when the first 8 hex digits of sha256(its path relative to its root) are 0 modulo 50
(about 2%): the split depends on names only, so it never moves when a file's contents change.

Outputs (bench/train_moe/work/ is git-ignored; bench/data/ is committed):
  work/tokenizer.json        byte-level BPE (Qwen2 split, moeprep.synth.tokenizer.train_tokenizer), train split only
  work/train.npy, heldout.npy   uint16 token ids, each document followed by <|endoftext|>
  bench/data/heldout.txt     the held-out documents joined by a blank line, for llama.cpp and moerun perplexity
  bench/data/corpus-manifest.tsv   split, bytes, sha256 of contents and path of every document

Run: python -m bench.train_moe.corpus   (about 3 minutes on 2 CPU cores)
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moeprep.synth.tokenizer import ENDOFTEXT, train_tokenizer

HERE = Path(__file__).resolve().parent
WORK = HERE / "work"
DATA = HERE.parent / "data"
VOCAB_SIZE = 8192
HELDOUT_MODULUS = 50  # one file in 50 is held out
LICENSES = Path("/usr/share/common-licenses")


@dataclass(frozen=True)
class Document:
    source: str  # "stdlib" or "licenses"
    path: str  # relative to the source's root
    text: str

    @property
    def heldout(self) -> bool:
        return int(hashlib.sha256(f"{self.source}/{self.path}".encode()).hexdigest()[:8], 16) % HELDOUT_MODULUS == 0


def collect_documents(stdlib: Path | None = None, licenses: Path = LICENSES) -> list[Document]:
    """Every stdlib .py file (no site-packages) and every licence text, sorted by path; undecodable files skipped."""
    stdlib = stdlib or Path(sysconfig.get_paths()["stdlib"])
    roots = [
        ("stdlib", stdlib, sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts)),
        ("licenses", licenses, sorted(p for p in licenses.iterdir() if p.is_file()) if licenses.is_dir() else []),
    ]
    docs = []
    for source, root, paths in roots:
        for p in paths:
            try:
                text = p.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue
            if text.strip():
                docs.append(Document(source, p.relative_to(root).as_posix(), text))
    return docs


def encode_documents(tokenizer, docs: list[Document]) -> np.ndarray:
    """Token ids of all documents, each followed by <|endoftext|>. -> uint16 [N]"""
    eos = tokenizer.token_to_id(ENDOFTEXT)
    ids: list[int] = []
    for enc in tokenizer.encode_batch([d.text for d in docs]):
        ids.extend(enc.ids)
        ids.append(eos)
    assert tokenizer.get_vocab_size() <= 1 << 16
    return np.asarray(ids, dtype=np.uint16)


def write_manifest(docs: list[Document], path: Path) -> None:
    lines = ["split\tbytes\tsha256\tsource\tpath"]
    for d in docs:
        digest = hashlib.sha256(d.text.encode()).hexdigest()
        lines.append(f"{'heldout' if d.heldout else 'train'}\t{len(d.text.encode())}\t{digest}\t{d.source}\t{d.path}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def main() -> None:
    WORK.mkdir(exist_ok=True)
    docs = collect_documents()
    train = [d for d in docs if not d.heldout]
    heldout = [d for d in docs if d.heldout]
    tokenizer = train_tokenizer("\n\n".join(d.text for d in train), vocab_size=VOCAB_SIZE)
    tokenizer.save(str(WORK / "tokenizer.json"), pretty=False)
    for name, part in (("train", train), ("heldout", heldout)):
        ids = encode_documents(tokenizer, part)
        np.save(WORK / f"{name}.npy", ids)
        n_bytes = sum(len(d.text.encode()) for d in part)
        print(
            f"{name}: {len(part)} documents, {n_bytes / 1e6:.2f} MB, {len(ids) / 1e6:.2f} M tokens "
            f"({n_bytes / len(ids):.2f} bytes/token)"
        )
    (DATA / "heldout.txt").write_text("\n\n".join(d.text for d in heldout), encoding="utf-8")
    write_manifest(docs, DATA / "corpus-manifest.tsv")


if __name__ == "__main__":
    main()
