"""Layers that compute straight from GGUF blocks on the GPU (kernels/gguf_matmul.py): the GPU twins of the reference
layers, which the backend (backend.py) picks where the kernels decode a tensor's type.

`QuantLinear` replaces a Linear whose weight type the kernels decode, `DeviceExperts` the reference expert path:
the selected experts' blocks are decoded in registers, so VRAM holds the weights at their GGUF size (a Q4_K matrix
takes a quarter of its bfloat16 copy) and each decode step reads every weight byte once. Imported only where the
device is CUDA (Triton comes with CUDA builds of torch). Where VRAM is left over (no expert cache wants it), a
QuantLinear may also keep its weight decoded to bfloat16 (`keep_decoded`, `keep_decoded_copies`) for products of
several tokens.

Inputs are rounded as llama.cpp's GPU products round theirs, not as its CPU does: on the matrix-vector kernel's
8-bit route (decode steps, the types with an 8-bit decoder) to int8 per 32 values with a scale each
(act_i8.quantize_i8, or in the norm or attention kernel that wrote them); its float route multiplies the float32
activations, the prefill GEMM bfloat16 ones. Agreement with llama.cpp is checked closely on the CPU path, which rounds
as its CPU does; on the GPU path within the tolerance accepted between moerun's CPU and GPU paths, and by
bench/bench_route_agreement.py (perplexity and top-1 on the trained bench model).
"""

from __future__ import annotations

import dataclasses

import torch
from gguf import GGMLQuantizationType as Q

from moerun.hooks import Hooks
from moerun.kernels import fused, tuning
from moerun.kernels.act_i8 import QAct
from moerun.kernels.dequant import supports as device_dequantizes
from moerun.kernels.gguf_matmul import (
    QWeight,
    bf16_mm,
    decode_bf16,
    gguf_mm,
    gguf_moe,
    gguf_moe_glu,
    glu_supports,
    moe_rounding,
    supports,
)
from moerun.kernels.tuning import INT8_ON, Int8Routes
from moerun.layers.ffn import Activation
from moerun.layers.linear import Linear
from moerun.layers.moe import GGUFExperts
from moerun.step import Step
from moerun.weights import ExpertTensor, Weights, expert_rows

__all__ = ["DeviceExperts", "QuantLinear", "QWeight", "supports"]


class QuantLinear(Linear):
    """y = x W^T (+ b) with W in its GGUF blocks on the GPU, and optionally also decoded to bfloat16 (`decoded`):
    products of tuning.KEPT_DECODED_MIN_TOKENS or more tokens then run on cuBLAS over that copy. `routes`: the 8-bit
    routes its products take (the runtime's options)."""

    def __init__(
        self, qweight: QWeight, bias: torch.Tensor | None, name: str, hooks: Hooks, routes: Int8Routes = INT8_ON
    ) -> None:
        torch.nn.Module.__init__(self)
        self.qweight, self.bias, self.name, self.hooks, self.routes = qweight, bias, name, hooks, routes
        self.register_buffer("blocks", qweight.data, persistent=False)  # so .to()/memory accounting see the bytes
        self.register_buffer("decoded", None, persistent=False)
        self.parts: list[QuantLinear] = []  # the QuantLinears whose rows stack_rows stacked into this one

    def forward(self, x: torch.Tensor, i8: QAct | None = None) -> torch.Tensor:
        if self.hooks.activation:
            self.hooks.fire_activation(self.name, x)
        if self.decoded is not None and x.shape[0] >= tuning.KEPT_DECODED_MIN_TOKENS:
            y = bf16_mm(x, self.decoded)
        else:
            y = gguf_mm(x, self.qweight, i8, self.routes)
        return y if self.bias is None else y + self.bias

    @property
    def decoded_bytes(self) -> int:
        return 2 * self.qweight.rows * self.qweight.cols

    def keep_decoded(self) -> None:
        """Decode the weight to bfloat16 once and keep it; the stacked parts get their rows of it as views."""
        self.decoded = decode_bf16(self.qweight)
        start = 0
        for p in self.parts:
            p.decoded = self.decoded[start : start + p.qweight.rows]
            start += p.qweight.rows

    @classmethod
    def stack_rows(cls, parts: list[Linear]) -> QuantLinear | None:
        """One QuantLinear over the rows of `parts` stacked, for products of one input (q, k and v: one launch instead
        of three), or None unless all are QuantLinear of one type and width. Each part is re-pointed at its own rows
        of the stacked bytes, so the weights are held once and the parts still run alone (hooks see each tensor)."""
        if (
            not all(isinstance(p, QuantLinear) for p in parts)
            or len({(Q(p.qweight.qtype), p.qweight.cols) for p in parts}) != 1
        ):
            return None
        data = torch.cat([p.qweight.data for p in parts])
        start = 0
        for p in parts:
            rows = p.qweight.rows
            p.qweight = dataclasses.replace(p.qweight, data=data[start : start + rows])
            p.blocks = p.qweight.data
            start += rows
        bias = None
        if any(p.bias is not None for p in parts):
            bias = torch.cat(
                [p.bias if p.bias is not None else data.new_zeros(p.qweight.rows, dtype=torch.float32) for p in parts]
            )
        first = parts[0].qweight
        stacked = cls(
            QWeight(data, first.qtype, start, first.cols),
            bias,
            "+".join(p.name for p in parts),
            parts[0].hooks,
            parts[0].routes,
        )
        stacked.parts = list(parts)
        return stacked


def keep_decoded_copies(net: torch.nn.Module, reserve: int) -> int:
    """Give every QuantLinear of `net` a bfloat16 copy of its weight (QuantLinear.keep_decoded) if all the copies fit
    in the free memory of their GPUs with `reserve` bytes to spare on each; -> the bytes kept, 0 if they do not fit.

    Why: a dense product of a few tokens on the blocks (a decode batch of `moerun serve`) runs at about 1 TB/s of
    the weight's bytes where one token's runs at 2, while cuBLAS reads a bfloat16 copy at about 2 whatever the
    number of tokens (H200: 1.7-2.4 TB/s on the 30B model's attention shapes, so fewer microseconds from 2 tokens on
    despite twice the bytes; docs/kernels.md); and a prompt's products then skip decoding the weight each time. All
    or none, so a step's time does not depend on which layers happened to fit."""
    linears = [m for m in net.modules() if isinstance(m, QuantLinear)]
    stacked = {id(p) for m in linears for p in m.parts}
    owners = [m for m in linears if id(m) not in stacked]  # a stacked part gets a view of its stack's copy
    need: dict[torch.device, int] = {}
    for m in owners:
        need[m.qweight.data.device] = need.get(m.qweight.data.device, 0) + m.decoded_bytes
    if not owners or any(torch.cuda.mem_get_info(device)[0] < n + reserve for device, n in need.items()):
        return 0
    for m in owners:
        m.keep_decoded()
    return sum(need.values())


def expert_bank(t: ExpertTensor) -> QWeight:
    """A stacked expert tensor's device bytes as a bank whose slot e is expert e (a fused gate/up's half: a view
    whose slots lie a whole fused expert apart, QWeight.slot_bytes)."""
    return QWeight(t.device_bytes, t.info.ggml_type, t.rows, t.cols)


class DeviceExperts(GGUFExperts):
    """ExpertCompute from the GGUF bytes on the GPU: gate, up and down of all selected experts of a layer in one
    launch each, whatever the number of tokens, with no host sync (so a decode step can be captured in a graph).
    With activation hooks registered it runs the reference path, which reports each expert's inputs. `routes`: the
    8-bit routes its products take (the runtime's options)."""

    routes: Int8Routes = INT8_ON

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.banks = tuple(expert_bank(t) for t in (self.gate, self.up, self.down))

    @classmethod
    def load(
        cls, w: Weights, hooks: Hooks, layer: int, activation: Activation, kernels, routes: Int8Routes = INT8_ON
    ) -> DeviceExperts:
        experts = super().load(w, hooks, layer, activation, kernels)
        experts.routes = routes
        return experts

    @classmethod
    def can_run(cls, w: Weights, layer: int) -> bool:
        """The kernels decode all three expert types, and ExpertTensor keeps their bytes on the device (it does so
        for the types the device dequantizer reads, which its reference path for hooks needs; IQ4_XS is not one)."""
        types = [part.info.ggml_type for part in expert_rows(w.gguf, layer)]
        return all(supports(t) and device_dequantizes(t) for t in types)

    def forward(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        step: Step | None = None,
        i8: QAct | None = None,
    ) -> torch.Tensor:
        if self.hooks.activation:
            return super().forward(x, ids, weights)
        return bank_moe(
            x,
            ids,
            weights,
            self.banks,
            self.activation,
            self.act,
            (self.gate_bias, self.up_bias, self.down_bias),
            ids,
            i8,
            self.routes,
        )


def bank_moe(
    x: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    banks: tuple[QWeight, QWeight, QWeight],
    activation: Activation,
    act,
    biases: tuple,
    ids: torch.Tensor,
    i8: QAct | None = None,
    routes: Int8Routes = INT8_ON,
) -> torch.Tensor:
    """sum_k weights[t, k] * expert(x[t]) over the (t, k) whose slot is not -1; the expert's weights are slot
    slots[t, k] of each bank (gate, up, down) and its biases row ids[t, k]; `act` computes `activation`; i8: x's int8
    rounding where its norm made one; `routes`: the 8-bit routes on. x (T, D) -> (T, D) float32."""
    gate_b, up_b, down_b = (None if b is None else b[ids] for b in biases)  # (T, K, rows) each
    groups: dict = {}  # a prompt's grouping of the pairs by slot, made once for the three banks
    if activation.name == "swiglu" and gate_b is None and up_b is None and glu_supports(banks[0], banks[1]):
        h = gguf_moe_glu(x, banks[0], banks[1], slots, groups, i8, routes)  # (T, K, I): gate, up, SwiGLU: one launch
    else:
        if i8 is None:  # a prompt's gate and up on the 8-bit GEMM: one rounding for both
            i8 = moe_rounding(x, banks[0], x.shape[0], routes)
        gate, up = gguf_moe(x, banks[0], slots, groups, i8, routes), gguf_moe(x, banks[1], slots, groups, i8, routes)
        h = act(gate if gate_b is None else gate + gate_b, up if up_b is None else up + up_b)  # (T, K, I)
    y = gguf_moe(h, banks[2], slots, groups, routes=routes)  # (T, K, D)
    if down_b is not None:
        y = y + down_b
    return fused.moe_combine(y, weights, slots)
