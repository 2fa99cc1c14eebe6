"""The model's tokenizer, rebuilt from GGUF metadata so that it splits text exactly as llama.cpp does.

Byte-level BPE ("gpt2" tokenizer model) runs in the `tokenizers` library: a BPE model over the GGUF tokens and
merges, behind the pre-tokenizer regexes llama.cpp uses for the file's `tokenizer.ggml.pre` (applied one after the
other, each splitting the pieces of the last), then the GPT-2 byte-to-unicode mapping. SentencePiece vocabularies
("llama") merge by piece score, which no library exposes over a bare GGUF vocabulary, so that loop is here.
Control tokens in the text are not parsed, as with llama.cpp's tokenize(special=False). Decoding maps tokens to
bytes ourselves, so control tokens print nothing and a streamed UTF-8 character split over tokens is reassembled.
"""

from __future__ import annotations

import heapq

from gguf import Keys, TokenType
from tokenizers import Regex, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from moeprep.errors import MoeprepError
from moeprep.gguf.reader import GGUFModel

TOK = Keys.Tokenizer

# Pre-tokenizer regexes, as in each family's tokenizer.json (Oniguruma syntax), with llama.cpp's pre names.
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
GPT2 = [r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"]
LLAMA3 = [_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"]
QWEN2 = [_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"]
QWEN35 = [_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"]
STARCODER = [r"\p{N}", GPT2[0]]
DEEPSEEK3 = [
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
]
_GPT4O_WORD = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_GPT4O_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
GPT4O = [(
    rf"[^\r\n\p{{L}}\p{{N}}]?{_GPT4O_WORD}*{_GPT4O_LOWER}+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_GPT4O_WORD}+{_GPT4O_LOWER}*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)]
DEFAULT = [r"[\p{P}\$\+<=>\^~\|]+", GPT2[0], r"\p{N}+", r"[0-9][0-9][0-9]"]

LLAMA3_NAMES = ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "lfm2")
# tokenizer.ggml.pre -> (regexes, ignore_merges: a piece that is itself a token is taken whole).
PRE_TOKENIZERS: dict[str, tuple[list[str], bool]] = {
    "default": (DEFAULT, False),
    **{name: (LLAMA3, True) for name in LLAMA3_NAMES},
    **{name: (LLAMA3, False) for name in ("dbrx", "smaug-bpe", "chatglm-bpe")},
    **{name: (LLAMA3, True) for name in ("glm4", "glm5")},
    **{name: (QWEN2, False) for name in ("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2", "hunyuan", "solar-open")},
    "qwen35": (QWEN35, False),
    **{name: (GPT2, False) for name in ("gpt-2", "mpt", "olmo", "jais", "trillion", "phi-2", "roberta-bpe", "exaone4")},
    **{name: (STARCODER, False) for name in ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone")},
    "deepseek-v3": (DEEPSEEK3, False),
    **{name: (GPT4O, False) for name in ("gpt-4o", "llama4", "kanana2")},
}


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


class ByteLevelBPE:
    """tokenizer.ggml.model "gpt2": the `tokenizers` library's BPE behind llama.cpp's pre-tokenizer regexes."""

    def __init__(self, g: GGUFModel, tokens: list[str], types: list[TokenType]) -> None:
        pre = g.get(TOK.PRE) or "default"
        if pre not in PRE_TOKENIZERS:
            raise MoeprepError(f"{g.path}: pre-tokenizer '{pre}' is not supported; supported: {', '.join(sorted(PRE_TOKENIZERS))}")
        regexes, ignore_merges = PRE_TOKENIZERS[pre]
        merges = [tuple(m.split(" ", 1)) for m in g.get(TOK.MERGES, [])]
        vocab = dict(zip(reversed(tokens), range(len(tokens) - 1, -1, -1)))  # a repeated token keeps its first id
        hf = HFTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        self._hf = hf
        self.token_bytes = [_byte_level_bytes(t, ty) for t, ty in zip(tokens, types)]
        self.add_bos_default = pre in LLAMA3_NAMES  # llama.cpp's default when tokenizer.ggml.add_bos_token is absent

    def encode(self, text: str, after_special: bool) -> list[int]:
        return self._hf.encode(text, add_special_tokens=False).ids


class SentencePieceBPE:
    """tokenizer.ggml.model "llama": SentencePiece's BPE as llama.cpp runs it. Spaces become "▁" (one is put in
    front of text that starts the input or follows a special token, when add_space_prefix is set); then, starting
    from single characters, the adjacent pair that forms the vocabulary piece of highest score merges first (the
    leftmost pair on a tie); characters left outside the vocabulary become their UTF-8 byte tokens <0xXX>."""

    SPACE = "\u2581"

    def __init__(self, g: GGUFModel, tokens: list[str], types: list[TokenType]) -> None:
        scores = g.get(TOK.SCORES) or [0.0] * len(tokens)
        self._pieces = {t: (i, scores[i]) for i, t in reversed(list(enumerate(tokens)))}  # first id wins
        self._byte_ids = {int(t[3:5], 16): i for i, (t, ty) in enumerate(zip(tokens, types))
                          if ty == TokenType.BYTE and len(t) == 6 and t.startswith("<0x")}
        self.add_space_prefix = bool(g.get(TOK.ADD_PREFIX, True))
        self.add_bos_default = True
        self.token_bytes = [_sentencepiece_bytes(t, ty) for t, ty in zip(tokens, types)]

    def encode(self, text: str, after_special: bool) -> list[int]:
        if self.add_space_prefix and after_special:
            text = " " + text
        symbols = list(text.replace(" ", self.SPACE))  # characters; merged symbols grow in place
        if not symbols:
            return []
        nxt = list(range(1, len(symbols))) + [-1]
        prv = list(range(-1, len(symbols) - 1))
        queue: list[tuple[float, int, int, str]] = []  # (-score, left, right, merged text)

        def push(left: int, right: int) -> None:
            if left >= 0 and right >= 0:
                merged = symbols[left] + symbols[right]
                if merged in self._pieces:
                    heapq.heappush(queue, (-self._pieces[merged][1], left, right, merged))

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
        ids: list[int] = []
        for s in symbols:
            if s in self._pieces:
                ids.append(self._pieces[s][0])
            elif s:
                ids += [self._byte_ids[b] for b in s.encode("utf-8")]
        return ids


# tokenizer.ggml.model -> implementation
TOKENIZER_MODELS = {"gpt2": ByteLevelBPE, "llama": SentencePieceBPE}


class Tokenizer:
    """Text <-> token ids for a GGUF model, identical to llama.cpp's tokenize(text, add_bos, special=False):
    user-defined tokens written in the text are matched first (longest first), control tokens never are."""

    def __init__(self, g: GGUFModel) -> None:
        kind = g.get(TOK.MODEL)
        if kind not in TOKENIZER_MODELS:
            raise MoeprepError(f"{g.path}: tokenizer model '{kind}' is not supported; supported: {', '.join(TOKENIZER_MODELS)}")
        tokens: list[str] = g.get(TOK.LIST)
        types = [TOKEN_TYPES[t] for t in (g.get(TOK.TOKEN_TYPE) or [TokenType.NORMAL] * len(tokens))]
        self._model = TOKENIZER_MODELS[kind](g, tokens, types)
        self._user_defined = sorted(((t, i) for i, (t, ty) in enumerate(zip(tokens, types))
                                     if ty == TokenType.USER_DEFINED and t), key=lambda ti: -len(ti[0].encode()))
        self.bos_id: int | None = g.get(TOK.BOS_ID)
        self.eos_id: int | None = g.get(TOK.EOS_ID)
        self.add_bos: bool = bool(g.get(TOK.ADD_BOS, self._model.add_bos_default)) and self.bos_id is not None
        self.eog_ids = {i for i in (self.eos_id, g.get(TOK.EOT_ID), g.get(TOK.EOM_ID)) if i is not None}

    @property
    def n_vocab(self) -> int:
        return len(self._model.token_bytes)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = [self.bos_id] if add_bos and self.add_bos else []
        after_special = True
        for fragment in self._partition(text):
            if isinstance(fragment, int):
                ids.append(fragment)
                after_special = True
            else:
                ids += self._model.encode(fragment, after_special)
                after_special = False
        return ids

    def _partition(self, text: str) -> list[str | int]:
        """Text cut around user-defined tokens (their ids in place of their text)."""
        fragments: list[str | int] = [text] if text else []
        for token, token_id in self._user_defined:
            split: list[str | int] = []
            for f in fragments:
                if isinstance(f, int) or token not in f:
                    split.append(f)
                    continue
                for i, piece in enumerate(f.split(token)):
                    if i:
                        split.append(token_id)
                    if piece:
                        split.append(piece)
            fragments = split
        return fragments

    def token_bytes(self, token: int) -> bytes:
        """The bytes a token stands for (b"" for control tokens); a UTF-8 character may span tokens."""
        return self._model.token_bytes[token]

    def decode(self, ids: list[int]) -> str:
        return b"".join(self._model.token_bytes[i] for i in ids).decode("utf-8", errors="replace")


TOKEN_TYPES = {int(t): t for t in TokenType}  # a dict lookup per token: TokenType(t) costs seconds on 262k tokens
_BYTE_OF_CHAR = {c: b for b, c in bytes_to_unicode().items()}
# str.translate table: each character of GPT-2's byte alphabet to its byte's code point, so that latin-1 encoding
# gives the bytes in one step (a 262k-token vocabulary in a fraction of a second, not seconds per character).
# Characters 0x80-0xff outside the alphabet are UTF-8 (two bytes) as they stand: they map to a character latin-1
# cannot encode, which sends their token to the per-character path.
_BYTE_TABLE = {ord(c): b for c, b in _BYTE_OF_CHAR.items()} | {
    x: 0x100 for x in range(0x80, 0x100) if chr(x) not in _BYTE_OF_CHAR}


def _byte_level_bytes(text: str, token_type: TokenType) -> bytes:
    if token_type == TokenType.CONTROL:
        return b""
    if token_type == TokenType.USER_DEFINED:
        return text.encode("utf-8")
    try:
        return text.translate(_BYTE_TABLE).encode("latin-1")
    except UnicodeEncodeError:  # a character outside the byte alphabet: its UTF-8 bytes, as llama.cpp keeps them
        return b"".join(bytes([_BYTE_OF_CHAR[c]]) if c in _BYTE_OF_CHAR else c.encode("utf-8") for c in text)


def _sentencepiece_bytes(text: str, token_type: TokenType) -> bytes:
    if token_type == TokenType.CONTROL:
        return b""
    if token_type == TokenType.BYTE:
        return bytes([int(text[3:5], 16)])
    return text.replace(SentencePieceBPE.SPACE, " ").encode("utf-8")
