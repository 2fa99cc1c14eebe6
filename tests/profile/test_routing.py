"""Routing regimes, trace files and `moeprep routing`: every regime's generated trace meets its targets at its own
shape, with reuse that comes from context; the trace file round-trips and refuses damage; ClassLRU keeps a busy
expert through a burst of one-off ones."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from moeprep.cli import main
from moeprep.errors import MoeprepError
from moeprep.profile.format import write_profile
from moeprep.profile.policy import make_policy, replay
from moeprep.profile.regimes import (
    REGIMES,
    TRAINED_SHAPE,
    TRAINED_TRACE,
    Shape,
    check_targets,
    generate,
    target_shape_trace,
)
from moeprep.profile.routing_stats import reuse, routing_stats
from moeprep.profile.tracefile import TraceFile, read_trace, trace_from_profile, write_trace
from moeprep.routing_cli import REGIME_NAMES

MARGIN = 0.005  # a measured value must clear its target's edges by half a point: not a near-tie


def test_cli_names_every_regime() -> None:
    assert REGIME_NAMES == list(REGIMES)


@pytest.mark.parametrize("name", list(REGIMES))
def test_generated_trace_meets_its_regimes_targets(name: str) -> None:
    r = REGIMES[name]
    checks = check_targets(r, target_shape_trace(r))
    assert len(checks) == len(r.targets)
    for c in checks:
        assert c.target.low + MARGIN <= c.value <= c.target.high - MARGIN, (c.target.describe(), c.value)


@pytest.mark.parametrize("name", ["qwen3-30b", "chat-glm"])
def test_reuse_comes_from_context_not_token_identity(name: str) -> None:
    """Shuffling the tokens of a chunk keeps every token's choice (its identity and all) but breaks the context's
    order: the next-token reuse must fall to near what popularity alone gives."""
    r = REGIMES[name]
    t = generate(name, Shape(4, r.shape.experts, r.shape.top_k), 4096, 1024)
    shuffled = t.ids.copy()
    rng = np.random.default_rng(0)
    for c in range(t.n_chunks):
        a, b = t.starts[c], t.starts[c + 1]
        shuffled[a:b] = shuffled[a:b][rng.permutation(b - a)]
    ordered, broken = reuse(t.ids, t.starts, 1).mean(), reuse(shuffled, t.starts, 1).mean()
    assert ordered > 0.35 and broken < 0.5 * ordered, (ordered, broken)


def test_generation_is_seeded_and_shapes_hold() -> None:
    a = generate("fine-512", Shape(3, 64, 6), 700, 256, seed=3)
    b = generate("fine-512", Shape(3, 64, 6), 700, 256, seed=3)
    assert (a.ids == b.ids).all() and a.ids.shape == (700, 3, 6)
    assert list(a.chunk_lengths()) == [256, 256, 188]
    assert (np.sort(a.ids, axis=2)[..., 1:] != np.sort(a.ids, axis=2)[..., :-1]).all()  # distinct per token
    assert np.allclose(a.weights.sum(axis=2), 1.0, atol=1e-5)
    assert (a.ids != generate("fine-512", Shape(3, 64, 6), 700, 256, seed=4).ids).any()


def test_trained_regime_is_the_recording_and_maps_by_its_rule() -> None:
    own = generate("trained", TRAINED_SHAPE, 1024, 512)
    with np.load(TRAINED_TRACE) as z:
        recorded = z["experts"][:1024].astype(np.int64)
    assert (own.ids == recorded).all()
    big = generate("trained", Shape(8, 128, 8), 1024, 512)
    # each recorded choice j becomes two of experts 4j..4j+3; layers 6 and 7 follow layers 0 and 1, relabelled
    assert (big.ids[:, :6] // 4 == np.repeat(recorded, 2, axis=2)).all()
    assert (np.sort(big.ids, axis=2)[..., 1:] != np.sort(big.ids, axis=2)[..., :-1]).all()
    perm = np.random.default_rng(1).permutation(32)
    assert (big.ids[:, 6] // 4 == np.repeat(perm[recorded[:, 0]], 2, axis=1)).all()
    with pytest.raises(MoeprepError, match="multiple"):
        generate("trained", Shape(4, 100, 8), 512, 512)


def test_trace_file_round_trip_and_refusals(tmp_path) -> None:
    t = generate("chat-glm", Shape(2, 32, 4), 600, 200)
    path = tmp_path / "t.npz"
    write_trace(path, t)
    back = read_trace(path)
    assert (back.ids == t.ids).all() and (back.starts == t.starts).all() and back.n_expert == 32
    assert np.allclose(back.weights, t.weights) and list(back.labels) == ["chat", "long", "chat"]
    assert back.regime == "chat-glm"
    bad = TraceFile(t.ids.copy(), t.starts, 32)
    bad.ids[5, 1, 2] = bad.ids[5, 1, 0]
    with pytest.raises(MoeprepError, match="same expert twice"):
        write_trace(tmp_path / "bad.npz", bad)
    assert not (tmp_path / "bad.npz").exists()
    truncated = tmp_path / "cut.npz"
    truncated.write_bytes(path.read_bytes()[:300])
    with pytest.raises(MoeprepError, match="not a routing trace"):
        read_trace(truncated)


def test_trace_from_a_profile(profile, tmp_path) -> None:
    t = trace_from_profile(profile, "p.moeprof")
    assert t.ids.shape == profile.trace.ids.shape and t.n_expert == profile.model.n_expert
    assert t.weights is None and t.n_chunks == profile.trace.n_chunks
    write_profile(tmp_path / "p.moeprof", profile)
    direct = read_trace(tmp_path / "p.moeprof")  # every trace reader takes a profile too
    assert (direct.ids == profile.trace.ids).all() and (direct.starts == profile.trace.starts).all()
    r = CliRunner().invoke(main, ["routing", "extract", str(tmp_path / "p.moeprof"), "-o", str(tmp_path / "t.npz")])
    assert r.exit_code == 0, r.output
    assert (read_trace(tmp_path / "t.npz").ids == profile.trace.ids).all()


def test_stats_hit_rates_are_the_policy_replay() -> None:
    """routing stats' LRU cold rate is the policy module's replay of each chunk and layer from an empty cache."""
    t = generate("qwen3-30b", Shape(2, 64, 4), 512, 256)
    s = routing_stats(t, sizes=(0.25,), policies=("lru",))
    hits = 0
    for c in range(t.n_chunks):
        rows = t.ids[t.starts[c] : t.starts[c + 1]].transpose(1, 0, 2)  # [M, T, K]
        hits += replay(make_policy("lru", [16, 16], 64, 4), rows).hits.sum()
    assert s.rate("lru", 0.25, warm=False) == pytest.approx(hits / t.ids.size)


def test_classlru_keeps_a_busy_expert_through_a_burst() -> None:
    """Expert 0 is used at every token for 200 tokens, then a burst of one-off experts passes; LRU loses expert 0,
    ClassLRU (it is in the top frequency class) keeps it."""
    k, slots = 2, 3
    busy = [[0, 1 + t % 2] for t in range(200)]
    burst = [[10 + 2 * t, 11 + 2 * t] for t in range(4)]
    ids = np.array(busy + burst + [[0, 50]])[None]
    lru = replay(make_policy("lru", [slots], 64, k), ids).hits[0, -1]
    classlru = replay(make_policy("classlru", [slots], 64, k), ids).hits[0, -1]
    assert (lru, classlru) == (0, 1)


def test_cli_generate_and_stats_json(tmp_path) -> None:
    out = tmp_path / "trained.npz"
    runner = CliRunner()
    r = runner.invoke(main, ["routing", "generate", "--regime", "trained", "--tokens", "8192", "-o", str(out)])
    assert r.exit_code == 0, r.output
    r = runner.invoke(main, ["routing", "stats", str(out), "--json"])
    assert r.exit_code == 0, r.output
    stats = json.loads(r.output)
    assert stats["experts"] == 32 and stats["top_k"] == 4 and stats["tokens"] == 8192
    assert stats["targets"] and all(t["met"] for t in stats["targets"])
    lru = stats["hit_rates"]["lru"]
    assert lru["0.25"]["warm"] < lru["0.5"]["warm"] < stats["hit_rates"]["belady"]["0.5"]["warm"]
    # on the trained model's routing payback hits the most, cost-payback saves the most (its few uploads)
    assert stats["best"]["0.25"] == {"hit_rate": "payback", "net_saving": "cost-payback"}
    assert stats["hit_rates"]["cost-payback"]["0.25"]["uploads_per_token"] < lru["0.25"]["uploads_per_token"] / 10


def test_cli_refusals(tmp_path) -> None:
    runner = CliRunner()
    r = runner.invoke(main, ["routing", "stats", str(tmp_path / "none.npz")])
    assert r.exit_code == 2 and "no such routing trace" in r.output and "Traceback" not in r.output
    r = runner.invoke(
        main,
        [
            "routing",
            "generate",
            "--regime",
            "qwen3-30b",
            "--experts",
            "4",
            "--top-k",
            "8",
            "-o",
            str(tmp_path / "x.npz"),
        ],
    )
    assert r.exit_code == 2 and "top-k 8 is more than" in r.output
    assert not (tmp_path / "x.npz").exists()
