"""How often each expert of each MoE layer was chosen: the histogram at the heart of a profile.

Letters: M MoE layers (block order), E experts per layer, K experts chosen per token, T tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass
class ExpertCounts:
    """Selections, gate mass and tokens per MoE layer; row m belongs to block `layers[m]`."""

    layers: tuple[int, ...]  # [M] block index of each MoE layer
    selections: np.ndarray  # [M, E] int64: tokens whose top-K included the expert
    gate_mass: np.ndarray  # [M, E] float64: sum of the expert's gate weight over those tokens
    tokens: np.ndarray  # [M] int64: tokens routed through the layer

    @classmethod
    def zeros(cls, layers: Sequence[int], n_expert: int) -> ExpertCounts:
        m = len(layers)
        return cls(
            tuple(layers), np.zeros((m, n_expert), np.int64), np.zeros((m, n_expert), np.float64), np.zeros(m, np.int64)
        )

    @property
    def n_expert(self) -> int:
        return self.selections.shape[1]

    def add(self, row: int, expert_ids: np.ndarray, weights: np.ndarray) -> None:
        """Count one batch of routing decisions of MoE layer `row`: ids and weights are [T, K]."""
        flat = expert_ids.reshape(-1)
        self.selections[row] += np.bincount(flat, minlength=self.n_expert)
        mass = weights.reshape(-1).astype(np.float64)
        self.gate_mass[row] += np.bincount(flat, weights=mass, minlength=self.n_expert)
        self.tokens[row] += expert_ids.shape[0]

    def scaled(self, weight: int) -> ExpertCounts:
        return ExpertCounts(self.layers, self.selections * weight, self.gate_mass * weight, self.tokens * weight)

    def __add__(self, other: ExpertCounts) -> ExpertCounts:
        assert self.layers == other.layers and self.n_expert == other.n_expert
        return ExpertCounts(
            self.layers,
            self.selections + other.selections,
            self.gate_mass + other.gate_mass,
            self.tokens + other.tokens,
        )

    def shares(self) -> np.ndarray:
        """[M, E] each expert's share of its layer's selections (a layer with none is all zero)."""
        total = self.selections.sum(axis=1, keepdims=True)
        return np.divide(self.selections, total, out=np.zeros(self.selections.shape), where=total > 0)

    def hottest(self) -> np.ndarray:
        """[M, E] expert ids per layer, most selected first; ties go to the lower id so the order is deterministic."""
        return np.argsort(-self.selections, axis=1, kind="stable")

    def coverage(self) -> np.ndarray:
        """[M, E] share of a layer's selections covered by its hottest k+1 experts (column k)."""
        return np.cumsum(np.take_along_axis(self.shares(), self.hottest(), axis=1), axis=1)

    def block_table(self, n_layer: int) -> np.ndarray:
        """[n_layer, E] selections indexed by block; dense blocks are zero rows."""
        table = np.zeros((n_layer, self.n_expert), np.int64)
        table[list(self.layers)] = self.selections
        return table
