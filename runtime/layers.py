"""The shared layers every architecture file builds on: linear, norm, RoPE, attention, router, experts, blocks.

Letters in shape comments: T tokens in the step, S KV cache slots read (at most n_ctx), D hidden size, H query heads,
G KV heads, Dh head size, E experts, K experts per token, I expert hidden size, V vocabulary.

The residual stream is float32; each matmul runs in the weights' compute dtype (float32 on CPU, bfloat16 on CUDA)
after rounding its input as llama.cpp does for the stored weight type (rounding.py); norms, softmaxes, RoPE and the
router run in float32, as in llama.cpp.

Norms, RoPE, attention, the router's top-k and the SwiGLU product run as torch ops (the float32 reference) or as
fused kernels: Triton's of kernels/fused.py where the weights are on a GPU, and on the CPU numba's of
kernels/cpu_fused.py for Q/K norm, RoPE and the router's choice. Each layer takes its `Kernels` from
`kernels_for(device)` once, at load.
"""

from __future__ import annotations

import itertools
import os
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Protocol

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import nn

from moerun.cache.kv import KVCache
from moerun.config import (
    GATING_SIGMOID,
    GATING_SOFTMAX,
    GATING_SOFTMAX_WEIGHT,
    ModelArgs,
)
from moerun.hooks import Hooks
from moerun.kernels.dequant import dequantize
from moerun.kernels.dequant import supports as dequantizes
from moerun.kernels.tuning import GEMV_MAX_TOKENS
from moerun.rounding import Rounding, input_rounding
from moerun.step import Step
from moerun.weights import ExpertTensor, Weights, device_bytes


class Linear(nn.Module):
    """y = x W^T (+ b) for the GGUF tensor `name`; reports its input to activation hooks, then rounds it as
    llama.cpp does for the stored weight type (see rounding.py)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, name: str, hooks: Hooks,
                 round_input: Rounding | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # (out, in)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.name, self.hooks, self.round_input = name, hooks, round_input

    @classmethod
    def load(cls, w: Weights, prefix: str, hooks: Hooks, dtype: torch.dtype | None = None,
             shape: tuple[int, ...] | None = None) -> Linear:
        """`prefix.weight` (reshaped to `shape` if given) and, if the file has it, `prefix.bias`."""
        name = f"{prefix}.weight"
        bias = w.optional(f"{prefix}.bias", torch.float32)
        blocks = w.blocks(name) if dtype is None and shape is None else None
        if blocks is not None:  # the GPU multiplies the GGUF blocks directly
            from moerun.quantized import QuantLinear  # needs Triton, which CUDA builds of torch bring

            return QuantLinear(blocks, bias, name, hooks)
        info = w.info(name)
        if w.device.type == "cpu" and dtype is None and shape is None and len(info.shape) == 2:
            from moerun.kernels.cpu_experts import CPUQuantLinear  # imports this module

            if CPUQuantLinear.can_run(info.ggml_type):  # decode steps multiply the GGUF blocks
                return CPUQuantLinear.load(w, prefix, hooks, bias)
        weight = w.dense(name, dtype)
        return cls(weight if shape is None else weight.reshape(shape), bias, name, hooks,
                   input_rounding(info.ggml_type))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.hooks.activation:
            self.hooks.fire_activation(self.name, x)
        return self.product(x)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T (+ b), the input rounded as llama.cpp rounds it, without reporting x to the hooks (a second use
        of a matrix already reported)."""
        if self.round_input is not None:
            x = self.round_input(x)
        x = x.to(self.weight.dtype)
        rows = x.shape[0]
        float32_rows = x.is_cuda and x.dtype == torch.float32 and x.dim() == 2  # a router on a GPU
        if float32_rows and 0 < rows <= GEMV_MAX_TOKENS and x.shape[1] % 32 == 0 and self.weight.is_contiguous():
            # the router of a decode step, on the matrix-vector kernel over its float32 values: the 30B shape's
            # (128 x 2048) took 2.4 / 4.3 us at 1 / 8 rows there against cuBLAS's 4.5 / 7.6 (a GEMM and its split-K
            # reduce past one row), and a decode step of 2-7 sequences 0.25-0.3 ms less (H200, docs/BENCHMARKS.md)
            from moerun.kernels.gguf_matmul import QWeight, gguf_mv  # needs Triton, which CUDA builds of torch bring

            n, k = self.weight.shape
            y = gguf_mv(x, QWeight(self.weight.view(torch.uint8).view(n, 4 * k), GGMLQuantizationType.F32, n, k))
        elif float32_rows and rows > 1 and rows % 8:
            # cuBLAS (torch 2.11, H200) ran 7 rows of the 30B model's float32 router on a kernel ten times slower
            # than the one it takes for 6 or 8 (52 us against 5 a layer: 2.5 ms of a decode step of 7 sequences,
            # docs/BENCHMARKS.md); rows padded to a multiple of 8 take the fast one.
            y = F.linear(F.pad(x, (0, 0, 0, -rows % 8)), self.weight)[:rows]
        else:
            y = F.linear(x, self.weight)
        y = y.float()
        return y if self.bias is None else y + self.bias


class Embedding(nn.Module):
    """The token embedding, kept as its GGUF rows on the device (on the CPU, the memory map itself): a step
    dequantizes only its tokens' rows (kernels/dequant.py, bit-identical to gguf-py). As a float32 table it took 4
    bytes a value wherever it lived: 1.2 GB for a 152k-token vocabulary of 2048, on a GPU VRAM the expert cache could
    have used. A type the device dequantizer does not read (IQ4_XS) is kept as that float32 table."""

    def __init__(self, w: Weights, name: str) -> None:
        super().__init__()
        info = w.info(name)
        self.n_vocab, self.dim = info.shape
        self.qtype = info.ggml_type if dequantizes(info.ggml_type) else None
        rows = (device_bytes(w.gguf.raw(info).reshape(self.n_vocab, -1), w.device) if self.qtype is not None
                else w.dense(name, torch.float32))
        self.register_buffer("rows", rows, persistent=False)  # (V, row bytes) uint8, or (V, D) float32

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (T,) -> (T, D) float32."""
        rows = self.rows[tokens]
        return rows if self.qtype is None else dequantize(rows, self.qtype, self.dim)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream plus a layer's output, and its norm: (x + delta, rms_norm(x + delta))."""
    h = x + delta
    return h, rms_norm(h, weight, eps)


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.float(), requires_grad=False)
        self.eps = eps
        self.kernels = kernels_for(weight.device)

    @classmethod
    def load(cls, w: Weights, name: str, eps: float) -> RMSNorm:
        return cls(w.dense(name, torch.float32), eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, its norm): x, delta (T, D) float32; (x, its norm) where delta is None."""
        if delta is None:
            return x, self.forward(x)
        return self.kernels.add_rms_norm(x, delta, self.weight, self.eps)


# ---------------------------------------------------------------------------------------------------------- RoPE


def yarn_attn_factor(args: ModelArgs, mscale: float = 1.0) -> float:
    """The magnitude factor llama.cpp hands its rope op (its context's yarn_attn_factor).

    With YaRN the rope op itself multiplies by 1 + 0.1 ln(factor), so that part is divided out here; `mscale` is
    the model's own mscale when it has a yarn_log_multiplier (deepseek2 passes its log multiplier).
    """
    attn = 1.0
    if args.rope_scaling == "yarn":
        factor = 1.0 / args.rope_freq_scale

        def get_mscale(scale: float, m: float) -> float:
            return 1.0 if scale <= 1.0 else 0.1 * m * math.log(scale) + 1.0

        attn = get_mscale(factor, mscale) / get_mscale(factor, args.yarn_log_mul) if args.yarn_log_mul else get_mscale(factor, 1.0)
        attn /= 1.0 + 0.1 * math.log(factor)
    return attn * args.rope_attn_factor


class Rope(nn.Module):
    """Rotary embedding of the first `dim` channels of each head, from cos/sin tables over all n_ctx positions.

    style "normal" rotates adjacent pairs (x0, x1), (x2, x3)...; "neox" rotates (x_i, x_{i + dim/2}).
    Linear scaling divides positions by the factor; YaRN blends interpolated and original frequencies per
    channel pair (ramp between the beta_fast/beta_slow correction dims) and scales the magnitude.
    """

    def __init__(self, args: ModelArgs, n_ctx: int, device: torch.device, *, base: float | None = None,
                 dim: int | None = None, attn_factor: float | None = None,
                 freq_factors: torch.Tensor | None = None) -> None:
        super().__init__()
        dim = dim or args.rope_dim
        base = base or args.rope_base
        self.dim, self.style = dim, args.rope_style
        freq_scale = args.rope_freq_scale
        mscale = yarn_attn_factor(args) if attn_factor is None else attn_factor
        inv_freq = base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)  # (dim/2,)
        if freq_factors is not None:  # llama3-style per-channel-pair divisors (rope_freqs.weight)
            inv_freq = inv_freq / freq_factors.double().cpu()
        if args.rope_scaling == "yarn":
            low, high = _yarn_corr_dims(dim, args.rope_orig_ctx, base, args.yarn_beta_fast, args.yarn_beta_slow)
            y = (torch.arange(dim // 2, dtype=torch.float64) - low) / max(0.001, high - low)
            extrapolate = 1 - y.clamp(0, 1)  # 1: keep the original frequency, 0: interpolate
            inv_freq = inv_freq * (freq_scale * (1 - extrapolate) + extrapolate)
            mscale *= 1.0 + 0.1 * math.log(1.0 / freq_scale)
        else:
            inv_freq = inv_freq * freq_scale
        angles = torch.arange(n_ctx, dtype=torch.float64)[:, None] * inv_freq[None, :]  # (S, dim/2)
        self.register_buffer("cos", (angles.cos() * mscale).float().to(device), persistent=False)
        self.register_buffer("sin", (angles.sin() * mscale).float().to(device), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x (T, heads, Dh) -> same shape, float32."""
        x = x.float()
        d = self.dim
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]  # (T, 1, d/2)
        rot, rest = x[..., :d], x[..., d:]
        if self.style == "neox":
            x1, x2 = rot[..., : d // 2], rot[..., d // 2 :]
            rot = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            rot = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
        return torch.cat([rot, rest], dim=-1)


def _yarn_corr_dims(dim: int, orig_ctx: int, base: float, beta_fast: float, beta_slow: float) -> tuple[float, float]:
    """The channel-pair range over which YaRN ramps from extrapolation to interpolation."""

    def corr_dim(n_rot: float) -> float:
        return dim * math.log(orig_ctx / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    return max(0.0, math.floor(corr_dim(beta_fast))), min(dim - 1.0, math.ceil(corr_dim(beta_slow)))


# ----------------------------------------------------------------------------------------------------- attention


# Float32 attention scores (all query heads) `attend` holds at once: a long prompt attends in blocks of query tokens,
# as its rows are independent. At once, a 4096-token prompt of 32 heads held 2 GiB of scores and twice that again in
# their masked and softmaxed copies; a 32k-token one, 128 GiB.
ATTEND_SCORE_BYTES = 256 << 20


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float,
           sinks: torch.Tensor | None = None, seqs: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention of q (T, H, Dk) over one sequence's k (S, G, Dk), v (S, G, Dv), or, given `seqs` (B,), over
    every sequence's k (n_seq, S, G, Dk), v (n_seq, S, G, Dv) when the tokens are B blocks of T/B consecutive rows,
    block b reading sequence seqs[b] (Step.blocks: B = T in a decode batch, one token per sequence; B prompt chunks in
    a captured prompt step); query head h reads KV head h // (H/G). `allowed` (T, S) masks each token's slots.

    `sinks` (H,) are per-head logits that join each softmax's denominator without a value (gpt-oss).
    Returns (T, H, Dv) float32.
    """
    if seqs is not None:  # each block's sequence
        k, v = k[seqs], v[seqs]
    T, H, Dk = q.shape
    G, Dv = v.shape[-2:]
    rows = max(1, ATTEND_SCORE_BYTES // (4 * H * k.shape[-3]))
    if k.dim() == 3 and T > rows:  # one sequence's long prompt: blocks of query tokens
        return torch.cat([attend(q[i : i + rows], k, v, allowed[i : i + rows], scale, sinks)
                          for i in range(0, T, rows)])
    if k.dim() == 3:  # one sequence: one block
        k, v = k[None], v[None]
    B, S = k.shape[:2]
    Tb, HG = T // B, H // G
    # The H/G query heads of a KV head are rows of one product with that head's keys: a broadcast matmul would copy
    # the keys and values out for every query head (on the CPU, a third of a small model's decode step). Row
    # h * Tb + t of a block's (KV head) product is its token t's query head h.
    qg = q.float().reshape(B, Tb, G, HG, Dk).permute(0, 2, 3, 1, 4).reshape(B, G, HG * Tb, Dk)
    kt, vt = k.float().permute(0, 2, 3, 1), v.float().permute(0, 2, 1, 3)  # (B, G, Dk, S), (B, G, S, Dv)
    mask = ~allowed.reshape(B, 1, 1, Tb, S).expand(B, 1, HG, Tb, S).reshape(B, 1, HG * Tb, S)
    scores = (torch.matmul(qg, kt) * scale).masked_fill(mask, float("-inf"))  # (B, G, HG * Tb, S)
    if sinks is not None:
        sink = sinks.float().reshape(1, G, HG, 1, 1).expand(1, G, HG, Tb, 1).reshape(1, G, HG * Tb, 1)
        probs = torch.softmax(torch.cat([scores, sink.expand(*scores.shape[:-1], 1)], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, vt)  # (B, G, HG * Tb, Dv)
    return out.reshape(B, G, HG, Tb, Dv).permute(0, 3, 1, 2, 4).reshape(T, H, Dv)


class Attention(nn.Module):
    """Grouped-query attention with optional per-head Q/K RMSNorm, QKV biases, sinks and a sliding window."""

    def __init__(self, *, wq: Linear, wk: Linear, wv: Linear, wo: Linear, rope: Rope, cache: KVCache,
                 n_heads: int, n_kv_heads: int, head_dim: int, v_head_dim: int, scale: float,
                 q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None, window: int = 0,
                 sinks: torch.Tensor | None = None) -> None:
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = wq, wk, wv, wo
        self.q_norm, self.k_norm = q_norm, k_norm
        self.rope, self.cache = rope, cache
        self.n_heads, self.n_kv_heads, self.head_dim, self.v_head_dim = n_heads, n_kv_heads, head_dim, v_head_dim
        self.scale, self.window = scale, window
        self.register_buffer("sinks", sinks, persistent=False)
        self.kernels = kernels_for(cache.k.device)
        self.wqkv = self.kernels.stack_rows([wq, wk, wv])  # q, k and v in one product where the kernels can
        self.qkv_rows = (n_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * v_head_dim)

    @classmethod
    def load(cls, args: ModelArgs, w: Weights, hooks: Hooks, layer: int, rope: Rope, cache: KVCache,
             scale: float | None = None) -> Attention:
        """The standard llama.cpp layout: attn_q/k/v/output (+ biases), optional attn_q_norm/k_norm, attn_sinks."""
        p = f"blk.{layer}"
        q_norm = RMSNorm.load(w, f"{p}.attn_q_norm.weight", args.norm_eps) if f"{p}.attn_q_norm.weight" in w else None
        k_norm = RMSNorm.load(w, f"{p}.attn_k_norm.weight", args.norm_eps) if f"{p}.attn_k_norm.weight" in w else None
        return cls(
            wq=Linear.load(w, f"{p}.attn_q", hooks), wk=Linear.load(w, f"{p}.attn_k", hooks),
            wv=Linear.load(w, f"{p}.attn_v", hooks), wo=Linear.load(w, f"{p}.attn_output", hooks),
            rope=rope, cache=cache, n_heads=args.n_heads, n_kv_heads=args.n_kv_heads, head_dim=args.head_dim,
            v_head_dim=args.v_head_dim, scale=scale or args.attn_scale or 1.0 / math.sqrt(args.head_dim),
            q_norm=q_norm, k_norm=k_norm, window=args.sliding_window if args.swa_layers[layer] else 0,
            sinks=w.optional(f"{p}.attn_sinks.weight", torch.float32),
        )

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.project(x)
        q = q.view(T, self.n_heads, self.head_dim)
        k = k.view(T, self.n_kv_heads, self.head_dim)
        v = v.view(T, self.n_kv_heads, self.v_head_dim)
        # k_all, v_all: (S, G, Dh), or (n_seq, S, G, Dh) that the step's blocks index
        q, k_all, v_all = self.kernels.norm_rope_store(q, k, v, self.q_norm, self.k_norm, self.rope, step, self.cache)
        out = self.kernels.attend(q, k_all, v_all, step.mask(self.window), self.scale, self.sinks,
                                  step.blocks)  # (T, H, Dv)
        return self.wo(out.reshape(T, self.n_heads * self.v_head_dim))

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (T, D) -> q (T, H*Dh), k (T, G*Dh), v (T, G*Dv): one stacked product, or three where the weights
        differ in type or activation hooks must see each tensor's input under its own name."""
        if self.wqkv is None or self.wqkv.hooks.activation:
            return self.wq(x), self.wk(x), self.wv(x)
        return self.wqkv(x).split(self.qkv_rows, dim=-1)


def norm_rope(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm: RMSNorm | None, k_norm: RMSNorm | None,
              rope: Rope, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q/K RMSNorm (per head, or over the whole projection as in olmoe: as long as its weight), then RoPE.
    q (T, H, Dh), k (T, G, Dh), v (T, G, Dv) -> q, k float32 and v as it came."""
    T = q.shape[0]
    if q_norm is not None:
        q = q_norm(q.reshape(T, -1, q_norm.weight.numel())).view_as(q)
    if k_norm is not None:
        k = k_norm(k.reshape(T, -1, k_norm.weight.numel())).view_as(k)
    return rope(q, positions), rope(k, positions), v


def qk_norms_per_head(q: torch.Tensor, q_norm: RMSNorm | None, k_norm: RMSNorm | None) -> bool | None:
    """What the fused kernels take of norm_rope's Q/K norms: True, one weight per head for q and k; False, none;
    None, anything else (olmoe's over the whole projection), which only the torch reference does."""
    if q_norm is None and k_norm is None:
        return False
    if (q_norm is not None and k_norm is not None
            and q_norm.weight.numel() == k_norm.weight.numel() == q.shape[-1]):
        return True
    return None


def norm_rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm: RMSNorm | None,
                    k_norm: RMSNorm | None, rope: Rope, step: Step, cache: KVCache,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """norm_rope, then k and v into the KV cache: -> q (T, H, Dh) float32 and the slots attention reads
    (KVCache.update)."""
    q, k, v = norm_rope(q, k, v, q_norm, k_norm, rope, step.positions)
    return q, *cache.update(step, k, v)


# ------------------------------------------------------------------------------------------------ feed-forward


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """gpt-oss: the gate is capped at `limit`, up clamped to +-limit, and up gets +1."""
    gate = gate.clamp(max=limit)
    return gate * torch.sigmoid(alpha * gate) * (up.clamp(-limit, limit) + 1)


# Expert activation functions by name; an arch file picks one.
def swiglu_clamp(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """glm5-next's clamped SwiGLU (llama.cpp's swiglu_clamp): the gate capped at `limit` before SiLU, up clamped to
    +-limit. Not in ACTIVATIONS: its limit is per block (the model binds it with functools.partial)."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


ACTIVATIONS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "swiglu": swiglu,
    "swiglu_oai": swiglu_oai,
}


class FeedForward(nn.Module):
    """Dense gated FFN: down(act(gate(x)) * up(x)); leading dense layers and shared experts."""

    def __init__(self, gate: Linear, up: Linear, down: Linear) -> None:
        super().__init__()
        self.gate, self.up, self.down = gate, up, down
        self.act = kernels_for(device_of(gate)).activations["swiglu"]

    @classmethod
    def load(cls, w: Weights, hooks: Hooks, layer: int, suffix: str = "") -> FeedForward:
        p = f"blk.{layer}"
        return cls(*(Linear.load(w, f"{p}.ffn_{part}{suffix}", hooks) for part in ("gate", "up", "down")))

    def forward(self, x: torch.Tensor, step: Step | None = None) -> torch.Tensor:
        return self.down(self.act(self.gate(x), self.up(x)))


class Router(nn.Module):
    """Chooses K experts per token and their gate weights, following llama.cpp's build_moe_ffn.

    gating: softmax or sigmoid over the router logits, or (gpt-oss) softmax over the chosen logits only; then
    the chosen weights are renormalised to sum 1 if args.expert_weights_norm, and scaled by expert_weights_scale.
    `selection_bias` (exp_probs_b) shifts only the choice, not the weights. With expert groups, each group scores
    the sum of its two best experts and only the best `n_group_used` groups compete.
    """

    def __init__(self, gate: Linear, args: ModelArgs, selection_bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.gate = gate
        self.k, self.gating, self.normalize = args.n_experts_used, args.gating, args.expert_weights_norm
        self.scale = args.expert_weights_scale
        self.n_groups, self.n_group_used = args.n_expert_groups, args.n_group_used
        self.register_buffer("selection_bias", selection_bias, persistent=False)
        self.kernels = kernels_for(device_of(gate))
        plain = self.kernels.route is not None and selection_bias is None and self.n_groups <= 1
        self.choose = self.choose_plain if plain else self.choose_general

    @classmethod
    def load(cls, args: ModelArgs, w: Weights, hooks: Hooks, layer: int) -> Router:
        """ffn_gate_inp (+ bias) in float32, where near-ties decide routing; exp_probs_b if the model has one."""
        p = f"blk.{layer}"
        return cls(Linear.load(w, f"{p}.ffn_gate_inp", hooks, torch.float32), args,
                   selection_bias=w.optional(f"{p}.exp_probs_b.bias", torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, D) -> expert ids (T, K) int64, weights (T, K) float32."""
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
        weights = probs.gather(-1, ids)
        if self.gating == GATING_SOFTMAX_WEIGHT:
            weights = torch.softmax(weights, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(-1, keepdim=True).clamp(min=6.103515625e-5)
        if self.scale not in (0.0, 1.0):
            weights = weights * self.scale
        return ids, weights

    def _mask_groups(self, scores: torch.Tensor) -> torch.Tensor:
        T, E = scores.shape
        grouped = scores.view(T, self.n_groups, E // self.n_groups)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # (T, n_groups)
        keep = group_scores.topk(self.n_group_used, dim=-1).indices
        mask = torch.ones_like(group_scores, dtype=torch.bool).scatter_(-1, keep, False)
        return grouped.masked_fill(mask[..., None], float("-inf")).view(T, E)


GATING_PROBS: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {
    GATING_SOFTMAX: lambda logits: torch.softmax(logits, dim=-1),
    GATING_SIGMOID: torch.sigmoid,
    GATING_SOFTMAX_WEIGHT: lambda logits: logits,
}


class ExpertCompute(Protocol):
    """The routed experts' work: sum_k weights[t, k] * expert_{ids[t, k]}(x[t]). The expert cache replaces this."""

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x (T, D), ids (T, K), weights (T, K) -> (T, D) float32."""
        ...


# Experts dequantized per call in prefill: bounds the transient memory (32 Qwen3-30B experts in bfloat16: 300 MB per
# tensor) while cutting the dequantization launches 32-fold.
EXPERTS_PER_DEQUANT = 32


class GGUFExperts(nn.Module):
    """Reference ExpertCompute: dequantizes each selected expert from the GGUF bytes and runs its rows."""

    def __init__(self, gate: ExpertTensor, up: ExpertTensor, down: ExpertTensor, activation: str, hooks: Hooks,
                 biases: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None] = (None, None, None)) -> None:
        super().__init__()
        self.gate, self.up, self.down = gate, up, down
        self.act = kernels_for(gate.device).activations[activation]
        self.gate_bias, self.up_bias, self.down_bias = biases  # (E, I), (E, I), (E, D) or None
        self.hooks = hooks

    @classmethod
    def load(cls, w: Weights, hooks: Hooks, layer: int, activation: str = "swiglu") -> GGUFExperts:
        p = f"blk.{layer}"
        parts = ("gate", "up", "down")
        return cls(*(w.experts(f"{p}.ffn_{part}_exps.weight") for part in parts), activation, hooks,
                   tuple(w.optional(f"{p}.ffn_{part}_exps.bias", torch.float32) for part in parts))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1 and not self.hooks.activation:
            return self._forward_one_token(x, ids[0], weights[0])
        per_slot = torch.zeros(*ids.shape, x.shape[1], dtype=torch.float32, device=x.device)  # (T, K, D)
        for group in torch.unique(ids).split(EXPERTS_PER_DEQUANT):  # dequantize a group of experts in one call
            gate, up, down = (t.experts(group) for t in (self.gate, self.up, self.down))  # (G, out, in) each
            for i, e in enumerate(group.tolist()):  # the host sync routing needs
                rows, slots = torch.nonzero(ids == e, as_tuple=True)  # tokens routed to e, and in which K slots
                xe = x[rows]  # (n, D)
                if self.hooks.activation:
                    self.hooks.fire_activation(self.gate.name, xe, e)
                    self.hooks.fire_activation(self.up.name, xe, e)
                h = self.act(self._matmul(self.gate, gate[i], xe, e, self.gate_bias),
                             self._matmul(self.up, up[i], xe, e, self.up_bias))
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

    def __init__(self, layer: int, router: Router, experts: ExpertCompute, hooks: Hooks,
                 shared: FeedForward | None = None, shared_gate: Linear | None = None) -> None:
        super().__init__()
        self.layer, self.router, self.experts, self.hooks = layer, router, experts, hooks
        self.shared, self.shared_gate = shared, shared_gate

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        ids, weights = self.router(x)  # (T, K)
        if self.hooks.routing:
            self.hooks.fire_routing(self.layer, step.positions, ids, weights)
        out = self.experts(x, ids, weights)
        if self.shared is not None:
            shared = self.shared(x)
            if self.shared_gate is not None:
                shared = shared * torch.sigmoid(self.shared_gate(x))
            out = out + shared
        return out


class Block(nn.Module):
    """Pre-norm decoder block: h = x + attn(norm(x)); out = h + ffn(norm(h)).

    The block hands on (h, ffn(norm(h))) and leaves the sum to whoever reads it next (the next block's attn_norm, or
    the final norm), whose fused add_rms_norm does it in the same kernel: one launch fewer per layer of a decode step.
    """

    def __init__(self, attn_norm: RMSNorm, attn: nn.Module, ffn_norm: RMSNorm, ffn: nn.Module) -> None:
        super().__init__()
        self.attn_norm, self.attn, self.ffn_norm, self.ffn = attn_norm, attn, ffn_norm, ffn

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream is x + delta (x alone where delta is None) -> (h, delta') whose sum is the output."""
        x, normed = self.attn_norm.add_forward(x, delta)
        h, normed = self.ffn_norm.add_forward(x, self.attn(normed, step))
        return h, self.ffn(normed, step)


# ------------------------------------------------------------------------------------------------------ kernels


@dataclass(frozen=True)
class Kernels:
    """The elementwise and normalization work of the layers, as torch ops or as fused Triton kernels.

    `route` chooses experts for the plain gatings (no selection bias, no expert groups; None: the Router's torch
    code); `activations` are the expert activations by name (ACTIVATIONS' keys); `stack_rows` makes one Linear of
    several that share their input (None: they run apart).
    """

    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    add_rms_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]
    norm_rope_store: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    attend: Callable[..., torch.Tensor]
    route: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None
    activations: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]
    stack_rows: Callable[[list[Linear]], Linear | None]


# The float32 reference, which the fused kernels (GPU and CPU) are tested against.
TORCH_KERNELS = Kernels(rms_norm, add_rms_norm, norm_rope_store, attend, None, ACTIVATIONS, lambda linears: None)


def kernels_for(device: torch.device) -> Kernels:
    """Fused Triton kernels on a GPU, numba's where they beat torch's on the CPU; torch ops with MOERUN_FUSED=0 (to
    measure what the fusion buys) and on other devices."""
    if os.environ.get("MOERUN_FUSED") == "0":
        return TORCH_KERNELS
    return {"cuda": fused_kernels, "cpu": cpu_kernels}.get(device.type, lambda: TORCH_KERNELS)()


def device_of(module: nn.Module) -> torch.device:
    """Where a module's weights are: its parameters, or its buffers (QuantLinear's GGUF blocks); the CPU for a module
    with neither (CPUQuantLinear on the memory-mapped bytes alone)."""
    first = next(itertools.chain(module.parameters(), module.buffers()), None)
    return torch.device("cpu") if first is None else first.device


@cache
def cpu_kernels() -> Kernels:
    from moerun.kernels import cpu_fused

    return Kernels(rms_norm, add_rms_norm, cpu_fused.norm_rope_store, attend, cpu_fused.route, ACTIVATIONS,
                   lambda linears: None)


@cache
def fused_kernels() -> Kernels:
    from moerun.kernels import fused  # Triton comes with CUDA builds of torch
    from moerun.quantized import QuantLinear

    def fused_norm_rope_store(q, k, v, q_norm, k_norm, rope, step, cache):
        """One launch where the Q/K norms are per head (or absent), else the torch reference. k and v go straight
        into the cache rows (slot = position, cache/kv.py) of the step's one sequence, or of each token's in a step
        across sequences; a captured prompt step (its sequences per block of tokens) hands them to KVCache.update."""
        per_head = qk_norms_per_head(q, q_norm, k_norm)
        if per_head is None:
            return norm_rope_store(q, k, v, q_norm, k_norm, rope, step, cache)
        n = step.n_slots
        if step.in_place:
            slots = (cache.k[step.seq], cache.v[step.seq], None)
        elif step.seqs is not None:  # a token each: every sequence's rows, written at (seqs[t], positions[t])
            slots = (cache.k, cache.v, step.seqs)
        else:
            slots = (None, None, None)
        q, k, v = fused.qkv_rope(q, k, v, q_norm.weight if per_head else None, k_norm.weight if per_head else None,
                                 q_norm.eps if per_head else 0.0, rope.cos, rope.sin, step.positions,
                                 rope.style == "neox", cache.k.dtype, *slots)
        if step.in_place:
            return q, k[:n], v[:n]
        if step.seqs is not None:
            return q, k[:, :n], v[:, :n]
        return q, *cache.update(step, k, v)

    def fused_attend(q, k, v, allowed, scale, sinks=None, seqs=None):
        """Decode-sized steps (of one sequence, or one token of each of several) in the split kernel; prefill and
        prompts mixed with decode tokens in torch."""
        if fused.attend_supports(q, k, v, seqs):
            return fused.attend_decode(q, k, v, allowed, scale, sinks, seqs)
        return attend(q, k, v, allowed, scale, sinks, seqs)

    return Kernels(fused.rms_norm, fused.add_rms_norm, fused_norm_rope_store, fused_attend, fused.route,
                   {**ACTIVATIONS, "swiglu": fused.swiglu}, QuantLinear.stack_rows)
