"""Which positions a comparison with llama.cpp can judge on any machine: those no near-tie decides.

Two faithful implementations do not agree to the last bit: llama.cpp's float32 sums run in the order of its SIMD
width (AVX2 here, AVX512 elsewhere), and for F16 weights both round every matmul input to F16 (2^-11 relative), so a
last-bit difference now and then moves one rounding by a whole F16 step. End to end on the F16 synthetic models that
drift reaches 3e-4 of the logits' range; layer by layer (each layer fed llama.cpp's input) about 1e-5.

Routing is a discontinuous function of that drift. Where a token's K-th and (K+1)-th experts score within the drift
of each other, the two runs may choose different experts, and that token's output then differs by a whole expert:
on an AVX512 machine, gpt-oss F16 position 214 did (relative logit error 1.1e-2 at that position, 3.1e-4 at every
other), and in our run its router logits are 2.3e-5 of their range from choosing otherwise. Such a position says
nothing about either implementation, so comparisons leave out the positions whose routing margin, in our own run,
is below TIE_BOUND at any MoE layer: the router-logit drift that would change the choice, over the range of the
token's router logits, is under 1e-3, three times the largest end-to-end drift, so no build's drift can cross it.
On the synthetic models that leaves out about 4% of the positions. The same holds for the top-1 token when the two
best logits are that close. Every other position keeps the tight bars, and a comparison must keep at least
MIN_JUDGED of its positions, so a broken model cannot hide behind ties.

Quantized weights drift far more (llama.cpp rounds activations to 8 bits), which no bound of this kind covers; their
end-to-end bars are measured agreement floors instead (tests/runtime/test_models.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import torch

import moerun
from moeprep.gguf.roles import parse_tensor_name
from moerun.config import GATING_SIGMOID, GATING_SOFTMAX, GATING_SOFTMAX_WEIGHT, GATING_SQRT_SOFTPLUS
from moerun.layers.moe import GATING_PROBS, HashRouter, Router

TIE_BOUND = 1e-3
MIN_JUDGED = 0.9


@contextmanager
def router_inputs(model: moerun.Model) -> Iterator[dict[int, torch.Tensor]]:
    """While active, collects each MoE layer's router input (T, D) of the forward passes run: layer -> input."""
    names = {m.gate.name for m in model.net.modules() if isinstance(m, Router)}
    inputs: dict[int, torch.Tensor] = {}

    def keep(ev: moerun.ActivationEvent) -> None:
        if ev.tensor_name in names:
            inputs[parse_tensor_name(ev.tensor_name).block] = ev.x.clone()

    handle = model.add_activation_hook(keep)
    try:
        yield inputs
    finally:
        handle.remove()


# d(selection score)/d(router logit) per gating: what turns a gap between two scores into the logit drift it takes
# to close it (for softmax, probabilities move with p(1 - p) times their logit; gpt-oss selects on the logits).
SCORE_SLOPES: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {
    GATING_SOFTMAX: lambda probs: probs * (1 - probs),
    GATING_SIGMOID: lambda probs: probs * (1 - probs),
    GATING_SOFTMAX_WEIGHT: torch.ones_like,
    # p = sqrt(softplus(x)): dp/dx = sigmoid(x) / 2p, and sigmoid(x) = 1 - exp(-p^2)
    GATING_SQRT_SOFTPLUS: lambda probs: -torch.expm1(-probs.square()) / (2 * probs),
}


@torch.inference_mode()
def routing_margins(model: moerun.Model, inputs: dict[int, torch.Tensor]) -> np.ndarray:
    """(MoE layers, T): how far the router logits must drift to change a token's choice, over the range of its
    logits: the gap between the K-th and (K+1)-th selection scores (and, with expert groups, between the last kept
    and the first dropped group) in logit units, as our router computes them. Hash-routed layers have none."""
    routers = {parse_tensor_name(m.gate.name).block: m for m in model.net.modules() if isinstance(m, Router)}
    margins = []
    for layer, x in sorted(inputs.items()):
        r = routers[layer]
        if isinstance(r, HashRouter):  # the token id chooses: no margin to drift across
            continue
        logits = r.gate(x).float()  # (T, E)
        probs = GATING_PROBS[r.gating](logits)
        slopes = SCORE_SLOPES[r.gating](probs).clamp(min=1e-30)
        scores = probs if r.selection_bias is None else probs + r.selection_bias
        drifts = []  # logit drift that closes each gap: the gap over the steeper of the scores that meet
        if r.n_groups > 1:
            group_scores = scores.view(len(x), r.n_groups, -1).topk(2, dim=-1).values.sum(-1)
            top = group_scores.topk(r.n_group_used + 1, dim=-1).values
            drifts.append((top[:, -2] - top[:, -1]) / (2 * slopes.max(-1).values))  # a group sums two experts
            scores = r._mask_groups(scores)
        top = scores.topk(r.k + 1, dim=-1)
        meeting = slopes.gather(-1, top.indices[:, -2:]).max(-1).values
        drifts.append((top.values[:, -2] - top.values[:, -1]) / meeting)
        spread = (logits.max(-1).values - logits.min(-1).values).clamp(min=1e-30)
        margins.append((torch.stack(drifts).min(0).values / spread).numpy())
    return np.stack(margins)


def top1_margins(logits: np.ndarray) -> np.ndarray:
    """(T,): the gap between the two best logits over the range of the logits."""
    top = np.sort(logits, axis=-1)
    return (top[:, -1] - top[:, -2]) / np.maximum(top[:, -1] - top[:, 0], 1e-30)


def judged(margins: np.ndarray) -> np.ndarray:
    """(T,) True where no margin (rows: layers or other decisions) is below TIE_BOUND."""
    return (np.atleast_2d(margins) >= TIE_BOUND).all(0)
