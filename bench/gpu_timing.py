"""Timing a captured CUDA graph: the GPU benchmarks' shared clock."""

from __future__ import annotations

import statistics

import torch


def replay_seconds(graph: torch.cuda.CUDAGraph, repeat: int) -> float:
    """Median seconds of one replay of `graph` over `repeat` timed replays (after one untimed)."""
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)
