"""Ctrl-C anywhere in a command that writes: exit code 130, one line on stderr saying what state the files are in,
no traceback, every output either absent or complete (a quantized model: verified), no temp files, inputs unchanged.

The interrupt is a real SIGINT sent to the main thread (as a terminal's Ctrl-C reaches Python) from inside a
patched step, at its first, a middle or its last call, so where it lands is the same on every run. Every test runs
with Python's own SIGINT handler, as a command in a terminal does, also when the tests themselves run in a
background job, which starts with SIGINT ignored. Such a job's commands keep it ignored, as Python and every Unix
tool do: a terminal's Ctrl-C is not theirs. Also: a quantize whose output fails verification writes no OUT."""

from __future__ import annotations

import itertools
import json
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

import moeprep.atomic
import moeprep.gguf.writer
import moeprep.profile.collect
import moeprep.profile.export
import moeprep.profile.format
import moeprep.publish
import moeprep.quant.imatrix
import moeprep.quant.quantize
import moeprep.quant.verify
import moeprep.synth.model
from moeprep.cli import main
from moeprep.gguf.reader import open_gguf
from moeprep.profile.format import read_profile
from moeprep.quant.verify import verify_model
from moeprep.synth import write_synth_model

ROOT = Path(__file__).resolve().parents[1]
CALIBRATION = ROOT / "moeprep" / "data" / "calibration.txt"
PROFILE = ["--dataset", str(CALIBRATION), "-c", "16", "--chunks", "3", "--holdout", "0.34"]
PROGRESS_BAR = re.compile(r"\[\d\d:\d\d[<,\]]")  # tqdm's lines on stderr (ours, and the datasets library's)
TEMP = re.compile(r"\.(tmp|stage)-\d+$")
SPLIT = "400K"  # the tiny model (1.2 MiB) as four shards


@pytest.fixture(autouse=True)
def sigint_raises_keyboard_interrupt() -> Iterator[None]:
    """Python's SIGINT handler for the test, as a terminal's command has it: where SIGINT starts ignored (pytest run
    from a background job or a script's `&`) Python leaves it ignored, and the pressed Ctrl-C would do nothing."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def ctrl_c_at(monkeypatch: pytest.MonkeyPatch, owner: object, name: str, call: int) -> None:
    """Make the `call`-th call of owner.name (counted from 1) press Ctrl-C, then carry on (a worker thread's call
    goes on with its work, as it would while the main thread unwinds)."""
    real = getattr(owner, name)
    calls = itertools.count(1)

    def pressed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if next(calls) == call:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, pressed)


def snapshot(*paths: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in paths}


def cli(*args: str | Path) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args])


def interrupted(result: Result, folder: Path, inputs: dict[Path, bytes]) -> str:
    """Check what every interrupted run must show; returns the one line."""
    assert result.exit_code == 130, (result.output, result.exception)
    lines = [line for line in re.split(r"[\r\n]", result.stderr) if line.strip() and not PROGRESS_BAR.search(line)]
    assert len(lines) == 1 and lines[0].startswith("moeprep: interrupted: "), result.stderr
    assert lines[0].endswith("; the inputs are unchanged")
    assert "Traceback" not in result.output and "Aborted" not in result.output
    assert not [p for p in folder.rglob("*") if TEMP.search(p.name)], "temp files left"
    for path, data in inputs.items():
        assert path.read_bytes() == data, f"{path} changed"
    return lines[0]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synth_model(tmp_path_factory.mktemp("src") / "tiny.gguf", "qwen3moe", skew=0.5)


@pytest.fixture(scope="module")
def profile(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("prof") / "tiny.moeprof"
    result = cli("profile", model, *PROFILE, "-o", out)
    assert result.exit_code == 0, result.output
    return out


# --- quantize: OUT appears only verified -------------------------------------------------------------------------

N_TENSORS, N_REQUANTIZED = 39, 12  # the tiny qwen3moe model; Q8_0 attention


@pytest.mark.parametrize(
    "owner, name, call, written",
    [
        (moeprep.quant.quantize, "quantize_rows", 1, False),  # first requantized rows, on the thread pool
        (moeprep.gguf.writer, "_kernel_copy", (N_TENSORS - N_REQUANTIZED) // 2, False),  # mid-write, a copied tensor
        (moeprep.quant.verify, "_check_tensor", N_TENSORS, False),  # verifying the last tensor
        # the writer renaming its 2nd temp shard inside the stage: all four renamed, then the interrupt (before verify)
        (moeprep.atomic.os, "replace", 2, False),
        # moving the 2nd of the 4 verified shards out of the stage: all four moved, then the interrupt
        (moeprep.atomic.os, "replace", 4 + 2, True),
    ],
    ids=["first-rows", "mid-write", "last-verify", "rename-in-stage", "move-out-of-stage"],
)
def test_quantize(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, owner: object, name: str, call: int, written: bool
) -> None:
    inputs = snapshot(model)
    assert len(open_gguf(model).tensors) == N_TENSORS
    out = tmp_path / "q.gguf"
    ctrl_c_at(monkeypatch, owner, name, call)
    result = cli("quantize", model, out, "--attn", "Q8_0", "--threads", "2", "--split-max-size", SPLIT)
    monkeypatch.undo()
    line = interrupted(result, tmp_path, inputs)
    shards = sorted(tmp_path.iterdir())
    if written:
        assert [p.name for p in shards] == [f"q-{i:05d}-of-00004.gguf" for i in (1, 2, 3, 4)]
        assert verify_model(open_gguf(shards[0]), open_gguf(model)).ok
        assert f"{shards[0]}" in line and "written complete" in line
    else:
        assert shards == [], "OUT appears only once it is verified"
        assert line == f"moeprep: interrupted: {out} not written (no temp files left); the inputs are unchanged"


def test_quantize_that_fails_verification_writes_nothing(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(moeprep.quant.verify.MAX_RELATIVE_ERROR, "Q8_0", 0.0)  # every requantized tensor fails
    out = tmp_path / "q.gguf"
    result = cli("quantize", model, out, "--attn", "Q8_0", "--threads", "2")
    assert result.exit_code == 1, result.output
    assert f"{out} was not written (it does not verify against the input)" in result.stdout
    assert "verify: FAILED: 12 problem(s)" in result.stdout
    assert list(tmp_path.iterdir()) == []


def test_quantize_in_a_terminal(model: Path, tmp_path: Path) -> None:
    """The whole process gets SIGINT (as a terminal sends it) during verification: exit 130 and the line, not
    click's 'Aborted!' and exit 1."""
    press = (
        "import itertools, os, signal, moeprep.quant.verify as v\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"  # a terminal's command, as above
        "real, calls = v._check_tensor, itertools.count(1)\n"
        "def check(*a):\n"
        f"    if next(calls) == {N_TENSORS}: os.kill(os.getpid(), signal.SIGINT)\n"
        "    return real(*a)\n"
        "v._check_tensor = check\n"
        "from moeprep.cli import main\n"
        "main(prog_name='moeprep')\n"
    )
    inputs = snapshot(model)
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            press,
            "quantize",
            str(model),
            str(tmp_path / "q.gguf"),
            "--attn",
            "Q8_0",
            "--threads",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 130, done.stderr
    lines = [line for line in re.split(r"[\r\n]", done.stderr) if line.strip() and not PROGRESS_BAR.search(line)]
    assert lines == [
        f"moeprep: interrupted: {tmp_path / 'q.gguf'} not written (no temp files left); the inputs are unchanged"
    ], done.stderr
    assert list(tmp_path.iterdir()) == [] and snapshot(model) == inputs


def test_quantize_in_a_background_job(model: Path, tmp_path: Path) -> None:
    """Started with SIGINT ignored (a script's `cmd &`), a command leaves it ignored, as the shell asked: SIGINTs
    during verification and while OUT is renamed into place change nothing, and OUT is written whole."""
    press = (
        "import itertools, os, signal, moeprep.atomic, moeprep.quant.verify as v\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"  # what the shell hands a background job
        "real_check, real_replace = v._check_tensor, os.replace\n"
        "def check(*a):\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    return real_check(*a)\n"
        "def replace(*a):\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    return real_replace(*a)\n"
        "v._check_tensor, moeprep.atomic.os.replace = check, replace\n"
        "from moeprep.cli import main\n"
        "main(prog_name='moeprep')\n"
    )
    inputs = snapshot(model)
    out = tmp_path / "q.gguf"
    done = subprocess.run(
        [sys.executable, "-c", press, "quantize", str(model), str(out), "--attn", "Q8_0", "--threads", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "interrupted" not in done.stderr and f"wrote {out}" in done.stdout, done.stdout
    assert verify_model(open_gguf(out), open_gguf(model)).ok and snapshot(model) == inputs
    assert [p.name for p in tmp_path.iterdir()] == ["q.gguf"]


def run_background_job(setup: str, *args: str | Path) -> subprocess.CompletedProcess:
    """`moeprep ARGS` in a child started as a script's `cmd &` starts it (SIGINT ignored), after `setup` (Python
    that patches a step to send the child a signal)."""
    code = (
        "import itertools, os, signal\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        f"{setup}\n"
        "from moeprep.cli import main\n"
        "main(prog_name='moeprep')\n"
    )
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, timeout=300)


def sigterm_at(module: str, name: str, call: int) -> str:
    """Setup for run_background_job: the `call`-th call of module.name sends the process SIGTERM (as `kill PID`)."""
    return (
        f"import {module} as owner\n"
        f"real, calls = owner.{name}, itertools.count(1)\n"
        "def pressed(*a, **k):\n"
        f"    if next(calls) == {call}: os.kill(os.getpid(), signal.SIGTERM)\n"
        "    return real(*a, **k)\n"
        f"owner.{name} = pressed"
    )


def test_kill_stops_a_background_job_cleanly(tmp_path: Path) -> None:
    """SIGTERM, the way to stop a job that ignores SIGINT, cleans up as Ctrl-C does: exit 143 and the one line."""
    out = tmp_path / "s.gguf"
    done = run_background_job(sigterm_at("moeprep.synth.model", "tensor_bytes", N_TENSORS // 2), "synth", out)
    assert done.returncode == 143, done.stderr
    lines = [line for line in re.split(r"[\r\n]", done.stderr) if line.strip() and not PROGRESS_BAR.search(line)]
    assert lines == [f"moeprep: terminated: {out} not written (no temp files left); the inputs are unchanged"]
    assert list(tmp_path.iterdir()) == []


def test_kill_during_the_renames_takes_effect_after_them(model: Path, tmp_path: Path) -> None:
    """SIGTERM while the verified shards move out of their stage (the 2nd of 4): all four are moved first."""
    inputs = snapshot(model)
    out = tmp_path / "q.gguf"
    done = run_background_job(
        sigterm_at("os", "replace", 4 + 2),
        "quantize",
        model,
        out,
        "--attn",
        "Q8_0",
        "--threads",
        "2",
        "--split-max-size",
        SPLIT,
    )
    assert done.returncode == 143, done.stderr
    shards = sorted(tmp_path.iterdir())
    assert [p.name for p in shards] == [f"q-{i:05d}-of-00004.gguf" for i in (1, 2, 3, 4)]
    assert verify_model(open_gguf(shards[0]), open_gguf(model)).ok and snapshot(model) == inputs
    assert done.stderr.strip().splitlines()[-1].startswith(f"moeprep: terminated: {shards[0]}")
    assert "written complete" in done.stderr


# --- profile: run, merge, export, bake ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "owner, name, call, done",
    [
        (moeprep.profile.collect.RoutingRecorder, "take", 2, []),  # the calibration pass, 2nd of 3 chunks
        (moeprep.quant.imatrix.gguf.GGUFWriter, "write_tensors_to_file", 1, []),  # writing the imatrix
        (moeprep.profile.format, "encode_profile", 1, ["imatrix"]),  # writing the profile, after the imatrix
    ],
    ids=["pass", "imatrix", "profile"],
)
def test_profile_run(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, owner: object, name: str, call: int, done: list[str]
) -> None:
    inputs = snapshot(model, CALIBRATION)
    out, imatrix = tmp_path / "p.moeprof", tmp_path / "imatrix.gguf"
    ctrl_c_at(monkeypatch, owner, name, call)
    result = cli("profile", model, *PROFILE, "--imatrix-out", imatrix, "-o", out)
    monkeypatch.undo()
    line = interrupted(result, tmp_path, inputs)
    assert not out.exists() and imatrix.exists() == ("imatrix" in done)
    if done:
        assert f"{imatrix} written complete" in line and f"{out} not written" in line
        assert open_gguf(imatrix).tensors  # complete: it opens
    elif name == "take":
        assert line == "moeprep: interrupted: nothing half-written; the inputs are unchanged"
    else:
        assert f"{imatrix} not written" in line


def test_profile_merge_export_bake(model: Path, profile: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    inputs = snapshot(model, profile)
    cases = [
        (moeprep.profile.format, "encode_profile", 1, ["profile", "merge", profile, profile, "-o", tmp_path / "m"]),
        (
            moeprep.profile.export,
            "profile_dict",
            1,
            ["profile", "export", profile, "--format", "json", "-o", tmp_path / "e.json"],
        ),
        (moeprep.gguf.writer, "_kernel_copy", 1, ["profile", "bake", profile, model, tmp_path / "first.gguf"]),
        (moeprep.gguf.writer, "_kernel_copy", N_TENSORS, ["profile", "bake", profile, model, tmp_path / "last.gguf"]),
    ]
    for owner, name, call, args in cases:
        with monkeypatch.context() as m:
            ctrl_c_at(m, owner, name, call)
            result = cli(*args)
        assert f"{args[-1]} not written" in interrupted(result, tmp_path, inputs), args
        assert list(tmp_path.iterdir()) == [], args


# --- synth and publish -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("call", [1, N_TENSORS // 2, N_TENSORS])
def test_synth(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, call: int) -> None:
    out = tmp_path / "s.gguf"
    ctrl_c_at(monkeypatch, moeprep.synth.model, "tensor_bytes", call)
    result = cli("synth", out)
    monkeypatch.undo()
    assert f"{out} not written" in interrupted(result, tmp_path, {})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "name, call",
    [("_copy", 2), ("build_card", 1), ("_published_file", 5)],
    ids=["copying-shard-2", "card", "checksum-of-the-card"],
)
def test_publish(model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, call: int) -> None:
    source = tmp_path / "source"
    source.mkdir()
    shards = moeprep.gguf.writer.write_gguf(source / "m.gguf", open_gguf(model), split_max_size=400_000)
    assert len(shards) == 4  # so _published_file runs for four shards, then the card
    inputs = snapshot(*shards)
    out = tmp_path / "upload"
    ctrl_c_at(monkeypatch, moeprep.publish, name, call)
    result = cli("publish", shards[0], out, "--base-model", "Org/Model")
    monkeypatch.undo()
    line = interrupted(result, tmp_path, inputs)
    assert line == f"moeprep: interrupted: {out} not written (no temp files left); the inputs are unchanged"
    assert sorted(tmp_path.iterdir()) == [source]


# --- prepare: each step's outputs whole or absent, and a rerun resumes --------------------------------------------


def test_prepare(model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    recipe = ROOT / "recipes" / "qwen3moe.toml"
    args = [
        "prepare",
        recipe,
        model,
        tmp_path / "out",
        "--dataset",
        CALIBRATION,
        "--ctx",
        "16",
        "--chunks",
        "3",
        "--threads",
        "1",
        "--base-model",
        "Org/Model",
    ]
    inputs = snapshot(model, recipe, CALIBRATION)
    work = tmp_path / "out" / "work"

    def recorded() -> list[str]:
        return list(json.loads((work / "state.json").read_text())["steps"])

    # calibrate: mid-pass; quantize: verifying the last tensor; publish: copying the model
    for owner, name, call, steps_done, lost in [
        (moeprep.profile.collect.RoutingRecorder, "take", 2, [], work / "source.moeprof"),
        (moeprep.quant.verify, "_check_tensor", N_TENSORS, ["calibrate"], work / "quantized.gguf"),
        (moeprep.publish, "_copy", 1, ["calibrate", "quantize", "profile", "bake"], tmp_path / "out" / "upload"),
    ]:
        with monkeypatch.context() as m:
            ctrl_c_at(m, owner, name, call)
            result = cli(*args)
        line = interrupted(result, tmp_path, inputs)
        assert recorded() == steps_done and not lost.exists()
        if name == "_copy":
            assert f"{lost} not written" in line and f"{work / 'state.json'}" in line
    assert (
        read_profile(work / "source.moeprof") and verify_model(open_gguf(work / "quantized.gguf"), open_gguf(model)).ok
    )
    result = cli(*args)
    assert result.exit_code == 0, result.output
    assert "] publish: done in" in result.stdout and "] bake: up to date, skipped" in result.stdout
