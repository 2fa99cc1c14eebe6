"""`moeprep publish` and `publish --check` on a synthetic model: the folder, its card (read back with
huggingface_hub), its checksums (also through `sha256sum -c`), its shards through llama.cpp; tampering, interrupts
and bad input."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from gguf import GGUFValueType, Keys
from huggingface_hub import ModelCard

from moeprep import publish as publish_module
from moeprep.cli import main
from moeprep.errors import MoeprepError
from moeprep.gguf.reader import open_gguf
from moeprep.gguf.writer import KVValue, write_gguf
from moeprep.profile.export import EXPERT_USAGE_KEY, bake_profile
from moeprep.profile.format import write_profile
from moeprep.profile.identity import identify_model
from moeprep.publish import CARD_FILE, SUMS_FILE, PublishRequest, check_folder, file_sha256, publish_folder
from moeprep.quant.imatrix import write_imatrix_gguf
from moeprep.quant.plan import parse_type, plan_requant
from moeprep.quant.quantize import quantize_model
from moeprep.synth import write_synth_model
from tests.oracle import llama_eval
from tests.profile.conftest import make_profile

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "qwen3moe.toml"
LIMIT = 10 << 20  # forces the 27 MiB model into three shards
TOKENS = list(range(1, 33))


def moeprep(*args: str | Path, code: int = 0) -> str:
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == code, (result.output, result.exception)
    if code == 2:  # a MoeprepError is one line; a click usage error starts with the usage
        assert result.stderr.count("\n") == 1 or result.stderr.startswith("Usage:"), result.stderr
        return result.stderr
    return result.stdout


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A baked Q4_K-attention model with license, languages and source URL, its profile and an imatrix."""
    d = tmp_path_factory.mktemp("inputs")
    small = open_gguf(write_synth_model(d / "small.gguf", "qwen3moe", preset="small", skew=0.5))
    quantize_model(small, d / "q.gguf", plan_requant(small, parse_type("Q4_K")), progress=False)
    write_gguf(
        d / "meta.gguf",
        open_gguf(d / "q.gguf"),
        kv_set={
            Keys.General.LICENSE: KVValue("apache-2.0", GGUFValueType.STRING),
            Keys.General.LANGUAGES: KVValue(["en", "zh"], GGUFValueType.ARRAY, GGUFValueType.STRING),
            Keys.General.SOURCE_REPO_URL: KVValue("https://huggingface.co/Org/Source-Model", GGUFValueType.STRING),
        },
    )
    profile = make_profile(identity=identify_model(open_gguf(d / "meta.gguf")))
    write_profile(d / "p.moeprof", profile)
    bake_profile(profile, "p.moeprof", str(d / "meta.gguf"), d / "model.gguf")
    write_imatrix_gguf(
        d / "imatrix.gguf",
        {"blk.0.attn_q.weight": (np.ones(256, np.float32), np.array([4]))},
        ["calibration.txt"],
        4,
        64,
    )
    return {"model": d / "model.gguf", "profile": d / "p.moeprof", "imatrix": d / "imatrix.gguf"}


@pytest.fixture(scope="module")
def folder(inputs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("pub") / "upload"
    stdout = moeprep(
        "publish",
        inputs["model"],
        out,
        "--base-model",
        "Org/Base-Model",
        "--profile",
        inputs["profile"],
        "--imatrix",
        inputs["imatrix"],
        "--recipe",
        RECIPE,
        "--quantized-by",
        "tester",
        "--repo-id",
        "tester/Model-GGUF",
        "--tag",
        "synthetic",
        "--split-max-size",
        str(LIMIT),
    )
    assert "model re-split to fit the size limit" in stdout and f"hf upload tester/Model-GGUF {out}" in stdout
    return out


def test_folder_layout(folder: Path, inputs: dict[str, Path]) -> None:
    names = sorted(p.name for p in folder.iterdir())
    shards = [f"model-{i:05d}-of-00003.gguf" for i in (1, 2, 3)]
    assert names == sorted([CARD_FILE, SUMS_FILE, *shards, "model.moeprof", "model.imatrix.gguf", "qwen3moe.toml"])
    assert all((folder / s).stat().st_size <= LIMIT for s in shards)
    assert (folder / "qwen3moe.toml").read_bytes() == RECIPE.read_bytes()
    assert inputs["model"].is_file(), "the user's model is never moved"
    assert list(folder.parent.iterdir()) == [folder], "no staging folder left behind"


def test_shards_are_the_same_model(folder: Path, inputs: dict[str, Path]) -> None:
    src, out = open_gguf(inputs["model"]), open_gguf(folder / "model-00001-of-00003.gguf")
    assert [t.name for t in out.tensors] == [t.name for t in src.tensors]
    for t in src.tensors:
        assert bytes(out.raw(out.tensor(t.name))) == bytes(src.raw(t)), t.name
    assert out.get(EXPERT_USAGE_KEY) == src.get(EXPERT_USAGE_KEY)


def test_card_metadata_reads_back_with_huggingface_hub(folder: Path) -> None:
    card = ModelCard.load(folder / CARD_FILE)
    data = card.data.to_dict()
    assert data["base_model"] == "Org/Base-Model" and data["base_model_relation"] == "quantized"
    assert data["quantized_by"] == "tester" and data["pipeline_tag"] == "text-generation"
    assert data["license"] == "apache-2.0" and data["language"] == ["en", "zh"]  # from the GGUF
    assert {"gguf", "moe", "qwen3moe", "synthetic"} <= set(data["tags"])


def test_card_body(folder: Path) -> None:
    text = ModelCard.load(folder / CARD_FILE).text
    for name in os.listdir(folder):
        if name not in (CARD_FILE, SUMS_FILE):
            assert f"`{name}` |" in text and f"`{file_sha256(folder / name)}`" in text, name
    assert "| attention | 16 |" in text and "Q4_K x16" in text and "| expert | 12 |" in text  # tensor types
    assert "held-out: 2 chunks" in text and "lru-warm" in text  # the profile's held-out table
    assert "hf download tester/Model-GGUF --local-dir Model-GGUF" in text and "huggingface-cli download" in text
    assert "moerun -m Model-GGUF/model-00001-of-00003.gguf" in text and "--expert-profile model.moeprof" in text
    assert "llama-cli -m Model-GGUF/model-00001-of-00003.gguf" in text and EXPERT_USAGE_KEY in text
    assert "attention requantized to Q4_K" in text


def test_checksums(folder: Path) -> None:
    lines = (folder / SUMS_FILE).read_text().splitlines()
    listed = {line.split("  ", 1)[1]: line.split("  ", 1)[0] for line in lines}
    assert set(listed) == set(os.listdir(folder)) - {SUMS_FILE}
    for name, sha in listed.items():
        assert hashlib.sha256((folder / name).read_bytes()).hexdigest() == sha, name
    done = subprocess.run(["sha256sum", "-c", SUMS_FILE], cwd=folder, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_check_passes(folder: Path) -> None:
    report = check_folder(folder)
    assert report.ok, report.problems
    assert report.files == 7 and report.model == "model-00001-of-00003.gguf"
    assert moeprep("publish", "--check", folder).startswith("OK: ")


def test_llama_cpp_loads_the_shards(folder: Path) -> None:
    logits = llama_eval(folder / "model-00001-of-00003.gguf", TOKENS).logits
    assert logits.shape[0] == len(TOKENS) and np.isfinite(logits).all()


def _copy(folder: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)  # real copies: the tests below damage them
    return copy


def test_tampered_shard_fails_check(folder: Path, tmp_path: Path) -> None:
    copy = _copy(folder, tmp_path)
    shard = copy / "model-00002-of-00003.gguf"
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF
    shard.write_bytes(bytes(data))
    out = moeprep("publish", "--check", copy, code=1)
    assert out.startswith("FAILED") and "model-00002-of-00003.gguf: sha256 does not match SHA256SUMS" in out


def test_missing_shard_and_stray_file_fail_check(folder: Path, tmp_path: Path) -> None:
    copy = _copy(folder, tmp_path)
    (copy / "model-00003-of-00003.gguf").unlink()
    (copy / "notes.txt").write_text("hello")
    problems = "\n".join(check_folder(copy).problems)
    assert "model-00003-of-00003.gguf: listed in SHA256SUMS but missing" in problems
    assert "split set is incomplete" in problems and "notes.txt: in the folder but not in SHA256SUMS" in problems


def test_card_without_required_fields_fails_check(folder: Path, tmp_path: Path) -> None:
    copy = _copy(folder, tmp_path)
    card = copy / CARD_FILE
    card.write_text(card.read_text().replace("base_model_relation: quantized\n", "").replace("- moe\n", ""))
    sums = copy / SUMS_FILE  # checksums made to agree, so only the card is wrong
    sums.write_text("".join(f"{file_sha256(copy / n)}  {n}\n" for n in sorted(os.listdir(copy)) if n != SUMS_FILE))
    problems = check_folder(copy).problems
    assert len(problems) == 2, problems
    assert any("base_model_relation is None" in p for p in problems) and any("tags" in p for p in problems)
    card.write_text("---\nbase_model: [unclosed\n---\n# card\n")
    assert any("metadata does not parse" in p for p in check_folder(copy).problems)


def _flip_a_byte(path: Path, offset: int) -> None:
    """An edit in place, as gguf-set-metadata makes one: the same inode, one byte changed."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_split_set_within_limit_is_copied_not_shared(folder: Path, tmp_path: Path) -> None:
    source = tmp_path / "source"
    shutil.copytree(folder, source)  # a model of the user's own, to damage the copy of
    before = {p.name: p.read_bytes() for p in source.iterdir()}
    out = tmp_path / "again"
    result = publish_folder(PublishRequest(source / "model-00001-of-00003.gguf", out, progress=False))
    assert result.placed in ("reflink", "copy")  # which one: the file system's (ext4: copy; btrfs, XFS: reflink)
    assert result.model_files == [f"model-{i:05d}-of-00003.gguf" for i in (1, 2, 3)]
    for name in result.model_files:
        assert (out / name).stat().st_ino != (source / name).stat().st_ino
        assert (out / name).read_bytes() == before[name]
    assert ModelCard.load(out / CARD_FILE).data.base_model == "Org/Source-Model"  # from general.source.repo_url
    assert check_folder(out).ok

    _flip_a_byte(out / "model-00002-of-00003.gguf", 1000)
    assert {p.name: p.read_bytes() for p in source.iterdir()} == before, "the user's model is unchanged"
    problems = check_folder(out).problems
    assert problems == ["model-00002-of-00003.gguf: sha256 does not match SHA256SUMS (changed or damaged)"]


def test_copy_without_reflinks_streams_the_bytes(folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file system without reflinks (FICLONE refused) nor copy_file_range between the files: a plain copy."""
    import errno

    def refused(*args):  # noqa: ANN002, ANN202
        raise OSError(errno.EOPNOTSUPP, "not supported")

    monkeypatch.setattr(publish_module.fcntl, "ioctl", refused)
    monkeypatch.setattr(publish_module, "_kernel_copy", lambda *args: False)
    monkeypatch.setattr(publish_module, "COPY_CHUNK", 1 << 20)  # several chunks per shard
    out = tmp_path / "copied"
    first = folder / "model-00001-of-00003.gguf"
    result = publish_folder(PublishRequest(first, out, progress=False))
    assert result.placed == "copy" and check_folder(out).ok
    for name in result.model_files:
        assert (out / name).read_bytes() == (folder / name).read_bytes()


def test_hardlink_on_request(folder: Path, tmp_path: Path) -> None:
    source = tmp_path / "source"
    shutil.copytree(folder, source)
    out = tmp_path / "linked"
    stdout = moeprep("publish", source / "model-00001-of-00003.gguf", out, "--hardlink")
    assert "model hard-linked (--hardlink: an edit in place of the folder's files edits it too)" in stdout
    for i in (1, 2, 3):
        name = f"model-{i:05d}-of-00003.gguf"
        assert (out / name).stat().st_ino == (source / name).stat().st_ino  # no bytes written
    assert moeprep("publish", "--check", out).startswith("OK: ")
    _flip_a_byte(out / "model-00003-of-00003.gguf", 2000)  # the risk --hardlink takes: the source changes too
    assert (source / "model-00003-of-00003.gguf").read_bytes() == (out / "model-00003-of-00003.gguf").read_bytes()
    assert "model-00003-of-00003.gguf: sha256 does not match" in moeprep("publish", "--check", out, code=1)


def test_interrupted_publish_leaves_nothing_that_passes(
    inputs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupt(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise KeyboardInterrupt

    monkeypatch.setattr(publish_module, "build_card", interrupt)
    out = tmp_path / "upload"
    out.mkdir()
    with pytest.raises(KeyboardInterrupt):
        publish_folder(PublishRequest(inputs["model"], out, "Org/Base-Model", split_max_size=LIMIT))
    assert list(tmp_path.iterdir()) == [out] and not list(out.iterdir())
    assert not check_folder(out).ok


def test_bad_input_is_one_line(inputs: dict[str, Path], tmp_path: Path) -> None:
    model = inputs["model"]
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    cases = [
        (["publish", model, tmp_path / "full", "--base-model", "O/M"], "exists and is not an empty folder"),
        (["publish", model, tmp_path / "a", "--base-model", "a b"], "not a Hugging Face repo id"),
        (["publish", inputs["imatrix"], tmp_path / "a", "--base-model", "O/M"], "not a Mixture-of-Experts model"),
        (["publish", model, tmp_path / "a", "--base-model", "O/M", "--split-max-size", "60G"], "50 GB file limit"),
        (
            ["publish", model, tmp_path / "a", "--base-model", "O/M", "--profile", tmp_path / "none.moeprof"],
            "no such profile file",
        ),
        (["publish", tmp_path / "none.gguf", tmp_path / "a", "--base-model", "O/M"], "no such file"),
        (["publish", "--check", tmp_path / "nowhere"], "no such folder"),
        (["publish", "--check", tmp_path / "full", model], "--check takes only the folder"),
        (["publish", model], "give MODEL and OUTDIR"),
    ]
    for args, message in cases:
        assert message in moeprep(*args, code=2), args
    assert not (tmp_path / "a").exists()


def test_profile_of_another_model_is_refused(inputs: dict[str, Path], tmp_path: Path) -> None:
    write_profile(tmp_path / "other.moeprof", make_profile())
    out = moeprep(
        "publish",
        inputs["model"],
        tmp_path / "a",
        "--base-model",
        "O/M",
        "--profile",
        tmp_path / "other.moeprof",
        code=2,
    )
    assert "made for another model" in out


def test_base_model_is_required_without_a_source_url(tmp_path: Path) -> None:
    model = write_synth_model(tmp_path / "m.gguf", "qwen3moe")
    with pytest.raises(MoeprepError, match="give --base-model ORG/NAME"):
        publish_folder(PublishRequest(model, tmp_path / "out"))


@pytest.mark.parametrize(
    "given, shown",
    [
        ("wikitext", "wikitext"),
        ("Salesforce/wikitext", "Salesforce/wikitext"),
        ("/home/me/data/calib.txt", "calib.txt"),
        ("data/calib.jsonl", "calib.jsonl"),
        ("./corpus", "corpus"),
    ],
)
def test_card_shows_local_datasets_by_name_only(given: str, shown: str) -> None:
    from moeprep.publish import public_dataset_name

    assert public_dataset_name(given) == shown
