"""Recording a calibration pass through moerun's hooks: expert choices per token and layer, and matmul inputs.

`RoutingRecorder` turns the routing events of one forward pass into [T, M, K] ids and gate weights placed by
token position; `ActivationRecorder` keeps llama-imatrix's statistics (sum of squared inputs per column and rows
seen, per expert for expert stacks); `collect` runs the chunks and fills counts and trace.

Letters: C chunks, T tokens of a chunk, M MoE layers, K experts chosen per token, P input width of a weight.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from tqdm import tqdm

from moeprep.profile.counts import ExpertCounts
from moeprep.profile.trace import RoutingTrace

if TYPE_CHECKING:  # moerun is imported only when a model is run
    from moerun import ActivationEvent, Model, RoutingEvent


class RoutingRecorder:
    """Routing hook: keeps the expert ids and gate weights of every MoE layer until `take`."""

    def __init__(self, layers: Sequence[int]) -> None:
        self.row = {block: m for m, block in enumerate(layers)}
        self.events: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (row, pos, ids, weights)

    def __call__(self, ev: RoutingEvent) -> None:
        self.events.append((self.row[ev.layer], ev.positions.cpu(), ev.expert_ids.cpu(), ev.weights.cpu()))

    def take(self, n_tokens: int, top_k: int) -> tuple[np.ndarray, np.ndarray]:
        """ids [T, M, K] int64 and weights [T, M, K] float32 of the pass that just ran; clears the events."""
        ids = np.full((n_tokens, len(self.row), top_k), -1, np.int64)
        weights = np.zeros((n_tokens, len(self.row), top_k), np.float32)
        for m, pos, expert_ids, w in self.events:
            ids[pos.numpy(), m] = expert_ids.numpy()
            weights[pos.numpy(), m] = w.numpy()
        self.events.clear()
        assert (ids >= 0).all(), "a MoE layer reported no routing for some tokens"
        return ids, weights


class ActivationRecorder:
    """Activation hook with llama-imatrix's semantics: for each weight inside a block, the sum over input rows of
    x**2 per column and the number of rows, kept per expert for an expert stack (rows routed to that expert)."""

    def __init__(self, n_mats: dict[str, int]) -> None:
        self.n_mats = n_mats  # weight name -> matrices in it (experts of a stack, 1 for a dense weight)
        self.sums: dict[str, torch.Tensor] = {}  # [n_mat, P] float64, on the model's device
        self.counts: dict[str, np.ndarray] = {}  # [n_mat] int64

    def __call__(self, ev: ActivationEvent) -> None:
        # llama-imatrix keeps the weights of blocks only (output.weight just on request)
        if not ev.tensor_name.startswith("blk.") or ev.x.shape[0] == 0:
            return
        name = ev.tensor_name
        if name not in self.sums:
            self.sums[name] = torch.zeros(self.n_mats[name], ev.x.shape[1], dtype=torch.float64, device=ev.x.device)
            self.counts[name] = np.zeros(self.n_mats[name], np.int64)
        mat = 0 if ev.expert is None else ev.expert
        self.sums[name][mat] += ev.x.double().square().sum(dim=0)
        self.counts[name][mat] += ev.x.shape[0]

    def entries(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        return {name: (s.cpu().numpy(), self.counts[name]) for name, s in self.sums.items()}


def collect(
    model: Model, chunks: np.ndarray, heldout: np.ndarray, layers: Sequence[int], n_expert: int, top_k: int
) -> tuple[ExpertCounts, RoutingTrace]:
    """Run every chunk [C, T] from position 0; counts take the chunks not held out, the trace keeps all."""
    recorder = RoutingRecorder(layers)
    handle = model.add_routing_hook(recorder)
    counts = ExpertCounts.zeros(layers, n_expert)
    traced = []
    try:
        with (
            torch.inference_mode(),
            tqdm(total=chunks.size, unit="tok", unit_scale=True, desc="profile", dynamic_ncols=True) as bar,
        ):
            for chunk, held in zip(chunks, heldout):
                model.forward(torch.from_numpy(chunk), start_pos=0)
                ids, weights = recorder.take(len(chunk), top_k)
                if not held:
                    for m in range(len(layers)):
                        counts.add(m, ids[:, m], weights[:, m])
                traced.append(ids)
                bar.update(len(chunk))
    finally:
        handle.remove()
    return counts, RoutingTrace.from_chunks(traced, heldout, n_expert)
