"""The benchmark workload: the bench-60g shape, and routing that follows the text with real skew and reuse."""

from __future__ import annotations

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
    plain = planned_tensors(synth_config("qwen3moe"))[0]
    assert [type(t.init).__name__ for t in plain][:1] == ["Embedding"]  # the default draws as before


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


def test_scaled_down_model_routes_with_real_statistics(tmp_path: Path) -> None:
    """moeprep profile over held-out text: the hottest 10% of the experts take 25-50% of the selections and
    30-45% of a token's experts are selected again by the next token, in every layer (uniform routing: 10%, 6%)."""
    from moeprep.profile.dataset import DatasetSpec
    from moeprep.profile.run import ProfileRequest, profile_model

    path = write_synth_model(tmp_path / "scaled.gguf", **SCALED)
    p = profile_model(ProfileRequest(path, DatasetSpec(str(HELDOUT)), ctx=512, tokens=2048, holdout=0))
    top = hot_share(p.counts.selections)
    reuse = next_token_reuse(p.trace.ids, p.trace.starts)
    assert p.counts.tokens.min() == 2048
    assert ((0.25 <= top) & (top <= 0.50)).all(), top
    assert ((0.30 <= reuse) & (reuse <= 0.45)).all(), reuse
