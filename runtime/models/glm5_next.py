"""GLM-5.3-Flash (glm5-next): 4-stream hyper-connections around every block, Kimi delta attention (KDA) in most
layers and absorbed MLA without RoPE (DSA) in the others, leading dense blocks, sigmoid-routed experts with a shared
expert, clamped SwiGLU everywhere. The trailing NextN (multi-token prediction) block is not run.

Hyper-connections (runtime/layers/hyper_connections.py). The residual is 4 streams (T, 4, D); the first block
copies the embedding into all four and the last returns their mean, so the Transformer around the blocks still sees
(T, D).

KDA. q, k, v each through a short causal convolution (its last kernel-1 inputs kept per sequence) and SiLU; q and
k L2-normalised per head; per head a (Hd, Hd) state S decays per key channel by exp(g), g = softplus(f_b(f_a(x))
+ dt_bias) * ssm_a (or lower_bound * sigmoid(-(...) * ssm_a) when the file sets kda.gate_lower_bound), then takes
the delta-rule write S += k beta (v - S^T k)^T; the output S^T q / sqrt(Hd) is RMS-normed per head, gated by
sigmoid(g_b(g_a(x))) (Kimi-K3: one full-rank sigmoid(g(x))) and projected by attn_output. The state lives in this module, per sequence; a step whose first
position is 0 starts its sequence's state anew. A step of several tokens runs the delta rule in chunks of 64
(delta_rule_chunked in runtime/layers/delta_rule.py), a single token step by step (delta_rule_recurrent).

DSA. deepseek2's MLAttention with no roped part, over the positions its lightning indexer selects: the best
top_k / kpool pools of kpool consecutive positions by the indexer's score, plus the query's unfinished pool. Below
top_k + kpool - 1 positions (2051 in GLM-5.3-Flash) that is every position, and the scoring is skipped. A DSA block
whose attention.indexer.types entry is 0 has no indexer: it attends to what the last DSA block before it with an
indexer selected in the same step.
Letters: H heads, Hd KDA head size, Di = H Hd.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moeprep.gguf.reader import GGUFModel
from moerun.config import GATING_SIGMOID, ModelArgs, required_key
from moerun.layers import Activation, Linear, MoE, RMSNorm
from moerun.layers.delta_rule import delta_rule_chunked, delta_rule_recurrent
from moerun.layers.hyper_connections import HyperBlock, HyperConnection
from moerun.models.base import BuildContext
from moerun.models.deepseek2 import MLAttention, rope_attn_factor
from moerun.models.deepseek32 import Selection, SparseMLA, shared_indexer_sources
from moerun.step import Step

L2_EPS = 1e-6  # llama.cpp's q/k L2 norm for KDA (as the reference FLA kernels)


def read_args(g: GGUFModel) -> ModelArgs:
    # llama.cpp's glm5-next graph rotates nothing and scales its scores by 1/sqrt(head size) alone, so the file's
    # context-scaling keys change nothing (MLAttention would otherwise scale the scores by YaRN's magnitude)
    fixed = {"rope_style": "normal", "rope_scaling": "none", "rope_attn_factor": 1.0}
    fixed |= {"selection_bias_required": True, "output_required": True}
    args = ModelArgs.from_gguf(g, fixed=fixed, defaults={"gating": GATING_SIGMOID})
    return args.replace(shared_expert_dim=args.expert_dim * args.n_shared_experts)


@dataclass(frozen=True)
class Glm5NextArgs:
    """The keys ModelArgs does not hold (read by each block builder: dictionary lookups)."""

    dsa_layers: tuple[bool, ...]  # head_count_kv 1 (DSA) or 0 (KDA), per block
    indexer_source: tuple[int | None, ...]  # per DSA block: the block whose indexer selects for it (itself or earlier)
    n_streams: int
    sinkhorn_iterations: int
    hc_eps: float
    kda_head_dim: int
    conv_kernel: int
    gate_lower_bound: float | None
    clamp_exp: tuple[float, ...]  # SwiGLU limit per block, routed experts
    clamp_shexp: tuple[float, ...]  # shared expert and dense FFN
    indexer_heads: int
    top_k: int  # positions the indexer keeps, in pools of kpool
    kpool: int
    layer_norm_eps: float  # the indexer key's LayerNorm
    l2_eps: float = L2_EPS  # KDA's q/k L2 norm
    full_output_gate: bool = False  # KDA's output gate is low rank (ssm_g_a, ssm_g_b)

    @classmethod
    def from_gguf(cls, g: GGUFModel) -> Glm5NextArgs:
        key = lambda name: f"{g.arch}.{name}"  # noqa: E731
        n_blocks = int(g.get(key("block_count")))

        def per_block(name: str, default: float) -> tuple[float, ...]:
            value = g.get(key(name), default)
            return tuple(float(v) for v in value) if isinstance(value, list) else (float(value),) * n_blocks

        def need(name: str) -> object:
            return required_key(g, key(name))

        clamp_exp = per_block("swiglu_clamp_exp", 0.0)
        dsa = tuple(bool(n) for n in need("attention.head_count_kv"))
        # the key lists the trunk blocks; the NextN blocks always have their own indexer
        source = shared_indexer_sources(g.get(key("attention.indexer.types"), []), list(dsa), str(g.path))
        lower_bound = g.get(key("kda.gate_lower_bound"))
        return cls(
            dsa_layers=dsa,
            indexer_source=tuple(source),
            n_streams=int(need("hyper_connection.count")),
            sinkhorn_iterations=int(need("hyper_connection.sinkhorn_iterations")),
            hc_eps=float(need("hyper_connection.epsilon")),
            kda_head_dim=int(need("kda.head_dim")),
            conv_kernel=int(need("ssm.conv_kernel")),
            gate_lower_bound=None if lower_bound is None or math.isinf(lower_bound) else float(lower_bound),
            clamp_exp=clamp_exp,
            clamp_shexp=per_block("swiglu_clamp_shexp", 0.0)
            if g.get(key("swiglu_clamp_shexp")) is not None
            else clamp_exp,
            indexer_heads=int(need("attention.indexer.head_count")),
            top_k=int(need("attention.indexer.top_k")),
            kpool=int(need("attention.indexer.kpool")),
            layer_norm_eps=float(g.get(key("attention.layer_norm_epsilon"), 0.0)),
        )


# ------------------------------------------------------------------------------------------------------ KDA


class KimiDeltaAttention(nn.Module):
    seq_on_host = True  # its recurrent state is indexed by step.seq as a number: no captured prompt steps
    keeps_history = True  # its state folds in every token it ran: a sequence goes on only where it stopped (Model)

    def __init__(self, ctx: BuildContext, a: Glm5NextArgs, layer: int) -> None:
        super().__init__()
        args, w, n_seq, p = ctx.args, ctx.weights, ctx.n_seq, f"blk.{layer}"
        self.H, self.Hd, self.K = args.n_heads, a.kda_head_dim, a.conv_kernel
        Di = self.H * self.Hd
        self.wq, self.wk, self.wv = (ctx.linear(f"{p}.attn_{x}") for x in "qkv")
        conv = torch.stack([w.dense(f"{p}.ssm_conv1d_{x}.weight", torch.float32).view(Di, self.K) for x in "qkv"])
        self.register_buffer("conv", conv, persistent=False)  # (3, Di, K): tap K-1 reads the current token
        self.f_a, self.f_b = ctx.linear(f"{p}.ssm_f_a"), ctx.linear(f"{p}.ssm_f_b")
        self.register_buffer("dt_bias", w.dense(f"{p}.ssm_dt.bias", torch.float32), persistent=False)  # (Di,)
        self.register_buffer("A", w.dense(f"{p}.ssm_a", torch.float32), persistent=False)  # (H,) -exp(A_log)
        self.beta = ctx.linear(f"{p}.ssm_beta")
        # the output gate: low rank (ssm_g_b ssm_g_a), or Kimi-K3's full-rank ssm_g; the architecture says which, so a
        # file missing its gate is refused naming the tensor its loader needs
        full_gate = a.full_output_gate
        self.g_a = None if full_gate else ctx.linear(f"{p}.ssm_g_a")
        self.g_b = ctx.linear(f"{p}.ssm_g" if full_gate else f"{p}.ssm_g_b")
        self.o_norm = ctx.norm(f"{p}.ssm_norm.weight")
        self.wo = ctx.linear(f"{p}.attn_output")
        self.lower_bound, self.l2_eps = a.gate_lower_bound, a.l2_eps
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
            out = torch.cat(
                [
                    self._segment(qkv[:, t : t + 1], g[t : t + 1], beta[t : t + 1], step.seqs[t], step.positions[t])
                    for t in range(T)
                ]
            )
        gate = torch.sigmoid(self.g_b(x if self.g_a is None else self.g_a(x))).view(T, H, Hd)
        return self.wo((self.o_norm(out) * gate).reshape(T, H * Hd))

    def _segment(
        self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, seq: int | torch.Tensor, first_pos: torch.Tensor
    ) -> torch.Tensor:
        """Consecutive tokens of one sequence: convolution and delta rule from its state -> (T, H, Hd)."""
        T, H, Hd = g.shape
        keep = (first_pos != 0).float()  # position 0 starts the sequence anew
        padded = torch.cat([self.conv_state[seq] * keep, qkv.float()], dim=1)  # (3, K - 1 + T, Di)
        self.conv_state[seq] = padded[:, T:]
        windows = padded.unfold(1, self.K, 1)  # (3, T, Di, K)
        q, k, v = F.silu((windows * self.conv[:, None]).sum(-1)).view(3, T, H, Hd)
        q, k = (t / torch.sqrt(t.pow(2).sum(-1, keepdim=True) + self.l2_eps) for t in (q, k))
        S = self.state[seq] * keep  # (H, Hd key, Hd value)
        out, self.state[seq] = (delta_rule_recurrent if T == 1 else delta_rule_chunked)(q, k, v, g, beta, S)
        return out / math.sqrt(Hd)


# ------------------------------------------------------------------------------------------------------ FFN


# ---------------------------------------------------------------------------------------------------- blocks


class LightningIndexer(nn.Module):
    """DSA's pooled indexer: which cached positions each query attends to.

    Every position caches a key (indexer.attn_k, LayerNorm'd) and a gate (indexer_compressor_gate). A pool is KPOOL
    consecutive positions; once complete its pooled key is, per channel, the softmax over its members of gate + ape
    (indexer_compressor_ape, one row per place in the pool) weighting their keys. A query scores each complete pool
    that ends at or before it as sum_h relu(q_h . pooled) w_h, q = indexer.attn_q_b(its q_a latent), w =
    indexer.proj(x) / sqrt(Hi di), and attends to the positions of its top_k / KPOOL best pools plus those of its
    own unfinished pool. Letters: Hi heads, di key size, P pools."""

    seq_on_host = True  # its key cache is indexed by step.seq as a number: no captured prompt steps

    def __init__(self, ctx: BuildContext, layer: int, a: Glm5NextArgs, q_a: Linear, q_a_norm: RMSNorm) -> None:
        super().__init__()
        w, n_ctx, n_seq, p = ctx.weights, ctx.n_ctx, ctx.n_seq, f"blk.{layer}.indexer"
        self.k, self.q = ctx.linear(f"{p}.attn_k"), ctx.linear(f"{p}.attn_q_b")
        self.proj = ctx.linear(f"{p}.proj")
        self.gate = ctx.linear(f"blk.{layer}.indexer_compressor_gate")
        self.register_buffer("k_norm", w.dense(f"{p}.k_norm.weight", torch.float32), persistent=False)
        self.register_buffer("k_norm_bias", w.dense(f"{p}.k_norm.bias", torch.float32), persistent=False)
        self.register_buffer(
            "ape", w.dense(f"blk.{layer}.indexer_compressor_ape.weight", torch.float32), persistent=False
        )  # (KPOOL, di)
        self.q_a, self.q_a_norm = q_a, q_a_norm  # the attention's own, run here without its hooks
        self.kpool, self.n_top, self.norm_eps, self.n_heads = (
            a.kpool,
            a.top_k // a.kpool,
            a.layer_norm_eps,
            a.indexer_heads,
        )
        di = self.k_norm.numel()
        self.register_buffer("cache", torch.zeros(n_seq, n_ctx, 2, di, device=w.device), persistent=False)

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor | None:
        """Cache the step's keys and gates; return the (T, n_slots) bool selection, or None while every position
        is selected (no more complete pools than the indexer keeps)."""
        key = F.layer_norm(self.k(x), self.k_norm.shape, self.k_norm, self.k_norm_bias, self.norm_eps)
        rows = torch.stack([key, self.gate(x)], dim=1)  # (T, 2, di)
        if step.seqs is None:
            self.cache[step.seq].index_copy_(0, step.positions, rows)
        else:
            self.cache.index_put_((step.seqs, step.positions), rows)
        scores = self.pool_scores(x, step)
        return None if scores is None else self.select(scores, step)

    def pool_scores(self, x: torch.Tensor, step: Step) -> torch.Tensor | None:
        """(T, P) scores of the complete pools among the step's slots, -inf for those ending after the query;
        None while there are no more than the indexer keeps. The step's own rows must be cached already."""
        P = step.n_slots // self.kpool
        if P <= self.n_top:
            return None
        seq = step.seq if step.seqs is None else step.seqs
        cached = self.cache[seq, : P * self.kpool]  # (P K, 2, di), or (T, P K, 2, di) across sequences
        pools = cached.unflatten(-3, (P, self.kpool))  # (..., P, K, 2, di)
        weights = torch.softmax(pools[..., 1, :] + self.ape, dim=-2)
        pooled = (weights * pools[..., 0, :]).sum(-2)  # (P, di) or (T, P, di)
        T = x.shape[0]
        q = self.q(self.q_a_norm(self.q_a.product(x))).view(T, self.n_heads, -1)  # (T, Hi, di): reported once
        w_heads = self.proj(x) / math.sqrt(q.shape[1] * q.shape[2])  # (T, Hi)
        scores = (torch.einsum("thd,tpd->thp", q, pooled.expand(T, -1, -1)).relu() * w_heads[..., None]).sum(1)
        pool_end = torch.arange(P, device=x.device) * self.kpool + self.kpool - 1
        return scores.masked_fill(pool_end[None, :] > step.positions[:, None], float("-inf"))

    def select(self, scores: torch.Tensor, step: Step) -> torch.Tensor:
        """(T, n_slots) bool: the members of each query's best pools, its own unfinished pool, none after it."""
        T, P = scores.shape
        top = scores.topk(self.n_top, dim=-1)
        chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, top.indices, top.values > float("-inf"))
        slots = torch.arange(step.n_slots, device=scores.device)
        positions = step.positions[:, None]
        # the query's own unfinished pool: its last (position + 1) % KPOOL positions (none once the pool is complete)
        selected = slots[None, :] > positions - (positions + 1) % self.kpool
        selected[:, : P * self.kpool] |= chosen.repeat_interleave(self.kpool, dim=1)
        return selected & (slots[None, :] <= positions)


def build_block(ctx: BuildContext, layer: int) -> HyperBlock:
    args, w, hooks = ctx.args, ctx.weights, ctx.hooks
    a = Glm5NextArgs.from_gguf(w.gguf)
    p = f"blk.{layer}"
    if a.dsa_layers[layer]:
        mla = MLAttention(
            ctx,
            layer,
            ctx.rope(attn_factor=rope_attn_factor(args)),
            ctx.kv_cache(1, args.kv_lora_rank, args.kv_lora_rank),
        )
        source = a.indexer_source[layer]
        indexer = LightningIndexer(ctx, layer, a, mla.wq_a, mla.q_a_norm) if source == layer else None
        selection = ctx.shared.setdefault(("dsa selection", source), Selection())  # one per indexer
        attn: nn.Module = SparseMLA(mla, indexer, selection)
    else:
        attn = KimiDeltaAttention(ctx, a, layer)
    shared = Activation("swiglu_clamp", a.clamp_shexp[layer])  # the dense FFN's and the shared expert's clamp
    if layer < args.n_dense_lead:
        ffn: nn.Module = ctx.feed_forward(layer, activation=shared)
    else:
        ffn = MoE(
            layer,
            ctx.router(layer),
            ctx.experts(layer, Activation("swiglu_clamp", a.clamp_exp[layer])),
            hooks,
            shared=ctx.feed_forward(layer, "_shexp", activation=shared),
        )
    hc = lambda site: HyperConnection.load(  # noqa: E731
        w, hooks, f"{p}.hc_{site}", a.n_streams, args.norm_eps, a.hc_eps, a.sinkhorn_iterations
    )
    norm = lambda name: ctx.norm(f"{p}.{name}.weight")  # noqa: E731
    return HyperBlock(
        hc("attn"),
        norm("attn_norm"),
        attn,
        hc("ffn"),
        norm("ffn_norm"),
        ffn,
        first=layer == 0,
        last=layer == args.n_layers - 1,
    )
