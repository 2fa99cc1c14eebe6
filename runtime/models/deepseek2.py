"""DeepSeek-V2/V3 (and the MLA models llama.cpp runs as deepseek2): multi-head latent attention, leading dense
blocks, routed experts with shared experts, softmax or sigmoid gating with exp_probs_b and group-limited top-k.

MLA runs in its absorbed form in both GGUF layouts: the cache holds one latent row per position, c (kv_lora_rank)
plus the roped key part k_pe (rope_dim), shared by all heads; each head's non-roped query is mapped into latent
space by its attn_k_b matrix, and the attention output back out by attn_v_b. Files with the older combined
attn_kv_b tensor are split into those two at load. Extra letters: C latent rank (kv_lora_rank), R roped dims,
N non-roped query dims, Dv value head size.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from gguf import Keys
from torch import nn

from moeprep.gguf.reader import GGUFModel
from moerun.config import GATING_SOFTMAX, ModelArgs
from moerun.kernels.rounding import input_rounding
from moerun.kv_cache import KVCache
from moerun.layers import Block, Rope, attend, yarn_attn_factor
from moerun.models.base import BuildContext
from moerun.step import Step

if TYPE_CHECKING:  # Triton's, which only CUDA builds of torch bring
    from moerun.kernels.act_i8 import QAct


def read_args(g: GGUFModel) -> ModelArgs:
    args = ModelArgs.from_gguf(g, fixed={"rope_style": "normal"}, defaults={"gating": GATING_SOFTMAX})
    # The converter stores 0.1 * mscale_all_dim as the yarn log multiplier; llama.cpp divides the 0.1 back out.
    log_mul = float(g.get(Keys.Rope.SCALING_YARN_LOG_MUL.format(arch=g.arch), 0.0))
    return args.replace(
        yarn_log_mul=log_mul / 0.1,
        head_dim_mla=args.head_dim_mla or args.head_dim,
        v_head_dim_mla=args.v_head_dim_mla or args.v_head_dim,
        shared_expert_dim=args.expert_dim * args.n_shared_experts,
    )


class MLAttention(nn.Module):
    def __init__(self, ctx: BuildContext, layer: int, rope: Rope, cache: KVCache, gated: bool = False) -> None:
        """`gated`: sigmoid(attn_gate x) multiplies the attention output before attn_output, per head channel
        (Kimi-K3), x the block's normed input."""
        super().__init__()
        args, w, hooks, p = ctx.args, ctx.weights, ctx.hooks, f"blk.{layer}"
        self.n_heads, self.rank, self.rope_dim = args.n_heads, args.kv_lora_rank, args.rope_dim
        self.nope_dim, self.v_dim = args.head_dim_mla - args.rope_dim, args.v_head_dim_mla
        if args.q_lora_rank:
            self.wq_a = ctx.linear(f"{p}.attn_q_a")
            self.q_a_norm = ctx.norm(f"{p}.attn_q_a_norm.weight")
            self.wq = ctx.linear(f"{p}.attn_q_b")
        else:
            self.wq_a = self.q_a_norm = None
            self.wq = ctx.linear(f"{p}.attn_q")
        self.wkv_a = ctx.linear(f"{p}.attn_kv_a_mqa")
        self.kv_a_norm = ctx.norm(f"{p}.attn_kv_a_norm.weight")
        # llama.cpp rounds the input of each matmul for its weight type (kernels/rounding.py): with attn_kv_b that is the
        # latent it decompresses, with attn_k_b/attn_v_b the non-roped query and the attention output.
        self.round_latent = self.round_q = self.round_out = None
        if f"{p}.attn_kv_b.weight" in w:
            self.kv_b_name = f"{p}.attn_kv_b.weight"
            kv_b = w.dense(self.kv_b_name).view(self.n_heads, self.nope_dim + self.v_dim, self.rank)
            k_b, v_b = kv_b[:, : self.nope_dim].transpose(1, 2), kv_b[:, self.nope_dim :]
            self.k_b_name = self.v_b_name = None
            self.round_latent = input_rounding(w.info(self.kv_b_name).ggml_type)
        else:
            self.kv_b_name = None
            self.k_b_name, self.v_b_name = f"{p}.attn_k_b.weight", f"{p}.attn_v_b.weight"
            k_b, v_b = w.dense(self.k_b_name), w.dense(self.v_b_name)
            self.round_q = input_rounding(w.info(self.k_b_name).ggml_type)
            self.round_out = input_rounding(w.info(self.v_b_name).ggml_type)
        self.k_b = nn.Parameter(k_b.contiguous(), requires_grad=False)  # (H, C, N)
        self.v_b = nn.Parameter(v_b.contiguous(), requires_grad=False)  # (H, Dv, C)
        self.wo = ctx.linear(f"{p}.attn_output")
        self.wgate = ctx.linear(f"{p}.attn_gate") if gated else None
        self.rope, self.cache, self.hooks = rope, cache, hooks
        # llama.cpp pre-scales the softmax by YaRN's magnitude correction squared (see its deepseek2 graph).
        freq_scale = args.rope_freq_scale
        mscale = rope_attn_factor(args) * (1 + 0.1 * math.log(1 / freq_scale))
        mscale *= 1 + 0.1 * args.yarn_log_mul * math.log(1 / freq_scale)
        self.scale = mscale * mscale / math.sqrt(args.head_dim_mla)

    def forward(self, x: torch.Tensor, step: Step, i8: QAct | None = None) -> torch.Tensor:
        """x (T, D), and its int8 rounding where its norm made one (for the products that read x) -> (T, D)."""
        T, H = x.shape[0], self.n_heads
        positions = step.positions
        if self.wq_a is None:
            q = self.wq(x, i8)
        else:
            _, q_in, q_i8 = self.q_a_norm.add_forward_i8(self.wq_a(x, i8), None)  # q_i8: q_in's rounding, or None
            q = self.wq(q_in, q_i8)
        q = q.view(T, H, self.nope_dim + self.rope_dim)
        q_nope, q_pe = q[..., : self.nope_dim], self.rope(q[..., self.nope_dim :], positions)  # (T, H, N), (T, H, R)
        kv = self.wkv_a(x, i8)  # (T, C + R)
        latent = self.kv_a_norm(kv[:, : self.rank])  # (T, C)
        k_pe = self.rope(kv[:, None, self.rank :], positions)  # (T, 1, R)
        if self.hooks.activation:
            self._fire("q", q_nope, latent)
        if self.round_latent is not None:
            latent = self.round_latent(latent)
        if self.round_q is not None:
            q_nope = self.round_q(q_nope)
        q_latent = torch.einsum("thn,hcn->thc", q_nope.to(self.k_b.dtype), self.k_b).float()  # (T, H, C)
        k_all, v_all = self.cache.update(step, torch.cat([latent[:, None], k_pe], dim=-1), latent[:, None])
        out = attend(
            torch.cat([q_latent, q_pe], dim=-1), k_all, v_all, step.mask(), self.scale, seqs=step.blocks
        )  # (T, H, C)
        if self.hooks.activation:
            self._fire("v", out, None)
        if self.round_out is not None:
            out = self.round_out(out)
        out = torch.einsum("thc,hvc->thv", out.to(self.v_b.dtype), self.v_b).float().reshape(T, H * self.v_dim)
        if self.wgate is not None:
            out = out * torch.sigmoid(self.wgate(x, i8).float())
        return self.wo(out)

    def _fire(self, stage: str, x: torch.Tensor, latent: torch.Tensor | None) -> None:
        """Activation hooks for the 3-D MLA matrices, with one row per (token, head); attn_kv_b sees the latent."""
        if stage == "q" and self.kv_b_name is not None:
            self.hooks.fire_activation(self.kv_b_name, latent)
        name = self.k_b_name if stage == "q" else self.v_b_name
        if name is not None:
            self.hooks.fire_activation(name, x.reshape(-1, x.shape[-1]))


def rope_attn_factor(args: ModelArgs) -> float:
    """deepseek2's rope magnitude: llama.cpp takes the model's mscale from its yarn log multiplier."""
    return yarn_attn_factor(args, mscale=args.yarn_log_mul if args.yarn_log_mul not in (0.0, 1.0) else 1.0)


def build_block(ctx: BuildContext, layer: int) -> Block:
    args = ctx.args
    rope = ctx.rope(attn_factor=rope_attn_factor(args))
    attn = MLAttention(ctx, layer, rope, ctx.kv_cache(1, args.kv_lora_rank + args.rope_dim, args.kv_lora_rank))
    return ctx.block(layer, attn, ctx.ffn(layer))
