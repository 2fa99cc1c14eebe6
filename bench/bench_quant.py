"""Throughput of moeprep's K-quantizers against libggml's ggml_quantize_chunk (single thread), on the same rows.

    python bench/bench_quant.py [--rows 256] [--cols 4096] [--repeat 3]

Prints MB of float32 input per second (best of --repeat runs) for Q4_K, Q5_K and Q6_K, without and with an
importance matrix, and whether the bytes are equal. The oracle comes from tests/quant/conftest.py (llama-cpp-python).
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from moeprep.quant import kquants

CONFTEST = Path(__file__).resolve().parent.parent / "tests" / "quant" / "conftest.py"


def load_oracle():
    spec = importlib.util.spec_from_file_location("quant_oracle", CONFTEST)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.load_ggml()


def best_seconds(fn: Callable[[], np.ndarray], repeat: int) -> tuple[float, np.ndarray]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


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
    for qtype, quantize in kquants.KQUANTIZERS.items():
        for qw in (None, imatrix):
            ours_s, ours = best_seconds(lambda: quantize(rows, qw), args.repeat)
            ggml_s, theirs = best_seconds(lambda: ggml.quantize(rows, qtype, qw), args.repeat)
            same = "equal" if np.array_equal(ours, theirs) else "DIFFER"
            print(f"{qtype.name:6} {'yes' if qw is not None else 'no':8} {mb / ours_s:10.1f} {mb / ggml_s:10.1f} "
                  f"{ours_s / ggml_s:10.2f}  {same}")


if __name__ == "__main__":
    main()
