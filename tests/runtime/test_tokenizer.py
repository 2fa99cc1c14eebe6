"""Tokenization identical to llama.cpp's (llama_cpp.Llama.tokenize) on mixed English, code, Unicode and whitespace.

The synthetic vocabulary is written with each family's `tokenizer.ggml.pre` value in turn, so every pre-tokenizer
regex family we support is checked against llama.cpp's own splitting on the same file.
"""

from __future__ import annotations

import pytest
from gguf import GGUFValueType

import moerun
from moeprep.gguf.reader import open_gguf
from moeprep.gguf.writer import KVValue, write_gguf
from moeprep.errors import MoeprepError
from moerun.tokenizer import Tokenizer
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
