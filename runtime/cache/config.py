"""What a user asks of the expert cache (`CacheConfig`), and the defaults behind it."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from moeprep.profile.tracefile import TraceFile
from moerun.cache.plan import AUTO, Bandwidths

# Uploads one layer may start per step besides filling its empty slots (evictions, that is): an upload of a
# 30B-shaped expert (2.6 MB) takes ~50 us over pinned PCIe, so a handful per layer keeps a step's upload time below
# its compute while the cache adapts within a few tokens.
UPLOADS_PER_LAYER_STEP = 2


# Prefill: a missed expert chosen by this many of a step's tokens runs on the GPU from a staging bank. An expert of
# the 30B shape uploads in ~50 us over pinned PCIe; the CPU spends about that on each token it computes.
STAGE_MIN_TOKENS = 4


STAGE_BYTES = 512 << 20  # the staging bank's default size per device (part of the VRAM reserve)


@dataclass
class CacheConfig:
    """What the user asked of the cache: a budget per GPU (bytes; None: the GPU's free memory) or a fixed number of
    slots per MoE layer; a profile to warm from (--expert-profile; without one, counts baked into the GGUF); the
    policy. `usage` [L, E] is resolved from the profile or the GGUF by `open_cache`."""

    budgets: list[int] | None = None
    slots_per_layer: int | None = None
    profile: str | None = None
    usage: np.ndarray | None = None
    policy: str = AUTO  # a key of moerun.cache.policy.POLICIES, or auto
    plan: str = AUTO  # cache, blend, static or auto (cache/plan.py)
    bandwidths: Bandwidths = field(default_factory=Bandwidths)  # the cost model's bus and RAM speeds
    trace: TraceFile | None = None  # routing to measure the policies and plans on (moerun bench --routing)
    uploads_per_layer_step: int | None = UPLOADS_PER_LAYER_STEP  # None: every upload the policy wants
    cpu_threads: int | None = None
    pin: bool | None = None  # copy the experts into page-locked RAM (None: on CUDA, when free RAM holds them)
    stream: bool = True  # decode steps read their misses from page-locked host RAM (module docstring); off: the CPU
    # computes them, as where the experts are not page-locked
    stage_bytes: int = STAGE_BYTES  # the staging bank's size per device
