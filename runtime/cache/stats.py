"""What the expert cache counts and times: hits, misses, uploads, staged and streamed experts per layer, and
seconds by part of the work."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import numpy as np


@dataclass
class CacheStats:
    """Counts since the last reset: lookups and hits per layer, uploads, and where the layers' host time went
    (`seconds`: router sync, CPU experts, uploads; `gpu_events`: (start, end) CUDA events around the GPU's expert
    work, read once the device is idle)."""

    lookups: np.ndarray
    hits: np.ndarray
    uploads: int = 0
    staged: int = 0  # a prompt's experts copied to the staging bank for one step, not kept
    streamed: int = 0  # misses a decode step's kernels read from host RAM over the bus
    seconds: dict = field(default_factory=lambda: dict.fromkeys(TIMED, 0.0))
    gpu_events: list = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return float(self.hits.sum() / max(1, self.lookups.sum()))

    def per_layer(self) -> np.ndarray:
        return np.divide(self.hits, self.lookups, out=np.zeros(len(self.hits)), where=self.lookups > 0)

    def gpu_expert_seconds(self) -> float:
        """Device time of the GPU's expert kernels (synchronizes)."""
        if self.gpu_events:
            self.gpu_events[-1][1].synchronize()
        return sum(a.elapsed_time(b) for a, b in self.gpu_events) / 1000


# Host time of the cached layers, by what it waited for or did: the router's result (the GPU's work up to it),
# the CPU's experts, planning and enqueueing uploads.
TIMED = ("router sync", "CPU experts", "uploads")


@contextlib.contextmanager
def timed(stats: CacheStats, what: str):
    start = time.perf_counter()
    yield
    stats.seconds[what] += time.perf_counter() - start
