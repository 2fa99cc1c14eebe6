"""The cost of one small moe_rows call (what the expert cache pays per layer for its misses), and where it goes.

    python bench/bench_moe_rows_call.py [--threads 1,2] [--repeat 30] [--impl PATH] [--json OUT]

Qwen3-30B-A3B's experts (D 2048, expert hidden I 768, 128 experts, Q4_K gate, up and down: 2.65 MB an expert) as
random valid blocks, and moe_rows on: 1 token with 1, 2 and 8 experts (decode misses), 1 token whose 8 slots are all
-1 (a layer where every expert was a hit: the call's floor), and 64 tokens with 8 experts each (a prompt), at each
thread count; and the fixed cost of a call, 1 token and 1 expert of a tiny stack (D = I = 256, 8 experts). Each
call takes experts the call before did not (disjoint sets in turn for one token, fresh random choices for 64), so
their bytes come from RAM. Times are the best of --repeat calls (the machine is shared: the best call is the one
nothing else interrupted), the median beside it.

Breakdown: the same calls again with moerun.kernels.cpu.moe_rows' numba entry points wrapped by a timer; "numba" is
the time inside them (their argument dispatch included), "Python" the rest of the call. "RAM bound" is the expert
bytes of the call over the host-RAM read bandwidth measured in the same run (bench_cpu_experts.ram_read_gbps: a
numba parallel sum over 1 GiB).
--impl PATH times another copy of moe_rows.py (say `git show REV:runtime/kernels/cpu/moe_rows.py > old.py`)
next to the current one, for a before/after under the same load.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType

import numpy as np
from bench_cpu_experts import ram_read_gbps  # bench/bench_cpu_experts.py: the RAM bound's clock
from gguf import GGMLQuantizationType as Q

from moeprep.synth.weights import random_blocks
from moerun.kernels.cpu import moe_rows as cpu_experts
from moerun.kernels.cpu.formats import ExpertBytes

D, I, E = 2048, 768, 128
QTYPE = Q.Q4_K
# (label, tokens, experts per token, stack): "30b" the shape above, "tiny" D = I = 256 and 8 experts
CASES = (
    ("fixed cost", 1, 1, "tiny"),
    ("all hits", 1, 8, "30b"),
    ("decode", 1, 1, "30b"),
    ("decode", 1, 2, "30b"),
    ("decode", 1, 8, "30b"),
    ("prompt", 64, 8, "30b"),
)
# The module's functions a moe_rows call enters numba through, old and new layouts (those present are timed).
ENTRIES = ("_plan", "_round_rows", "_expert_rows", "_activate", "_combine", "_moe")


def load_impl(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def routing(rng: np.random.Generator, label: str, T: int, K: int, n_experts: int, n_calls: int) -> list[np.ndarray]:
    """ids (T, K) of each call, none of a one-token call's experts used by the call before."""
    if label == "all hits":
        return [np.full((T, K), -1) for _ in range(n_calls)]
    if T == 1:
        return [(np.arange(K) + i * K)[None] % n_experts for i in range(n_calls)]
    return [np.stack([rng.choice(n_experts, K, replace=False) for _ in range(T)]) for _ in range(n_calls)]


class Timer:
    """Wraps a module's numba entry points and sums the time spent inside them."""

    def __init__(self, module: ModuleType) -> None:
        self.module, self.inside, self.saved = module, 0.0, {}

    def __enter__(self) -> Timer:
        for name in ENTRIES:
            if hasattr(self.module, name):
                self.saved[name] = f = getattr(self.module, name)
                setattr(self.module, name, self._timed(f))
        return self

    def __exit__(self, *exc) -> None:
        for name, f in self.saved.items():
            setattr(self.module, name, f)

    def _timed(self, f):
        def timed(*args):
            start = time.perf_counter()
            try:
                return f(*args)
            finally:
                self.inside += time.perf_counter() - start

        return timed


def stack(rng: np.random.Generator, n_experts: int, d: int, i: int) -> list[ExpertBytes]:
    return [
        ExpertBytes(random_blocks(rng, (n_experts, rows, cols), QTYPE, 0.02), QTYPE, rows, cols)
        for rows, cols in ((i, d), (i, d), (d, i))
    ]


def bench(module: ModuleType, stacks, label: str, T: int, K: int, threads: int, repeat: int, rng) -> dict:
    gate, up, down = (module.ExpertBytes(s.data, s.qtype, s.rows, s.cols) for s in stacks)
    x = rng.standard_normal((T, gate.cols)).astype(np.float32)
    weights = np.full((T, K), 1.0 / K, np.float32)
    out = np.zeros((T, gate.cols), np.float32)
    calls = routing(rng, label, T, K, gate.data.shape[0], repeat + 1)

    def run(ids):
        module.moe_rows(x, ids, weights, gate, up, down, "swiglu", out, threads=threads)

    run(calls[-1])  # compile (or load from numba's cache), warm up
    times = []
    for ids in calls[:repeat]:
        start = time.perf_counter()
        run(ids)
        times.append(time.perf_counter() - start)
    split = []
    for ids in calls[:repeat]:
        with Timer(module) as timer:
            start = time.perf_counter()
            run(ids)
            total = time.perf_counter() - start
        split.append((total, timer.inside))
    total, inside = min(split)
    experts = len({int(e) for e in calls[0].ravel() if e >= 0})
    return {
        "case": label,
        "tokens": T,
        "k": K,
        "threads": threads,
        "us": min(times) * 1e6,
        "median_us": statistics.median(times) * 1e6,
        "numba_us": inside * 1e6,
        "python_us": (total - inside) * 1e6,
        "bytes": experts * sum(s.data[0].nbytes for s in stacks),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--impl", help="another kernels/cpu/moe_rows.py to time beside the current one")
    ap.add_argument("--json", help="write the numbers here")
    args = ap.parse_args()
    threads = sorted({int(n) for n in args.threads.split(",")})
    rng = np.random.default_rng(0)
    stacks = {"30b": stack(rng, E, D, I), "tiny": stack(rng, 8, 256, 256)}
    impls = {"current": cpu_experts} | ({"other": load_impl(args.impl)} if args.impl else {})
    ram = {n: ram_read_gbps(n, 10) for n in threads}
    rows = []
    for n in threads:
        for label, T, K, shape in CASES:
            for name, module in impls.items():
                rows.append({"impl": name, **bench(module, stacks[shape], label, T, K, n, args.repeat, rng)})
    print("host RAM read (parallel sum, 1 GiB): " + ", ".join(f"{ram[n]:.1f} GB/s with {n} threads" for n in threads))
    print(
        f"{'case':<11}{'impl':<9}{'threads':>8}{'T':>4}{'K':>3}{'us/call':>10}{'median':>9}{'numba':>9}{'Python':>8}"
        f"{'MB':>7}{'RAM bound us':>14}"
    )
    for r in rows:
        bound = r["bytes"] / (ram[r["threads"]] * 1e9) * 1e6
        print(
            f"{r['case']:<11}{r['impl']:<9}{r['threads']:>8}{r['tokens']:>4}{r['k']:>3}{r['us']:>10.0f}"
            f"{r['median_us']:>9.0f}"
            f"{r['numba_us']:>9.0f}{r['python_us']:>8.0f}{r['bytes'] / 1e6:>7.1f}{bound:>14.0f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"ram_gbps": ram, "rows": rows, **vars(args)}, indent=2))


if __name__ == "__main__":
    main()
