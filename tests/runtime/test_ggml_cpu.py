"""moerun.kernels.ggml_cpu: ggml's row dot products (libggml-cpu from llama-cpp-python, the test extra) under
moe_rows, against moerun's own numba kernels (test_cpu_experts.py checks both against float64)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from moerun.kernels import cpu_experts, ggml_cpu
from moerun.kernels.cpu_experts import moe_rows

from tests.runtime.test_cpu_experts import expert_bytes

pytestmark = pytest.mark.skipif(ggml_cpu.row_dot(Q.Q4_K) is None, reason="llama-cpp-python is not installed")


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q4_0, Q.MXFP4, Q.IQ4_XS], ids=lambda q: q.name)
def test_ggml_row_dots_equal_the_numba_kernels(monkeypatch, qtype):
    """Where ggml covers a type, moe_rows runs its row dots, and they give the numba kernels' sums up to float32
    rounding (the same roundings of the input, both exact integer block sums); Q4_1/Q5_1 stay with numba."""
    rng = np.random.default_rng([int(qtype), 3])
    cols = 512 if GGML_QUANT_SIZES[qtype][0] == 256 else 320
    gate, up = (expert_bytes(rng, qtype, n_experts=4, rows=cols, cols=cols) for _ in range(2))
    down = expert_bytes(rng, qtype, n_experts=4, rows=cols, cols=cols)
    assert all(cpu_experts._ggml_kernel(t) is not None for t in (gate, up, down))
    assert cpu_experts._ggml_kernel(expert_bytes(rng, Q.Q4_1, n_experts=1, rows=8, cols=320)) is None
    x = rng.standard_normal((3, cols)).astype(np.float32)
    ids, weights = np.array([[0, 2], [3, -1], [2, 1]]), rng.random((3, 2)).astype(np.float32)
    act = "swiglu_oai" if qtype == Q.MXFP4 else "swiglu"
    ours = np.zeros_like(x)
    moe_rows(x, ids, weights, gate, up, down, act, ours)
    monkeypatch.setattr(cpu_experts, "_ggml_kernel", lambda t: None)
    numba_only = np.zeros_like(x)
    moe_rows(x, ids, weights, gate, up, down, act, numba_only)
    assert np.abs(numba_only).max() > 0
    np.testing.assert_allclose(ours, numba_only, rtol=0, atol=1e-5 * np.abs(numba_only).max())


def forget_library() -> None:
    """Clear ggml_cpu's cached library and row dots, which read the environment once."""
    for cached in (ggml_cpu._library, ggml_cpu.row_dot):
        cached.cache_clear()


@pytest.fixture
def fresh_library():
    """The library and row dots looked up again in the test, and again after it."""
    forget_library()
    yield
    forget_library()


def test_ggml_is_off_with_the_environment_switch(monkeypatch, fresh_library):
    """MOERUN_GGML_CPU=0: no ggml kernel for any type (the numba kernels run)."""
    monkeypatch.setenv("MOERUN_GGML_CPU", "0")
    assert ggml_cpu.row_dot(Q.Q4_K) is None
    monkeypatch.delenv("MOERUN_GGML_CPU")
    forget_library()
    assert ggml_cpu.row_dot(Q.Q4_K) is not None


def test_a_named_library_is_used(monkeypatch, fresh_library):
    """MOERUN_GGML_CPU_LIB: the libggml-cpu.so of a llama.cpp build (here llama-cpp-python's own file, named by
    path) gives the same row dots, and `moerun bench` says whose they are."""
    import llama_cpp

    path = str(Path(llama_cpp.__file__).parent / "lib" / "libggml-cpu.so")
    monkeypatch.setenv("MOERUN_GGML_CPU_LIB", path)
    assert ggml_cpu.row_dot(Q.Q4_K) is not None and ggml_cpu._library()._name == path
    assert path in ggml_cpu.describe()


@pytest.mark.parametrize("what", ["missing", "not a library"])
def test_a_bad_named_library_is_one_line_and_exit_2(monkeypatch, fresh_library, tmp_path, synth_model, what):
    from click.testing import CliRunner

    from moerun.cli import main

    path = tmp_path / "libggml-cpu.so"
    if what == "not a library":
        path.write_text("not an ELF file")
    monkeypatch.setenv("MOERUN_GGML_CPU_LIB", str(path))
    result = CliRunner().invoke(main, ["-m", str(synth_model("qwen3moe", expert_type="Q4_K")), "-p", "hi",
                                       "-n", "1", "--device", "cpu"])
    assert result.exit_code == 2, result.output
    assert f"MOERUN_GGML_CPU_LIB={path}" in result.output and "Traceback" not in result.output
    lines = result.output.strip().splitlines()  # the device line, then the error
    assert len(lines) == 2 and lines[0] == "moerun: running on cpu (--device cpu)"


def test_moerun_bench_says_whose_cpu_kernels_run(synth_model):
    from click.testing import CliRunner

    from moerun.cli import main

    result = CliRunner().invoke(main, ["bench", "-m", str(synth_model("qwen3moe")), "-p", "8", "-n", "2",
                                       "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "CPU kernels: ggml's row dots" in result.output
