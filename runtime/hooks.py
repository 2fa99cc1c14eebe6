"""Callbacks into the forward pass: routing decisions and matmul inputs, for profiling and importance matrices.

`Hooks` is built once per model and handed to every layer that can fire; a layer checks the (usually empty) list
before building an event, so with nothing registered a forward pass makes no copies and no host syncs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RoutingEvent:
    layer: int  # block index
    positions: torch.Tensor  # (T,) int64
    expert_ids: torch.Tensor  # (T, K) int64
    weights: torch.Tensor  # (T, K) float32 gate weights applied to the experts' outputs


@dataclass(frozen=True)
class ActivationEvent:
    tensor_name: str  # GGUF name of the weight, e.g. "blk.3.attn_q.weight"
    x: torch.Tensor  # (N, in_features) float32 rows multiplied by that weight
    expert: int | None  # for stacked expert tensors, the expert these routed rows went to


class HookHandle:
    def __init__(self, hooks: list, fn: Callable) -> None:
        self._hooks, self._fn = hooks, fn

    def remove(self) -> None:
        if self._fn in self._hooks:
            self._hooks.remove(self._fn)


class Hooks:
    """The registered callbacks of one model; layers hold a reference and fire through it."""

    def __init__(self) -> None:
        self.routing: list[Callable[[RoutingEvent], None]] = []
        self.activation: list[Callable[[ActivationEvent], None]] = []

    def add_routing(self, fn: Callable[[RoutingEvent], None]) -> HookHandle:
        self.routing.append(fn)
        return HookHandle(self.routing, fn)

    def add_activation(self, fn: Callable[[ActivationEvent], None]) -> HookHandle:
        self.activation.append(fn)
        return HookHandle(self.activation, fn)

    def fire_routing(self, layer: int, positions: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
        event = RoutingEvent(layer, positions, ids.long(), weights.float())
        for fn in list(self.routing):
            fn(event)

    def fire_activation(self, tensor_name: str, x: torch.Tensor, expert: int | None = None) -> None:
        event = ActivationEvent(tensor_name, x.reshape(-1, x.shape[-1]).float(), expert)
        for fn in list(self.activation):
            fn(event)
