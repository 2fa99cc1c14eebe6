"""The expert cache on the CPU, a CPU device standing in for the GPU (its slot banks run through the Triton kernels
in Triton's interpreter, tests/conftest.py): outputs equal the all-resident path, hits and uploads are counted as the
policy decides, slots never disagree with the table, and warm starts come from a profile or the GGUF's baked counts.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import moerun
from moeprep.cli import main as moeprep_main
from moeprep.errors import MoeprepError
from moerun.cache.config import CacheConfig
from moerun.cache.experts import CachedExperts
from moerun.options import RuntimeOptions
from tests.runtime.conftest import profile_model

CPU_TOO = frozenset({"cuda", "cpu"})  # a CPU standing in for a GPU stages or streams as a GPU would

BUDGET = [8 << 30]  # more than the synthetic models need: --cache-slots sets the slots


def cached_layers(model) -> list[CachedExperts]:
    return [m for m in model.net.modules() if isinstance(m, CachedExperts)]


def check_tables(model) -> None:
    for layer in cached_layers(model):
        resident = layer.resident[layer.resident >= 0]
        assert len(set(resident.tolist())) == len(resident)  # an expert sits in one slot at most
        for slot, e in enumerate(layer.resident.tolist()):
            assert e < 0 or layer.slot_of[e] == slot
        assert (layer.slot_of >= 0).sum() == len(resident)


@pytest.mark.parametrize("slots", [1, 16])
def test_cached_forward_equals_all_resident(synth_model, slots):
    path = synth_model("qwen3moe", expert_type="F32", attn_type="F32")
    reference = moerun.load_model(path)
    cached = moerun.load_model(path, cache=CacheConfig(budgets=BUDGET, slots_per_layer=slots))
    assert [layer.n_slots for layer in cached_layers(cached)] == [slots] * len(cached_layers(cached))
    prompt = torch.tensor(reference.tokenizer.encode("def bisect(a, x):\n    lo, hi = 0, len(a)"))
    torch.testing.assert_close(cached.forward(prompt), reference.forward(prompt), rtol=1e-4, atol=1e-4)
    for i, token in enumerate([5, 17, 99, 5, 17, 99, 5]):  # repeats: what the policy uploads gets hit
        pos = len(prompt) + i
        torch.testing.assert_close(
            cached.forward(torch.tensor([token]), pos),
            reference.forward(torch.tensor([token]), pos),
            rtol=1e-4,
            atol=1e-4,
        )
        check_tables(cached)
    stats = cached.expert_cache.stats
    assert stats.lookups.sum() == (len(prompt) + 7) * reference.args.n_experts_used * len(cached_layers(cached))
    assert 0 < stats.hits.sum() < stats.lookups.sum() and stats.uploads > 0


def test_every_expert_cached_and_warm_is_all_hits(synth_model):
    path = synth_model("qwen3moe", expert_type="F32", attn_type="F32")
    n_expert = moerun.load_model(path).args.n_experts
    usage = np.ones((3, n_expert), np.int64)  # every expert known: warm start fills every slot
    model = moerun.load_model(path, cache=CacheConfig(budgets=BUDGET, slots_per_layer=n_expert, usage=usage))
    model.forward(torch.arange(1, 12))
    stats = model.expert_cache.stats
    assert stats.hits.sum() == stats.lookups.sum() > 0 and stats.uploads == 0


def test_generated_text_scores_the_same_through_the_cache(synth_model):
    path = synth_model("gpt-oss", expert_type="F32", attn_type="F32")  # expert biases and swiglu_oai too
    plain = moerun.load_model(path)
    prompt = plain.tokenizer.encode("Once upon a time")
    text = torch.tensor(prompt + list(moerun.generate(plain, prompt, 12)))
    # teacher-forced over the plain model's own generation: equal logits, not equal argmaxes, so that a near-tie the
    # two summation orders break differently on another CPU cannot fail the test
    cached = moerun.load_model(path, cache=CacheConfig(budgets=BUDGET, slots_per_layer=3))
    torch.testing.assert_close(cached.forward(text), plain.forward(text), rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def profiled(tmp_path_factory, synth_model):
    """A model and a profile of it made by `moeprep profile`, and a second, different model."""
    folder = tmp_path_factory.mktemp("cache-profile")
    model = synth_model("qwen3moe", preset="small", skew=1.0)
    out = folder / "p.moeprof"
    profile_model(model, out)
    return model, out, synth_model("qwen3moe", preset="small", seed=1)


def test_profile_warm_start_fills_the_hottest_experts(profiled):
    from moeprep.profile.format import read_profile

    model_path, profile_path, _ = profiled
    counts = read_profile(profile_path).counts
    model = moerun.load_model(
        model_path, cache=CacheConfig(budgets=BUDGET, slots_per_layer=4, profile=str(profile_path))
    )
    for layer in cached_layers(model):
        row = counts.selections[counts.layers.index(layer.layer)]
        hottest = set(np.argsort(-row, kind="stable")[:4].tolist())
        assert set(layer.resident.tolist()) == hottest
    cold = moerun.load_model(model_path, cache=CacheConfig(budgets=BUDGET, slots_per_layer=4))
    assert all((layer.resident < 0).all() for layer in cached_layers(cold))


def test_baked_counts_warm_without_a_flag(profiled, tmp_path):
    model_path, profile_path, _ = profiled
    baked = tmp_path / "baked.gguf"
    result = CliRunner().invoke(moeprep_main, ["profile", "bake", str(profile_path), str(model_path), str(baked)])
    assert result.exit_code == 0, result.output
    model = moerun.load_model(baked, cache=CacheConfig(budgets=BUDGET, slots_per_layer=4))
    assert all((layer.resident >= 0).all() for layer in cached_layers(model))


def test_a_profile_of_another_model_is_refused(profiled):
    _, profile_path, other = profiled
    with pytest.raises(MoeprepError):
        moerun.load_model(other, cache=CacheConfig(budgets=BUDGET, profile=str(profile_path)))


def test_a_budget_without_room_for_slots_is_refused(synth_model):
    with pytest.raises(MoeprepError, match="vram-budget"):
        moerun.load_model(synth_model("qwen3moe"), cache=CacheConfig(budgets=[1 << 20]))


@pytest.mark.parametrize("bank_bytes", [512 << 20, 1])  # 1 byte: a bank of one expert, one round per expert
def test_prefill_stages_busy_misses_on_the_device(synth_model, monkeypatch, bank_bytes):
    """A prompt's missed experts chosen by several tokens run from the staging bank, in rounds of what it holds (on
    the GPU there; here the CPU stands in, with the CPU's kernel, so the sum is the resident model's up to summation
    order), the rest on the CPU for just the tokens that chose them."""
    path = synth_model("qwen3moe", expert_type="F32", attn_type="F32")
    reference = moerun.load_model(path)
    cached = moerun.load_model(
        path,
        cache=CacheConfig(budgets=BUDGET, slots_per_layer=1, stage_bytes=bank_bytes),
        options=RuntimeOptions(staging_devices=CPU_TOO),
    )
    prompt = torch.tensor(reference.tokenizer.encode("def bisect(a, x):\n    lo, hi = 0, len(a)\n    while lo < hi:"))
    ours, ref = cached.forward(prompt), reference.forward(prompt)
    stats = cached.expert_cache.stats
    assert stats.staged > 0 and stats.hits.sum() < stats.lookups.sum()
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    check_tables(cached)


def check_streaming_tables(model) -> None:
    """Between steps each layer's streaming table names the slot of every expert whose upload is complete (all
    of them: the CPU's copies are done at once) and "on the host" (-2 - e) for every other."""
    for layer in cached_layers(model):
        e = np.arange(len(layer.slot_of))
        assert (layer.table_host == np.where(layer.slot_of >= 0, layer.slot_of, -2 - e)).all()
        assert (layer.table.numpy() == layer.table_host).all() and not layer.pending


@pytest.mark.parametrize(
    "policy,stage", [("lru", False), ("static", False), ("lru", True)], ids=["lru", "static", "lru-staged"]
)
def test_decode_streams_misses_from_host_memory(synth_model, monkeypatch, policy, stage):
    """Streaming (a GPU whose experts are page-locked; the CPU stands in here, reading the host bytes with its own
    kernel): a decode-sized step, one token or a batch of sequences, runs every expert in the experts' launch, the
    missed ones read from host memory, and stops at the host only after the last layer, where the step's routing
    is counted and the policy plans its uploads in one call while the next step runs. Outputs are the resident model's; the tables follow
    the uploads; a prompt (more than GEMV_MAX_TOKENS tokens) still computes its misses on the CPU. `stage`: as on a
    GPU, the step's misses are first copied to the staging bank (staging.stage_second, in the interpreter here)
    and run from there."""
    from moerun.kernels import staging, tuning

    options = RuntimeOptions(stream_devices=CPU_TOO, staging_devices=CPU_TOO if stage else frozenset({"cuda"}))
    copies = []
    monkeypatch.setattr(
        staging, "stage_second", lambda *a, stage=staging.stage_second: copies.append(a[0].numel()) or stage(*a)
    )
    path = synth_model("qwen3moe", expert_type="F32", attn_type="F32")
    reference = moerun.load_model(path, n_seq=3)
    n_expert, k = reference.args.n_experts, reference.args.n_experts_used
    usage = np.tile(np.arange(n_expert)[::-1], (3, 1))  # experts 0, 1, 2, ... hottest first
    cached = moerun.load_model(
        path, n_seq=3, cache=CacheConfig(budgets=BUDGET, slots_per_layer=4, usage=usage, policy=policy), options=options
    )
    cache, layers = cached.expert_cache, cached_layers(cached)
    assert cache.streamed and all(b.second is not None for b in layers[0].banks)
    check_streaming_tables(cached)
    prompts = [
        reference.tokenizer.encode(text)
        for text in ("def bisect(a, x):\n    lo, hi = 0, len(a)", "import os", "class A:")
    ]
    assert len(prompts[0]) > tuning.GEMV_MAX_TOKENS
    for seq, prompt in enumerate(prompts):
        torch.testing.assert_close(
            cached.forward(torch.tensor(prompt), 0, seq),
            reference.forward(torch.tensor(prompt), 0, seq),
            rtol=1e-4,
            atol=1e-4,
        )
        if seq == 0:  # the long prompt's misses went to the CPU, the short ones' are streamed
            assert cache.stats.streamed == 0 and cache.stats.hits.sum() < cache.stats.lookups.sum()
    assert cache.stats.streamed > 0
    cache.plan_pending()  # the last short prompt's
    cache.reset_stats()
    calls = []
    copies.clear()
    monkeypatch.setattr(cache, "_plan", lambda routed, plan=cache._plan: calls.append(len(routed)) or plan(routed))
    pos = len(prompts[0])
    for i, token in enumerate([5, 17, 99, 3, 250, 5]):
        torch.testing.assert_close(
            cached.forward(torch.tensor([token]), pos + i),
            reference.forward(torch.tensor([token]), pos + i),
            rtol=1e-4,
            atol=1e-4,
        )
        check_tables(cached)
        check_streaming_tables(cached)
    lengths = torch.tensor([len(p) for p in prompts])
    lengths[0] += 6
    for i, t in enumerate([7, 40, 7]):
        tokens, seqs = torch.tensor([t, t + 1, t + 2]), torch.arange(3)
        torch.testing.assert_close(
            cached.forward_batch(tokens, lengths + i, seqs),
            reference.forward_batch(tokens, lengths + i, seqs),
            rtol=1e-4,
            atol=1e-4,
        )
        check_streaming_tables(cached)
    stats = cache.stats
    assert calls == [len(layers)] * 8  # one plan per step, with every layer's routing, during the next step
    assert (sorted(set(copies)) == [k, 3 * k]) if stage else not copies  # a token's pairs, a batch's
    assert stats.lookups.sum() == (6 + 3 * 3) * k * len(layers)
    assert stats.streamed == stats.lookups.sum() - stats.hits.sum() > 0
    assert (stats.uploads > 0) == (policy == "lru")
    if policy == "static":
        assert all(layer.resident.tolist() == [0, 1, 2, 3] for layer in layers)
    cached.forward(torch.tensor(prompts[0]), 0, 0)  # a prompt plans the last streamed step's uploads first
    assert calls == [len(layers)] * 10 and not cache.unplanned


def test_streamed_uploads_reach_the_table_once_copied(synth_model, monkeypatch):
    """On a GPU an upload's copy runs on the copy stream while the next step may already run: the evicted expert
    leaves the table at once (no step reads a slot being written), the new one enters it only once its copy is
    complete, and not if a later plan took the slot again."""
    path = synth_model("qwen3moe", expert_type="F32", attn_type="F32")
    n_expert = moerun.load_model(path).args.n_experts
    usage = np.tile(np.arange(n_expert)[::-1], (3, 1))
    model = moerun.load_model(
        path,
        cache=CacheConfig(budgets=BUDGET, slots_per_layer=4, usage=usage),
        options=RuntimeOptions(stream_devices=CPU_TOO),
    )
    layer = cached_layers(model)[0]

    class Copy:  # a copy stream's event, complete when the test says
        done = False

        def query(self):
            return self.done

    first, second = Copy(), Copy()
    monkeypatch.setattr(layer, "_on_copy_stream", lambda copies: (copies(), first)[1])
    layer.upload([(0, 9)])  # expert 0 leaves slot 0 for expert 9
    model.expert_cache.publish()
    assert layer.table_host[0] == -2 and layer.table_host[9] == -11 and layer.slot_of[9] == 0
    first.done = True
    model.expert_cache.publish()
    assert layer.table_host[9] == 0 and (layer.table.numpy() == layer.table_host).all()
    first.done = False
    monkeypatch.setattr(layer, "_on_copy_stream", lambda copies: (copies(), first)[1])
    layer.upload([(1, 10)])
    monkeypatch.setattr(layer, "_on_copy_stream", lambda copies: (copies(), second)[1])
    layer.upload([(1, 11)])  # slot 1 taken again before expert 10's copy completed
    first.done = True
    model.expert_cache.publish()
    assert layer.table_host[10] == -12 and layer.table_host[11] == -13 and layer.table_host[1] == -3
    second.done = True
    model.expert_cache.publish()
    assert layer.table_host[11] == 1 and not layer.pending


@pytest.mark.parametrize("stream", [False, True], ids=["cpu-misses", "streamed"])
def test_paused_steps_leave_the_warm_cache_alone(synth_model, monkeypatch, stream):
    """Steps run under ExpertCache.pause (a server's warm-up on made-up tokens) neither upload nor count; the policy
    acts again afterwards."""
    path = synth_model("qwen3moe", expert_type="F32", attn_type="F32")
    n_expert = moerun.load_model(path).args.n_experts
    usage = np.tile(np.arange(n_expert)[::-1], (3, 1))  # experts 0, 1, ... hottest first
    model = moerun.load_model(
        path,
        cache=CacheConfig(budgets=BUDGET, slots_per_layer=4, usage=usage, policy="lru"),
        options=RuntimeOptions(stream_devices=CPU_TOO if stream else frozenset({"cuda"})),
    )
    warm = [layer.resident.copy() for layer in cached_layers(model)]
    with model.expert_cache.pause():
        for i in range(6):
            model.forward(torch.tensor([0]), i)
    assert all((layer.resident == w).all() for layer, w in zip(cached_layers(model), warm))
    stats = model.expert_cache.stats
    assert stats.lookups.sum() == 0 and stats.uploads == 0
    for i in range(6):
        model.forward(torch.tensor([0]), i)
    assert model.expert_cache.stats.uploads > 0  # token 0's experts are not all among the warm ones


BENCH_MODEL = Path(__file__).resolve().parents[2] / "bench" / "models" / "bench-qwen3moe-q4k.gguf"  # trained, Q4_K
HELDOUT_TEXT = Path(__file__).resolve().parents[2] / "bench" / "data" / "heldout.txt"


def test_runtime_hit_rate_is_what_the_profile_predicts():
    """On the trained bench model (real routing), moerun's cache decoding held-out text token by token hits what
    `moeprep profile`'s held-out table (simulate_caches over the same routing) predicts for the same policy and
    slots, at 10, 25 and 50% of a layer's experts, cold and warm: within 3 points (the issue's bar)."""
    from moeprep.profile.collect import collect
    from moeprep.profile.heldout import HELDOUT_POLICIES, SIZES, simulate_caches
    from moeprep.profile.identity import identify_model

    plain = moerun.load_model(BENCH_MODEL)
    tokens = plain.tokenizer.encode(HELDOUT_TEXT.read_text()[:20000])
    chunks = np.array(tokens[:288]).reshape(3, 96)  # two chunks counted, the last one held out
    identity = identify_model(plain.gguf)
    counts, trace = collect(
        plain, chunks, np.array([False, False, True]), identity.moe_layers, identity.n_expert, identity.n_expert_used
    )  # what `moeprep profile` records
    table = simulate_caches(trace, counts)
    predicted = table.overall()  # [P, S, W]
    usage, heldout = counts.block_table(plain.args.n_layers), chunks[-1].tolist()
    for pi, policy in enumerate(HELDOUT_POLICIES):
        if policy.rule != "lru":  # the runtime runs every policy; lru cold and warm stand for them here
            continue
        for si, slots in enumerate(table.slots):
            config = CacheConfig(
                budgets=BUDGET,
                slots_per_layer=slots,
                policy="lru",
                uploads_per_layer_step=None,
                usage=usage if policy.warm else None,
            )
            cached = moerun.load_model(BENCH_MODEL, cache=config)
            for pos, token in enumerate(heldout):
                cached.forward(torch.tensor([token]), pos)
            measured = cached.expert_cache.stats.hit_rate
            print(
                f"{policy.name} {SIZES[si]:.0%} ({slots} slots): moerun {measured:.1%}, "
                f"profile {predicted[pi, si, 0]:.1%}"
            )  # docs/BENCHMARKS.md quotes these (pytest -s)
            assert abs(measured - predicted[pi, si, 0]) <= 0.03, (policy.name, SIZES[si], measured, predicted[pi, si])


def test_fixed_slots_must_fit_the_budget(synth_model):
    from moeprep.gguf.anatomy import DEFAULT_RESERVE, describe_model
    from moeprep.gguf.reader import open_gguf
    from moerun.cache.placement import place

    path = synth_model("qwen3moe", expert_type="F32", attn_type="F32")
    anatomy = describe_model(open_gguf(path))
    roomy = place(anatomy, [8 << 30])
    non_expert = roomy.used[0] - roomy.cache_bytes[0] - DEFAULT_RESERVE
    per_layer = anatomy.geometry.expert_bytes[0]
    budget = DEFAULT_RESERVE + non_expert + 4 * per_layer * len(roomy.moe_layers)  # room for 4 slots a layer
    fits = moerun.load_model(path, cache=CacheConfig(budgets=[budget], slots_per_layer=4))
    assert fits.expert_cache.placement.slots == (4, 4, 4)
    with pytest.raises(MoeprepError, match="--cache-slots 5: gpu 0's slots take"):
        moerun.load_model(path, cache=CacheConfig(budgets=[budget], slots_per_layer=5))


def test_glm5_next_through_the_cache(synth_model):
    """glm5-next's clamped SwiGLU reaches the cache's slots and the CPU's misses (its limit is per block; the
    synthetic model's limit is small enough to bite)."""
    from moeprep.synth.glm5_next import SWIGLU_CLAMP

    path = synth_model("glm5-next", expert_type="F32", attn_type="F32")
    plain = moerun.load_model(path)
    cached = moerun.load_model(path, cache=CacheConfig(budgets=BUDGET, slots_per_layer=2))
    layers = cached_layers(cached)
    assert layers and {(layer.activation.name, layer.activation.limit) for layer in layers} == {
        ("swiglu_clamp", SWIGLU_CLAMP)
    }
    prompt = torch.tensor(plain.tokenizer.encode("def bisect(a, x):\n    lo, hi = 0, len(a)"))
    torch.testing.assert_close(cached.forward(prompt), plain.forward(prompt), rtol=1e-4, atol=1e-4)
    for i, token in enumerate([5, 17, 99, 5]):
        pos = len(prompt) + i
        torch.testing.assert_close(
            cached.forward(torch.tensor([token]), pos), plain.forward(torch.tensor([token]), pos), rtol=1e-4, atol=1e-4
        )
    stats = cached.expert_cache.stats
    assert 0 < stats.hits.sum() < stats.lookups.sum()


def test_step35_clamp_reaches_the_cache(synth_model):
    """step35's clamped SwiGLU (swiglu_limited) reaches the cache's slots and the CPU's misses on the layer whose
    swiglu_clamp_exp is above 0, and only there (the synthetic model clamps its last trunk layer, enough to bite)."""
    from moeprep.synth.step35 import SWIGLU_CLAMP

    path = synth_model("step35", expert_type="F32", attn_type="F32")
    plain = moerun.load_model(path)
    cached = moerun.load_model(path, cache=CacheConfig(budgets=BUDGET, slots_per_layer=2))
    activations = {layer.layer: (layer.activation.name, layer.activation.limit) for layer in cached_layers(cached)}
    assert activations == {1: ("swiglu", 0.0), 2: ("swiglu_limited", SWIGLU_CLAMP)}
    prompt = torch.tensor(plain.tokenizer.encode("def bisect(a, x):\n    lo, hi = 0, len(a)"))
    torch.testing.assert_close(cached.forward(prompt), plain.forward(prompt), rtol=1e-4, atol=1e-4)
    for i, token in enumerate([5, 17, 99, 5]):
        pos = len(prompt) + i
        torch.testing.assert_close(
            cached.forward(torch.tensor([token]), pos), plain.forward(torch.tensor([token]), pos), rtol=1e-4, atol=1e-4
        )
