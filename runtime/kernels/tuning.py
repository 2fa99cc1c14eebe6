"""Tile sizes of the GGUF matmul kernels (gguf_matmul.py), per block type.

GEMV tiles are R rows x B blocks per loop step, each thread holding a few of the R*B*P values of a part; a tile
holds enough bytes that the loads in flight cover HBM latency without spilling registers. GEMM tiles are the usual
BM tokens x BN rows, stepping B GGUF blocks (B*P values per tl.dot) at a time. Numbers from bench/bench_gguf_matmul.py
on an H200 (docs/BENCHMARKS.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGMLQuantizationType as Q

# Up to this many tokens (or (token, expert) pairs per expert slot on the decode path) the weights are streamed by
# the matrix-vector kernel; more go through the tiled GEMM.
GEMV_MAX_TOKENS = 8


@dataclass(frozen=True)
class GemvTiles:
    rows: int  # R
    blocks: int  # B
    num_warps: int = 4


@dataclass(frozen=True)
class GemmTiles:
    block_m: int  # tokens
    block_n: int  # weight rows
    blocks: int  # GGUF blocks per K step
    num_warps: int = 4
    num_stages: int = 2


# Measured on an H200 (Triton 3.6; bench/bench_gguf_matmul.py --sweep, docs/BENCHMARKS.md), 4096x4096, T=1: the
# fastest of 2-16 rows x 2-16 blocks, 4 or 8 warps. Keyed by values per block; types not swept take their size's.
GEMV_BY_BLOCK_VALUES = {256: GemvTiles(rows=4, blocks=4), 32: GemvTiles(rows=8, blocks=16)}
GEMV_OVERRIDES: dict[Q, GemvTiles] = {Q.Q4_0: GemvTiles(rows=8, blocks=16, num_warps=8)}
# The grouped decode (gguf_moe, gguf_moe_glu: a program per (token, expert) pair and row tile) runs short rows in many
# small programs; its tiles, keyed by (type, blocks per row), come from bench_gguf_matmul.py --sweep on the expert
# shapes. Shapes not listed take the dense tiles above.
GEMV_GROUPED_OVERRIDES: dict[tuple[Q, int], GemvTiles] = {}
# GEMM, T=512: 128x128 tiles with 8 warps ran 1.8x faster than 64x64 on the dense kernel (Q4_K, Q8_0; 3 stages,
# Triton 3.6). Q4_K keeps 2 stages: Triton 3.9 asks 232 KB of shared memory for 3 (the H200 has 227 KB). The grouped
# kernel, given those tiles with float32 inputs, asked for 303 KB; it keeps 64x64, measured on it. Q6_K and Q4_0 were
# not swept.
GEMM_BY_BLOCK_VALUES = {256: GemmTiles(64, 64, 1), 32: GemmTiles(64, 64, 2)}
DENSE_GEMM_OVERRIDES: dict[Q, GemmTiles] = {Q.Q4_K: GemmTiles(128, 128, 1, num_warps=8, num_stages=2),
                                            Q.Q8_0: GemmTiles(128, 128, 4, num_warps=8, num_stages=3)}
# The grouped prefill GEMM's tiles by (type, blocks per row), from bench_gguf_matmul.py --sweep on the expert shapes
# at T = 512 (8 of 128 experts: about 32 pairs per expert, half a 64-row tile); shapes not listed take the above.
GROUPED_GEMM_OVERRIDES: dict[tuple[Q, int], GemmTiles] = {}


# The GEMV keeps one float32 accumulator per (token, value) of its tile: at most this many per thread, or they spill.
GEMV_ACCUMULATORS_PER_THREAD = 64


def gemv_tiles(qtype: Q, block_values: int, part_values: int, tokens: int, grouped_blocks: int = 0) -> GemvTiles:
    """The type's tiles (the grouped decode's for rows of `grouped_blocks` blocks, where swept), with fewer blocks
    (then rows) per step when `tokens` accumulators per value would spill."""
    tiles = (GEMV_GROUPED_OVERRIDES.get((qtype, grouped_blocks)) or GEMV_OVERRIDES.get(qtype)
             or GEMV_BY_BLOCK_VALUES[block_values])
    rows, blocks = tiles.rows, tiles.blocks
    budget = GEMV_ACCUMULATORS_PER_THREAD * 32 * tiles.num_warps
    while tokens * rows * blocks * part_values > budget and rows * blocks > 1:
        rows, blocks = (rows, blocks // 2) if blocks > 1 else (rows // 2, blocks)
    return GemvTiles(rows, blocks, tiles.num_warps)


def gemm_tiles(qtype: Q, block_values: int, grouped: bool, grouped_blocks: int = 0) -> GemmTiles:
    """The GEMM's tiles: the grouped kernel's for rows of `grouped_blocks` blocks where swept, the dense ones'
    where swept, else the block size's."""
    swept = GROUPED_GEMM_OVERRIDES.get((qtype, grouped_blocks)) if grouped else DENSE_GEMM_OVERRIDES.get(qtype)
    return swept or GEMM_BY_BLOCK_VALUES[block_values]
