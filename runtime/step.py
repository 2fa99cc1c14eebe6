"""What one forward call is about: the positions of its tokens, their sequences, and how many KV slots attention reads."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch


@dataclass
class Step:
    """One forward call: the positions of its T tokens, the sequence they belong to, and how many KV cache slots
    attention reads.

    A step of one sequence (`seq`, the common case: a prompt chunk or a decode step) reads that sequence's slots as
    they lie; a step that mixes sequences (`seqs`, one per token: a batch of decode steps) makes each token read its
    own sequence's slots. Slots past the last position are masked anyway, so n_slots = last position + 1 is the
    cheapest choice; a CUDA-graph decode step passes a fixed bucket instead, so that its shapes never change.

    A model spread over several devices reads the step on each of them: `on(device)` gives the step's copy there,
    made once per step and device.
    """

    positions: torch.Tensor  # (T,) int64
    n_slots: int
    seq: int = 0
    seqs: torch.Tensor | None = None  # (T,) int64, or None: every token is in `seq`
    _masks: dict[int, torch.Tensor] = field(default_factory=dict)
    _copies: dict[torch.device, Step] = field(default_factory=dict)  # shared by the step and all its copies

    def on(self, device: torch.device) -> Step:
        """This step with its tensors on `device`: itself where they are already, else a copy made the first time
        any of the step's copies is asked for `device` (its masks are then built there, once)."""
        if self.positions.device == device:
            return self
        if device not in self._copies:
            self._copies.setdefault(self.positions.device, self)
            moved = {f.name: getattr(self, f.name).to(device, non_blocking=True) for f in fields(self)
                     if isinstance(getattr(self, f.name), torch.Tensor)}
            self._copies[device] = replace(self, **moved, _masks={}, _copies=self._copies)
        return self._copies[device]

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
