"""The MoE block: the `Router` (which experts, with what weights), the routed experts' work (`ExpertCompute`, whose
reference is `GGUFExperts`; the GGUF-backed twins and the expert cache implement the same call) and `MoE`, which adds
the shared experts."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from moerun.config import (
    GATING_SIGMOID,
    GATING_SOFTMAX,
    GATING_SOFTMAX_WEIGHT,
    GATING_SQRT_SOFTPLUS,
    ModelArgs,
)
from moerun.hooks import Hooks
from moerun.layers.ffn import Activation, FeedForward
from moerun.layers.linear import Linear
from moerun.layers.ops import Kernels
from moerun.step import Step
from moerun.weights import ExpertTensor, Weights

if TYPE_CHECKING:  # Triton's, which only CUDA builds of torch bring
    from moerun.kernels.act_i8 import QAct
from torch import nn


class Router(nn.Module):
    """Chooses K experts per token and their gate weights, following llama.cpp's build_moe_ffn.

    gating: softmax, sigmoid or sqrt(softplus) over the router logits, or (gpt-oss) softmax over the chosen logits
    only; then the chosen weights are renormalised to sum 1 if args.expert_weights_norm, and scaled by expert_weights_scale.
    `selection_bias` (exp_probs_b) shifts only the choice, not the weights. With expert groups, each group scores
    the sum of its two best experts and only the best `n_group_used` groups compete.
    """

    def __init__(
        self, gate: Linear, args: ModelArgs, kernels: Kernels, selection_bias: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        self.gate = gate
        self.k, self.gating, self.normalize = args.n_experts_used, args.gating, args.expert_weights_norm
        self.scale = args.expert_weights_scale
        self.n_groups, self.n_group_used = args.n_expert_groups, args.n_group_used
        self.register_buffer("selection_bias", selection_bias, persistent=False)
        self.kernels = kernels
        plain = (  # the fused kernel knows softmax, sigmoid and softmax-weight scores
            self.kernels.route is not None
            and selection_bias is None
            and self.n_groups <= 1
            and self.gating != GATING_SQRT_SOFTPLUS
        )
        self.choose = self.choose_plain if plain else self.choose_general

    @classmethod
    def load(cls, args: ModelArgs, w: Weights, hooks: Hooks, layer: int, kernels: Kernels) -> Router:
        """ffn_gate_inp (+ bias) in float32, where near-ties decide routing; exp_probs_b if the model has one (a file
        without it is refused where the architecture requires it)."""
        p = f"blk.{layer}"
        read_bias = w.dense if args.selection_bias_required else w.optional
        gate = Linear.load(w, f"{p}.ffn_gate_inp", hooks, torch.float32)
        return cls(gate, args, kernels, selection_bias=read_bias(f"{p}.exp_probs_b.bias", torch.float32))

    def forward(self, x: torch.Tensor, step: Step | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, D) -> expert ids (T, K) int64, weights (T, K) float32. (`step`: for routers that read the positions,
        such as a routing replay's.)"""
        return self.choose(self.gate(x).float())

    def choose_plain(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """No selection bias, no groups: the fused kernel."""
        return self.kernels.route(logits, self.k, self.gating, self.normalize, self.scale)

    def choose_general(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The torch reference, for every gating: logits (T, E) -> ids (T, K), weights (T, K)."""
        probs = GATING_PROBS[self.gating](logits)
        scores = probs if self.selection_bias is None else probs + self.selection_bias
        if self.n_groups > 1:
            scores = self._mask_groups(scores)
        ids = torch.topk(scores, self.k, dim=-1).indices  # (T, K)
        return ids, self.weigh(probs, ids)

    def weigh(self, probs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The chosen experts' gate weights (T, K) from the scores (T, E)."""
        weights = probs.gather(-1, ids)
        if self.gating == GATING_SOFTMAX_WEIGHT:
            weights = torch.softmax(weights, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(-1, keepdim=True).clamp(min=6.103515625e-5)
        if self.scale not in (0.0, 1.0):
            weights = weights * self.scale
        return weights

    def _mask_groups(self, scores: torch.Tensor) -> torch.Tensor:
        T, E = scores.shape
        grouped = scores.view(T, self.n_groups, E // self.n_groups)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # (T, n_groups)
        keep = group_scores.topk(self.n_group_used, dim=-1).indices
        mask = torch.ones_like(group_scores, dtype=torch.bool).scatter_(-1, keep, False)
        return grouped.masked_fill(mask[..., None], float("-inf")).view(T, E)


class HashRouter(Router):
    """DeepSeek-V4's first layers: the experts come from the token id (ffn_gate_tid2eid, a (V, K) table), the
    weights from the router's scores at them, renormalised and scaled as the Router's. Reads step.tokens."""

    def __init__(self, gate: Linear, args: ModelArgs, kernels: Kernels, table: torch.Tensor) -> None:
        super().__init__(gate, args, kernels)
        self.register_buffer("table", table.long(), persistent=False)  # (V, K)

    @classmethod
    def load(cls, args: ModelArgs, w: Weights, hooks: Hooks, layer: int, kernels: Kernels) -> HashRouter:
        name = f"blk.{layer}.ffn_gate_tid2eid.weight"
        info = w.info(name)
        table = torch.from_numpy(w.gguf.raw(info).view(np.int32).reshape(info.shape).astype(np.int64))
        return cls(Linear.load(w, f"blk.{layer}.ffn_gate_inp", hooks, torch.float32), args, kernels, table.to(w.device))

    def forward(self, x: torch.Tensor, step: Step | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        assert step is not None and step.tokens is not None, "a hash router reads the step's token ids"
        ids = self.table[step.tokens.to(self.table.device)]  # (T, K)
        return ids, self.weigh(GATING_PROBS[self.gating](self.gate(x).float()), ids)


GATING_PROBS: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {
    GATING_SOFTMAX: lambda logits: torch.softmax(logits, dim=-1),
    GATING_SIGMOID: torch.sigmoid,
    GATING_SOFTMAX_WEIGHT: lambda logits: logits,
    GATING_SQRT_SOFTPLUS: lambda logits: torch.sqrt(F.softplus(logits)),
}


class ExpertCompute(Protocol):
    """The routed experts' work: sum_k weights[t, k] * expert_{ids[t, k]}(x[t]). The expert cache replaces this.
    `step` is the step being computed (the expert cache reads its capture, if any)."""

    def __call__(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        step: Step | None = None,
        i8: QAct | None = None,
    ) -> torch.Tensor:
        """x (T, D), ids (T, K), weights (T, K) -> (T, D) float32; i8: x's int8 rounding where its norm made one
        (for the GPU's gate and up products; the others ignore it)."""
        ...


# Experts dequantized per call in prefill: bounds the transient memory (32 Qwen3-30B experts in bfloat16: 300 MB per
# tensor) while cutting the dequantization launches 32-fold.
EXPERTS_PER_DEQUANT = 32


class GGUFExperts(nn.Module):
    """Reference ExpertCompute: dequantizes each selected expert from the GGUF bytes and runs its rows."""

    def __init__(
        self,
        gate: ExpertTensor,
        up: ExpertTensor,
        down: ExpertTensor,
        activation: Activation,
        kernels: Kernels,
        hooks: Hooks,
        biases: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None] = (None, None, None),
    ) -> None:
        super().__init__()
        self.gate, self.up, self.down = gate, up, down
        self.activation, self.act = activation, activation.on(kernels)
        self.gate_bias, self.up_bias, self.down_bias = biases  # (E, I), (E, I), (E, D) or None
        self.hooks = hooks

    @classmethod
    def load(cls, w: Weights, hooks: Hooks, layer: int, activation: Activation, kernels: Kernels) -> GGUFExperts:
        return cls(*w.experts(layer), activation, kernels, hooks, w.expert_biases(layer))

    def forward(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        step: Step | None = None,
        i8: QAct | None = None,
    ) -> torch.Tensor:
        if x.shape[0] == 1 and not self.hooks.activation:
            return self._forward_one_token(x, ids[0], weights[0])
        per_slot = torch.zeros(*ids.shape, x.shape[1], dtype=torch.float32, device=x.device)  # (T, K, D)
        for group in torch.unique(ids).split(EXPERTS_PER_DEQUANT):  # dequantize a group of experts in one call
            gate, up, down = (t.experts(group) for t in (self.gate, self.up, self.down))  # (G, out, in) each
            for i, e in enumerate(group.tolist()):  # the host sync routing needs
                rows, slots = torch.nonzero(ids == e, as_tuple=True)  # tokens routed to e, and in which K slots
                xe = x[rows]  # (n, D)
                if self.hooks.activation:  # once per stored tensor: a fused gate/up's input counts once, as in
                    self.hooks.fire_activation(self.gate.name, xe, e)  # llama.cpp's imatrix
                    if self.up.name != self.gate.name:
                        self.hooks.fire_activation(self.up.name, xe, e)
                h = self.act(
                    self._matmul(self.gate, gate[i], xe, e, self.gate_bias),
                    self._matmul(self.up, up[i], xe, e, self.up_bias),
                )
                if self.hooks.activation:
                    self.hooks.fire_activation(self.down.name, h, e)
                y = self._matmul(self.down, down[i], h, e, self.down_bias)  # (n, D)
                per_slot[rows, slots] = y * weights[rows, slots, None]
        return per_slot.sum(dim=1)

    def _forward_one_token(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Decode: the K chosen experts of one token, each tensor dequantized once for all K, no host sync.
        x (1, D), ids (K,), weights (K,) -> (1, D)."""
        h = self.act(self._matmul_k(self.gate, x, ids, self.gate_bias), self._matmul_k(self.up, x, ids, self.up_bias))
        y = self._matmul_k(self.down, h, ids, self.down_bias)  # (K, D)
        return (y * weights[:, None]).sum(dim=0, keepdim=True)

    @staticmethod
    def _matmul_k(t: ExpertTensor, x: torch.Tensor, ids: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x (1, in) or (K, in) through experts ids (K,) -> (K, out)."""
        w = t.experts(ids)  # (K, out, in)
        if t.round_input is not None:
            x = t.round_input(x)
        y = torch.matmul(w, x.to(w.dtype).expand(len(ids), -1)[:, :, None])[:, :, 0].float()
        return y if bias is None else y + bias[ids]

    @staticmethod
    def _matmul(t: ExpertTensor, w: torch.Tensor, x: torch.Tensor, e: int, bias: torch.Tensor | None) -> torch.Tensor:
        """x (n, in) through expert e's dequantized weight w (out, in) of tensor t -> (n, out)."""
        if t.round_input is not None:
            x = t.round_input(x)
        y = F.linear(x.to(w.dtype), w).float()
        return y if bias is None else y + bias[e]


class MoE(nn.Module):
    """Router + routed experts (+ shared experts, optionally scaled by a sigmoid gate as in qwen2moe)."""

    def __init__(
        self,
        layer: int,
        router: Router,
        experts: ExpertCompute,
        hooks: Hooks,
        shared: FeedForward | None = None,
        shared_gate: Linear | None = None,
    ) -> None:
        super().__init__()
        self.layer, self.router, self.experts, self.hooks = layer, router, experts, hooks
        self.shared, self.shared_gate = shared, shared_gate

    def forward(self, x: torch.Tensor, step: Step, i8: QAct | None = None) -> torch.Tensor:
        """x (T, D), and its int8 rounding where its norm made one (for the experts' and shared expert's gate and up)
        -> (T, D)."""
        ids, weights = self.route(x, step)  # (T, K)
        out = self.experts(x, ids, weights, step, i8)
        if self.shared is not None:
            shared = self.shared(x, step, i8)
            if self.shared_gate is not None:
                shared = shared * torch.sigmoid(self.shared_gate(x, i8))
            out = out + shared
        return out

    def route(self, x: torch.Tensor, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        """The router's choice for x (T, D), reported to the routing hooks: ids (T, K), weights (T, K). A block
        that routes from another input than the experts' (SmallThinker's) calls it and the experts apart."""
        ids, weights = self.router(x, step)
        if self.hooks.routing:
            self.hooks.fire_routing(self.layer, step.positions, ids, weights)
        return ids, weights


class LatentMoE(MoE):
    """A MoE whose routed experts run in a narrower latent space (Kimi-K3): the router and the shared experts read
    x (T, D); the experts read down(x) (T, L), and their weighted sum, RMS-normed by `latent_norm` where there is one,
    goes back through up (L -> D)."""

    def __init__(
        self,
        layer: int,
        router: Router,
        experts: ExpertCompute,
        hooks: Hooks,
        down: Linear,
        up: Linear,
        latent_norm: nn.Module | None = None,
        shared: FeedForward | None = None,
    ) -> None:
        super().__init__(layer, router, experts, hooks, shared=shared)
        self.down, self.up, self.latent_norm = down, up, latent_norm

    def forward(self, x: torch.Tensor, step: Step, i8: QAct | None = None) -> torch.Tensor:
        """x (T, D), and its int8 rounding where its norm made one (for down and the shared expert) -> (T, D)."""
        ids, weights = self.route(x, step)
        out = self.experts(self.down(x, i8), ids, weights, step)  # (T, L)
        if self.latent_norm is not None:
            out = self.latent_norm(out)
        out = self.up(out)
        return out if self.shared is None else out + self.shared(x, step, i8)
