"""GB/s of expert bytes through moerun's CPU expert kernels, next to the host-RAM read bandwidth of the same run.

    python bench/bench_cpu_experts.py [--threads 1,N] [--types Q4_K,Q4_0,Q8_0] [--shapes 60gb,30b] [--repeat 10]
                                      [--json OUT]

For each expert type and shape: moe_rows on one token with 1 expert and with 8 experts (gate, up and down of each),
at each thread count (default 1 and os.cpu_count()). Bytes are the GGUF bytes of the experts read; each call picks
experts not used by the call before (the stack is large enough that they come from RAM, not the last-level cache);
the time is the median of --repeat calls. Shapes: 60gb = the 60 GB benchmark model's experts (gate/up 4096 -> 1408,
down 1408 -> 4096; a K-quant down falls back to Q4_0 there, as in that model, since 1408 is no multiple of 256),
30b = Qwen3-30B-A3B's (2048 -> 768, 768 -> 2048). The bandwidth line is a numba parallel sum over a 1 GiB array.
For the whole-model peer (llama.cpp's CPU decode on the same machine and threads) run bench/bench_runtime.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numba
import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from moeprep.synth.weights import random_blocks
from moerun.kernels.cpu.formats import ExpertBytes
from moerun.kernels.cpu.moe_rows import moe_rows

# name -> (D hidden, I expert hidden, experts in the stack)
SHAPES = {"60gb": (4096, 1408, 32), "30b": (2048, 768, 64)}


@numba.njit(parallel=True, nogil=True, cache=True)
def _parallel_sum(a: np.ndarray, n_chunks: int) -> int:
    total = 0
    step = -(-a.shape[0] // n_chunks)
    for c in numba.prange(n_chunks):
        s = 0
        for i in range(c * step, min((c + 1) * step, a.shape[0])):
            s += a[i]
        total += s
    return total


def ram_read_gbps(threads: int, repeat: int) -> float:
    """Read bandwidth of a parallel sum over 1 GiB (uint64 words), median of `repeat`."""
    a = np.ones(2**27, np.uint64)
    numba.set_num_threads(threads)
    _parallel_sum(a, threads)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        _parallel_sum(a, threads)
        times.append(time.perf_counter() - start)
    return a.nbytes / statistics.median(times) / 1e9


def stack(rng: np.random.Generator, qtype: Q, n_experts: int, rows: int, cols: int) -> ExpertBytes:
    return ExpertBytes(random_blocks(rng, (n_experts, rows, cols), qtype, 0.02), qtype, rows, cols)


def bench_experts(qtype: Q, shape: str, threads: list[int], repeat: int) -> list[dict]:
    D, I, E = SHAPES[shape]
    rng = np.random.default_rng(0)
    down_type = qtype if I % GGML_QUANT_SIZES[qtype][0] == 0 else Q.Q4_0
    gate, up, down = stack(rng, qtype, E, I, D), stack(rng, qtype, E, I, D), stack(rng, down_type, E, D, I)
    bytes_per_expert = sum(t.data[0].nbytes for t in (gate, up, down))
    x = rng.standard_normal((1, D)).astype(np.float32)
    out = np.zeros((1, D), np.float32)
    rows = []
    for n_experts in (1, 8):
        sets = [np.arange(i, i + n_experts)[None] % E for i in range(0, E, n_experts)]  # disjoint, in turn
        weights = np.full((1, n_experts), 1.0 / n_experts, np.float32)
        for n in threads:
            moe_rows(x, sets[0], weights, gate, up, down, "swiglu", out, threads=n)  # compile, warm up
            times = []
            for i in range(repeat):
                start = time.perf_counter()
                moe_rows(x, sets[(i + 1) % len(sets)], weights, gate, up, down, "swiglu", out, threads=n)
                times.append(time.perf_counter() - start)
            seconds = statistics.median(times)
            rows.append(
                {
                    "shape": shape,
                    "types": f"{qtype.name}/{qtype.name}/{down_type.name}",
                    "experts": n_experts,
                    "threads": n,
                    "ms": seconds * 1e3,
                    "gbps": n_experts * bytes_per_expert / seconds / 1e9,
                }
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default=f"1,{os.cpu_count()}")
    ap.add_argument("--types", default="Q4_K,Q4_0,Q8_0")
    ap.add_argument("--shapes", default="60gb,30b")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--json", help="write the numbers here")
    args = ap.parse_args()
    threads = sorted({int(n) for n in args.threads.split(",")})
    ram = {n: ram_read_gbps(n, args.repeat) for n in threads}
    rows = [
        row
        for shape in args.shapes.split(",")
        for name in args.types.split(",")
        for row in bench_experts(Q[name], shape, threads, args.repeat)
    ]
    print("host RAM read (parallel sum, 1 GiB): " + ", ".join(f"{ram[n]:.1f} GB/s with {n} threads" for n in threads))
    print(f"{'shape':<6}{'gate/up/down':<18}{'experts':>8}{'threads':>8}{'ms':>9}{'GB/s':>8}{'of RAM':>8}")
    for r in rows:
        print(
            f"{r['shape']:<6}{r['types']:<18}{r['experts']:>8}{r['threads']:>8}{r['ms']:>9.2f}{r['gbps']:>8.2f}"
            f"{r['gbps'] / ram[r['threads']]:>8.0%}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"ram_gbps": ram, "rows": rows, **vars(args)}, indent=2))


if __name__ == "__main__":
    main()
