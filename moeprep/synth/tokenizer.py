"""The synthetic models' tokenizer: a real byte-level BPE, trained once and shipped as moeprep/data/tokenizer.json.

GGUF stores it as llama.cpp's "gpt2" tokenizer model: the token strings (in the GPT-2 byte-to-unicode alphabet),
their types, the merges as "left right" strings, and the special token ids. The pre-tokenizer is named by
`tokenizer.ggml.pre`; we use "qwen2" for every architecture: llama.cpp knows the name, and its split pattern is
the public Qwen2 regex below, which the `tokenizers` library and llama.cpp apply identically. Training uses that
same split, so both sides agree on every token boundary.

The same vocabulary recast for the other tokenizer models, for tests against llama.cpp: SentencePiece-style BPE
over raw UTF-8 (`sentencepiece_style`, Gemma 4's "gemma4"), and a unigram vocabulary with a precompiled
normalization map (`unigram_style`, `precompiled_charsmap`: "t5").
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from gguf import GGUFValueType, Keys, TokenType

from moeprep.gguf.writer import KVValue

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
TOKENIZER_PATH = DATA_DIR / "tokenizer.json"
VOCAB_SIZE = 2048
# Real checkpoints pad their vocabularies with tokens no text produces (Gemma's <unusedN>); so does n_vocab here.
PADDING_TOKEN = "<unused{}>"
ENDOFTEXT = "<|endoftext|>"
SPECIAL_TOKENS = (ENDOFTEXT, "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2: the trainer puts them first
PRE_TOKENIZER = "qwen2"
# Qwen2's split: contractions, letters with one leading non-letter, single digits, punctuation runs, newlines,
# whitespace (a run before a non-space keeps its last space for the next word).
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def train_tokenizer(text: str, vocab_size: int = VOCAB_SIZE):
    """A byte-level BPE over `text` with the Qwen2 split (maintainers only: see moeprep/synth/corpus.py)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([text], trainer=trainer)
    return tokenizer


@dataclass(frozen=True)
class Vocab:
    """The shipped tokenizer as GGUF wants it: tokens in id order, their types, merges as 'left right'."""

    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    eos_id: int

    @property
    def size(self) -> int:
        return len(self.tokens)


@functools.cache
def load_vocab(path: Path = TOKENIZER_PATH) -> Vocab:
    """Read tokenizer.json directly (a JSON file; no need to build a Tokenizer object to list its vocabulary)."""
    data = json.loads(path.read_text(encoding="utf-8"))
    vocab: dict[str, int] = data["model"]["vocab"]
    tokens = [""] * len(vocab)
    for token, i in vocab.items():
        tokens[i] = token
    special = {t["content"] for t in data["added_tokens"] if t["special"]}
    types = [TokenType.CONTROL if t in special else TokenType.NORMAL for t in tokens]
    # tokenizers writes merges as [left, right] pairs; older versions wrote "left right" strings.
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return Vocab(tokens, [int(t) for t in types], merges, eos_id=vocab[ENDOFTEXT])


def padded_vocab(vocab: Vocab, size: int) -> Vocab:
    """`vocab` grown to `size` tokens with UNUSED padding tokens, for files with a real model's vocabulary size.

    No text ever becomes a padding token: BPE reaches a token only through merges, and the pre-tokenizer splits
    every digit into a piece of its own, so no piece is ever a whole <unusedN>."""
    extra = range(size - vocab.size)
    return Vocab(
        vocab.tokens + [PADDING_TOKEN.format(i) for i in extra],
        vocab.token_types + [int(TokenType.UNUSED)] * len(extra),
        vocab.merges,
        vocab.eos_id,
    )


def with_user_defined(vocab: Vocab, texts: tuple[str, ...]) -> Vocab:
    """`vocab` with USER_DEFINED tokens appended: text the tokenizer matches whole before any splitting (tool-call
    markers and the like in real vocabularies)."""
    return Vocab(
        vocab.tokens + list(texts),
        vocab.token_types + [int(TokenType.USER_DEFINED)] * len(texts),
        vocab.merges,
        vocab.eos_id,
    )


SPACE = "\u2581"


def sentencepiece_style(vocab: Vocab) -> Vocab:
    """The byte-level vocabulary recast as the BPE vocabularies of Gemma 4 (tokenizer model "gemma4"): tokens are
    raw UTF-8 text with spaces written "\u2581", the 256 byte tokens <0xXX> catch what no token covers, and merges
    keep their order. Tokens (and merges) that are not whole UTF-8 text have no such form and are left out."""
    byte_of = {c: b for b, c in _byte_chars().items()}

    def raw(token: str) -> str | None:
        try:
            return bytes(byte_of[c] for c in token).decode("utf-8").replace(" ", SPACE)
        except (KeyError, UnicodeDecodeError):
            return None

    tokens, types, known = [], [], set()
    for token, kind in zip(vocab.tokens, vocab.token_types):
        text = token if kind != TokenType.NORMAL else raw(token)
        if text is not None and text not in known:
            tokens.append(text)
            types.append(kind)
            known.add(text)
    merges = []
    for m in vocab.merges:
        left, right = (raw(side) for side in m.split(" ", 1))
        if left is not None and right is not None and left + right in known:
            merges.append(f"{left} {right}")
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [int(TokenType.BYTE)] * 256
    return Vocab(tokens, types, merges, tokens.index(ENDOFTEXT))


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> character alphabet (the same map as the runtime's, which moeprep does not import)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return {b: chr(b) if b in printable else chr(next(extra)) for b in range(256)}


def vocab_metadata(vocab: Vocab, model: str = "gpt2", pre: str | None = PRE_TOKENIZER) -> dict[str, KVValue]:
    """tokenizer.ggml.* keys. <|endoftext|> is bos, eos and padding, as in Qwen base models; no BOS is added
    unless the tokenizer always adds one (Gemma 4's). `pre=None` leaves tokenizer.ggml.pre out."""
    T, S, U32, B = GGUFValueType.ARRAY, GGUFValueType.STRING, GGUFValueType.UINT32, GGUFValueType.BOOL
    return {
        Keys.Tokenizer.MODEL: KVValue(model, S),
        **({Keys.Tokenizer.PRE: KVValue(pre, S)} if pre is not None else {}),
        Keys.Tokenizer.LIST: KVValue(vocab.tokens, T, S),
        Keys.Tokenizer.TOKEN_TYPE: KVValue(vocab.token_types, T, GGUFValueType.INT32),
        Keys.Tokenizer.MERGES: KVValue(vocab.merges, T, S),
        Keys.Tokenizer.BOS_ID: KVValue(vocab.eos_id, U32),
        Keys.Tokenizer.EOS_ID: KVValue(vocab.eos_id, U32),
        Keys.Tokenizer.PAD_ID: KVValue(vocab.eos_id, U32),
        Keys.Tokenizer.ADD_BOS: KVValue(False, B),
    }


# A few of SentencePiece's NFKC rules, for the unigram ("t5") vocabulary's normalization map.
NFKC_SAMPLE = {
    "ﬁ": "fi",
    "ﬀ": "ff",
    "Ａ": "A",
    "１": "1",
    "①": "1",
    "\u3000": " ",
    "\u00a0": " ",
    "\t": " ",
    "\n": " ",
    "e\u0301": "é",
    "…": "...",
    "™": "TM",
    "ｶﾞ": "ガ",
}


def precompiled_charsmap(rules: dict[str, str]) -> bytes:
    """SentencePiece's precompiled character map for `rules` (input text -> replacement): a u32 byte count, a
    double-array trie over the UTF-8 bytes of the inputs, then the NUL-terminated replacements. In the array (of
    u32), the node at index p has children at (p XOR base(p)) XOR byte, each entry packing base << 10, a leaf flag
    (bit 8) and the byte that leads to it (bits 0-7); a leaf's value entry, at p XOR base(p), is bit 31 plus the
    offset of its replacement."""
    replacements, offsets = bytearray(), {}
    for out in rules.values():
        if out not in offsets:
            offsets[out] = len(replacements)
            replacements += out.encode() + b"\0"
    trie: dict = {}
    for key, out in rules.items():
        node = trie
        for b in key.encode():
            node = node.setdefault(b, {})
        node[None] = offsets[out]  # None: this node ends a key
    entries: dict[int, int] = {}
    used = {0}
    pending = [(0, trie)]  # (index, trie node): place each node's children and value
    while pending:
        index, node = pending.pop(0)
        children = sorted(b for b in node if b is not None)
        offset = next(
            o
            for o in range(1, 1 << 20)
            if all(o ^ c not in used for c in children) and (None not in node or o not in used)
        )
        entries[index] = entries.get(index, 0) | ((index ^ offset) << 10)
        if None in node:
            entries[offset] = (1 << 31) | node[None]
            used.add(offset)
        for c in children:
            child = offset ^ c
            used.add(child)
            entries[child] = c | ((1 << 8) if None in node[c] else 0)
            pending.append((child, node[c]))
    # every index a lookup can reach (an offset XOR any byte) lies inside the array, as readers index it unchecked
    array = [entries.get(i, 0) for i in range((max(entries) | 0xFF) + 1)]
    blob = b"".join(x.to_bytes(4, "little") for x in array)
    return len(blob).to_bytes(4, "little") + blob + bytes(replacements)


def unigram_style(vocab: Vocab) -> tuple[Vocab, list[float]]:
    """The byte-level vocabulary recast as a SentencePiece unigram one (tokenizer model "t5", XLM-R style):
    <s> <pad> </s> <unk>, then every token that is whole UTF-8 text with spaces as "\\u2581", scored by id so that
    earlier (more frequent) merges score higher. Returns the vocabulary and the scores."""
    raw = sentencepiece_style(vocab)
    tokens = ["<s>", "<pad>", "</s>", "<unk>"]
    types = [int(TokenType.CONTROL)] * 3 + [int(TokenType.UNKNOWN)]
    for token, kind in zip(raw.tokens, raw.token_types):
        if kind == TokenType.NORMAL:
            tokens.append(token)
            types.append(kind)
    scores = [0.0] * 4 + [-1.0 - i / 64 for i in range(len(tokens) - 4)]
    return Vocab(tokens, types, [], eos_id=2), scores
