"""Rotary position embedding: cos/sin tables over all positions (linear and YaRN scaling), applied per head."""

from __future__ import annotations

import math

import torch
from torch import nn

from moerun.config import ModelArgs


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

        attn = (
            get_mscale(factor, mscale) / get_mscale(factor, args.yarn_log_mul)
            if args.yarn_log_mul
            else get_mscale(factor, 1.0)
        )
        attn /= 1.0 + 0.1 * math.log(factor)
    return attn * args.rope_attn_factor


class Rope(nn.Module):
    """Rotary embedding of the first `dim` channels of each head, from cos/sin tables over all n_ctx positions.

    style "normal" rotates adjacent pairs (x0, x1), (x2, x3)...; "neox" rotates (x_i, x_{i + dim/2}).
    Linear scaling divides positions by the factor; YaRN blends interpolated and original frequencies per
    channel pair (ramp between the beta_fast/beta_slow correction dims) and scales the magnitude.

    `rotate` False gives a NoPE layer's table: cos 1 and sin 0 at every position, no magnitude scale, so the layer
    passes through every kernel that takes a RoPE table with its q and k unchanged. `scaled` False gives plain RoPE
    whatever the model's context scaling: positions as they are, no YaRN blend, no magnitude scale (laguna's
    sliding-window layers).
    """

    def __init__(
        self,
        args: ModelArgs,
        n_ctx: int,
        device: torch.device,
        *,
        base: float | None = None,
        dim: int | None = None,
        attn_factor: float | None = None,
        freq_factors: torch.Tensor | None = None,
        rotate: bool = True,
        scaled: bool = True,
    ) -> None:
        super().__init__()
        dim = dim or args.rope_dim
        base = base or args.rope_base
        self.dim, self.style = dim, args.rope_style
        freq_scale = args.rope_freq_scale if scaled else 1.0
        mscale = (yarn_attn_factor(args) if scaled else 1.0) if attn_factor is None else attn_factor
        inv_freq = base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)  # (dim/2,)
        if freq_factors is not None:  # llama3-style per-channel-pair divisors (rope_freqs.weight)
            # the first dim/2 of them: step35's one tensor serves layers that rotate fewer channels than others
            inv_freq = inv_freq / freq_factors.double().cpu()[: dim // 2]
        if scaled and args.rope_scaling == "yarn":
            low, high = _yarn_corr_dims(dim, args.rope_orig_ctx, base, args.yarn_beta_fast, args.yarn_beta_slow)
            y = (torch.arange(dim // 2, dtype=torch.float64) - low) / max(0.001, high - low)
            extrapolate = 1 - y.clamp(0, 1)  # 1: keep the original frequency, 0: interpolate
            inv_freq = inv_freq * (freq_scale * (1 - extrapolate) + extrapolate)
            mscale *= 1.0 + 0.1 * math.log(1.0 / freq_scale)
        else:
            inv_freq = inv_freq * freq_scale
        if not rotate:
            inv_freq, mscale = torch.zeros_like(inv_freq), 1.0
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
