"""Expert-cache replacement policies on a real routing stream: hit rate against LRU, LFU and the offline optimum.

    python bench/bench_cache_policy.py [--trace bench/data/routing-trace.npz] [--model bench/models/...gguf]
                                       [--tokens N] [--cap 1] [--json OUT]

The stream is the trained bench model's routing on held-out text (bench/train_moe/routing.py wrote it), replayed
as one continuous decode: one token per step, every MoE layer a cache of its own of 10/25/50% of its experts,
starting empty. Every policy of moeprep/profile/policy.py (the runtime's, moerun.cache.policy) runs on the same
stream, uncapped and with at most `--cap` uploads per layer per token, next to Belady's offline optimum (keep the
experts needed soonest; without a cap no policy can hit more). Reported per size: hit rate overall and per layer,
the gap to Belady in points, uploads per token per layer, and the net saving per token per layer in expert reads:
hits - uploads * (upload time / CPU time of one expert), with the H200 machine's 55 GB/s pinned copies and 89 GB/s
host reads. A policy pays back when its net saving beats LRU's.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from moeprep.gguf.anatomy import model_geometry
from moeprep.gguf.reader import open_gguf
from moeprep.profile.heldout import SIZES, cache_slots
from moeprep.profile.policy import POLICIES, Belady, UploadCost, make_policy, next_uses, replay

HERE = Path(__file__).resolve().parent
COMPARED = ("lru", "lfu", "lfuda", "admit2", "payback")  # every policy that adapts; static needs a profile


def load_stream(path: Path, n_tokens: int | None) -> np.ndarray:
    """ids [M, N, K] of the trace (one row per MoE layer), in token order."""
    experts = np.load(path)["experts"]  # [N, M, K]
    experts = experts[:n_tokens] if n_tokens else experts
    return np.ascontiguousarray(experts.transpose(1, 0, 2)).astype(np.int64)


def run_policy(name: str, ids: np.ndarray, n_expert: int, caps: tuple[int | None, ...]) -> dict:
    """Replay one policy at every size and cap at once: rows are (cap, size, layer)."""
    n_m, n_t, n_k = ids.shape
    slots = np.array([cache_slots(s, n_expert) for s in SIZES])
    shape = (len(caps), len(SIZES), n_m)
    rows_ids = np.broadcast_to(ids[None, None], (*shape, n_t, n_k)).reshape(-1, n_t, n_k)
    rows_slots = np.broadcast_to(slots[None, :, None], shape).reshape(-1)
    free = np.broadcast_to(np.array([n_expert if c is None else c for c in caps])[:, None, None], shape).reshape(-1)
    if name == "belady":
        policy = Belady(rows_slots, n_expert, n_k, next_uses(rows_ids))
    else:
        policy = make_policy(name, rows_slots, n_expert, n_k)
    t0 = time.perf_counter()
    r = replay(policy, rows_ids, free=free)
    seconds = time.perf_counter() - t0
    hits = r.hits.reshape(*shape, n_t).sum(axis=-1) / (n_t * n_k)  # [caps, S, M]
    uploads = r.uploads.reshape(*shape, n_t).sum(axis=-1) / n_t
    return {"hit": hits, "uploads": uploads, "seconds": seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trace", type=Path, default=HERE / "data" / "routing-trace.npz")
    p.add_argument("--model", type=Path, default=HERE / "models" / "bench-qwen3moe-f16.gguf",
                   help="the model the trace came from (its expert count)")
    p.add_argument("--tokens", type=int, default=None, help="replay only the first N tokens")
    p.add_argument("--cap", type=int, default=1, help="uploads per layer per token in the capped runs")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    ids = load_stream(a.trace, a.tokens)
    n_expert = model_geometry(open_gguf(a.model)).n_expert
    n_m, n_t, n_k = ids.shape
    caps = (None, a.cap)
    cost = UploadCost()
    upload_in_reads = cost.upload_s / cost.hit_saves_s
    results = {name: run_policy(name, ids, n_expert, caps) for name in (*COMPARED, "belady")}
    print(f"{a.trace.name}: {n_t} tokens, {n_m} MoE layers, {n_expert} experts, top-{n_k}; one continuous stream, "
          f"caches start empty; an upload costs {upload_in_reads:.2f} expert reads")
    for ci, cap in enumerate(caps):
        print(f"\n{'no upload cap' if cap is None else f'at most {cap} upload per layer per token'}")
        print("| size (slots) | policy | hit rate | gap to Belady | uploads/token/layer | net saving | per layer |")
        print("|---|---|---|---|---|---|---|")
        for si, size in enumerate(SIZES):
            best = results["belady"]["hit"][ci, si].mean()
            for name, res in results.items():
                hit = res["hit"][ci, si]
                up = res["uploads"][ci, si].mean()
                net = hit.mean() * n_k - up * upload_in_reads
                layers = " ".join(f"{h:.1%}" for h in hit)
                print(f"| {size:.0%} ({cache_slots(size, n_expert)}) | {name} | {hit.mean():.1%} | "
                      f"{100 * (best - hit.mean()):.1f} | {up:.2f} | {net:.2f} | {layers} |")
    print("\nseconds per policy (all sizes and caps): "
          + ", ".join(f"{name} {res['seconds']:.0f}" for name, res in results.items()))
    if a.json:
        a.json.write_text(json.dumps({"trace": str(a.trace), "tokens": n_t, "caps": list(caps), "sizes": SIZES,
                                      "policies": {n: {k: np.asarray(v).tolist() for k, v in r.items()}
                                                   for n, r in results.items()}}, indent=1))


if __name__ == "__main__":
    assert set(COMPARED) <= set(POLICIES)
    main()
