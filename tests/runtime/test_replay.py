"""Routing replay on the CPU (a CPU device standing in for the GPU): the MoE layers use the trace's experts while
their routers still run, the expert cache's hits on a replayed trace are the policy replay's on that trace, and a
trace of another shape is refused with one line and exit code 2."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

import moerun
from moeprep.profile.policy import make_policy, replay
from moeprep.profile.regimes import Shape, generate
from moeprep.profile.routing_stats import hit_rates
from moeprep.profile.tracefile import TraceFile, write_trace
from moerun.bench import run_bench
from moerun.cache.config import UPLOADS_PER_LAYER_STEP, CacheConfig
from moerun.cli import main
from moerun.layers import Router
from moerun.replay import install_replay

BUDGET = [8 << 30]  # more than the synthetic models need: slots_per_layer sets the slots


@pytest.fixture
def model_path(synth_model):
    return synth_model("qwen3moe", expert_type="F32", attn_type="F32")  # tiny: 3 MoE layers, 16 experts, top-4


def trace_for(model, tokens: int = 96, chunk: int = 48, regime: str = "qwen3-30b") -> TraceFile:
    a = model.args
    n_moe = sum(1 for m in model.net.modules() if isinstance(m, Router))
    return generate(regime, Shape(n_moe, a.n_experts, a.n_experts_used), tokens, chunk, seed=1)


def test_replayed_layers_use_the_trace_and_routers_still_run(model_path):
    model = moerun.load_model(model_path)
    t = trace_for(model)
    routers = [m for m in model.net.modules() if isinstance(m, Router)]
    calls = []
    for r in routers:
        r.register_forward_hook(lambda mod, args, out: calls.append(1))
    seen: dict[int, list[np.ndarray]] = {}
    model.add_routing_hook(lambda ev: seen.setdefault(ev.layer, []).append(ev.expert_ids.cpu().numpy()))
    installed = install_replay(model, t, 40, "t.npz")
    assert installed.chunk == 0
    result = run_bench(model, 8, 12, warmup=False, routing=None)  # already installed
    assert result.gen_tokens == 12
    assert len(calls) == len(routers) * (1 + 12)  # one prefill and 12 decode steps, every router each time
    for m, layer in enumerate(sorted(seen)):
        ids = np.concatenate(seen[layer])  # prefill's 8 rows, then one per decode step
        assert (ids == t.ids[:20, m]).all()


def test_a_later_chunk_when_the_first_is_too_short(model_path):
    model = moerun.load_model(model_path)
    a = model.args
    short = generate("fine-512", Shape(3, a.n_experts, a.n_experts_used), 30 + 64, 30)
    short.starts = np.array([0, 30, 94])
    assert install_replay(model, short, 50, "t.npz").chunk == 1


def test_cache_hits_on_a_replayed_trace_are_the_policy_replays(model_path):
    slots = 4
    model = moerun.load_model(model_path, cache=CacheConfig(budgets=BUDGET, slots_per_layer=slots, policy="lru"))
    t = trace_for(model)
    n_gen = 40
    run_bench(model, 0, n_gen, warmup=False, routing=t)
    stats = model.expert_cache.stats
    rows = t.ids[:n_gen].transpose(1, 0, 2)  # [M, T, K] from position 0 of chunk 0
    n_m, _, n_k = rows.shape
    want = replay(make_policy("lru", [slots] * n_m, t.n_expert, n_k), rows, free=UPLOADS_PER_LAYER_STEP).hits
    got = stats.hits[stats.lookups > 0]
    assert got.tolist() == want.sum(axis=1).tolist()
    assert 0 < got.sum() < stats.lookups.sum()
    # and routing stats' replay (one chunk of the decoded tokens, the same cap) counts the same
    cut = TraceFile(t.ids[:n_gen], np.array([0, n_gen]), t.n_expert)
    _, rates, _ = hit_rates(cut, (slots / t.n_expert,), ("lru",), free=UPLOADS_PER_LAYER_STEP)
    assert np.allclose(rates[0, 0, 0] * n_gen * n_k, got)


def test_the_bench_warm_up_leaves_a_cold_cache_cold(model_path):
    """The warm-up runs the prompt's positions, so a replayed trace's routing, once before the timed prompt: the
    policy must not see it, or the prompt's experts would look reused and a cold cache would start warm."""
    stats = []
    for warmup in (False, True):
        config = CacheConfig(budgets=BUDGET, slots_per_layer=4, policy="payback")
        model = moerun.load_model(model_path, cache=config)
        run_bench(model, 16, 24, warmup=warmup, routing=trace_for(model))
        stats.append((model.expert_cache.stats.hits.tolist(), model.expert_cache.stats.uploads))
    assert stats[0] == stats[1]
    assert sum(stats[0][0]) > 0


def test_cli_bench_replays_and_refuses_another_shape(model_path, tmp_path):
    model = moerun.load_model(model_path)
    good = tmp_path / "good.npz"
    write_trace(good, trace_for(model))
    runner = CliRunner()
    common = ["bench", "-m", str(model_path), "-p", "8", "-n", "8", "--vram-budget", "8G", "--cache-slots", "4"]
    r = runner.invoke(main, [*common, "--routing", str(good)])
    assert r.exit_code == 0, r.output
    assert "routing replayed from" in r.output and "hit rate" in r.output
    a = model.args
    for shape in (Shape(2, a.n_experts, a.n_experts_used), Shape(3, 32, a.n_experts_used), Shape(3, a.n_experts, 2)):
        bad = tmp_path / f"bad-{shape.layers}-{shape.experts}-{shape.top_k}.npz"
        write_trace(bad, generate("qwen3-30b", shape, 64, 64))
        r = runner.invoke(main, [*common, "--routing", str(bad)])
        assert r.exit_code == 2, r.output
        assert "the trace has" in r.output and "Traceback" not in r.output
        assert len(r.output.strip().splitlines()) == 1
    r = runner.invoke(main, [*common, "-n", "200", "--routing", str(good)])
    assert r.exit_code == 2 and "longest chunk has 48 tokens" in r.output
