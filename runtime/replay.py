"""Routing replay: every MoE layer uses the experts (and gate weights) a recorded trace gives, not its router's.

`moerun bench --routing TRACE` and bench/bench_cache.py install it on a loaded model before the benchmark runs.
Each MoE layer's router is wrapped: the router still runs (its matrix product and top-k cost what they cost), then
its choice is replaced by the trace's row for each token, row = the chosen chunk's start + the token's position.
Everything after the router runs as usual on the trace's choice: the expert cache's lookups, uploads, streamed and
CPU misses, the GPU experts, CUDA graphs. The positions come from the step the MoE layer is called with (a forward
pre-hook keeps a reference to them); in a captured decode step they are the graph's static position buffer, so a
replayed graph reads each step's own rows.

A trace without gate weights (one extracted from a profile) weighs each of a token's K choices 1/K. A trace whose
number of MoE layers, experts or top-k differs from the model's is refused: nothing is stretched to fit.

Letters: N trace tokens, M MoE layers, K experts per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from moeprep.errors import MoeprepError
from moeprep.profile.tracefile import TraceFile
from moerun.layers import MoE, Router, device_of
from moerun.step import Step


class ReplayRouter(nn.Module):
    """Runs the wrapped router, then returns the trace's choice for the step's positions."""

    def __init__(self, router: Router, ids: torch.Tensor, weights: torch.Tensor, base: int) -> None:
        super().__init__()
        self.router = router
        self.register_buffer("ids", ids, persistent=False)  # [N, K] int64 on the router's device
        self.register_buffer("weights", weights, persistent=False)  # [N, K] float32
        self.base = base  # trace row of position 0

    def forward(self, x: torch.Tensor, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        self.router(x, step)  # its cost stays in the step; its choice is not used
        rows = step.positions.to(self.ids.device) + self.base
        return self.ids[rows], self.weights[rows]


@dataclass(frozen=True)
class Replay:
    """What was installed: which trace chunk the positions read, and its length."""

    chunk: int
    tokens: int


def moe_layers(model) -> list[MoE]:
    return [m for m in model.net.modules() if isinstance(m, MoE)]


def pick_chunk(t: TraceFile, n_tokens: int, where: str) -> int:
    """The first chunk of at least n_tokens tokens (positions 0..n_tokens-1 read its rows)."""
    long_enough = np.flatnonzero(t.chunk_lengths() >= n_tokens)
    if not len(long_enough):
        raise MoeprepError(
            f"{where}: its longest chunk has {int(t.chunk_lengths().max())} tokens; the benchmark needs "
            f"{n_tokens} (-p plus -n): give a trace with longer chunks (--chunk) or lower -p/-n"
        )
    return int(long_enough[0])


def install_replay(model, t: TraceFile, n_tokens: int, where: str) -> Replay:
    """Wrap every MoE layer's router, for good, so that positions 0..n_tokens-1 take the rows of the trace's first
    chunk long enough. Install on a model loaded for the benchmark, before its first decode step (CUDA graphs
    capture whatever runs then)."""
    t.check_shape(len(moe_layers(model)), model.args.n_experts, model.args.n_experts_used, where)
    chunk = pick_chunk(t, n_tokens, where)
    base = int(t.starts[chunk])
    weights = t.weights if t.weights is not None else np.full(t.ids.shape, 1.0 / t.top_k, np.float32)
    for m, moe in enumerate(moe_layers(model)):
        device = device_of(moe.router.gate)
        wrapper = ReplayRouter(
            moe.router,
            torch.from_numpy(np.ascontiguousarray(t.ids[:, m])).long().to(device),
            torch.from_numpy(np.ascontiguousarray(weights[:, m])).float().to(device),
            base,
        )
        moe.router = wrapper
    return Replay(chunk, int(t.chunk_lengths()[chunk]))
