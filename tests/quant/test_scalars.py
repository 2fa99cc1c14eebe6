"""ggml's scalar conversions (moeprep.quant.scalars) against the C bit trick and numpy's float16."""

from __future__ import annotations

import struct

import numpy as np

from moeprep.quant.scalars import fp16_bits, fp16_value, nearest_int


def test_nearest_int_wraps_like_c():
    """In range it rounds half to even; out of range it returns the C bit trick's value, not a rounded one."""

    def c_nearest_int(v: float) -> int:
        bits = struct.unpack("<i", struct.pack("<f", np.float32(np.float32(v) + np.float32(12582912.0))))[0]
        return (bits & 0x007FFFFF) - 0x00400000

    values = np.array(
        [0.5, 1.5, 2.5, -0.5, -1.5, 3.49, 4194303.0, -4194303.0, 5e6, -9e6, 1e20, np.inf, -np.inf, np.nan], np.float32
    )
    with np.errstate(invalid="ignore", over="ignore"):
        got = [nearest_int(v) for v in values]
    assert got == [c_nearest_int(v) for v in values]
    assert got[:6] == [0, 2, 2, 0, -2, 3]


def test_fp16_conversion_matches_numpy():
    """fp16_bits rounds to nearest even as numpy's float16 cast does (normals, subnormals, ties, overflow to inf,
    signed zeros), keeps x86's default NaN as 0xFE00; fp16_value reads every non-NaN fp16 back exactly."""
    rng = np.random.default_rng(0)
    every = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
    every = every[~np.isnan(every)]
    values = np.concatenate(
        [
            (rng.standard_normal(20000) * np.exp(rng.standard_normal(20000) * 8)).astype(np.float32),
            every,
            np.nextafter(every, np.float32(np.inf)),  # every fp16 value, and the float32 just above it
            np.array(
                [0.0, -0.0, 65504.0, 65519.996, 65520.0, 1e30, -np.inf, 2.0**-25, 2.0**-26, 3 * 2.0**-26], np.float32
            ),
        ]
    )
    with np.errstate(over="ignore"):
        expected = values.astype(np.float16).view(np.uint16)
    assert [fp16_bits(v) for v in values] == expected.tolist()
    assert fp16_bits(np.uint32(0xFFC00000).view(np.float32)) == 0xFE00
    halves = np.arange(1 << 16, dtype=np.uint16)
    finite = halves[~np.isnan(halves.view(np.float16))]
    back = np.array([fp16_value(int(h)) for h in finite], np.float32)
    assert np.array_equal(back.view(np.uint32), finite.view(np.float16).astype(np.float32).view(np.uint32))
