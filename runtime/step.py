"""What one forward call is about: the positions of its tokens, their sequences, and how many KV slots attention reads."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from moerun.capture import Capture


@dataclass
class Step:
    """One forward call: the positions of its T tokens, the sequence they belong to, and how many KV cache slots
    attention reads.

    A step of one sequence (`seq`, the common case: a prompt chunk or a decode step) reads that sequence's slots as
    they lie; a captured prompt step (graphs.PromptGraphs) gives its sequences as a (B,) device tensor instead, its
    tokens being B blocks of equal length, one prompt chunk each, so that one graph serves every set of sequences
    (each block reads its sequence's slots); a step that mixes sequences (`seqs`, one per token: a batch of decode
    steps) makes each token read its own sequence's slots. Slots past the last position are masked anyway, so
    n_slots = last position + 1 is the cheapest choice; a CUDA-graph decode step passes a fixed bucket instead, so
    that its shapes never change.

    A model spread over several devices reads the step on each of them: `on(device)` gives the step's copy there,
    made once per step and device. A step being captured as CUDA graphs carries its `capture`, where layers with
    host work inside the step cut the graph.
    """

    positions: torch.Tensor  # (T,) int64
    n_slots: int
    seq: int | torch.Tensor = 0  # a (B,) int64 device tensor in a captured prompt step: B blocks of tokens
    seqs: torch.Tensor | None = None  # (T,) int64, or None: every token is in `seq`
    groups: tuple[tuple[int, int, int, int], ...] = ()  # a mixed step's row groups, see group_rows and parts
    capture: Capture | None = None  # the CUDA-graph capture recording this step, if any (capture.py)
    tokens: torch.Tensor | None = None  # (T,) the step's token ids, for routers that read them (DeepSeek-V4's hash
    # layers); the Transformer sets them
    _masks: dict[int, torch.Tensor] = field(default_factory=dict)
    _copies: dict[torch.device, Step] = field(default_factory=dict)  # shared by the step and all its copies
    _parts: list[tuple[slice, Step]] = field(default_factory=list)

    @property
    def in_place(self) -> bool:
        """Is the step of one sequence (`seq` a number), rather than of a sequence per block or token (`blocks`)?"""
        return self.seqs is None and not isinstance(self.seq, torch.Tensor)

    @property
    def blocks(self) -> torch.Tensor | None:
        """The sequence of each block of rows where the step is not in place: (T,) `seqs` (a token each), or the
        captured prompt step's (B,) `seq`; None in place. Attention reads block b's slots from sequence blocks[b] of
        the KV cache (KVCache.update)."""
        return None if self.in_place else self.seqs if self.seqs is not None else self.seq

    def tensors(self) -> dict[str, torch.Tensor]:
        """The step's device tensors by field name (positions, and seqs when given)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}

    def on(self, device: torch.device, moved: dict[str, torch.Tensor] | None = None) -> Step:
        """This step with its tensors on `device`: itself where they are already, else a copy made the first time
        any of the step's copies is asked for `device` (its masks are then built there, once). `moved`: the
        tensors already there (a captured step copies them between graphs, see graphs.Capture.cross)."""
        if self.positions.device == device:
            return self
        if device not in self._copies:
            self._copies.setdefault(self.positions.device, self)
            moved = moved or {name: t.to(device, non_blocking=True) for name, t in self.tensors().items()}
            self._copies[device] = replace(self, **moved, _masks={}, _copies=self._copies, _parts=[])
        return self._copies[device]

    def parts(self) -> list[tuple[slice, Step]]:
        """A mixed step as the consecutive rows that attention runs together, each with its step: a prompt chunk as a
        step of its sequence (reading the slots as they lie, not a copy per token), the single tokens of several
        sequences between chunks as a mixed step. Made once, so that every layer reuses the parts' masks."""
        if not self._parts:
            self._parts = [
                (
                    slice(a, b),
                    Step(self.positions[a:b], n, seq=s, capture=self.capture)
                    if s >= 0
                    else Step(self.positions[a:b], n, seqs=self.seqs[a:b], capture=self.capture),
                )
                for a, b, s, n in self.groups
            ]
        return self._parts

    def mask(self, window: int = 0) -> torch.Tensor:
        """(T, n_slots) bool: may the query at positions[t] see slot s (slot = position); `window` > 0 limits how
        far back (llama.cpp's standard sliding window: the last `window` positions, itself included)."""
        if window not in self._masks:
            slots = torch.arange(self.n_slots, device=self.positions.device)[None, :]
            allowed = slots <= self.positions[:, None]
            if window:
                allowed &= slots > self.positions[:, None] - window
            self._masks[window] = allowed
        return self._masks[window]


def group_rows(positions: list[int], seqs: list[int]) -> tuple[tuple[int, int, int, int], ...]:
    """(start, stop, sequence or -1 for several, n_slots) of each group of a mixed step's rows: a run of two or more
    tokens of one sequence, or the single tokens between such runs; () where the rows are single tokens only."""
    runs: list[list[int]] = []  # [start, stop, seq]
    for t, s in enumerate(seqs):
        if runs and runs[-1][2] == s:
            runs[-1][1] = t + 1
        else:
            runs.append([t, t + 1, s])
    groups: list[list[int]] = []
    for a, b, s in runs:
        s = s if b - a > 1 else -1
        if groups and s == -1 == groups[-1][2]:
            groups[-1][1] = b
        else:
            groups.append([a, b, s])
    if len(groups) == 1 and groups[0][2] == -1:
        return ()
    return tuple((a, b, s, max(positions[a:b]) + 1) for a, b, s in groups)
