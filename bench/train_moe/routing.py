"""Routing of the bench model on the held-out text: a replayable trace and the statistics cache policies care about.

    python -m bench.train_moe.routing -m bench/models/bench-qwen3moe-f16.gguf -f bench/data/heldout.txt

The model runs in moerun; its routing hook records the experts each token selects in each layer. The text is cut
into windows of n_ctx tokens, each a fresh sequence (as perplexity runs it); the trace keeps them in order, so a
replay sees the token stream a server would.

Statistics per layer (N tokens, L layers, K experts per token, E experts):
  top10_share   share of all selections taken by the round(E/10) most selected experts (uniform: about 10%)
  repeat_rate   mean over tokens of |S_t & S_t-1| / K, S_t the token's selected experts (within a window;
                uniform random routing gives K/E)
  reuse_median  median distance in tokens from a selection of expert e back to e's previous selection in that
                layer (within a window; selections with no earlier use in their window are left out); uniform
                random routing gives a geometric distance with p = K/E

Trace (.npz): tokens uint16 [N], experts uint8 [N, L, K] in router order (most probable first), window_starts
int64 [W]; plus the model's file name and sha256 of the text.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
from pathlib import Path

import numpy as np
import torch

import moerun


def collect_trace(model: moerun.Model, text: str, n_ctx: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """-> tokens [N], experts [N, L, K], window_starts [W]"""
    tokens = model.tokenizer.encode(text, add_bos=False)
    n = len(tokens) // n_ctx * n_ctx
    layers: dict[int, list[np.ndarray]] = {}
    hook = model.add_routing_hook(lambda ev: layers.setdefault(ev.layer, []).append(ev.expert_ids.cpu().numpy()))
    for start in range(0, n, n_ctx):
        model.forward(torch.tensor(tokens[start : start + n_ctx], dtype=torch.long), 0)
    hook.remove()
    experts = np.stack([np.concatenate(layers[i]) for i in sorted(layers)], axis=1)  # [N, L, K]
    return np.asarray(tokens[:n], dtype=np.uint16), experts.astype(np.uint8), np.arange(0, n, n_ctx)


def top_share(ids: np.ndarray, n_experts: int, fraction: float = 0.1) -> float:
    """ids [N, K]: share of selections taken by the most selected round(E * fraction) experts (train.py's too)."""
    counts = np.sort(np.bincount(ids.ravel(), minlength=n_experts))[::-1]
    return float(counts[: max(1, round(n_experts * fraction))].sum() / counts.sum())


def repeats(ids: np.ndarray, window_starts: np.ndarray) -> dict[str, float]:
    """ids [N, K], over consecutive tokens of one window: repeat_rate (share of a token's experts the previous token
    also selected), top1_repeat (same first choice), any_overlap (at least one expert in common)."""
    same = (ids[1:, :, None] == ids[:-1, None, :]).any(-1)  # [N-1, K]
    first = np.zeros(len(ids), dtype=bool)
    first[window_starts] = True
    keep = ~first[1:]
    return {
        "repeat_rate": float(same[keep].mean()),
        "top1_repeat": float((ids[1:, 0] == ids[:-1, 0])[keep].mean()),
        "any_overlap": float(same.any(-1)[keep].mean()),
    }


def reuse_distances(ids: np.ndarray, window_starts: np.ndarray, n_experts: int) -> np.ndarray:
    """ids [N, K]: for each selection with an earlier selection of the same expert in its window, the distance."""
    last = np.full(n_experts, -1, dtype=np.int64)
    out = []
    starts = set(int(s) for s in window_starts)
    for t, row in enumerate(ids):
        if t in starts:
            last[:] = -1
        prev = last[row]
        out.append(t - prev[prev >= 0])
        last[row] = t
    return np.concatenate(out)


def routing_stats(experts: np.ndarray, window_starts: np.ndarray, n_experts: int) -> list[dict]:
    stats = []
    for layer in range(experts.shape[1]):
        ids = experts[:, layer, :].astype(np.int64)
        d = reuse_distances(ids, window_starts, n_experts)
        counts = np.bincount(ids.ravel(), minlength=n_experts) / ids.size * n_experts
        stats.append(
            {
                "layer": layer,
                "top10_share": top_share(ids, n_experts),
                **repeats(ids, window_starts),
                "reuse_median": float(np.median(d)),
                "reuse_p90": float(np.percentile(d, 90)),
                "load_min": float(counts.min()),
                "load_max": float(counts.max()),
            }
        )
    return stats


COLUMNS = [
    ("top10_share", "top 10% share", "{:.1%}"),
    ("repeat_rate", "next-token repeat", "{:.1%}"),
    ("top1_repeat", "same first choice", "{:.1%}"),
    ("any_overlap", "any expert shared", "{:.1%}"),
    ("reuse_median", "median reuse distance", "{:.1f}"),
    ("reuse_p90", "p90 reuse distance", "{:.0f}"),
    ("load_min", "least used (x mean)", "{:.2f}"),
    ("load_max", "most used (x mean)", "{:.2f}"),
]


def uniform_baseline(n_experts: int, k: int) -> dict[str, float]:
    """The statistics of routing that picks K of E experts uniformly at random for every token."""
    return {
        "top10_share": max(1, round(n_experts / 10)) / n_experts,
        "repeat_rate": k / n_experts,
        "top1_repeat": 1 / n_experts,
        "any_overlap": 1 - math.comb(n_experts - k, k) / math.comb(n_experts, k),
        "reuse_median": math.ceil(math.log(0.5) / math.log(1 - k / n_experts)),  # geometric, p = K/E
        "reuse_p90": math.ceil(math.log(0.1) / math.log(1 - k / n_experts)),
        "load_min": 1.0,
        "load_max": 1.0,
    }


def format_stats(stats: list[dict], n_experts: int, k: int) -> str:
    lines = ["| layer | " + " | ".join(title for _, title, _ in COLUMNS) + " |", "| --- " * (len(COLUMNS) + 1) + "|"]
    rows = [(str(s["layer"]), s) for s in stats]
    rows.append(("mean", {key: float(np.mean([s[key] for s in stats])) for key, _, _ in COLUMNS}))
    rows.append(("uniform random routing", uniform_baseline(n_experts, k)))
    for label, s in rows:
        lines.append(f"| {label} | " + " | ".join(fmt.format(s[key]) for key, _, fmt in COLUMNS) + " |")
    return "\n".join(lines)


def main() -> None:
    here = Path(__file__).resolve().parent
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-m", "--model", type=Path, default=here.parent / "models" / "bench-qwen3moe-f16.gguf")
    p.add_argument("-f", "--file", type=Path, default=here.parent / "data" / "heldout.txt")
    p.add_argument("-c", "--ctx-size", type=int, default=512)
    p.add_argument("--trace", type=Path, default=here.parent / "data" / "routing-trace.npz")
    p.add_argument("--stats", type=Path, default=here / "routing-stats.json")
    p.add_argument("--from-trace", action="store_true", help="recompute the statistics from --trace; run nothing")
    a = p.parse_args()
    model = moerun.load_model(a.model, n_ctx=a.ctx_size)
    n_experts, k = model.args.n_experts, model.args.n_experts_used
    if a.from_trace:
        trace = np.load(a.trace)
        tokens, experts, starts = trace["tokens"], trace["experts"], trace["window_starts"]
    else:
        text = a.file.read_text(encoding="utf-8")
        tokens, experts, starts = collect_trace(model, text, a.ctx_size)
        np.savez_compressed(
            a.trace,
            tokens=tokens,
            experts=experts,
            window_starts=starts,
            model=np.array(a.model.name),
            text_sha256=np.array(hashlib.sha256(text.encode()).hexdigest()),
        )
    stats = routing_stats(experts, starts, n_experts)
    a.stats.write_text(json.dumps({"model": a.model.name, "tokens": len(tokens), "layers": stats}, indent=1))
    print(
        f"{len(tokens)} tokens, {experts.shape[1]} layers, {n_experts} experts, top-{k}; trace {a.trace} "
        f"({a.trace.stat().st_size / 1e6:.2f} MB)"
    )
    print(format_stats(stats, n_experts, k))


if __name__ == "__main__":
    main()
