"""The committed bench models (bench/models/, trained by bench/train_moe/): they load in llama.cpp, in moeprep's
reader and in moerun, give finite logits, and the two engines agree on them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

import moerun
from bench.train_moe.evaluate import open_llama
from moeprep.gguf.reader import open_gguf

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "bench" / "models"
F16 = MODELS / "bench-qwen3moe-f16.gguf"
Q4K = MODELS / "bench-qwen3moe-q4k.gguf"
HELDOUT = ROOT / "bench" / "data" / "heldout.txt"
N_TOKENS = 64
# tensor name suffix -> type in the quantized variant (export.VARIANT_TYPES, with ggml's fallback for down rows of 128)
Q4K_TYPES = {
    "token_embd.weight": Q.Q6_K,
    "attn_q.weight": Q.Q8_0,
    "attn_output.weight": Q.Q8_0,
    "ffn_gate_exps.weight": Q.Q4_K,
    "ffn_up_exps.weight": Q.Q4_K,
    "ffn_down_exps.weight": Q.Q5_0,
    "ffn_gate_inp.weight": Q.F32,
    "attn_norm.weight": Q.F32,
}


@pytest.fixture(scope="module")
def prompt_ids() -> list[int]:
    model = moerun.load_model(F16, n_ctx=N_TOKENS)
    return model.tokenizer.encode(HELDOUT.read_text(encoding="utf-8")[:2000], add_bos=False)[:N_TOKENS]


def test_committed_models_fit_the_size_budget():
    assert F16.stat().st_size + Q4K.stat().st_size <= 60_000_000


@pytest.mark.parametrize("path", [F16, Q4K], ids=["f16", "q4k"])
def test_reader_sees_a_qwen3moe_with_a_tokenizer(path):
    g = open_gguf(path)
    assert g.arch == "qwen3moe"
    assert g.get("qwen3moe.expert_count") == 32 and g.get("qwen3moe.expert_used_count") == 4
    assert g.get("tokenizer.ggml.model") == "gpt2" and g.get("tokenizer.ggml.pre") == "qwen2"
    assert "output.weight" not in {t.name for t in g.tensors}  # tied output head


def test_quantized_variant_types():
    types = {t.name: t.ggml_type for t in open_gguf(Q4K).tensors}
    for name, qtype in types.items():
        for suffix, expected in Q4K_TYPES.items():
            if name.endswith(suffix):
                assert qtype == expected, name


@pytest.mark.parametrize("path", [F16, Q4K], ids=["f16", "q4k"])
def test_llama_cpp_and_moerun_agree(path, prompt_ids):
    llm = open_llama(path, N_TOKENS)
    try:
        assert llm.tokenize(HELDOUT.read_text(encoding="utf-8")[:2000].encode(), add_bos=False)[:N_TOKENS] == prompt_ids
        llm.eval(prompt_ids)
        ref = np.asarray(llm.scores[:N_TOKENS], dtype=np.float32)
    finally:
        llm.close()
    ours = moerun.load_model(path, n_ctx=N_TOKENS).forward(torch.tensor(prompt_ids), 0).float().numpy()
    assert np.isfinite(ref).all() and np.isfinite(ours).all()
    assert np.linalg.norm(ours - ref) / np.linalg.norm(ref) < 2e-2
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() > 0.95
