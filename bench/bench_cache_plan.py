"""The expert cache's plans (runtime/cache/plan.py) on every named routing regime, measured through the runtime on a
CPU standing in for the GPU: for each regime and VRAM room, the plans cache, blend, static and auto decode a
replayed trace (`moerun bench --routing`'s replay), and their measured misses, streamed experts and uploads per
token are turned into expert traffic at a machine's bus and CPU expert speeds, next to llama.cpp's `--n-cpu-moe` split of
the same VRAM (at llama.cpp's CPU expert speed).

    python bench/bench_cache_plan.py [--model bench/models/bench-qwen3moe-q4k.gguf] [--gbps 48,7.4,60] [-n 256]
                                     [--cold [--prompt 256]] [--json OUT]

The model's shape (6 MoE layers, 32 experts, top-4) is every regime's here (regimes are generated for any shape);
the warm-start counts come from the trace's other chunks (what a profile of other text gives), the decode replays
its first chunk (with --cold: no counts, as without a profile, and the decode follows a prompt of --prompt tokens
of the same chunk, which fills the empty cache), and the plan's hit curves are measured on the trace itself (as `moerun bench --routing` does).
A CPU stands in for the GPU and streams its misses through the CPU's kernel, so the speeds are not a GPU's: the
traffic column is the cost model's formula applied to the counts the runtime measured.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

import moerun
from moeprep.errors import MoeprepError
from moeprep.gguf.anatomy import describe_model
from moeprep.profile.regimes import REGIMES, Shape, generate
from moerun.bench import run_bench
from moerun.cache.config import CacheConfig
from moerun.cache.placement import slot_room
from moerun.cache.plan import Bandwidths, split_seconds
from moerun.cache.plan import Shape as PlanShape
from moerun.options import RuntimeOptions

MODEL = Path(__file__).resolve().parent / "models" / "bench-qwen3moe-q4k.gguf"
PLANS = ("cache", "static", "auto")  # blend: where auto takes it
SHARES = (0.10, 0.25, 0.50)
CHUNK = 512


def measure(
    model_path: Path, regime: str, share: float, plan: str, bw: Bandwidths, n_gen: int, n_prompt: int | None = None
) -> dict:
    """One plan at one share of one regime; n_prompt None: warm (counts from the trace's other chunks, no prompt),
    else cold after a prompt of n_prompt tokens."""
    probe = moerun.load_model(model_path)
    a = describe_model(probe.gguf)
    geo = a.geometry
    moe = list(geo.moe_layers)
    eb = geo.expert_bytes[moe[0]]
    t = generate(regime, Shape(len(moe), geo.n_expert, geo.n_expert_used), 4 * CHUNK, CHUNK)
    usage = np.zeros((geo.n_layer, geo.n_expert), np.int64)
    rest = t.ids[t.starts[1] :]  # the other chunks: the warm-start counts
    for m, block in enumerate(moe):
        usage[block] = np.bincount(rest[:, m].ravel(), minlength=geo.n_expert)
    big = 64 << 30
    overhead = big - slot_room(a, [big])
    room = int(share * len(moe) * geo.n_expert * eb)
    options = replace(RuntimeOptions.from_environment(), stream_devices=frozenset({"cuda", "cpu"}))
    cold = n_prompt is not None
    config = CacheConfig(budgets=[overhead + room], usage=None if cold else usage, plan=plan, bandwidths=bw, trace=t)
    model = moerun.load_model(model_path, cache=config, n_ctx=(n_prompt or 0) + n_gen + 8, options=options)
    cache = model.expert_cache
    run_bench(model, n_prompt or 0, n_gen, warmup=False, routing=t)
    s = cache.stats
    lookups, hits = int(s.lookups.sum()), int(s.hits.sum())
    streamed, uploads = s.streamed, s.uploads
    cpu_misses = lookups - hits - streamed
    traffic = eb * (streamed / bw.bus_gbps + cpu_misses / bw.cpu_gbps + uploads / bw.bus_gbps) / 1e9 / n_gen
    n_split, split = split_seconds(PlanShape(len(moe), geo.n_expert, geo.n_expert_used, eb, room), bw)
    return {
        "regime": regime,
        "share": share,
        "asked": plan,
        "plan": cache.plan.name,
        "policy": cache.config.policy,
        "pinned": len(cache.placement.pinned),
        "hit_rate": hits / lookups,
        "uploads_per_token": uploads / n_gen,
        "streamed_per_token": streamed / n_gen,
        "cpu_misses_per_token": cpu_misses / n_gen,
        "traffic_ms": traffic * 1e3,
        "predicted_ms": cache.plan.seconds * 1e3,
        "split_ms": split * 1e3,
        "split_layers": n_split,
        "why": list(cache.why),
    }


def refuse(message: str) -> None:
    """Bad input: one line on stderr, exit code 2."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=MODEL)
    ap.add_argument(
        "--gbps",
        default="48,7.4,60",
        help="bus, moerun's CPU experts and llama.cpp's CPU experts in GB/s (default: the H200 machine's)",
    )
    ap.add_argument("-n", "--n-gen", type=int, default=256)
    ap.add_argument("--regimes", default="all")
    ap.add_argument("--cold", action="store_true", help="no warm-start counts; the decode follows a prompt")
    ap.add_argument("--prompt", type=int, default=256, help="with --cold: the prompt's tokens (default 256)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    bw = Bandwidths(*(float(x) for x in args.gbps.split(",")))  # bus, moerun's CPU experts, llama.cpp's
    regimes = [r for r in REGIMES if r != "token-id"] if args.regimes == "all" else args.regimes.split(",")
    prompt = args.prompt if args.cold else 0
    if args.n_gen < 1 or prompt < 0 or prompt + args.n_gen > CHUNK:
        refuse(f"-n {args.n_gen} and --prompt {prompt} must be at least 1 and 0 and fit a replayed chunk of {CHUNK}")
    if unknown := [r for r in regimes if r not in REGIMES]:
        refuse(f"unknown regime {unknown[0]}: choose from {', '.join(REGIMES)}")
    if not args.model.is_file():
        refuse(f"{args.model}: no such model file")
    rows = []
    print(
        f"expert traffic per decode token in ms at {bw.bus_gbps:g} GB/s bus, {bw.cpu_gbps:g} GB/s CPU experts "
        "(measured hits, streamed misses, CPU misses and uploads; predicted by the plan's cost model)"
    )
    print(
        "| regime | room | plan asked | plan / policy / pinned | hit rate | uploads/token | traffic ms | "
        "predicted ms | split ms |"
    )
    print("|---|---:|---|---|---:|---:|---:|---:|---:|")
    for regime in regimes:
        for share in SHARES:
            for plan in PLANS:
                try:
                    r = measure(args.model, regime, share, plan, bw, args.n_gen, prompt if args.cold else None)
                except MoeprepError as e:  # a model moerun cannot load or cache: one line, exit 2
                    refuse(str(e))
                rows.append(r)
                print(
                    f"| {regime} | {share:.0%} | {plan} | {r['plan']} / {r['policy']} / {r['pinned']} | "
                    f"{r['hit_rate']:.1%} | {r['uploads_per_token']:.2f} | {r['traffic_ms']:.4f} | "
                    f"{r['predicted_ms']:.4f} | {r['split_ms']:.4f} |",
                    flush=True,
                )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
