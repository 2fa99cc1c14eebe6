"""Speed of moerun's GGUF matmul kernels (runtime/kernels/gguf_matmul.py) on one GPU, next to torch's bfloat16 peer.

    python bench/bench_gguf_matmul.py [--sweep [grouped | batch | gemm8 | dense8 | routes | bf16]]
                                      [--decode-only | --quick] [--carried] [--shapes TEXT] [--tokens N]
                                      [--token-counts 16,32,...] [--json FILE]

Prints, from one run:
- the HBM copy bandwidth (a 2 GiB device-to-device copy, bytes read + written over time): the ceiling;
- decode products (T = 1, 2, 4, 8 tokens, a decode step of as many sequences) of a 4096x4096 weight in Q4_K, Q8_0,
  Q6_K, Q4_0: GB/s of weight bytes, on the matrix-vector kernel and, from T = 2, through the weight decoded to
  bfloat16 and cuBLAS ("decoded"), and from T = 2 on the 8-bit GEMM ("8-bit GEMM"; tuning.py picks among them);
- grouped MoE decode, 8 of 128 experts (distinct), one token: 2048x768 and 768x2048 in Q4_K (Qwen3-30B-A3B shape),
  4096x1408 in Q4_K and 1408x4096 in Q4_0 (the 60 GB benchmark shape); shapes are GGUF's (columns x rows); then 8
  tokens (8 random experts each) as decode runs them (gate+up in one gguf_moe_glu, a matrix-vector program group per
  (token, expert) pair): GB/s of the distinct experts' bytes, what a step must read at least;
- prefill at T = 64, 128, 512: TFLOP/s for the 4096x4096 weight, through the GEMM on the blocks and through the
  weight decoded to bfloat16 once and cuBLAS (tuning.DECODED_GEMM_MIN_TOKENS), and at T = 512 for the grouped
  experts (8 of 128 per token);
- the peer on every shape: torch bfloat16 F.linear (dense) or bmm over the 8 experts' pre-stacked bfloat16 weights.
Weights are random bytes (timing does not depend on the values; tests/runtime/test_gguf_matmul.py checks results).
Every timed call reads weights that are not in L2: the calls rotate over enough copies (or experts) to pass 200 MB.
Each timing replays a CUDA graph of all rotated calls (launch overhead out of the picture, as in a captured decode
step), median of --repeat replays after a warm-up. The 8-bit route's decode rows include the activations' rounding
(quantize_i8, a launch of its own); with --carried the input comes rounded already, as the decode step's norms and
attention return it (an act_i8.QAct, the products' `i8`), and the kernel is timed alone. --sweep first times a few
GEMV/GEMM tile shapes per type and uses the fastest (to copy into runtime/kernels/tuning.py), then the grouped
decode's tiles on each expert shape (gate/up as the one-launch gguf_moe_glu), for tuning.GEMV_GROUPED_OVERRIDES,
and the grouped prefill GEMM's at T = 512, for tuning.GROUPED_GEMM_OVERRIDES.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from unittest.mock import patch

import torch
import torch.nn.functional as F
import triton
from gguf import GGMLQuantizationType as Q
from gpu_timing import replay_seconds  # bench/gpu_timing.py

from moerun.kernels import fused, tuning
from moerun.kernels.act_i8 import QAct, quantize_i8
from moerun.kernels.gguf_matmul import QWeight, bf16_mm, gguf_mm, gguf_moe, gguf_moe_glu
from moerun.kernels.qtypes import BLOCK_TYPES

ROTATE_BYTES = 200 << 20  # more than the H200's 50 MB L2, several times over
DENSE = (4096, 4096)  # (rows, cols)
DENSE_TYPES = (Q.Q4_K, Q.Q8_0, Q.Q6_K, Q.Q4_0)
# name, qtype, (rows, cols), input per (t, k)?
MOE_SHAPES = (
    ("30B gate/up 2048x768", Q.Q4_K, (768, 2048), False),
    ("30B down 768x2048", Q.Q4_K, (2048, 768), True),
    ("60GB gate/up 4096x1408", Q.Q4_K, (1408, 4096), False),
    ("60GB down 1408x4096", Q.Q4_0, (4096, 1408), True),
)
N_EXPERTS, TOP_K, PREFILL_T, DECODE_T = 128, 8, 512, 8
CARRIED = False  # --carried: decode inputs come with their 8-bit rounding (see rounded)


def graph_seconds(calls: list[Callable[[], object]], repeat: int) -> float:
    """Seconds per call: a CUDA graph of all calls, replayed; median over replays."""
    for call in calls:  # compile and warm up outside the capture
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return replay_seconds(graph, repeat) / len(calls)


# The 8-bit routes the timed products take (the runtime's MOERUN_GEMV_INT8 / MOERUN_GEMM_INT8); `tuned` sets them.
ROUTES = tuning.INT8_ON


@contextmanager
def tuned(**values) -> Iterator[None]:
    """tuning.py's constants set to `values` inside the block, and GEMV_INT8 / GEMM_INT8 the routes the products are
    given (ROUTES): the routes that rows next to each other compare."""
    global ROUTES
    saved_routes = ROUTES
    ROUTES = dataclasses.replace(
        ROUTES, **{name[:4].lower(): values.pop(name) for name in ("GEMV_INT8", "GEMM_INT8") if name in values}
    )
    saved = {name: getattr(tuning, name) for name in values}
    for name, value in values.items():
        setattr(tuning, name, value)
    try:
        yield
    finally:
        ROUTES = saved_routes
        for name, value in saved.items():
            setattr(tuning, name, value)


def fastest(results: list) -> object:
    """The configuration of the best (measure, configuration) pair; failed measurements (nan) lose."""
    return max(results, key=lambda r: r[0] if r[0] == r[0] else float("-inf"))[1]


def guarded(measure: Callable[..., dict], *args) -> dict:
    """A failing measurement reports its error instead of ending the run (one GPU call measures everything)."""
    try:
        return measure(*args)
    except Exception as e:  # noqa: BLE001
        print(f"  {measure.__name__}{args}: {type(e).__name__}: {str(e)[:300]}")
        return {"error": str(e)[:300], "us": float("nan"), "GB/s": float("nan"), "TFLOP/s": float("nan")}


def copy_bandwidth(repeat: int) -> float:
    n = 2 << 30
    src, dst = (
        torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda"),
        torch.empty(n, dtype=torch.uint8, device="cuda"),
    )
    return 2 * n / graph_seconds([lambda: dst.copy_(src)], repeat) / 1e9


def random_bank(qtype: Q, n: int, rows: int, cols: int) -> torch.Tensor:
    bt = BLOCK_TYPES[qtype]
    return torch.randint(0, 256, (n, rows, cols // bt.values * bt.nbytes), dtype=torch.uint8, device="cuda")


def rounded(x: torch.Tensor) -> QAct | None:
    """With --carried, x's 8-bit rounding where a step's norm would return it (fused.add_rms_norm_i8), for the timed
    products to take so that they skip quantize_i8's launch; made here, outside the timed graph. Else None."""
    if CARRIED and fused.rounds_i8(*x.view(-1, x.shape[-1]).shape, ROUTES):
        return quantize_i8(x.view(-1, x.shape[-1]))
    return None


def copies_for(nbytes: int) -> int:
    return max(2, -(-ROTATE_BYTES // nbytes))


def dense_decode(qtype: Q, n_tokens: int, repeat: int, shape: tuple[int, int] = DENSE) -> dict:
    rows, cols = shape
    bank = random_bank(qtype, 1, rows, cols)[0]
    weights = [QWeight(bank.clone(), qtype, rows, cols) for _ in range(copies_for(bank.numel()))]
    x = torch.randn(n_tokens, cols, device="cuda")
    i8 = rounded(x)
    t = graph_seconds([lambda w=w: gguf_mm(x, w, i8, ROUTES) for w in weights], repeat)
    return {"us": t * 1e6, "GB/s": bank.numel() / t / 1e9}


def dense_peer(n_tokens: int, repeat: int) -> dict:
    rows, cols = DENSE
    weights = [torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16) for _ in range(copies_for(rows * cols * 2))]
    x = torch.randn(n_tokens, cols, device="cuda", dtype=torch.bfloat16)
    t = graph_seconds([lambda w=w: F.linear(x, w) for w in weights], repeat)
    return {"us": t * 1e6, "GB/s": rows * cols * 2 / t / 1e9, "TFLOP/s": 2 * n_tokens * rows * cols / t / 1e12}


def moe_inputs(
    n_tokens: int,
    cols: int,
    per_pair: bool,
    n_calls: int,
) -> tuple[torch.Tensor, QAct | None, list[torch.Tensor]]:
    x = torch.randn((n_tokens, TOP_K, cols) if per_pair else (n_tokens, cols), device="cuda")
    slots = [
        torch.rand(n_tokens, N_EXPERTS, device="cuda").argsort(dim=1)[:, :TOP_K].to(torch.int32) for _ in range(n_calls)
    ]
    return x, rounded(x), slots


def distinct_experts(slots: list[torch.Tensor]) -> float:
    """Experts a call reads at least (each once), averaged over the calls' slot tables."""
    return sum(s.unique().numel() for s in slots) / len(slots)


def moe(qtype: Q, shape: tuple[int, int], per_pair: bool, n_tokens: int, repeat: int) -> dict:
    rows, cols = shape
    w = QWeight(random_bank(qtype, N_EXPERTS, rows, cols), qtype, rows, cols)
    expert_bytes = w.data[0].numel()
    x, i8, slots = moe_inputs(n_tokens, cols, per_pair, n_calls=16)
    t = graph_seconds([lambda s=s: gguf_moe(x, w, s, i8=i8, routes=ROUTES) for s in slots], repeat)
    return {
        "us": t * 1e6,
        "GB/s": distinct_experts(slots) * expert_bytes / t / 1e9,
        "TFLOP/s": 2 * n_tokens * TOP_K * rows * cols / t / 1e12,
    }


def moe_glu(qtype: Q, shape: tuple[int, int], n_tokens: int, repeat: int) -> dict:
    """gate and up of the 8 experts of each token with SwiGLU (gguf_moe_glu, one launch on the matrix-vector path):
    bytes of both banks."""
    rows, cols = shape
    gate, up = (QWeight(random_bank(qtype, N_EXPERTS, rows, cols), qtype, rows, cols) for _ in range(2))
    expert_bytes = gate.data[0].numel()
    x, i8, slots = moe_inputs(n_tokens, cols, False, n_calls=16)
    t = graph_seconds([lambda s=s: gguf_moe_glu(x, gate, up, s, i8=i8, routes=ROUTES) for s in slots], repeat)
    return {"us": t * 1e6, "GB/s": 2 * distinct_experts(slots) * expert_bytes / t / 1e9}


def moe_peer_decode(shape: tuple[int, int], repeat: int) -> dict:
    """bmm of one token's input with its 8 experts' bfloat16 weights, already stacked (the peer's best case)."""
    rows, cols = shape
    nbytes = TOP_K * rows * cols * 2
    stacks = [torch.randn(TOP_K, cols, rows, device="cuda", dtype=torch.bfloat16) for _ in range(copies_for(nbytes))]
    x = torch.randn(TOP_K, 1, cols, device="cuda", dtype=torch.bfloat16)
    t = graph_seconds([lambda s=s: torch.bmm(x, s) for s in stacks], repeat)
    return {"us": t * 1e6, "GB/s": nbytes / t / 1e9}


def i8_route(qtype: Q) -> bool:
    return ROUTES.gemv and BLOCK_TYPES[qtype].dot8 is not None


def i8_candidates(n_blocks: int) -> list[tuning.GemvTiles]:
    """Tiles for the 8-bit route (its blocks are the route's units, qtypes.BlockType.dot8_values): a thread holds a
    quad's four words of R*B / (32 * warps) (row, unit) pairs, one to four (fewer leave threads idle; more than two
    spilled on the route's first, block-per-lane, form), B up to the row's units."""
    widest = min(32, triton.next_power_of_2(n_blocks))
    tiles = []
    for warps in (1, 2):  # 4 warps and B below a quarter of the row never won a sweep of this kernel
        for pairs in (1, 2, 4):
            for blocks in (widest // 4, widest // 2, widest):
                rows = 32 * warps * pairs // max(blocks, 1)
                if blocks >= 1 and 1 <= rows <= 64:
                    tiles.append(tuning.GemvTiles(rows, blocks, warps))
    return tiles


def batch_candidates(n_tokens: int) -> list[tuning.GemvTiles]:
    """Dense 8-bit tiles for a decode batch of n_tokens: R rows x B blocks with every accumulator in registers
    (tuning.gemv_tiles' budget: T x R x B x 8 per 32 threads of a warp at most GEMV_ACCUMULATORS_PER_THREAD), rows
    first: a program reads the whole input once, so more rows per program read it fewer times over."""
    tiles = []
    for warps in (1, 2, 4):
        budget = tuning.GEMV_ACCUMULATORS_PER_THREAD * 32 * warps // (8 * n_tokens)  # R x B
        for rows in (2, 4, 8, 16, 32, 64):
            blocks = budget // rows
            if 1 <= blocks <= 32 and blocks & (blocks - 1) == 0:
                tiles.append(tuning.GemvTiles(rows, blocks, warps))
    return tiles


def sweep_batch_gemv(qtype: Q, n_tokens: int, repeat: int) -> tuple[dict, list]:
    """The dense matrix-vector kernel on the 8-bit route at T = n_tokens (a `moerun serve` decode batch), over
    batch_candidates, against the route tuning.py takes there (the weight decoded to bfloat16 and cuBLAS from
    DECODED_GEMM_MIN_TOKENS on). The shipped tiles are left as they were."""
    timed = []
    with patch.dict(tuning.GEMV_I8_OVERRIDES), tuned(**ON_BLOCKS):
        for tiles in batch_candidates(n_tokens):
            tuning.GEMV_I8_OVERRIDES[qtype] = tiles
            timed.append((guarded(dense_decode, qtype, n_tokens, repeat), tiles))
    with tuned(**DECODED):
        decoded = guarded(dense_decode, qtype, n_tokens, repeat)["us"]
    best = fastest([(measured["GB/s"], tiles) for measured, tiles in timed])
    best_us = next(measured["us"] for measured, tiles in timed if tiles is best)
    return (
        {"best": best.__dict__, "us": best_us, "decoded us": decoded},
        [(round(measured["us"], 1), tiles.__dict__) for measured, tiles in timed],
    )


def sweep_gemv(qtype: Q, repeat: int) -> tuple[tuning.GemvTiles, list]:
    """The dense matrix-vector kernel's tiles at T=1 (the 8-bit route's where the type takes it)."""
    bt = BLOCK_TYPES[qtype]
    table = tuning.GEMV_I8_OVERRIDES if i8_route(qtype) else tuning.GEMV_OVERRIDES
    if i8_route(qtype):
        candidates = i8_candidates(DENSE[1] // bt.dot8_values)
    else:
        shapes = [(2, 4), (4, 4), (8, 4), (4, 8)] if bt.values == 256 else [(4, 16), (8, 8), (8, 16), (16, 16)]
        candidates = [tuning.GemvTiles(rows, blocks, warps) for rows, blocks in shapes for warps in (1, 2, 4)]
    results = []
    for tiles in candidates:
        table[qtype] = tiles
        results.append((guarded(dense_decode, qtype, 1, repeat)["GB/s"], tiles))
    best = fastest(results)
    table[qtype] = best
    return best, [(round(gbs), t.__dict__) for gbs, t in results]


def sweep_grouped_gemv(
    name: str, qtype: Q, shape: tuple[int, int], per_pair: bool, repeat: int
) -> tuple[tuning.GemvTiles, list]:
    """Tiles of the grouped decode on one expert shape (gate/up timed as gguf_moe_glu, the launch decode runs):
    more rows per program for short rows, 1-4 warps. Sets tuning.GEMV_GROUPED_OVERRIDES for the shape."""
    rows, cols = shape
    bt = BLOCK_TYPES[qtype]
    key = (qtype, cols // bt.values)
    table = tuning.GEMV_I8_GROUPED_OVERRIDES if i8_route(qtype) else tuning.GEMV_GROUPED_OVERRIDES
    if i8_route(qtype):
        candidates = i8_candidates(cols // bt.dot8_values)
    else:
        blocks = (1, 2, 4) if bt.values == 256 else (4, 8, 16)
        candidates = [tuning.GemvTiles(r, b, warps) for r in (4, 8, 16, 32) for b in blocks for warps in (1, 2, 4)]
    results = []
    for tiles in candidates:
        table[key] = tiles
        measured = (
            guarded(moe, qtype, shape, True, 1, repeat) if per_pair else guarded(moe_glu, qtype, shape, 1, repeat)
        )
        results.append((measured["GB/s"], tiles))
    best = fastest(results)
    table[key] = best
    return best, [(round(gbs), t.__dict__) for gbs, t in results]


def sweep_gemm(qtype: Q, repeat: int) -> tuple[tuning.GemmTiles, list]:
    v = BLOCK_TYPES[qtype].values
    b = 1 if v == 256 else 4
    candidates = [
        tuning.GemmTiles(64, 64, b, 4, 2),
        tuning.GemmTiles(64, 128, b, 4, 3),
        tuning.GemmTiles(128, 64, b, 4, 3),
        tuning.GemmTiles(128, 128, b, 8, 3),
        tuning.GemmTiles(64, 128, 2 * b, 8, 3),
    ]
    results = []
    for tiles in candidates:
        tuning.DENSE_GEMM_OVERRIDES[qtype] = tiles
        with tuned(**ON_BLOCKS):
            results.append((guarded(gemm, qtype, repeat)["TFLOP/s"], tiles))
    best = fastest(results)
    tuning.DENSE_GEMM_OVERRIDES[qtype] = best
    return best, [(round(tf, 1), t.__dict__) for tf, t in results]


def sweep_grouped_gemm(
    qtype: Q, shape: tuple[int, int], per_pair: bool, repeat: int, i8: bool = False, n_tokens: int = PREFILL_T
) -> tuple[tuning.GemmTiles, list]:
    """Tiles of the grouped prefill GEMM on one expert shape at T = n_tokens (512: about 32 pairs per expert): fewer
    rows per tile than the dense kernel's, wider weight tiles. Sets tuning.GROUPED_GEMM_OVERRIDES for the shape; with
    `i8` those of the 8-bit GEMM (gemm8_candidates, tuning.GEMM_I8_GROUPED_OVERRIDES, or GEMM_I8_FEW_TOKENS_OVERRIDES
    for a step of at most GEMM_I8_FEW_TOKENS tokens)."""
    rows, cols = shape
    bt = BLOCK_TYPES[qtype]
    key = (qtype, cols // bt.values)
    b = 1 if bt.values == 256 else 4
    candidates = (
        gemm8_candidates()
        if i8
        else (
            [
                tuning.GemmTiles(bm, bn, b, warps, stages)
                for bm in (16, 32, 64)
                for bn in (64, 128)
                for warps, stages in ((4, 2), (4, 3), (8, 3))
            ]
            + [tuning.GemmTiles(32, 64, 2 * b, 4, 3)]
        )
    )
    if i8:
        few = n_tokens <= tuning.GEMM_I8_FEW_TOKENS
        table = tuning.GEMM_I8_FEW_TOKENS_OVERRIDES if few else tuning.GEMM_I8_GROUPED_OVERRIDES
    else:
        table = tuning.GROUPED_GEMM_OVERRIDES
    results = []
    # the GEMM at any size: the experts of a step of up to MOE_GEMV_MAX_TOKENS would take the matrix-vector kernel
    with tuned(GEMM_INT8=i8, MOE_GEMV_MAX_TOKENS=0, GEMM_I8_MIN_TOKENS=0 if i8 else 1 << 30):
        for tiles in candidates:
            table[key] = tiles
            results.append((guarded(moe, qtype, shape, per_pair, n_tokens, repeat)["TFLOP/s"], tiles))
    best = fastest(results)
    table[key] = best
    return best, [(round(tf, 1), t.__dict__) for tf, t in results]


def gemm8_candidates() -> list[tuning.GemmTiles]:
    """Tiles of the 8-bit GEMM for the grouped prefill: 16-64 pairs x 64-256 rows (about 32 pairs per expert at
    T = 512, 16 at 256), 2 to 8 warps."""
    return [
        tuning.GemmTiles(bm, bn, 1, warps, 3)
        for bm, bn, warps in (
            (16, 64, 2),
            (16, 64, 4),
            (16, 128, 4),
            (16, 128, 8),
            (16, 256, 8),
            (32, 64, 2),
            (32, 64, 4),
            (32, 128, 4),
            (32, 128, 8),
            (32, 256, 8),
            (64, 64, 4),
            (64, 128, 4),
            (64, 128, 8),
        )
    ]


def sweep_gemm8(repeat: int, shapes: str, n_tokens: int = PREFILL_T) -> dict:
    """The 8-bit GEMM's tiles on each expert shape at T = n_tokens (sweep_grouped_gemm), next to the bfloat16 GEMM
    on its own tiles."""
    found = {}
    for name, qtype, shape, per_pair in MOE_SHAPES:
        if shapes not in name or BLOCK_TYPES[qtype].gemm8 is None:
            continue
        with tuned(GEMM_INT8=False, MOE_GEMV_MAX_TOKENS=0):
            before = guarded(moe, qtype, shape, per_pair, n_tokens, repeat)["TFLOP/s"]
        best, table = sweep_grouped_gemm(qtype, shape, per_pair, repeat, i8=True, n_tokens=n_tokens)
        key = f"(Q.{qtype.name}, {shape[1] // BLOCK_TYPES[qtype].values})"
        print(
            f"sweep 8-bit GEMM {name} {qtype.name} T={n_tokens} (TFLOP/s; bf16 GEMM {before:.1f}): {table} -> "
            f"{key}: {best}",
            flush=True,
        )
        found[f"{name} {qtype.name}"] = {"bf16 TFLOP/s": before, "table": table}
    return found


def sweep_moe_routes(repeat: int, shapes: str, token_counts: list[int]) -> dict:
    """The experts' three routes at prompt sizes, us a call, each on its shipped tiles: the matrix-vector kernel over
    every (token, expert) pair (gate/up: both banks in one gguf_moe_glu launch, as decode and short prompts run them,
    and one bank), the bfloat16 grouped GEMM and the 8-bit grouped GEMM (one bank; gate/up takes two of them). Where
    tuning.MOE_GEMV_MAX_TOKENS, MOE_GLU_GEMV_MAX_TOKENS and GEMM_I8_MIN_TOKENS come from."""
    found = {}
    for name, qtype, shape, per_pair in MOE_SHAPES:
        if shapes not in name:
            continue
        for n_tokens in token_counts:
            row = {}
            with tuned(MOE_GEMV_MAX_TOKENS=1 << 30, MOE_GLU_GEMV_MAX_TOKENS=1 << 30):
                row["gemv"] = guarded(moe, qtype, shape, per_pair, n_tokens, repeat)["us"]
                if not per_pair:
                    row["gemv glu, both banks"] = guarded(moe_glu, qtype, shape, n_tokens, repeat)["us"]
            with tuned(MOE_GEMV_MAX_TOKENS=0, GEMM_INT8=False):
                row["bf16 gemm"] = guarded(moe, qtype, shape, per_pair, n_tokens, repeat)["us"]
            if BLOCK_TYPES[qtype].gemm8 is not None:
                with tuned(MOE_GEMV_MAX_TOKENS=0, GEMM_I8_MIN_TOKENS=0):
                    row["8-bit gemm"] = guarded(moe, qtype, shape, per_pair, n_tokens, repeat)["us"]
            print(
                f"routes {name} {qtype.name} T={n_tokens} (us): " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()),
                flush=True,
            )
            found[f"{name} {qtype.name} T={n_tokens}"] = row
    return found


# The dense products the 8-bit GEMM's tiles are swept on: the 4096x4096 of the other rows, and Qwen3-30B-A3B's
# attention, its fused q/k/v (5120 rows x 2048) and its output (2048 x 4096). (rows, cols)
DENSE8_SHAPES = ((4096, 4096), (5120, 2048), (2048, 4096))


def dense8_candidates(block_values: int) -> list[tuning.GemmTiles]:
    """Tiles of the 8-bit GEMM for a dense product of a few tokens (one 16-token tile): 16-64 rows, 1-2 blocks per K
    step (1 of the K-quants' 256 values), K split over 2-16 programs, 2 or 4 warps."""
    steps = (1,) if block_values == 256 else (1, 2)
    return [
        tuning.GemmTiles(16, bn, b, warps, 3, split)
        for bn in (16, 32, 64)
        for b in steps
        for warps in (2, 4)
        for split in (2, 4, 8, 16)
    ]


def sweep_dense8(repeat: int, dump_to: str | None = None) -> dict:
    """The 8-bit GEMM's tiles for dense products of 8 tokens (tuning.DENSE_I8_OVERRIDES): the fewest microseconds
    over DENSE8_SHAPES; then, on those tiles, 2 to 32 tokens on the 4096x4096 and 8 on the others, against the route
    tuning.py takes without it (the matrix-vector kernel below DECODED_GEMM_MIN_TOKENS, then the decoded weight and
    cuBLAS), us per product."""
    found = {}
    for qtype in (Q.Q8_0, Q.Q4_K, Q.Q4_0):  # the types with a gemm8 decoder, the 30B model's attention's first
        timed = []
        with tuned(**ON_I8):
            for tiles in dense8_candidates(BLOCK_TYPES[qtype].values):
                tuning.DENSE_I8_OVERRIDES[qtype] = tiles
                timed.append(
                    (sum(guarded(dense_decode, qtype, 8, repeat, shape)["us"] for shape in DENSE8_SHAPES), tiles)
                )
        best = tuning.DENSE_I8_OVERRIDES[qtype] = fastest([(-us, tiles) for us, tiles in timed])
        table = sorted(((round(us, 1), t.__dict__) for us, t in timed if us == us), key=lambda r: r[0])
        print(
            f"sweep dense 8-bit GEMM {qtype.name} T=8 (us over {len(DENSE8_SHAPES)} shapes, best first): "
            f"{table[:6]} -> Q.{qtype.name}: {best}",
            flush=True,
        )
        found[f"{qtype.name} sweep"] = table
        for shape, n_tokens in [(DENSE, n) for n in (2, 3, 4, 8, 16, 32)] + [(s, 8) for s in DENSE8_SHAPES[1:]]:
            with tuned(DENSE_I8_MAX_TOKENS=0):
                before = guarded(dense_decode, qtype, n_tokens, repeat, shape)["us"]
            with tuned(**ON_I8):
                ours = guarded(dense_decode, qtype, n_tokens, repeat, shape)["us"]
            name = f"{shape[0]}x{shape[1]} {qtype.name} T={n_tokens}"
            print(f"dense {name}: 8-bit GEMM {ours:.1f} us, without it {before:.1f}", flush=True)
            found[name] = {"8-bit GEMM us": ours, "without us": before}
        if dump_to:  # a sweep cut short by a time limit keeps the types it finished
            dump({"sweep dense8": found}, dump_to)
    return found


BF16_SHAPES = DENSE8_SHAPES + ((151936, 2048),)  # ... and the 30B model's output head


def bf16_product(n_tokens: int, repeat: int, shape: tuple[int, int]) -> dict:
    """One dense product of n_tokens over a kept bfloat16 copy of a weight (quantized.keep_decoded_copies):
    gguf_matmul.bf16_mm, cuBLAS to float32."""
    rows, cols = shape
    weight = torch.randn(rows, cols, device="cuda").to(torch.bfloat16)
    weights = [weight.clone() for _ in range(copies_for(2 * weight.numel()))]
    x = torch.randn(n_tokens, cols, device="cuda")
    t = graph_seconds([lambda w=w: bf16_mm(x, w) for w in weights], repeat)
    return {"us": t * 1e6, "GB/s": 2 * weight.numel() / t / 1e9}


def bf16_routes(repeat: int) -> dict:
    """1-16 tokens on each of BF16_SHAPES over a kept bfloat16 copy against the Q8_0 blocks' route (gguf_mm, what
    runs without the copies), us per product (tuning.KEPT_DECODED_MIN_TOKENS)."""
    found = {}
    for shape in BF16_SHAPES:
        for n_tokens in (1, 2, 3, 4, 8, 16):
            copy = guarded(bf16_product, n_tokens, repeat, shape)
            blocks = guarded(dense_decode, Q.Q8_0, n_tokens, repeat, shape)
            name = f"{shape[0]}x{shape[1]} T={n_tokens}"
            print(
                f"{name}: bfloat16 copy on cuBLAS {copy['us']:.1f} us ({copy['GB/s']:.0f} GB/s), Q8_0 blocks "
                f"{blocks['us']:.1f} ({blocks['GB/s']:.0f})",
                flush=True,
            )
            found[name] = {"bfloat16 copy": copy, "Q8_0 blocks": blocks}
    return found


def gemm(qtype: Q, repeat: int, n_tokens: int = PREFILL_T) -> dict:
    rows, cols = DENSE
    bank = random_bank(qtype, 1, rows, cols)[0]
    weights = [QWeight(bank.clone(), qtype, rows, cols) for _ in range(copies_for(bank.numel()))]
    x = torch.randn(n_tokens, cols, device="cuda", dtype=torch.bfloat16)
    t = graph_seconds([lambda w=w: gguf_mm(x, w, routes=ROUTES) for w in weights], repeat)
    return {"us": t * 1e6, "TFLOP/s": 2 * n_tokens * rows * cols / t / 1e12}


BLOCKS_ONLY = 1 << 30  # DECODED_GEMM_MIN_TOKENS that keeps every product on the GEMM over the blocks
# tuning.py's routes for a dense product, each forced for any token count: the kernels over the blocks (the
# matrix-vector kernel up to GEMV_MAX_TOKENS, the bfloat16 GEMM past it), the weight decoded to bfloat16 and cuBLAS,
# the 8-bit GEMM
ON_BLOCKS = {"DECODED_GEMM_MIN_TOKENS": BLOCKS_ONLY, "DENSE_I8_MAX_TOKENS": 0}
DECODED = {"DECODED_GEMM_MIN_TOKENS": 1, "DENSE_I8_MAX_TOKENS": 0}
ON_I8 = {"DENSE_I8_MIN_TOKENS": 1, "DENSE_I8_MAX_TOKENS": 1 << 30}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sweep",
        nargs="?",
        const="all",
        choices=["all", "grouped", "batch", "gemm8", "dense8", "routes", "bf16"],
        help="time tile candidates first (grouped: the grouped decode's only; batch: only the dense "
        "8-bit tiles at T = 4 and 8, against the decoded route, then stop; gemm8: only the 8-bit "
        "GEMM's tiles on the expert shapes at T = 512, then stop; dense8: only its tiles for "
        "dense products of 8 tokens, then 2-32 tokens against the route taken without it, then "
        "stop; routes: the experts' routes at --token-counts, then stop; bf16: dense products of "
        "1-16 tokens over a kept bfloat16 copy against the Q8_0 blocks, then stop)",
    )
    parser.add_argument("--shapes", default="", help="sweep only the expert shapes whose name has this text")
    parser.add_argument("--tokens", type=int, default=PREFILL_T, help="the tokens of --sweep gemm8's prompt")
    parser.add_argument("--token-counts", default="16,32,64,128,256", help="the prompt sizes of --sweep routes")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--json")
    parser.add_argument("--decode-only", action="store_true", help="sweep and time the decode kernels only")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="time only what a one-sequence decode step runs (T = 1, the route tuning.py picks), "
        "for a before/after comparison in the same device call",
    )
    parser.add_argument(
        "--carried",
        action="store_true",
        help="decode inputs come rounded for the 8-bit route, as in a decode step: time the kernel alone",
    )
    args = parser.parse_args()
    args.decode_only |= args.quick
    global CARRIED
    CARRIED = args.carried
    r = args.repeat
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    results["copy GB/s"] = copy = copy_bandwidth(r)
    print(f"{results['device']}  torch {torch.__version__}  triton {triton.__version__}  HBM copy {copy:.0f} GB/s")
    if args.sweep == "gemm8":  # the 8-bit GEMM's tiles on the expert shapes, then stop
        results["sweep gemm8"] = sweep_gemm8(r, args.shapes, args.tokens)
        dump(results, args.json)
        return
    if args.sweep == "bf16":
        results["bf16 routes"] = bf16_routes(r)
        dump(results, args.json)
        return
    if args.sweep == "routes":
        results["sweep routes"] = sweep_moe_routes(r, args.shapes, [int(t) for t in args.token_counts.split(",")])
        dump(results, args.json)
        return
    if args.sweep == "dense8":
        results["sweep dense8"] = sweep_dense8(r, args.json)
        dump(results, args.json)
        return
    if args.sweep == "batch":  # does a serve batch's dense product beat the decoded route on the 8-bit kernel?
        for n_tokens in (4, 8):
            for qtype in (q for q in DENSE_TYPES if i8_route(q)):
                best, table = sweep_batch_gemv(qtype, n_tokens, r)
                results[f"sweep batch gemv {qtype.name} T={n_tokens}"] = {"best": best, "table": table}
                print(f"sweep batch GEMV {qtype.name} T={n_tokens}: {table} -> {best}", flush=True)
        dump(results, args.json)
        return
    if args.sweep:
        for qtype in DENSE_TYPES if args.sweep == "all" else ():
            best, table = sweep_gemv(qtype, r)
            results[f"sweep gemv {qtype.name}"] = table
            print(f"sweep GEMV {qtype.name}: {table} -> {best}", flush=True)
        for name, qtype, shape, per_pair in MOE_SHAPES:
            if args.shapes not in name:
                continue
            best, table = sweep_grouped_gemv(name, qtype, shape, per_pair, r)
            results[f"sweep grouped gemv {name} {qtype.name}"] = table
            key = f"(Q.{qtype.name}, {shape[1] // BLOCK_TYPES[qtype].values})"
            print(f"sweep grouped GEMV {name} {qtype.name}: {table} -> {key}: {best}", flush=True)
            dump(results, args.json)  # a sweep cut short by a time limit keeps the shapes it finished
        for qtype in () if args.decode_only else (Q.Q4_K, Q.Q8_0):
            best, table = sweep_gemm(qtype, r)
            results[f"sweep gemm {qtype.name}"] = table
            print(f"sweep GEMM {qtype.name}: {table} -> {best}", flush=True)
        for name, qtype, shape, per_pair in () if args.decode_only else MOE_SHAPES:
            best, table = sweep_grouped_gemm(qtype, shape, per_pair, r)
            results[f"sweep grouped gemm {name} {qtype.name}"] = table
            key = f"(Q.{qtype.name}, {shape[1] // BLOCK_TYPES[qtype].values})"
            print(f"sweep grouped GEMM {name} {qtype.name}: {table} -> {key}: {best}", flush=True)
    print(f"\n{'shape':48} {'type':6} {'us':>8} {'GB/s':>7} {'% copy':>7}   {'bf16 peer us':>12} {'GB/s':>7}")

    def report(shape: str, qname: str, ours: dict, peer: dict | None) -> None:
        theirs = f"{peer['us']:12.1f} {peer['GB/s']:7.0f}" if peer is not None else ""
        print(
            f"{shape:48} {qname:6} {ours['us']:8.1f} {ours['GB/s']:7.0f} {100 * ours['GB/s'] / copy:6.0f}%   {theirs}",
            flush=True,
        )
        results[f"{shape} {qname}"] = {"ours": ours, "peer": peer}

    # a decode step of as many sequences: the matrix-vector kernel, then the decoded
    for n_tokens in (1,) if args.quick else (1, 2, 4, 8):
        peer = guarded(dense_peer, n_tokens, r)
        for qtype in DENSE_TYPES:
            with tuned(**ON_BLOCKS):
                report(
                    f"4096x4096 T={n_tokens}" + " GEMV" * (n_tokens > 1),
                    qtype.name,
                    guarded(dense_decode, qtype, n_tokens, r),
                    peer,
                )
            if i8_route(qtype) and not args.quick:  # the same on float32 activations
                with tuned(**ON_BLOCKS, GEMV_INT8=False):
                    report(
                        f"4096x4096 T={n_tokens}" + " GEMV" * (n_tokens > 1) + " float",
                        qtype.name,
                        guarded(dense_decode, qtype, n_tokens, r),
                        peer,
                    )
            if n_tokens > 1:
                with tuned(**DECODED):
                    report(
                        f"4096x4096 T={n_tokens} decoded", qtype.name, guarded(dense_decode, qtype, n_tokens, r), peer
                    )
            if n_tokens > 1 and BLOCK_TYPES[qtype].gemm8 is not None:
                with tuned(**ON_I8):
                    report(
                        f"4096x4096 T={n_tokens} 8-bit GEMM",
                        qtype.name,
                        guarded(dense_decode, qtype, n_tokens, r),
                        peer,
                    )
    for float_route in (False,) if args.quick else (False, True):  # then on float32 activations (8-bit types)
        label = " float" if float_route else ""
        with tuned(GEMV_INT8=ROUTES.gemv and not float_route):
            for name, qtype, shape, per_pair in MOE_SHAPES:
                if float_route and BLOCK_TYPES[qtype].dot8 is None:
                    continue
                report(
                    f"{name} 8/128 T=1{label}",
                    qtype.name,
                    guarded(moe, qtype, shape, per_pair, 1, r),
                    guarded(moe_peer_decode, shape, r),
                )
                if not per_pair:  # gate and up as decode runs them: one launch with the SwiGLU (peer: two bmm)
                    peer = guarded(moe_peer_decode, shape, r)
                    report(
                        f"{name.replace('gate/up', 'gate+up')} GLU 8/128 T=1{label}",
                        qtype.name,
                        guarded(moe_glu, qtype, shape, 1, r),
                        {"us": 2 * peer["us"], "GB/s": peer["GB/s"]},
                    )
            for name, qtype, shape, per_pair in () if args.quick else MOE_SHAPES:  # 8 sequences: a group per pair
                if float_route and BLOCK_TYPES[qtype].dot8 is None:
                    continue
                ours = (
                    guarded(moe, qtype, shape, True, DECODE_T, r)
                    if per_pair
                    else guarded(moe_glu, qtype, shape, DECODE_T, r)
                )
                name = name if per_pair else f"{name.replace('gate/up', 'gate+up')} GLU"
                report(f"{name} 8/128 T={DECODE_T}{label}", qtype.name, ours, None)
    if args.decode_only:
        dump(results, args.json)
        print("tiles:", json.dumps(results["tiles"]))
        return
    print(f"\n{'prefill':48} {'type':6} {'us':>8} {'TFLOP/s':>8}   {'bf16 peer us':>12} {'TFLOP/s':>8}")
    for n_tokens in (64, 128, PREFILL_T):  # the GEMM on the blocks, and the weight decoded to bfloat16 + cuBLAS
        peer = guarded(dense_peer, n_tokens, r)
        for qtype in DENSE_TYPES:
            routes = [("blocks GEMM", ON_BLOCKS), ("decoded + cuBLAS", DECODED)]
            if BLOCK_TYPES[qtype].gemm8 is not None:
                routes.append(("8-bit GEMM", ON_I8))
            for route, values in routes:
                with tuned(**values):
                    ours = guarded(gemm, qtype, r, n_tokens)
                label = f"4096x4096 T={n_tokens} {route}"
                print(
                    f"{label:48} {qtype.name:6} {ours['us']:8.1f} {ours['TFLOP/s']:8.1f}   {peer['us']:12.1f} "
                    f"{peer['TFLOP/s']:8.1f}",
                    flush=True,
                )
                results[f"prefill {label} {qtype.name}"] = {"ours": ours, "peer": peer}
    for name, qtype, shape, per_pair in MOE_SHAPES:  # the 8-bit GEMM where the type has one, then the bfloat16 one
        for i8 in (True, False) if BLOCK_TYPES[qtype].gemm8 is not None else (False,):
            with tuned(GEMM_INT8=i8):
                ours = guarded(moe, qtype, shape, per_pair, PREFILL_T, r)
            label = f"{name} 8/128{' 8-bit' if i8 else ''}"
            print(f"{label:48} {qtype.name:6} {ours['us']:8.1f} {ours['TFLOP/s']:8.1f}", flush=True)
            results[f"prefill {label} {qtype.name}"] = {"ours": ours}
    dump(results, args.json)
    print("tiles:", json.dumps(results["tiles"]))


def dump(results: dict, path: str | None) -> None:
    """The tiles the run used, printed; all results into `path` as JSON."""
    results["tiles"] = {
        "gemv": {q.name: t.__dict__ for q, t in tuning.GEMV_OVERRIDES.items()},
        "grouped gemv": {f"{q.name} {n}": t.__dict__ for (q, n), t in tuning.GEMV_GROUPED_OVERRIDES.items()},
        "8-bit gemv": {q.name: t.__dict__ for q, t in tuning.GEMV_I8_OVERRIDES.items()},
        "8-bit grouped gemv": {f"{q.name} {n}": t.__dict__ for (q, n), t in tuning.GEMV_I8_GROUPED_OVERRIDES.items()},
        "gemm": {q.name: t.__dict__ for q, t in tuning.DENSE_GEMM_OVERRIDES.items()},
        "grouped gemm": {f"{q.name} {n}": t.__dict__ for (q, n), t in tuning.GROUPED_GEMM_OVERRIDES.items()},
        "8-bit grouped gemm": {f"{q.name} {n}": t.__dict__ for (q, n), t in tuning.GEMM_I8_GROUPED_OVERRIDES.items()},
        "8-bit dense gemm": {q.name: t.__dict__ for q, t in tuning.DENSE_I8_OVERRIDES.items()},
    }
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
