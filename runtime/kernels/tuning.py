"""Tile sizes of the GGUF matmul kernels (gemv.py, gemm.py), per block type.

GEMV tiles are R rows x B blocks per loop step, each thread holding a few of the R*B*P values of a part; a tile
holds enough bytes that the loads in flight cover HBM latency without spilling registers. GEMM tiles are the usual
BM tokens x BN rows, stepping B GGUF blocks (B*P values per tl.dot) at a time. Numbers from bench/bench_gguf_matmul.py
on an H200 (docs/BENCHMARKS.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGMLQuantizationType as Q


@dataclass(frozen=True)
class Int8Routes:
    """Which 8-bit routes the GPU products take, as the runtime's options say (options.py: MOERUN_GEMV_INT8,
    MOERUN_GEMM_INT8): `gemv`, the matrix-vector kernel's int8 activations (decode steps); `gemm`, the 8-bit GEMM's
    (long prompts' experts, a few tokens' dense products). A value the layers hold and pass to each product."""

    gemv: bool = True
    gemm: bool = True


INT8_ON = Int8Routes()

# Up to this many tokens a step is decode-sized: dense products below DECODED_GEMM_MIN_TOKENS (and
# DENSE_I8_MIN_TOKENS) run the matrix-vector kernel, and so does a float32 router (layers.Linear, gguf_mv); more
# tokens go through a GEMM.
GEMV_MAX_TOKENS = 8
# The routed experts run the matrix-vector kernel, one program group per (token, expert) pair, up to these many tokens
# (a decode batch, a short prompt), the grouped 8-bit GEMM past them (GEMM_I8_MIN_TOKENS): a pair reads its expert's
# rows whole at the kernel's bandwidth, where the GEMM decodes each expert's tiles in every program for the few pairs
# each expert gets. Gate and up in one launch (gguf_moe_glu: the input read once for both banks) keep the pairs
# longer than one bank alone (down, or gate and up apart). H200, the 30B shapes, us for gate+up on
# the pairs / on two 8-bit GEMM launches, then down on the pairs / the GEMM (few-token tiles below; the grouping made
# once, ~3 us, outside the time) at T = 32: 94 / 213, 64 / 88; 48: 137 / 243, 96 / 98; 64: 182 / 261, 128 / 102;
# 80: 224 / 278, 153 / 106; 96: 267 / 290, 182 / 108; 128: 349 / 315, 239 / 113 (docs/history/benchmarks-log.md).
# (One limit of 64 for both before: a 64-token prompt's down ran 26 us a layer slower on the pairs. The limit was
# 128 while the grouping took ~20 torch kernels, 88-93 us a layer; moe_align.group_by_slot is one launch since.)
# Model.warm_up runs a prompt past each to compile the GEMM.
MOE_GLU_GEMV_MAX_TOKENS = 96
MOE_GEMV_MAX_TOKENS = 48
# From this many tokens a dense product on a GPU decodes its weight to bfloat16 once and multiplies on cuBLAS
# (gguf_matmul.decode_bf16). H200 (bench_gguf_matmul.py, docs/history/benchmarks-log.md): 4096x4096 Q4_K at
# T = 512 took 410 us on the GEMM over the blocks and 43 decoded (25 for the bfloat16 product alone), at T = 64 265
# against 28; the matrix-vector kernel multiplies each value with every token in float32 and slows with tokens
# (Q4_K 9.9 us at T=1, 18-24 at T=2 for the four types, 29-48 at T=4, 38-69 at T=8), where the decoded product
# costs about the same ~25-30 us at any T. A GEMM over the blocks on 16-token tiles lost at T = 2-8 too (47-138 us).
# The 8-bit route, timed at T > 1 (before its whole-word loads): T = 2 13-20 us against 30-34 decoded,
# T = 4 29-32 against 30-31 for Q4_K, Q8_0 and Q4_0 (a tie; Q6_K 47 against 34), T = 8 63-80 against 29-34.
# (Expert banks stay on the grouped GEMM: ~32 tokens per expert in a prompt do not repay a decoded copy.)
DECODED_GEMM_MIN_TOKENS = 4
# A dense weight kept decoded to bfloat16 as well (quantized.keep_decoded_copies: on a GPU without the expert cache,
# where the copies fit) takes cuBLAS over that copy from this many tokens. H200 (bench_gguf_matmul.py
# --sweep bf16), us at T = 1 / 2 / 8, Q8_0 blocks against cuBLAS over the copy: 4096x4096 9.1 / 19.5 / 17.6 against
# 14.1 / 13.8 / 14.2; 5120x2048 7.9 / 13.4 / 12.6 against 10.1 / 10.0 / 9.7; 2048x4096 6.6 / 10.5 / 14.0 against
# 9.9 / 9.9 / 9.8; the 151936x2048 output head 99.0 / 237.6 / 239.6 against 147.5 / 149.3 / 151.9. One token stays on
# the matrix-vector kernel over the blocks, which reads fewer bytes (Q8_0: 1.06 a value against 2).
KEPT_DECODED_MIN_TOKENS = 2
# A prompt step of at least GEMM_I8_MIN_TOKENS tokens runs its experts on the 8-bit GEMM (gemm._gemm_i8_kernel:
# activations rounded to int8 per 32 values as on the GEMV's 8-bit route, the weights' quants as int8 tiles on tensor
# cores) where the type has a qtypes gemm8 decoder, the bfloat16 GEMM otherwise. H200 (--sweep routes,
# the shipped tiles): on the 30B shapes at T = 256 gate/up 317.7 against 367.4 us a bank, down 265.1 against 332.1
# (with the grouping in each time), so it takes every step the GEMM takes (past the limits above); at T = 512
# 20-36% faster on the four expert shapes (--sweep gemm8). Int8Routes.gemm off (MOERUN_GEMM_INT8=0) turns the
# 8-bit GEMM off, for the experts and for the dense products below.
GEMM_I8_MIN_TOKENS = MOE_GEMV_MAX_TOKENS + 1
DECODE_TILES = (16, 2)  # rows x blocks per program of the decode to bfloat16
# A weight larger than this decodes in row chunks of this size, one scratch buffer reused: the output head of a
# 152k-token vocabulary would otherwise take 620 MB of scratch in a decode step of several sequences.
DECODED_CHUNK_BYTES = 64 << 20


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
    split: int = 1  # programs over K (the 8-bit GEMM of a dense product of a few tokens; their sums added after)


# Measured on an H200 (Triton 3.6; bench/bench_gguf_matmul.py --sweep, docs/history/benchmarks-log.md), 4096x4096,
# T=1: the fastest of 2-16 rows x 2-16 blocks, 4 or 8 warps. Keyed by values per block; types not swept take their
# size's.
# The types swept again (commit a09edcf, 1-4 warps) have their own tiles where they beat these by
# more than 5%, GB/s of weight bytes against the block size's tiles: Q4_K 4 x 8 blocks 915 (4 x 4: 766), Q8_0 4 x 16
# 1368 (8 x 16: 1008), Q4_0 4 x 16 on 2 warps 958 (its former 8 x 16 on 8 warps was not in the sweep; the best 8-row
# tile made 803). Q6_K keeps 4 x 4 on 4 warps: 1130, within 4% of the sweep's best (4 x 8 on 2 warps, 1167).
GEMV_BY_BLOCK_VALUES = {256: GemvTiles(rows=4, blocks=4), 32: GemvTiles(rows=8, blocks=16)}
# F32 (a router, gguf_mv): 1 x 32 on 2 warps, 2.4 / 4.3 us at 1 / 8 rows of the 30B router against 4.5 / 11.3 on the
# block size's tiles (H200, 9 tiles).
GEMV_OVERRIDES: dict[Q, GemvTiles] = {
    Q.Q4_K: GemvTiles(rows=4, blocks=8),
    Q.Q8_0: GemvTiles(rows=4, blocks=16),
    Q.Q4_0: GemvTiles(rows=4, blocks=16, num_warps=2),
    Q.F32: GemvTiles(rows=1, blocks=32, num_warps=2),
}
# The grouped decode (gguf_moe, gguf_moe_glu: a program per (token, expert) pair and row tile) runs short rows in many
# small programs; its tiles, keyed by (type, blocks per row), come from bench_gguf_matmul.py --sweep on the expert
# shapes (4-32 rows x 1-4 blocks (4-16 of 32 values), 1-4 warps; gate/up timed as gguf_moe_glu). Shapes not listed
# take the dense tiles above. GB/s against the dense tiles those shapes ran before (Q4_K 4 x 4 on
# 4 warps; Q4_0 8 x 16 on 8 warps, not in the sweep: its 4-warp form): 30B gate+up 1018 (864), 30B down 756 (580),
# 60 GB gate+up 1234 (1073), 60 GB down 1075 (866).
GEMV_GROUPED_OVERRIDES: dict[tuple[Q, int], GemvTiles] = {
    (Q.Q4_K, 8): GemvTiles(rows=4, blocks=4, num_warps=1),  # Qwen3-30B-A3B gate/up, 2048 columns
    (Q.Q4_K, 3): GemvTiles(rows=4, blocks=1, num_warps=1),  # its down, 768 columns
    (Q.Q4_K, 16): GemvTiles(rows=4, blocks=4, num_warps=2),  # the 60 GB bench model's gate/up, 4096 columns
    (Q.Q4_0, 44): GemvTiles(rows=4, blocks=4, num_warps=2),  # its down, 1408 columns
}
# The 8-bit route of the matrix-vector kernel (act_i8.quantize_i8 and qtypes' dot8 decoders: activations rounded
# to int8 per 32 values, four products per dp4a) for the types that have it; Int8Routes.gemv off (MOERUN_GEMV_INT8=0)
# turns it off (float32 activations). Its tiles where swept, else the above. H200 (bench_gguf_matmul.py --sweep,
# then the table on these tiles; docs/history/benchmarks-log.md), 4096x4096 at T=1 with the activations' rounding in
# the time, GB/s against the float route's in the same run: Q4_K 1061 (912), Q8_0 1585 (1356), Q4_0 1216 (938);
# Q6_K's 8-bit form made 872 in the sweep against its float route's 1156 and was dropped.
# On this route a tile's blocks are the route's units (qtypes.BlockType.dot8_values: a Q4_K or Q5_K block is four):
# one per lane. Q4_K re-swept in units (H200, 27 tiles): 2 x 32 on one warp 1321 GB/s against 1193 for
# its block tile moved to units (8 x 64 on 2 warps), which Q5_K keeps (not swept).
GEMV_I8_OVERRIDES: dict[Q, GemvTiles] = {
    Q.Q4_K: GemvTiles(rows=2, blocks=32, num_warps=1),
    Q.Q8_0: GemvTiles(rows=1, blocks=32, num_warps=1),
    Q.Q4_0: GemvTiles(rows=2, blocks=32, num_warps=1),
    Q.Q5_K: GemvTiles(rows=8, blocks=64, num_warps=2),
}
# The grouped decode's 8-bit tiles, in units like the above: H200 (bench_gguf_matmul.py --sweep grouped
# --decode-only, 18 candidates each, gate+up timed as one GLU launch), GB/s against the tiles the block-per-lane kernel
# ran before, in the same run: 30B gate+up 1861 (1354), 30B down 1052 (866), 60 GB gate+up 2694 (1773; 4 x 8 made
# 2690), 60 GB down 1948 (1844).
GEMV_I8_GROUPED_OVERRIDES: dict[tuple[Q, int], GemvTiles] = {
    (Q.Q4_K, 8): GemvTiles(rows=2, blocks=16, num_warps=1),  # Qwen3-30B-A3B gate/up: a row's 16 units in one tile
    (Q.Q4_K, 3): GemvTiles(rows=8, blocks=4, num_warps=1),  # its down, 768 columns = 6 units
    (Q.Q4_K, 16): GemvTiles(rows=1, blocks=32, num_warps=1),  # the 60 GB bench model's gate/up, 4096 columns
    (Q.Q4_0, 44): GemvTiles(rows=4, blocks=16, num_warps=1),  # its down, 1408 columns
}
QUANTIZE_BLOCKS = 32  # blocks of 32 activations per program of quantize_i8
# GEMM, T=512: 128x128 tiles with 8 warps ran 1.8x faster than 64x64 on the dense kernel (Q4_K, Q8_0; 3 stages,
# Triton 3.6). Q4_K keeps 2 stages: Triton 3.9 asks 232 KB of shared memory for 3 (the H200 has 227 KB). The grouped
# kernel, given those tiles with float32 inputs, asked for 303 KB; it keeps 64x64 where not swept. Q6_K and Q4_0 were
# not swept.
GEMM_BY_BLOCK_VALUES = {256: GemmTiles(64, 64, 1), 32: GemmTiles(64, 64, 2)}
DENSE_GEMM_OVERRIDES: dict[Q, GemmTiles] = {
    Q.Q4_K: GemmTiles(128, 128, 1, num_warps=8, num_stages=2),
    Q.Q8_0: GemmTiles(128, 128, 4, num_warps=8, num_stages=3),
}
# The grouped prefill GEMM's tiles by (type, blocks per row), from bench_gguf_matmul.py --sweep on the expert shapes
# at T = 512 (8 of 128 experts: about 32 pairs per expert, half a 64-row tile); shapes not listed take the above.
# TFLOP/s against the 64x64 tiles they ran before: 30B gate/up 24.0 (16.6), 30B down 25.9 (17.5),
# 60 GB gate/up 28.8 (18.7): 16 pairs per tile waste least on the experts' short runs (and 16-row tiles fit 3 stages
# in shared memory); 60 GB down (Q4_0) 31.0 (64x64 on 4 blocks per step: 19.8; the default's 2 were not in the sweep).
GROUPED_GEMM_OVERRIDES: dict[tuple[Q, int], GemmTiles] = {
    (Q.Q4_K, 8): GemmTiles(16, 128, 1, num_warps=8, num_stages=3),
    (Q.Q4_K, 3): GemmTiles(16, 128, 1, num_warps=8, num_stages=3),
    (Q.Q4_K, 16): GemmTiles(16, 128, 1, num_warps=8, num_stages=3),
    (Q.Q4_0, 44): GemmTiles(64, 128, 4, num_warps=4, num_stages=2),
}
# The 8-bit GEMM's tiles (one block per K step, so `blocks` is unused; tl.dot needs 16 tokens at least), by (type,
# blocks per row) as GROUPED_GEMM_OVERRIDES: H200 (bench_gguf_matmul.py --sweep gemm8, 8 candidates each,
# T = 512), us against the bfloat16 GEMM on its tiles: 30B gate/up 421.6 (525.6), 30B down 396.0 (497.4), 60 GB
# gate/up 1129.8 (1644.1), 60 GB down 976.7 (1533.3). The 30B down moved from 4 warps to 2 after a sweep at T = 256 (a
# `moerun serve` prompt step; 13 candidates): 24.4 TFLOP/s against 21.1 (16 x 128 made 24.5,
# but a block_m other than gate/up's costs the layer a second group_by_slot). Capping registers (ptx .maxnreg 96 or
# 128: ncu found 175 a thread, two programs an SM) made every tile 5-100% slower.
GEMM_I8_GROUPED_TILES = GemmTiles(32, 128, 1, num_warps=4, num_stages=3)
GEMM_I8_GROUPED_OVERRIDES: dict[tuple[Q, int], GemmTiles] = {
    (Q.Q4_K, 8): GemmTiles(32, 128, 1, num_warps=4, num_stages=3),
    (Q.Q4_K, 3): GemmTiles(32, 64, 1, num_warps=2, num_stages=3),
    (Q.Q4_K, 16): GemmTiles(64, 128, 1, num_warps=4, num_stages=3),
    (Q.Q4_0, 44): GemmTiles(32, 128, 1, num_warps=4, num_stages=3),
}
# Steps of at most GEMM_I8_FEW_TOKENS tokens (about 8 pairs per expert or fewer) take these tiles where listed: a tile
# of 16 pairs wastes less on the experts' short runs, and narrower weight tiles make more programs. H200,
# the 30B shapes (12 tiles each, the grouping made once outside the time), us at T = 64 / 128 against the
# T = 512 tiles above: gate/up 126.4 / 152.5 (149.2 / 195.1, 32 x 128 on 4 warps), down 101.1 / 108.9 (135.7 /
# 142.5). Both take 16 pairs a tile, so that a layer's banks share one grouping.
GEMM_I8_FEW_TOKENS = 128
GEMM_I8_FEW_TOKENS_OVERRIDES: dict[tuple[Q, int], GemmTiles] = {
    (Q.Q4_K, 8): GemmTiles(16, 32, 1, num_warps=2, num_stages=3),
    (Q.Q4_K, 3): GemmTiles(16, 64, 1, num_warps=2, num_stages=3),
}
# A dense product of DENSE_I8_MIN_TOKENS .. DENSE_I8_MAX_TOKENS tokens (a `moerun serve` decode batch, a short
# prompt) runs on the 8-bit GEMM too, where the type has a gemm8 decoder: one tile of BM = 16 tokens costs a
# tensor-core dot what one token does, and a weight tile is read once for all of them, where the matrix-vector
# kernel's work grows with the tokens and the decoded route writes and reads back a bfloat16 copy of the weight. Few
# tokens make few (token, row) tiles, so K is split over `split` programs whose sums are added after. H200
# (bench_gguf_matmul.py --sweep dense8, docs/history/benchmarks-log.md), 4096x4096 us against the route taken without
# it: T = 2 16.7-17.3 against the matrix-vector kernel's 8.2-17.6 (not taken), T = 3 16.6-17.5 against 19.7-29.2,
# T = 4-8 16.6-19.6 against the decoded route's 28.7-31.1, T = 16 18.1-23.7 against 29.4-31.7, T = 32 26.7-32.7
# against 30.1-32.3 (not taken: Q4_K loses). (On the grouped tiles, 64-128 rows and K whole, it had lost to the
# decoded route at 4-16 tokens: 33-80 us against 29-31.)
DENSE_I8_MIN_TOKENS = 3
DENSE_I8_MAX_TOKENS = 16
DENSE_I8_TILES = GemmTiles(16, 32, 1, num_warps=2, num_stages=3, split=8)
DENSE_I8_OVERRIDES: dict[Q, GemmTiles] = {
    Q.Q4_K: GemmTiles(16, 32, 1, num_warps=2, num_stages=3, split=4),
    Q.Q4_0: GemmTiles(16, 64, 2, num_warps=4, num_stages=3, split=8),
}
# The GEMV keeps one float32 accumulator per (token, value) of its tile: at most this many per thread, or they spill.
GEMV_ACCUMULATORS_PER_THREAD = 64


def gemv_tiles(
    qtype: Q, block_values: int, per_block: int, tokens: int, grouped_blocks: int = 0, i8: bool = False
) -> GemvTiles:
    """The type's tiles (the grouped decode's for rows of `grouped_blocks` blocks, where swept; the 8-bit route's
    where swept), with fewer blocks (then rows) per step when `tokens` x `per_block` accumulators per (row, block)
    would spill."""
    tiles = (
        (i8 and (GEMV_I8_GROUPED_OVERRIDES.get((qtype, grouped_blocks)) or GEMV_I8_OVERRIDES.get(qtype)))
        or GEMV_GROUPED_OVERRIDES.get((qtype, grouped_blocks))
        or GEMV_OVERRIDES.get(qtype)
        or GEMV_BY_BLOCK_VALUES[block_values]
    )
    rows, blocks = tiles.rows, tiles.blocks
    budget = GEMV_ACCUMULATORS_PER_THREAD * 32 * tiles.num_warps
    while tokens * rows * blocks * per_block > budget and rows * blocks > 1:
        rows, blocks = (rows, blocks // 2) if blocks > 1 else (rows // 2, blocks)
    return GemvTiles(rows, blocks, tiles.num_warps)


def dense_i8_tiles(qtype: Q) -> GemmTiles:
    """The 8-bit GEMM's tiles for a dense product of a few tokens (DENSE_I8_MIN_TOKENS .. DENSE_I8_MAX_TOKENS)."""
    return DENSE_I8_OVERRIDES.get(qtype, DENSE_I8_TILES)


def gemm_tiles(
    qtype: Q, block_values: int, grouped: bool, grouped_blocks: int = 0, i8: bool = False, n_tokens: int = 0
) -> GemmTiles:
    """The GEMM's tiles: with `i8` the 8-bit (grouped) GEMM's (for a step of at most GEMM_I8_FEW_TOKENS tokens the
    few-token ones where swept), else the grouped kernel's for rows of `grouped_blocks` blocks where swept, the dense
    ones' where swept, else the block size's."""
    if i8:
        few = GEMM_I8_FEW_TOKENS_OVERRIDES.get((qtype, grouped_blocks)) if n_tokens <= GEMM_I8_FEW_TOKENS else None
        return few or GEMM_I8_GROUPED_OVERRIDES.get((qtype, grouped_blocks), GEMM_I8_GROUPED_TILES)
    swept = GROUPED_GEMM_OVERRIDES.get((qtype, grouped_blocks)) if grouped else DENSE_GEMM_OVERRIDES.get(qtype)
    return swept or GEMM_BY_BLOCK_VALUES[block_values]


# staging.stage_second: words (of 8 bytes where the matrix and the addresses allow) per program and warps.
# Copying 1-8 experts of 9.3 MiB from page-locked host memory on the H200 machine: 1024 words x 4 warps 44-50 GB/s,
# the same as 4096-16384 words (41-50), against 46-55 for the copy engine; the matrix-vector kernel reading them in
# place reached 22-24.
STAGE_WORDS = 1024
STAGE_WARPS = 4
