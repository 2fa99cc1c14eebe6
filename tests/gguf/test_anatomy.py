"""inspect's numbers against the tensors of the synthetic models, and the VRAM slot arithmetic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from gguf import GGUFValueType

from moeprep.cli import main
from moeprep.errors import MoeprepError
from moeprep.gguf.anatomy import DEFAULT_RESERVE, describe_model, model_geometry, moe_geometry, plan_vram
from moeprep.gguf.reader import open_gguf
from moeprep.gguf.roles import TensorRole
from moeprep.gguf.writer import KVValue, write_gguf
from moeprep.synth import SYNTH_ARCHS, write_synth_model

LEADING_DENSE = {
    "deepseek2": [0],
    "glm4moe": [0],
    "glm5-next": [0],
    "mimo2": [0],
    "llama4": [0, 2],
    "deepseek32": [0],
    "bailingmoe2": [0],
    "afmoe": [0],
    "lfm2moe": [0],
    "glm-dsa": [0],
    "dots1": [0],
    "ernie4_5-moe": [0],
    "nemotron_h_moe": [0, 2],
    "step35": [0],
    "laguna": [0],
    "kimi-k3": [0],
}  # llama4: interleaved; nemotron_h_moe: its Mamba-2 and attention layers have no FFN at all
NEXTN = {"glm5-next": [5], "step35": [3], "deepseek4": [3]}  # blocks with experts that no decoder runs


@pytest.fixture(scope="module")
def synth_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("anatomy")
    return {arch: write_synth_model(folder / f"{arch}.gguf", arch) for arch in SYNTH_ARCHS}


@pytest.mark.parametrize("arch", SYNTH_ARCHS)
def test_geometry_matches_tensors(arch: str, synth_models: dict[str, Path]) -> None:
    model = open_gguf(synth_models[arch])
    geo = model_geometry(model)
    exps = [t for t in model.tensors if "_exps" in t.name]
    blocks = sorted({int(t.name.split(".")[1]) for t in exps} - set(NEXTN.get(arch, [])))
    assert geo.moe_layers == blocks
    assert geo.dense_layers == LEADING_DENSE.get(arch, [])
    assert geo.nextn_layers == NEXTN.get(arch, [])
    assert geo.n_layer == model.get(f"{arch}.block_count")
    assert geo.n_expert == model.get(f"{arch}.expert_count") == exps[0].shape[0]
    assert geo.n_expert_used == model.get(f"{arch}.expert_used_count")
    for block in blocks:  # one expert = its slice of every *_exps tensor of the block
        total = sum(t.n_bytes for t in exps if t.name.startswith(f"blk.{block}."))
        assert geo.expert_bytes[block] * geo.n_expert == total


@pytest.mark.parametrize("arch", SYNTH_ARCHS)
def test_role_bytes_add_up(arch: str, synth_models: dict[str, Path]) -> None:
    model = open_gguf(synth_models[arch])
    anatomy = describe_model(model)
    assert anatomy.arch_known
    assert sum(s.n_bytes for s in anatomy.roles.values()) == sum(t.n_bytes for t in model.tensors)
    assert sum(s.n_tensors for s in anatomy.roles.values()) == len(model.tensors)
    expert_bytes = sum(t.n_bytes for t in model.tensors if "_exps" in t.name)
    assert anatomy.roles[TensorRole.EXPERT.value].n_bytes == expert_bytes
    assert anatomy.expert_share == pytest.approx(expert_bytes / synth_models[arch].stat().st_size)
    assert TensorRole.ATTENTION.value in anatomy.roles and TensorRole.ROUTER.value in anatomy.roles


def test_vram_slots_arithmetic(synth_models: dict[str, Path]) -> None:
    anatomy = describe_model(open_gguf(synth_models["qwen3moe"]))
    geo = anatomy.geometry
    slot = sum(geo.expert_bytes.values())
    non_expert = sum(s.n_bytes for r, s in anatomy.roles.items() if r != "expert")
    reserve = 1000
    # GPU 0 gets a third of the non-expert weights, GPU 1 two thirds; 3 slots fit on the first, 5 on the second.
    vram = [non_expert // 3 + reserve + 3 * slot + slot // 2, 2 * non_expert // 3 + reserve + 5 * slot + 1]
    plan = plan_vram(anatomy, vram, reserve)
    assert [g.slots_per_layer for g in plan.gpus] == [3, 5]
    assert plan.slot_bytes == slot and plan.slots_per_layer == min(8, geo.n_expert)
    assert [g.non_expert for g in plan.gpus] == [non_expert * v // sum(vram) for v in vram]
    assert plan_vram(anatomy, [reserve], reserve).slots_per_layer == 0  # nothing left after the reserve
    assert plan_vram(anatomy, [1 << 40]).slots_per_layer == geo.n_expert  # capped at the expert count


def test_inspect_json_and_text(synth_models: dict[str, Path]) -> None:
    path = synth_models["deepseek2"]
    result = CliRunner().invoke(main, ["inspect", str(path), "--json", "--vram", "24G,16G"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["arch"] == "deepseek2" and report["geometry"]["dense_layers"] == [0]
    assert [g["vram"] for g in report["vram"]["gpus"]] == [24 << 30, 16 << 30]
    assert report["vram"]["gpus"][0]["reserve"] == DEFAULT_RESERVE
    text = CliRunner().invoke(main, ["inspect", str(path), "--vram", "24G"]).stdout
    assert "deepseek2" in text and "1 dense: 0" in text and "slots/layer" in text


def test_bad_vram_option(synth_models: dict[str, Path]) -> None:
    result = CliRunner().invoke(main, ["inspect", str(synth_models["qwen3moe"]), "--vram", "lots"])
    assert result.exit_code == 2 and "not a size" in result.stderr


def test_split_set_reads_as_one_model(synth_models: dict[str, Path], tmp_path: Path) -> None:
    model = open_gguf(synth_models["qwen3moe"])
    paths = write_gguf(tmp_path / "split.gguf", model, split_max_size=model.file_size // 3)
    assert len(paths) >= 3
    split = describe_model(open_gguf(paths[0]))
    whole = describe_model(model)
    assert split.n_shards == len(paths)
    assert split.roles == whole.roles and split.geometry == whole.geometry


def test_unknown_architecture_says_so(synth_models: dict[str, Path], tmp_path: Path) -> None:
    from gguf import GGUFValueType

    from moeprep.gguf.writer import KVValue

    model = open_gguf(synth_models["qwen3moe"])
    out = write_gguf(
        tmp_path / "mystery.gguf", model, kv_set={"general.architecture": KVValue("mystery", GGUFValueType.STRING)}
    )[0]
    text = CliRunner().invoke(main, ["inspect", str(out)]).stdout
    assert "unknown: roles guessed from tensor names" in text
    assert describe_model(open_gguf(out)).roles == describe_model(model).roles


def test_dense_model_shows_its_anatomy(dense_model: Path) -> None:
    """A dense GGUF: layers and role bytes as for any model, the expert rows empty, no cache to plan."""
    model = open_gguf(dense_model)
    anatomy = describe_model(model)
    geo = anatomy.geometry
    assert not geo.is_moe and geo.moe_layers == [] and geo.dense_layers == [0, 1] and geo.n_expert == 0
    assert TensorRole.EXPERT.value not in anatomy.roles and anatomy.expert_share == 0
    assert sum(s.n_bytes for s in anatomy.roles.values()) == sum(t.n_bytes for t in model.tensors)
    assert plan_vram(anatomy, [24 << 30]) is None
    result = CliRunner().invoke(main, ["inspect", str(dense_model), "--vram", "24G"])
    assert result.exit_code == 0, result.output
    rows = dict(line.split(None, 1) if " " in line else (line, "") for line in result.stdout.splitlines() if line)
    assert rows["layers"] == "2 (0 MoE, 2 dense)" and rows["experts"] == "-" and rows["all"] == "experts   -"
    assert "no expert cache to plan" in rows["note"] and "slots/layer" not in result.stdout
    assert rows["dense_ffn"].split()[0] == "6"  # gate, up, down in each of the 2 layers
    report = json.loads(CliRunner().invoke(main, ["inspect", str(dense_model), "--json", "--vram", "24G"]).stdout)
    assert report["geometry"]["moe_layers"] == [] and report["vram"] is None


def test_commands_that_need_experts_refuse_a_dense_model(dense_model: Path) -> None:
    with pytest.raises(MoeprepError, match="not a Mixture-of-Experts model"):
        moe_geometry(open_gguf(dense_model))


def _window_line(path: Path) -> str | None:
    result = CliRunner().invoke(main, ["inspect", str(path)])
    assert result.exit_code == 0, result.output
    return next((line for line in result.stdout.splitlines() if line.startswith("window ")), None)


@pytest.mark.parametrize(
    ("arch", "line"),
    [
        # the arch's period, the full block last (gpt-oss: every other block, from 0; afmoe: three then one)
        ("gpt-oss", "S = sliding 16 (4 blocks), F = full (4 blocks): (SF) x4"),
        ("afmoe", "S = sliding 16 (6 blocks), F = full (2 blocks): (SSSF) x2"),
        # the full block first in each period (llama.cpp's dense_first); smallthinker's window is fixed at 4096
        ("laguna", "S = sliding 16 (6 blocks), F = full (2 blocks): (FSSS) x2"),
        ("smallthinker", "S = sliding 4096 (6 blocks), F = full (2 blocks): (FSSS) x2"),
        # a per-block list in the file; step35's NextN block is no decoder block, so 7 remain: a partial period
        ("gemma4", "S = sliding 16 (4 blocks), F = full (4 blocks): (SF) x4"),
        ("mimo2", "S = sliding 16 (4 blocks), F = full (4 blocks): (FS) x4"),
        ("step35", "S = sliding 16 (3 blocks), F = full (4 blocks): (FS) x3 + F"),
        # llama4's chunks: every 4th block attends to every position
        ("llama4", "C = chunked 8192 (6 blocks), F = full (2 blocks): (CCCF) x2"),
    ],
)
def test_inspect_shows_sliding_and_full_blocks(arch: str, line: str, tmp_path: Path) -> None:
    path = write_synth_model(tmp_path / f"{arch}.gguf", arch, n_layer=8)
    assert _window_line(path) == f"window        {line}"
    report = json.loads(CliRunner().invoke(main, ["inspect", str(path), "--json"]).stdout)
    assert sum(len(blocks) for blocks in report["geometry"]["windows"].values()) == 8 - len(NEXTN.get(arch, []))


def test_inspect_shows_no_window_line_where_every_block_attends_alike(tmp_path: Path) -> None:
    # no window at all; every block sliding (deepseek4's raw-key window: its attention line tells the blocks apart);
    # llama4 without chunks (attention.sliding_window 0)
    assert _window_line(write_synth_model(tmp_path / "qwen3moe.gguf", "qwen3moe", n_layer=8)) is None
    assert _window_line(write_synth_model(tmp_path / "deepseek4.gguf", "deepseek4", n_layer=8)) is None
    chunked = write_synth_model(tmp_path / "llama4.gguf", "llama4", n_layer=8)
    unchunked = tmp_path / "llama4-no-chunks.gguf"
    write_gguf(
        unchunked,
        open_gguf(chunked),
        kv_set={"llama4.attention.sliding_window": KVValue(0, GGUFValueType.UINT32)},
    )
    assert _window_line(unchunked) is None


def test_window_pattern_without_a_repeating_unit() -> None:
    from moeprep.gguf.anatomy import window_pattern

    assert window_pattern({"sliding 512": [0, 1, 3], "full": [2, 4]}) == (
        "S = sliding 512 (3 blocks), F = full (2 blocks): SSFSF"
    )
