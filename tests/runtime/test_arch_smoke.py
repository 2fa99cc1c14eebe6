"""Every architecture with one residual stream (glm5-next's four: tests/test_glm5_next.py), through what a user runs
besides a plain forward pass: the expert cache (outputs equal the all-resident model, prompt and decode), `moeprep
profile` (counts for exactly the layers that route), batched decode, and greedy generation. Their agreement with
llama.cpp is tests/runtime/test_models.py's.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import moerun
from moeprep.gguf.reader import open_gguf
from moeprep.profile.format import read_profile
from moerun.cache.config import CacheConfig
from moerun.cache.experts import CachedExperts
from tests.runtime.conftest import SMOKE_ARCHS, assert_batched_decode_equals_alone, profile_model

ARCHS = SMOKE_ARCHS
BUDGET = [8 << 30]  # more than the synthetic models need: slots_per_layer sets the slots
PROMPT = "def bisect(a, x):\n    lo, hi = 0, len(a)"


def routed_layers(path) -> list[int]:
    """Layers with a router that the decoder runs, as the file says (ffn_gate_inp; the NextN blocks at the end, which
    it does not run, left out)."""
    from moeprep.gguf.reader import open_gguf

    g = open_gguf(path)
    trunk = int(g.get(f"{g.arch}.block_count")) - int(g.get(f"{g.arch}.nextn_predict_layers", 0))
    layers = (int(t.name.split(".")[1]) for t in g.tensors if t.name.endswith(".ffn_gate_inp.weight"))
    return sorted(layer for layer in layers if layer < trunk)


@pytest.mark.parametrize("arch", ARCHS)
def test_through_the_expert_cache(arch, synth_model):
    path = synth_model(arch, expert_type="F32", attn_type="F32")
    plain = moerun.load_model(path)
    slots = plain.args.n_experts // 2  # room for hits, and misses still
    cached = moerun.load_model(path, cache=CacheConfig(budgets=BUDGET, slots_per_layer=slots))
    layers = [m for m in cached.net.modules() if isinstance(m, CachedExperts)]
    assert [layer.layer for layer in layers] == routed_layers(path)
    prompt = torch.tensor(plain.tokenizer.encode(PROMPT))
    torch.testing.assert_close(cached.forward(prompt), plain.forward(prompt), rtol=1e-4, atol=1e-4)
    for i, token in enumerate([5, 17, 99, 5, 17]):
        pos = len(prompt) + i
        torch.testing.assert_close(
            cached.forward(torch.tensor([token]), pos), plain.forward(torch.tensor([token]), pos), rtol=1e-4, atol=1e-4
        )
    stats = cached.expert_cache.stats
    assert stats.lookups.sum() == (len(prompt) + 5) * plain.args.n_experts_used * len(layers)
    assert 0 < stats.hits.sum() < stats.lookups.sum()


@pytest.mark.parametrize("arch", ARCHS)
def test_profile_counts_the_routed_layers(arch, synth_model, tmp_path):
    path = synth_model(arch, skew=1.0)
    out = tmp_path / "p.moeprof"
    profile_model(path, out)
    counts = read_profile(out).counts
    assert list(counts.layers) == routed_layers(path)
    n_experts_used = moerun.load_model(path).args.n_experts_used
    totals = counts.selections.sum(axis=1)
    assert (totals > 0).all() and len(set(totals.tolist())) == 1 and totals[0] % n_experts_used == 0
    # skew 1: the quarter of the experts the router favours takes most of the choices
    top = np.sort(counts.selections, axis=1)[:, ::-1][:, : counts.selections.shape[1] // 4].sum(axis=1)
    assert (top > totals / 2).all()
    # the warm start takes the profile's hottest experts
    cached = moerun.load_model(path, cache=CacheConfig(budgets=BUDGET, slots_per_layer=2, profile=str(out)))
    for layer in (m for m in cached.net.modules() if isinstance(m, CachedExperts)):
        row = counts.selections[list(counts.layers).index(layer.layer)]
        assert set(layer.resident.tolist()) == set(np.argsort(-row, kind="stable")[:2].tolist())


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_decode_equals_each_sequence_alone(arch, synth_model):
    path = synth_model(arch, expert_type="F32", attn_type="F32")
    assert_batched_decode_equals_alone(path)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generation_follows_the_argmax(arch, synth_model):
    model = moerun.load_model(synth_model(arch, expert_type="F32", attn_type="F32"))
    prompt = model.tokenizer.encode("Once upon a time")
    out = list(moerun.generate(model, prompt, 8, moerun.greedy))
    seq = list(prompt)
    for token in out:
        assert token == int(model.forward(torch.tensor(seq))[-1].argmax())
        seq.append(token)


def test_llama4_with_several_experts_per_token_is_refused(synth_model, tmp_path):
    """Llama 4 scales the expert's input by its router weight, which moerun does for one expert per token only."""
    from gguf import GGUFValueType

    from moeprep.errors import MoeprepError
    from moeprep.gguf.reader import open_gguf
    from moeprep.gguf.writer import KVValue, write_gguf

    path = tmp_path / "two.gguf"
    write_gguf(
        path, open_gguf(synth_model("llama4")), kv_set={"llama4.expert_used_count": KVValue(2, GGUFValueType.UINT32)}
    )
    with pytest.raises(MoeprepError, match="2 experts per token is not supported"):
        moerun.load_model(path)


def test_gemma4_fused_qkv_is_refused_in_one_line(synth_model, tmp_path):
    import dataclasses

    from moeprep.errors import MoeprepError
    from moeprep.gguf.reader import open_gguf
    from moeprep.gguf.writer import copied_tensor, write_gguf

    g = open_gguf(synth_model("gemma4"))
    renamed = {"blk.0.attn_q.weight": "blk.0.attn_qkv.weight"}
    tensors = [dataclasses.replace(copied_tensor(g, t), name=renamed.get(t.name, t.name)) for t in g.tensors]
    write_gguf(tmp_path / "qkv.gguf", g, tensors=tensors)
    with pytest.raises(MoeprepError, match="gemma4 with attn_qkv .projections fused into one tensor"):
        moerun.load_model(tmp_path / "qkv.gguf")


@pytest.mark.parametrize(
    "key,message",
    [
        ("gemma4.embedding_length_per_layer_input", "per-layer token embeddings"),
        ("gemma4.attention.shared_kv_layers", "layers sharing KV caches"),
    ],
)
def test_gemma4_edge_model_features_are_refused(key, message, synth_model, tmp_path):
    """Gemma 4's dense E2B/E4B models' per-layer embeddings and shared KV caches are not run."""
    from gguf import GGUFValueType

    from moeprep.errors import MoeprepError
    from moeprep.gguf.reader import open_gguf
    from moeprep.gguf.writer import KVValue, write_gguf

    path = tmp_path / "edge.gguf"
    write_gguf(path, open_gguf(synth_model("gemma4")), kv_set={key: KVValue(2, GGUFValueType.UINT32)})
    with pytest.raises(MoeprepError, match=message):
        moerun.load_model(path)


def test_ungated_experts_take_one_slot_bank_for_up(synth_model):
    """nemotron_h_moe's experts have no gate: up stands in for it, in the same slots (no second copy uploaded), so
    a slot holds what the cache's plan counted for it (up and down)."""
    path = synth_model("nemotron_h_moe", expert_type="F32", attn_type="F32")
    cached = moerun.load_model(path, cache=CacheConfig(budgets=BUDGET, slots_per_layer=4))
    layers = [m for m in cached.net.modules() if isinstance(m, CachedExperts)]
    assert layers
    for layer in layers:
        assert layer.banks[0] is layer.banks[1] and len(layer.uploads) == 2


def test_smallthinker_without_gating_function_is_refused(synth_model, tmp_path):
    """llama.cpp's smallthinker loader reads no default gating function (its graph aborts without one)."""
    from moeprep.errors import MoeprepError
    from moeprep.gguf.reader import open_gguf
    from moeprep.gguf.writer import write_gguf

    path = tmp_path / "no-gating.gguf"
    write_gguf(path, open_gguf(synth_model("smallthinker")), kv_remove=["smallthinker.expert_gating_func"])
    with pytest.raises(MoeprepError, match="smallthinker.expert_gating_func is missing"):
        moerun.load_model(path)


@pytest.mark.parametrize("key", ["attention.sliding_window", "attention.sliding_window_pattern"])
def test_step35_without_its_sliding_window_keys_is_refused(key, synth_model, tmp_path):
    """llama.cpp's step35 loader requires the window and the per-layer pattern; so does moerun, in one line."""
    from moeprep.errors import MoeprepError
    from moeprep.gguf.reader import open_gguf
    from moeprep.gguf.writer import write_gguf

    path = tmp_path / "no-window.gguf"
    write_gguf(path, open_gguf(synth_model("step35")), kv_remove=[f"step35.{key}"])
    with pytest.raises(MoeprepError, match="step35 needs attention.sliding_window and a per-layer"):
        moerun.load_model(path)


@pytest.mark.parametrize("arch", ["step35", "qwen3moe"])
def test_an_unknown_rope_scaling_is_refused(arch, synth_model, tmp_path):
    """A rope.scaling.type llama.cpp does not know (its loader stops on it) is refused in one line, exit code 2."""
    from click.testing import CliRunner
    from gguf import GGUFValueType

    from moeprep.gguf.reader import open_gguf
    from moeprep.gguf.writer import KVValue, write_gguf
    from moerun.cli import main
    from tests.runtime.test_cli import _assert_one_line_error

    path = tmp_path / "dynamic.gguf"
    kv = {f"{arch}.rope.scaling.type": KVValue("dynamic", GGUFValueType.STRING)}
    write_gguf(path, open_gguf(synth_model(arch)), kv_set=kv)
    result = CliRunner().invoke(main, ["run", "-m", str(path), "-p", "hi", "-n", "1", "--device", "cpu"])
    _assert_one_line_error(result, "unknown rope.scaling.type 'dynamic'; llama.cpp knows none, linear, yarn, longrope")


def test_smallthinker_without_sliding_window_matches_llama_cpp(synth_model, calibration_text, tmp_path):
    """The variant without attention.sliding_window: every layer full attention with RoPE (the synthetic file's
    layer 0 has none in the sliding-window variant, so a leftover NoPE layer shows)."""
    from moeprep.gguf.reader import open_gguf
    from moeprep.gguf.writer import write_gguf
    from tests.oracle import llama_eval

    path = tmp_path / "full.gguf"
    src = synth_model("smallthinker", expert_type="F32", attn_type="F32")
    write_gguf(path, open_gguf(src), kv_remove=["smallthinker.attention.sliding_window"])
    model = moerun.load_model(path)
    assert not any(model.args.swa_layers) and model.args.sliding_window == 0
    tokens = model.tokenizer.encode(calibration_text)[:64]
    ours, ref = model.forward(torch.tensor(tokens)).numpy(), llama_eval(path, tokens).logits
    sliding = moerun.load_model(src).forward(torch.tensor(tokens)).numpy()
    assert np.abs(sliding - ref).max() > 1e-2 * np.abs(ref).max()  # the two variants differ
    assert np.abs(ours - ref).max() <= 1e-3 * np.abs(ref).max()


def test_lfm2moe_without_gating_function_is_refused(synth_model, tmp_path):
    """llama.cpp's lfm2moe loader requires expert_gating_func; moerun refuses such a file in one line too."""
    from moeprep.errors import MoeprepError
    from moeprep.gguf.reader import open_gguf
    from moeprep.gguf.writer import write_gguf

    path = tmp_path / "no-gating.gguf"
    write_gguf(path, open_gguf(synth_model("lfm2moe")), kv_remove=["lfm2moe.expert_gating_func"])
    with pytest.raises(MoeprepError, match="lfm2moe.expert_gating_func is missing"):
        moerun.load_model(path)


def assert_refused_without(src, missing: str, tmp_path) -> None:
    """`src` (an open GGUF) written again without tensor `missing`: moerun refuses the file in one line naming it."""
    from moeprep.errors import MoeprepError
    from moeprep.gguf.writer import copied_tensor, write_gguf

    assert missing in {t.name for t in src.tensors}
    path = tmp_path / "incomplete.gguf"
    write_gguf(path, src, tensors=[copied_tensor(src, t) for t in src.tensors if t.name != missing])
    with pytest.raises(MoeprepError, match=f"tensor {re.escape(missing)} is missing") as refused:
        moerun.load_model(path)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("norm", ["attn_q_norm", "attn_k_norm"])
def test_lfm2moe_without_its_qk_norms_is_refused(norm, synth_model, tmp_path):
    """llama.cpp's lfm2 loader requires both per-head norms on every attention layer; moerun refuses a file missing
    one in one line instead of running that layer without it."""
    src = open_gguf(synth_model("lfm2moe"))
    attention = next(i for i, n in enumerate(moerun.load_model(src.path).args.kv_heads_by_layer) if n)
    missing = f"blk.{attention}.{norm}.weight"
    assert_refused_without(src, missing, tmp_path)


def test_kimi_k3_without_its_output_gate_is_refused_by_name(synth_model, tmp_path):
    """Kimi-K3's KDA layers have one full-rank output gate ssm_g (llama.cpp's loader requires it); a file without it
    is refused naming that tensor, not glm5-next's low-rank ssm_g_a the file never had."""
    src = open_gguf(synth_model("kimi-k3"))
    kda = next(i for i, n in enumerate(moerun.load_model(src.path).args.kv_heads_by_layer) if n == 0)
    missing = f"blk.{kda}.ssm_g.weight"
    assert_refused_without(src, missing, tmp_path)


@pytest.mark.parametrize("arch", ["lfm2moe", "laguna", "qwen3moe"])
def test_gated_experts_without_their_gate_are_refused(arch, synth_model, tmp_path):
    """Gated experts (SwiGLU) read ffn_gate_exps; a file without it is refused in one line naming it, as llama.cpp's
    loaders do, instead of running the up rows in the gate's place (only Nemotron-H's ungated experts do that)."""
    src = open_gguf(synth_model(arch))
    missing = next(t.name for t in src.tensors if t.name.endswith(".ffn_gate_exps.weight"))
    assert_refused_without(src, missing, tmp_path)


@pytest.mark.parametrize(
    "arch",
    ["lfm2moe", "laguna", "kimi-k3", "deepseek4", "glm4moe", "minimax-m2", "afmoe", "glm5-next", "nemotron_h_moe"],
)
def test_router_without_its_selection_bias_is_refused(arch, synth_model, tmp_path):
    """These architectures' llama.cpp loaders require exp_probs_b on every routed layer; a file without it is refused
    in one line naming it instead of routing without the bias."""
    src = open_gguf(synth_model(arch))
    missing = next(t.name for t in src.tensors if t.name.endswith(".exp_probs_b.bias"))
    assert_refused_without(src, missing, tmp_path)


@pytest.mark.parametrize("norm", ["attn_q_norm", "attn_k_norm"])
def test_laguna_without_its_qk_norms_is_refused(norm, synth_model, tmp_path):
    """llama.cpp's laguna loader requires both per-head norms on every layer; moerun refuses a file missing one in
    one line instead of running that layer without it."""
    src = open_gguf(synth_model("laguna"))
    missing = f"blk.1.{norm}.weight"
    assert_refused_without(src, missing, tmp_path)


@pytest.mark.parametrize("norm", ["attn_q_norm", "attn_k_norm"])
@pytest.mark.parametrize("arch", ["qwen3moe", "olmoe", "minimax-m2", "dots1", "bailingmoe2", "afmoe"])
def test_attention_without_its_qk_norms_is_refused(arch, norm, synth_model, tmp_path):
    """These architectures' llama.cpp loaders require attn_q_norm and attn_k_norm on every attention layer; a file
    missing one is refused in one line naming it instead of running that layer without it."""
    src = open_gguf(synth_model(arch))
    missing = next(t.name for t in src.tensors if t.name.endswith(f".{norm}.weight"))
    assert_refused_without(src, missing, tmp_path)


@pytest.mark.parametrize(
    "arch",
    [
        "step35",
        "kimi-k3",
        "deepseek4",
        "qwen2moe",
        "olmoe",
        "gpt-oss",
        "minimax-m2",
        "dots1",
        "bailingmoe2",
        "mimo2",
        "glm5-next",
    ],
)
def test_file_without_its_output_head_is_refused(arch, synth_model, tmp_path):
    """These architectures' llama.cpp loaders require output.weight (no tied-embedding fallback); a file without it
    is refused in one line instead of running token_embd as the head."""
    src = open_gguf(synth_model(arch))
    assert_refused_without(src, "output.weight", tmp_path)


@pytest.mark.parametrize(
    "arch, missing",
    [
        # the Mamba-2 mixers' convolution bias
        ("granitehybrid", "blk.0.ssm_conv1d.bias"),
        ("nemotron_h_moe", "blk.0.ssm_conv1d.bias"),
        # a shared expert the file's keys announce (expert_shared_feed_forward_length, expert_shared_count)
        ("ernie4_5-moe", "blk.1.ffn_up_shexp.weight"),
        ("afmoe", "blk.1.ffn_gate_shexp.weight"),
        # a router on every layer of a model with experts, and the full layers' RoPE frequency divisors
        ("gemma4", "blk.1.ffn_gate_inp.weight"),
        ("gemma4", "rope_freqs.weight"),
        # gpt-oss's biases and sinks
        ("gpt-oss", "blk.0.attn_output.bias"),
        ("gpt-oss", "blk.0.attn_sinks.weight"),
        ("gpt-oss", "blk.0.ffn_gate_inp.bias"),
        ("gpt-oss", "blk.0.ffn_gate_exps.bias"),
        ("gpt-oss", "blk.0.ffn_up_exps.bias"),
        ("gpt-oss", "blk.0.ffn_down_exps.bias"),
    ],
)
def test_file_without_a_tensor_llama_cpp_requires_is_refused(arch, missing, synth_model, tmp_path):
    """Tensors the shared loaders read where present (or whose presence chose a layer's parts) that these
    architectures' llama.cpp loaders require: a file without one is refused in one line naming it, instead of running
    without it (a zero bias, no sinks, no shared expert, a dense layer in place of a routed one, plain RoPE)."""
    src = open_gguf(synth_model(arch))
    assert missing in {t.name for t in src.tensors}
    assert_refused_without(src, missing, tmp_path)


@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss", "gemma4", "lfm2moe"])
def test_file_without_its_final_norm_is_refused_naming_it(arch, synth_model, tmp_path):
    """A file without its final norm is refused naming the tensor it lacks: output_norm, or LFM2's token_embd_norm
    (not LFM2's name for every architecture)."""
    src = open_gguf(synth_model(arch))
    missing = next(t.name for t in src.tensors if t.name in ("output_norm.weight", "token_embd_norm.weight"))
    assert_refused_without(src, missing, tmp_path)


def test_laguna_layouts(synth_model):
    """XS.2's layout: a full-attention layer first in every four, the sliding ones with twice its query heads, their
    own RoPE (plain, over rope.dimension_count_swa channels) and a gate value per head; M.1's: every layer full, one
    head count, a gate value per channel."""
    xs2 = moerun.load_model(synth_model("laguna"))
    a = xs2.args
    assert a.swa_layers == (False, True, True, True, False) and a.heads_by_layer == (4, 8, 8, 8, 4)
    attns = [block.attn.attn for block in xs2.net.blocks]
    assert [attn.gate.per_head for attn in attns] == [True] * 5
    assert [attn.window for attn in attns] == [0, a.sliding_window, a.sliding_window, a.sliding_window, 0]
    assert attns[0].rope.dim == a.rope_dim < attns[1].rope.dim == a.rope_dim_swa == a.head_dim
    m1 = moerun.load_model(synth_model("laguna", sliding_window=0))
    assert not any(m1.args.swa_layers) and set(m1.args.heads_by_layer) == {m1.args.n_heads}
    assert all(not block.attn.attn.gate.per_head and block.attn.attn.window == 0 for block in m1.net.blocks)


def test_laguna_sliding_window_pattern_key_matches_llama_cpp(synth_model, calibration_text, tmp_path):
    """A file's attention.sliding_window_pattern overrides the period of 4: with 2, layers 0, 2 and 4 are full (layer
    2 keeping its 8 query heads: the per-layer head_count, not the layer's kind, sets them)."""
    from gguf import GGUFValueType

    from moeprep.gguf.reader import open_gguf
    from moeprep.gguf.writer import KVValue, write_gguf
    from tests.oracle import llama_eval

    src = synth_model("laguna", expert_type="F32", attn_type="F32")
    g = open_gguf(src)
    path = tmp_path / "period2.gguf"
    pattern = {"laguna.attention.sliding_window_pattern": KVValue(2, GGUFValueType.UINT32)}
    write_gguf(path, g, kv_set=pattern)
    model = moerun.load_model(path)
    assert model.args.swa_layers == (False, True, False, True, False)
    tokens = model.tokenizer.encode(calibration_text)[:64]
    ours, ref = model.forward(torch.tensor(tokens)).numpy(), llama_eval(path, tokens).logits
    assert np.abs(ours - ref).max() <= 1e-3 * np.abs(ref).max()


def test_laguna_gate_of_another_width_is_refused_in_one_line(synth_model, tmp_path):
    """llama.cpp aborts on an attn_gate whose rows are neither the heads nor the channels; moerun names both."""
    from gguf import GGMLQuantizationType

    from moeprep.errors import MoeprepError
    from moeprep.gguf.reader import open_gguf
    from moeprep.gguf.writer import OutputTensor, copied_tensor, write_gguf

    g = open_gguf(synth_model("laguna", expert_type="F32", attn_type="F32"))
    tensors = [copied_tensor(g, t) for t in g.tensors]
    at = next(i for i, t in enumerate(tensors) if t.name == "blk.0.attn_gate.weight")
    odd = np.zeros((3, tensors[at].shape[1]), np.float32)
    tensors[at] = OutputTensor(tensors[at].name, GGMLQuantizationType.F32, odd.shape, lambda: [odd.tobytes()])
    write_gguf(tmp_path / "odd-gate.gguf", g, tensors=tensors)
    with pytest.raises(MoeprepError, match=r"blk\.0\.attn_gate\.weight has 3 rows; .* per head \(4\) or .* \(64\)"):
        moerun.load_model(tmp_path / "odd-gate.gguf")


@pytest.mark.parametrize("key", ["attn_res.block_size", "activation.situ_beta", "kda.head_dim"])
def test_kimi_k3_without_its_keys_is_refused(key, synth_model, tmp_path):
    """llama.cpp's kimi-k3 loader requires the residual-attention block size, the situ betas and the KDA head size;
    so does moerun, in one line naming the key."""
    from moeprep.errors import MoeprepError
    from moeprep.gguf.reader import open_gguf
    from moeprep.gguf.writer import write_gguf

    path = tmp_path / "no-key.gguf"
    write_gguf(path, open_gguf(synth_model("kimi-k3")), kv_remove=[f"kimi-k3.{key}"])
    with pytest.raises(MoeprepError, match=f"kimi-k3.{key}"):
        moerun.load_model(path)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_prompt_chunk_riding_with_decode_tokens_through_the_expert_cache(arch, synth_model):
    """One pass holding a prompt chunk of sequence 1, then decode tokens of sequences 2 and 0 (what the server runs
    while a prompt is prefilled), the routed experts through the expert cache: each sequence's logits equal the
    all-resident model's run alone, and the cache sees every token once per routed layer."""
    path = synth_model(arch, expert_type="F32", attn_type="F32")
    alone = moerun.load_model(path)
    cache = CacheConfig(budgets=BUDGET, slots_per_layer=alone.args.n_experts // 2)
    cached = moerun.load_model(path, n_seq=3, cache=cache)
    first, second, third = (alone.tokenizer.encode(p) for p in (PROMPT, "Once upon a time, in a land", "SELECT *"))
    expected = [alone.forward(torch.tensor(p))[-1] for p in (first + [17], second, third + [40])]
    cached.forward(torch.tensor(first), 0, seq=0)
    cached.forward(torch.tensor(third), 0, seq=2)
    before = cached.expert_cache.stats.lookups.sum()
    tokens = torch.tensor(second + [40, 17])
    positions = torch.tensor(list(range(len(second))) + [len(third), len(first)])
    seqs = torch.tensor([1] * len(second) + [2, 0])
    rows = torch.tensor([len(second) + 1, len(second) - 1, len(second)])  # sequences 0, 1, 2
    got = cached.forward_batch(tokens, positions, seqs, outputs=rows)
    torch.testing.assert_close(got, torch.stack(expected), rtol=1e-4, atol=1e-4)
    n_routed = sum(isinstance(m, CachedExperts) for m in cached.net.modules())
    assert cached.expert_cache.stats.lookups.sum() - before == len(tokens) * alone.args.n_experts_used * n_routed


@pytest.mark.parametrize("arch", ["gpt-oss", "afmoe", "laguna", "smallthinker", "gemma4", "mimo2", "step35"])
def test_inspect_names_the_sliding_blocks_moerun_builds(arch, synth_model):
    """`moeprep inspect` reads the sliding blocks from the arch's rule (moeprep/gguf/arch_table.py's WINDOW_RULES);
    moerun builds them from its arch module's: both give the same blocks."""
    from moeprep.gguf.anatomy import model_geometry
    from moeprep.gguf.reader import open_gguf
    from moerun.models import arch_module

    g = open_gguf(synth_model(arch, n_layer=8))
    args = arch_module(g.arch).read_args(g)
    windows = model_geometry(g).windows
    sliding = next(blocks for kind, blocks in windows.items() if kind.startswith("sliding"))
    assert sliding == [layer for layer, slides in enumerate(args.swa_layers) if slides]
    assert f"sliding {args.sliding_window}" in windows
