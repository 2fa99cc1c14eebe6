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


def load_bench(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_seed_box_estimate_adds_its_parts():
    """Streamed misses cross the 25 GB/s bus, the CPU's misses read 45 GB/s RAM, and the GPU step is the slower of
    the measured one and the bytes over 936 GB/s."""
    from argparse import Namespace

    seed_box = load_bench("seed_box")
    speeds = Namespace(bus=25.0, ram=45.0, vram=936.0)
    expert, dense, layers, top_k = 2_500_000, 1_000_000_000, 48, 8
    streamed = {"hit_rate": 0.75, "streamed_per_token": 96.0, "uploads_per_token": 4.0}
    streamed["ms_per_token"] = {"GPU experts (device)": 1.0, "rest": 1.0}
    e = seed_box.estimate(streamed, expert, dense, layers, top_k, speeds)
    assert e["bus_ms"] == pytest.approx(100 * 2.5e6 / 25e9 * 1e3)  # 10 ms
    assert e["cpu_ms"] == 0  # every miss was streamed
    gpu_bytes = dense + 0.75 * 384 * expert
    assert e["gpu_ms"] == pytest.approx(max(2.0, gpu_bytes / 936e9 * 1e3))
    assert e["tok_s"] == pytest.approx(1000 / (e["gpu_ms"] + e["bus_ms"]))
    on_cpu = {**streamed, "streamed_per_token": 0.0, "uploads_per_token": 0.0}
    e = seed_box.estimate(on_cpu, expert, dense, layers, top_k, speeds)
    assert e["bus_ms"] == 0
    assert e["cpu_ms"] == pytest.approx(96 * 2.5e6 / 45e9 * 1e3)


def test_bench_cache_warms_from_the_trace_chunks_it_does_not_replay():
    import numpy as np

    from moeprep.profile.tracefile import TraceFile

    bench_cache = load_bench("bench_cache")
    ids = np.zeros((30, 2, 1), np.int64)
    ids[:10] = 1  # chunk 0: too short for 12 tokens, counted
    ids[10:22] = 2  # chunk 1: the first long enough, replayed, not counted
    ids[22:, 0] = 3  # chunk 2: counted
    trace = TraceFile(ids=ids, starts=np.array([0, 10, 22, 30]), n_expert=4)
    counts = bench_cache.trace_counts(trace, 3, (1, 2), 12)
    assert counts.tolist() == [[0, 0, 0, 0], [0, 10, 0, 8], [8, 10, 0, 0]]
    lone = TraceFile(ids=ids[10:22], starts=np.array([0, 12]), n_expert=4)
    with pytest.raises(Exception, match="no chunk besides the replayed one"):
        bench_cache.trace_counts(lone, 3, (1, 2), 12)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench/seed_box.py", "missing.gguf", "results.json"], "missing.gguf"),
        (["bench/bench_archs_gpu.py", "out", "--archs", "nope"], "moerun does not run nope"),
        (
            ["bench/bench_cache.py", "bench/models/bench-qwen3moe-q4k.gguf", "--budget", "1G", "-f", "README.md"]
            + ["--routing", "missing.npz"],
            "no such routing trace",
        ),
        (["bench/bench_cache_plan.py", "--cold", "--prompt", "600"], "fit a replayed chunk of 512"),
        (["bench/bench_cache_plan.py", "--regimes", "nope"], "unknown regime nope"),
        (["bench/bench_cache_plan.py", "--model", "missing.gguf"], "missing.gguf: no such model file"),
    ],
)
def test_bench_scripts_refuse_bad_input_in_one_line(argv, message):
    result = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr
    assert not (ROOT / "out").exists()
