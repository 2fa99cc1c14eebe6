"""The architectures added beside the first eight, through what a user runs besides a plain forward pass: the expert
cache (outputs equal the all-resident model, prompt and decode), `moeprep profile` (counts for exactly the layers
that route), batched decode, and greedy generation. Their agreement with llama.cpp is tests/runtime/test_models.py's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import moerun
from moeprep.profile.format import read_profile
from moerun.cache.config import CacheConfig
from moerun.cache.experts import CachedExperts
from tests.runtime.conftest import profile_model

ARCHS = [
    "mimo2",
    "qwen35moe",
    "qwen3next",
    "minimax-m2",
    "llama4",
    "deepseek32",
    "dots1",
    "ernie4_5-moe",
    "hunyuan-moe",
    "granitehybrid",
    "nemotron_h_moe",
]
BUDGET = [8 << 30]  # more than the synthetic models need: slots_per_layer sets the slots
PROMPT = "def bisect(a, x):\n    lo, hi = 0, len(a)"


def routed_layers(path) -> list[int]:
    """Layers with a router, as the file says (ffn_gate_inp)."""
    from moeprep.gguf.reader import open_gguf

    names = {t.name for t in open_gguf(path).tensors}
    return sorted(int(n.split(".")[1]) for n in names if n.endswith(".ffn_gate_inp.weight"))


@pytest.mark.parametrize("arch", ARCHS)
def test_through_the_expert_cache(arch, synth_model):
    path = synth_model(arch, expert_type="F32", attn_type="F32")
    plain = moerun.load_model(path)
    slots = plain.args.n_experts // 2  # room for hits, and misses still
    cached = moerun.load_model(path, cache=CacheConfig(budgets=BUDGET, slots_per_layer=slots))
    layers = [m for m in cached.net.modules() if isinstance(m, CachedExperts)]
    assert [layer.layer for layer in layers] == routed_layers(path)
    prompt = torch.tensor(plain.tokenizer.encode(PROMPT))
    torch.testing.assert_close(cached.forward(prompt), plain.forward(prompt), rtol=1e-4, atol=1e-4)
    for i, token in enumerate([5, 17, 99, 5, 17]):
        pos = len(prompt) + i
        torch.testing.assert_close(
            cached.forward(torch.tensor([token]), pos), plain.forward(torch.tensor([token]), pos), rtol=1e-4, atol=1e-4
        )
    stats = cached.expert_cache.stats
    assert stats.lookups.sum() == (len(prompt) + 5) * plain.args.n_experts_used * len(layers)
    assert 0 < stats.hits.sum() < stats.lookups.sum()


@pytest.mark.parametrize("arch", ARCHS)
def test_profile_counts_the_routed_layers(arch, synth_model, tmp_path):
    path = synth_model(arch, skew=1.0)
    out = tmp_path / "p.moeprof"
    profile_model(path, out)
    counts = read_profile(out).counts
    assert list(counts.layers) == routed_layers(path)
    n_experts_used = moerun.load_model(path).args.n_experts_used
    totals = counts.selections.sum(axis=1)
    assert (totals > 0).all() and len(set(totals.tolist())) == 1 and totals[0] % n_experts_used == 0
    # skew 1: the quarter of the experts the router favours takes most of the choices
    top = np.sort(counts.selections, axis=1)[:, ::-1][:, : counts.selections.shape[1] // 4].sum(axis=1)
    assert (top > totals / 2).all()
    # the warm start takes the profile's hottest experts
    cached = moerun.load_model(path, cache=CacheConfig(budgets=BUDGET, slots_per_layer=2, profile=str(out)))
    for layer in (m for m in cached.net.modules() if isinstance(m, CachedExperts)):
        row = counts.selections[list(counts.layers).index(layer.layer)]
        assert set(layer.resident.tolist()) == set(np.argsort(-row, kind="stable")[:2].tolist())


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_decode_equals_each_sequence_alone(arch, synth_model):
    path = synth_model(arch, expert_type="F32", attn_type="F32")
    alone, batched = moerun.load_model(path), moerun.load_model(path, n_seq=2)
    prompts = [alone.tokenizer.encode(p) for p in ("def bisect(a, x):", "Once upon a time, in a land")]
    expected = [
        torch.stack([alone.forward(torch.tensor(p))[-1], alone.forward(torch.tensor([7]), len(p))[0]]) for p in prompts
    ]
    first = [batched.forward(torch.tensor(p), 0, seq=s)[-1] for s, p in reversed(list(enumerate(prompts)))][::-1]
    step = batched.forward_batch(torch.tensor([7, 7]), torch.tensor([len(p) for p in prompts]), torch.tensor([0, 1]))
    for s in range(2):
        torch.testing.assert_close(torch.stack([first[s], step[s]]), expected[s], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generation_follows_the_argmax(arch, synth_model):
    model = moerun.load_model(synth_model(arch, expert_type="F32", attn_type="F32"))
    prompt = model.tokenizer.encode("Once upon a time")
    out = list(moerun.generate(model, prompt, 8, moerun.greedy))
    seq = list(prompt)
    for token in out:
        assert token == int(model.forward(torch.tensor(seq))[-1].argmax())
        seq.append(token)


def test_llama4_with_several_experts_per_token_is_refused(synth_model, tmp_path):
    """Llama 4 scales the expert's input by its router weight, which moerun does for one expert per token only."""
    from gguf import GGUFValueType

    from moeprep.errors import MoeprepError
    from moeprep.gguf.reader import open_gguf
    from moeprep.gguf.writer import KVValue, write_gguf

    path = tmp_path / "two.gguf"
    write_gguf(
        path, open_gguf(synth_model("llama4")), kv_set={"llama4.expert_used_count": KVValue(2, GGUFValueType.UINT32)}
    )
    with pytest.raises(MoeprepError, match="2 experts per token is not supported"):
        moerun.load_model(path)


def test_ungated_experts_take_one_slot_bank_for_up(synth_model):
    """nemotron_h_moe's experts have no gate: up stands in for it, in the same slots (no second copy uploaded), so
    a slot holds what the cache's plan counted for it (up and down)."""
    path = synth_model("nemotron_h_moe", expert_type="F32", attn_type="F32")
    cached = moerun.load_model(path, cache=CacheConfig(budgets=BUDGET, slots_per_layer=4))
    layers = [m for m in cached.net.modules() if isinstance(m, CachedExperts)]
    assert layers
    for layer in layers:
        assert layer.banks[0] is layer.banks[1] and len(layer.uploads) == 2
