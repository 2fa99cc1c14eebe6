"""llama.cpp's pre-tokenizers: each `tokenizer.ggml.pre` name it accepts -> how it cuts text into words.

The regexes are the models' own (their tokenizer.json), in the form llama.cpp runs them: case-insensitive groups
spelled out ('[sS]'), possessive quantifiers made greedy. `split.py` runs them with llama.cpp's semantics. Names
llama.cpp does not know are refused, as llama.cpp refuses them.
"""

from __future__ import annotations

from dataclasses import dataclass

from moerun.tokenizer.split import DIGIT_GROUPS, KIMI_K2, TINY_AYA_DIGITS


@dataclass(frozen=True)
class PreTokenizer:
    rules: tuple[str, ...]  # regexes (or split.py's rule markers) applied one after the other
    ignore_merges: bool = False  # a word that is itself a token is taken whole, whatever the merges say
    add_bos: bool = False  # llama.cpp's default when the file has no tokenizer.ggml.add_bos_token
    byte_level: bool = True  # words in GPT-2's byte alphabet; False: raw UTF-8, unknown bytes as <0xXX> tokens
    escape_spaces: bool = False  # spaces become "\u2581" before splitting (SentencePiece-style BPE vocabularies)
    bos_token: bool = True  # False: no BOS id unless the file names one (ChatGLM)
    gemma4: bool = False  # Gemma 4's rules: BOS always added; a run of newlines that is a token is taken whole


_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_TAIL = r"\s*[\r\n]+|\s+(?!\S)|\s+"  # newline runs with the spaces before them, then other whitespace
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|" + _TAIL
QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|" + _TAIL
QWEN35 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|" + _TAIL
JAIS2 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    + "".join(rf"|\s{{{n}}}(?!\S)" for n in (512, 256, 128, 64, 32, 16, 8, 4))
    + r"|\s{1,2}(?!\S)|\s{1}"
)
# DeepSeek-V3 and relatives: numbers in threes, CJK runs, then words that may start with one ASCII punctuation mark
_CJK_KANA = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
_CJK_HANGUL = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_ASCII_PUNCT_WORD = r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+"
DEEPSEEK3 = (
    r"\p{N}{1,3}",
    _CJK_KANA,
    _ASCII_PUNCT_WORD + r"|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|" + _TAIL,
)
DEEPSEEK_LLM = (
    r"[\r\n]",
    r"\s?[A-Za-z"  # letters of cased scripts
    "\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373\u0376"
    "\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f"
    "\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d"
    "\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb"
    "\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128"
    "\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4"
    "\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf"
    "\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
    "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df"
    "\U0001e900-\U0001e943"
    "]+",
    r"\s?[!-/:-~" "\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002" "]+",
    r"\s+$",
    _CJK_HANGUL,
    r"\p{N}+",
)
DEEPSEEK_CODER = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}")
# Case-aware words (GPT-4o's o200k split): uppercase letters then lowercase ones, or the other way round, with one
# optional leading non-letter and an optional contraction; numbers; punctuation with trailing newlines or slashes.
# llama.cpp spells the letter classes either with \p{Lu}-style names or as "a letter that is not a-z / not A-Z";
# on its stand-in text both only tell cases apart for ASCII, but each name keeps its own spelling, as llama.cpp does.
_UPPER, _LOWER = r"((?=[\p{L}])([^a-z]))", r"((?=[\p{L}])([^A-Z]))"
_UPPER_M, _LOWER_M = r"((?=[\p{L}\p{M}])([^a-z]))", r"((?=[\p{L}\p{M}])([^A-Z]))"
_CASED_UPPER, _CASED_LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_NOT_WORD = r"[^\r\n\p{L}\p{N}]?"


def _cased_words(upper: str, lower: str, numbers: str, contraction: str = _CONTRACTIONS + "?") -> str:
    return (
        f"{_NOT_WORD}{upper}*{lower}+{contraction}|{_NOT_WORD}{upper}+{lower}*{contraction}"
        f"|{numbers}| ?[^\\s\\p{{L}}\\p{{N}}]+[\\r\\n/]*|" + _TAIL
    )


GPT4O = _cased_words(_UPPER, _LOWER, r"\p{N}{1,3}")
TEKKEN = _cased_words(_UPPER, _LOWER, r"\p{N}", contraction="")
GRANITE_EMB_MULTI = _cased_words(_UPPER_M, _LOWER_M, r"\p{N}{1,3}")
TINY_AYA = _cased_words(_CASED_UPPER, _CASED_LOWER, r"\p{N}{1,3}")
YOUTU = (
    "[\uac00-\ud7a3\u3131-\u318e]+|[\uff01\u2026\u201c\u201d\u2018\u2019\u2014\uff1a\uff1b\uff0c\u3001-\u303f"
    "\ufe30-\ufe4f]+|[\u3105-\u312f]+|" + _CJK_KANA,  # Hangul, CJK punctuation, Bopomofo, CJK and kana runs
    _cased_words(_CASED_UPPER, _CASED_LOWER, r"\p{N}"),
)
STARCODER = (r"\p{N}", GPT2)
FALCON = (r"[\p{P}\$\+<=>\^~\|`]+", GPT2, "[0-9][0-9][0-9]")
DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]")
BLOOM = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"  # words up to whitespace or sentence punctuation
CHAMELEON = (
    "<sentinel:[0-9]+>",
    "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
    "([\\t\\n]|    |  )",
    r"\p{N}",
    r"[\p{P}!-/:-@\[-`{-~]",
    GPT2,
)
BAILINGMOE = (
    "'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"
)
SEED_CODER = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|" + _TAIL
UFAKZEKA = r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|" + _TAIL  # Qwen2's without contractions
# runs of CJK, kana, Thai, Lao, Khmer, Myanmar and Hangul
AFMOE_SCRIPTS = (
    "[\u4e00-\u9fff\u3400-\u4dbf\u8c48-\ufaff\u3040-\u309f\u30a0-\u30ff\uff65-\uff9f\u2f00-\u2fdf"
    "\u0e40-\u0e7f\u0e80-\u0eff\u1780-\u17ff\u1000-\u109f\uaa60-\uaa7f\ua9e0-\ua9ff\uac00-\ud7af"
    "\u1100-\u11ff]+"
)
LINES = r"[^\n]+|[\n]+"
EXAONE_MOE = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?"
    r"|\s*[\r\n]|\s+(?!\S)|\s+"
)
MINICPM5 = (r"\p{N}{1,3}", _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|" + _TAIL)

_LLAMA3 = PreTokenizer((LLAMA3,), ignore_merges=True, add_bos=True)
_QWEN2 = PreTokenizer((QWEN2,))
_GPT2 = PreTokenizer((GPT2,))
_GPT4O = PreTokenizer((GPT4O,))
_STARCODER = PreTokenizer(STARCODER)
_DEEPSEEK3 = PreTokenizer(DEEPSEEK3)
_SPM_STYLE = PreTokenizer((LINES,), byte_level=False, escape_spaces=True)  # spaces as "\u2581", lines whole
_GEMMA4 = PreTokenizer((LINES,), byte_level=False, escape_spaces=True, gemma4=True)


def _names(names: str, pre: PreTokenizer) -> dict[str, PreTokenizer]:
    return dict.fromkeys(names.split(), pre)


# tokenizer.ggml.pre -> its pre-tokenizer, for every name llama.cpp accepts with the "gpt2" tokenizer model.
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": PreTokenizer(DEFAULT),
    "minicpm5": PreTokenizer(MINICPM5, ignore_merges=True),
    **_names("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano", _LLAMA3),
    "deepseek-llm": PreTokenizer(DEEPSEEK_LLM),
    "deepseek-coder": PreTokenizer(DEEPSEEK_CODER),
    **_names("deepseek-v3 hunyuan-dense joyai-llm hy_v4", _DEEPSEEK3),
    "spark2_5": PreTokenizer(
        (
            r"\p{N}{1,3}",
            _CJK_KANA,
            _ASCII_PUNCT_WORD + r"|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+",
            r"\p{N}",
        )
    ),
    "youtu": PreTokenizer(YOUTU, ignore_merges=True),
    "falcon": PreTokenizer(FALCON),
    **_names(
        "mpt gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum modern-bert olmo jais "
        "trillion granite-docling exaone4 jina-v1-en jina-v2-code roberta-bpe",
        _GPT2,
    ),
    "jais-2": PreTokenizer((JAIS2,)),
    **_names("gemma4 granite-embed-multi-311m", _GEMMA4),
    "sarvam-moe": _SPM_STYLE,
    "whitespace": PreTokenizer((r"\S+",), byte_level=False),
    **_names("starcoder refact command-r smollm codeshell exaone minerva-7b mellum2", _STARCODER),
    **_names("qwen2 deepseek-r1-qwen kormo f2llmv2 stablelm2 megrez hunyuan solar-open", _QWEN2),
    "qwen35": PreTokenizer((QWEN35,)),
    **_names("dbrx smaug-bpe", PreTokenizer((LLAMA3,))),
    **_names("poro-chat bloom gpt3-finnish", PreTokenizer((BLOOM,))),
    "chatglm-bpe": PreTokenizer((LLAMA3,), bos_token=False),
    **_names("glm4 glm5", PreTokenizer((LLAMA3,), ignore_merges=True, bos_token=False)),
    "viking": PreTokenizer((BLOOM, r"\p{N}")),
    "tekken": PreTokenizer((TEKKEN,), ignore_merges=True, add_bos=True),
    "exaone-moe": PreTokenizer((EXAONE_MOE,)),
    "chameleon": PreTokenizer(CHAMELEON, add_bos=True),
    **_names("gpt-4o llama4 kanana2 talkie minimax-m2", _GPT4O),
    "granite-embed-multi-97m": PreTokenizer((GRANITE_EMB_MULTI,), ignore_merges=True),
    **_names("tiny_aya cohere2moe", PreTokenizer((TINY_AYA_DIGITS, TINY_AYA))),
    "superbpe": PreTokenizer((r"\p{N}+", r"(?=(\d{3})+(?!\d))")),
    **_names("bailingmoe bailingmoe2 llada-moe", PreTokenizer((BAILINGMOE,))),
    "seed-coder": PreTokenizer((SEED_CODER,)),
    "kimi-k2": PreTokenizer((KIMI_K2,)),
    "ufakzeka": PreTokenizer((UFAKZEKA,)),
    "grok-2": _QWEN2,
    "afmoe": PreTokenizer((DIGIT_GROUPS, AFMOE_SCRIPTS, DEEPSEEK3[2])),
    "laguna": PreTokenizer((LINES, QWEN2)),
}
