"""GLM-5.3-Flash (glm5-next): 4-stream hyper-connections around every block, Kimi delta attention (KDA) in most
layers and absorbed MLA without RoPE (DSA) in the others, leading dense blocks, sigmoid-routed experts with a shared
expert, clamped SwiGLU everywhere. The trailing NextN (multi-token prediction) block is not run.

Hyper-connections. The residual is 4 streams (T, 4, D); the first block copies the embedding into all four and the
last returns their mean, so the Transformer around the blocks still sees (T, D). Before the attention and before
the FFN, hc_*_fn reads the RMS-normed streams (all 4 D values) and gives per token: 4 `pre` weights that sum the
streams into the sublayer's input, 4 `post` weights for the sublayer's output in each stream, and a 4x4 stream
mixing matrix made doubly stochastic by Sinkhorn iterations: stream d out = post_d y + sum_s comb[s, d] stream s.

KDA. q, k, v each through a short causal convolution (its last kernel-1 inputs kept per sequence) and SiLU; q and
k L2-normalised per head; per head a (Hd, Hd) state S decays per key channel by exp(g), g = softplus(f_b(f_a(x))
+ dt_bias) * ssm_a (or lower_bound * sigmoid(-(...) * ssm_a) when the file sets kda.gate_lower_bound), then takes
the delta-rule write S += k beta (v - S^T k)^T; the output S^T q / sqrt(Hd) is RMS-normed per head, gated by
sigmoid(g_b(g_a(x))) and projected by attn_output. The state lives in this module, per sequence; a step whose first
position is 0 starts its sequence's state anew.

DSA. deepseek2's MLAttention with no roped part. The lightning indexer selects every cached position while there
are fewer than top_k + kpool - 1 of them (2051 in GLM-5.3-Flash), which makes DSA dense attention there; longer
steps are refused rather than computed densely. Letters: H heads, Hd KDA head size, Di = H Hd.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from moeprep.errors import MoeprepError
from moeprep.gguf.reader import GGUFModel
from moerun.config import GATING_SIGMOID, ModelArgs
from moerun.hooks import Hooks
from moerun.layers import FeedForward, GGUFExperts, Linear, MoE, RMSNorm, Router
from moerun.models.base import BuildContext
from moerun.models.deepseek2 import MLAttention, rope_attn_factor
from moerun.step import Step
from moerun.weights import Weights

L2_EPS = 1e-6  # llama.cpp's q/k L2 norm for KDA (as the reference FLA kernels)


def read_args(g: GGUFModel) -> ModelArgs:
    args = ModelArgs.from_gguf(g, fixed={"rope_style": "normal"}, defaults={"gating": GATING_SIGMOID})
    return args.replace(shared_expert_dim=args.expert_dim * args.n_shared_experts)


@dataclass(frozen=True)
class Glm5NextArgs:
    """The keys ModelArgs does not hold, read once per model."""

    dsa_layers: tuple[bool, ...]  # head_count_kv 1 (DSA) or 0 (KDA), per block
    n_streams: int
    sinkhorn_iterations: int
    hc_eps: float
    kda_head_dim: int
    conv_kernel: int
    gate_lower_bound: float | None
    clamp_exp: tuple[float, ...]  # SwiGLU limit per block, routed experts
    clamp_shexp: tuple[float, ...]  # shared expert and dense FFN
    dense_limit: int  # positions below which the indexer selects everything

    @classmethod
    def from_gguf(cls, g: GGUFModel) -> Glm5NextArgs:
        key = lambda name: f"{g.arch}.{name}"  # noqa: E731
        n_blocks = int(g.get(key("block_count")))

        def per_block(name: str, default: float) -> tuple[float, ...]:
            value = g.get(key(name), default)
            return tuple(float(v) for v in value) if isinstance(value, list) else (float(value),) * n_blocks

        def need(name: str) -> object:
            value = g.get(key(name))
            if value is None:
                raise MoeprepError(f"{g.path}: metadata key {key(name)} is missing; is this a complete glm5-next GGUF?")
            return value

        clamp_exp = per_block("swiglu_clamp_exp", 0.0)
        lower_bound = g.get(key("kda.gate_lower_bound"))
        return cls(
            dsa_layers=tuple(bool(n) for n in need("attention.head_count_kv")),
            n_streams=int(need("hyper_connection.count")),
            sinkhorn_iterations=int(need("hyper_connection.sinkhorn_iterations")),
            hc_eps=float(need("hyper_connection.epsilon")),
            kda_head_dim=int(need("kda.head_dim")),
            conv_kernel=int(need("ssm.conv_kernel")),
            gate_lower_bound=None if lower_bound is None or math.isinf(lower_bound) else float(lower_bound),
            clamp_exp=clamp_exp,
            clamp_shexp=per_block("swiglu_clamp_shexp", 0.0) if g.get(key("swiglu_clamp_shexp")) is not None
            else clamp_exp,
            dense_limit=int(need("attention.indexer.top_k")) + int(need("attention.indexer.kpool")) - 1,
        )


# ------------------------------------------------------------------------------------------ hyper-connections


class HyperConnection(nn.Module):
    """One mixing site (hc_attn_* or hc_ffn_*): streams (T, N, D) -> the sublayer input, then the new streams."""

    def __init__(self, fn: Linear, base: torch.Tensor, scale: torch.Tensor, n: int, norm_eps: float, eps: float,
                 iterations: int) -> None:
        super().__init__()
        self.fn, self.n, self.norm_eps, self.eps, self.iterations = fn, n, norm_eps, eps, iterations
        self.register_buffer("base", base, persistent=False)  # (N (2 + N),): pre, post, then the N x N mixing
        self.register_buffer("scale", scale, persistent=False)  # (3,)

    @classmethod
    def load(cls, w: Weights, hooks: Hooks, prefix: str, a: Glm5NextArgs, norm_eps: float) -> HyperConnection:
        return cls(Linear.load(w, f"{prefix}_fn", hooks, torch.float32), w.dense(f"{prefix}_base.weight", torch.float32),
                   w.dense(f"{prefix}_scale.weight", torch.float32), a.n_streams, norm_eps, a.hc_eps,
                   a.sinkhorn_iterations)

    def split(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams (T, N, D) -> sublayer input (T, D), post weights (T, N), mixing comb (T, N src, N dst)."""
        T, N, D = streams.shape
        flat = streams.reshape(T, N * D)
        mixes = self.fn(flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + self.norm_eps))  # (T, N (2 + N))
        pre = torch.sigmoid(mixes[:, :N] * self.scale[0] + self.base[:N]) + self.eps
        post = 2 * torch.sigmoid(mixes[:, N:2 * N] * self.scale[1] + self.base[N:2 * N])
        comb = (mixes[:, 2 * N:] * self.scale[2] + self.base[2 * N:]).view(T, N, N)  # [t, src, dst]
        return (streams * pre[:, :, None]).sum(1), post, self._sinkhorn(comb)

    def _sinkhorn(self, logits: torch.Tensor) -> torch.Tensor:
        """Softmax over destinations, then alternately columns (over sources) and rows normalised to 1."""
        comb = torch.softmax(logits, dim=-1) + self.eps
        comb = comb / (comb.sum(1, keepdim=True) + self.eps)
        for _ in range(self.iterations - 1):
            comb = comb / (comb.sum(2, keepdim=True) + self.eps)
            comb = comb / (comb.sum(1, keepdim=True) + self.eps)
        return comb

    @staticmethod
    def merge(y: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """Stream d: post_d y + sum_s comb[s, d] stream_s -> (T, N, D)."""
        return post[:, :, None] * y[:, None, :] + torch.einsum("tsd,tse->tde", comb, streams)


class HyperBlock(nn.Module):
    """hc_attn -> attn_norm -> attention -> hc_attn merge, then the same around ffn_norm and the FFN."""

    def __init__(self, hc_attn: HyperConnection, attn_norm: RMSNorm, attn: nn.Module, hc_ffn: HyperConnection,
                 ffn_norm: RMSNorm, ffn: nn.Module, first: bool, last: bool) -> None:
        super().__init__()
        self.hc_attn, self.attn_norm, self.attn = hc_attn, attn_norm, attn
        self.hc_ffn, self.ffn_norm, self.ffn = hc_ffn, ffn_norm, ffn
        self.first, self.last = first, last

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        """x (T, D) for the first block, else (T, N, D) -> (T, N, D), or their mean (T, D) from the last block."""
        streams = x[:, None, :].expand(-1, self.hc_attn.n, -1) if self.first else x
        h, post, comb = self.hc_attn.split(streams)
        streams = self.hc_attn.merge(self.attn(self.attn_norm(h), step), streams, post, comb)
        h, post, comb = self.hc_ffn.split(streams)
        streams = self.hc_ffn.merge(self.ffn(self.ffn_norm(h), step), streams, post, comb)
        return streams.mean(1) if self.last else streams


# ------------------------------------------------------------------------------------------------------ KDA


class KimiDeltaAttention(nn.Module):
    def __init__(self, args: ModelArgs, a: Glm5NextArgs, w: Weights, hooks: Hooks, layer: int, n_seq: int) -> None:
        super().__init__()
        p = f"blk.{layer}"
        self.H, self.Hd, self.K = args.n_heads, a.kda_head_dim, a.conv_kernel
        Di = self.H * self.Hd
        self.wq, self.wk, self.wv = (Linear.load(w, f"{p}.attn_{x}", hooks) for x in "qkv")
        conv = torch.stack([w.dense(f"{p}.ssm_conv1d_{x}.weight", torch.float32).view(Di, self.K) for x in "qkv"])
        self.register_buffer("conv", conv, persistent=False)  # (3, Di, K): tap K-1 reads the current token
        self.f_a, self.f_b = Linear.load(w, f"{p}.ssm_f_a", hooks), Linear.load(w, f"{p}.ssm_f_b", hooks)
        self.register_buffer("dt_bias", w.dense(f"{p}.ssm_dt.bias", torch.float32), persistent=False)  # (Di,)
        self.register_buffer("A", w.dense(f"{p}.ssm_a", torch.float32), persistent=False)  # (H,) -exp(A_log)
        self.beta = Linear.load(w, f"{p}.ssm_beta", hooks)
        self.g_a, self.g_b = Linear.load(w, f"{p}.ssm_g_a", hooks), Linear.load(w, f"{p}.ssm_g_b", hooks)
        self.o_norm = RMSNorm.load(w, f"{p}.ssm_norm.weight", args.norm_eps)
        self.wo = Linear.load(w, f"{p}.attn_output", hooks)
        self.lower_bound = a.gate_lower_bound
        device = w.device
        self.register_buffer("conv_state", torch.zeros(n_seq, 3, self.K - 1, Di, device=device), persistent=False)
        self.register_buffer("state", torch.zeros(n_seq, self.H, self.Hd, self.Hd, device=device), persistent=False)

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        T, H, Hd = x.shape[0], self.H, self.Hd
        qkv = torch.stack([self.wq(x), self.wk(x), self.wv(x)])  # (3, T, Di)
        f = self.f_b(self.f_a(x)) + self.dt_bias  # (T, Di)
        if self.lower_bound is None:
            g = F.softplus(f).view(T, H, Hd) * self.A[:, None]
        else:
            g = self.lower_bound * torch.sigmoid(-(f.view(T, H, Hd) * self.A[:, None]))
        beta = torch.sigmoid(self.beta(x))  # (T, H)
        if step.seqs is None:
            out = self._segment(qkv, g, beta, step.seq, step.positions[0])
        else:  # tokens of several sequences: each one continues its own sequence's state
            out = torch.cat([self._segment(qkv[:, t:t + 1], g[t:t + 1], beta[t:t + 1], step.seqs[t], step.positions[t])
                             for t in range(T)])
        gate = torch.sigmoid(self.g_b(self.g_a(x))).view(T, H, Hd)
        return self.wo((self.o_norm(out) * gate).reshape(T, H * Hd))

    def _segment(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, seq: int | torch.Tensor,
                 first_pos: torch.Tensor) -> torch.Tensor:
        """Consecutive tokens of one sequence: convolution and delta rule from its state -> (T, H, Hd)."""
        T, H, Hd = g.shape
        keep = (first_pos != 0).float()  # position 0 starts the sequence anew
        padded = torch.cat([self.conv_state[seq] * keep, qkv.float()], dim=1)  # (3, K - 1 + T, Di)
        self.conv_state[seq] = padded[:, T:]
        windows = padded.unfold(1, self.K, 1)  # (3, T, Di, K)
        q, k, v = F.silu((windows * self.conv[:, None]).sum(-1)).view(3, T, H, Hd)
        q, k = (t / torch.sqrt(t.pow(2).sum(-1, keepdim=True) + L2_EPS) for t in (q, k))
        S = self.state[seq] * keep  # (H, Hd key, Hd value)
        decay, out = g.exp(), torch.empty(T, H, Hd, device=q.device)
        for t in range(T):
            S = S * decay[t, :, :, None]
            delta = (v[t] - torch.einsum("hkv,hk->hv", S, k[t])) * beta[t, :, None]
            S = S + k[t, :, :, None] * delta[:, None, :]
            out[t] = torch.einsum("hkv,hk->hv", S, q[t])
        self.state[seq] = S
        return out / math.sqrt(Hd)


# ------------------------------------------------------------------------------------------------------ FFN


def swiglu_clamp(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """llama.cpp's swiglu_clamp: the gate capped at `limit` before SiLU, up clamped to +-limit."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


class ClampedFeedForward(FeedForward):
    def __init__(self, gate: Linear, up: Linear, down: Linear, limit: float) -> None:
        super().__init__(gate, up, down)
        self.limit = limit

    def forward(self, x: torch.Tensor, step: Step | None = None) -> torch.Tensor:
        return self.down(swiglu_clamp(self.gate(x), self.up(x), self.limit))


def clamped_ffn(w: Weights, hooks: Hooks, layer: int, limit: float, suffix: str = "") -> ClampedFeedForward:
    base = FeedForward.load(w, hooks, layer, suffix)
    return ClampedFeedForward(base.gate, base.up, base.down, limit)


# ---------------------------------------------------------------------------------------------------- blocks


class DenseDSA(nn.Module):
    """DSA while its indexer selects every position: MLA over the whole cache. Beyond `limit` positions the
    selection is sparse, which moerun does not compute yet, so such a step is refused."""

    def __init__(self, mla: MLAttention, limit: int) -> None:
        super().__init__()
        self.mla, self.limit = mla, limit

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        if step.n_slots > self.limit:
            raise MoeprepError(f"glm5-next: {step.n_slots} positions need the sparse DSA indexer, which moerun does "
                               f"not implement yet; it runs contexts of up to {self.limit} positions")
        return self.mla(x, step)


def build_block(ctx: BuildContext, layer: int) -> HyperBlock:
    args, w, hooks = ctx.args, ctx.weights, ctx.hooks
    a = Glm5NextArgs.from_gguf(w.gguf)
    p = f"blk.{layer}"
    if a.dsa_layers[layer]:
        mla = MLAttention(args, w, hooks, layer, ctx.rope(attn_factor=rope_attn_factor(args)),
                          ctx.kv_cache(1, args.kv_lora_rank, args.kv_lora_rank))
        attn: nn.Module = DenseDSA(mla, a.dense_limit)
    else:
        attn = KimiDeltaAttention(args, a, w, hooks, layer, ctx.n_seq)
    if layer < args.n_dense_lead:
        ffn: nn.Module = clamped_ffn(w, hooks, layer, a.clamp_shexp[layer])
    else:
        experts = GGUFExperts.load(w, hooks, layer)
        experts.act = partial(swiglu_clamp, limit=a.clamp_exp[layer])
        ffn = MoE(layer, Router.load(args, w, hooks, layer), experts, hooks,
                  shared=clamped_ffn(w, hooks, layer, a.clamp_shexp[layer], "_shexp"))
    hc = lambda site: HyperConnection.load(w, hooks, f"{p}.hc_{site}", a, args.norm_eps)  # noqa: E731
    norm = lambda name: RMSNorm.load(w, f"{p}.{name}.weight", args.norm_eps)  # noqa: E731
    return HyperBlock(hc("attn"), norm("attn_norm"), attn, hc("ffn"), norm("ffn_norm"), ffn,
                      first=layer == 0, last=layer == args.n_layers - 1)
