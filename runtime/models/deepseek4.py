"""DeepSeek-V4 (deepseek4, DeepSeek-V4-Flash): glm5-next's 4-stream hyper-connections around every block, one
attention kind over raw and compressed keys, sqrt-softplus routing with a selection bias (hash routing by token id in
the first `hash_layer_count` layers) beside a shared expert, clamped SwiGLU everywhere. The last block's streams are
summed by the head's own mix (output_hc_*) before the final norm. The trailing NextN block is not run.

Attention. A q LoRA (attn_q_a, its norm, attn_q_b); each query head RMS-normed without a weight. One shared KV head
kv = attn_kv_a_norm(attn_kv x): the key and the value at once. RoPE (adjacent pairs) on the last rope_dim channels
of q and kv; a layer with compressed keys rotates with compress_rope_freq_base (and the file's context scaling),
one without with rope.freq_base, unscaled. A query attends, under one softmax with its head's sink, to
  * the raw keys of the last `sliding_window` positions (itself included), and
  * the compressed entries its position completes (runtime/layers/kv_compression.py): at ratio 128 all of them, at
    ratio 4 those a lightning indexer picks: its own compressor (indexer_compressor_*, entries of di channels), a
    query q_i = indexer.attn_q_b(q LoRA latent) rotated at the query's position, and the score
    sum_h relu(q_i,h . entry) w_h with w = indexer.proj(x) / sqrt(Hi di); the top_k best entries (all of them while
    there are no more).
The output's rotation is taken back at the query's position; heads are then grouped (attention.output_group_count G):
each group's heads go through their own attn_output_a slice (to output_lora_rank R), and attn_output_b maps the G R
values back to D.
State, per sequence: a ring of the raw keys of the last `sliding_window` positions, and per compressor its entries
and a ring of its last rows (what an unfinished block needs); a step starting at position 0 reads nothing of an
earlier run. A prompt chunk
builds the entries of the blocks it completes; a decode step (one token per sequence) rewrites the entry of the
block each token is in, finished or not, with no host sync, so that a CUDA graph can hold it.
Letters: H heads, d head size, Hi/di the indexer's heads and key size, G groups, R the output LoRA rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from moeprep.errors import MoeprepError
from moeprep.gguf.reader import GGUFModel
from moerun.config import GATING_SQRT_SOFTPLUS, ModelArgs, required_key
from moerun.layers import Activation, HashRouter, Linear, MoE, Rope
from moerun.layers.hyper_connections import HyperBlock, HyperConnection, HyperHead
from moerun.layers.kv_compression import KVCompressor, rotate_tail
from moerun.models.base import BuildContext
from moerun.step import Step

CSA_RATIO, HCA_RATIO = 4, 128  # the overlapping compression with an indexer, and the plain one
QUERY_BLOCK = 128  # queries scored at once: (128, H, S) float32 scores


def read_args(g: GGUFModel) -> ModelArgs:
    fixed = {"rope_style": "normal", "selection_bias_required": True, "output_required": True}
    args = ModelArgs.from_gguf(g, fixed=fixed, defaults={"gating": GATING_SQRT_SOFTPLUS})
    return args.replace(shared_expert_dim=args.expert_dim * args.n_shared_experts)


@dataclass(frozen=True)
class Deepseek4Args:
    """The keys ModelArgs does not hold."""

    compress_ratios: tuple[int, ...]  # per block: 0, 4 or 128
    compress_rope_base: float
    output_groups: int
    output_lora_rank: int
    hash_layers: int
    n_streams: int
    sinkhorn_iterations: int
    hc_eps: float
    indexer_heads: int
    indexer_head_size: int
    top_k: int
    clamp_exp: tuple[float, ...]  # SwiGLU limit per block, routed experts
    clamp_shexp: tuple[float, ...]  # the shared expert's

    @classmethod
    def from_gguf(cls, g: GGUFModel) -> Deepseek4Args:
        key = lambda name: f"{g.arch}.{name}"  # noqa: E731
        need = lambda name: required_key(g, key(name))  # noqa: E731
        n_blocks = int(need("block_count"))

        def per_block(name: str, default: float) -> tuple[float, ...]:
            value = g.get(key(name), default)
            return tuple(float(v) for v in value) if isinstance(value, list) else (float(value),) * n_blocks

        ratios = tuple(int(r) for r in need("attention.compress_ratios"))
        if len(ratios) < n_blocks or any(r not in (0, CSA_RATIO, HCA_RATIO) for r in ratios):
            raise MoeprepError(
                f"{g.path}: attention.compress_ratios must give every block 0, {CSA_RATIO} or {HCA_RATIO} "
                f"(got {list(ratios)} for {n_blocks} blocks)"
            )
        clamp_exp = per_block("swiglu_clamp_exp", 0.0)
        return cls(
            compress_ratios=ratios,
            compress_rope_base=float(need("attention.compress_rope_freq_base")),
            output_groups=int(need("attention.output_group_count")),
            output_lora_rank=int(need("attention.output_lora_rank")),
            hash_layers=int(g.get(key("hash_layer_count"), 0)),
            n_streams=int(need("hyper_connection.count")),
            sinkhorn_iterations=int(need("hyper_connection.sinkhorn_iterations")),
            hc_eps=float(need("hyper_connection.epsilon")),
            indexer_heads=int(need("attention.indexer.head_count")),
            indexer_head_size=int(need("attention.indexer.key_length")),
            top_k=int(need("attention.indexer.top_k")),
            clamp_exp=clamp_exp,
            clamp_shexp=per_block("swiglu_clamp_shexp", 0.0)
            if g.get(key("swiglu_clamp_shexp")) is not None
            else clamp_exp,
        )


def compressor(ctx: BuildContext, layer: int, prefix: str, ratio: int, rope: Rope) -> KVCompressor:
    p, w = f"blk.{layer}.{prefix}_compressor", ctx.weights
    return KVCompressor(
        ctx.linear(f"{p}_kv"),
        ctx.linear(f"{p}_gate"),
        w.dense(f"{p}_ape.weight", torch.float32),
        ctx.norm(f"{p}_norm.weight"),
        rope,
        ratio,
        ratio == CSA_RATIO,
        ctx.n_ctx,
        ctx.n_seq,
    )


class EntryIndexer(nn.Module):
    """The lightning indexer of a ratio-4 layer: which compressed entries each query attends to."""

    def __init__(self, ctx: BuildContext, layer: int, a: Deepseek4Args, rope: Rope) -> None:
        super().__init__()
        p = f"blk.{layer}.indexer"
        self.q, self.proj = ctx.linear(f"{p}.attn_q_b"), ctx.linear(f"{p}.proj")
        self.keys = compressor(ctx, layer, "indexer", CSA_RATIO, rope)
        self.rope, self.n_heads, self.head_size, self.top_k = rope, a.indexer_heads, a.indexer_head_size, a.top_k

    def select(
        self, qr: torch.Tensor, x: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor, seq
    ) -> torch.Tensor:
        """(T, B) bool: the visible entries each query keeps; qr (T, Cq) its q LoRA latent, x (T, D) its input, seq
        its sequence (a number) or each query's (T,)."""
        T, B = visible.shape
        if B <= self.top_k:
            return visible
        q = rotate_tail(self.rope, self.q(qr).view(T, self.n_heads, self.head_size), positions)  # (T, Hi, di)
        w_heads = self.proj(x).float() / math.sqrt(self.n_heads * self.head_size)  # (T, Hi)
        scores = (products(q, rows_read(self.keys.cache, seq, B)).relu() * w_heads[..., None]).sum(1)
        top = scores.masked_fill(~visible, float("-inf")).topk(self.top_k, dim=-1).indices
        return torch.zeros_like(visible).scatter_(1, top, True) & visible


def rows_read(cache: torch.Tensor, seq, n: int) -> torch.Tensor:
    """The first n rows of `cache` (n_seq, S, W) the queries read: (n, W) of sequence `seq` where it is a number
    (every query's), else (T, n, W), one sequence per query."""
    return cache[seq, :n]


def products(q: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """q (T, H, d) times rows (n, d) shared by the queries, or (T, n, d) each its own -> (T, H, n)."""
    return torch.einsum("thd,nd->thn" if rows.dim() == 2 else "thd,tnd->thn", q, rows)


class CompressedAttention(nn.Module):
    seq_on_host = True  # its caches are indexed by step.seq as a number: no captured prompt steps
    keeps_history = True  # its state folds in every token it ran: a sequence goes on only where it stopped (Model)

    def __init__(self, ctx: BuildContext, layer: int, a: Deepseek4Args) -> None:
        super().__init__()
        args, w, p = ctx.args, ctx.weights, f"blk.{layer}"
        self.H, self.d, self.eps, self.window = args.n_heads, args.head_dim, args.norm_eps, args.sliding_window
        self.wq_a, self.q_a_norm = ctx.linear(f"{p}.attn_q_a"), ctx.norm(f"{p}.attn_q_a_norm.weight")
        self.wq_b = ctx.linear(f"{p}.attn_q_b")
        self.wkv, self.kv_norm = ctx.linear(f"{p}.attn_kv"), ctx.norm(f"{p}.attn_kv_a_norm.weight")
        self.register_buffer("sinks", w.dense(f"{p}.attn_sinks.weight", torch.float32), persistent=False)  # (H,)
        G, R = a.output_groups, a.output_lora_rank
        if self.H % G:
            raise MoeprepError(f"{w.gguf.path}: {self.H} heads do not split into {G} output groups")
        self.wo_a = Linear.load(w, f"{p}.attn_output_a", ctx.hooks, shape=(G, R, self.H * self.d // G))
        self.wo_b = ctx.linear(f"{p}.attn_output_b")
        self.ratio = a.compress_ratios[layer]
        if self.ratio:  # compressed layers rotate with their own base and the file's context scaling
            yarn = args.rope_scaling == "yarn" and args.rope_freq_scale != 1.0
            cancel = 1.0 / (1.0 + 0.1 * math.log(1.0 / args.rope_freq_scale)) if yarn else 1.0
            self.rope = ctx.rope(base=a.compress_rope_base, attn_factor=cancel)
        else:
            self.rope = ctx.rope(scaled=False)
        self.compressor = compressor(ctx, layer, "attn", self.ratio, self.rope) if self.ratio else None
        self.indexer = EntryIndexer(ctx, layer, a, self.rope) if self.ratio == CSA_RATIO else None
        # the raw keys, in the compute dtype (as KVCache keeps them): a ring of the window's positions (all of them
        # without a window), with the position each slot holds (-1: none)
        slots = min(self.window or ctx.n_ctx, ctx.n_ctx)
        self.register_buffer(
            "raw", torch.zeros(ctx.n_seq, slots, self.d, dtype=w.dtype, device=w.device), persistent=False
        )
        self.register_buffer(
            "raw_pos", torch.full((ctx.n_seq, slots), -1, dtype=torch.long, device=w.device), persistent=False
        )

    def forward(self, x: torch.Tensor, step: Step, i8=None) -> torch.Tensor:
        # i8: the norm's int8 rounding of x, unused here: its products round x themselves
        T, H, d, positions = x.shape[0], self.H, self.d, step.positions
        qr = self.q_a_norm(self.wq_a(x))
        q = self.wq_b(qr).view(T, H, d).float()
        q = rotate_tail(self.rope, q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + self.eps), positions)
        kv = rotate_tail(self.rope, self.kv_norm(self.wkv(x))[:, None], positions)[:, 0]  # (T, d)
        if step.seqs is None and T > 1:  # a prompt chunk
            out = self._attend(q, qr, x, kv, int(step.seq), positions, step.n_slots)
        elif step.seqs is None or step.capture is not None or len(set(step.seqs.tolist())) == T:
            # decode tokens, one per sequence: no host sync, so that a CUDA graph can hold the step
            seqs = step.seqs if step.seqs is not None else torch.full_like(positions, int(step.seq))
            out = self._attend(q, qr, x, kv, seqs, positions, step.n_slots)
        else:  # single tokens of which some share a sequence: in order, each after the one before
            out = torch.cat(
                [
                    self._attend(
                        q[t : t + 1], qr[t : t + 1], x[t : t + 1], kv[t : t + 1], s, positions[t : t + 1], p + 1
                    )
                    for t, (s, p) in enumerate(zip(step.seqs.tolist(), positions.tolist()))
                ]
            )
        out = rotate_tail(self.rope, out, positions, inverse=True).reshape(T, self.wo_a.weight.shape[0], -1)
        return self.wo_b(self._grouped_output(out))

    def _grouped_output(self, out: torch.Tensor) -> torch.Tensor:
        """(T, G, H d / G) -> (T, G R): each group of heads through its own slice of attn_output_a."""
        T, G, width = out.shape
        if self.wo_a.hooks.activation:
            self.wo_a.hooks.fire_activation(self.wo_a.name, out.reshape(T * G, width))
        if self.wo_a.round_input is not None:
            out = self.wo_a.round_input(out)
        weight = self.wo_a.weight
        return torch.einsum("tgi,gri->tgr", out.to(weight.dtype), weight).float().reshape(T, -1)

    def _attend(
        self,
        q: torch.Tensor,
        qr: torch.Tensor,
        x: torch.Tensor,
        kv: torch.Tensor,
        seq: int | torch.Tensor,
        positions: torch.Tensor,
        n: int,
    ) -> torch.Tensor:
        """Store the tokens' keys and build the entries they complete, then attend -> (T, H, d). `seq`: a number for
        consecutive tokens of one sequence (a prompt chunk), or each token's (T,), one token per sequence; n: the
        step's slots (positions), of which n // ratio compressed entries are read."""
        chunk = isinstance(seq, int)
        keys, key_pos = self._raw_keys(kv, seq, positions)
        p = positions[:, None]
        allowed = (key_pos >= 0) & (key_pos <= p)
        if self.window:
            allowed &= key_pos > p - self.window
        for compressor in (self.compressor, self.indexer.keys if self.indexer is not None else None):
            if compressor is not None and chunk:
                compressor.update(x, seq, positions)
            elif compressor is not None:
                compressor.update_tokens(x, seq, positions)
        B = n // self.ratio if self.ratio else 0
        if B:
            visible = torch.arange(B, device=x.device)[None, :] < (p + 1) // self.ratio  # (T, B)
            if self.indexer is not None:
                visible = self.indexer.select(qr, x, positions, visible, seq)
            keys = torch.cat([keys, rows_read(self.compressor.cache, seq, B)], dim=-2)
            allowed = torch.cat([allowed, visible], dim=1)
        return self._softmax(q, keys, allowed)

    def _raw_keys(self, kv: torch.Tensor, seq, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the tokens' raw keys in the ring; return the keys the queries read and their positions: for a chunk
        the ring's earlier positions then the chunk's own ((R + T, d), (1, R + T)), else each token's sequence's ring
        after the write ((T, R, d), (T, R))."""
        R = self.raw.shape[1]
        if not isinstance(seq, int):
            self.raw[seq, positions % R] = kv.to(self.raw.dtype)
            self.raw_pos[seq, positions % R] = positions
            return self.raw[seq].float(), self.raw_pos[seq]
        earlier = self.raw_pos[seq].masked_fill(self.raw_pos[seq] >= positions[0], -1)  # a restart drops the rest
        keys = torch.cat([self.raw[seq], kv.to(self.raw.dtype)]).float()  # the chunk's own rounded as stored
        key_pos = torch.cat([earlier, positions])[None, :]
        keep = min(len(positions), R)
        self.raw[seq, positions[-keep:] % R] = kv[-keep:].to(self.raw.dtype)
        self.raw_pos[seq, positions[-keep:] % R] = positions[-keep:]
        return keys, key_pos

    def _softmax(self, q: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """q (T, H, d) over its keys, (S, d) shared or (T, S, d) each its own, which are the values too, where
        allowed (T, S), with the heads' sinks; QUERY_BLOCK queries at a time, which bounds the scores' memory."""
        out = []
        for a in range(0, len(q), QUERY_BLOCK):
            qb, kb = q[a : a + QUERY_BLOCK], keys if keys.dim() == 2 else keys[a : a + QUERY_BLOCK]
            scores = products(qb, kb) / math.sqrt(self.d)
            scores = scores.masked_fill(~allowed[a : a + QUERY_BLOCK, None, :], float("-inf"))
            sinks = self.sinks[None, :, None].expand(len(qb), -1, 1)
            probs = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]
            out.append(torch.einsum("ths,sd->thd" if kb.dim() == 2 else "ths,tsd->thd", probs, kb))
        return torch.cat(out)


def build_block(ctx: BuildContext, layer: int) -> HyperBlock:
    args, w, hooks = ctx.args, ctx.weights, ctx.hooks
    a = Deepseek4Args.from_gguf(w.gguf)
    p = f"blk.{layer}"
    routed = Activation("swiglu_clamp", a.clamp_exp[layer])
    router = HashRouter.load(args, w, hooks, layer, ctx.backend.kernels) if layer < a.hash_layers else ctx.router(layer)
    shared = ctx.feed_forward(layer, "_shexp", activation=Activation("swiglu_clamp", a.clamp_shexp[layer]))
    ffn = MoE(layer, router, ctx.experts(layer, routed), hooks, shared=shared)

    def hc(site: str) -> HyperConnection:
        return HyperConnection.load(
            w, hooks, f"{p}.hc_{site}", a.n_streams, args.norm_eps, a.hc_eps, a.sinkhorn_iterations
        )

    last = layer == args.n_layers - 1
    return HyperBlock(
        hc("attn"),
        ctx.norm(f"{p}.attn_norm.weight"),
        CompressedAttention(ctx, layer, a),
        hc("ffn"),
        ctx.norm(f"{p}.ffn_norm.weight"),
        ffn,
        first=layer == 0,
        last=last,
        head=HyperHead.load(w, hooks, args.norm_eps, a.hc_eps) if last else None,
    )
