"""`moeprep prepare` end to end on a tiny synthetic model and local calibration text: every step, the resulting
upload folder, resuming (finished steps skipped, changed inputs redone) and refusals before any work."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from huggingface_hub import ModelCard

from moeprep.cli import main
from moeprep.gguf.reader import open_gguf
from moeprep.profile.export import EXPERT_USAGE_KEY
from moeprep.profile.format import read_profile
from moeprep.publish import CARD_FILE, check_folder
from moeprep.quant.imatrix import QUANTIZE_IMATRIX_DATASET
from moeprep.synth import write_synth_model
from tests.oracle import llama_eval

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "qwen3moe.toml"
CALIBRATION = ROOT / "moeprep" / "data" / "calibration.txt"
# tiny calibration: 4 chunks of 32 tokens, one held out
FAST = ["--ctx", "32", "--chunks", "4", "--threads", "1", "--base-model", "Qwen/Qwen3-30B-A3B"]
STEPS = ["calibrate", "quantize", "profile", "bake", "publish"]


def moeprep(*args: str | Path, code: int = 0) -> str:
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == code, (result.output, result.exception)
    if code == 2:
        assert result.stderr.count("\n") == 1 or result.stderr.startswith("Usage:"), result.stderr
        return result.stderr
    return result.stdout


def ran(stdout: str) -> list[str]:
    return [s for s in STEPS if f"] {s}: done in" in stdout]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synth_model(tmp_path_factory.mktemp("src") / "tiny-moe.gguf", "qwen3moe", skew=0.5)


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local copy of the shipped calibration text (tests change it)."""
    path = tmp_path_factory.mktemp("text") / "calibration.txt"
    shutil.copyfile(CALIBRATION, path)
    return path


@pytest.fixture(scope="module")
def prepared(model: Path, text: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("prep") / "out"
    stdout = moeprep("prepare", RECIPE, model, out, "--dataset", text, *FAST)
    return out, stdout


def test_every_step_runs(prepared: tuple[Path, str]) -> None:
    out, stdout = prepared
    assert ran(stdout) == STEPS
    assert f"moeprep publish --check {out / 'upload'}" in stdout and "hf upload" in stdout


def test_upload_folder(prepared: tuple[Path, str], model: Path, text: Path) -> None:
    upload = prepared[0] / "upload"
    assert check_folder(upload).ok
    names = sorted(p.name for p in upload.iterdir())
    assert names == sorted(
        [
            "README.md",
            "SHA256SUMS",
            "qwen3moe.toml",
            "tiny-moe-attn-Q4_K.gguf",
            "tiny-moe-attn-Q4_K.imatrix.gguf",
            "tiny-moe-attn-Q4_K.moeprof",
        ]
    )
    published, source = open_gguf(upload / "tiny-moe-attn-Q4_K.gguf"), open_gguf(model)
    assert published.get("moeprep.attn_type") == "Q4_K" and published.get(EXPERT_USAGE_KEY) is not None
    assert published.get(QUANTIZE_IMATRIX_DATASET) == str(text)  # quantized with the calibration pass's imatrix
    for t in source.tensors:
        if "_exps" in t.name:
            assert bytes(published.raw(published.tensor(t.name))) == bytes(source.raw(t)), t.name
    profile = read_profile(upload / "tiny-moe-attn-Q4_K.moeprof")
    assert profile.heldout is not None and profile.sources[0].ctx == 32 and profile.sources[0].chunks == 3
    data = ModelCard.load(upload / CARD_FILE).data
    assert data.base_model == "Qwen/Qwen3-30B-A3B" and {"qwen3", "imatrix"} <= set(data.tags)
    recipe = (upload / "qwen3moe.toml").read_text()
    assert recipe.startswith(RECIPE.read_text().rstrip("\n")) and "# calibration.chunks = 4" in recipe
    logits = llama_eval(upload / "tiny-moe-attn-Q4_K.gguf", list(range(1, 17))).logits
    assert np.isfinite(logits).all()


def test_rerun_skips_finished_steps(prepared: tuple[Path, str], model: Path, text: Path) -> None:
    out, _ = prepared
    before = {p.name: p.stat().st_mtime_ns for p in (out / "upload").iterdir()}
    stdout = moeprep("prepare", RECIPE, model, out, "--dataset", text, *FAST)
    assert ran(stdout) == [] and stdout.count("up to date, skipped") == 5
    assert {p.name: p.stat().st_mtime_ns for p in (out / "upload").iterdir()} == before


def test_changed_settings_redo_only_their_steps(prepared: tuple[Path, str], model: Path, text: Path) -> None:
    out, _ = prepared
    stdout = moeprep("prepare", RECIPE, model, out, "--dataset", text, *FAST, "--quantized-by", "someone")
    assert ran(stdout) == ["publish"]
    assert ModelCard.load(out / "upload" / CARD_FILE).data.quantized_by == "someone"
    # a damaged output is redone, and what depends on it
    (out / "work" / "quantized.moeprof").write_bytes(b"damaged")
    stdout = moeprep("prepare", RECIPE, model, out, "--dataset", text, *FAST, "--quantized-by", "someone")
    assert ran(stdout)[0] == "profile" and "calibrate" not in ran(stdout) and "quantize" not in ran(stdout)
    assert check_folder(out / "upload").ok


def test_changed_input_redoes_everything_after_it(model: Path, text: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    mine = tmp_path / "text.txt"
    shutil.copyfile(text, mine)
    moeprep("prepare", RECIPE, model, out, "--dataset", mine, *FAST)
    mine.write_text(text.read_text()[1000:])  # other calibration text: another imatrix, another profile
    stdout = moeprep("prepare", RECIPE, model, out, "--dataset", mine, *FAST)
    assert ran(stdout) == STEPS
    state = json.loads((out / "work" / "state.json").read_text())
    assert set(state["steps"]) == set(STEPS) and check_folder(out / "upload").ok


def test_recipe_without_imatrix(model: Path, text: Path, tmp_path: Path) -> None:
    recipe = tmp_path / "plain.toml"
    recipe.write_text(RECIPE.read_text().replace("imatrix = true", "imatrix = false"))
    stdout = moeprep("prepare", recipe, model, tmp_path / "out", "--dataset", text, *FAST)
    assert "calibrate: off in this recipe" in stdout and ran(stdout) == STEPS[1:]
    upload = tmp_path / "out" / "upload"
    assert not list(upload.glob("*.imatrix.gguf")) and check_folder(upload).ok


def test_refusals_come_before_any_work(model: Path, text: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    cases = [
        ([ROOT / "recipes" / "deepseek2.toml", model, out, *FAST], "a qwen3moe model, but"),
        ([RECIPE, model, out, "--ctx", "32"], "give --base-model ORG/NAME"),
        ([RECIPE, model, out, *FAST, "--split-max-size", "80G"], "50 GB file limit"),
        ([tmp_path / "none.toml", model, out, *FAST], "no such recipe file"),
        ([RECIPE, tmp_path / "none.gguf", out, *FAST], "no such file"),
    ]
    for args, message in cases:
        assert message in moeprep("prepare", *args, code=2), args
    assert not out.exists()
    bad = tmp_path / "bad.toml"
    bad.write_text(RECIPE.read_text().replace("ctx = 512", "ctx = 512\nctx_size = 4"))
    assert "unknown key calibration.ctx_size" in moeprep("prepare", bad, model, out, *FAST, code=2)


def test_model_missing_a_tensor_leaves_no_outdir(model: Path, text: Path, tmp_path: Path) -> None:
    """A model the runtime refuses fails the first step in one line, and the OUTDIR that run made is gone again."""
    from moeprep.gguf.writer import copied_tensor, write_gguf

    src = open_gguf(model)
    missing = "blk.1.attn_q.weight"
    broken = tmp_path / "broken.gguf"
    write_gguf(broken, src, tensors=[copied_tensor(src, t) for t in src.tensors if t.name != missing])
    out = tmp_path / "new" / "out"
    out.parent.mkdir()
    stderr = moeprep("prepare", RECIPE, broken, out, "--dataset", text, *FAST, code=2)
    assert f"tensor {missing} is missing" in stderr
    assert list(out.parent.iterdir()) == []


def test_upload_folder_of_someone_else_is_kept(model: Path, text: Path, tmp_path: Path) -> None:
    (tmp_path / "out" / "upload").mkdir(parents=True)
    (tmp_path / "out" / "upload" / "mine.txt").write_text("keep me")
    assert "was not written by moeprep prepare" in moeprep(
        "prepare", RECIPE, model, tmp_path / "out", "--dataset", text, *FAST, code=2
    )
    assert (tmp_path / "out" / "upload" / "mine.txt").read_text() == "keep me"


def test_short_text_is_reported_on_stderr_and_in_the_card(model: Path, text: Path, tmp_path: Path) -> None:
    """A recipe asking more chunks than the text has: both calibration passes say so on stderr before running, and
    the published profile and card record how many were asked."""
    short = tmp_path / "short.txt"
    short.write_text(text.read_text()[:2000])
    args = ["--ctx", "32", "--chunks", "200", "--threads", "1", "--base-model", "Qwen/Qwen3-30B-A3B"]
    result = CliRunner().invoke(
        main, ["prepare", str(RECIPE), str(model), str(tmp_path / "out"), "--dataset", str(short), *args]
    )
    assert result.exit_code == 0, (result.output, result.exception)
    upload = tmp_path / "out" / "upload"
    source = read_profile(upload / "tiny-moe-attn-Q4_K.moeprof").sources[0]
    got = source.chunks + source.heldout_chunks
    assert 2 <= got < 200 and source.chunks_asked == 200
    warning = f"moeprep: warning: dataset {short} gave {got} chunks of 32 tokens, fewer than the 200 asked"
    assert result.stderr.count(warning) == 2  # the calibration pass over the source, the profile of the result
    assert "(the text gave only these, of the 200 chunks asked)" in (upload / CARD_FILE).read_text()
