"""The benchmark workload: the bench-60g shape, its routing by the qwen3-30b regime built into the weights, and the
token-id routing kept beside it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from moeprep.errors import MoeprepError
from moeprep.synth import synth_config, tensor_data_size, write_synth_model
from moeprep.synth.model import planned_tensors
from moeprep.synth.routing import hot_share, next_token_reuse, token_directions
from moeprep.synth.tokenizer import TOKENIZER_PATH

HELDOUT = Path(__file__).resolve().parents[1] / "bench" / "data" / "heldout.txt"
# bench-60g's construction, scaled down: same preset (types, experts, top-k, routing), few layers, small dims
SCALED = dict(
    preset="bench-60g",
    n_layer=4,
    n_embd=256,
    n_head=4,
    n_head_kv=2,
    head_dim=64,
    n_ff_exp=64,
    n_vocab=2048,
    n_ctx=1024,
    fast_random_blocks=True,
    routing="token-id",
)
# the same for the regime construction: 2 MoE layers (every layer reads the same context; more only add samples),
# 4 kv heads (it takes three kinds of attention head)
REGIME_SCALED = dict(
    preset="bench-60g",
    n_layer=2,
    n_embd=256,
    n_head=8,
    n_head_kv=4,
    head_dim=64,
    n_ff_exp=32,
    n_vocab=2048,
    n_ctx=1024,
    fast_random_blocks=True,
)


def test_bench_60g_shape() -> None:
    c = synth_config("qwen3moe", preset="bench-60g", fast_random_blocks=True)
    assert (c.n_layer, c.n_embd, c.n_head, c.n_head_kv, c.head_dim) == (46, 4096, 32, 4, 128)
    assert (c.n_expert, c.n_expert_used, c.n_ff_exp, c.n_vocab, c.n_dense_lead) == (128, 8, 1408, 32000, 0)
    tensors, types = planned_tensors(c)
    kinds = {
        t.name.split(".")[-2] if t.name.startswith("blk.") else t.name.split(".")[0]: q for t, q in zip(tensors, types)
    }
    assert kinds["ffn_gate_exps"] == kinds["ffn_up_exps"] == Q.Q4_K and kinds["ffn_down_exps"] == Q.Q4_0
    assert kinds["attn_q"] == kinds["attn_output"] == Q.Q8_0 and kinds["output"] == Q.Q8_0
    assert kinds["token_embd"] == Q.F16
    expert = sum(int(np.prod(t.shape[1:])) for t in tensors if t.name.startswith("blk.0.ffn_") and "exps" in t.name)
    assert expert == 3 * 1408 * 4096
    per_expert = 2 * 1408 * 4096 // 256 * 144 + 4096 * 1408 // 32 * 18  # Q4_K gate/up, Q4_0 down
    assert per_expert == 9_732_096 and round(per_expert / 2**20, 2) == 9.28
    assert 59e9 < tensor_data_size(c) < 61e9


def test_routing_option() -> None:
    with pytest.raises(MoeprepError, match="routing must be one of"):
        synth_config("qwen3moe", routing="semantic")
    with pytest.raises(MoeprepError, match="routing by a regime is built for qwen3moe"):
        synth_config("deepseek2", preset="small", routing="qwen3-30b")
    with pytest.raises(MoeprepError, match="3 or more kv heads"):
        synth_config("qwen3moe", **{**REGIME_SCALED, "n_head_kv": 2})
    plain = planned_tensors(synth_config("qwen3moe"))[0]
    assert [type(t.init).__name__ for t in plain][:1] == ["Embedding"]  # the default draws as before
    for preset in ("bench-60g", "qwen3-30b-a3b"):  # the bench models' presets route by the qwen3-30b regime
        assert synth_config("qwen3moe", preset=preset).routing == "qwen3-30b"


def test_token_directions_put_neighbours_together() -> None:
    """Consecutive tokens of held-out text (never used to build the directions) point much closer together
    than random pairs of tokens."""
    from tokenizers import Tokenizer

    d = token_directions()
    assert d is token_directions()  # built once per process
    norms = np.linalg.norm(d, axis=1)
    assert np.allclose(norms[norms > 0], 1.0) and (norms > 0).mean() > 0.8
    ids = np.array(Tokenizer.from_file(str(TOKENIZER_PATH)).encode(HELDOUT.read_text()[:200_000]).ids)
    ids = ids[norms[ids] > 0]
    neighbours = (d[ids[:-1]] * d[ids[1:]]).sum(axis=1).mean()
    shuffled = np.random.default_rng(0).permutation(ids)
    strangers = (d[shuffled[:-1]] * d[shuffled[1:]]).sum(axis=1).mean()
    assert neighbours > strangers + 0.2, (neighbours, strangers)


def test_token_id_routing_statistics(tmp_path: Path) -> None:
    """token-id routing, moeprep profile over held-out text: the hottest 10% of the experts take 25-50% of the
    selections and 30-45% of a token's experts are selected again by the next token, in every layer (uniform
    routing: 10%, 6%)."""
    from moeprep.profile.dataset import DatasetSpec
    from moeprep.profile.run import ProfileRequest, profile_model

    path = write_synth_model(tmp_path / "scaled.gguf", **SCALED)
    p = profile_model(ProfileRequest(path, DatasetSpec(str(HELDOUT)), ctx=512, tokens=2048, holdout=0))
    top = hot_share(p.counts.selections)
    reuse = next_token_reuse(p.trace.ids, p.trace.starts)
    assert p.counts.tokens.min() == 2048
    assert ((0.25 <= top) & (top <= 0.50)).all(), top
    assert ((0.30 <= reuse) & (reuse <= 0.45)).all(), reuse


def test_context_layer_kernels() -> None:
    """The context layer's three kinds of head, as the runtime's NeoX rotary and Q/K norm compute them: the short
    average's weights fall off over about its window, the long one's over ten times that, and the previous-token
    heads put most of their weight one position back."""
    from moeprep.synth.context_routing import LONG, PREVIOUS, SHORT, ContextLayer

    d, base, n = 64, 1e6, 1024
    layer = ContextLayer.build(base, d, 64.0, n)
    theta = base ** (-np.arange(0, d, 2) / d)

    def rotate(x: np.ndarray, pos: int) -> np.ndarray:
        c, s = np.cos(pos * theta), np.sin(pos * theta)
        return np.concatenate([x[: d // 2] * c - x[d // 2 :] * s, x[: d // 2] * s + x[d // 2 :] * c])

    def weights(kind: int) -> np.ndarray:  # [n] over keys 0..n-1 positions back of the last query
        q, k = np.sqrt(d) * layer.query[kind] * layer.norm, np.sqrt(d) * layer.key[kind] * layer.norm
        scores = np.array([rotate(q, n - 1) @ rotate(k, j) for j in range(n)]) / np.sqrt(d)
        w = np.exp(scores - scores.max())[::-1]
        return w / w.sum()

    lags = np.arange(n)
    short, long, previous = weights(SHORT), weights(LONG), weights(PREVIOUS)
    assert 40 < short @ lags < 100 and short[:256].sum() > 0.97
    assert 250 < long @ lags < 550
    assert previous[1] > 0.75 and previous[1] > 10 * max(previous[0], previous[2])


@pytest.mark.parametrize("name", ["qwen3-30b", "fine-512", "skewed-256"])
def test_scaled_model_meets_its_regime(name: str, tmp_path: Path) -> None:
    """bench-60g's construction scaled down, at the regime's expert count and top-k, profiled by moeprep on 8192
    tokens of held-out text in chunks of 1024 (the regime's own trace length): `moeprep routing stats` on the
    profile meets every target of the regime (moeprep/profile/regimes.py), each at least a point inside its range,
    in every layer as well as overall. Random routers on the same model (routing="random") fail them."""
    from moeprep.profile.dataset import DatasetSpec
    from moeprep.profile.regimes import check_targets, regime
    from moeprep.profile.run import ProfileRequest, profile_model
    from moeprep.profile.tracefile import trace_from_profile

    r = regime(name)
    shape = dict(REGIME_SCALED, n_expert=r.shape.experts, n_expert_used=r.shape.top_k, routing=name)
    path = write_synth_model(tmp_path / "regime.gguf", **shape)
    p = profile_model(ProfileRequest(path, DatasetSpec(str(HELDOUT)), ctx=1024, tokens=8192, holdout=0))
    trace = trace_from_profile(p, str(path))
    assert (trace.n_tokens, trace.n_chunks, trace.n_expert, trace.top_k) == (8192, 8, r.shape.experts, r.shape.top_k)
    for layer in range(trace.n_layers):
        one = dataclasses.replace(trace, ids=trace.ids[:, layer : layer + 1], weights=None)
        for check in check_targets(r, one):
            low, high = check.target.low, check.target.high
            assert low + 0.01 <= check.value <= high - 0.01, (layer, check.target.describe(), check.value)

    plain = write_synth_model(tmp_path / "random.gguf", **{**shape, "routing": "random"})
    q = profile_model(ProfileRequest(plain, DatasetSpec(str(HELDOUT)), ctx=1024, tokens=2048, holdout=0))
    assert not all(c.met for c in check_targets(r, trace_from_profile(q, str(plain))))


def test_llama_cpp_routes_the_regime_model_as_moerun(tmp_path: Path) -> None:
    """The regime is weights only: llama.cpp, running the model as any qwen3moe, picks the experts moerun picks
    (the context comes from its own attention and rotary), but for rare flips of near-equal logits."""
    import torch

    from moerun.model import load_model
    from tests.oracle import llama_eval, llama_tokenize

    path = write_synth_model(tmp_path / "regime.gguf", **REGIME_SCALED)
    tokens = llama_tokenize(path, HELDOUT.read_text()[:4000])[:384]
    ref = llama_eval(path, tokens).experts(REGIME_SCALED["n_layer"])
    model = load_model(path)
    ours = {}
    handle = model.add_routing_hook(lambda ev: ours.__setitem__(ev.layer, ev.expert_ids.numpy().copy()))
    with torch.inference_mode():
        model.forward(torch.tensor(tokens), start_pos=0)
    handle.remove()
    for layer, ids in ours.items():
        same = (np.sort(ids, axis=1)[:, :, None] == np.sort(ref[layer], axis=1)[:, None, :]).any(axis=2).mean()
        assert same > 0.97, (layer, same)


def test_cli_routing_option(tmp_path: Path) -> None:
    """`moeprep synth --routing`: a choice among the routings; a regime the shape cannot carry is one line, exit 2,
    and no file."""
    from click.testing import CliRunner

    from moeprep.cli import main

    out = tmp_path / "token-id.gguf"
    r = CliRunner().invoke(main, ["synth", str(out), "--preset", "small", "--routing", "token-id"])
    assert r.exit_code == 0 and out.exists(), r.output
    bad = tmp_path / "regime.gguf"
    r = CliRunner().invoke(main, ["synth", str(bad), "--preset", "small", "--routing", "qwen3-30b"])
    assert r.exit_code == 2 and "3 or more kv heads" in r.output and "Traceback" not in r.output, r.output
    assert not bad.exists()
    r = CliRunner().invoke(main, ["synth", str(bad), "--routing", "text"])
    assert r.exit_code == 2 and "token-id" in r.output
