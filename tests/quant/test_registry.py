"""The quantizer table against libggml for every target type, the fallback table, and input checks."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from moeprep.errors import MoeprepError
from moeprep.gguf.reader import dequantize_raw
from moeprep.quant import registry

LEGACY = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1]
PLAIN = [T.Q8_0, T.F16, T.BF16, T.F32]


def signed_zero_rows(n_per_row: int, rng: np.random.Generator) -> np.ndarray:
    """Blocks that are all zeros of both signs, and sparse rows whose zeros are -0.0 (0 * negative)."""
    zeros = np.where(rng.random((2, n_per_row)) < 0.5, 0.0, -0.0)
    sparse = rng.standard_normal((2, n_per_row)) * (rng.random((2, n_per_row)) < 0.1)
    return np.concatenate([zeros, sparse]).astype(np.float32)


@pytest.mark.parametrize("n_per_row", [32, 96, 256, 2880])
@pytest.mark.parametrize("with_imatrix", [False, True], ids=["ref", "imatrix"])
@pytest.mark.parametrize("qtype", LEGACY + PLAIN, ids=lambda t: t.name)
def test_table_matches_ggml(ggml, qtype, with_imatrix, n_per_row):
    rng = np.random.default_rng(n_per_row)
    rows = np.concatenate(
        [
            rng.standard_normal((8, n_per_row)) * rng.exponential(1.0, (8, 1)),
            np.zeros((1, n_per_row)),
            np.full((1, n_per_row), -3.0),
            rng.standard_normal((1, n_per_row)) * 1e30,
            rng.standard_normal((1, n_per_row)) * 1e-30,
            -np.abs(rng.standard_normal((1, n_per_row))),
            signed_zero_rows(n_per_row, rng),
        ]
    ).astype(np.float32)
    qw = (rng.random(n_per_row) ** 2 * 3).astype(np.float32) if with_imatrix else None
    ours = registry.quantize_rows(rows, qtype, qw)
    ggml.assert_same_blocks(ours, ggml.quantize(rows, qtype, qw), qtype, f"rows of {n_per_row}")


@pytest.mark.parametrize("qtype", LEGACY, ids=lambda t: t.name)
def test_legacy_per_row_importance_across_lane_groups(ggml, qtype):
    """Rows of 45 blocks: the weighted search's lane groups (moeprep.quant.searches.LANES blocks) cross row ends, each block with
    its own row's sigma2 and importance row; equal to quantizing each row with its own [P] importance."""
    rng = np.random.default_rng(4)
    rows = (rng.standard_normal((5, 1440)) * rng.exponential(1.0, (5, 1))).astype(np.float32)
    per_row = (rng.random((5, 1440)) + 0.1).astype(np.float32)
    theirs = np.concatenate([ggml.quantize(rows[r : r + 1], qtype, per_row[r]) for r in range(5)])
    ggml.assert_same_blocks(registry.quantize_rows(rows, qtype, per_row), theirs, qtype, "per-row importance")


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K, T.Q6_K], ids=lambda t: t.name)
def test_k_types_route_to_kquants(ggml, qtype):
    rng = np.random.default_rng(1)
    rows = rng.standard_normal((4, 512)).astype(np.float32)
    qw = rng.random(512).astype(np.float32)
    for imatrix in (None, qw):
        ggml.assert_same_blocks(
            registry.quantize_rows(rows, qtype, imatrix),
            ggml.quantize(rows, qtype, imatrix),
            qtype,
            f"imatrix={imatrix is not None}",
        )


def test_every_fallback_fits_and_is_quantizable():
    for target, fallback in registry.FALLBACK.items():
        assert GGML_QUANT_SIZES[target][0] == 256 and GGML_QUANT_SIZES[fallback][0] == 32
        assert fallback in registry.QUANTIZERS


@pytest.mark.parametrize(
    "target, n_per_row, expected",
    [
        (T.Q4_K, 4096, (T.Q4_K, False)),
        (T.Q4_K, 2880, (T.Q5_0, True)),  # gpt-oss's hidden size
        (T.Q5_K, 2880, (T.Q5_1, True)),
        (T.Q6_K, 2880, (T.Q8_0, True)),
        (T.Q6_K, 100, (T.F16, True)),  # not even a multiple of 32
        (T.Q8_0, 96, (T.Q8_0, False)),
        (T.Q4_0, 100, (T.F16, True)),  # a 32-block type has nothing smaller to fall back to
        (T.F16, 7, (T.F16, False)),
        (T.F32, 7, (T.F32, False)),
    ],
)
def test_choose_type_follows_llama_quantize(target, n_per_row, expected):
    assert registry.choose_type(target, n_per_row) == expected


def test_unsupported_type_is_a_user_error():
    with pytest.raises(MoeprepError, match="cannot quantize to Q2_K"):
        registry.choose_type(T.Q2_K, 4096)
    with pytest.raises(MoeprepError, match="cannot quantize to IQ4_XS"):
        registry.quantize_rows(np.zeros((1, 256), np.float32), T.IQ4_XS)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0, T.Q4_0, T.F16], ids=lambda t: t.name)
def test_non_finite_input_is_refused(qtype, bad):
    rows = np.ones((3, 256), np.float32)
    rows[1, 17] = bad
    with pytest.raises(MoeprepError, match=r"1 NaN/Inf value\(s\).*\[1, 17\]"):
        registry.quantize_rows(rows, qtype)


def test_bad_imatrix_is_refused():
    rows = np.ones((2, 256), np.float32)
    qw = np.ones(256, np.float32)
    qw[3] = np.nan
    with pytest.raises(MoeprepError, match="importance matrix has NaN/Inf"):
        registry.quantize_rows(rows, T.Q4_K, qw)
    with pytest.raises(MoeprepError, match="does not fit rows"):
        registry.quantize_rows(rows, T.Q4_K, np.ones(128, np.float32))


def test_row_length_that_does_not_fit_points_to_choose_type():
    with pytest.raises(MoeprepError, match="choose_type"):
        registry.quantize_rows(np.ones((2, 2880), np.float32), T.Q4_K)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0, T.Q5_0, T.BF16, T.F16, T.F32], ids=lambda t: t.name)
def test_dequantize_round_trip(qtype):
    rows = np.random.default_rng(2).standard_normal((3, 256)).astype(np.float32)
    raw = registry.quantize_rows(rows, qtype)
    back = dequantize_raw(raw, qtype, rows.shape)
    assert back.shape == rows.shape and back.dtype == np.float32
    assert np.abs(back - rows).max() < 0.2
