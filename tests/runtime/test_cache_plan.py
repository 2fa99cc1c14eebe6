"""The expert cache's plan (cache/plan.py): the cost model's choice for given hit rates and sizes, never above
llama.cpp's static split of the same VRAM; pinned whole layers hold every expert and are never evicted; the
static plan's layers are fully resident; the policy auto-chosen from measured routing; the line printed at start.
The runtime parts run on a CPU standing in for the GPU."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import moerun
from moeprep.errors import MoeprepError
from moeprep.gguf.anatomy import DEFAULT_RESERVE, describe_model
from moeprep.gguf.reader import open_gguf
from moerun.cache.config import CacheConfig
from moerun.cache.controller import ROUTING_POLICIES
from moerun.cache.experts import CachedExperts
from moerun.cache.placement import place, slot_room
from moerun.cache.plan import (
    GENERAL_POLICY,
    Bandwidths,
    HitCurve,
    Shape,
    choose_plan,
    choose_policy,
    pinned_layers,
    split_seconds,
    token_seconds,
    usage_curve,
)
from moerun.cli import main
from tests.runtime.conftest import profile_model

MIB = 1 << 20
SIZES = (0.10, 0.25, 0.38, 0.50)
H200 = Bandwidths()  # the H200 machine's measured speeds


def curve(hits, uploads=None, policy="lru") -> HitCurve:
    return HitCurve(policy, SIZES, tuple(hits), None if uploads is None else tuple(uploads), "test")


def shape(share: float, n_moe: int = 48, n_expert: int = 128, top_k: int = 8, expert_bytes: int = 9 * MIB) -> Shape:
    return Shape(n_moe, n_expert, top_k, expert_bytes, int(share * n_moe * n_expert * expert_bytes))


FLAT = curve(SIZES, (0.0,) * 4, "static")  # a hot set on flat routing: hits its share


def test_high_hit_rates_take_the_cache():
    """qwen3-30b-like routing (LRU 92.5% at 38%): the cache's misses and uploads cost far less than the CPU reading
    every expert of 62% of the layers."""
    s = shape(0.38)
    lru = curve((0.615, 0.874, 0.925, 0.946), (3.08, 1.02, 0.62, 0.47))
    plan = choose_plan("auto", s, lru, FLAT, H200, can_stream=True)
    assert plan.name == "cache" and plan.pinned == 0 and plan.stream
    assert plan.seconds < plan.split_seconds / 2
    assert "cache plan cache" in plan.describe() and "--n-cpu-moe" in plan.describe()


def test_flat_routing_takes_the_static_split():
    """Routing without reuse (hit = share) and a cache that uploads every miss: no plan beats pinning whole layers
    and reading the others' misses; on a CPU as slow as the bus the CPU computes them, as llama.cpp does."""
    s = shape(0.38)
    lru = curve(SIZES, [(1 - h) * 8 for h in SIZES])
    plan = choose_plan("auto", s, lru, FLAT, H200, can_stream=True)
    assert plan.name == "static" and plan.pinned == s.most_pinned and plan.stream
    assert all(plan.seconds <= other for _, other in plan.others)
    fast_cpu = Bandwidths(bus_gbps=25.0, cpu_gbps=45.0, split_gbps=45.0)
    plan = choose_plan("auto", s, lru, FLAT, fast_cpu, can_stream=True)
    assert plan.name == "static" and not plan.stream and plan.seconds <= plan.split_seconds


def test_blend_when_hits_need_more_room_than_a_layer_gives():
    """Hit rates that only pay at a small share with few uploads but flatten out: some layers pinned whole, the rest
    cached, beats both ends; the choice is the argmin over every number of pinned layers."""
    s = shape(0.38)
    steep = curve((0.60, 0.64, 0.66, 0.68), (0.0,) * 4)
    plan = choose_plan("auto", s, steep, FLAT, H200, can_stream=False)
    costs = {n: token_seconds(s, steep, H200, n, False) for n in range(s.most_pinned + 1)}
    assert plan.name == "blend" and 0 < plan.pinned < s.most_pinned
    assert plan.seconds == pytest.approx(min(costs.values()))
    assert plan.seconds < costs[0] and plan.seconds < dict(plan.others)["static"]


@pytest.mark.parametrize("seed", range(6))
def test_no_plan_predicts_slower_than_the_static_split(seed):
    """Any shape, budget, speeds and hit curve (even a cache that misses everything and uploads as much): the plan
    taken predicts no slower than the static split of the same VRAM run by moerun (the whole layers that fit, the
    rest's misses streamed or computed by the CPU), and where moerun's CPU experts are as fast as llama.cpp's, no
    slower than llama.cpp's split."""
    rng = np.random.default_rng(seed)
    for _ in range(40):
        n_expert, top_k = int(rng.choice([32, 128, 256, 512])), int(rng.choice([4, 8, 10]))
        s = shape(
            float(rng.uniform(0.02, 1.1)), int(rng.integers(2, 60)), n_expert, top_k, int(rng.integers(1, 12)) * MIB
        )
        if s.room < s.n_moe * s.expert_bytes:
            continue
        hits = np.sort(rng.uniform(0, 1, 4))
        lru = curve(hits, rng.uniform(0, top_k, 4))
        counts = rng.pareto(rng.uniform(0.5, 3), (s.n_moe, n_expert)) + 1e-3
        for static in (FLAT, usage_curve(counts, n_expert)):
            cpu = float(rng.uniform(5, 100))
            bw = Bandwidths(float(rng.uniform(10, 60)), cpu, cpu)
            stream = bool(rng.integers(2))
            plan = choose_plan("auto", s, lru, static, bw, can_stream=stream)
            split_in_moerun = min(token_seconds(s, static, bw, s.most_pinned, path) for path in {stream, False})
            assert plan.seconds <= split_in_moerun * (1 + 1e-9)
            assert plan.seconds <= split_seconds(s, bw)[1] * (1 + 1e-9)


def test_asked_plans_and_bad_names():
    s = shape(0.38)
    lru = curve((0.615, 0.874, 0.925, 0.946), (3.08, 1.02, 0.62, 0.47))
    assert choose_plan("static", s, lru, FLAT, H200, True).name == "static"
    assert choose_plan("blend", s, lru, FLAT, H200, True).pinned >= 1
    assert choose_plan("blend", shape(0.01, n_moe=4), lru, FLAT, H200, True).name == "cache"  # nothing to pin
    with pytest.raises(MoeprepError, match="unknown cache plan"):
        choose_plan("split", s, lru, FLAT, H200, True)


def test_policy_chosen_by_predicted_traffic():
    """Fewer hits can win by fewer uploads; without measured routing the general default."""
    s = shape(0.25)
    curves = {
        "lru": curve((0.5, 0.80, 0.85, 0.9), (4.0, 2.0, 1.5, 1.0)),
        "payback": curve((0.45, 0.78, 0.83, 0.88), (0.2, 0.3, 0.3, 0.3), "payback"),
        "lfu": curve((0.2, 0.5, 0.6, 0.7), (0.1, 0.1, 0.1, 0.1), "lfu"),
    }
    best, why = choose_policy(curves, s, H200, stream=True)
    assert best == "payback" and "cache policy payback" in why and "lru" in why
    curves["lru"] = curve((0.5, 0.95, 0.97, 0.98), (1.0, 0.2, 0.1, 0.1))
    assert choose_policy(curves, s, H200, stream=True)[0] == "lru"
    assert choose_policy({}, s, H200, stream=True)[0] == GENERAL_POLICY


def test_usage_curve_and_pinned_layers():
    counts = np.ones((4, 100))
    counts[1, :10] = 1000  # layer 1 is skewed: its hot set covers most of it
    c = usage_curve(counts, 100)
    assert c.hits[SIZES.index(0.10) + 1] > 0.1 and c.uploads == (0.0,) * len(c.sizes)
    assert usage_curve(None, 100).hit(0.3) == pytest.approx(0.3)
    assert 1 not in pinned_layers(counts, 3, 4, 0.1, 100)  # the skewed layer is the one kept cached
    assert pinned_layers(None, 2, 5, 0.1, 100) == (3, 4)  # without counts, the last layers, as llama.cpp


def test_placement_pins_whole_layers_within_the_budget():
    from tests.runtime.test_placement import anatomy

    a = anatomy(n_layer=8, n_expert=64, expert_bytes=10 * MIB)
    overhead = (16 << 30) - slot_room(a, [16 << 30])  # the non-expert weights and the reserve
    budget = overhead + 64 * 10 * MIB * 3 + 8 * 10 * MIB * 4  # room for 3 whole layers and more
    p = place(a, [budget], pinned=(2, 5))
    assert p.pinned == (2, 5) and p.slots[2] == p.slots[5] == 64
    assert all(s >= 1 for s in p.slots) and p.used[0] <= budget
    assert "pinned whole" in p.describe()
    with pytest.raises(MoeprepError, match="no room to pin"):
        place(a, [budget], pinned=tuple(range(8)))


# --- the runtime, a CPU standing in for the GPU -----------------------------------------------------------------------


def cached_layers(model) -> list[CachedExperts]:
    return [m for m in model.net.modules() if isinstance(m, CachedExperts)]


def budget_for(path, whole_layers: float) -> int:
    """A budget whose slots' room holds `whole_layers` layers' worth of experts."""
    a = describe_model(open_gguf(path))
    roomy = place(a, [8 << 30])
    non_expert = roomy.used[0] - roomy.cache_bytes[0] - DEFAULT_RESERVE
    per_layer = a.geometry.expert_bytes[a.geometry.moe_layers[0]] * a.geometry.n_expert
    return DEFAULT_RESERVE + non_expert + int(whole_layers * per_layer)


@pytest.mark.parametrize("plan", ["static", "blend"])
def test_pinned_layers_are_fully_resident_and_never_evicted(synth_model, plan):
    path = synth_model("qwen3moe", expert_type="F32", attn_type="F32")
    reference = moerun.load_model(path)
    model = moerun.load_model(path, cache=CacheConfig(budgets=[budget_for(path, 1.5)], plan=plan, policy="lru"))
    cache = model.expert_cache
    assert cache.plan.name == plan and cache.placement.pinned
    n_expert = cache.n_expert
    pinned = [layer for layer in cached_layers(model) if layer.layer in cache.placement.pinned]
    others = [layer for layer in cached_layers(model) if layer.layer not in cache.placement.pinned]
    assert pinned and others
    before = {layer.layer: layer.resident.copy() for layer in pinned}
    assert all(sorted(r.tolist()) == list(range(n_expert)) for r in before.values())
    if plan == "static":  # the other layers' slots are fixed once filled
        assert cache.config.policy == "static"
    prompt = torch.tensor(reference.tokenizer.encode("def bisect(a, x):\n    lo, hi = 0, len(a)"))
    torch.testing.assert_close(model.forward(prompt), reference.forward(prompt), rtol=1e-4, atol=1e-4)
    for i, token in enumerate([5, 17, 99, 5, 17, 99, 5, 3, 42, 7]):
        pos = len(prompt) + i
        torch.testing.assert_close(
            model.forward(torch.tensor([token]), pos),
            reference.forward(torch.tensor([token]), pos),
            rtol=1e-4,
            atol=1e-4,
        )
    stats = cache.stats
    for layer in pinned:
        assert (layer.resident == before[layer.layer]).all()
        assert stats.hits[layer.layer] == stats.lookups[layer.layer] > 0
    assert sum(stats.hits[layer.layer] for layer in others) < sum(stats.lookups[layer.layer] for layer in others)
    if plan == "static":  # without counts to warm from, the first misses fill the empty slots, and stay
        assert 0 < stats.uploads <= sum(layer.n_slots for layer in others)


def test_fixed_slots_take_the_cache_plan(synth_model):
    path = synth_model("qwen3moe", expert_type="F32", attn_type="F32")
    model = moerun.load_model(path, cache=CacheConfig(budgets=[8 << 30], slots_per_layer=2))
    assert model.expert_cache.plan is None and not model.expert_cache.placement.pinned
    with pytest.raises(MoeprepError, match="--cache-plan static"):
        moerun.load_model(path, cache=CacheConfig(budgets=[8 << 30], slots_per_layer=2, plan="static"))


def test_auto_policy_and_plan_from_a_profiles_heldout_routing(profiled_model):
    model_path, profile_path = profiled_model
    model = moerun.load_model(
        model_path, cache=CacheConfig(budgets=[budget_for(model_path, 1.2)], profile=str(profile_path))
    )
    cache = model.expert_cache
    policy_line, plan_line = cache.why
    assert "fewest predicted" in policy_line and "the profile's held-out chunks" in policy_line
    chosen = policy_line.split(":")[0].split()[-1]
    # every policy auto weighs was measured on the held-out routing, and the one taken predicts the least time
    ranked = re.findall(r"([a-z-]+) [0-9.]+% hits ([0-9.e-]+) ms", policy_line)
    ms = {p: float(v) for p, v in ranked}
    assert sorted(ms) == sorted(ROUTING_POLICIES) and ms[chosen] == min(ms.values()), policy_line
    assert plan_line.startswith(f"cache plan {cache.plan.name}") and cache.config.policy == cache.plan.policy
    if cache.plan.name != "static":
        assert cache.config.policy == chosen


@pytest.fixture(scope="module")
def profiled_model(tmp_path_factory, synth_model):
    folder = tmp_path_factory.mktemp("plan-profile")
    model = synth_model("qwen3moe", preset="small", skew=1.0)
    out = folder / "p.moeprof"
    profile_model(model, out)
    return model, out


def test_cli_says_which_plan_and_policy(synth_model):
    path = synth_model("qwen3moe")
    budget = budget_for(path, 1.5)
    common = [
        "bench",
        "-m",
        str(path),
        "--device",
        "cpu",
        "-p",
        "4",
        "-n",
        "4",
        "-t",
        "1",
        "--vram-budget",
        str(budget),
    ]
    r = CliRunner().invoke(main, [*common, "--cache-plan", "static", "--cache-gbps", "25,6,40"])
    assert r.exit_code == 0, r.output
    lines = [line for line in r.stderr.splitlines() if line.startswith("cache plan ")]
    assert len(lines) == 1 and lines[0].startswith("cache plan static: 1 whole layers pinned")
    assert "--n-cpu-moe split of the same VRAM, 1 layers on the GPU" in lines[0]
    assert "cache policy payback: no routing measured" in r.stderr
    r = CliRunner().invoke(main, [*common, "--cache-gbps", "fast"])
    assert r.exit_code == 2 and "--cache-gbps 'fast'" in r.output and "Traceback" not in r.output
