"""moerun.kernels.ggml_cpu: ggml's row dot products (libggml-cpu from llama-cpp-python, the test extra) under
moe_rows, against moerun's own numba kernels (test_cpu_experts.py checks both against float64)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from moerun.kernels import ggml_cpu
from moerun.kernels.cpu.moe_rows import ggml_kernel, moe_rows
from moerun.options import RuntimeOptions
from tests.runtime.test_cpu_experts import expert_bytes

GGML = ggml_cpu.open_library()
pytestmark = pytest.mark.skipif(GGML is None, reason="llama-cpp-python is not installed")


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q4_0, Q.MXFP4, Q.IQ4_XS], ids=lambda q: q.name)
def test_ggml_row_dots_equal_the_numba_kernels(qtype):
    """Where ggml covers a type, moe_rows runs its row dots, and they give the numba kernels' sums up to float32
    rounding (the same roundings of the input, both exact integer block sums); Q4_1/Q5_1 stay with numba."""
    rng = np.random.default_rng([int(qtype), 3])
    cols = 512 if GGML_QUANT_SIZES[qtype][0] == 256 else 320
    gate, up = (expert_bytes(rng, qtype, n_experts=4, rows=cols, cols=cols) for _ in range(2))
    down = expert_bytes(rng, qtype, n_experts=4, rows=cols, cols=cols)
    assert all(ggml_kernel(t, GGML) is not None for t in (gate, up, down))
    assert ggml_kernel(expert_bytes(rng, Q.Q4_1, n_experts=1, rows=8, cols=320), GGML) is None
    assert ggml_kernel(gate, None) is None
    x = rng.standard_normal((3, cols)).astype(np.float32)
    ids, weights = np.array([[0, 2], [3, -1], [2, 1]]), rng.random((3, 2)).astype(np.float32)
    act = "swiglu_oai" if qtype == Q.MXFP4 else "swiglu"
    ours = np.zeros_like(x)
    moe_rows(x, ids, weights, gate, up, down, act, ours, ggml=GGML)
    numba_only = np.zeros_like(x)
    moe_rows(x, ids, weights, gate, up, down, act, numba_only)
    assert np.abs(numba_only).max() > 0
    np.testing.assert_allclose(ours, numba_only, rtol=0, atol=1e-5 * np.abs(numba_only).max())


def test_ggml_is_off_with_the_environment_switch(synth_model):
    """MOERUN_GGML_CPU=0: the options give no library, and a model built with them runs no ggml row dot (its CPU
    layers hold none)."""
    import moerun
    from moerun.layers.gguf_cpu import CPUExperts

    off = RuntimeOptions.from_environment({"MOERUN_GGML_CPU": "0"})
    assert off.ggml_library() is None and RuntimeOptions.from_environment({}).ggml_library() is GGML
    model = moerun.load_model(synth_model("qwen3moe", expert_type="Q4_K"), options=off)
    experts = [m.experts for m in model.net.modules() if isinstance(getattr(m, "experts", None), CPUExperts)]
    assert experts and all(e.ggml is None for e in experts)


def test_a_named_library_is_used():
    """MOERUN_GGML_CPU_LIB: the libggml-cpu.so of a llama.cpp build (here llama-cpp-python's own file, named by
    path) gives the same row dots, and `moerun bench` says whose they are."""
    import llama_cpp

    path = str(Path(llama_cpp.__file__).parent / "lib" / "libggml-cpu.so")
    named = RuntimeOptions.from_environment({"MOERUN_GGML_CPU_LIB": path}).ggml_library()
    assert named.row_dot(Q.Q4_K) is not None and named.path == path and named.named
    assert path in ggml_cpu.describe(named)


@pytest.mark.parametrize("what", ["missing", "not a library"])
def test_a_bad_named_library_is_one_line_and_exit_2(monkeypatch, tmp_path, synth_model, what):
    from click.testing import CliRunner

    from moerun.cli import main

    path = tmp_path / "libggml-cpu.so"
    if what == "not a library":
        path.write_text("not an ELF file")
    monkeypatch.setenv("MOERUN_GGML_CPU_LIB", str(path))
    result = CliRunner().invoke(
        main, ["-m", str(synth_model("qwen3moe", expert_type="Q4_K")), "-p", "hi", "-n", "1", "--device", "cpu"]
    )
    assert result.exit_code == 2, result.output
    assert f"MOERUN_GGML_CPU_LIB={path}" in result.output and "Traceback" not in result.output
    lines = result.output.strip().splitlines()  # the device line, then the error
    assert len(lines) == 2 and lines[0] == "moerun: running on cpu (--device cpu)"


def test_moerun_bench_says_whose_cpu_kernels_run(synth_model):
    from click.testing import CliRunner

    from moerun.cli import main

    result = CliRunner().invoke(
        main, ["bench", "-m", str(synth_model("qwen3moe")), "-p", "8", "-n", "2", "--device", "cpu"]
    )
    assert result.exit_code == 0, result.output
    assert "CPU kernels: ggml's row dots" in result.output
