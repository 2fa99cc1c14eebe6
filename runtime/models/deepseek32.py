"""DeepSeek-V3.2 (deepseek32): deepseek2's absorbed MLA, leading dense layers and shared-expert MoE, with DSA: each
query attends only to the top_k cached positions (2048 in V3.2) its lightning indexer scores best.

The indexer caches one key per position: indexer.attn_k(x), LayerNorm'd (indexer.k_norm weight and bias), NeoX RoPE
on its first rope_dim channels. A query's heads q = indexer.attn_q_b(its MLA q_a latent), RoPE'd the same way, score
position s as sum_h relu(q_h . k_s) w_h with w = indexer.proj(x) / sqrt(Hi di). While a step's queries see no more
than top_k positions, every position is selected and the scoring is skipped. As llama.cpp does, q and k are rotated
by an orthonormal Walsh-Hadamard matrix (in blocks of the largest power of two, at least 64, dividing di), which
leaves their products as they are, and the keys are cached in F16: so the scores, whose top_k-th decides, are
llama.cpp's to float32 rounding.
Letters: Hi indexer heads, di their size, R rope channels.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from moeprep.errors import MoeprepError
from moeprep.gguf.reader import GGUFModel
from moerun.config import ModelArgs, required_key
from moerun.layers import Block, Linear, RMSNorm, Rope
from moerun.models.base import BuildContext
from moerun.models.deepseek2 import MLAttention, rope_attn_factor
from moerun.models.deepseek2 import read_args as deepseek2_args
from moerun.step import Step

LAYER_NORM_EPS = 1e-6  # llama.cpp's fixed LayerNorm epsilon for the indexer keys


def walsh_hadamard(n: int) -> torch.Tensor:
    """The orthonormal (n, n) Walsh-Hadamard matrix, n a power of two: [[H, H], [H, -H]] / sqrt 2 at each doubling."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return (h / math.sqrt(n)).float()


def rotation_block(size: int) -> int:
    """The block llama.cpp rotates a head of `size` channels in: the largest power of two >= 64 dividing it."""
    block = 64
    while size % (block * 2) == 0:
        block *= 2
    return block


def read_args(g: GGUFModel) -> ModelArgs:
    return deepseek2_args(g)


class TopKIndexer(nn.Module):
    seq_on_host = True  # its key cache is indexed by step.seq as a number: no captured prompt steps

    def __init__(self, ctx: BuildContext, layer: int, q_a: Linear, q_a_norm: RMSNorm, rope_style: str = "neox") -> None:
        super().__init__()
        g, w, p = ctx.weights.gguf, ctx.weights, f"blk.{layer}.indexer"

        def key(name: str) -> int:
            return int(required_key(g, f"{g.arch}.attention.indexer.{name}"))

        self.n_heads, self.head_size, self.top_k = key("head_count"), key("key_length"), key("top_k")
        self.k, self.q, self.proj = ctx.linear(f"{p}.attn_k"), ctx.linear(f"{p}.attn_q_b"), ctx.linear(f"{p}.proj")
        self.register_buffer("k_norm", w.dense(f"{p}.k_norm.weight", torch.float32), persistent=False)
        self.register_buffer("k_norm_bias", w.dense(f"{p}.k_norm.bias", torch.float32), persistent=False)
        self.q_a, self.q_a_norm = q_a, q_a_norm  # the attention's own, run here without its hooks
        self.rope = Rope(
            ctx.args.replace(rope_style=rope_style), ctx.n_ctx, w.device, attn_factor=rope_attn_factor(ctx.args)
        )
        if self.head_size % 64:
            raise MoeprepError(f"{g.path}: indexer key_length {self.head_size} is not a multiple of 64")
        self.register_buffer("hadamard", walsh_hadamard(rotation_block(self.head_size)).to(w.device), persistent=False)
        self.register_buffer(
            "cache", torch.zeros(ctx.n_seq, ctx.n_ctx, self.head_size, device=w.device), persistent=False
        )

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., di) times the Hadamard matrix, block by block (it is symmetric)."""
        n = self.hadamard.shape[0]
        return (x.unflatten(-1, (-1, n)) @ self.hadamard).flatten(-2)

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor | None:
        """Cache the step's keys; return the (T, n_slots) bool selection, or None while every position is."""
        self.store(x, step)
        if step.n_slots <= self.top_k:
            return None
        scores = self.scores(x, step)
        top = scores.topk(self.top_k, dim=-1)
        chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, top.indices, top.values > float("-inf"))
        return chosen & step.mask()

    def store(self, x: torch.Tensor, step: Step) -> None:
        """The step's keys into the cache, rotated and rounded to F16 as llama.cpp keeps them."""
        key = F.layer_norm(self.k(x).float(), self.k_norm.shape, self.k_norm, self.k_norm_bias, LAYER_NORM_EPS)
        key = self.rotate(self.rope(key[:, None], step.positions)[:, 0]).half().float()  # (T, di)
        if step.seqs is None:
            self.cache[step.seq].index_copy_(0, step.positions, key)
        else:
            self.cache.index_put_((step.seqs, step.positions), key)

    def scores(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        """(T, n_slots) float32: each query's score of each cached position, -inf after it. The step's own keys
        must be stored already."""
        T = x.shape[0]
        q = self.q(self.q_a_norm(self.q_a.product(x))).view(T, self.n_heads, self.head_size)
        q = self.rotate(self.rope(q, step.positions))  # (T, Hi, di)
        w_heads = self.proj(x).float() / math.sqrt(self.n_heads * self.head_size)  # (T, Hi)
        seq = step.seq if step.seqs is None else step.seqs
        keys = self.cache[seq, : step.n_slots]  # (S, di), or (T, S, di) across sequences
        scores = (torch.einsum("thd,tsd->ths", q, keys.expand(T, -1, -1)).relu() * w_heads[..., None]).sum(1)
        return scores.masked_fill(~step.mask(), float("-inf"))


def shared_indexer_sources(types: list[int], dsa: list[bool], where: str) -> list[int | None]:
    """For each block, the DSA block whose indexer's selection it attends over (attention.indexer.types: 1, its own;
    0, the last DSA block before it with one; blocks past the list have their own); None for a block without DSA.
    A sharing block with no such block before it is refused in one line."""
    full = list(types) + [1] * len(dsa)
    sources, last = [], None
    for il, is_dsa in enumerate(dsa):
        if is_dsa and full[il]:
            last = il
        elif is_dsa and last is None:
            raise MoeprepError(
                f"{where}: DSA block {il} shares the indexer of an earlier DSA block, and there "
                f"is none (attention.indexer.types = {list(types)})"
            )
        sources.append(last if is_dsa else None)
    return sources


class Selection:
    """What a DSA block's indexer selected in the current step, for the DSA blocks after it that share its indexer
    (attention.indexer.types 0: they have no indexer tensors and attend to the same positions, as in llama.cpp).
    Blocks run in order, so a sharing block reads its source's selection of the same step. Selections are kept by
    where the step's rows start in its positions tensor and how many there are, so that a step run in parts (rows
    a:b of one positions tensor each) pairs each part with its own; a step starting at row 0 drops the others."""

    def __init__(self) -> None:
        self._by_rows: dict[tuple[int, int], torch.Tensor | None] = {}

    @staticmethod
    def _rows(step: Step) -> tuple[int, int]:
        return step.positions.storage_offset(), step.positions.shape[0]

    def record(self, step: Step, selected: torch.Tensor | None) -> None:
        """selected: (T, n_slots) bool, or None for every position."""
        rows = self._rows(step)
        if rows[0] == 0:
            self._by_rows.clear()
        self._by_rows[rows] = selected

    def read(self, step: Step) -> torch.Tensor | None:
        rows = self._rows(step)
        assert rows in self._by_rows, "a DSA block sharing an indexer ran before the block that owns it"
        return self._by_rows[rows]


class SparseMLA(nn.Module):
    """DSA: MLA over the positions an indexer selects (all of them while there are few): its own indexer, which
    records what it selected in `selection`, or, without one, the selection another block recorded there."""

    def __init__(self, mla: MLAttention, indexer: nn.Module | None, selection: Selection) -> None:
        super().__init__()
        self.mla, self.indexer, self.selection = mla, indexer, selection

    def forward(self, x: torch.Tensor, step: Step, i8=None) -> torch.Tensor:
        # i8: the norm's int8 rounding of x, unused here: its products round x themselves
        if self.indexer is not None:
            self.selection.record(step, self.indexer(x, step))
        selected = self.selection.read(step)
        if selected is not None:
            step = dataclasses.replace(step, _masks={0: selected.to(x.device)})
        return self.mla(x, step)


def indexed_mla(ctx: BuildContext, layer: int) -> MLAttention:
    """The absorbed MLA of a DSA block, with the q LoRA its indexer reads."""
    args = ctx.args
    mla = MLAttention(
        ctx,
        layer,
        ctx.rope(attn_factor=rope_attn_factor(args)),
        ctx.kv_cache(1, args.kv_lora_rank + args.rope_dim, args.kv_lora_rank),
    )
    if mla.wq_a is None:
        g = ctx.weights.gguf
        raise MoeprepError(f"{g.path}: {g.arch} needs the q LoRA (attn_q_a): its indexer reads it")
    return mla


def build_block(ctx: BuildContext, layer: int) -> Block:
    mla = indexed_mla(ctx, layer)
    indexer = TopKIndexer(ctx, layer, mla.wq_a, mla.q_a_norm)
    return ctx.block(layer, SparseMLA(mla, indexer, Selection()), ctx.ffn(layer))
