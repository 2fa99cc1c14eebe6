"""What every architecture shares: the build context handed to its block builder, and the decoder stack.

An arch module (named after its GGUF general.architecture) provides
    read_args(g: GGUFModel) -> ModelArgs
    build_block(ctx: BuildContext, layer: int) -> Block
and the `Transformer` here wraps its blocks with the token embedding, the final norm and the output head.
On several devices each block is built by `ctx.on(its device)` and the Transformer moves the hidden state between
them (devices.py); block builders never see more than one device.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import nn

from moerun.cache.expert_cache import CachedExperts, ExpertCache
from moerun.cache.kv import KVCache
from moerun.config import ModelArgs
from moerun.devices import DeviceMap, on_device
from moerun.graphs import active_capture
from moerun.hooks import Hooks
from moerun.kernels.cpu_experts import CPUExperts
from moerun.layers import Attention, Block, Embedding, FeedForward, GGUFExperts, Linear, MoE, RMSNorm, Rope, Router
from moerun.step import Step
from moerun.weights import Weights


@dataclass
class BuildContext:
    args: ModelArgs
    weights: Weights
    hooks: Hooks
    n_ctx: int  # S: KV cache slots per sequence and RoPE table length
    n_seq: int = 1  # sequences the KV cache holds side by side
    cache: ExpertCache | None = None  # routed experts through the expert cache instead of all on the device
    _ropes: dict = field(default_factory=dict)
    _contexts: dict = field(default_factory=dict)  # device -> the context building there, shared by all of them

    def on(self, device: torch.device) -> BuildContext:
        """This context building on `device`: weights, KV caches and RoPE tables land there (one set of tables per
        device, shared by its layers)."""
        self._contexts.setdefault(self.weights.device, self)
        if device not in self._contexts:
            w = self.weights
            self._contexts[device] = replace(self, weights=Weights(w.gguf, w.dtype, device), _ropes={},
                                             _contexts=self._contexts)
        return self._contexts[device]

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

    def attention(self, layer: int, rope: Rope | None = None, **options) -> Attention:
        """The standard attention of `layer` (GQA, with whatever biases, norms and sinks the file has)."""
        a = self.args
        cache = self.kv_cache(a.n_kv_heads, a.head_dim, a.v_head_dim)
        return Attention.load(a, self.weights, self.hooks, layer, rope or self.rope(), cache, **options)

    def routed_experts(self, layer: int, activation: str | None = None, shared: bool = False, **moe_options) -> MoE:
        """The MoE block of `layer`: router, routed experts and, with `shared`, the *_shexp shared expert."""
        w, hooks = self.weights, self.hooks
        if self.cache is not None:
            experts = CachedExperts.for_layer(w.gguf, layer, self.cache, hooks, activation or "swiglu")
        else:
            experts = self.expert_compute(layer).load(w, hooks, layer, **({"activation": activation} if activation else {}))
        if shared:
            moe_options["shared"] = FeedForward.load(w, hooks, layer, "_shexp")
        return MoE(layer, Router.load(self.args, w, hooks, layer), experts, hooks, **moe_options)

    def expert_compute(self, layer: int) -> type[GGUFExperts]:
        """The ExpertCompute for `layer` on this device: on a GPU, DeviceExperts where the kernels decode the
        experts' types; on the CPU, CPUExperts where its kernels do; otherwise the reference path."""
        if self.weights.device.type == "cpu" and CPUExperts.can_run(self.weights, layer):
            return CPUExperts
        if self.weights.device.type == "cuda":
            from moerun.quantized import DeviceExperts  # needs Triton, which CUDA builds of torch bring

            if DeviceExperts.can_run(self.weights, layer):
                return DeviceExperts
        return GGUFExperts

    def ffn(self, layer: int, **moe_options) -> nn.Module:
        """A dense FFN for the leading dense layers, else routed experts with the shared expert."""
        if layer < self.args.n_dense_lead:
            return FeedForward.load(self.weights, self.hooks, layer)
        return self.routed_experts(layer, shared=True, **moe_options)

    def block(self, layer: int, attn: nn.Module, ffn: nn.Module, ffn_norm: str = "ffn_norm") -> Block:
        """Pre-norm residual block: attn_norm -> attn, then `ffn_norm` -> ffn."""
        norm = lambda name: RMSNorm.load(self.weights, f"blk.{layer}.{name}.weight", self.args.norm_eps)  # noqa: E731
        return Block(norm("attn_norm"), attn, norm(ffn_norm), ffn)


class ByGroups(nn.Module):
    """A block's attention, run on a mixed step group by group (Step.parts), so that a prompt chunk riding with
    other sequences' decode tokens reads its sequence's slots as they lie instead of a copy of them per token."""

    def __init__(self, attn: nn.Module) -> None:
        super().__init__()
        self.attn = attn

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        if not step.groups:
            return self.attn(x, step)
        return torch.cat([self.attn(x[rows], part) for rows, part in step.parts()])


class Transformer(nn.Module):
    """Token embedding -> blocks -> final RMSNorm -> output head (token_embd when output.weight is absent).

    `layout` says which device runs each block (all on ctx's device without one): the embedding sits with the first
    block, the norm and head with the last, and the hidden state and the step move at each change of device."""

    def __init__(self, ctx: BuildContext, blocks: list[nn.Module], layout: DeviceMap | None = None) -> None:
        super().__init__()
        self.layout = layout or DeviceMap((ctx.weights.device,), (0,) * len(blocks))
        self.runs = self.layout.runs()  # [(device, slice of blocks)]
        w, args = ctx.on(self.layout.first).weights, ctx.args
        self.embed = Embedding(w, "token_embd.weight")
        for block in blocks:
            block.attn = ByGroups(block.attn)
        self.blocks = nn.ModuleList(blocks)
        w = ctx.on(self.layout.last).weights
        self.norm = RMSNorm.load(w, "output_norm.weight", args.norm_eps)
        head = "output" if "output.weight" in w else "token_embd"
        self.output = Linear.load(w, head, ctx.hooks)

    def forward(self, tokens: torch.Tensor, step: Step, outputs: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (T,) at step.positions -> logits (T, V) float32, or (R, V) for the rows `outputs` (R,) only: the
        final norm and the output head, the largest matmul of a prompt chunk, run only where logits are wanted."""
        x, delta = self.embed(tokens), None  # the residual stream is x + delta (T, D): see Block
        capture = active_capture() if self.layout.spans_devices else None
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
            return self.output(self.norm.add_forward(x, delta)[1])
