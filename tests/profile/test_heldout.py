"""The vectorised cache simulation against a plain per-cache reference written the obvious way."""

from __future__ import annotations

import numpy as np
import pytest

from moeprep.profile.counts import ExpertCounts
from moeprep.profile.heldout import COLD_WINDOW, POLICIES, SIZES, cache_slots, simulate_caches
from moeprep.profile.trace import RoutingTrace
from tests.profile.conftest import make_profile, skewed_routing


def reference_hits(chunk: np.ndarray, policy: str, slots: int, hottest: list[int]) -> tuple[int, int]:
    """(hits over all tokens, hits over the first COLD_WINDOW) of one layer's [T, K] ids, one cache, stepped as the
    runtime decodes: a token's K lookups see the cache as it was at the token's start, then the cache keeps the
    `slots` best of its experts and the token's (LRU: most recent; LFU: most used, then most recent)."""
    n_k = chunk.shape[1]
    tick: dict[int, int] = {}
    uses: dict[int, int] = {}
    cache: set[int] = set()
    if policy in ("lru-warm", "static"):
        cache = set(hottest[:slots])
        tick = {e: -(rank + 1) for rank, e in enumerate(hottest)}  # the hottest counts as the most recent
    hits = cold = 0
    for t, row in enumerate(chunk):
        row = [int(e) for e in row]
        hit = sum(e in cache for e in row)
        hits += hit
        cold += hit * (t < COLD_WINDOW)
        if policy == "static":
            continue
        for k, e in enumerate(row):
            tick[e] = t * n_k + k + 1
            uses[e] = uses.get(e, 0) + 1
        key = (lambda e: tick[e]) if policy in ("lru", "lru-warm") else (lambda e: (uses[e], tick[e]))
        cache = set(sorted(cache | set(row), key=key)[-slots:])
    return hits, cold


@pytest.mark.parametrize("seed", [0, 1])
def test_simulation_matches_reference(seed: int) -> None:
    p = make_profile(seed=seed, chunks=5, heldout=3, tokens=90, skew=0.8)
    table = simulate_caches(p.trace, p.counts)
    hottest = p.counts.hottest()
    for pi, policy in enumerate(POLICIES):
        for si, size in enumerate(SIZES):
            slots = cache_slots(size, p.counts.n_expert)
            for m in range(len(p.counts.layers)):
                want = np.sum(
                    [
                        reference_hits(p.trace.chunk(c)[:, m], policy, slots, list(hottest[m]))
                        for c in np.flatnonzero(p.trace.heldout)
                    ],
                    axis=0,
                )
                assert tuple(table.hits[pi, si, :, m]) == tuple(want), (policy, size, m)
    lengths = np.diff(p.trace.starts)[p.trace.heldout]
    assert table.lookups[0] == lengths.sum() * 2
    assert table.lookups[1] == np.minimum(lengths, COLD_WINDOW).sum() * 2
    assert table.tokens == lengths.sum() and table.chunks == 3


def test_tiny_cache_smaller_than_k() -> None:
    """One slot and K=2: every second lookup of a token evicts the first; the simulation must still agree."""
    rng = np.random.default_rng(3)
    ids, w = skewed_routing(rng, 40, 1, 4, 2, 1.0)
    counts = ExpertCounts.zeros((0,), 4)
    counts.add(0, ids[:20, 0], w[:20, 0])
    trace = RoutingTrace.from_chunks([ids[:20], ids[20:]], [False, True], 4)
    table = simulate_caches(trace, counts)
    assert table.slots == (1, 1, 2)
    for pi, policy in enumerate(POLICIES):
        assert table.hits[pi, 0, 0, 0] == reference_hits(ids[20:, 0], policy, 1, list(counts.hottest()[0]))[0]


def test_skew_shows_in_the_table() -> None:
    """On skewed routing the profile's hot set beats a cold cache at the start of a chunk, and everything beats
    the share of experts cached; on uniform routing the static cache gets about its share."""
    skewed = simulate_caches(*(lambda p: (p.trace, p.counts))(make_profile(skew=1.5, tokens=120)))
    overall = skewed.overall()  # [P, S, W]
    static, lru, warm = POLICIES.index("static"), POLICIES.index("lru"), POLICIES.index("lru-warm")
    for si, size in enumerate(SIZES):
        assert overall[static, si, 0] > size + 0.1
        assert overall[warm, si, 1] > overall[lru, si, 1]
    uniform = make_profile(skew=0.0, tokens=120, chunks=8, heldout=4)
    flat = simulate_caches(uniform.trace, uniform.counts).overall()
    assert abs(flat[static, 2, 0] - 0.5) < 0.1
