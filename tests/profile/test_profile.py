"""Merging profiles: weighted counts, concatenated traces, a recomputed held-out table, other models refused."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from moeprep.errors import MoeprepError
from moeprep.profile.heldout import simulate_caches
from moeprep.profile.profile import merge_profiles
from tests.profile.conftest import fake_identity, make_profile


def test_merge_weights_and_traces() -> None:
    a, b = make_profile(seed=1), make_profile(seed=2, chunks=4, heldout=1)
    m = merge_profiles([("a", a), ("b", b)], [1, 3])
    assert np.array_equal(m.counts.selections, a.counts.selections + 3 * b.counts.selections)
    assert np.array_equal(m.counts.tokens, a.counts.tokens + 3 * b.counts.tokens)
    assert np.allclose(m.counts.gate_mass, a.counts.gate_mass + 3 * b.counts.gate_mass)
    assert m.trace.n_chunks == a.trace.n_chunks + b.trace.n_chunks
    assert np.array_equal(m.trace.chunk(a.trace.n_chunks), b.trace.chunk(0))
    assert m.trace.heldout.sum() == 3
    assert [s.weight for s in m.sources] == [1, 3]
    want = simulate_caches(m.trace, m.counts)
    assert np.array_equal(m.heldout.hits, want.hits) and m.heldout.chunks == 3
    # merging a merged profile again multiplies its recorded weights
    assert [s.weight for s in merge_profiles([("m", m)], [2]).sources] == [2, 6]


def test_merge_refuses_another_model() -> None:
    other = make_profile(identity=fake_identity(router="cd" * 32))
    with pytest.raises(MoeprepError, match="^b: made for another model .*differs in router_sha256"):
        merge_profiles([("a", make_profile()), ("b", other)])
    renamed = make_profile(identity=dataclasses.replace(fake_identity(), name="requantized", file_size=1))
    merge_profiles([("a", make_profile()), ("b", renamed)])  # name and size do not matter


@pytest.mark.parametrize("weights, message", [([1], "2 profiles"), ([1, 0], "below 1")])
def test_merge_bad_weights(weights: list[int], message: str) -> None:
    with pytest.raises(MoeprepError, match=message):
        merge_profiles([("a", make_profile()), ("b", make_profile())], weights)
