"""`moeprep profile` end to end through click: run, show/plot, merge, export, bake; refusals are one line, exit 2."""

from __future__ import annotations

import csv
import hashlib
import io
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from moeprep.cli import main
from moeprep.gguf.reader import open_gguf
from moeprep.profile.cli import EXPORT_FORMATS
from moeprep.profile.export import EXPERT_USAGE_KEY, EXPORTERS
from moeprep.profile.format import read_profile
from tests.profile.conftest import CALIBRATION


def moeprep(*args: str | Path, code: int = 0) -> str:
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == code, (result.output, result.stderr, result.exception)
    if code == 2:
        # a MoeprepError is one line, no traceback; a click usage error (bad flags) shows the usage first
        assert result.stderr.count("\n") == 1 or result.stderr.startswith("Usage:"), result.stderr
        return result.stderr
    return result.stdout


@pytest.fixture(scope="module")
def profiled(synth, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:  # noqa: ANN001
    """(model, profile, imatrix) of a skewed tiny model, profiled through the CLI."""
    out = tmp_path_factory.mktemp("cli")
    model = synth("tiny-skewed", skew=1.0)
    text = moeprep(
        "profile",
        model,
        "--dataset",
        CALIBRATION,
        "-c",
        64,
        "--chunks",
        6,
        "--holdout",
        0.34,
        "-o",
        out / "a.moeprof",
        "--imatrix-out",
        out / "a.imatrix.gguf",
    )
    assert "held-out: 2 chunks, 128 tokens" in text and "lru-warm" in text
    return model, out / "a.moeprof", out / "a.imatrix.gguf"


def test_run_writes_profile_and_imatrix(profiled: tuple[Path, Path, Path]) -> None:
    model, path, imatrix = profiled
    p = read_profile(path)
    assert p.model.name == "synth-qwen3moe-tiny" and p.model.file_size == model.stat().st_size
    assert p.sources[0].chunks == 4 and p.sources[0].heldout_chunks == 2 and p.sources[0].tokens == 4 * 64
    assert p.sources[0].chunks_asked == 6 and not p.sources[0].short_of_text
    assert p.trace.n_chunks == 6 and p.heldout is not None
    assert imatrix.read_bytes()[:4] == b"GGUF"


def test_run_warns_when_the_text_gives_fewer_chunks_than_asked(synth, tmp_path: Path) -> None:  # noqa: ANN001
    """A short text and --chunks 200: one warning line on stderr saying how many chunks the text gave, the run
    goes on with them, and the profile records the number asked."""
    model = synth("tiny-skewed", skew=1.0)
    short = tmp_path / "short.txt"
    short.write_text(CALIBRATION.read_text()[:3000])
    result = CliRunner().invoke(
        main,
        [
            "profile",
            str(model),
            "--dataset",
            str(short),
            "-c",
            "64",
            "--chunks",
            "200",
            "-o",
            str(tmp_path / "s.moeprof"),
        ],
    )
    assert result.exit_code == 0, (result.output, result.exception)
    source = read_profile(tmp_path / "s.moeprof").sources[0]
    got = source.chunks + source.heldout_chunks
    assert 2 <= got < 200 and source.chunks_asked == 200 and source.short_of_text
    assert result.stderr.count("warning") == 1
    assert (
        f"moeprep: warning: dataset {short} gave {got} chunks of 64 tokens, fewer than the 200 asked" in result.stderr
    )
    # --tokens asks for ceil(tokens / ctx) chunks
    result = CliRunner().invoke(
        main,
        [
            "profile",
            str(model),
            "--dataset",
            str(short),
            "-c",
            "64",
            "--tokens",
            "6401",
            "-o",
            str(tmp_path / "t.moeprof"),
        ],
    )
    assert result.exit_code == 0 and f"gave {got} chunks of 64 tokens, fewer than the 101 asked" in result.stderr
    assert read_profile(tmp_path / "t.moeprof").sources[0].chunks_asked == 101


def test_no_warning_when_the_text_is_long_enough(synth, tmp_path: Path) -> None:  # noqa: ANN001
    model = synth("tiny-skewed", skew=1.0)
    result = CliRunner().invoke(
        main,
        [
            "profile",
            str(model),
            "--dataset",
            str(CALIBRATION),
            "-c",
            "64",
            "--chunks",
            "3",
            "-o",
            str(tmp_path / "a.moeprof"),
        ],
    )
    assert result.exit_code == 0 and "warning" not in result.stderr


def test_run_option_errors(synth, tmp_path: Path) -> None:  # noqa: ANN001
    model = synth("tiny-skewed", skew=1.0)
    out = moeprep(
        "profile", model, "--dataset", CALIBRATION, "--chunks", 2, "--tokens", 9, "-o", tmp_path / "x", code=2
    )
    assert "--chunks and --tokens" in out
    out = moeprep("profile", model, "--dataset", tmp_path / "none.txt", "-o", tmp_path / "x", code=2)
    assert "none.txt: no such file" in out
    out = moeprep("profile", model, "--dataset", CALIBRATION, "-c", 64, "--chunks", 1, "-o", tmp_path / "x", code=2)
    assert "only 1 chunk" in out and "--holdout 0" in out


def test_show_and_plot(profiled: tuple[Path, Path, Path], tmp_path: Path) -> None:
    text = moeprep("profile", "show", profiled[1], "--per-layer", "--plot", tmp_path / "p.png")
    assert "eff. experts" in text and "per layer, first64 tokens" in text
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_merge(profiled: tuple[Path, Path, Path], tmp_path: Path) -> None:
    path = profiled[1]
    moeprep("profile", "merge", path, path, "--weights", "1,2", "-o", tmp_path / "m.moeprof")
    a, m = read_profile(path), read_profile(tmp_path / "m.moeprof")
    assert np.array_equal(m.counts.selections, 3 * a.counts.selections)
    assert m.trace.n_chunks == 2 * a.trace.n_chunks and m.heldout.chunks == 4
    assert "--weights" in moeprep("profile", "merge", path, "--weights", "1,x", "-o", tmp_path / "n", code=2)


def test_export_formats(profiled: tuple[Path, Path, Path], tmp_path: Path) -> None:
    model, path, _ = profiled
    p = read_profile(path)
    assert EXPORT_FORMATS == list(EXPORTERS)
    ini = moeprep("profile", "export", path, "--format", "moe-state-ini").splitlines()
    assert ini[0] == f"[synth-qwen3moe-tiny {model.stat().st_size}]"
    assert ini[1] == "geom = qwen3moe.16.4"
    assert ini[2:] == [f"hot.{i} = " + " ".join(map(str, row)) for i, row in enumerate(p.counts.selections)]

    moeprep("profile", "export", path, "--format", "trace-csv", "-o", tmp_path / "t.csv")
    rows = np.array(list(csv.reader(io.StringIO((tmp_path / "t.csv").read_text()))), dtype=np.int64)
    n_m, k = len(p.model.moe_layers), p.model.n_expert_used
    assert rows.shape == (len(p.trace.ids) * n_m, 2 + k)
    assert rows[:n_m, 0].tolist() == [0] * n_m and rows[:n_m, 1].tolist() == list(p.model.moe_layers)
    assert np.array_equal(rows[:, 2:], p.trace.ids.reshape(-1, k))
    assert rows[64 * n_m, 0] == 0  # positions restart with each chunk

    data = json.loads(moeprep("profile", "export", path, "--format", "json"))
    assert [layer["selections"] for layer in data["layers"]] == p.counts.selections.tolist()
    assert {r["policy"] for r in data["heldout"]["rates"]} == {"static", "lru", "lfu", "lru-warm"}


def test_export_labelled_with_another_file(profiled: tuple[Path, Path, Path], synth) -> None:  # noqa: ANN001
    _, path, _ = profiled
    f32 = synth("tiny-skewed-f32", skew=1.0, attn_type="F32")  # same routers, other attention type and size
    ini = moeprep("profile", "export", path, "--format", "moe-state-ini", "--model", f32)
    assert ini.startswith(f"[synth-qwen3moe-tiny {f32.stat().st_size}]")
    other = synth("tiny-flat", skew=0.0)
    err = moeprep("profile", "export", path, "--format", "moe-state-ini", "--model", other, code=2)
    assert "made for another model" in err and "router_sha256" in err


def test_bake_round_trip(profiled: tuple[Path, Path, Path], tmp_path: Path, synth) -> None:  # noqa: ANN001
    model, path, _ = profiled
    p = read_profile(path)
    moeprep("profile", "bake", path, model, tmp_path / "baked.gguf")
    src, baked = open_gguf(model), open_gguf(tmp_path / "baked.gguf")
    table = np.array(baked.get(EXPERT_USAGE_KEY), np.int64).reshape(p.model.n_layer, p.model.n_expert)
    assert np.array_equal(table[list(p.model.moe_layers)], p.counts.selections)
    assert baked.fields[EXPERT_USAGE_KEY].types == [baked.fields[EXPERT_USAGE_KEY].types[0], 4]  # ARRAY of UINT32
    assert {k: v for k, v in baked.kv.items() if k != EXPERT_USAGE_KEY} == src.kv
    for a, b in zip(src.tensors, baked.tensors):
        assert (a.name, a.ggml_type, a.shape) == (b.name, b.ggml_type, b.shape)
        assert hashlib.sha256(src.raw(a)).digest() == hashlib.sha256(baked.raw(b)).digest()
    # a profile of the baked file is still a profile of the model: same routers
    moeprep("profile", "bake", path, tmp_path / "baked.gguf", tmp_path / "again.gguf")
    err = moeprep("profile", "bake", path, synth("tiny-flat", skew=0.0), tmp_path / "x.gguf", code=2)
    assert "made for another model" in err and not (tmp_path / "x.gguf").exists()


def test_damaged_profile_is_refused(profiled: tuple[Path, Path, Path], tmp_path: Path) -> None:
    data = bytearray(profiled[1].read_bytes())
    data[100] ^= 0xFF
    (tmp_path / "bad.moeprof").write_bytes(bytes(data))
    for args in (["show"], ["export", "--format", "json"], ["merge", "-o", tmp_path / "m"]):
        err = moeprep("profile", args[0], tmp_path / "bad.moeprof", *args[1:], code=2)
        assert "damaged profile (checksum mismatch)" in err
