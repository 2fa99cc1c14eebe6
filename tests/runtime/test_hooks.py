"""Routing and activation hooks: what fires, with which shapes, and nothing at all when none is registered."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import moerun
from moerun.hooks import Hooks


@pytest.mark.parametrize("arch", ["qwen3moe", "deepseek2", "gpt-oss"])
def test_routing_hook_fires_per_moe_layer(arch, synth_model):
    model = moerun.load_model(synth_model(arch))
    events = []
    handle = model.add_routing_hook(events.append)
    tokens = torch.tensor(model.tokenizer.encode("one two three four five"))
    model.forward(tokens[:3])
    model.forward(tokens[3:], 3)
    moe_layers = list(range(model.args.n_dense_lead, model.args.n_layers))
    assert [e.layer for e in events] == moe_layers * 2
    for e, start, T in [(events[0], 0, 3), (events[len(moe_layers)], 3, len(tokens) - 3)]:
        K = model.args.n_experts_used
        assert e.positions.tolist() == list(range(start, start + T))
        assert e.expert_ids.shape == (T, K) and e.expert_ids.dtype == torch.int64
        assert e.weights.shape == (T, K) and e.weights.dtype == torch.float32
        assert ((0 <= e.expert_ids) & (e.expert_ids < model.args.n_experts)).all()
    handle.remove()
    model.forward(tokens[:2])
    assert len(events) == 2 * len(moe_layers)


@pytest.mark.parametrize(
    "arch,options",
    [("qwen3moe", {}), ("qwen2moe", {}), ("deepseek2", {}), ("deepseek2", {"mla_split": True}), ("gpt-oss", {})],
)
def test_activation_hook_sees_every_matmul_input(arch, options, synth_model):
    model = moerun.load_model(synth_model(arch, **options))
    events = []
    model.add_activation_hook(events.append)
    T = 5
    model.forward(torch.tensor(model.tokenizer.encode("a b c d e f g h")[:T]))
    infos = {t.name: t for t in model.gguf.tensors}
    for e in events:
        assert e.x.dtype == torch.float32 and e.x.ndim == 2
        assert e.x.shape[1] == infos[e.tensor_name].shape[-1], e.tensor_name  # in_features = GGUF row length
        assert (e.expert is not None) == ("_exps." in e.tensor_name)
    named = {e.tensor_name for e in events}
    matrices = {
        n
        for n, t in infos.items()
        if n.endswith(".weight") and n != "token_embd.weight" and (len(t.shape) >= 2 or ".ffn_gate_inp_shexp." in n)
    }  # qwen2moe's shared gate is a (D,) row
    assert named == matrices, f"never fired: {sorted(matrices - named)}; unexpected: {sorted(named - matrices)}"
    # each MoE layer's routed rows add up to T * K for every expert tensor
    routed = Counter()
    for e in events:
        if e.expert is not None:
            routed[e.tensor_name] += e.x.shape[0]
    assert set(routed.values()) == {T * model.args.n_experts_used}


def test_no_hook_means_no_event_built(synth_model, monkeypatch):
    model = moerun.load_model(synth_model("qwen3moe"))

    def refuse(*args, **kwargs):
        raise AssertionError("an event was built with no hook registered")

    monkeypatch.setattr(Hooks, "fire_routing", refuse)
    monkeypatch.setattr(Hooks, "fire_activation", refuse)
    model.forward(torch.tensor(model.tokenizer.encode("no hooks here")))
