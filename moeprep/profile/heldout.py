"""Held-out judgement of a profile: replay chunks it never counted through simulated expert caches.

Each held-out chunk is a fresh session: the cache starts empty (or warmed from the profile) at its first token.
Every MoE layer has its own cache of `slots` experts; each token looks up its K experts in order, a lookup is a hit
when the expert is cached, and a dynamic cache admits every miss, evicting by its policy when full. Hit rates are
reported over all tokens and over the first COLD_WINDOW tokens of a chunk, the cold start a warm start is for.

Letters: C chunks, T tokens of a chunk, M MoE layers, K experts per token, E experts per layer, S cache sizes,
P policies, W windows, B = C*P*S*M independent caches simulated side by side.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moeprep.profile.counts import ExpertCounts
from moeprep.profile.trace import RoutingTrace

SIZES = (0.10, 0.25, 0.50)  # cache size as a share of a layer's experts
COLD_WINDOW = 64  # tokens at the start of a chunk
WINDOWS = ("all", f"first{COLD_WINDOW}")
CHUNK_BATCH = 32  # chunks replayed together: bounds memory at CHUNK_BATCH*P*S*M caches
NOT_CACHED = np.iinfo(np.int64).max


@dataclass(frozen=True)
class CachePolicy:
    name: str
    freq_weight: int  # 0: evict the least recently used; 1: the least frequently used, recency breaking ties
    warm: bool  # each chunk starts with the profile's hottest experts cached (hottest as most recent)
    about: str


# The static cache is not simulated step by step: it holds the hottest experts and never changes.
STATIC = "static"
DYNAMIC = (
    CachePolicy("lru", 0, False, "least recently used, starts empty"),
    CachePolicy("lfu", 1, False, "least frequently used in the chunk, starts empty"),
    CachePolicy("lru-warm", 0, True, "least recently used, starts with the profile's hottest experts"),
)
POLICIES = (STATIC, *(p.name for p in DYNAMIC))
ABOUT = {STATIC: "the profile's hottest experts, fixed", **{p.name: p.about for p in DYNAMIC}}


def cache_slots(size: float, n_expert: int) -> int:
    """Experts a cache of `size` (share of a layer) holds: rounded half up, at least one."""
    return max(1, int(np.floor(size * n_expert + 0.5)))


@dataclass
class HeldoutTable:
    """Hits per policy, cache size, window and MoE layer; every layer makes the same lookups."""

    layers: tuple[int, ...]  # [M] block indices
    slots: tuple[int, ...]  # [S] experts per layer cached at each of SIZES
    hits: np.ndarray  # [P, S, W, M] int64
    lookups: np.ndarray  # [W] int64 expert lookups per layer (tokens x K)
    chunks: int
    tokens: int
    policies: tuple[str, ...] = POLICIES
    sizes: tuple[float, ...] = SIZES
    windows: tuple[str, ...] = WINDOWS

    def layer_rates(self) -> np.ndarray:
        """[P, S, W, M] hit rate of each layer."""
        return self.hits / np.maximum(self.lookups, 1)[None, None, :, None]

    def overall(self) -> np.ndarray:
        """[P, S, W] hit rate over all layers."""
        return self.hits.sum(axis=3) / np.maximum(self.lookups * len(self.layers), 1)[None, None, :]


def simulate_caches(trace: RoutingTrace, counts: ExpertCounts) -> HeldoutTable:
    """Replay the trace's held-out chunks through every policy and size; static and warm caches come from `counts`."""
    chunks = np.flatnonzero(trace.heldout)
    assert len(chunks), "no held-out chunks to replay"
    n_expert = counts.n_expert
    slots = np.array([cache_slots(s, n_expert) for s in SIZES])
    # rank[m, e]: position of expert e in layer m's hottest-first order
    rank = np.argsort(counts.hottest(), axis=1, kind="stable")  # [M, E]
    members = rank[None, :, :] < slots[:, None, None]  # [S, M, E] the static cache of each size
    hits = np.zeros((len(POLICIES), len(SIZES), len(WINDOWS), len(counts.layers)), np.int64)
    lookups = np.zeros(len(WINDOWS), np.int64)
    for first in range(0, len(chunks), CHUNK_BATCH):
        ids, valid = trace.padded(chunks[first : first + CHUNK_BATCH])  # [C, T, M, K], [C, T]
        windows = _window_masks(valid)  # [W, C, T]
        lookups += windows.sum(axis=(1, 2)) * trace.top_k
        hits[0] += _static_hits(ids, windows, members)
        hits[1:] += _replay(ids, valid, windows, slots, members, rank)
    return HeldoutTable(counts.layers, tuple(int(s) for s in slots), hits, lookups, len(chunks),
                        int(np.diff(trace.starts)[chunks].sum()))


def _window_masks(valid: np.ndarray) -> np.ndarray:
    cold = np.arange(valid.shape[1]) < COLD_WINDOW
    return np.stack([valid, valid & cold[None, :]])


def _static_hits(ids: np.ndarray, windows: np.ndarray, members: np.ndarray) -> np.ndarray:
    """[S, W, M] hits of the fixed caches."""
    m_index = np.arange(ids.shape[2])[None, None, :, None]
    out = []
    for member in members:
        hit = member[m_index, ids].sum(axis=3)  # [C, T, M] hits per token
        out.append(np.einsum("wct,ctm->wm", windows.astype(np.int64), hit))
    return np.stack(out)


def _replay(ids: np.ndarray, valid: np.ndarray, windows: np.ndarray, slots: np.ndarray, members: np.ndarray,
            rank: np.ndarray) -> np.ndarray:
    """[P_dynamic, S, W, M] hits of the dynamic caches, all chunks, policies, sizes and layers stepped together."""
    n_c, n_t, n_m, n_k = ids.shape
    n_e = rank.shape[1]
    n_p, n_s = len(DYNAMIC), len(slots)
    shape = (n_c, n_p, n_s, n_m)
    n_b = int(np.prod(shape))
    rows = np.arange(n_b)
    cap = np.broadcast_to(slots[None, None, :, None], shape).reshape(-1)
    freq_weight = np.broadcast_to(np.array([p.freq_weight for p in DYNAMIC])[None, :, None, None], shape).reshape(-1)
    warm = np.array([p.warm for p in DYNAMIC])

    # key[b, e]: eviction order of the cached experts, smallest first; NOT_CACHED marks the others.
    # LRU: the tick of the last use. LFU: uses * span + tick (uses first, recency breaking ties); span exceeds
    # any tick. Warm experts were "used" just before the chunk, the hottest last: ticks -E..-1; real ticks from 1.
    span = n_t * n_k + n_e + 2
    key = np.full((*shape, n_e), NOT_CACHED, np.int64)
    key[:, warm] = np.where(members, -(rank + 1)[None], NOT_CACHED)[None, None]  # [S, M, E] over chunks, policies
    key = key.reshape(n_b, n_e)
    n_cached = (key != NOT_CACHED).sum(axis=1)
    uses = np.zeros((n_b, n_e), np.int64)
    n_w = len(windows)
    win_hits = np.zeros((n_w, n_b), np.int64)

    for t in range(n_t):
        live = np.broadcast_to(valid[:, t, None, None, None], shape).reshape(-1)
        used = rows[live]
        in_window = np.broadcast_to(windows[:, :, t, None, None, None], (n_w, *shape)).reshape(n_w, -1)
        for k in range(n_k):
            e = np.broadcast_to(ids[:, t, None, None, :, k], shape).reshape(-1)
            hit = (key[rows, e] != NOT_CACHED) & live
            win_hits += hit[None, :] & in_window
            miss = live & ~hit
            evict = np.flatnonzero(miss & (n_cached >= cap))
            if len(evict):
                key[evict, key[evict].argmin(axis=1)] = NOT_CACHED
            n_cached += miss & (n_cached < cap)
            e_used = e[live]
            uses[used, e_used] += 1
            key[used, e_used] = uses[used, e_used] * freq_weight[live] * span + (t * n_k + k + 1)
    # [W, C, P, S, M] -> [P, S, W, M]
    return win_hits.reshape(n_w, *shape).sum(axis=1).transpose(1, 2, 0, 3)
