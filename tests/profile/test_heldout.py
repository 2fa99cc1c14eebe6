"""The vectorised cache simulation against a plain per-cache reference written the obvious way."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest

from moeprep.profile.counts import ExpertCounts
from moeprep.profile.heldout import COLD_WINDOW, POLICIES, SIZES, cache_slots, simulate_caches
from moeprep.profile.trace import RoutingTrace
from tests.profile.conftest import make_profile, skewed_routing


def reference_hits(chunk: np.ndarray, policy: str, slots: int, hottest: list[int]) -> tuple[int, int]:
    """(hits over all tokens, hits over the first COLD_WINDOW) of one layer's [T, K] ids, one cache."""
    cache: OrderedDict[int, None] = OrderedDict()  # least recently used first
    uses: dict[int, int] = {}
    if policy == "lru-warm":
        for e in reversed(hottest[:slots]):  # the hottest ends up most recent
            cache[e] = None
    static = set(hottest[:slots])
    hits = cold = 0
    for t, row in enumerate(chunk):
        for e in map(int, row):
            hit = e in static if policy == "static" else e in cache
            hits += hit
            cold += hit and t < COLD_WINDOW
            if policy == "static":
                continue
            if not hit and len(cache) >= slots:
                if policy == "lfu":
                    order = list(cache)  # recency order breaks ties among the least used
                    victim = min(order, key=lambda x: (uses.get(x, 0), order.index(x)))
                else:
                    victim = next(iter(cache))
                del cache[victim]
            cache[e] = None
            cache.move_to_end(e)
            uses[e] = uses.get(e, 0) + 1
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
                want = np.sum([reference_hits(p.trace.chunk(c)[:, m], policy, slots, list(hottest[m]))
                               for c in np.flatnonzero(p.trace.heldout)], axis=0)
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
