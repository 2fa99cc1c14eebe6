"""Slot placement: budgets never exceeded and filled, layers spread over every GPU, slots following measured need."""

from __future__ import annotations

import numpy as np
import pytest

from moeprep.errors import MoeprepError
from moeprep.gguf.anatomy import Anatomy, ModelGeometry, RoleSummary
from moerun.cache.placement import Placement, parse_budgets, place

MIB = 1 << 20
GIB = 1 << 30


def anatomy(
    n_layer: int = 8,
    dense: tuple[int, ...] = (),
    n_expert: int = 64,
    expert_bytes: int = 10 * MIB,
    non_expert: int = 2 * GIB,
) -> Anatomy:
    moe = [b for b in range(n_layer) if b not in dense]
    geo = ModelGeometry(
        arch="qwen3moe",
        n_layer=n_layer,
        moe_layers=moe,
        dense_layers=list(dense),
        n_expert=n_expert,
        n_expert_used=8,
        n_ff_exp=1408,
        expert_bytes={b: expert_bytes for b in moe},
    )
    experts = len(moe) * n_expert * expert_bytes
    roles = {"expert": RoleSummary(len(moe) * 3, experts), "attention": RoleSummary(n_layer * 4, non_expert)}
    return Anatomy("m", "qwen3moe", True, experts + non_expert, 1, geo, roles, experts / (experts + non_expert))


def check_budgets(p: Placement, a: Anatomy, reserve: int) -> None:
    """Each GPU: planned bytes within budget, and no further slot of any of its layers would fit."""
    geo = a.geometry
    for g, (budget, used) in enumerate(zip(p.budgets, p.used)):
        assert used <= budget, (g, used, budget)
        mine = [b for b in geo.moe_layers if p.device[b] == g]
        room = budget - used
        assert all(p.slots[b] == geo.n_expert or geo.expert_bytes[b] > room for b in mine), (g, room)
        assert p.cache_bytes[g] == sum(p.slots[b] * geo.expert_bytes[b] for b in mine)


@pytest.mark.parametrize("n_gpu", [1, 2, 4])
def test_budgets_filled_never_exceeded(n_gpu: int) -> None:
    a = anatomy(n_layer=12)
    budgets = [5 * GIB + 123 * MIB] * n_gpu
    p = place(a, budgets, reserve=512 * MIB)
    check_budgets(p, a, 512 * MIB)
    assert len(set(p.device)) == n_gpu  # every GPU runs layers
    assert list(p.device) == sorted(p.device)  # contiguous blocks, in order
    counts = np.bincount(p.device, minlength=n_gpu)
    assert counts.max() - counts.min() <= 1  # equal budgets, equal blocks
    slots = [p.slots[b] for b in a.geometry.moe_layers]
    assert max(slots) - min(slots) <= 1  # no profile: equal shares
    assert p.share == pytest.approx(sum(slots) / (12 * 64))


def test_more_gpus_more_slots() -> None:
    a = anatomy(n_layer=12)
    shares = [place(a, [3 * GIB] * n, reserve=512 * MIB).share for n in (1, 2, 4)]
    assert shares[0] < shares[1] < shares[2]


def test_uneven_budgets() -> None:
    a = anatomy(n_layer=16)
    budgets = [24 * GIB, 8 * GIB, 12 * GIB]
    p = place(a, budgets, reserve=1 * GIB)
    check_budgets(p, a, 1 * GIB)
    layers = np.bincount(p.device, minlength=3)
    assert layers[0] > layers[2] > layers[1] > 0  # the biggest budget runs the most layers
    assert p.cache_bytes[0] > p.cache_bytes[2] > p.cache_bytes[1]


def test_full_cache_caps_at_every_expert() -> None:
    a = anatomy(n_layer=4, n_expert=16)
    p = place(a, [80 * GIB], reserve=0)
    assert all(s == 16 for s in p.slots) and p.share == 1.0


def test_dense_blocks_sit_with_their_neighbours() -> None:
    a = anatomy(n_layer=10, dense=(0, 1))
    p = place(a, [4 * GIB, 4 * GIB], reserve=256 * MIB)
    assert p.slots[0] == p.slots[1] == 0 and p.device[0] == p.device[1] == p.device[2] == 0
    assert p.device[-1] == 1
    check_budgets(p, a, 256 * MIB)


def test_budget_too_small_for_one_slot_per_layer() -> None:
    a = anatomy(n_layer=8)
    # non-expert 2 GiB + reserve 1 GiB leave 70 MiB: less than one 10 MiB slot in each of 8 layers
    with pytest.raises(MoeprepError, match="less than one expert slot"):
        place(a, [3 * GIB + 70 * MIB], reserve=1 * GIB)
    assert sum(place(a, [3 * GIB + 80 * MIB], reserve=1 * GIB).slots) == 8  # exactly one each fits


def test_skewed_layers_get_fewer_slots_than_flat_ones() -> None:
    """A layer whose selections concentrate on a few experts reaches its hit rate with few slots; a layer spread
    wide needs more, and gets them. The greedy split beats equal shares on the usage it was given."""
    a = anatomy(n_layer=4, n_expert=64)
    ranks = np.arange(64) + 1.0
    usage = np.stack([ranks**-2.0, np.ones(64), ranks**-0.5, ranks**-1.0]) * 1e4  # skewed, flat, mild, medium
    budget = [2 * GIB + 256 * MIB + 96 * 10 * MIB]  # 96 slots over 4 layers of 64
    flat = place(a, budget, reserve=256 * MIB)
    need = place(a, budget, reserve=256 * MIB, usage=usage)
    assert sum(flat.slots) == sum(need.slots) == 96
    assert need.slots[1] > need.slots[2] > need.slots[3] > need.slots[0]

    def covered(slots: tuple[int, ...]) -> float:  # share of selections the hottest `slots` experts take
        shares = -np.sort(-usage / usage.sum(axis=1, keepdims=True), axis=1)
        return sum(shares[m, : slots[m]].sum() for m in range(4))

    assert covered(need.slots) > covered(flat.slots) + 0.1


def test_usage_as_block_table_and_foreign_usage() -> None:
    a = anatomy(n_layer=6, dense=(0,))
    usage = np.random.default_rng(0).integers(0, 100, (5, 64))
    block_table = np.vstack([np.zeros((1, 64), int), usage])  # moe_cache.expert_usage: dense rows zero
    budget = [2 * GIB + 256 * MIB + 150 * MIB]
    assert place(a, budget, 256 * MIB, usage).slots == place(a, budget, 256 * MIB, block_table).slots
    with pytest.raises(MoeprepError, match="profile made for this model"):
        place(a, budget, 256 * MIB, np.ones((5, 32)))


def test_parse_budgets() -> None:
    assert parse_budgets("24G,8G") == [24 * GIB, 8 * GIB]
    with pytest.raises(MoeprepError):
        parse_budgets("24G,lots")


def test_describe_names_every_gpu() -> None:
    p = place(anatomy(), [4 * GIB, 4 * GIB], reserve=256 * MIB)
    text = p.describe()
    assert "gpu 0: blocks 0-3" in text and "gpu 1: blocks 4-7" in text and f"{p.share:.1%}" in text
