"""A model over two GPUs computes what it computes on one (runs where two GPUs are; bench/gpu_multi.sh runs it):
the blocks split by bytes or by the expert cache's placement, eager steps and CUDA-graph decode steps cut at the
change of GPU. tests/runtime/test_devices.py checks the same layout on CPU stand-ins.

Self-contained (no conftest: the GPU machine runs it with --noconftest).
"""

from __future__ import annotations

import pytest
import torch

import moerun
from moeprep.synth import write_synth_model
from moerun.cache.config import CacheConfig
from moerun.graphs import graph_blockers

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")

PROMPT = "def bisect(a, x):\n    lo, hi = 0, len(a)\n    while lo < hi:"
BUDGET = 8 << 30  # the slots come from slots_per_layer


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_synth_model(
        tmp_path_factory.mktemp("multi-gpu") / "m.gguf",
        "qwen3moe",
        preset="small",
        n_layer=6,
        expert_type="Q4_K",
        attn_type="Q8_0",
        skew=0.8,
    )


def decode_logits(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Prefill, then `decode` (a graph replay where it can) each of `tokens`: the logits of each step, (N, V)."""
    model.forward(torch.tensor(prompt), 0)
    return torch.stack([model.decode(t, len(prompt) + i).float().cpu() for i, t in enumerate(tokens)])


@pytest.mark.parametrize("cache", [None, CacheConfig(budgets=[BUDGET], slots_per_layer=4)], ids=["plain", "cache"])
def test_two_gpus_equal_one(model_path, cache) -> None:
    one = moerun.load_model(model_path, device="cuda:0", cache=cache)
    two_cache = None if cache is None else CacheConfig(budgets=[BUDGET, BUDGET], slots_per_layer=4)
    two = moerun.load_model(model_path, device="cuda:0,cuda:1" if cache is None else "cuda", cache=two_cache)
    layout = two.net.layout
    assert layout.spans_devices and set(layout.block) == {0, 1}
    assert {p.device for p in two.net.blocks[0].parameters()} == {torch.device("cuda", 0)}
    assert {p.device for p in two.net.blocks[-1].parameters()} == {torch.device("cuda", 1)}
    assert not graph_blockers(two)
    prompt = one.tokenizer.encode(PROMPT)
    torch.testing.assert_close(
        two.forward(torch.tensor(prompt)).float().cpu(),
        one.forward(torch.tensor(prompt)).float().cpu(),
        rtol=1e-4,
        atol=1e-4,
    )
    tokens = [5, 17, 99, 5, 17, 99]
    graphs = decode_logits(two, prompt, tokens)
    torch.testing.assert_close(graphs, decode_logits(one, prompt, tokens), rtol=1e-4, atol=1e-4)
    eager = moerun.load_model(model_path, device=two.net.layout.devices, cache=two_cache)  # a fresh cache, no graphs
    eager.decode_graphs = None
    eager.forward(torch.tensor(prompt))
    torch.testing.assert_close(decode_logits(eager, prompt, tokens), graphs, rtol=1e-4, atol=1e-4)
