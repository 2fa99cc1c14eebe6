"""What a routing trace means for an expert cache: skew, reuse, and the hit rates of the cache policies.

`moeprep routing stats TRACE` prints these; the regimes (regimes.py) state their targets in the same terms, so a
trace can be checked against the regime it claims to follow.

- hot share: the share of a layer's choices taken by its round(E * fraction) most chosen experts (uniform: about
  the fraction);
- next-token reuse: the mean share of a token's K experts that the previous token of its chunk also chose;
- reuse within 8: the same against the union of the previous 8 tokens' choices (tokens with 8 predecessors);
- hit rates: every chunk a fresh decode session, every MoE layer a cache of its own of `size` x E experts that
  starts empty, stepped one token at a time as moerun decodes (moeprep/profile/policy.py's `replay`), for LRU, LFU,
  ClassLRU, payback, cost-payback, Belady's offline optimum and the frequency oracle (the trace's own hottest experts of each
  layer, held fixed: what no profile of other text can beat as a static set). "cold" counts every token of a
  chunk, "warm" only the tokens after its first WARM_AFTER.

Letters: C chunks, T tokens of a chunk, M MoE layers, K experts per token, E experts, S sizes, P policies.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moeprep.profile.heldout import cache_slots
from moeprep.profile.policy import POLICIES, Belady, UploadCost, make_policy, next_uses, replay
from moeprep.profile.tracefile import TraceFile

SIZES = (0.10, 0.25, 0.38, 0.50)  # cache size as a share of a layer's experts
STAT_POLICIES = ("lru", "lfu", "classlru", "payback", "cost-payback", "belady", "oracle")
WARM_AFTER = 64  # tokens of a chunk before "warm" hit rates count
REUSE_WINDOW = 8
CHUNK_BATCH = 16  # chunks replayed side by side


@dataclass
class RoutingStats:
    n_expert: int
    top_k: int
    tokens: int
    chunks: int
    hot_share: np.ndarray  # [M] share of choices of the top 10% of experts
    next_reuse: np.ndarray  # [M]
    window_reuse: np.ndarray  # [M] within REUSE_WINDOW tokens
    sizes: tuple[float, ...]
    slots: tuple[int, ...]
    policies: tuple[str, ...]
    hits: np.ndarray  # [P, S, 2, M] hit rate: windows cold (every token), warm (after WARM_AFTER)
    uploads: np.ndarray  # [P, S, M] uploads per token
    hot_fraction: float = 0.10

    def rate(self, policy: str, size: float, warm: bool = True, layer: int | None = None) -> float:
        """A hit rate over all layers (every layer makes the same lookups) or of one layer."""
        h = self.hits[self.policies.index(policy), self.sizes.index(size), int(warm)]
        return float(h.mean() if layer is None else h[layer])

    def net_saving(self, policy: str, size: float) -> float:
        """Expert reads a layer saves per token (warm): hits x K - uploads x what an upload costs in reads (the
        cost-payback policy's UploadCost). Belady and the oracle are not online policies: their uploads are not real."""
        cost = UploadCost()
        uploads = self.uploads[self.policies.index(policy), self.sizes.index(size)].mean()
        return self.rate(policy, size) * self.top_k - uploads * cost.upload_s / cost.hit_saves_s

    def best(self, size: float) -> tuple[str, str]:
        """(the online policy of most hits, the one of most net saving) at `size`."""
        online = [p for p in self.policies if p in POLICIES]
        return (max(online, key=lambda p: self.rate(p, size)), max(online, key=lambda p: self.net_saving(p, size)))

    def to_dict(self) -> dict:
        per = {
            p: {
                f"{s:g}": {
                    "cold": round(self.rate(p, s, False), 4),
                    "warm": round(self.rate(p, s, True), 4),
                    "uploads_per_token": round(float(self.uploads[pi, si].mean()), 4),
                    "warm_per_layer": [round(float(v), 4) for v in self.hits[pi, si, 1]],
                }
                for si, s in enumerate(self.sizes)
            }
            for pi, p in enumerate(self.policies)
        }
        return {
            "experts": self.n_expert,
            "top_k": self.top_k,
            "layers": len(self.hot_share),
            "tokens": self.tokens,
            "chunks": self.chunks,
            "warm_after": WARM_AFTER,
            "reuse_window": REUSE_WINDOW,
            "hot_fraction": self.hot_fraction,
            "hot_share": round(float(self.hot_share.mean()), 4),
            "next_token_reuse": round(float(self.next_reuse.mean()), 4),
            "reuse_within_window": round(float(self.window_reuse.mean()), 4),
            "per_layer": {
                "hot_share": [round(float(v), 4) for v in self.hot_share],
                "next_token_reuse": [round(float(v), 4) for v in self.next_reuse],
                "reuse_within_window": [round(float(v), 4) for v in self.window_reuse],
            },
            "sizes": list(self.sizes),
            "slots": list(self.slots),
            "hit_rates": per,
            "best": {f"{s:g}": dict(zip(("hit_rate", "net_saving"), self.best(s))) for s in self.sizes},
        }


def hot_share(ids: np.ndarray, n_expert: int, fraction: float) -> np.ndarray:
    """ids [N, M, K] -> [M]: share of each layer's choices taken by its round(E * fraction) most chosen experts."""
    n_hot = max(1, round(n_expert * fraction))
    counts = np.stack([np.bincount(ids[:, m].ravel(), minlength=n_expert) for m in range(ids.shape[1])])
    return -np.sort(-counts, axis=1)[:, :n_hot].sum(axis=1) / np.maximum(counts.sum(axis=1), 1)


def reuse(ids: np.ndarray, starts: np.ndarray, window: int) -> np.ndarray:
    """[M]: mean share of a token's K experts chosen by any of the `window` tokens before it in its chunk, over the
    tokens that have `window` predecessors there."""
    again, n = np.zeros(ids.shape[1]), 0
    for c in range(len(starts) - 1):
        x = ids[starts[c] : starts[c + 1]]  # [T, M, K]
        if len(x) <= window:
            continue
        seen = np.zeros((len(x) - window, ids.shape[1], ids.shape[2]), bool)
        for back in range(1, window + 1):
            prev = x[window - back : len(x) - back]  # [T - window, M, K]
            seen |= (x[window:, :, :, None] == prev[:, :, None, :]).any(axis=-1)
        again += seen.mean(axis=2).sum(axis=0)
        n += len(x) - window
    return again / max(n, 1)


def hit_rates(
    t: TraceFile,
    sizes: tuple[float, ...] = SIZES,
    policies: tuple[str, ...] = STAT_POLICIES,
    free: int | None = None,
    progress=None,
) -> tuple[tuple[int, ...], np.ndarray, np.ndarray]:
    """-> slots [S], hit rates [P, S, 2, M] (windows cold, warm) and uploads per token [P, S, M] (every token) of
    every policy on every chunk of the trace; at most `free` uploads per layer per token (None: no cap)."""
    slots = np.array([cache_slots(s, t.n_expert) for s in sizes])
    n_m, n_k = t.n_layers, t.top_k
    hits = np.zeros((len(policies), len(sizes), 2, n_m))
    uploads = np.zeros((len(policies), len(sizes), n_m))
    lookups = np.zeros(2)
    trace = t.routing_trace()
    counts = np.stack([np.bincount(t.ids[:, m].ravel(), minlength=t.n_expert) for m in range(n_m)])  # oracle's
    for first in range(0, t.n_chunks, CHUNK_BATCH):
        chunks = list(range(first, min(first + CHUNK_BATCH, t.n_chunks)))
        ids, valid = trace.padded(chunks)  # [C, T, M, K], [C, T]
        warm = valid & (np.arange(valid.shape[1]) >= WARM_AFTER)[None, :]
        windows = np.stack([valid, warm]).astype(np.int64)  # [2, C, T]
        lookups += windows.sum(axis=(1, 2)) * n_k
        for pi, name in enumerate(policies):
            hit, up = _replay_rows(name, ids, valid, slots, t.n_expert, counts, free)  # [C, S, M, T] each
            hits[pi] += np.einsum("wct,csmt->swm", windows, hit)
            uploads[pi] += up.sum(axis=(0, 3))
            if progress is not None:
                progress(len(chunks) / len(policies))
    return (
        tuple(int(s) for s in slots),
        hits / np.maximum(lookups, 1)[None, None, :, None],
        uploads / max(t.n_tokens, 1),
    )


def _replay_rows(
    name: str,
    ids: np.ndarray,
    valid: np.ndarray,
    slots: np.ndarray,
    n_expert: int,
    counts: np.ndarray,
    free: int | None,
) -> tuple[np.ndarray, np.ndarray]:
    """[C, S, M, T] hits and uploads of one policy: rows are (chunk, size, layer), each a cache of its own."""
    n_c, n_t, n_m, n_k = ids.shape
    shape = (n_c, len(slots), n_m)
    rows_ids = np.ascontiguousarray(np.broadcast_to(ids.transpose(0, 2, 1, 3)[:, None], (*shape, n_t, n_k))).reshape(
        -1, n_t, n_k
    )
    rows_valid = np.broadcast_to(valid[:, None, None, :], (*shape, n_t)).reshape(-1, n_t)
    rows_slots = np.broadcast_to(slots[None, :, None], shape).reshape(-1)
    if name == "belady":
        upcoming = next_uses(rows_ids)
        lengths = rows_valid.sum(axis=1)
        upcoming[upcoming >= lengths[:, None, None]] = n_t  # padding is never a use
        cache = Belady(rows_slots, n_expert, n_k, upcoming)
    elif name == "oracle":
        cache = make_policy("static", rows_slots, n_expert, n_k)
        cache.seed(np.broadcast_to(counts[None, None], (*shape, n_expert)).reshape(-1, n_expert))
        cache.plan_rows(np.arange(len(rows_slots)))  # the hottest experts, before the first token
    else:
        cache = make_policy(name, rows_slots, n_expert, n_k)
    r = replay(cache, rows_ids, rows_valid, free)
    return (r.hits.reshape(*shape, n_t).astype(np.int64), r.uploads.reshape(*shape, n_t).astype(np.int64))


def routing_stats(
    t: TraceFile,
    sizes: tuple[float, ...] = SIZES,
    policies: tuple[str, ...] = STAT_POLICIES,
    hot_fraction: float = 0.10,
    progress=None,
) -> RoutingStats:
    slots, hits, uploads = hit_rates(t, sizes, policies, progress=progress)
    return RoutingStats(
        t.n_expert,
        t.top_k,
        t.n_tokens,
        t.n_chunks,
        hot_share(t.ids, t.n_expert, hot_fraction),
        reuse(t.ids, t.starts, 1),
        reuse(t.ids, t.starts, REUSE_WINDOW),
        tuple(sizes),
        slots,
        tuple(policies),
        hits,
        uploads,
        hot_fraction,
    )


def format_stats(s: RoutingStats, per_layer: bool = False) -> str:
    lines = [
        (f"{s.tokens} tokens in {s.chunks} chunks; {len(s.hot_share)} MoE layers, {s.n_expert} experts, top-{s.top_k}"),
        (
            f"top {s.hot_fraction:.0%} of experts take {s.hot_share.mean():.1%} of the choices; next-token reuse "
            f"{s.next_reuse.mean():.1%}; reuse within {REUSE_WINDOW} tokens {s.window_reuse.mean():.1%}"
        ),
        "",
        f"hit rates, caches starting empty per chunk (cold: every token / warm: after {WARM_AFTER} tokens)",
        "| policy | " + " | ".join(f"{size:.0%} ({n})" for size, n in zip(s.sizes, s.slots)) + " |",
        "|---|" + "---:|" * len(s.sizes),
    ]
    for p in s.policies:
        lines.append(
            f"| {p} | "
            + " | ".join(f"{s.rate(p, size, False):.1%} / {s.rate(p, size, True):.1%}" for size in s.sizes)
            + " |"
        )
    if any(p in POLICIES for p in s.policies):
        cost = UploadCost()
        lines += [
            "",
            f"best online policy (--cache-policy) at each share, by hit rate / by net saving (hits x K - "
            f"uploads x {cost.upload_s / cost.hit_saves_s:.2f}, an upload's cost in expert reads): "
            + ", ".join(f"{size:.0%} {'/'.join(s.best(size))}" for size in s.sizes),
        ]
    if per_layer:
        lines += [
            "",
            "| layer | hot share | next-token reuse | reuse within 8 | LRU warm at each size |",
            "|---:|---:|---:|---:|---|",
        ]
        for m in range(len(s.hot_share)):
            lru = " ".join(f"{s.rate('lru', size, True, m):.1%}" for size in s.sizes) if "lru" in s.policies else "-"
            lines.append(f"| {m} | {s.hot_share[m]:.1%} | {s.next_reuse[m]:.1%} | {s.window_reuse[m]:.1%} | {lru} |")
    return "\n".join(lines)
