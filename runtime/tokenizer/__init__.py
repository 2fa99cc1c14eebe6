"""The model's tokenizer, rebuilt from GGUF metadata so that it splits text exactly as llama.cpp does.

Three tokenizer models cover the text vocabularies of MoE releases:
- BPE ("gpt2", and "gemma4", which is BPE over SentencePiece-style pieces): the pre-tokenizer named by
  `tokenizer.ggml.pre` cuts text into words (pretokenizers.py: the table; split.py: llama.cpp's splitting rules),
  and each word is merged pair by pair in the order of the file's merge list;
- SentencePiece ("llama"): pieces merged by score, characters outside the vocabulary as their <0xXX> byte tokens;
- SentencePiece unigram ("t5", unigram.py): normalization by the file's character map, best-scoring segmentation.
User-defined tokens written in the text are matched first (longest first); control tokens never are, as with
llama.cpp's tokenize(special=False). Decoding maps tokens to bytes, so control tokens print nothing and a streamed
UTF-8 character split over tokens is reassembled.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass

from gguf import Keys, TokenType

from moeprep.errors import MoeprepError
from moeprep.gguf.reader import GGUFModel
from moerun.tokenizer.pretokenizers import PRE_TOKENIZERS, PreTokenizer
from moerun.tokenizer.split import split
from moerun.tokenizer.unigram import Unigram

TOK = Keys.Tokenizer
SPACE = "\u2581"  # SentencePiece's visible space
_WORD_CACHE_LIMIT = 1 << 16  # words remembered per tokenizer; text repeats its words, so most lookups hit


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (byte-level BPE token text)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


_BYTE_CHAR = bytes_to_unicode()
_BYTE_CHARS = [_BYTE_CHAR[b] for b in range(256)]


def merge_pairs(tokens: list[str], rank: Callable[[str, str], float | None]) -> list[str]:
    """`tokens` with adjacent pairs merged, lowest rank first (the leftmost pair on a tie), until no pair has a
    rank. The loop llama.cpp runs for BPE (rank = merge index) and SentencePiece (rank = -score)."""
    symbols = list(tokens)
    nxt = [*range(1, len(symbols)), -1]
    prv = list(range(-1, len(symbols) - 1))
    queue: list[tuple[float, int, int, str]] = []

    def push(left: int, right: int) -> None:
        if left >= 0 and right >= 0:
            r = rank(symbols[left], symbols[right])
            if r is not None:
                heapq.heappush(queue, (r, left, right, symbols[left] + symbols[right]))

    for i in range(len(symbols) - 1):
        push(i, i + 1)
    while queue:
        _, left, right, merged = heapq.heappop(queue)
        if not symbols[left] or not symbols[right] or symbols[left] + symbols[right] != merged:
            continue  # one side has merged since this pair was queued
        symbols[left], symbols[right] = merged, ""
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prv[nxt[right]] = left
        push(prv[left], left)
        push(left, nxt[left])
    return [s for s in symbols if s]


class BPE:
    """tokenizer.ggml.model "gpt2" (and "gemma4"): words from the pre-tokenizer, merged by merge-list rank. A word
    left with a piece outside the vocabulary falls back to that piece's byte tokens."""

    def __init__(self, g: GGUFModel, tokens: list[str], types: list[TokenType], pre: PreTokenizer) -> None:
        self.pre = pre
        self._ids = {t: i for i, t in enumerate(tokens)}
        self._ranks: dict[tuple[str, str], int] = {}
        for i, m in enumerate(g.get(TOK.MERGES) or []):
            cut = m.find(" ", 1)  # the first space after the first character: a piece may start with a space
            self._ranks.setdefault((m[:cut], m[cut + 1 :]) if cut > 0 else ("", ""), i)
        self._cache: dict[str, list[int]] = {}
        self.token_bytes = [_bpe_token_bytes(t, ty, pre) for t, ty in zip(tokens, types)]

    def encode(self, text: str, after_special: bool) -> list[int]:
        if self.pre.escape_spaces:
            text = text.replace(" ", SPACE)
        ids: list[int] = []
        for word in split(text, self.pre.rules):
            if self.pre.byte_level:
                word = "".join([_BYTE_CHARS[b] for b in word.encode("utf-8")])
            cached = self._cache.get(word)
            if cached is None:
                if len(self._cache) >= _WORD_CACHE_LIMIT:
                    self._cache.clear()
                cached = self._cache[word] = self._encode_word(word)
            ids += cached
        return ids

    def _encode_word(self, word: str) -> list[int]:
        whole = self._ids.get(word)
        # a word that is a token is taken whole when merges are ignored, and a run of newlines in SentencePiece-
        # style vocabularies (whose merge lists need not build it)
        if whole is not None and (self.pre.ignore_merges or (self.pre.gemma4 and not word.strip("\n"))):
            return [whole]
        ids: list[int] = []
        for piece in merge_pairs(list(word), lambda a, b: self._ranks.get((a, b))):
            token = self._ids.get(piece)
            if token is not None:
                ids.append(token)
            elif self.pre.byte_level:  # llama.cpp looks up each byte of the piece's text as a one-byte token
                ids += [self._ids[chr(b)] for b in piece.encode("utf-8") if b < 0x80 and chr(b) in self._ids]
            else:
                ids += [self._ids[t] for b in piece.encode("utf-8") if (t := f"<0x{b:02X}>") in self._ids]
        return ids


class SentencePieceBPE:
    """tokenizer.ggml.model "llama": SentencePiece's BPE as llama.cpp runs it. Spaces become "▁" (one is put in
    front of text that starts the input or follows a special token, when add_space_prefix is set); then, starting
    from single characters, the adjacent pair that forms the vocabulary piece of highest score merges first (the
    leftmost pair on a tie); characters left outside the vocabulary become their UTF-8 byte tokens <0xXX>."""

    def __init__(self, g: GGUFModel, tokens: list[str], types: list[TokenType], pre: PreTokenizer | None) -> None:
        scores = g.get(TOK.SCORES) or [0.0] * len(tokens)
        self._pieces = {t: (i, scores[i]) for i, t in reversed(list(enumerate(tokens)))}  # first id wins
        self._byte_ids = {
            int(t[3:5], 16): i
            for i, (t, ty) in enumerate(zip(tokens, types))
            if ty == TokenType.BYTE and len(t) == 6 and t.startswith("<0x")
        }
        self.add_space_prefix = bool(g.get(TOK.ADD_PREFIX, True))
        self.token_bytes = [_sentencepiece_bytes(t, ty) for t, ty in zip(tokens, types)]

    def _rank(self, left: str, right: str) -> float | None:
        piece = self._pieces.get(left + right)
        return None if piece is None else -piece[1]

    def encode(self, text: str, after_special: bool) -> list[int]:
        if self.add_space_prefix and after_special:
            text = " " + text
        ids: list[int] = []
        for s in merge_pairs(list(text.replace(" ", SPACE)), self._rank):
            if s in self._pieces:
                ids.append(self._pieces[s][0])
            else:
                ids += [self._byte_ids[b] for b in s.encode("utf-8")]
        return ids


@dataclass(frozen=True)
class TokenizerModel:
    """A tokenizer.ggml.model value: its implementation and llama.cpp's defaults where the file says nothing."""

    implementation: type
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    add_eos: bool = False


TOKENIZER_MODELS: dict[str, TokenizerModel] = {
    "gpt2": TokenizerModel(BPE, 11, 11, add_bos=False),
    "gemma4": TokenizerModel(BPE, None, None, add_bos=False),
    "llama": TokenizerModel(SentencePieceBPE, 1, 2, add_bos=True),
    "t5": TokenizerModel(Unigram, None, 1, add_bos=False, add_eos=True),
}
# tokenizer models llama.cpp knows that no MoE release uses (BERT word pieces, RWKV, PLaMo 2, DNA, none)
OTHER_LLAMA_CPP_MODELS = ("bert", "rwkv", "plamo2", "hybriddna", "whitespace", "no_vocab", "none", "test")


def pre_tokenizer(g: GGUFModel, kind: str) -> PreTokenizer | None:
    """The file's pre-tokenizer (BPE models only), refused as llama.cpp refuses a name it does not know."""
    if kind == "gemma4":
        return PRE_TOKENIZERS["gemma4"]  # the gemma4 model always splits its own way, whatever the file says
    if kind != "gpt2":
        return None
    name = g.get(TOK.PRE) or "default"  # llama.cpp warns and uses "default" when the name is missing
    if name not in PRE_TOKENIZERS:
        raise MoeprepError(
            f"{g.path}: unknown pre-tokenizer type '{name}' (tokenizer.ggml.pre); llama.cpp does "
            f"not know it either. Known: {', '.join(sorted(PRE_TOKENIZERS))}"
        )
    return PRE_TOKENIZERS[name]


class Tokenizer:
    """Text <-> token ids for a GGUF model, identical to llama.cpp's tokenize(text, add_special, special=False)."""

    def __init__(self, g: GGUFModel) -> None:
        kind = g.get(TOK.MODEL)
        if kind not in TOKENIZER_MODELS:
            known = (
                "a tokenizer model moerun does not run" if kind in OTHER_LLAMA_CPP_MODELS else "an unknown tokenizer"
            )
            raise MoeprepError(
                f"{g.path}: tokenizer model '{kind}' (tokenizer.ggml.model) is {known}; "
                f"supported: {', '.join(TOKENIZER_MODELS)}"
            )
        spec = TOKENIZER_MODELS[kind]
        bos, add_bos = spec.bos_id, spec.add_bos
        pre = pre_tokenizer(g, kind)
        tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(g.get(TOK.LIST))]  # llama.cpp's name for empty tokens
        types = [
            TOKEN_TYPES.get(t, TokenType.UNUSED) for t in (g.get(TOK.TOKEN_TYPE) or [TokenType.NORMAL] * len(tokens))
        ]
        self._model = spec.implementation(g, tokens, types, pre)
        self._user_defined = sorted(
            ((t, i) for i, (t, ty) in enumerate(zip(tokens, types)) if ty == TokenType.USER_DEFINED),
            key=lambda ti: -len(ti[0].encode()),
        )
        if pre is not None:
            bos = bos if pre.bos_token else None
            add_bos = pre.add_bos
        self.bos_id = _special_id(g, TOK.BOS_ID, bos, len(tokens))
        self.eos_id = _special_id(g, TOK.EOS_ID, spec.eos_id, len(tokens))
        add_bos = bool(g.get(TOK.ADD_BOS, add_bos)) or bool(pre and pre.gemma4)  # llama.cpp forces it for Gemma 4
        self.add_bos: bool = add_bos and self.bos_id is not None
        self.add_eos: bool = bool(g.get(TOK.ADD_EOS, spec.add_eos)) and self.eos_id is not None
        self.eog_ids = {i for i in (self.eos_id, g.get(TOK.EOT_ID), g.get(TOK.EOM_ID)) if i is not None}

    @property
    def n_vocab(self) -> int:
        return len(self._model.token_bytes)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of `text`; `add_bos` adds the file's BOS (and EOS) tokens where it asks for them."""
        ids = [self.bos_id] if add_bos and self.add_bos else []
        after_special = True
        for fragment in self._partition(text):
            if isinstance(fragment, int):
                ids.append(fragment)
                after_special = True
            else:
                ids += self._model.encode(fragment, after_special)
                after_special = False
        return ids + ([self.eos_id] if add_bos and self.add_eos else [])

    def _partition(self, text: str) -> list[str | int]:
        """Text cut around user-defined tokens (their ids in place of their text)."""
        fragments: list[str | int] = [text] if text else []
        for token, token_id in self._user_defined:
            split_fragments: list[str | int] = []
            for f in fragments:
                if isinstance(f, int) or token not in f:
                    split_fragments.append(f)
                    continue
                for i, piece in enumerate(f.split(token)):
                    if i:
                        split_fragments.append(token_id)
                    if piece:
                        split_fragments.append(piece)
            fragments = split_fragments
        return fragments

    def token_bytes(self, token: int) -> bytes:
        """The bytes a token stands for (b"" for control tokens); a UTF-8 character may span tokens."""
        return self._model.token_bytes[token]

    def decode(self, ids: list[int]) -> str:
        return b"".join(self._model.token_bytes[i] for i in ids).decode("utf-8", errors="replace")


def _special_id(g: GGUFModel, key: str, default: int | None, n_vocab: int) -> int | None:
    """The file's id for a special token (one out of range is ignored, as llama.cpp ignores it), else the
    model's default (disabled when out of range)."""
    value = g.get(key)
    if value is not None and 0 <= value < n_vocab:
        return int(value)
    return default if default is not None and default < n_vocab else None


TOKEN_TYPES = {int(t): t for t in TokenType}  # a dict lookup per token: TokenType(t) costs seconds on 262k tokens
_BYTE_OF_CHAR = {c: b for b, c in _BYTE_CHAR.items()}
# str.translate table: each character of GPT-2's byte alphabet to its byte's code point, so that latin-1 encoding
# gives the bytes in one step (a 262k-token vocabulary in a fraction of a second, not seconds per character).
# Characters 0x80-0xff outside the alphabet are UTF-8 (two bytes) as they stand: they map to a character latin-1
# cannot encode, which sends their token to the per-character path.
_BYTE_TABLE = {ord(c): b for c, b in _BYTE_OF_CHAR.items()} | {
    x: 0x100 for x in range(0x80, 0x100) if chr(x) not in _BYTE_OF_CHAR
}


def _bpe_token_bytes(text: str, token_type: TokenType, pre: PreTokenizer) -> bytes:
    if token_type == TokenType.CONTROL:
        return b""
    if token_type == TokenType.USER_DEFINED:
        return text.encode("utf-8")
    if token_type == TokenType.BYTE and len(text) == 6 and text.startswith("<0x"):
        return bytes([int(text[3:5], 16)])
    if pre.escape_spaces:
        return text.replace(SPACE, " ").encode("utf-8")
    try:
        return text.translate(_BYTE_TABLE).encode("latin-1")
    except UnicodeEncodeError:  # a character outside the byte alphabet: its UTF-8 bytes, as llama.cpp keeps them
        return b"".join(bytes([_BYTE_OF_CHAR[c]]) if c in _BYTE_OF_CHAR else c.encode("utf-8") for c in text)


def _sentencepiece_bytes(text: str, token_type: TokenType) -> bytes:
    if token_type == TokenType.CONTROL:
        return b""
    if token_type == TokenType.BYTE:
        return bytes([int(text[3:5], 16)])
    return text.replace(SPACE, " ").encode("utf-8")
