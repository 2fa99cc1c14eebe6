"""The synthetic models' tokenizer: a real byte-level BPE, trained once and shipped as moeprep/data/tokenizer.json.

GGUF stores it as llama.cpp's "gpt2" tokenizer model: the token strings (in the GPT-2 byte-to-unicode alphabet),
their types, the merges as "left right" strings, and the special token ids. The pre-tokenizer is named by
`tokenizer.ggml.pre`; we use "qwen2" for every architecture: llama.cpp knows the name, and its split pattern is
the public Qwen2 regex below, which the `tokenizers` library (and so our runtime) applies identically. Training
uses that same split, so both sides agree on every token boundary.
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
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def train_tokenizer(text: str, vocab_size: int = VOCAB_SIZE):
    """A byte-level BPE over `text` with the Qwen2 split (maintainers only: see moeprep/synth/corpus.py)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
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
    return Vocab(vocab.tokens + [PADDING_TOKEN.format(i) for i in extra],
                 vocab.token_types + [int(TokenType.UNUSED)] * len(extra), vocab.merges, vocab.eos_id)


def vocab_metadata(vocab: Vocab) -> dict[str, KVValue]:
    """tokenizer.ggml.* keys. <|endoftext|> is bos, eos and padding, as in Qwen base models; no BOS is added."""
    T, S, U32, B = GGUFValueType.ARRAY, GGUFValueType.STRING, GGUFValueType.UINT32, GGUFValueType.BOOL
    return {
        Keys.Tokenizer.MODEL: KVValue("gpt2", S),
        Keys.Tokenizer.PRE: KVValue(PRE_TOKENIZER, S),
        Keys.Tokenizer.LIST: KVValue(vocab.tokens, T, S),
        Keys.Tokenizer.TOKEN_TYPE: KVValue(vocab.token_types, T, GGUFValueType.INT32),
        Keys.Tokenizer.MERGES: KVValue(vocab.merges, T, S),
        Keys.Tokenizer.BOS_ID: KVValue(vocab.eos_id, U32),
        Keys.Tokenizer.EOS_ID: KVValue(vocab.eos_id, U32),
        Keys.Tokenizer.PAD_ID: KVValue(vocab.eos_id, U32),
        Keys.Tokenizer.ADD_BOS: KVValue(False, B),
    }
