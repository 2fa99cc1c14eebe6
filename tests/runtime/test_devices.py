"""A model over several devices, on CPU devices standing in for GPUs: the device list, the block split (by bytes,
or the expert cache's placement), the step copied per device, and the same logits as on one device with the cache
on and off. The GPU side (two real GPUs) is bench/check_multi_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import moerun
from moeprep.errors import MoeprepError
from moerun.cache.config import CacheConfig
from moerun.cache.experts import CachedExperts
from moerun.devices import DeviceMap, resolve_devices, split_blocks
from moerun.step import Step

CPU = torch.device("cpu")
BUDGETS = [8 << 30, 8 << 30]  # ample for the synthetic models: the slots come from slots_per_layer
PROMPT = "def bisect(a, x):\n    lo, hi = 0, len(a)"


@pytest.fixture
def gpus(monkeypatch):
    """Pretend `n` GPUs are visible (only the device list is resolved: nothing touches CUDA)."""

    def visible(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "a pretended GPU")

    return visible


def run_text(model, n_decode: int = 4) -> torch.Tensor:
    """Logits of a prompt, then of a few single-token decode steps: (T + n_decode, V)."""
    prompt = torch.tensor(model.tokenizer.encode(PROMPT))
    rows = [model.forward(prompt)]
    for i, token in enumerate([5, 17, 99, 5][:n_decode]):
        rows.append(model.forward(torch.tensor([token]), len(prompt) + i))
    return torch.cat(rows)


# ---- the block split


def test_split_blocks_equal_shares() -> None:
    assert split_blocks([10] * 8, 1) == [0] * 8
    assert split_blocks([10] * 8, 2) == [0] * 4 + [1] * 4
    assert split_blocks([10] * 8, 4) == [0, 0, 1, 1, 2, 2, 3, 3]
    # the embedding's bytes count on the first device, the head's on the last: blocks shift away from them
    assert split_blocks([10] * 8, 2, first=40) == [0] * 2 + [1] * 6
    assert split_blocks([10] * 8, 2, last=40) == [0] * 6 + [1] * 2


def test_split_blocks_by_bytes_not_counts() -> None:
    sizes = [40, 10, 10, 10, 10, 10, 10, 10]  # one big block takes a whole share
    split = split_blocks(sizes, 2)
    assert split == sorted(split) and split.count(0) == 2
    halves = [sum(s for s, d in zip(sizes, split) if d == g) for g in (0, 1)]
    assert abs(halves[0] - halves[1]) <= max(sizes)


@pytest.mark.parametrize("n", [2, 3, 5])
def test_split_blocks_contiguous_and_every_device_used(n: int) -> None:
    rng = np.random.default_rng(n)
    sizes = rng.integers(50, 150, 24).tolist()
    split = split_blocks(sizes, n, first=100, last=100)
    assert split == sorted(split) and set(split) == set(range(n))
    share = (sum(sizes) + 200) / n
    for g in range(n):
        mine = sum(s for s, d in zip(sizes, split) if d == g) + 100 * (g == 0) + 100 * (g == n - 1)
        assert abs(mine - share) <= max(sizes) + 100, (g, mine, share)


def test_device_map_runs() -> None:
    layout = DeviceMap((torch.device("cuda", 0), torch.device("cuda", 1)), (0, 0, 0, 1, 1))
    assert layout.runs() == [(torch.device("cuda", 0), slice(0, 3)), (torch.device("cuda", 1), slice(3, 5))]
    assert layout.first == torch.device("cuda", 0) and layout.last == torch.device("cuda", 1)
    assert layout.spans_devices
    stand_ins = DeviceMap((CPU, CPU), (0, 0, 1, 1))
    assert not stand_ins.spans_devices and [s for _, s in stand_ins.runs()] == [slice(0, 2), slice(2, 4)]


# ---- the device list


def test_resolve_cpu_stand_ins() -> None:
    assert resolve_devices("cpu") == [CPU]
    assert resolve_devices("cpu", 3) == [CPU] * 3
    assert resolve_devices("cpu,cpu") == [CPU] * 2
    assert resolve_devices(["cpu", torch.device("cpu")], 2) == [CPU] * 2


def test_resolve_gpus(gpus) -> None:
    gpus(4)
    cuda = [torch.device("cuda", i) for i in range(4)]
    assert resolve_devices("cuda") == cuda[:1]
    assert resolve_devices("cuda", 2) == cuda[:2]
    assert resolve_devices("cuda:1", 2) == cuda[1:3]
    assert resolve_devices("cuda", every_gpu=True) == cuda
    assert resolve_devices("cuda:2", every_gpu=True) == cuda[2:3]  # a GPU named by index stays one
    assert resolve_devices("cuda:0, cuda:3") == [cuda[0], cuda[3]]


@pytest.mark.parametrize(
    "device,n,message",
    [
        ("cuda", 3, "3 budgets .* 2 GPU"),
        ("cuda:0,cuda:1", 3, "3 budgets for the 2 devices"),
        ("cuda:2", None, "cuda:2: 2 GPU"),
        ("cuda:1,cuda:1", None, "listed twice"),
        ("cpu,cuda:0", None, "mixes device types"),
        ("gpu0", None, "not a device"),
        ("cpu,cpu", 3, "3 budgets for the 2 devices"),
    ],
)
def test_resolve_refuses_in_one_line(gpus, device, n, message) -> None:
    gpus(2)
    with pytest.raises(MoeprepError, match=message) as e:
        resolve_devices(device, n)
    assert "\n" not in str(e.value)


def test_more_budgets_than_gpus_is_refused_before_loading(gpus, synth_model) -> None:
    gpus(1)
    with pytest.raises(MoeprepError, match="2 budgets") as e:
        moerun.load_model(synth_model("qwen3moe"), device="cuda", cache=CacheConfig(budgets=BUDGETS))
    assert "\n" not in str(e.value)


# ---- the step on each device


def test_step_copied_once_per_device() -> None:
    meta = torch.device("meta")  # a second device that needs no GPU: the copies' placement is what is checked
    step = Step(torch.arange(4, 8), n_slots=8, seqs=torch.tensor([0, 1, 0, 1]))
    assert step.on(CPU) is step
    there = step.on(meta)
    assert there.positions.device == meta and there.seqs.device == meta and there.n_slots == 8
    assert step.on(meta) is there and there.on(meta) is there  # built once, whichever copy is asked
    assert there.on(CPU) is step
    step.mask()
    assert there._masks == {}  # each device builds its own masks


# ---- whole models on two CPU stand-ins


@pytest.mark.parametrize("arch", ["qwen3moe", "deepseek2", "gpt-oss", "glm5-next"])
def test_two_stand_ins_give_the_same_logits(arch, synth_model) -> None:
    path = synth_model(arch, n_layer=6)  # glm5-next: 5 trunk blocks and its (unrun) NextN block
    one = moerun.load_model(path)
    two = moerun.load_model(path, device="cpu,cpu")
    assert two.net.layout.devices == (CPU, CPU)
    assert sorted(set(two.net.layout.block)) == [0, 1]  # both stand-ins run blocks
    assert two.net.layout.block == tuple(sorted(two.net.layout.block))
    torch.testing.assert_close(run_text(two), run_text(one), rtol=0, atol=0)


def test_cache_over_two_stand_ins_follows_the_placement(synth_model) -> None:
    path = synth_model("qwen3moe", expert_type="F32", attn_type="F32", n_layer=4)
    reference = moerun.load_model(path)
    one = moerun.load_model(path, cache=CacheConfig(budgets=BUDGETS[:1], slots_per_layer=3))
    two = moerun.load_model(path, cache=CacheConfig(budgets=BUDGETS, slots_per_layer=3))  # "cpu": two stand-ins
    cache = two.expert_cache
    assert cache.devices == (CPU, CPU)
    assert two.net.layout.block == cache.placement.device == (0, 0, 1, 1)  # equal budgets, equal halves
    for layer in (m for m in two.net.modules() if isinstance(m, CachedExperts)):
        assert layer.banks[0].data.device == cache.device_of(layer.layer) and layer.copy_stream is None
    logits = run_text(two)
    torch.testing.assert_close(logits, run_text(one), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, run_text(reference), rtol=1e-4, atol=1e-4)
    assert one.expert_cache.stats.hits.tolist() == cache.stats.hits.tolist()  # the same policy decisions
    assert 0 < cache.stats.hits.sum() < cache.stats.lookups.sum()


def test_uneven_budgets_give_the_bigger_one_more_blocks(synth_model) -> None:
    path = synth_model("qwen3moe", n_layer=6)
    model = moerun.load_model(path, device=["cpu", "cpu"], cache=CacheConfig(budgets=[12 << 30, 4 << 30]))
    block = model.net.layout.block
    assert block == model.expert_cache.placement.device and block == tuple(sorted(block))
    assert block.count(0) > block.count(1) > 0


@pytest.mark.parametrize("n", [2, 3])
def test_equal_budgets_split_the_blocks_evenly(n, synth_model) -> None:
    model = moerun.load_model(synth_model("qwen3moe", n_layer=6), cache=CacheConfig(budgets=[8 << 30] * n))
    assert model.net.layout.devices == (CPU,) * n
    assert model.net.layout.block == tuple(sorted(model.net.layout.block))
    assert np.bincount(model.net.layout.block).tolist() == [6 // n] * n


def test_cache_over_two_stand_ins_with_a_dense_lead_block(synth_model) -> None:
    path = synth_model("deepseek2", expert_type="F32", attn_type="F32", n_layer=5)  # block 0 dense, MLA
    one = moerun.load_model(path, cache=CacheConfig(budgets=BUDGETS[:1], slots_per_layer=2))
    two = moerun.load_model(path, cache=CacheConfig(budgets=BUDGETS, slots_per_layer=2))
    layout, placement = two.net.layout, two.expert_cache.placement
    assert placement.slots[0] == 0 and layout.block[0] == layout.block[1] == 0  # the dense block with its neighbour
    assert layout.block[-1] == 1
    torch.testing.assert_close(run_text(two, 2), run_text(one, 2), rtol=1e-5, atol=1e-5)


def test_cli_refuses_more_budgets_than_gpus_with_exit_2(gpus, synth_model) -> None:
    from click.testing import CliRunner

    from moerun.cli import main

    gpus(1)
    result = CliRunner().invoke(
        main,
        ["-m", str(synth_model("qwen3moe")), "--device", "cuda", "--vram-budget", "24G,24G", "-p", "hi", "-n", "1"],
    )
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines()[0] == "moerun: running on cuda (a pretended GPU)"
    assert "2 budgets" in result.stderr and result.stderr.count("\n") == 2  # the device line, then the error
