"""moerun on two GPUs gives what it gives on one: the GPU side of tests/runtime/test_devices.py (needs 2 GPUs).

    python bench/check_multi_gpu.py [MODEL.gguf ...] [-n 32] [--json OUT] [--cpu]

For each model (default: the trained bench models in bench/models and a synthetic Qwen3-MoE and DeepSeek-V2 written
to a temporary folder), greedy generation over the start of bench/data/heldout.txt in these configurations:

    plain 1          no expert cache, one GPU (the reference)
    plain 2          no cache, blocks split over cuda:0,cuda:1 by bytes          -> the reference's tokens
    plain 2 eager    the same without CUDA graphs                                 -> the reference's tokens
    slots 1 / 2      the cache with a fixed number of slots per layer, budgets for 1 and for 2 GPUs: the same slots
                     and policy decisions on one GPU or spread over two           -> equal tokens and hit counts
    slots 2 eager    slots 2 without CUDA graphs                                  -> slots 1's tokens
    budget 2         the cache at two budgets of (reserve + half the non-expert weights + 25% of the experts), the
                     slots from the placement: about half of all experts cached   -> the reference's tokens
    too many         one budget more than there are GPUs                          -> a one-line MoeprepError

and prints, per configuration, the blocks on each GPU, each GPU's memory (allocated after load, peak while
generating), decode tok/s and the cache's hit rate per GPU. Decode steps replay CUDA graphs (cut at the change of
GPU and at each cached layer, graphs.py) except in the "eager" rows. A configuration that raises is reported and
the others still run. Exit code 1 when a check fails.
--cpu runs the same on CPU stand-ins (a dry run of this script; slow: Triton's interpreter runs the slot kernels).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import moerun
from moeprep.errors import MoeprepError
from moeprep.gguf.anatomy import DEFAULT_RESERVE, describe_model
from moeprep.gguf.reader import open_gguf
from moeprep.synth import write_synth_model
from moerun.cache.config import CacheConfig

ROOT = Path(__file__).resolve().parent
PROMPT_CHARS = 400


def synth_models(folder: Path) -> list[Path]:
    """Two synthetic models with GPU-kernel types: a Qwen3-MoE and a DeepSeek-V2 (MLA, a dense lead block)."""
    shape = dict(preset="small", n_layer=8, n_expert=64, n_expert_used=8, expert_type="Q4_K", attn_type="Q8_0")
    return [
        write_synth_model(folder / "synth-qwen3moe.gguf", "qwen3moe", skew=0.8, **shape),
        write_synth_model(folder / "synth-deepseek2.gguf", "deepseek2", skew=0.8, **shape),
    ]


def memory(n_gpu: int) -> list[dict]:
    return [
        {
            "allocated_mib": torch.cuda.memory_allocated(i) / 2**20,
            "peak_mib": torch.cuda.max_memory_allocated(i) / 2**20,
        }
        for i in range(n_gpu)
    ]


def run(
    path: Path, device: str, cache: CacheConfig | None, prompt_text: str, n: int, n_gpu: int, eager: bool = False
) -> dict:
    """Load, generate greedily, report; the model is freed before returning."""
    if n_gpu:
        for i in range(n_gpu):
            torch.cuda.reset_peak_memory_stats(i)
    model = moerun.load_model(path, device=device, n_ctx=1024, cache=cache)
    if eager:
        model.decode_graphs = None
    loaded = memory(n_gpu) if n_gpu else []
    prompt = model.tokenizer.encode(prompt_text)
    start = time.perf_counter()
    tokens = list(moerun.generate(model, prompt, n, moerun.greedy))
    if n_gpu:
        for i in range(n_gpu):
            torch.cuda.synchronize(i)
    seconds = time.perf_counter() - start
    layout = model.net.layout
    out = {
        "tokens": tokens,
        "tok_s": len(tokens) / seconds,
        "blocks_per_device": np.bincount(layout.block, minlength=len(layout.devices)).tolist(),
        "memory": [{**a, "peak_mib": b["peak_mib"]} for a, b in zip(loaded, memory(n_gpu))] if n_gpu else [],
    }
    if model.expert_cache is not None:
        stats, placement = model.expert_cache.stats, model.expert_cache.placement
        per_device = [[b for b in placement.moe_layers if layout.block[b] == d] for d in range(len(layout.devices))]
        out |= {
            "share_cached": placement.share,
            "hits": stats.hits.tolist(),
            "uploads": stats.uploads,
            "hit_rate_per_device": [float(stats.hits[b].sum() / max(1, stats.lookups[b].sum())) for b in per_device],
        }
    del model
    gc.collect()
    if n_gpu:
        torch.cuda.empty_cache()
    return out


def check_model(path: Path, prompt_text: str, n: int, cpu: bool) -> tuple[dict, list[str]]:
    """All configurations of one model -> (results by configuration, failed checks)."""
    n_gpu = 0 if cpu else 2
    one, two = ("cpu", "cpu,cpu") if cpu else ("cuda:0", "cuda:0,cuda:1")
    kind = "cpu" if cpu else "cuda"
    anatomy = describe_model(open_gguf(path))
    experts = anatomy.roles["expert"].n_bytes
    non_expert = anatomy.file_size - experts
    big = DEFAULT_RESERVE + non_expert + experts  # room for every slot: slots_per_layer decides
    quarter = DEFAULT_RESERVE + non_expert // 2 + experts // 4  # each GPU: half the weights, a quarter of the experts
    slots = max(1, anatomy.geometry.n_expert // 4)
    configs = {
        "plain 1": (one, None),
        "plain 2": (two, None),
        "plain 2 eager": (two, None),
        "slots 1": (kind, CacheConfig(budgets=[big], slots_per_layer=slots)),
        "slots 2": (kind, CacheConfig(budgets=[big, big], slots_per_layer=slots)),
        "slots 2 eager": (kind, CacheConfig(budgets=[big, big], slots_per_layer=slots)),
        "budget 2": (kind, CacheConfig(budgets=[quarter, quarter])),
    }
    results, failed = {}, []
    for name, (device, cache) in configs.items():
        try:
            results[name] = run(path, device, cache, prompt_text, n, n_gpu, eager=name.endswith("eager"))
        except Exception as e:  # noqa: BLE001 - a check script: report it, run the rest
            print(f"  FAIL {name}: {type(e).__name__}: {e}", flush=True)
            failed.append(f"{path.name}: {name} raised {type(e).__name__}: {e}")
            results[name] = {"tokens": [], "hits": [], "blocks_per_device": [0], "error": str(e)}
            gc.collect()
            if n_gpu:
                torch.cuda.empty_cache()
            continue
        r = results[name]
        mem = " ".join(f"gpu{i} {m['allocated_mib']:.0f}/{m['peak_mib']:.0f} MiB" for i, m in enumerate(r["memory"]))
        hits = (
            ""
            if "hits" not in r
            else (
                f", {r['share_cached']:.0%} cached, hit rate per device "
                + " ".join(f"{h:.1%}" for h in r["hit_rate_per_device"])
            )
        )
        print(f"  {name:13} blocks {r['blocks_per_device']}, {r['tok_s']:.1f} tok/s, {mem}{hits}", flush=True)

    def expect(ok: bool, what: str) -> None:
        print(f"  {'ok  ' if ok else 'FAIL'} {what}", flush=True)
        if not ok:
            failed.append(f"{path.name}: {what}")

    def first_difference(a: list[int], b: list[int]) -> str:
        i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        return "" if a == b else f" (first difference at token {i})"

    reference = results["plain 1"]["tokens"]
    for name in ("plain 2", "plain 2 eager", "budget 2"):
        tokens = results[name]["tokens"]
        expect(tokens == reference, f"{name}: the same greedy tokens as plain 1{first_difference(tokens, reference)}")
    s1 = results["slots 1"]
    for name in ("slots 2", "slots 2 eager"):
        s2 = results[name]
        expect(
            s1["tokens"] == s2["tokens"],
            f"{name}: the same greedy tokens as slots 1{first_difference(s2['tokens'], s1['tokens'])}",
        )
        expect(s1["hits"] == s2["hits"], f"{name}: the same hits per layer as slots 1")
    for name in ("plain 2", "slots 2", "budget 2"):
        expect(min(results[name]["blocks_per_device"]) > 0, f"{name}: both devices run blocks")
    if not cpu:
        too_many = [quarter] * (torch.cuda.device_count() + 1)
        try:
            moerun.load_model(path, device="cuda", cache=CacheConfig(budgets=too_many))
            expect(False, f"{len(too_many)} budgets on {len(too_many) - 1} GPUs are refused")
        except MoeprepError as e:
            expect("\n" not in str(e), f"{len(too_many)} budgets on {len(too_many) - 1} GPUs: {e}")
    return results, failed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="*", type=Path)
    ap.add_argument("-n", type=int, default=32, help="tokens to generate")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--cpu", action="store_true", help="CPU stand-ins instead of two GPUs (a dry run)")
    args = ap.parse_args()
    if not args.cpu and torch.cuda.device_count() < 2:
        sys.exit(f"check_multi_gpu: {torch.cuda.device_count()} GPU(s) visible; this check needs 2 (or --cpu)")
    if not args.cpu:
        print(" | ".join(f"gpu{i} {torch.cuda.get_device_name(i)}" for i in range(torch.cuda.device_count())))
    prompt_text = (ROOT / "data" / "heldout.txt").read_text(encoding="utf-8")[:PROMPT_CHARS]
    with tempfile.TemporaryDirectory() as tmp:
        models = args.models or [*sorted((ROOT / "models").glob("*.gguf")), *synth_models(Path(tmp))]
        report, failed = {}, []
        for path in models:
            print(f"{path.name}:", flush=True)
            report[path.name], model_failed = check_model(path, prompt_text, args.n, args.cpu)
            failed += model_failed
    if args.json:
        args.json.write_text(json.dumps({"results": report, "failed": failed}, indent=2))
    print("all checks passed" if not failed else f"{len(failed)} check(s) failed:\n  " + "\n  ".join(failed))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
