"""The oracle for tests/quant: libggml's ggml_quantize_chunk, loaded from llama-cpp-python through ctypes.

llama-cpp-python is a declared test dependency (pyproject's `test` extra), so a missing one fails the tests
instead of skipping them: a skipped oracle would let a byte-level regression pass unnoticed.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType


class GgmlQuantizer:
    """ggml_quantize_chunk over rows [R, P] float32 (+ importance [P]) -> bytes [R, row_bytes]."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        lib.ggml_quantize_chunk.restype = ctypes.c_size_t
        lib.ggml_quantize_chunk.argtypes = [
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_void_p,
        ]
        lib.ggml_quantize_init.restype = None
        lib.ggml_quantize_init.argtypes = [ctypes.c_int]

    def quantize(self, rows: np.ndarray, qtype: GGMLQuantizationType, imatrix: np.ndarray | None = None) -> np.ndarray:
        rows = np.ascontiguousarray(rows, dtype=np.float32)
        n_rows, n_per_row = rows.shape
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        out = np.zeros((n_rows, n_per_row // block_size * type_size), np.uint8)
        qw = None if imatrix is None else np.ascontiguousarray(imatrix, dtype=np.float32)
        self.lib.ggml_quantize_init(int(qtype))
        written = self.lib.ggml_quantize_chunk(
            int(qtype), rows.ctypes.data, out.ctypes.data, 0, n_rows, n_per_row, None if qw is None else qw.ctypes.data
        )
        assert written == out.nbytes
        return out

    @staticmethod
    def assert_same_blocks(ours: np.ndarray, theirs: np.ndarray, qtype: GGMLQuantizationType, label: str) -> None:
        """Byte equality, reported per block: how many differ and the first bad one (ours vs ggml's bytes)."""
        assert ours.dtype == np.uint8 and ours.shape == theirs.shape, (ours.dtype, ours.shape, theirs.shape)
        type_size = GGML_QUANT_SIZES[qtype][1]
        a, b = ours.reshape(-1, type_size), theirs.reshape(-1, type_size)
        bad = np.flatnonzero((a != b).any(axis=1))
        if bad.size:
            i = int(bad[0])
            raise AssertionError(
                f"{qtype.name} {label}: {bad.size} of {a.shape[0]} blocks differ; "
                f"first bad block {i} (bytes {np.flatnonzero(a[i] != b[i]).tolist()[:16]}):\n"
                f"  ours {a[i].tolist()}\n  ggml {b[i].tolist()}"
            )


def load_ggml() -> GgmlQuantizer:
    """libggml-base from the installed llama-cpp-python; ImportError/OSError if it is missing."""
    import llama_cpp

    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    candidates = sorted(lib_dir.glob("libggml-base.*")) + sorted(lib_dir.glob("ggml-base.*"))
    if not candidates:
        raise OSError(f"no libggml-base shared library under {lib_dir}")
    return GgmlQuantizer(ctypes.CDLL(str(candidates[0])))


@pytest.fixture(scope="session")
def ggml() -> GgmlQuantizer:
    try:
        return load_ggml()
    except (ImportError, OSError) as e:
        pytest.fail(
            f"the libggml oracle (llama-cpp-python, a test dependency) is not usable: {e}; pip install -e '.[test]'"
        )
