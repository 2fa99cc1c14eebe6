"""The model's tokenizer, rebuilt from GGUF metadata so that it splits text exactly as llama.cpp does.

Byte-level BPE ("gpt2" tokenizer model) runs in the `tokenizers` library: a BPE model over the GGUF tokens and
merges, behind the pre-tokenizer regexes llama.cpp uses for the file's `tokenizer.ggml.pre` (applied one after the
other, each splitting the pieces of the last), then the GPT-2 byte-to-unicode mapping. Special tokens in the text
are not parsed, as with llama.cpp's tokenize(special=False). Decoding maps tokens to bytes ourselves, so control
tokens print nothing and a streamed UTF-8 character split over tokens can be reassembled.
"""

from __future__ import annotations

from gguf import Keys, TokenType
from tokenizers import Regex, Tokenizer as HFTokenizer, models, pre_tokenizers

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
GPT4O = [
    rf"[^\r\n\p{{L}}\p{{N}}]?{_GPT4O_WORD}*{_GPT4O_LOWER}+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_GPT4O_WORD}+{_GPT4O_LOWER}*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
]
DEFAULT = [r"[\p{P}\$\+<=>\^~\|]+", GPT2[0], r"\p{N}+", r"[0-9][0-9][0-9]"]

# tokenizer.ggml.pre -> (regexes, ignore_merges: a piece that is itself a token is taken whole).
PRE_TOKENIZERS: dict[str, tuple[list[str], bool]] = {
    "default": (DEFAULT, False),
    **{name: (LLAMA3, True) for name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "lfm2")},
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


class Tokenizer:
    def __init__(self, g: GGUFModel) -> None:
        model = g.get(TOK.MODEL)
        if model != "gpt2":
            raise MoeprepError(f"{g.path}: tokenizer model '{model}' is not supported (only byte-level BPE 'gpt2')")
        pre = g.get(TOK.PRE) or "default"
        if pre not in PRE_TOKENIZERS:
            raise MoeprepError(f"{g.path}: pre-tokenizer '{pre}' is not supported; supported: {', '.join(sorted(PRE_TOKENIZERS))}")
        regexes, ignore_merges = PRE_TOKENIZERS[pre]
        tokens: list[str] = g.get(TOK.LIST)
        merges = [tuple(m.split(" ", 1)) for m in g.get(TOK.MERGES, [])]
        vocab: dict[str, int] = {}
        for i, t in enumerate(tokens):
            vocab.setdefault(t, i)
        hf = HFTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        self._hf = hf
        self.bos_id: int | None = g.get(TOK.BOS_ID)
        self.eos_id: int | None = g.get(TOK.EOS_ID)
        self.add_bos: bool = bool(g.get(TOK.ADD_BOS, False)) and self.bos_id is not None
        types = g.get(TOK.TOKEN_TYPE) or [TokenType.NORMAL] * len(tokens)
        self.eog_ids = {i for i in (self.eos_id, g.get(TOK.EOT_ID), g.get(TOK.EOM_ID)) if i is not None}
        self._bytes = [_token_bytes(t, TokenType(ty)) for t, ty in zip(tokens, types)]

    @property
    def n_vocab(self) -> int:
        return len(self._bytes)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = self._hf.encode(text, add_special_tokens=False).ids if text else []
        return [self.bos_id, *ids] if add_bos and self.add_bos else ids

    def token_bytes(self, token: int) -> bytes:
        """The bytes a token stands for (b"" for control tokens); a UTF-8 character may span tokens."""
        return self._bytes[token]

    def decode(self, ids: list[int]) -> str:
        return b"".join(self._bytes[i] for i in ids).decode("utf-8", errors="replace")


_BYTE_OF_CHAR = {c: b for b, c in bytes_to_unicode().items()}


def _token_bytes(text: str, token_type: TokenType) -> bytes:
    if token_type == TokenType.CONTROL:
        return b""
    if token_type == TokenType.USER_DEFINED:
        return text.encode("utf-8")
    return b"".join(bytes([_BYTE_OF_CHAR[c]]) if c in _BYTE_OF_CHAR else c.encode("utf-8") for c in text)
