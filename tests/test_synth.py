"""The synthetic models: deterministic bytes, and llama.cpp (the oracle) loads and runs every architecture.

llama.cpp is reached through llama_cpp.Llama; tests/conftest.py turns its extra (AMX/repacked) CPU buffers off.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import gguf
import llama_cpp
import numpy as np
import pytest
from click.testing import CliRunner

from moeprep.cli import main
from moeprep.errors import MoeprepError
from moeprep.gguf.reader import open_gguf
from moeprep.synth import BIAS_CHANNEL, SYNTH_ARCHS, synth_config, write_synth_model
from moeprep.synth.tokenizer import TOKENIZER_PATH
from moeprep.synth.weights import RANDOM_BLOCKS, random_blocks
from tests.conftest import REAL_VOCAB
from tests.oracle import llama_eval

MIXED_TEXT = (
    "Hello, world! It's 2024: don't  panic.\n\ndef f(x):\n    return x ** 2  # 12345\n"
    "\tcafé ünïcode 日本語 😀 — “quotes”\r\n   trailing   "
)
PROMPT = "The heap invariant: a[k] <= a[2*k+1] and a[k] <= a[2*k+2] for all k, counting elements from zero."


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def llama(path: Path) -> llama_cpp.Llama:
    return llama_cpp.Llama(model_path=str(path), logits_all=True, n_ctx=256, n_threads=2, verbose=False)


def eval_logits(llm: llama_cpp.Llama, n_tokens: int = 24) -> np.ndarray:
    """Logits [T, V] of the first n_tokens tokens of PROMPT."""
    tokens = llm.tokenize(PROMPT.encode(), add_bos=False)[:n_tokens]
    assert len(tokens) == n_tokens
    llm.eval(tokens)
    return np.array(llm.scores[:n_tokens])


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("synth")
    return {arch: write_synth_model(folder / f"{arch}.gguf", arch) for arch in SYNTH_ARCHS}


@pytest.mark.parametrize("arch", SYNTH_ARCHS)
def test_same_arguments_same_bytes(arch: str, tiny_models: dict[str, Path], tmp_path: Path) -> None:
    again = write_synth_model(tmp_path / "again.gguf", arch)
    other_seed = write_synth_model(tmp_path / "other.gguf", arch, seed=1)
    assert sha256(again) == sha256(tiny_models[arch])
    assert sha256(other_seed) != sha256(again)


@pytest.mark.parametrize("arch", SYNTH_ARCHS)
def test_llama_cpp_loads_and_evaluates(arch: str, tiny_models: dict[str, Path]) -> None:
    llm = llama(tiny_models[arch])
    logits = eval_logits(llm)
    assert logits.shape == (24, len(open_gguf(tiny_models[arch]).get("tokenizer.ggml.tokens")))
    assert np.isfinite(logits).all()
    assert 0.3 < logits.std() < 3.0  # well-conditioned: neither flat nor exploding
    assert not np.allclose(logits[0], logits[-1])  # the prompt matters


def test_tokenizer_round_trip_and_agreement(tiny_models: dict[str, Path]) -> None:
    """llama.cpp's "qwen2" pre-tokenizer and the tokenizers library split and merge identically."""
    from tokenizers import Tokenizer

    llm = llama_cpp.Llama(model_path=str(tiny_models["qwen3moe"]), vocab_only=True, verbose=False)
    reference = Tokenizer.from_file(str(TOKENIZER_PATH))
    calibration = (TOKENIZER_PATH.parent / "calibration.txt").read_text(encoding="utf-8")
    for text in (MIXED_TEXT, calibration[:6000], calibration[-3000:]):
        ids = llm.tokenize(text.encode(), add_bos=False, special=False)
        assert llm.detokenize(ids).decode() == text
        assert ids == reference.encode(text, add_special_tokens=False).ids
    assert llm.tokenize(b"<|im_start|>user", add_bos=False, special=True)[0] == 1
    assert llm.token_eos() == 0


def test_real_vocabulary_size_loads_in_llama_cpp(real_vocab_model: Path, tiny_models: dict[str, Path]) -> None:
    """n_vocab pads the vocabulary with unused tokens: llama.cpp takes all of them, no text becomes one, and the
    embedding and output tensors have a row per token."""
    llm = llama_cpp.Llama(model_path=str(real_vocab_model), vocab_only=True, verbose=False)
    small = llama_cpp.Llama(model_path=str(tiny_models["qwen3moe"]), vocab_only=True, verbose=False)
    assert llm.n_vocab() == REAL_VOCAB
    for text in (MIXED_TEXT, "<unused0> <unused12345>"):
        ids = llm.tokenize(text.encode(), add_bos=False, special=True)
        assert ids == small.tokenize(text.encode(), add_bos=False, special=True)
        assert llm.detokenize(ids).decode() == text
    model = open_gguf(real_vocab_model)
    assert model.tensor("token_embd.weight").shape[0] == model.tensor("output.weight").shape[0] == REAL_VOCAB
    cli = CliRunner().invoke(main, ["synth", str(real_vocab_model.with_name("cli.gguf")), "--vocab-size", "4096"])
    assert cli.exit_code == 0, cli.output
    assert len(open_gguf(real_vocab_model.with_name("cli.gguf")).get("tokenizer.ggml.tokens")) == 4096


@pytest.mark.parametrize("arch", SYNTH_ARCHS)
def test_k_quant_variants_load(arch: str, tmp_path: Path) -> None:
    """The small preset's rows are multiples of 256, so every attention and expert matrix takes the K-quant."""
    path = write_synth_model(tmp_path / "k.gguf", arch, preset="small", expert_type="Q4_K", attn_type="Q6_K")
    model = open_gguf(path)
    types = {t.name: t.type_name for t in model.tensors}
    assert {v for k, v in types.items() if "_exps.weight" in k} == {"Q4_K"}
    # hybrids: not every layer; deepseek4's low-rank output ends in attn_output_b
    first_attention = next(name for name in types if name.endswith((".attn_output.weight", ".attn_output_b.weight")))
    assert types[first_attention] == "Q6_K"
    assert np.isfinite(eval_logits(llama(path))).all()


@pytest.mark.parametrize("options", [dict(mla_split=True), dict(yarn=True), dict(mla_split=True, yarn=True)])
def test_deepseek2_options_load(options: dict, tmp_path: Path) -> None:
    path = write_synth_model(tmp_path / "ds.gguf", "deepseek2", **options)
    assert np.isfinite(eval_logits(llama(path))).all()


@pytest.mark.parametrize("scaling", ["linear", "yarn", "longrope"])
def test_step35_rope_scaling_keys(scaling: str, tmp_path: Path) -> None:
    """rope_scaling writes the type and factor (and for YaRN and LongRoPE the original context); LongRoPE's divisors
    replace rope_freqs. llama.cpp loads each (its agreement: tests/runtime/test_models.py)."""
    path = write_synth_model(tmp_path / "s.gguf", "step35", rope_scaling=scaling)
    model = open_gguf(path)
    kv, names = model.kv, {t.name for t in model.tensors}
    assert kv["step35.rope.scaling.type"] == scaling and kv["step35.rope.scaling.factor"] == 4.0
    assert kv.get("step35.rope.scaling.original_context_length") == (None if scaling == "linear" else 512)
    divisors = {"rope_factors_long.weight", "rope_factors_short.weight"}
    assert names & (divisors | {"rope_freqs.weight"}) == (divisors if scaling == "longrope" else {"rope_freqs.weight"})
    assert np.isfinite(eval_logits(llama(path))).all()


def test_mla_layouts_are_one_model(tmp_path: Path) -> None:
    """attn_k_b/attn_v_b are cut from attn_kv_b's draw: both layouts compute the same logits (up to F16)."""
    kv_b = eval_logits(llama(write_synth_model(tmp_path / "kv_b.gguf", "deepseek2")))
    split_path = write_synth_model(tmp_path / "split.gguf", "deepseek2", mla_split=True)
    split = eval_logits(llama(split_path))
    assert np.abs(kv_b - split).max() < 0.02
    kv = open_gguf(split_path).kv
    assert kv["deepseek2.attention.head_count_kv"] == 1
    assert kv["deepseek2.attention.key_length_mla"] == 24 and kv["deepseek2.attention.value_length_mla"] == 16


def test_gpt_oss_mxfp4_experts(tmp_path: Path) -> None:
    path = write_synth_model(tmp_path / "oss.gguf", "gpt-oss", expert_type="MXFP4")
    types = {t.name: t.type_name for t in open_gguf(path).tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == "MXFP4" and types["blk.0.ffn_gate_exps.bias"] == "F32"
    assert np.isfinite(eval_logits(llama(path))).all()


@pytest.mark.parametrize("expert_type", ["F32", "BF16", "Q8_0", "Q4_0"])
def test_other_weight_types_load(expert_type: str, tmp_path: Path) -> None:
    path = write_synth_model(tmp_path / "t.gguf", "qwen3moe", expert_type=expert_type, attn_type=expert_type)
    types = {t.name: t.type_name for t in open_gguf(path).tensors}
    assert types["blk.0.ffn_down_exps.weight"] == types["blk.0.attn_q.weight"] == expert_type
    assert np.isfinite(eval_logits(llama(path))).all()


def expert_share_of_top_quarter(path: Path, tokens: list[int]) -> float:
    """Share of llama.cpp's expert choices (all MoE layers) that go to each layer's most-chosen quarter."""
    run = llama_eval(path, tokens)
    model = open_gguf(path)
    n_expert = model.get(f"{model.arch}.expert_count")
    shares = []
    for ids in run.topk.values():
        counts = np.sort(np.bincount(ids.ravel(), minlength=n_expert))[::-1]
        shares.append(counts[: n_expert // 4].sum() / counts.sum())
    return float(np.mean(shares))


@pytest.mark.parametrize("arch", ["qwen3moe", "deepseek2"])  # skew via the router column / via exp_probs_b
def test_skew_concentrates_llama_cpp_routing(arch: str, tmp_path: Path) -> None:
    calibration = (TOKENIZER_PATH.parent / "calibration.txt").read_text(encoding="utf-8")
    tokens = llama_cpp.Llama(
        model_path=str(write_synth_model(tmp_path / "v.gguf", arch)), vocab_only=True, verbose=False
    ).tokenize(calibration[:4000].encode(), add_bos=False)[:256]
    flat = expert_share_of_top_quarter(write_synth_model(tmp_path / "s0.gguf", arch, skew=0.0), tokens)
    skewed = expert_share_of_top_quarter(write_synth_model(tmp_path / "s1.gguf", arch, skew=1.0), tokens)
    assert flat < 0.5 and skewed > 0.65, (flat, skewed)


def test_residual_writers_leave_the_bias_channel_alone(tiny_models: dict[str, Path]) -> None:
    """Token embeddings hold a constant in BIAS_CHANNEL and nothing writes there, so every router sees it."""
    model = open_gguf(tiny_models["gpt-oss"])
    values = {t.name: gguf.quants.dequantize(model.raw(t), t.ggml_type).reshape(t.shape) for t in model.tensors}
    assert np.all(values["token_embd.weight"][:, BIAS_CHANNEL] == 4.0)
    for name in ("blk.0.attn_output.weight", "blk.0.ffn_down_exps.weight"):
        assert not values[name][..., BIAS_CHANNEL, :].any()
        assert values[name][..., BIAS_CHANNEL + 1, :].any()
    for name in ("blk.0.attn_output.bias", "blk.0.ffn_down_exps.bias"):
        assert not values[name][..., BIAS_CHANNEL].any()


@pytest.mark.parametrize("qtype", list(RANDOM_BLOCKS), ids=lambda q: q.name)
def test_random_blocks_decode_to_the_intended_scale(qtype: gguf.GGMLQuantizationType) -> None:
    blocks = random_blocks(np.random.default_rng(0), (16, 1024), qtype, std=0.03)
    values = gguf.quants.dequantize(blocks, qtype)
    assert values.shape == (16, 1024) and np.isfinite(values).all()
    # MXFP4's scale is a power of two, so its std lands within a factor sqrt(2) of the target
    tolerance = 2**0.5 if qtype == gguf.GGMLQuantizationType.MXFP4 else 1.1
    assert 1 / tolerance < values.std() / 0.03 < tolerance
    assert abs(values.mean()) < 0.005


def test_fast_random_blocks_midsize_writes_quickly_and_loads(tmp_path: Path) -> None:
    """The qwen3-30b-a3b geometry cut to 2 layers and 32 experts: Q4_K blocks written directly as bytes."""
    start = time.perf_counter()
    path = write_synth_model(
        tmp_path / "mid.gguf", "qwen3moe", preset="qwen3-30b-a3b", n_layer=2, n_expert=32, fast_random_blocks=True
    )
    seconds = time.perf_counter() - start
    assert path.stat().st_size > 150e6
    assert seconds < 20, seconds
    assert np.isfinite(eval_logits(llama(path), 8)).all()


def test_tiny_model_writes_well_under_a_second(tmp_path: Path) -> None:
    write_synth_model(tmp_path / "warm.gguf")  # imports and the tokenizer cache
    start = time.perf_counter()
    write_synth_model(tmp_path / "tiny.gguf", "deepseek2")
    assert time.perf_counter() - start < 0.5


def test_metadata_follows_the_arch_table(tiny_models: dict[str, Path]) -> None:
    kv = {arch: open_gguf(path).kv for arch, path in tiny_models.items()}
    assert kv["qwen2moe"]["qwen2moe.expert_shared_feed_forward_length"] == 4 * 32
    assert kv["deepseek2"]["deepseek2.expert_gating_func"] == 2
    assert kv["deepseek2"]["deepseek2.leading_dense_block_count"] == 1
    assert kv["glm4moe"]["glm4moe.rope.dimension_count"] == 8  # partial rotary: half of head_dim 16
    assert kv["gpt-oss"]["gpt-oss.attention.sliding_window"] == 16
    assert kv["llama"]["llama.feed_forward_length"] == 32  # Mixtral: the experts' width
    assert kv["llama4"]["llama4.interleave_moe_layer_step"] == 2
    assert kv["mimo2"]["mimo2.attention.head_count_kv"] == [2, 4, 2]  # sliding layers have twice the KV heads
    assert kv["gemma4"]["gemma4.attention.key_length_swa"] == 16 and kv["gemma4"]["gemma4.attention.key_length"] == 32
    assert kv["gemma4"]["tokenizer.ggml.model"] == "gemma4" and "tokenizer.ggml.pre" not in kv["gemma4"]
    for arch, keys in kv.items():
        assert keys["general.architecture"] == arch
        assert arch == "gemma4" or keys["tokenizer.ggml.pre"] == "qwen2"  # Gemma 4's converter writes none
        used = 1 if arch == "llama4" else 4  # Llama 4 routes to one expert
        assert keys[f"{arch}.expert_count"] == 16 and keys[f"{arch}.expert_used_count"] == used


def test_failed_write_leaves_nothing(tmp_path: Path) -> None:
    def fail(name: str, n_bytes: int) -> None:
        if name.startswith("blk.1."):
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        write_synth_model(tmp_path / "broken.gguf", on_tensor=fail)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(arch="mamba"), "unknown synthetic architecture"),
        (dict(preset="huge"), "unknown preset"),
        (dict(expert_type="Q3_K"), "not supported"),
        (dict(n_expert_used=32), "n_expert_used"),
        (dict(flux_capacitor=1), "unknown synth option"),
        (dict(arch="olmoe", n_head_kv=2), "n_head_kv must equal n_head"),
        (dict(n_vocab=1000), "n_vocab must be at least"),
        (dict(rope_scaling="dynamic"), "rope_scaling must be one of none, linear, yarn, longrope"),
        (dict(rope_scaling="linear", yarn=True), "yarn=True is rope_scaling='yarn'"),
        (dict(rope_scaling="longrope"), "rope_scaling='longrope' is written for step35 only"),
    ],
)
def test_bad_options_are_user_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(MoeprepError, match=message):
        synth_config(**kwargs)


def test_cli_prints_path_and_size(tmp_path: Path) -> None:
    out = tmp_path / "cli.gguf"
    result = CliRunner().invoke(main, ["synth", str(out), "--arch", "glm4moe", "--skew", "0.5", "--layers", "2"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith(str(out)) and "KiB" in result.output
    assert open_gguf(out).get("glm4moe.block_count") == 2
    bad = CliRunner().invoke(main, ["synth", str(out), "--arch", "nope"])
    assert bad.exit_code == 2 and "unknown synthetic architecture" in bad.output
    scaled = CliRunner().invoke(main, ["synth", str(out), "--arch", "step35", "--rope-scaling", "yarn"])
    assert scaled.exit_code == 0, scaled.output
    assert open_gguf(out).get("step35.rope.scaling.type") == "yarn"
