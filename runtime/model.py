"""load_model: a GGUF file -> a runnable Model (weights, tokenizer, KV cache, hooks); the arch is a table lookup."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from moeprep.errors import MoeprepError
from moeprep.gguf.reader import GGUFModel, open_gguf
from moerun.config import ModelArgs
from moerun.hooks import ActivationEvent, HookHandle, Hooks, RoutingEvent
from moerun.layers import Step
from moerun.models import arch_module
from moerun.models.base import BuildContext, Transformer
from moerun.tokenizer import Tokenizer
from moerun.weights import Weights

# KV cache length when the caller gives none: the trained context, capped to keep the cache small.
DEFAULT_MAX_CTX = 4096


class Model:
    """A loaded model. `forward` runs a chunk of tokens through the KV cache and returns their next-token logits."""

    def __init__(self, g: GGUFModel, args: ModelArgs, net: Transformer, tokenizer: Tokenizer, hooks: Hooks,
                 n_ctx: int, device: torch.device) -> None:
        self.gguf, self.args, self.net, self.tokenizer = g, args, net, tokenizer
        self.hooks, self.n_ctx, self.device = hooks, n_ctx, device

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start_pos: int = 0) -> torch.Tensor:
        """tokens (T,) int64 at positions start_pos.. -> logits (T, V) float32; start_pos 0 starts a new sequence."""
        T = tokens.shape[0]
        if start_pos + T > self.n_ctx:
            raise MoeprepError(f"{start_pos + T} positions do not fit the context of {self.n_ctx}; load with a larger n_ctx")
        positions = torch.arange(start_pos, start_pos + T, device=self.device)
        return self.net(tokens.to(self.device), Step(positions, n_slots=start_pos + T))

    def add_routing_hook(self, fn: Callable[[RoutingEvent], None]) -> HookHandle:
        return self.hooks.add_routing(fn)

    def add_activation_hook(self, fn: Callable[[ActivationEvent], None]) -> HookHandle:
        return self.hooks.add_activation(fn)


def load_model(path: str | Path | GGUFModel, device: str = "cpu", dtype: torch.dtype | None = None, n_ctx: int | None = None) -> Model:
    """Open a GGUF MoE model (file or first shard). dtype defaults to float32 on CPU and bfloat16 on CUDA."""
    g = path if isinstance(path, GGUFModel) else open_gguf(path)  # an opened model is not parsed again
    arch = arch_module(g.arch, g.path)  # an architecture moerun does not run is refused before any weight loads
    device_ = torch.device(device)
    if device_.type == "cuda" and not torch.cuda.is_available():
        raise MoeprepError("--device cuda: no CUDA device is available; use --device cpu")
    dtype = dtype or (torch.bfloat16 if device_.type == "cuda" else torch.float32)
    args = arch.read_args(g)
    n_ctx = n_ctx or min(args.n_ctx_train, DEFAULT_MAX_CTX)
    hooks = Hooks()
    ctx = BuildContext(args, Weights(g, dtype, device_), hooks, n_ctx)
    net = Transformer(ctx, [arch.build_block(ctx, layer) for layer in range(args.n_layers)])
    return Model(g, args, net.eval(), Tokenizer(g), hooks, n_ctx, device_)
