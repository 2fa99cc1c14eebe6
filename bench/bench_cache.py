"""moerun with the expert cache at a VRAM budget: prefill and decode tok/s, hit rate, uploads per token.

    python bench/bench_cache.py MODEL --budget 8G [--prompt 512] [--gen 64] [--profile P.moeprof] [--json OUT]

Decode is teacher-forced over seeded random tokens (a synthetic model's routing is what its weights make of them).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import moerun
from moeprep.units import parse_size
from moerun.cache.expert_cache import CacheConfig, describe_cache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--budget", required=True)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--profile")
    ap.add_argument("--json")
    args = ap.parse_args()
    config = CacheConfig(budgets=[parse_size(args.budget)], profile=args.profile)
    model = moerun.load_model(args.model, device="cuda", n_ctx=args.prompt + args.gen + 8, cache=config)
    print(describe_cache(model.expert_cache))
    tokens = torch.randint(1, model.args.n_vocab, (args.prompt + args.gen,), generator=torch.Generator().manual_seed(0))
    torch.cuda.synchronize()
    start = time.perf_counter()
    model.forward(tokens[: args.prompt], 0)
    torch.cuda.synchronize()
    prefill_s = time.perf_counter() - start
    stats = model.expert_cache.stats
    prefill_hits = stats.hit_rate
    model.expert_cache.reset_stats()
    start = time.perf_counter()
    for i in range(args.gen):
        model.decode(int(tokens[args.prompt + i]), args.prompt + i)
    torch.cuda.synchronize()
    decode_s = time.perf_counter() - start
    stats = model.expert_cache.stats
    result = {"prefill_tok_s": args.prompt / prefill_s, "decode_tok_s": args.gen / decode_s,
              "prefill_hit_rate": prefill_hits, "decode_hit_rate": stats.hit_rate,
              "uploads_per_token": stats.uploads / args.gen, "share_cached": model.expert_cache.placement.share,
              "vram_gib": torch.cuda.max_memory_allocated() / 2**30}
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
