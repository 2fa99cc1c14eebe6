"""The bench model for training: qwen3moe exactly as llama.cpp computes it, written for speed at this small size.

llama.cpp's qwen3moe graph (src/models/qwen3moe.cpp): x = embed(tokens); per layer, RMSNorm -> Q, K, V projections
-> per-head RMSNorm of Q and K -> NeoX RoPE -> causal attention scaled 1/sqrt(head_dim) -> output projection ->
residual; RMSNorm -> router softmax over all experts (float32) -> top-K -> weights renormalised to sum 1 -> SwiGLU
experts (down(silu(gate x) * up x)) weighted and summed -> residual; final RMSNorm; logits through the tied
embedding (no output.weight in the GGUF: llama.cpp then reuses token_embd).

Experts are computed densely: every expert on every token, multiplied by a weight that is zero outside the top-K.
The result and every gradient equal the sparse computation's, and at E*I = 4096 this is two large matmuls per
layer, much faster on a GPU than gathering tokens per expert.

Shapes: B batch, S sequence, T = B*S tokens, D hidden, H heads, G kv heads, Hd head_dim, E experts, K top-k,
I expert hidden, V vocab. export.py maps parameter names to GGUF tensor names.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int = 8192
    dim: int = 256
    n_layers: int = 6
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 64
    n_experts: int = 32
    n_experts_used: int = 4
    expert_dim: int = 128
    context: int = 512
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6

    def to_dict(self) -> dict:
        return asdict(self)


CONFIGS = {
    "bench": ModelArgs(),
    "tiny": ModelArgs(
        vocab_size=8192,
        dim=64,
        n_layers=2,
        n_heads=2,
        n_kv_heads=1,
        head_dim=32,
        n_experts=8,
        n_experts_used=2,
        expert_dim=32,
        context=64,
    ),
}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)


def rope_tables(args: ModelArgs, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [S, Hd/2] for NeoX rotation (pairs i and i + Hd/2), as ggml's rope with mode NEOX."""
    inv = args.rope_theta ** (-torch.arange(0, args.head_dim, 2, device=device, dtype=torch.float32) / args.head_dim)
    angles = torch.arange(args.context, device=device, dtype=torch.float32)[:, None] * inv[None, :]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, S, H, Hd] -> rotated, NeoX layout (first half, second half)."""
    S = x.shape[1]
    c, s = cos[:S, None, :], sin[:S, None, :]  # [S, 1, Hd/2]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        D, H, G, Hd = args.dim, args.n_heads, args.n_kv_heads, args.head_dim
        self.wq = nn.Parameter(torch.empty(H * Hd, D))
        self.wk = nn.Parameter(torch.empty(G * Hd, D))
        self.wv = nn.Parameter(torch.empty(G * Hd, D))
        self.wo = nn.Parameter(torch.empty(D, H * Hd))
        self.q_norm = nn.Parameter(torch.ones(Hd))
        self.k_norm = nn.Parameter(torch.ones(Hd))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        a = self.args
        B, S, _ = x.shape
        q = (x @ self.wq.T).view(B, S, a.n_heads, a.head_dim)  # [B, S, H, Hd]
        k = (x @ self.wk.T).view(B, S, a.n_kv_heads, a.head_dim)  # [B, S, G, Hd]
        v = (x @ self.wv.T).view(B, S, a.n_kv_heads, a.head_dim)
        q = apply_rope(rms_norm(q, self.q_norm, a.norm_eps), cos, sin)
        k = apply_rope(rms_norm(k, self.k_norm, a.norm_eps), cos, sin)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            scale=1.0 / math.sqrt(a.head_dim),
            enable_gqa=True,
        )  # [B, H, S, Hd]
        return o.transpose(1, 2).reshape(B, S, a.n_heads * a.head_dim) @ self.wo.T


@dataclass
class Routing:
    """One layer's routing of a batch: ids [T, K], the router's full probabilities [T, E]."""

    ids: torch.Tensor
    probs: torch.Tensor

    def balance_loss(self, n_experts: int) -> torch.Tensor:
        """Switch/GShard auxiliary loss E * sum_e f_e * P_e: 1.0 when balanced, up to E when collapsed."""
        T, K = self.ids.shape
        f = torch.bincount(self.ids.flatten(), minlength=n_experts).float() / (T * K)  # [E] share of selections
        return n_experts * (f * self.probs.mean(0)).sum()


class MoE(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        E, I, D = args.n_experts, args.expert_dim, args.dim
        self.router = nn.Parameter(torch.empty(E, D))  # ffn_gate_inp
        self.gate = nn.Parameter(torch.empty(E, I, D))  # ffn_gate_exps
        self.up = nn.Parameter(torch.empty(E, I, D))  # ffn_up_exps
        self.down = nn.Parameter(torch.empty(E, D, I))  # ffn_down_exps

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, Routing]:
        """x [T, D] -> dense weights [T, E] (zero outside the top-K, renormalised), routing."""
        with torch.autocast(x.device.type, enabled=False):  # the router runs in float32, as in llama.cpp
            probs = torch.softmax(x.float() @ self.router.float().T, dim=-1)  # [T, E]
        top_p, ids = probs.topk(self.args.n_experts_used, dim=-1)  # [T, K]
        top_p = top_p / top_p.sum(-1, keepdim=True)
        dense = torch.zeros_like(probs).scatter(1, ids, top_p)  # [T, E]
        return dense, Routing(ids, probs)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Routing]:
        B, S, D = x.shape
        E, I = self.args.n_experts, self.args.expert_dim
        xt = x.reshape(B * S, D)
        w, routing = self.route(xt)
        g = xt @ self.gate.reshape(E * I, D).T  # [T, E*I]
        u = xt @ self.up.reshape(E * I, D).T  # [T, E*I]
        h = (F.silu(g) * u).view(-1, E, I) * w.to(x.dtype)[:, :, None]  # [T, E, I]
        y = h.reshape(-1, E * I) @ self.down.permute(0, 2, 1).reshape(E * I, D)  # [T, D]
        return y.view(B, S, D), routing


class Block(nn.Module):
    def __init__(self, args: ModelArgs, dropout: float) -> None:
        super().__init__()
        self.args = args
        self.dropout = dropout  # on each residual branch, in training only
        self.attn_norm = nn.Parameter(torch.ones(args.dim))
        self.attn = Attention(args)
        self.ffn_norm = nn.Parameter(torch.ones(args.dim))
        self.moe = MoE(args)

    def forward(self, x, cos, sin):
        p = self.dropout if self.training else 0.0
        x = x + F.dropout(self.attn(rms_norm(x, self.attn_norm, self.args.norm_eps), cos, sin), p)
        y, routing = self.moe(rms_norm(x, self.ffn_norm, self.args.norm_eps))
        return x + F.dropout(y, p), routing


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs, dropout: float = 0.0) -> None:
        super().__init__()
        self.args = args
        self.embed = nn.Parameter(torch.empty(args.vocab_size, args.dim))  # token_embd, tied output
        self.layers = nn.ModuleList(Block(args, dropout) for _ in range(args.n_layers))
        self.output_norm = nn.Parameter(torch.ones(args.dim))
        cos, sin = rope_tables(args, torch.device("cpu"))
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def init_weights(self, seed: int) -> None:
        """Normal(0, 0.02); projections into the residual stream scaled by 1/sqrt(2 L) (GPT-2)."""
        g = torch.Generator().manual_seed(seed)
        out_std = 0.02 / math.sqrt(2 * self.args.n_layers)
        for name, p in self.named_parameters():
            if p.ndim == 1:
                continue
            std = out_std if name.endswith(("wo", "down")) else 0.02
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g) * std)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, list[Routing]]:
        """tokens [B, S] -> logits [B, S, V], one Routing per layer."""
        x = F.embedding(tokens, self.embed)
        routings = []
        for layer in self.layers:
            x, r = layer(x, self.rope_cos, self.rope_sin)
            routings.append(r)
        x = rms_norm(x, self.output_norm, self.args.norm_eps)
        return x @ self.embed.T, routings
