"""Recording a step as a `Program`: CUDA graphs with host work between them (graphs.py captures and replays them).

The Capture in progress travels with the step it records (`Step.capture`): a layer with host work inside the step
(the expert cache) cuts the graph there, a model over several GPUs crosses between them; nothing reads it from a
global. This module imports torch only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class Program:
    """A captured step: CUDA graphs and the host work between them, replayed in order, then the host work that
    follows the whole step (`after`)."""

    def __init__(self) -> None:
        self.parts: list[torch.cuda.CUDAGraph | Callable[[], None]] = []
        self.after: list[Callable[[], None]] = []

    def replay(self) -> None:
        for part in self.parts:
            part.replay() if isinstance(part, torch.cuda.CUDAGraph) else part()
        for work in self.after:
            work()


class Capture:
    """Records a Program: the graph being captured ends at each `cut`, the host work is appended, a new graph
    begins. Use as a context manager on a side stream (CUDA cannot capture the default stream)."""

    def __init__(self, pool) -> None:
        self.pool, self.program, self.graph = pool, Program(), None
        self.streams: dict[torch.device, tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}  # (capturing, previous)

    def __enter__(self) -> Capture:
        self._begin()
        return self

    def __exit__(self, *exc) -> None:
        self.program.parts.append(self._end())
        for device, (_, previous) in self.streams.items():
            with torch.cuda.device(device):
                torch.cuda.set_stream(previous)

    def after(self, host_work: Callable[[], None]) -> None:
        """Host work once the whole step is launched (the expert cache's streamed steps: read the step's routing,
        plan uploads)."""
        self.program.after.append(host_work)

    def cut(self, host_work: Callable[[], None]) -> None:
        self.program.parts += [self._end(), on_current_device(host_work)]
        self._begin()

    def cross(self, tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        """Go on on another GPU: end this GPU's graph, and begin one on `device` (on a capture stream of its own,
        current there until the capture ends). At replay, between the two, the host copies `tensors` into buffers on
        `device`, each copy ordered after the first GPU's work and before the second's (as Tensor.to orders them);
        returns those buffers, for the rest of the step to read."""
        graph = self._end()
        buffers = [torch.empty_like(t, device=device) for t in tensors]

        def copy() -> None:
            for buffer, t in zip(buffers, tensors):
                buffer.copy_(t, non_blocking=True)

        self.program.parts += [graph, copy]
        with torch.cuda.device(device):
            if device not in self.streams:
                self.streams[device] = torch.cuda.Stream(device), torch.cuda.current_stream(device)
                torch.cuda.set_stream(self.streams[device][0])
            self._begin()
        return buffers

    def _begin(self) -> None:
        self.device = torch.cuda.current_device()  # a graph begins and ends on its GPU's current stream
        self.graph = torch.cuda.CUDAGraph()
        self.graph.capture_begin(pool=self.pool)

    def _end(self) -> torch.cuda.CUDAGraph:
        with torch.cuda.device(self.device):
            self.graph.capture_end()
        return self.graph


def on_current_device(work: Callable[[], None]) -> Callable[[], None]:
    """`work` replayed under the GPU current now (a layer's host work syncs and records on its own GPU's stream);
    as it is where one GPU is visible (the switch costs a few microseconds, twice per cached layer and step)."""
    if torch.cuda.device_count() == 1:
        return work
    device = torch.cuda.current_device()

    def run() -> None:
        with torch.cuda.device(device):
            work()

    return run
