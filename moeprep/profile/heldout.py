"""Held-out judgement of a profile: replay chunks it never counted through simulated expert caches.

Each held-out chunk is a fresh session: the cache starts empty (or warmed from the profile) at its first token.
Every MoE layer has its own cache of `slots` experts. The caches are the runtime's own replacement policies
(moeprep/profile/policy.py) stepped as moerun decodes: each token looks up its K experts in the residency at its
start (a lookup is a hit when the expert is cached), then the policy updates the cache. Hit rates are reported over
all tokens and over the first COLD_WINDOW tokens of a chunk, the cold start a warm start is for.

Letters: C chunks, T tokens of a chunk, M MoE layers, K experts per token, E experts per layer, S cache sizes,
P policies, W windows; a policy steps C*S*M independent caches side by side.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moeprep.profile.counts import ExpertCounts
from moeprep.profile.policy import make_policy, replay
from moeprep.profile.trace import RoutingTrace

SIZES = (0.10, 0.25, 0.50)  # cache size as a share of a layer's experts
COLD_WINDOW = 64  # tokens at the start of a chunk
WINDOWS = ("all", f"first{COLD_WINDOW}")
CHUNK_BATCH = 32  # chunks replayed together: bounds memory at CHUNK_BATCH*P*S*M caches


@dataclass(frozen=True)
class CachePolicy:
    name: str
    rule: str  # the replacement policy (a key of moeprep.profile.policy.POLICIES), as the runtime runs it
    warm: bool  # each chunk starts with the profile's hottest experts cached (and the policy seeded)
    about: str


HELDOUT_POLICIES = (
    CachePolicy("static", "static", True, "the profile's hottest experts, fixed"),
    CachePolicy("lru", "lru", False, "least recently used, starts empty"),
    CachePolicy("lfu", "lfu", False, "most used in the chunk stay (a miss must outnumber one), starts empty"),
    CachePolicy("lru-warm", "lru", True, "least recently used, starts with the profile's hottest experts"),
)
POLICIES = tuple(p.name for p in HELDOUT_POLICIES)
ABOUT = {p.name: p.about for p in HELDOUT_POLICIES}


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


def simulate_caches(
    trace: RoutingTrace, counts: ExpertCounts, policies: tuple[CachePolicy, ...] = HELDOUT_POLICIES
) -> HeldoutTable:
    """Replay the trace's held-out chunks through every policy and size; warm caches come from `counts`."""
    chunks = np.flatnonzero(trace.heldout)
    assert len(chunks), "no held-out chunks to replay"
    slots = np.array([cache_slots(s, counts.n_expert) for s in SIZES])
    hits = np.zeros((len(policies), len(SIZES), len(WINDOWS), len(counts.layers)), np.int64)
    lookups = np.zeros(len(WINDOWS), np.int64)
    for first in range(0, len(chunks), CHUNK_BATCH):
        ids, valid = trace.padded(chunks[first : first + CHUNK_BATCH])  # [C, T, M, K], [C, T]
        windows = _window_masks(valid)  # [W, C, T]
        lookups += windows.sum(axis=(1, 2)) * trace.top_k
        for pi, policy in enumerate(policies):
            hits[pi] += _replay(policy, ids, valid, windows, slots, counts)
    return HeldoutTable(
        counts.layers,
        tuple(int(s) for s in slots),
        hits,
        lookups,
        len(chunks),
        int(np.diff(trace.starts)[chunks].sum()),
        tuple(p.name for p in policies),
    )


def _window_masks(valid: np.ndarray) -> np.ndarray:
    cold = np.arange(valid.shape[1]) < COLD_WINDOW
    return np.stack([valid, valid & cold[None, :]])


def _replay(
    policy: CachePolicy,
    ids: np.ndarray,
    valid: np.ndarray,
    windows: np.ndarray,
    slots: np.ndarray,
    counts: ExpertCounts,
) -> np.ndarray:
    """[S, W, M] hits of one policy: every chunk, size and layer a cache of its own, all stepped together."""
    n_c, n_t, n_m, n_k = ids.shape
    n_s = len(slots)
    shape = (n_c, n_s, n_m)  # the rows, in this order
    rows_ids = np.broadcast_to(ids.transpose(0, 2, 1, 3)[:, None], (*shape, n_t, n_k)).reshape(-1, n_t, n_k)
    rows_valid = np.broadcast_to(valid[:, None, None, :], (*shape, n_t)).reshape(-1, n_t)
    rows_slots = np.broadcast_to(slots[None, :, None], shape).reshape(-1)
    cache = make_policy(policy.rule, rows_slots, counts.n_expert, n_k)
    if policy.warm:
        usage = np.broadcast_to(counts.selections[None, None], (*shape, counts.n_expert))
        cache.seed(usage.reshape(-1, counts.n_expert))
        cache.plan_rows(np.arange(len(rows_slots)))  # fill the empty slots with the hottest experts
    hit = replay(cache, rows_ids, rows_valid).hits.reshape(*shape, n_t).astype(np.int64)
    return np.einsum("wct,csmt->swm", windows.astype(np.int64), hit)
