"""What every architecture shares: the build context handed to its block builder, and the decoder stack.

An arch module (named after its GGUF general.architecture) provides
    read_args(g: GGUFModel) -> ModelArgs
    build_block(ctx: BuildContext, layer: int) -> Block
and the `Transformer` here wraps its blocks with the token embedding, the final norm and the output head.
On several devices each block is built by `ctx.on(its device)` and the Transformer moves the hidden state between
them (devices.py); block builders never see more than one device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from moeprep.errors import MoeprepError
from moerun.backend import Backend, backend_for
from moerun.cache.controller import ExpertCache
from moerun.cache.experts import CachedExperts
from moerun.config import ModelArgs
from moerun.devices import DeviceMap, on_device
from moerun.hooks import Hooks
from moerun.kv_cache import KVCache
from moerun.layers import (
    SWIGLU,
    Activation,
    Attention,
    Block,
    Embedding,
    FeedForward,
    Linear,
    MoE,
    OutputGate,
    RMSNorm,
    Rope,
    Router,
)
from moerun.layers.softcap import SoftCappedHead
from moerun.options import RuntimeOptions, process_options
from moerun.step import Step
from moerun.weights import FUSED_GATE_UP, Weights

if TYPE_CHECKING:  # Triton's, which only CUDA builds of torch bring
    from moerun.kernels.act_i8 import QAct


@dataclass
class BuildContext:
    args: ModelArgs
    weights: Weights
    hooks: Hooks
    n_ctx: int  # S: KV cache slots per sequence and RoPE table length
    n_seq: int = 1  # sequences the KV cache holds side by side
    cache: ExpertCache | None = None  # routed experts through the expert cache instead of all on the device
    options: RuntimeOptions = field(default_factory=process_options)
    shared: dict = field(default_factory=dict)  # what the blocks of the model being built share, by key (the same
    # dict on every device's context; glm5-next's DSA selections)
    _ropes: dict = field(default_factory=dict)
    _contexts: dict = field(default_factory=dict)  # device -> the context building there, shared by all of them

    def on(self, device: torch.device) -> BuildContext:
        """This context building on `device`: weights, KV caches and RoPE tables land there (one set of tables per
        device, shared by its layers)."""
        self._contexts.setdefault(self.weights.device, self)
        if device not in self._contexts:
            w = self.weights
            self._contexts[device] = replace(
                self, weights=Weights(w.gguf, w.dtype, device), _ropes={}, _contexts=self._contexts
            )
        return self._contexts[device]

    @property
    def backend(self) -> Backend:
        """The implementations of this context's device (backend.py)."""
        return backend_for(self.weights.device, self.options)

    def linear(self, prefix: str, dtype: torch.dtype | None = None, shape: tuple[int, ...] | None = None) -> Linear:
        """GGUF tensor `prefix`.weight (+ its bias) as the backend's Linear (see Backend.linear)."""
        return self.backend.linear(self.weights, prefix, self.hooks, dtype, shape)

    def require(self, *names: str) -> None:
        """Refuse a file without any of `names` in one line naming it: tensors the shared loaders read where present
        (biases, sinks) that the architecture's llama.cpp loader requires."""
        for name in names:
            self.weights.info(name)

    def present(self, name: str, *companions: str) -> bool:
        """Whether the file has `name`, the tensor whose presence gives a layer an optional part; a file with any of
        the part's `companions` but not `name` is refused in one line naming it (llama.cpp's loader refuses a file
        with tensors it leaves unread) instead of running the layer without the part."""
        if name in self.weights:
            return True
        if any(companion in self.weights for companion in companions):
            self.weights.info(name)  # refuses
        return False

    def norm(self, name: str) -> RMSNorm:
        """The RMSNorm of GGUF tensor `name` with the model's epsilon."""
        return RMSNorm.load(self.weights, name, self.args.norm_eps, self.backend.kernels)

    def feed_forward(self, layer: int, suffix: str = "", activation: Activation = SWIGLU) -> FeedForward:
        """The dense FFN ffn_{gate,up,down}`suffix` of `layer`."""
        p = f"blk.{layer}"
        return FeedForward(
            *(self.linear(f"{p}.ffn_{part}{suffix}") for part in ("gate", "up", "down")),
            self.backend.kernels,
            activation,
        )

    def router(self, layer: int) -> Router:
        return Router.load(self.args, self.weights, self.hooks, layer, self.backend.kernels)

    def rope(self, *, freq_factors: str | None = None, **options) -> Rope:
        """A RoPE table, shared by all layers that ask with the same options (see Rope for them);
        `freq_factors` names the tensor of per-channel-pair frequency divisors, if the model has one."""
        key = (freq_factors, *sorted(options.items()))
        if key not in self._ropes:
            factors = self.weights.dense(freq_factors, torch.float32) if freq_factors else None
            self._ropes[key] = Rope(self.args, self.n_ctx, self.weights.device, freq_factors=factors, **options)
        return self._ropes[key]

    def kv_cache(self, n_kv_heads: int, k_dim: int, v_dim: int) -> KVCache:
        return KVCache(self.n_ctx, n_kv_heads, k_dim, v_dim, self.weights.dtype, self.weights.device, self.n_seq)

    def attention(
        self,
        layer: int,
        rope: Rope | None = None,
        scale: float | None = None,
        gate: OutputGate | None = None,
    ) -> Attention:
        """The standard attention of `layer` in llama.cpp's layout: attn_q/k/v (or one attn_qkv)/output (+ biases),
        attn_q_norm/k_norm (per head or over the whole projection) where the file has them, or always where
        args.qk_norms_required (a file without them is then refused in one line, as the arch's llama.cpp loader
        refuses it), optional attn_sinks, the layer's own query and KV head counts, a sliding window on the layers
        that have one, and the arch's output `gate` if it has one."""
        a, w, p = self.args, self.weights, f"blk.{layer}"
        n_heads, n_kv_heads = a.heads_by_layer[layer], a.kv_heads_by_layer[layer]
        cache = self.kv_cache(n_kv_heads, a.head_dim, a.v_head_dim)
        q_norm, k_norm = (
            self.norm(name) if a.qk_norms_required or name in w else None
            for name in (f"{p}.attn_q_norm.weight", f"{p}.attn_k_norm.weight")
        )
        if f"{p}.attn_qkv.weight" in w:
            projections = {"wqkv": self.linear(f"{p}.attn_qkv")}
        else:
            projections = {f"w{x}": self.linear(f"{p}.attn_{x}") for x in "qkv"}
        return Attention(
            **projections,
            wo=self.linear(f"{p}.attn_output"),
            rope=rope or self.rope(),
            cache=cache,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=a.head_dim,
            v_head_dim=a.v_head_dim,
            scale=scale or a.attn_scale or 1.0 / math.sqrt(a.head_dim),
            q_norm=q_norm,
            k_norm=k_norm,
            window=a.sliding_window if a.swa_layers[layer] else 0,
            sinks=w.optional(f"{p}.attn_sinks.weight", torch.float32),
            gate=gate,
            kernels=self.backend.kernels,
        )

    def output_gate(self, layer: int, function: str) -> OutputGate:
        """function(attn_gate x) on `layer`'s attention output, one value per head or per channel as the tensor's rows
        say; any other row count is refused in one line."""
        name, a = f"blk.{layer}.attn_gate", self.args
        n_heads = a.heads_by_layer[layer]
        rows = self.weights.info(f"{name}.weight").shape[0]
        if rows not in (n_heads, n_heads * a.v_head_dim):
            raise MoeprepError(
                f"{self.weights.gguf.path}: {name}.weight has {rows} rows; {a.arch}'s gate has one per head "
                f"({n_heads}) or one per channel ({n_heads * a.v_head_dim})"
            )
        return OutputGate(self.linear(name), function, per_head=rows == n_heads)

    def experts(self, layer: int, activation: Activation = SWIGLU) -> nn.Module:
        """The routed experts of `layer`: through the expert cache where there is one, else the backend's."""
        if activation.reads_gate:  # stored alone or fused with up; only ungated experts may have neither
            gate, fused = (f"blk.{layer}.{part}.weight" for part in ("ffn_gate_exps", FUSED_GATE_UP))
            if fused not in self.weights:
                self.weights.info(gate)  # refuses a file without it in one line
        if self.cache is not None:
            return CachedExperts.for_layer(
                self.weights.gguf, layer, self.cache, self.hooks, activation, self.backend.kernels
            )
        return self.backend.experts(self.weights, self.hooks, layer, activation)

    def routed_experts(self, layer: int, activation: Activation = SWIGLU, shared: bool = False, **moe_options) -> MoE:
        """The MoE block of `layer`: router, routed experts and, with `shared`, the *_shexp shared expert."""
        if shared:
            moe_options["shared"] = self.feed_forward(layer, "_shexp")
        return MoE(layer, self.router(layer), self.experts(layer, activation), self.hooks, **moe_options)

    def ffn(self, layer: int, **moe_options) -> nn.Module:
        """A dense FFN for the leading dense layers, else routed experts with the shared expert."""
        if layer < self.args.n_dense_lead:
            return self.feed_forward(layer)
        return self.routed_experts(layer, shared=True, **moe_options)

    def block(self, layer: int, attn: nn.Module, ffn: nn.Module, ffn_norm: str = "ffn_norm") -> Block:
        """Pre-norm residual block: attn_norm -> attn, then `ffn_norm` -> ffn."""
        return Block(self.norm(f"blk.{layer}.attn_norm.weight"), attn, self.norm(f"blk.{layer}.{ffn_norm}.weight"), ffn)


class ByGroups(nn.Module):
    """A block's attention, run on a mixed step group by group (Step.parts), so that a prompt chunk riding with
    other sequences' decode tokens reads its sequence's slots as they lie instead of a copy of them per token."""

    def __init__(self, attn: nn.Module) -> None:
        super().__init__()
        self.attn = attn

    def forward(self, x: torch.Tensor, step: Step, i8: QAct | None = None) -> torch.Tensor:
        """`i8`: x's int8 rounding where its norm made one (a Block's; the attention of glm5-next's blocks, whose norms
        make none, takes no such argument), for a step run whole (a group's rows round their own)."""
        if not step.groups:
            return self.attn(x, step) if i8 is None else self.attn(x, step, i8)
        return torch.cat([self.attn(x[rows], part) for rows, part in step.parts()])


class Transformer(nn.Module):
    """Token embedding (times args.embed_scale) -> blocks -> final RMSNorm (args.final_norm: output_norm, or LFM2's
    token_embd_norm) -> output head (token_embd when
    output.weight is absent and the architecture allows it; soft-capped where args.logit_softcap says).

    `layout` says which device runs each block (all on ctx's device without one): the embedding sits with the first
    block, the norm and head with the last, and the hidden state and the step move at each change of device."""

    def __init__(self, ctx: BuildContext, blocks: list[nn.Module], layout: DeviceMap | None = None) -> None:
        super().__init__()
        self.layout = layout or DeviceMap((ctx.weights.device,), (0,) * len(blocks))
        self.runs = self.layout.runs()  # [(device, slice of blocks)]
        w = ctx.on(self.layout.first).weights
        self.embed = Embedding(w, "token_embd.weight", ctx.args.embed_scale)
        for block in blocks:
            if block.attn is not None:  # (a block of one FFN part has none: nemotron_h_moe)
                block.attn = ByGroups(block.attn)
        self.blocks = nn.ModuleList(blocks)
        last = ctx.on(self.layout.last)
        self.norm = last.norm(ctx.args.final_norm)
        tied = not ctx.args.output_required and "output.weight" not in last.weights
        head = last.linear("token_embd" if tied else "output")
        self.output = SoftCappedHead(head, ctx.args.logit_softcap) if ctx.args.logit_softcap else head
        if ctx.args.logit_scale:  # the head is linear: dividing the final norm's weight divides the logits
            self.norm.weight.div_(ctx.args.logit_scale)

    def forward(self, tokens: torch.Tensor, step: Step, outputs: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (T,) at step.positions -> logits (T, V) float32, or (R, V) for the rows `outputs` (R,) only: the
        final norm and the output head, the largest matmul of a prompt chunk, run only where logits are wanted."""
        x, delta = self.embed(tokens), None  # the residual stream is x + delta (T, D): see Block
        step.tokens = tokens  # for routers that read the token ids (before the step is copied to another device)
        capture = step.capture if self.layout.spans_devices else None
        for device, run in self.runs:
            if delta is not None:  # a boundary between runs: the stream crosses as one tensor
                x, delta = x + delta, None
            if capture is not None and x.device != device:  # a captured step: the copies are host work between graphs
                x, *moved = capture.cross([x, *step.tensors().values()], device)
                on = step.on(device, dict(zip(step.tensors(), moved)))
            else:
                x, on = x.to(device, non_blocking=True), step.on(device)  # no copies while the device stays
            with on_device(device):
                for block in self.blocks[run]:
                    x, delta = block(x, delta, on)
        if outputs is not None:
            rows = outputs.to(x.device)
            x, delta = x[rows], None if delta is None else delta[rows]  # (R, D)
        with on_device(x.device):  # the head's kernels launch where it lives (the last block's device)
            _, normed, i8 = self.norm.add_forward_i8(x, delta)
            return self.output(normed, i8)
