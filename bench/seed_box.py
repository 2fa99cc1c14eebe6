"""An estimate, not a measurement: what the expert cache's measured parts on the GPU machine would give on the box
the reference numbers for this kind of cache come from (2x RTX 3090, 128 GB DDR4, 8-core Ryzen 3700X; one 3090's
PCIe 4.0 x16 about 25 GB/s, dual-channel DDR4 about 45 GB/s, 936 GB/s of GDDR6X), beside llama.cpp's static split
on the same box.

    python bench/seed_box.py MODEL RESULTS... [--peer-cpu-layers 28] [--bus 25] [--ram 45] [--vram 936]

RESULTS are bench/bench_cache.py --json files (bench/gpu_regimes.sh writes one per routing regime). For each
setting of each file, per decode token (docs/expert-cache.md, "The seed's box", gives the formula):

    gpu_ms   = max(the GPU step measured (GPU experts' device time + the rest), bytes the GPU reads / vram)
    bus_ms   = (experts streamed + experts uploaded) x expert_bytes / bus
    cpu_ms   = experts the CPU computes x expert_bytes / ram
    estimate = gpu_ms + bus_ms + cpu_ms          (no overlap counted: the estimate errs slow)

with the bytes the GPU reads = the always-resident weights a token uses + its cached experts. llama.cpp's static
split of the same VRAM on that box: its CPU layers' K experts over the RAM speed, plus its GPU part: the bytes over
vram, or (--peer-gpu-tg, llama-bench -ngl 99's decode on the GPU machine) its measured step where that is slower.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from moeprep.errors import MoeprepError
from moeprep.gguf.reader import open_gguf
from moeprep.profile.identity import identify_model


def model_bytes(path: str) -> tuple[int, int, int, int, int]:
    """(expert_bytes, dense bytes a token reads, MoE layers, experts per layer, top-k) of the model file: an
    expert's gate, up and down slices of one layer, and every tensor that is not an expert stack or the embedding
    table (a token reads one row of it)."""
    g = open_gguf(path)
    identity = identify_model(g)
    layer = identity.moe_layers[0]
    stacks = [t for t in g.tensors if t.name.startswith(f"blk.{layer}.ffn_") and t.name.split(".")[2].endswith("_exps")]
    expert = sum(t.n_bytes for t in stacks) // identity.n_expert
    dense = sum(t.n_bytes for t in g.tensors if "_exps" not in t.name and not t.name.startswith("token_embd"))
    return expert, dense, len(identity.moe_layers), identity.n_expert, identity.n_expert_used


def estimate(report: dict, expert: int, dense: int, layers: int, top_k: int, speeds: argparse.Namespace) -> dict:
    """One setting's decode report (runtime/bench.py cache_report) on the seed box, in ms per token."""
    ms = report.get("ms_per_token", {})
    measured_gpu = ms.get("GPU experts (device)", 0.0) + ms.get("rest", 0.0)
    hits = report["hit_rate"] * layers * top_k
    gpu = max(measured_gpu, (dense + hits * expert) / speeds.vram / 1e6)
    moved = report["streamed_per_token"] + report["uploads_per_token"]
    bus = moved * expert / speeds.bus / 1e6
    cpu_experts = (1 - report["hit_rate"]) * layers * top_k - report["streamed_per_token"]
    cpu = max(cpu_experts, 0.0) * expert / speeds.ram / 1e6
    total = gpu + bus + cpu
    return {"gpu_ms": gpu, "bus_ms": bus, "cpu_ms": cpu, "ms": total, "tok_s": 1000 / total}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("results", nargs="+")
    ap.add_argument("--peer-cpu-layers", type=int, default=28, help="llama.cpp's --n-cpu-moe at the same VRAM")
    ap.add_argument("--bus", type=float, default=25.0, help="GB/s host to GPU")
    ap.add_argument("--ram", type=float, default=45.0, help="GB/s of host RAM the CPU experts read")
    ap.add_argument("--vram", type=float, default=936.0, help="GB/s of GPU memory")
    ap.add_argument("--peer-gpu-tg", type=float, help="llama-bench -ngl 99 tg tok/s on the GPU machine (its step)")
    args = ap.parse_args()
    try:
        expert, dense, layers, _, top_k = model_bytes(args.model)
        results = {path: json.loads(Path(path).read_text()) for path in args.results}
    except (OSError, ValueError, MoeprepError) as e:  # a missing or foreign file: one line, exit 2
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    peer_cpu = args.peer_cpu_layers * top_k * expert / args.ram / 1e6
    peer_gpu = (dense + (layers - args.peer_cpu_layers) * top_k * expert) / args.vram / 1e6
    if args.peer_gpu_tg:
        peer_gpu = max(peer_gpu, 1000 / args.peer_gpu_tg)
    peer = 1000 / (peer_cpu + peer_gpu)
    print(f"expert {expert / 1e6:.2f} MB, {layers} MoE layers, top-{top_k}; always-resident {dense / 1e9:.2f} GB")
    print(f"llama.cpp --n-cpu-moe {args.peer_cpu_layers} on the seed box, estimated: {peer:.1f} tok/s")
    print("| results | setting | hit rate | GPU ms | bus ms | CPU ms | tok/s, estimated | against the split |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for path, settings in results.items():
        for setting, result in settings.items():
            report = result.get("cache_decode")
            if not report:
                continue
            e = estimate(report, expert, dense, layers, top_k, args)
            print(
                f"| {Path(path).stem} | {setting} | {report['hit_rate']:.1%} | {e['gpu_ms']:.2f} | {e['bus_ms']:.2f} | "
                f"{e['cpu_ms']:.2f} | {e['tok_s']:.1f} | {e['tok_s'] / peer:.2f}x |"
            )


if __name__ == "__main__":
    main()
