"""bench/bench_router_scores.py: its router-score predictors on a hand-made stream, and its refusals."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moeprep.profile.policy import Payback, replay

ROOT = Path(__file__).resolve().parents[2]


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_router_scores", ROOT / "bench" / "bench_router_scores.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# one slot, experts 0 and 1 taking turns; the router always scores 0 well above 1 (and 2, never chosen)
N_TOKENS = 12
IDS = np.array([[[t % 2] for t in range(N_TOKENS)]])  # [1 row, T, K=1]
SCORES = np.broadcast_to(np.array([0.8, 0.15, 0.05]), (1, N_TOKENS, 3)).copy()


def test_ranking_by_the_scores_keeps_the_expert_the_router_favours():
    """After the first token fills the slot with 0, 1 never outranks it: every later 0 hits (tokens 2, 4, ...)."""
    bench = load_bench()
    hits = replay(bench.ScoresOnly([1], 3, 1, SCORES, half_life=4.0), IDS).hits[0]
    assert hits.tolist() == [0, 0] + [1, 0] * 5


def test_payback_takes_the_scores_once_their_ghost_pays():
    """Without scores every predictor of payback's keeps the last expert used, and alternation never hits. With the
    scores' predictor in the pool: token 1 misses and the recency ranking puts 1 in; token 2 (0) misses too, but the
    scores' ghost held 0, so the pool switches to it and 0 goes back in for good: hits at tokens 4, 6, 8, 10."""
    bench = load_bench()
    assert replay(Payback([1], 3, 1), IDS).hits[0].sum() == 0
    scored = bench.ScoredPayback([1], 3, 1, SCORES, half_life=4.0, kind="prob")
    hits = replay(scored, IDS).hits[0]
    assert hits.tolist() == [0, 0, 0, 0] + [1, 0] * 4
    assert scored.ESTIMATES[-1] == "prob-4"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--from-scores", "missing.npz"], "missing.npz"),
        (["--regimes", "nope"], "not a generated regime: nope"),
        (["--windows", "0"], "--windows must be at least 1"),
    ],
)
def test_bad_input_is_refused_in_one_line(argv, message):
    result = subprocess.run(
        [sys.executable, "bench/bench_router_scores.py", *argv], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr
    assert result.stdout == ""
