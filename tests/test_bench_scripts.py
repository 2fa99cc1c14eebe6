"""The GPU bench scripts take their output folder as an argument: without one (or with too many) they print a usage
line and exit 2 before doing anything, so they never fall back to some machine's fixed folders."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "bench").glob("gpu_*.sh") if p.name != "gpu_env.sh")


def test_every_gpu_script_reads_its_folders_through_gpu_env():
    assert SCRIPTS, "no bench/gpu_*.sh found"
    for script in SCRIPTS:
        assert 'source bench/gpu_env.sh "$@"' in (ROOT / script).read_text(), script


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("args", [[], ["a", "b", "c"], ["--help"], [""]])
def test_bad_arguments_give_a_usage_line_and_exit_2(script, args, tmp_path):
    result = subprocess.run(
        ["bash", script, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "TMPDIR": str(tmp_path)},
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"usage: bash {script} OUTDIR [WORKDIR]"), result.stderr
    assert result.stdout == ""
    assert list(tmp_path.iterdir()) == []  # nothing written, not even the default work folder


def test_an_output_folder_that_cannot_be_made_is_refused(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = subprocess.run(
        ["bash", "bench/gpu_serve.sh", str(blocker / "out")], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert "cannot create the output folder" in result.stderr.splitlines()[0]
    assert result.stderr.splitlines()[1].startswith("usage: bash bench/gpu_serve.sh OUTDIR")


def test_bench_quantize_file_refuses_zero_rounds():
    result = subprocess.run(
        [sys.executable, "bench/bench_quantize_file.py", "m.gguf", "--rounds", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "--rounds and --threads must be at least 1" in result.stderr
