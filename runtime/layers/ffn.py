"""Gated activations and the dense feed-forward block (leading dense layers, shared experts)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from moerun.layers.linear import Linear
from moerun.layers.ops import Kernels
from moerun.step import Step

if TYPE_CHECKING:  # Triton's, which only CUDA builds of torch bring
    from moerun.kernels.act_i8 import QAct
from torch import nn


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """gpt-oss: the gate is capped at `limit`, up clamped to +-limit, and up gets +1."""
    gate = gate.clamp(max=limit)
    return gate * torch.sigmoid(alpha * gate) * (up.clamp(-limit, limit) + 1)


def swiglu_clamp(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """glm5-next's clamped SwiGLU (llama.cpp's swiglu_clamp): the gate capped at `limit` before SiLU, up clamped to
    +-limit."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


def swiglu_limited(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """Step-3.5's clamped SwiGLU (llama.cpp's default for a swiglu_clamp key): SiLU of the gate, then capped at
    `limit`; up clamped to +-limit. Unlike swiglu_clamp, the cap comes after the SiLU."""
    return F.silu(gate).clamp(max=limit) * up.clamp(-limit, limit)


# ggml's tanh-approximated GELU: 0.5 x (1 + tanh(sqrt(2/pi) x (1 + 0.044715 x^2))).
GELU_COEF_A = 0.044715
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
GELU_TABLE_RANGE = 10.0  # beyond +-this ggml's CPU GELU takes x (above) or 0 (below) instead of its table


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU (tanh approximation) of float32 x, in ggml_gelu_f32's order of float32 operations."""
    return 0.5 * x * (1.0 + torch.tanh(SQRT_2_OVER_PI * x * (1.0 + GELU_COEF_A * x * x)))


def gelu_half_table(x: torch.Tensor) -> torch.Tensor:
    """GELU as llama.cpp's CPU backend computes it for float32 tensors: x rounded to float16, looked up in a table of
    gelu_tanh over every float16 value (its entries float16 too); x itself above GELU_TABLE_RANGE, 0 below minus
    it. The two float16 roundings move a value by up to 2^-11 of it, well beyond float32's last bits."""
    x = x.float()
    table = gelu_tanh(x.half().float()).half().float()
    return torch.where(x >= GELU_TABLE_RANGE, x, torch.where(x <= -GELU_TABLE_RANGE, torch.zeros_like(x), table))


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Gemma's gated GELU (ggml's geglu): GELU of the gate, as llama.cpp's CPU backend computes it, times up."""
    return gelu_half_table(gate) * up


def relu_sqr(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Nemotron-H's ungated experts: relu(up)^2; `gate` is not read (weights.expert_rows passes up there)."""
    return F.relu(up).square()


def reglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """ReLU-gated (ggml's reglu; SmallThinker's experts): relu(gate) * up."""
    return torch.relu(gate) * up


def situ(gate: torch.Tensor, up: torch.Tensor, beta: float, up_beta: float) -> torch.Tensor:
    """Kimi-K3's situ: beta tanh(gate / beta) sigmoid(gate), times up saturated as up_beta tanh(up / up_beta)
    where up_beta > 0 (up itself otherwise). Each division is a product with the reciprocal, as llama.cpp scales."""
    act = beta * torch.tanh(gate * (1.0 / beta)) * torch.sigmoid(gate)
    if up_beta > 0:
        up = up_beta * torch.tanh(up * (1.0 / up_beta))
    return act * up


# The torch reference of each activation by name: act(gate, up, limit, up_limit); `limit` is read only by those with
# a clamp that varies per model or block (gpt-oss's is fixed) and situ (its beta), `up_limit` only by situ.
ACTIVATIONS: dict[str, Callable[[torch.Tensor, torch.Tensor, float, float], torch.Tensor]] = {
    "swiglu": lambda gate, up, limit, up_limit: swiglu(gate, up),
    "swiglu_oai": lambda gate, up, limit, up_limit: swiglu_oai(gate, up),
    "swiglu_clamp": lambda gate, up, limit, up_limit: swiglu_clamp(gate, up, limit),
    "swiglu_limited": lambda gate, up, limit, up_limit: swiglu_limited(gate, up, limit),
    "geglu": lambda gate, up, limit, up_limit: geglu(gate, up),
    "relu_sqr": lambda gate, up, limit, up_limit: relu_sqr(gate, up),
    "reglu": lambda gate, up, limit, up_limit: reglu(gate, up),
    "situ": situ,
}


@dataclass(frozen=True)
class Activation:
    """An FFN's or experts' gated activation, act(gate, up): a name of ACTIVATIONS and, for swiglu_clamp and
    swiglu_limited, its clamp (glm5-next and step35 set one per block); for situ its beta (`limit`) and linear beta
    (`up_limit`). One value that every implementation reads:
    the torch reference (`__call__`), the fused kernels (`Kernels.activations`) and the CPU experts (moe_rows'
    activation and limit)."""

    name: str = "swiglu"
    limit: float = 0.0
    up_limit: float = 0.0

    def __post_init__(self) -> None:
        if self.name not in ACTIVATIONS:
            raise ValueError(f"unknown activation {self.name!r} (known: {', '.join(ACTIVATIONS)})")

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return ACTIVATIONS[self.name](gate, up, self.limit, self.up_limit)

    @property
    def reads_gate(self) -> bool:
        """False only for relu_sqr, whose experts have no gate tensor."""
        return self.name != "relu_sqr"

    def on(self, kernels: Kernels) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """The function computing it with `kernels`: their fused one where they have it (never for a clamp that
        varies), else this torch reference."""
        fused = kernels.activations.get(self.name)
        return fused if fused is not None and self.name not in ("swiglu_clamp", "swiglu_limited", "situ") else self


SWIGLU = Activation()
RELU_SQR = Activation("relu_sqr")


class FeedForward(nn.Module):
    """Dense gated FFN: down(act(gate(x), up(x))); leading dense layers and shared experts."""

    def __init__(
        self, gate: Linear, up: Linear, down: Linear, kernels: Kernels, activation: Activation = SWIGLU
    ) -> None:
        super().__init__()
        self.gate, self.up, self.down = gate, up, down
        self.activation, self.act = activation, activation.on(kernels)

    def forward(self, x: torch.Tensor, step: Step | None = None, i8: QAct | None = None) -> torch.Tensor:
        """x (T, D), and its int8 rounding where its norm made one (for gate and up) -> (T, D)."""
        return self.down(self.act(self.gate(x, i8), self.up(x, i8)))


class UngatedFeedForward(nn.Module):
    """Dense FFN without a gate: down(relu(up x)^2) (Nemotron-H's shared expert)."""

    def __init__(self, up: Linear, down: Linear) -> None:
        super().__init__()
        self.up, self.down = up, down

    def forward(self, x: torch.Tensor, step: Step | None = None, i8: QAct | None = None) -> torch.Tensor:
        """x (T, D), and its int8 rounding where its norm made one (for up) -> (T, D)."""
        return self.down(F.relu(self.up(x, i8)).square())
