"""Tokenization identical to llama.cpp's (llama_cpp.Llama.tokenize) on mixed English, code, Unicode and whitespace.

The synthetic vocabulary is written with each family's `tokenizer.ggml.pre` value in turn, so every pre-tokenizer
regex family we support is checked against llama.cpp's own splitting on the same file.
"""

from __future__ import annotations

import pytest
from gguf import GGUFValueType, TokenType

import moerun
from moeprep.errors import MoeprepError
from moeprep.gguf.reader import open_gguf
from moeprep.gguf.writer import KVValue, write_gguf
from moerun.tokenizer import Tokenizer, bytes_to_unicode
from tests.oracle import llama_tokenize
from tests.runtime.conftest import MIXED_TEXT

# One pre name per regex family in moerun.tokenizer.PRE_TOKENIZERS (glm4: the llama3 split with ignore_merges).
PRE_NAMES = ["qwen2", "llama-bpe", "glm4", "gpt-2", "starcoder", "default", "deepseek-v3", "gpt-4o", "qwen35"]


@pytest.mark.parametrize("pre", PRE_NAMES)
def test_tokenization_matches_llama_cpp(pre, synth_model, tmp_path, calibration_text):
    path = tmp_path / f"{pre}.gguf"
    write_gguf(path, open_gguf(synth_model("qwen3moe")), kv_set={"tokenizer.ggml.pre": KVValue(pre, GGUFValueType.STRING)})
    tokenizer = Tokenizer(open_gguf(path))
    for text in (MIXED_TEXT, calibration_text[:4000], "", " ", "\n\n", "a"):
        assert tokenizer.encode(text) == llama_tokenize(path, text), f"{pre}: {text[:40]!r}"
        assert tokenizer.encode(text, add_bos=False) == llama_tokenize(path, text, add_bos=False)


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
    write_gguf(out_path, src, kv_remove=["tokenizer.ggml.merges", "tokenizer.ggml.pre", "tokenizer.ggml.add_bos_token"], kv_set={
        "tokenizer.ggml.model": KVValue("llama", V.STRING),
        "tokenizer.ggml.tokens": KVValue(tokens, V.ARRAY, V.STRING),
        "tokenizer.ggml.scores": KVValue([0.0] * n_fixed + [-float(i) for i in range(len(tokens) - n_fixed)],
                                         V.ARRAY, V.FLOAT32),
        "tokenizer.ggml.token_type": KVValue([int(t) for t in types], V.ARRAY, V.INT32),
        "tokenizer.ggml.bos_token_id": KVValue(1, V.UINT32),
        "tokenizer.ggml.eos_token_id": KVValue(2, V.UINT32),
        "tokenizer.ggml.unknown_token_id": KVValue(0, V.UINT32),
    })
    return out_path


def test_sentencepiece_tokenization_matches_llama_cpp(synth_model, tmp_path, calibration_text):
    path = _sentencepiece_model(synth_model("llama"), tmp_path / "spm.gguf")
    tokenizer = Tokenizer(open_gguf(path))
    assert tokenizer.add_bos  # SentencePiece vocabularies add BOS unless the file says otherwise
    for text in (MIXED_TEXT, calibration_text[:4000], "", " ", "a<tool>b <tool> c", "naïve 🙂"):
        assert tokenizer.encode(text) == llama_tokenize(path, text), text[:40]
    assert tokenizer.decode(tokenizer.encode(MIXED_TEXT, add_bos=False)) == " " + MIXED_TEXT  # the space prefix


def test_decode_round_trips(synth_model):
    tokenizer = moerun.load_model(synth_model("qwen3moe")).tokenizer
    assert tokenizer.decode(tokenizer.encode(MIXED_TEXT, add_bos=False)) == MIXED_TEXT
    # a character split over tokens comes back whole from the concatenated bytes
    ids = tokenizer.encode("👍🏽", add_bos=False)
    assert b"".join(tokenizer.token_bytes(i) for i in ids).decode() == "👍🏽"


def test_unknown_pre_tokenizer_is_a_user_error(synth_model, tmp_path):
    path = tmp_path / "odd.gguf"
    write_gguf(path, open_gguf(synth_model("qwen3moe")), kv_set={"tokenizer.ggml.pre": KVValue("no-such", GGUFValueType.STRING)})
    with pytest.raises(MoeprepError, match="pre-tokenizer 'no-such' is not supported"):
        Tokenizer(open_gguf(path))
