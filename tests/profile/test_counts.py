from __future__ import annotations

import numpy as np

from moeprep.profile.counts import ExpertCounts


def test_add_shares_hottest_coverage() -> None:
    c = ExpertCounts.zeros((1, 3), 4)
    c.add(0, np.array([[0, 1], [1, 2], [1, 0]]), np.array([[0.5, 0.5], [0.9, 0.1], [0.6, 0.4]], np.float32))
    assert c.selections.tolist() == [[2, 3, 1, 0], [0, 0, 0, 0]]
    assert np.allclose(c.gate_mass[0], [0.9, 2.0, 0.1, 0.0])
    assert c.tokens.tolist() == [3, 0]
    assert np.allclose(c.shares()[0], [2 / 6, 3 / 6, 1 / 6, 0]) and not c.shares()[1].any()
    assert c.hottest()[0].tolist() == [1, 0, 2, 3]
    assert c.hottest()[1].tolist() == [0, 1, 2, 3]  # ties: lower id first
    assert np.allclose(c.coverage()[0], [0.5, 5 / 6, 1, 1])
    table = c.block_table(5)
    assert table.shape == (5, 4) and table[1].tolist() == [2, 3, 1, 0] and not table[[0, 2, 3, 4]].any()


def test_scaled_sum() -> None:
    a = ExpertCounts.zeros((0,), 2)
    a.add(0, np.array([[0], [1], [1]]), np.ones((3, 1), np.float32))
    b = a.scaled(3) + a
    assert b.selections.tolist() == [[4, 8]] and b.tokens.tolist() == [12] and b.gate_mass.tolist() == [[4.0, 8.0]]
