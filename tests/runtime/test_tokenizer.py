"""Tokenization identical to llama.cpp's (llama_cpp.Llama.tokenize, vocabulary-only load) for every pre-tokenizer
name and every tokenizer model of MoE releases that llama.cpp accepts.

Each test writes a vocabulary-only GGUF with the synthetic vocabulary under one `tokenizer.ggml.pre` name (or
tokenizer model) and tokenizes a text that mixes scripts (CJK, Arabic, Devanagari, Cyrillic with mixed case),
code, long numbers, emoji, whitespace runs, contractions and user-defined tokens, on both sides.
"""

from __future__ import annotations

import random

import llama_cpp
import pytest
from click.testing import CliRunner
from gguf import GGUFValueType, TokenType

import moerun
from moeprep.errors import MoeprepError
from moeprep.gguf.reader import open_gguf
from moeprep.gguf.writer import KVValue, write_gguf
from moeprep.synth.tokenizer import (
    NFKC_SAMPLE,
    load_vocab,
    precompiled_charsmap,
    sentencepiece_style,
    unigram_style,
    vocab_metadata,
    with_user_defined,
)
from moerun.cli import main as moerun_main
from moerun.tokenizer import Tokenizer, bytes_to_unicode
from moerun.tokenizer.pretokenizers import PRE_TOKENIZERS
from tests.oracle import llama_tokenize
from tests.runtime.conftest import MIXED_TEXT

USER_DEFINED = ("<tool_call>", "</tool_call>")
TEXT = MIXED_TEXT + (
    "हिन्दी में परीक्षण: नमस्ते दुनिया १२३४५ — مرحبا بالعالم ٣١٤١٥ — 你好，世界！これはテストです。가나다\n"
    "digits 12345678901234567890 1234 12 0.000001 ０１２\n"
    "IT'S THEY'LL We'RE o'clock l'été приВЕТ МирОК ΑΒΓδεζ Ǆemal ﬁne Ⅻ\n"
    '<tool_call>{"name": "f", "args": [1, 2]}</tool_call> a<tool_call>b\n'
    "\t \n \r\n\r\n\n\n\n    \u3000\u3000x  \u200b \u0301e\u0301 🧑‍💻🏳️‍🌈 🇯🇵\n"
    "    for (int i = 0; i < n; ++i) { s += a[i] * b[i]; }  // dot\n"
    "x=1;y=22;z=333;w=4444 ... !!! ??? \"quoted\" 'single' `tick` $HOME ~/.bashrc\n"
)
TEXTS = (TEXT, "", " ", "\n\n", "   a", "a  ", "1234567", "\u3000")
# tokenizer.ggml.pre names whose words are raw UTF-8 (SentencePiece-style BPE): written with that vocabulary
RAW_UTF8 = sorted(name for name, pre in PRE_TOKENIZERS.items() if not pre.byte_level)


@pytest.fixture(scope="module")
def vocab_file(synth_model):
    """Writes a vocabulary-only GGUF (the synthetic model's keys, no tensors) with the synthetic vocabulary plus
    the user-defined tokens, under the given tokenizer model and pre-tokenizer name."""
    base = open_gguf(synth_model("qwen3moe"))

    def write(path, *, model="gpt2", pre=None, raw=False, **kv):
        vocab = with_user_defined(sentencepiece_style(load_vocab()) if raw else load_vocab(), USER_DEFINED)
        meta = vocab_metadata(vocab, model=model, pre=pre) | kv
        write_gguf(
            path,
            base,
            tensors=[],
            kv_set=meta,
            kv_remove=[k for k in base.fields if k.startswith("tokenizer.") and k not in meta],
        )
        return path

    return write


def _assert_same_as_llama_cpp(path, texts=TEXTS):
    tokenizer = Tokenizer(open_gguf(path))
    for text in texts:
        for add_bos in (True, False):
            ours, theirs = tokenizer.encode(text, add_bos=add_bos), llama_tokenize(path, text, add_bos=add_bos)
            assert ours == theirs, f"{path.stem}: {text[:40]!r} add_bos={add_bos}"
    return tokenizer


@pytest.mark.parametrize("pre", sorted(PRE_TOKENIZERS))
def test_every_pre_tokenizer_matches_llama_cpp(pre, vocab_file, tmp_path):
    raw = pre in RAW_UTF8
    text, texts = TEXT, TEXTS
    if pre == "whitespace":
        # Made for the "whitespace" tokenizer model, which drops whitespace; under "gpt2" llama.cpp aborts (an
        # assertion in its merge lookup) on a word of two whitespace characters, so whitespace comes single here.
        text = " ".join(TEXT.split(" ")).replace("  ", " ")
        text = "\n".join(" ".join(line.split()) for line in text.split("\n"))
        texts = (text, "", " ", "\n\n", "a b")
    tokenizer = _assert_same_as_llama_cpp(vocab_file(tmp_path / f"{pre}.gguf", pre=pre, raw=raw), texts)
    ids = tokenizer.encode(text, add_bos=False)
    tool_call = open_gguf(tmp_path / f"{pre}.gguf").get("tokenizer.ggml.tokens").index(USER_DEFINED[0])
    assert len(ids) > 200 and ids.count(tool_call) == 2  # the text was tokenized, user-defined tokens whole
    assert tokenizer.decode(ids) == text  # detokenization round-trips


# Random texts are drawn from these pieces: cased letters of several scripts, digits of several systems, marks,
# emoji, control characters, Unicode spaces, contractions in both cases.
PIECES = [
    *"abcXYZ'sStT  \t\n\r0123456789.,!?-_/$+<=>^`|~()[]{}\"#%&*:;@\\",
    *"éÉßǅǄŉ日本語中文한국어ΑβГдיעبالعربيةहिन्दी१२३٣٤、。！？・ーｶﾞ０１ＡＢａｂ",
    *"\u3000\u00a0\u2003\u200b\u0301\u0308\u093f\u094d🙂👍🏽🧑‍💻\U0001fa77\x01\x1f\x7f\u2028\u0085",
    "'re",
    "'LL",
    "'Ve",
    "IT'S",
    " 'd",
    "<tool_call>",
]


@pytest.mark.parametrize("pre", sorted(set(PRE_TOKENIZERS) - {"whitespace"}))
def test_random_texts_match_llama_cpp(pre, vocab_file, tmp_path):
    """40 seeded random texts per pre-tokenizer: the corners a fixed text misses (a mark after a space, a
    contraction at the end, a digit run against a letter, ...)."""
    path = vocab_file(tmp_path / f"{pre}.gguf", pre=pre, raw=pre in RAW_UTF8)
    tokenizer, llm = Tokenizer(open_gguf(path)), llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    rng = random.Random(pre)
    for _ in range(40):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 40)))
        assert tokenizer.encode(text, add_bos=False) == llm.tokenize(text.encode(), add_bos=False, special=False), text


def test_kimi_k2_without_merges_matches_llama_cpp(vocab_file, tmp_path):
    """Kimi-K2 files may carry no merge list (llama.cpp accepts that for this name only): words then become
    their whole-token matches or single characters."""
    path = vocab_file(tmp_path / "k2.gguf", pre="kimi-k2")
    stripped = tmp_path / "k2-no-merges.gguf"
    write_gguf(stripped, open_gguf(path), tensors=[], kv_remove=["tokenizer.ggml.merges"])
    _assert_same_as_llama_cpp(stripped)


def test_gemma4_tokenizer_model_matches_llama_cpp(vocab_file, tmp_path):
    path = vocab_file(
        tmp_path / "gemma4.gguf",
        model="gemma4",
        raw=True,
        **{"tokenizer.ggml.bos_token_id": KVValue(1, GGUFValueType.UINT32)},
    )
    tokenizer = _assert_same_as_llama_cpp(path)
    assert tokenizer.add_bos  # Gemma 4 always starts with BOS, whatever the file says
    ids = tokenizer.encode(TEXT, add_bos=False)
    tokens = open_gguf(path).get("tokenizer.ggml.tokens")
    assert any(tokens[i].startswith("\u2581") for i in ids)  # spaces were written "\u2581" and merged into words
    assert any(tokens[i].startswith("<0x") for i in ids)  # characters no token covers went to their byte tokens
    assert tokenizer.decode(ids) == TEXT


@pytest.mark.parametrize("extra_spaces", ["merged", "kept"])
def test_unigram_tokenizer_model_matches_llama_cpp(extra_spaces, synth_model, tmp_path):
    """ "t5" (SentencePiece unigram, XLM-R style as in nomic-bert-moe): the character map normalizes (NFKC rules),
    spaces become "\u2581", the best-scoring segmentation wins, unknown characters merge into one <unk>."""
    vocab, scores = unigram_style(load_vocab())
    vocab = with_user_defined(vocab, USER_DEFINED)
    V = GGUFValueType
    path = tmp_path / "t5.gguf"
    base = open_gguf(synth_model("qwen3moe"))
    write_gguf(
        path,
        base,
        tensors=[],
        kv_remove=[k for k in base.fields if k.startswith("tokenizer.")],
        kv_set={
            "tokenizer.ggml.model": KVValue("t5", V.STRING),
            "tokenizer.ggml.tokens": KVValue(vocab.tokens, V.ARRAY, V.STRING),
            "tokenizer.ggml.scores": KVValue(scores + [0.0] * len(USER_DEFINED), V.ARRAY, V.FLOAT32),
            "tokenizer.ggml.token_type": KVValue(vocab.token_types, V.ARRAY, V.INT32),
            "tokenizer.ggml.precompiled_charsmap": KVValue(list(precompiled_charsmap(NFKC_SAMPLE)), V.ARRAY, V.UINT8),
            "tokenizer.ggml.add_space_prefix": KVValue(True, V.BOOL),
            "tokenizer.ggml.remove_extra_whitespaces": KVValue(extra_spaces == "merged", V.BOOL),
            "tokenizer.ggml.bos_token_id": KVValue(0, V.UINT32),
            "tokenizer.ggml.eos_token_id": KVValue(2, V.UINT32),
            "tokenizer.ggml.unknown_token_id": KVValue(3, V.UINT32),
            "tokenizer.ggml.add_bos_token": KVValue(True, V.BOOL),
        },
    )
    text = TEXT + "".join(NFKC_SAMPLE) + " ﬁnal ＡＢ１ …"
    tokenizer = _assert_same_as_llama_cpp(path, (text, *TEXTS[1:]))
    ids = tokenizer.encode(text)
    assert ids[0] == 0 and ids[-1] == 2 and 3 in ids  # BOS, EOS (t5's default), and some unknown characters
    assert "fi" in tokenizer.decode(tokenizer.encode("ﬁ", add_bos=False))  # normalized by the map


def test_missing_pre_tokenizer_is_default_as_in_llama_cpp(vocab_file, tmp_path):
    _assert_same_as_llama_cpp(vocab_file(tmp_path / "none.gguf", pre=None))


def test_add_bos_and_eos_follow_the_file(vocab_file, tmp_path):
    path = vocab_file(
        tmp_path / "eos.gguf",
        pre="llama-bpe",
        **{
            "tokenizer.ggml.add_bos_token": KVValue(True, GGUFValueType.BOOL),
            "tokenizer.ggml.add_eos_token": KVValue(True, GGUFValueType.BOOL),
        },
    )
    tokenizer = _assert_same_as_llama_cpp(path)
    assert tokenizer.encode("a")[0] == tokenizer.bos_id and tokenizer.encode("a")[-1] == tokenizer.eos_id


def test_unknown_pre_tokenizer_is_refused_like_llama_cpp(vocab_file, synth_model, tmp_path):
    path = vocab_file(tmp_path / "odd.gguf", pre="no-such")
    with pytest.raises(ValueError):  # llama.cpp will not load it
        llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    with pytest.raises(MoeprepError, match="unknown pre-tokenizer type 'no-such'"):
        Tokenizer(open_gguf(path))
    model = tmp_path / "model.gguf"  # a whole model: the tokenizer is refused before any weight is read
    write_gguf(
        model,
        open_gguf(synth_model("qwen3moe")),
        kv_set={"tokenizer.ggml.pre": KVValue("no-such", GGUFValueType.STRING)},
    )
    result = CliRunner().invoke(moerun_main, ["-m", str(model), "-p", "hi", "-n", "1"])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.strip().splitlines() if not line.startswith("moerun: running on")]
    assert len(lines) == 1 and "unknown pre-tokenizer type 'no-such'" in lines[0]  # after the device line


@pytest.mark.parametrize("model", ["no-such", "bert", "rwkv"])
def test_tokenizer_models_moerun_does_not_run_are_one_line_errors(model, vocab_file, tmp_path):
    path = vocab_file(tmp_path / "model.gguf", model=model, pre=None)
    with pytest.raises(MoeprepError, match=f"tokenizer model '{model}'"):
        Tokenizer(open_gguf(path))


def _sentencepiece_model(src_path, out_path):
    """The synthetic byte-level vocabulary recast as a SentencePiece ("llama") one: <unk> <s> </s>, a user-defined
    <tool>, the 256 byte tokens <0xXX>, then every BPE token that is whole UTF-8 text, spaces as "\u2581", scored
    by merge order. Tensors are kept; only the tokenizer is read from this file."""
    src = open_gguf(src_path)
    char_bytes = {c: b for b, c in bytes_to_unicode().items()}
    tokens = ["<unk>", "<s>", "</s>", "<tool>", *(f"<0x{b:02X}>" for b in range(256))]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL, TokenType.USER_DEFINED, *[TokenType.BYTE] * 256]
    for text, kind in zip(src.get("tokenizer.ggml.tokens"), src.get("tokenizer.ggml.token_type")):
        try:
            piece = bytes(char_bytes[c] for c in text).decode("utf-8").replace(" ", "\u2581")
        except (KeyError, UnicodeDecodeError):
            continue
        if kind == TokenType.NORMAL and piece not in tokens:
            tokens.append(piece)
            types.append(TokenType.NORMAL)
    n_fixed = 4 + 256
    V = GGUFValueType
    write_gguf(
        out_path,
        src,
        kv_remove=["tokenizer.ggml.merges", "tokenizer.ggml.pre", "tokenizer.ggml.add_bos_token"],
        kv_set={
            "tokenizer.ggml.model": KVValue("llama", V.STRING),
            "tokenizer.ggml.tokens": KVValue(tokens, V.ARRAY, V.STRING),
            "tokenizer.ggml.scores": KVValue(
                [0.0] * n_fixed + [-float(i) for i in range(len(tokens) - n_fixed)], V.ARRAY, V.FLOAT32
            ),
            "tokenizer.ggml.token_type": KVValue([int(t) for t in types], V.ARRAY, V.INT32),
            "tokenizer.ggml.bos_token_id": KVValue(1, V.UINT32),
            "tokenizer.ggml.eos_token_id": KVValue(2, V.UINT32),
            "tokenizer.ggml.unknown_token_id": KVValue(0, V.UINT32),
        },
    )
    return out_path


def test_sentencepiece_tokenization_matches_llama_cpp(synth_model, tmp_path, calibration_text):
    path = _sentencepiece_model(synth_model("llama"), tmp_path / "spm.gguf")
    tokenizer = Tokenizer(open_gguf(path))
    assert tokenizer.add_bos  # SentencePiece vocabularies add BOS unless the file says otherwise
    for text in (TEXT, calibration_text[:4000], "", " ", "a<tool>b <tool> c", "naïve 🙂"):
        assert tokenizer.encode(text) == llama_tokenize(path, text), text[:40]
    assert tokenizer.decode(tokenizer.encode(TEXT, add_bos=False)) == " " + TEXT  # the space prefix


def test_synthetic_models_tokenize_as_llama_cpp(synth_model, calibration_text):
    path = synth_model("qwen3moe")
    tokenizer = moerun.load_model(path).tokenizer
    for text in (calibration_text[:4000], TEXT):
        assert tokenizer.encode(text) == llama_tokenize(path, text)
    # a character split over tokens comes back whole from the concatenated bytes
    ids = tokenizer.encode("👍🏽", add_bos=False)
    assert b"".join(tokenizer.token_bytes(i) for i in ids).decode() == "👍🏽"
