"""Throughput of moerun's torch dequantizers on a device against gguf-py's numpy dequantizer on the CPU.

    python bench/bench_dequant.py [--device cuda|cpu] [--small] [--top-k 8] [--dtype bfloat16] [--compile] [--repeat 10]

One expert stack of a Qwen3-30B-shaped layer ([128 experts, 768, 2048]; --small: [16, 128, 512]) per type (Q4_K,
Q8_0, Q6_K), its random raw bytes resident on the device. For the top-k selected experts (gathered by a device index
tensor, as the runtime does) and for the whole stack it prints the best time of --repeat runs, GB/s of output in
--dtype and billions of values per second; gguf-py is timed on the selected experts only (float32, on the host).
"equal" means our float32 values are bit-identical to gguf-py's. --compile adds torch.compile'd timings.
On a shared CPU, OMP_NUM_THREADS=1 keeps torch's thread pool from fighting the other processes.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize

from moerun.kernels.dequant import dequantize

TYPES = (Q.Q4_K, Q.Q8_0, Q.Q6_K)
SHAPES = {False: (128, 768, 2048), True: (16, 128, 512)}  # --small -> (E, rows, cols)
# Byte offsets of the fp16 scales in a block: set to finite values so that random bytes are a valid block.
FP16_FIELDS = {Q.Q4_K: (0, 2), Q.Q8_0: (0,), Q.Q6_K: (208,)}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def random_stack(qtype: Q, n_experts: int, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """[E, rows, row_bytes] uint8 of random blocks with small positive fp16 scales."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (n_experts, rows, cols // block_size, type_size), dtype=np.uint8)
    for offset in FP16_FIELDS[qtype]:
        scales = rng.uniform(1e-4, 1e-2, blocks.shape[:-1] + (1,)).astype(np.float16)
        blocks[..., offset : offset + 2] = scales.view(np.uint8)
    return blocks.reshape(n_experts, rows, -1)


def best_seconds(fn: Callable[[], object], sync: Callable[[], None], repeat: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def report(label: str, seconds: float, n_values: int, bytes_per_value: int, note: str = "") -> None:
    print(
        f"  {label:28} {seconds * 1e3:9.3f} ms {n_values * bytes_per_value / seconds / 1e9:9.2f} GB/s "
        f"{n_values / seconds / 1e9:8.3f} Gval/s  {note}"
    )


@dataclass(frozen=True)
class Setup:
    """What every timed call shares."""

    device: torch.device
    dtype: torch.dtype
    shape: tuple[int, int, int]  # (E, rows, cols)
    ids: np.ndarray  # [K] selected expert ids
    variants: dict[str, Callable[..., torch.Tensor]]  # name -> dequantize, eager or compiled
    repeat: int

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def bench_type(qtype: Q, setup: Setup, rng: np.random.Generator) -> None:
    n_experts, rows, cols = setup.shape
    top_k = len(setup.ids)
    raw_np = random_stack(qtype, n_experts, rows, cols, rng)
    raw = torch.from_numpy(raw_np).to(setup.device)  # [E, rows, row_bytes] uint8, resident on the device
    ids = torch.from_numpy(setup.ids).to(setup.device)
    selected = raw_np[setup.ids]
    expected = torch.from_numpy(gguf_dequantize(selected, qtype))
    print(f"{qtype.name}: {raw_np.nbytes / 1e6:.0f} MB of raw bytes on {setup.device}")
    for name, fn in setup.variants.items():
        same = torch.equal(fn(raw[ids], qtype, cols).cpu().view(torch.int32), expected.view(torch.int32))
        seconds = best_seconds(lambda fn=fn: fn(raw[ids], qtype, cols, setup.dtype), setup.sync, setup.repeat)
        report(f"{name} top-{top_k}", seconds, top_k * rows * cols, setup.dtype.itemsize, "equal" if same else "DIFFER")
        seconds = best_seconds(lambda fn=fn: fn(raw, qtype, cols, setup.dtype), setup.sync, setup.repeat)
        report(f"{name} all {n_experts}", seconds, n_experts * rows * cols, setup.dtype.itemsize)
    seconds = best_seconds(lambda: gguf_dequantize(selected, qtype), lambda: None, max(1, setup.repeat // 5), warmup=0)
    report(f"gguf-py numpy top-{top_k}", seconds, top_k * rows * cols, 4, "(float32, host)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    ap.add_argument("--small", action="store_true", help="a [16, 128, 512] stack, for a quick run on a CPU")
    ap.add_argument("--top-k", type=int, default=8, help="experts selected per call")
    ap.add_argument("--dtype", default="bfloat16", choices=tuple(DTYPES))
    ap.add_argument("--compile", action="store_true", help="also time torch.compile(dequantize)")
    ap.add_argument("--repeat", type=int, default=10)
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    shape = SHAPES[args.small]
    variants: dict[str, Callable[..., torch.Tensor]] = {"eager": dequantize}
    if args.compile:
        # One graph per (type, shape, dtype): 3 types x 3 calls here, past dynamo's default limit of 8.
        torch._dynamo.config.recompile_limit = 64
        variants["compiled"] = torch.compile(dequantize, fullgraph=True, dynamic=False)
    setup = Setup(
        torch.device(args.device),
        DTYPES[args.dtype],
        shape,
        rng.choice(shape[0], args.top_k, replace=False),
        variants,
        args.repeat,
    )
    name = torch.cuda.get_device_name(setup.device) if setup.device.type == "cuda" else "CPU"
    print(
        f"device {setup.device} ({name}), torch {torch.__version__}, {torch.get_num_threads()} CPU threads; "
        f"stack {list(shape)}, top-{args.top_k}, output {args.dtype}, best of {args.repeat}"
    )
    for qtype in TYPES:
        bench_type(qtype, setup, rng)


if __name__ == "__main__":
    main()
