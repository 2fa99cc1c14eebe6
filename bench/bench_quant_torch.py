"""Throughput and bytes of moeprep's torch K-quantizers (kquants_torch) against the CPU ones (kquants, ggml-exact).

    python bench/bench_quant_torch.py [--rows 512] [--cols 4096] [--devices cpu,cuda] [--repeat 3]

For Q4_K, Q5_K and Q6_K, without and with an importance matrix: MB of float32 input per second for kquants (numba,
one thread, one run after a warm-up that compiles it) and for torch on each device (best of --repeat after a
warm-up), and whether torch's bytes equal kquants' ('equal' or the number of differing blocks). Then the adversarial
rows of tests/quant/test_kquants.py on each device, and how often torch's `tensor / scalar` differs from a correctly
rounded division there (the reason kquants_torch divides through `_div`). Needs no libggml: kquants is the oracle
(tests/quant/test_kquants.py ties it to ggml).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES

from moeprep.quant import kquants, kquants_torch
from tests.quant.test_kquants import adversarial_rows, make_imatrix


def seconds(fn: Callable[[], np.ndarray], repeat: int, device: str | None) -> tuple[float, np.ndarray]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best, out


def compare(ours: np.ndarray, expected: np.ndarray, qtype) -> str:
    size = GGML_QUANT_SIZES[qtype][1]
    bad = int((ours.reshape(-1, size) != expected.reshape(-1, size)).any(axis=1).sum())
    return "equal" if bad == 0 else f"{bad} of {expected.size // size} blocks differ"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--devices", default="cpu,cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    devices = args.devices.split(",")

    rng = np.random.default_rng(0)
    rows = (rng.standard_t(4, (args.rows, args.cols)) * rng.exponential(1.0, (args.rows, 1))).astype(np.float32)
    imatrix = (rng.random(args.cols) ** 2 * 3).astype(np.float32)
    mb = rows.nbytes / 1e6
    tables = {d: kquants_torch.quantizers_on(d) for d in devices}
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads"
        + (f", {torch.cuda.get_device_name()}" if "cuda" in devices else "")
    )
    print(f"{args.rows} x {args.cols} float32 rows ({mb:.1f} MB); kquants: one run; torch: best of {args.repeat}")
    print(
        f"{'type':6} {'imatrix':8} {'kquants MB/s':>12} "
        + " ".join(f"{'torch-' + d + ' MB/s':>16}  bytes vs kquants" for d in devices)
    )
    for qtype, quantize in kquants.KQUANTIZERS.items():
        for qw in (None, imatrix):
            quantize(rows[:8], qw)  # warm-up: numba compiles or loads its cache
            np_s, expected = seconds(lambda f=quantize, w=qw: f(rows, w), 1, None)
            cells = []
            for d in devices:
                tables[d][qtype](rows[:8], qw)  # warm-up
                t_s, got = seconds(lambda f=tables[d][qtype], w=qw: f(rows, w), args.repeat, d)
                cells.append(f"{mb / t_s:16.1f}  {compare(got, expected, qtype)}")
            print(
                f"{qtype.name:6} {'yes' if qw is not None else 'no':8} {mb / np_s:12.1f} " + " ".join(cells), flush=True
            )

    adv_rng = np.random.default_rng(7)
    adv = np.concatenate(list(adversarial_rows(512, adv_rng).values()))
    print(f"adversarial rows of tests/quant/test_kquants.py ({adv.shape[0]} x 512):")
    for qtype, quantize in kquants.KQUANTIZERS.items():
        for kind in (None, "random", "sparse"):
            qw = make_imatrix(kind, 512, adv_rng)
            expected = quantize(adv, qw)
            print(
                f"  {qtype.name} imatrix={kind}: "
                + ", ".join(f"{d} {compare(tables[d][qtype](adv, qw), expected, qtype)}" for d in devices)
            )

    a = (rng.standard_normal(1 << 20) * np.exp(rng.standard_normal(1 << 20) * 3)).astype(np.float32)
    for d in devices:
        t = torch.from_numpy(a).to(d)
        scalar = int((np.asarray((t / 63.0).cpu()) != a / np.float32(63)).sum())
        full = int((np.asarray(kquants_torch._div(t, 63.0).cpu()) != a / np.float32(63)).sum())
        print(f"division by 63 on {d}: tensor / scalar differs from numpy in {scalar} of {a.size}, _div in {full}")


if __name__ == "__main__":
    main()
