"""GLM-5 (glm-dsa): DeepSeek-V3.2's graph (absorbed MLA with DSA, leading dense layers, shared experts) with three
differences: the lightning indexer rotates its keys and queries with normal RoPE, not NeoX; the gating is sigmoid
unless the file says otherwise; and not every block has its own indexer. attention.indexer.types lists, per block,
1 for an indexer of its own and 0 for attending to the positions the last block before it with one selected in the
same step (a 0 before any 1 is refused). Files without the key: every block has its own below a training context
of 2^20 (GLM-5, 5.1); from there on GLM-5.2's layout, blocks 0, 1 and every fourth from 2. The yarn log
multiplier key is not read, as llama.cpp does not read it for this architecture. NextN blocks are not run."""

from __future__ import annotations

from moeprep.errors import MoeprepError
from moeprep.gguf.reader import GGUFModel
from moerun.config import GATING_SIGMOID, ModelArgs
from moerun.layers import Block
from moerun.models.base import BuildContext
from moerun.models.deepseek2 import read_args as deepseek2_args
from moerun.models.deepseek32 import Selection, SparseMLA, TopKIndexer, indexed_mla, shared_indexer_sources

LONG_CONTEXT = 1 << 20  # from this training context on, files without indexer types have GLM-5.2's layout


def read_args(g: GGUFModel) -> ModelArgs:
    args = deepseek2_args(g)
    gating = args.gating if g.get(f"{g.arch}.expert_gating_func") else GATING_SIGMOID  # absent or 0 (none)
    return args.replace(gating=gating, yarn_log_mul=0.0)


def indexer_sources(g: GGUFModel, n_blocks: int) -> list[int]:
    """For each decoder block, the block whose indexer's selection it attends over (itself where it has one)."""
    types = g.get(f"{g.arch}.attention.indexer.types")
    if types is None:
        if int(g.get(f"{g.arch}.context_length", 0)) < LONG_CONTEXT:
            types = [1] * n_blocks
        else:
            types = [int(il < 2 or (il - 2) % 4 == 0) for il in range(n_blocks)]
    types = [int(t) for t in types]
    if len(types) < n_blocks:
        raise MoeprepError(
            f"{g.path}: {g.arch}.attention.indexer.types lists {len(types)} blocks; the model has {n_blocks}"
        )
    return shared_indexer_sources(types, [True] * n_blocks, str(g.path))


def build_block(ctx: BuildContext, layer: int) -> Block:
    mla = indexed_mla(ctx, layer)
    source = indexer_sources(ctx.weights.gguf, ctx.args.n_layers)[layer]
    indexer = TopKIndexer(ctx, layer, mla.wq_a, mla.q_a_norm, rope_style="normal") if source == layer else None
    selection = ctx.shared.setdefault(("dsa selection", source), Selection())  # one per indexer
    return ctx.block(layer, SparseMLA(mla, indexer, selection), ctx.ffn(layer))
