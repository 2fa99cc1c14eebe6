"""Write the benchmark model: a synthetic MoE of Qwen3-30B-A3B's shape (48 layers, 128 experts, 8 used, Q4_K,
about 17 GB), with valid random quant blocks written directly as bytes.

    python bench/make_bench_model.py OUT.gguf [--arch qwen3moe] [--preset qwen3-30b-a3b] [--routing qwen3-30b]
        [--skew 0.5] [--seed 0]

Streams one tensor at a time (memory stays a few hundred MB), shows a progress bar in bytes and prints the time.
The weights are random, so the model's text is noise; its sizes, types and routing are what benchmarks need: the
preset routes by the qwen3-30b regime (moeprep/synth/context_routing.py), built into the weights.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from tqdm import tqdm

from moeprep.synth import synth_config, tensor_data_size, write_synth_model
from moeprep.synth.config import ROUTING_KINDS
from moeprep.units import format_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # no default inside the repository: .gitignore lets bench/models/*.gguf through, and this file is 17 GB
    parser.add_argument("out", type=Path, help="where to write the model, e.g. /data/qwen3-30b-a3b-synth.gguf")
    parser.add_argument("--arch", default="qwen3moe")
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    parser.add_argument("--skew", type=float, default=0.5, help="routing skew 0..1 (expert cache benchmarks want some)")
    parser.add_argument(
        "--routing", choices=ROUTING_KINDS, default=None, help="how the routers pick experts (default: the preset's)"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    options = dict(preset=args.preset, seed=args.seed, skew=args.skew, fast_random_blocks=True, routing=args.routing)
    total = tensor_data_size(synth_config(args.arch, **options))
    start = time.perf_counter()
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=args.out.name) as bar:
        path = write_synth_model(args.out, args.arch, **options, on_tensor=lambda name, n: bar.update(n))
    seconds = time.perf_counter() - start
    size = path.stat().st_size
    print(f"{path}: {format_size(size)} in {seconds:.1f} s ({size / seconds / 2**20:.0f} MiB/s)")


if __name__ == "__main__":
    main()
