"""Q4_K / Q5_K / Q6_K bytes against libggml's ggml_quantize_chunk, with and without an importance matrix."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from moeprep.quant import kquants

KTYPES = [T.Q4_K, T.Q5_K, T.Q6_K]
IMATRIX = [None, "random", "sparse"]


def make_imatrix(kind: str | None, n_per_row: int, rng: np.random.Generator) -> np.ndarray | None:
    """None, positive random importance, or one that is zero almost everywhere (zero-weight sub-blocks)."""
    if kind is None:
        return None
    if kind == "random":
        return (rng.random(n_per_row) ** 2 * 3).astype(np.float32)
    return ((rng.random(n_per_row) < 0.1) * 5).astype(np.float32)


def adversarial_rows(n_per_row: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Named [4, n_per_row] inputs that hit ggml's edge paths (zero groups, fp16 overflow, signed zeros...)."""

    def normal() -> np.ndarray:
        return rng.standard_normal((4, n_per_row))

    outlier = normal() * 0.01
    outlier[:, 7], outlier[:, n_per_row // 2 + 3] = 50.0, -80.0
    rows = {
        "zeros": np.zeros((4, n_per_row)),
        "constant": np.full((4, n_per_row), 0.37),
        "constant-negative": np.full((4, n_per_row), -2.5),
        "one-outlier": outlier,
        "huge-1e4": normal() * 1e4,
        "huge-6e4": normal() * 6e4,  # scales overflow fp16
        "huge-1e30": normal() * 1e30,  # x*x overflows float32
        "tiny-1e-10": normal() * 1e-10,
        "tiny-1e-30": normal() * 1e-30,  # below GROUP_MAX_EPS
        "negative-only": -np.abs(normal()),
        "positive-only": np.abs(normal()),
        "integer-grid": rng.integers(-8, 8, (4, n_per_row)).astype(float),
        "sparse-signed-zeros": normal() * (rng.random((4, n_per_row)) < 0.05),
        "signed-zeros": np.where(rng.random((4, n_per_row)) < 0.5, 0.0, -0.0),
        "mixed-scales": normal() * np.exp(rng.standard_normal((4, n_per_row // 32)) * 4).repeat(32, axis=1),
    }
    return {k: v.astype(np.float32) for k, v in rows.items()}


@pytest.mark.parametrize("n_per_row", [256, 512, 2048])
@pytest.mark.parametrize("imatrix", IMATRIX)
@pytest.mark.parametrize("qtype", KTYPES, ids=lambda t: t.name)
def test_random_rows_match_ggml(ggml, qtype, imatrix, n_per_row):
    rng = np.random.default_rng(n_per_row)
    rows = (rng.standard_t(3, (16, n_per_row)) * rng.exponential(1.0, (16, 1))).astype(np.float32)
    qw = make_imatrix(imatrix, n_per_row, rng)
    ours = kquants.KQUANTIZERS[qtype](rows, qw)
    theirs = ggml.quantize(rows, qtype, qw)
    ggml.assert_same_blocks(ours, theirs, qtype, f"random rows of {n_per_row}, imatrix={imatrix}")


@pytest.mark.parametrize("imatrix", IMATRIX)
@pytest.mark.parametrize("qtype", KTYPES, ids=lambda t: t.name)
def test_adversarial_rows_match_ggml(ggml, qtype, imatrix):
    rng = np.random.default_rng(7)
    qw = make_imatrix(imatrix, 512, rng)
    for name, rows in adversarial_rows(512, rng).items():
        ours = kquants.KQUANTIZERS[qtype](rows, qw)
        ggml.assert_same_blocks(ours, ggml.quantize(rows, qtype, qw), qtype, f"{name}, imatrix={imatrix}")


@pytest.mark.parametrize("qtype", KTYPES, ids=lambda t: t.name)
def test_lane_groups_and_per_row_importance(ggml, qtype):
    """15 super-blocks fill several lane groups and part of the last (moeprep.quant.searches.LANES); an [R, P] importance equals
    quantizing each row with its own [P] one."""
    rng = np.random.default_rng(3)
    rows = rng.standard_normal((5, 768)).astype(np.float32)
    per_row = (rng.random((5, 768)) + 0.1).astype(np.float32)
    ours = kquants.KQUANTIZERS[qtype](rows, per_row)
    theirs = np.concatenate([ggml.quantize(rows[r : r + 1], qtype, per_row[r]) for r in range(5)])
    ggml.assert_same_blocks(ours, theirs, qtype, "per-row importance over a partial lane group")
    reference = kquants.KQUANTIZERS[qtype](rows, None)
    ggml.assert_same_blocks(reference, ggml.quantize(rows, qtype), qtype, "reference over a partial lane group")


@pytest.mark.parametrize("qtype", KTYPES, ids=lambda t: t.name)
def test_threads_give_the_bytes_of_one_call(qtype):
    """The kernels release the GIL (moeprep.quant.quantize runs row chunks in a thread pool): chunks quantized on
    four threads at once equal one call over all rows."""
    rng = np.random.default_rng(5)
    rows = rng.standard_normal((64, 1024)).astype(np.float32)
    qw = make_imatrix("random", 1024, rng)
    quantize = kquants.KQUANTIZERS[qtype]
    for imatrix in (None, qw):
        with ThreadPoolExecutor(max_workers=4) as pool:
            parts = list(pool.map(lambda r0, w=imatrix: quantize(rows[r0 : r0 + 8], w), range(0, 64, 8)))
        assert np.array_equal(np.concatenate(parts), quantize(rows, imatrix))


def test_output_shape_and_type_sizes():
    rows = np.random.default_rng(0).standard_normal((3, 512)).astype(np.float32)
    assert kquants.quantize_q4_k(rows).shape == (3, 2 * 144)
    assert kquants.quantize_q5_k(rows).shape == (3, 2 * 176)
    assert kquants.quantize_q6_k(rows).shape == (3, 2 * 210)
    assert kquants.quantize_q6_k(rows).dtype == np.uint8
