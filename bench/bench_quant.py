"""Throughput of moeprep's quantizers against libggml's ggml_quantize_chunk (single thread), on the same rows.

    python bench/bench_quant.py [--rows 256] [--cols 4096] [--repeat 3]

Prints MB of float32 input per second (best of --repeat runs) for Q4_K, Q5_K, Q6_K and the 32-value types Q4_0,
Q4_1, Q5_0, Q5_1, without and with an importance matrix, and whether the bytes are equal. Each repetition times ours
then ggml's, so that load from other jobs on the machine falls on both alike. Ours are numba kernels, compiled (or
loaded from numba's cache) by a warm-up call before timing; they use no threads of their own, like
ggml_quantize_chunk. The oracle comes from tests/quant/conftest.py (llama-cpp-python).
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T

from moeprep.quant import registry

CONFTEST = Path(__file__).resolve().parent.parent / "tests" / "quant" / "conftest.py"
TYPES = [T.Q4_K, T.Q5_K, T.Q6_K, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1]


def load_oracle():
    spec = importlib.util.spec_from_file_location("quant_oracle", CONFTEST)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.load_ggml()


def seconds(fn) -> tuple[float, np.ndarray]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    rows = (rng.standard_t(4, (args.rows, args.cols)) * rng.exponential(1.0, (args.rows, 1))).astype(np.float32)
    imatrix = (rng.random(args.cols) ** 2 * 3).astype(np.float32)
    mb = rows.nbytes / 1e6
    ggml = load_oracle()

    print(f"{args.rows} x {args.cols} float32 rows ({mb:.1f} MB), best of {args.repeat}")
    print(f"{'type':6} {'imatrix':8} {'ours MB/s':>10} {'ggml MB/s':>10} {'ggml/ours':>10}  bytes")
    for qtype in TYPES:
        quantize = registry.QUANTIZERS[qtype]
        for qw in (None, imatrix):
            quantize(rows[:2], qw)  # warm-up: JIT compile or cache load
            ours_s = ggml_s = float("inf")
            for _ in range(args.repeat):
                t, ours = seconds(lambda f=quantize, w=qw: f(rows, w))
                ours_s = min(ours_s, t)
                t, theirs = seconds(lambda q=qtype, w=qw: ggml.quantize(rows, q, w))
                ggml_s = min(ggml_s, t)
            same = "equal" if np.array_equal(ours, theirs) else "DIFFER"
            print(
                f"{qtype.name:6} {'yes' if qw is not None else 'no':8} {mb / ours_s:10.1f} {mb / ggml_s:10.1f} "
                f"{ours_s / ggml_s:10.2f}  {same}",
                flush=True,
            )


if __name__ == "__main__":
    main()
