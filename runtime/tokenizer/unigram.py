"""tokenizer.ggml.model "t5": SentencePiece's unigram model, as llama.cpp runs it (XLM-R vocabularies: the
nomic-bert-moe embedding model, T5-family encoders).

Text is first normalized with the file's precompiled character map (SentencePiece's NFKC-style rules, stored as a
double-array trie over UTF-8 bytes plus the replacement strings): at each position the longest matching input
prefix is replaced. Spaces become "\u2581": with remove_extra_whitespaces each run of non-spaces gets exactly one
in front and other spaces vanish, else every space maps to one and add_space_prefix puts one at the start. Then
the token sequence of highest total score is found (Viterbi over UTF-8 bytes): a character no token covers costs
the lowest token score minus 10 and becomes the unknown token, consecutive unknowns merging into one.
"""

from __future__ import annotations

import numpy as np
from gguf import Keys, TokenType

from moeprep.errors import MoeprepError
from moeprep.gguf.reader import GGUFModel

TOK = Keys.Tokenizer
SPACE = "\u2581".encode()
UNKNOWN_PENALTY = np.float32(10.0)


class CharsMap:
    """The precompiled character map: a u32 byte count, the XOR-compressed double array (XCDA) of that many
    bytes, then NUL-terminated replacement strings. Each array entry packs BASE (bits 10-30, shifted left by 8 when
    bit 9 is set), LCHECK (bits 0-7 and 31) and a LEAF flag (bit 8); a leaf's entry holds a replacement offset."""

    def __init__(self, blob: bytes, path) -> None:
        if len(blob) < 4:
            raise MoeprepError(f"{path}: tokenizer.ggml.precompiled_charsmap is too short")
        size = int.from_bytes(blob[:4], "little")
        if size + 4 >= len(blob):
            raise MoeprepError(f"{path}: tokenizer.ggml.precompiled_charsmap is truncated")
        self.nodes = np.frombuffer(blob, dtype="<u4", count=size // 4, offset=4).tolist()
        self.replacements = blob[4 + size :]

    def _base(self, node: int) -> int:
        packed = self.nodes[node]
        return (packed >> 10) << ((packed & (1 << 9)) >> 6)

    def longest_prefix(self, text: bytes, start: int) -> tuple[bytes, int] | None:
        """(replacement, bytes consumed) for the longest prefix of text[start:] the map knows, else None."""
        nodes, n = self.nodes, len(self.nodes)
        found, node = None, self._base(0)
        for pos in range(start, len(text)):
            c = text[pos]
            if c == 0:
                break
            node ^= c
            if node >= n or nodes[node] & ((1 << 31) | 0xFF) != c:
                break
            leaf = (nodes[node] >> 8) & 1
            node ^= self._base(node)
            if node >= n:
                break
            if leaf:
                found = (nodes[node] & ((1 << 31) - 1), pos - start + 1)
        if found is None:
            return None
        offset, consumed = found
        end = self.replacements.find(b"\0", offset)
        return self.replacements[offset:end], consumed


def _utf8_length(lead: int) -> int:
    return (1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4)[lead >> 4]


class Unigram:
    """tokenizer.ggml.model "t5": normalization by the character map, then the best-scoring segmentation."""

    def __init__(self, g: GGUFModel, tokens: list[str], types: list[TokenType], pre) -> None:
        scores = g.get(TOK.SCORES) or [0.0] * len(tokens)
        self._pieces: dict[bytes, tuple[int, float]] = {}
        for i, (t, ty) in enumerate(zip(tokens, types)):
            if ty in (TokenType.NORMAL, TokenType.USER_DEFINED, TokenType.UNUSED):
                self._pieces[t.encode()] = (i, 0.0 if ty == TokenType.USER_DEFINED else float(scores[i]))
        self._longest = max(map(len, self._pieces), default=0)
        lowest = min(
            (np.float32(scores[i]) for i, ty in enumerate(types) if ty == TokenType.NORMAL),
            default=np.float32(np.finfo(np.float32).max),
        )
        self._unknown_score = float(np.float32(lowest - UNKNOWN_PENALTY))  # float arithmetic, as llama.cpp's
        self.unknown_id = g.get(TOK.UNK_ID, 2)
        self.add_space_prefix = bool(g.get(TOK.ADD_PREFIX, False))
        self.merge_spaces = bool(g.get(TOK.REMOVE_EXTRA_WS, False))
        charsmap = g.get(TOK.PRECOMPILED_CHARSMAP)
        self._charsmap = CharsMap(np.asarray(charsmap).astype(np.uint8).tobytes(), g.path) if charsmap else None
        self.token_bytes = [
            b""
            if ty == TokenType.CONTROL
            else bytes([int(t[3:5], 16)])
            if ty == TokenType.BYTE
            else t.replace("\u2581", " ").encode()
            for t, ty in zip(tokens, types)
        ]

    def normalize(self, text: bytes) -> bytes:
        out, in_word, prepended, pos = bytearray(), False, False, 0
        while pos < len(text):
            mapped = self._charsmap.longest_prefix(text, pos) if self._charsmap else None
            if mapped is None:
                n = min(_utf8_length(text[pos]), len(text) - pos)
                mapped = (text[pos : pos + n], n)
            replacement, consumed = mapped
            for c in replacement:
                if c != 0x20:
                    if not in_word:
                        in_word = True
                        if (self.add_space_prefix and not prepended) or self.merge_spaces:
                            out += SPACE
                            prepended = True
                    out.append(c)
                else:
                    in_word = False
                    if not self.merge_spaces:
                        out += SPACE
            pos += consumed
        return bytes(out)

    def encode(self, text: str, after_special: bool) -> list[int]:
        norm = self.normalize(text.encode())
        n = len(norm)
        if not n:
            return []
        # best[end] = (token, start, score) of the best segmentation of norm[:end]; ties keep the earliest found
        best: list[tuple[int, int, float]] = [(self.unknown_id, 0, -np.inf)] * (n + 1)
        best[0] = (self.unknown_id, 0, 0.0)
        start = 0
        while start < n:
            char = min(_utf8_length(norm[start]), n - start)
            base = best[start][2]
            covered = False
            for length in range(1, min(self._longest, n - start) + 1):
                piece = self._pieces.get(norm[start : start + length])
                if piece is None:
                    continue
                covered |= length == char
                if base + piece[1] > best[start + length][2]:
                    best[start + length] = (piece[0], start, base + piece[1])
            if not covered and base + self._unknown_score > best[start + char][2]:
                best[start + char] = (self.unknown_id, start, base + self._unknown_score)
            start += char
        ids, end, previous_unknown = [], n, False
        while True:
            token, start, _ = best[end]
            unknown = token == self.unknown_id
            if not (previous_unknown and unknown):
                ids.append(token)
            if start == 0:
                break
            previous_unknown, end = unknown, start
        return ids[::-1]
