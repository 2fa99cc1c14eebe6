"""How moeprep's numba kernels are built, so that they compute what ggml's C computes, bit for bit.

The quantizers (moeprep.quant.kquants, moeprep.quant.registry) and moerun's CPU kernels are numba functions
compiled with JIT's options, on float32 values (F32). Bit-exactness rests on these habits, each mirroring what the
C does:
  * every value is float32: numba types `float32 op float32` as float32, but a Python float literal or an int mixed
    with a float32 gives float64, so every constant is an `F32(...)` and every integer level is converted with
    `F32(l)` before it meets a float;
  * the C's association order (`w*l*x` is `(w*l)*x`), and no fused multiply-add: the kernels are compiled without
    fastmath, so LLVM neither contracts a*b+c nor reorders a running sum `s += t[i]`. Its SIMD runs across lanes,
    which are independent, so vectorising changes no lane's operations or their order;
  * `nearest_int` (moeprep.quant.scalars) is ggml's magic-number trick on the float32 bits, so out-of-range values
    (huge or overflowing inputs, a search that drifted) wrap the same way;
  * integer stores narrow like C casts (storing an int into a uint8 array or `np.int8(v)` wraps), and fp16 is
    `fp16_bits`, round-to-nearest-even like GGML_FP32_TO_FP16 (numba has no float16 scalar type);
  * `error_model="numpy"`: a float division by zero gives inf or NaN, as in C, instead of raising.

The kernels are compiled on first use and cached on disk (`cache=True`; see `_numba_cache_usable`), and release the
GIL (`nogil=True`), so moeprep.quant.quantize's thread pool runs row chunks in parallel. A row kernel takes
`(rows, qw, out, *params)` and fills out in place; `quantize_with` calls one from numpy.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import numba
import numpy as np
from numba.misc.appdirs import AppDirs

F32 = np.float32


def _writable(folder: Path) -> bool:
    """Whether numba could cache in folder: it creates it and writes a file there, as numba checks."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError:
        return False
    return True


def _numba_cache_usable() -> bool:
    """Make sure numba's on-disk cache has a writable home; False if none can be found (compile in memory).

    numba caches next to the source (moeprep/quant/__pycache__), else in the user-wide cache (~/.cache/numba); with
    neither writable (a read-only install and a read-only home) `cache=True` raises at import. Then the cache goes
    to a folder in the system temp dir, through NUMBA_CACHE_DIR (numba reads it when it places a function's cache);
    a NUMBA_CACHE_DIR the user set wins."""
    if numba.config.CACHE_DIR:
        return True
    if _writable(Path(__file__).parent / "__pycache__") or _writable(Path(AppDirs("numba", False).user_cache_dir)):
        return True
    try:
        fallback = Path(tempfile.gettempdir()) / f"moeprep-numba-{getattr(os, 'getuid', lambda: 0)()}"
    except FileNotFoundError:  # no writable temp dir either
        return False
    if not _writable(fallback):
        return False
    numba.config.CACHE_DIR = os.environ["NUMBA_CACHE_DIR"] = str(fallback)
    return True


# Options of every kernel (see the module docstring). fastmath stays off: it would allow FMA and reassociation.
JIT = {"cache": _numba_cache_usable(), "nogil": True, "error_model": "numpy"}


def quantize_with(
    kernel: Callable[..., None], rows: np.ndarray, imatrix: np.ndarray | None, row_bytes: int, *params: object
) -> np.ndarray:
    """Run a row kernel `kernel(rows, qw, out, *params)`. rows [R, P] float32, imatrix [P] or [R, P] -> [R, row_bytes].

    The kernel gets rows C-contiguous, qw as [1, P] (one importance for every row) or [R, P], or None."""
    rows = np.ascontiguousarray(rows, dtype=F32)
    qw = None if imatrix is None else np.ascontiguousarray(np.atleast_2d(imatrix), dtype=F32)
    out = np.empty((rows.shape[0], row_bytes), np.uint8)
    kernel(rows, qw, out, *params)
    return out
