"""The policy bench's state oracle, a cache that ranks experts by the router's hidden state (what bounds any policy
that sees only the choices), and its seeded replay. The hidden state comes with the same trace `generate` writes;
the oracle's ranking and hits, and a seeded cache's, are checked on hand-made states and traces."""

from __future__ import annotations

import numpy as np
import pytest

from bench.bench_cache_policy import StateOracle, seeded_rates, state_oracle_rates
from moeprep.errors import MoeprepError
from moeprep.profile.policy import make_policy, replay
from moeprep.profile.regimes import Hidden, Latent, Shape, generate, generate_with_hidden
from moeprep.profile.tracefile import TraceFile

# context 2, persistence 0.5: the expected logit `ahead` tokens on is 2 * 0.5**ahead * <u, c> + b
PLAIN = Latent(rho=0.5, context=2.0, token=0.0, noise=0.0, popularity=0.0)


def hand_hidden(states: np.ndarray) -> Hidden:
    """One layer of three experts in two dimensions: expert 0 along the first axis, 1 along the second, 2 against
    the first; expert 1 has an offset of 0.25."""
    directions = np.array([[[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]]])
    return Hidden(PLAIN, states, directions, np.array([[0.0, 0.25, 0.0]]))


@pytest.mark.parametrize("name", ["qwen3-30b", "chat-glm"])
def test_the_hidden_state_comes_with_the_same_trace(name: str) -> None:
    shape = Shape(2, 64, 4)
    t, hidden = generate_with_hidden(name, shape, 300, 100, seed=3)
    plain = generate(name, shape, 300, 100, seed=3)
    assert (t.ids == plain.ids).all() and (t.weights == plain.weights).all()
    assert hidden.states.shape == (300, 16) and hidden.directions.shape == (2, 64, 16)
    assert np.allclose(np.linalg.norm(hidden.directions, axis=2), 1.0) and hidden.offsets.shape == (2, 64)


def test_recorded_routing_has_no_hidden_state() -> None:
    with pytest.raises(MoeprepError, match="no hidden state"):
        generate_with_hidden("trained", Shape(6, 32, 4), 64, 64)


def test_expected_logits() -> None:
    hidden = hand_hidden(np.array([[1.0, 0.0]]))
    # one token on: 2 * 0.5 * <u, (1, 0)> + b = 1, 0.25, -1; two on: 0.5, 0.25, -0.5
    assert np.allclose(hidden.expected_logits(0, hidden.states, 1), [[1.0, 0.25, -1.0]])
    assert np.allclose(hidden.expected_logits(0, hidden.states, 2), [[0.5, 0.25, -0.5]])


def test_state_oracle_keeps_what_the_state_favours() -> None:
    """One slot, one expert per token, the state pointing along expert 0 throughout. Stream 1 0 1 0 2 0: LRU
    holds the last expert, which never comes next (no hits). The oracle fills the empty slot with 1, takes 0 over
    it (expected logit 1 against 0.25), keeps 0 against 1 and 2: hits at tokens 3 and 5."""
    stream = np.array([1, 0, 1, 0, 2, 0])
    states = np.tile([1.0, 0.0], (len(stream), 1))
    ids = stream[None, :, None]  # [B, T, K]
    oracle = StateOracle([1], 3, 1, hand_hidden(states), [0], states[None], ahead=1)
    assert replay(oracle, ids).hits[0].tolist() == [0, 0, 0, 1, 0, 1]
    assert replay(make_policy("lru", [1], 3, 1), ids).hits.sum() == 0


def test_state_oracle_follows_the_state() -> None:
    """Stream 1 0 1 0 2 2 with the state turning to expert 2's side at token 4: the oracle keeps 0 while the
    state favours it (hit at token 3), then takes 2 over it (logit 1 against -1): hit at token 5."""
    stream = np.array([1, 0, 1, 0, 2, 2])
    states = np.array([[1.0, 0.0]] * 4 + [[-1.0, 0.0]] * 2)
    ids = stream[None, :, None]
    oracle = StateOracle([1], 3, 1, hand_hidden(states), [0], states[None], ahead=1)
    assert replay(oracle, ids).hits[0].tolist() == [0, 0, 0, 1, 0, 1]


def test_state_oracle_rates_count_warm_tokens_of_every_chunk() -> None:
    """Two chunks of 70 tokens, each choosing experts 1 and 2 by turns for 64 tokens, then 0 six times, the state
    along expert 0 throughout. Only the last six tokens of each chunk count: 0 misses once, then hits (5 of 6), with
    one slot (0 takes it from 1) as with three (0 takes the empty one). Counted from the first token, one slot would
    hit 1 at every other token and three slots everything after the first two. Eight tokens ahead the state has
    faded (0's expected logit 2 * 0.5**8 = 0.008) below 1's offset of 0.25: one slot keeps 1 and never hits."""
    n = 70
    chunk = np.concatenate([np.tile([1, 2], 32), np.zeros(6, np.int64)])
    ids = np.concatenate([chunk, chunk])[:, None, None]
    t = TraceFile(ids, np.array([0, n, 2 * n]), 3)
    hidden = hand_hidden(np.tile([1.0, 0.0], (2 * n, 1)))
    rates = state_oracle_rates(t, hidden, sizes=(0.34, 1.0), horizons=(1, 8))
    assert np.allclose(rates, [[5 / 6, 5 / 6], [0.0, 5 / 6]])


def test_seeded_rates_seed_each_chunk_with_the_other_chunks() -> None:
    """LFU with one slot of three experts. Chunk 0: expert 0 for 64 tokens, then 1 1 1 1 0 0; chunk 1: expert 1 for
    70 tokens. Seeded from chunk 1, chunk 0 starts with 1 weighing 256 uses, which 0's 64 never pass: warm hits
    at the four 1s. Seeded from chunk 0 (0: 66 uses, 1: 4, so 241 and 15 seeded), chunk 1 keeps 0 throughout: no
    hits. (Unseeded, chunk 0 would keep 0 and hit the last two, chunk 1 keep 1 and hit all six.)"""
    chunk0 = np.concatenate([np.zeros(64, np.int64), [1, 1, 1, 1, 0, 0]])
    ids = np.concatenate([chunk0, np.ones(70, np.int64)])[:, None, None]
    t = TraceFile(ids, np.array([0, 70, 140]), 3)
    assert np.allclose(seeded_rates(t, "lfu", sizes=(0.34,)), [4 / 12])
