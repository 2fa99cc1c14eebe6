"""A file the command cannot use is refused before any weight or tokenizer is built: one line, exit code 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from gguf import GGUFValueType, Keys

import moerun
import moerun.model
from moeprep.cli import main as moeprep_main
from moeprep.gguf.reader import open_gguf
from moeprep.gguf.writer import KVValue, write_gguf
from moerun.cli import main as moerun_main


def forbid(monkeypatch: pytest.MonkeyPatch, owner: object, name: str) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError(f"{name} ran before the file was refused")

    monkeypatch.setattr(owner, name, refuse)


def one_line_error(result, expected: str) -> None:
    assert result.exit_code == 2, (result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], result.stderr


@pytest.fixture(scope="module")
def foreign_arch(real_vocab_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real-vocabulary model relabelled as an architecture moerun does not run."""
    out = tmp_path_factory.mktemp("foreign") / "gemma3.gguf"
    return write_gguf(
        out, open_gguf(real_vocab_model), kv_set={Keys.General.ARCHITECTURE: KVValue("gemma3", GGUFValueType.STRING)}
    )[0]


def test_moerun_refuses_an_unsupported_architecture_before_loading(
    foreign_arch: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("Weights", "Tokenizer"):
        forbid(monkeypatch, moerun.model, name)
    result = CliRunner().invoke(moerun_main, ["-m", str(foreign_arch), "-p", "hi", "-n", "1"])
    one_line_error(result, "architecture 'gemma3' is not supported")


def test_moerun_refuses_before_importing_torch(foreign_arch: Path) -> None:
    """The refusal costs a header read, not torch's import (seconds on a small machine): checked in a fresh process."""
    code = (
        "import sys\nfrom click.testing import CliRunner\nfrom moerun.cli import main\n"
        f"result = CliRunner().invoke(main, ['-m', {str(foreign_arch)!r}, '-p', 'hi'])\n"
        "print(result.exit_code, 'torch' in sys.modules)"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.split() == ["2", "False"], run.stdout + run.stderr


def test_profile_refuses_a_dense_model_before_loading(
    dense_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    forbid(monkeypatch, moerun, "load_model")
    text = tmp_path / "text.txt"
    text.write_text("some calibration text\n" * 50)
    result = CliRunner().invoke(
        moeprep_main, ["profile", str(dense_model), "--dataset", str(text), "-o", str(tmp_path / "out.moeprof")]
    )
    one_line_error(result, "not a Mixture-of-Experts model")
    assert not (tmp_path / "out.moeprof").exists()


def test_moerun_runs_a_dense_llama(dense_model: Path) -> None:
    """Dense is refused only where experts are needed: moerun runs a dense llama."""
    model = moerun.load_model(dense_model, n_ctx=16)
    assert model.args.n_experts == 0
    logits = model.forward(torch.tensor(model.tokenizer.encode("Hello world"), dtype=torch.long))
    assert logits.shape[-1] == model.args.n_vocab and torch.isfinite(logits).all()
