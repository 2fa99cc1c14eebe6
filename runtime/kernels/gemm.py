"""The GEMM kernels over GGUF blocks, for products of many tokens (prefill), and the decode to bfloat16.

- `_gemm_kernel` decodes a [BN rows, B blocks] tile per K step to bfloat16 and multiplies it with a [BM tokens, K]
  input tile through tl.dot, accumulating in float32;
- on the types with a qtypes gemm8 decoder, `_gemm_i8_kernel` instead multiplies int8 tiles of the quants with int8
  activations (act_i8) per 32 values on tensor cores, for the experts of a long prompt step (tuning.Int8Routes.gemm,
  GEMM_I8_MIN_TOKENS) and for dense products of a few tokens (DENSE_I8_MIN_TOKENS .. DENSE_I8_MAX_TOKENS: a decode
  batch, a short prompt), K split over several programs there;
- `_decode_kernel` decodes a weight to bfloat16 once, for a dense product of more tokens on a GPU, which then
  multiplies on cuBLAS.
The GEMMs take their tokens dense, or grouped by expert (moe_align.group_by_slot): a bank slot per block of BM
(token, expert) pairs, -1 for a spare block, which reads no weight bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moerun.kernels import tuning
from moerun.kernels.act_i8 import QAct, quantize_i8
from moerun.kernels.qtypes import INTERPRETED, BlockType
from moerun.kernels.qweight import QWeight


@triton.jit
def _program_ids(
    m, ids_ptr, block_slot_ptr, w_ptr, n_ids, n_blocks, slot_bytes, BM: tl.constexpr, GROUPED: tl.constexpr
):
    """A GEMM program's BM ids (-> ids, ok, the weight's base, its K steps): dense, ids m*BM + j < n_ids (token =
    id); GROUPED, ids_ptr[m*BM + j], (token, expert) pair ids (-1 padding), all for bank slot block_slot_ptr[m] (-1: a
    spare block past the last group, no K steps)."""
    ids = m * BM + tl.arange(0, BM)
    if GROUPED:
        ids = tl.load(ids_ptr + ids)
        slot = tl.load(block_slot_ptr + m)
        return ids, ids >= 0, w_ptr + tl.maximum(slot, 0).to(tl.int64) * slot_bytes, tl.where(slot >= 0, n_blocks, 0)
    return ids, ids < n_ids, w_ptr, n_blocks


@triton.jit(do_not_specialize=["n_ids"])
def _gemm_kernel(
    x_ptr,
    w_ptr,
    ids_ptr,
    block_slot_ptr,
    out_ptr,
    n_ids,
    n_rows,
    n_blocks,
    row_bytes,
    slot_bytes,
    cols,
    x_div,
    DECODE: tl.constexpr,
    V: tl.constexpr,
    S: tl.constexpr,
    P: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    B: tl.constexpr,
    GROUPED: tl.constexpr,
    DOT_IN_F32: tl.constexpr,
):
    """Program (m, i): output rows i*BN .. i*BN+BN-1 for the BM ids of _program_ids (dense or GROUPED). An id reads
    input row id // x_div and writes output row id."""
    m = tl.program_id(0)
    r = tl.program_id(1) * BN + tl.arange(0, BN)
    ids, ok, w_base, n_steps = _program_ids(m, ids_ptr, block_slot_ptr, w_ptr, n_ids, n_blocks, slot_bytes, BM, GROUPED)
    x_row = (tl.where(ok, ids, 0) // x_div)[:, None] * cols  # [BM, 1]
    row_ptr = w_base + tl.minimum(r, n_rows - 1)[:, None, None] * row_bytes  # [BN, 1, 1]
    lane = tl.arange(0, P)
    acc = tl.zeros((BM, BN), tl.float32)
    for kb in range(0, n_steps, B):
        b = kb + tl.arange(0, B)
        col_ok = tl.reshape(tl.broadcast_to((b < n_blocks)[:, None], (B, P)), (B * P,))
        b = tl.minimum(b, n_blocks - 1)
        blk = row_ptr + b[None, :, None] * S  # [BN, B, 1]
        for part in tl.static_range(V // P):
            w = tl.reshape(DECODE(blk, lane[None, None, :], part), (BN, B * P))
            col = tl.reshape(b[:, None] * V + part * P + lane[None, :], (B * P,))
            xv = tl.load(x_ptr + x_row + col[None, :], mask=ok[:, None] & col_ok[None, :], other=0.0)
            if DOT_IN_F32:
                acc = tl.dot(xv.to(tl.float32), tl.trans(w), acc, input_precision="ieee")
            else:
                acc = tl.dot(xv.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)), acc)
    tl.store(out_ptr + ids[:, None] * n_rows + r[None, :], acc, mask=ok[:, None] & (r < n_rows)[None, :])


@triton.jit(do_not_specialize=["n_ids"])
def _gemm_i8_kernel(
    xq_ptr,
    xd_ptr,
    xs_ptr,
    w_ptr,
    ids_ptr,
    block_slot_ptr,
    out_ptr,
    sum_ptr,
    counter_ptr,
    n_ids,
    n_rows,
    n_blocks,
    row_bytes,
    slot_bytes,
    cols,
    x_div,
    split_blocks,
    DECODE: tl.constexpr,
    V: tl.constexpr,
    S: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    B: tl.constexpr,
    MINS: tl.constexpr,
    GROUPED: tl.constexpr,
    EVEN_K: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """_gemm_kernel's programs and ids on the 8-bit route: quantize_i8's activations (int8 quants at xq_ptr, their
    scale d per 32 values at xd_ptr, d * (sum of quants) per 16 at xs_ptr) times the weights' quants (DECODE: a
    qtypes gemm8 decoder), B blocks per K step and one tl.dot of [BM, 32] x [32, BN] int8 per 32 values, exact in
    int32 on tensor cores; each adds dot * d * scale (+ offset * d * sum(q_x) with MINS, the K-quants') to the float32
    accumulators. Program (m, i, k) covers blocks k*split_blocks .. +split_blocks of the rows (a dense product of a
    few tokens splits K so that enough programs read the weight) and writes its partial sums at out_ptr + k * n_ids *
    n_rows; with SPLIT the last of a tile's programs to finish adds them up, in split order, into sum_ptr (the tile's
    arrivals counted at counter_ptr, zeros that it leaves as it found them). The grouped products run one split.
    EVEN_K: every split is whole K steps (no block to mask)."""
    m = tl.program_id(0)
    r = tl.program_id(1) * BN + tl.arange(0, BN)
    ids, ok, w_base, n_steps = _program_ids(m, ids_ptr, block_slot_ptr, w_ptr, n_ids, n_blocks, slot_bytes, BM, GROUPED)
    first = tl.program_id(2) * split_blocks
    last = tl.minimum(n_steps, first + split_blocks)
    x_row = (tl.where(ok, ids, 0) // x_div).to(tl.int64)  # [BM]
    row_ptr = w_base + tl.minimum(r, n_rows - 1)[:, None] * row_bytes  # [BN, 1]
    lane = tl.arange(0, 32)[None, :]
    acc = tl.zeros((BM, BN), tl.float32)
    for kb in range(first, last, B):
        for j in tl.static_range(B):
            # [BM] (a block past the split's end: block `last - 1` read again, adds 0); not `ok & (...)`: the
            # interpreter makes that int32, which its loads refuse as a mask
            in_k = tl.where(kb + j < last, ok, False)
            for part in tl.static_range(V // 32):
                q, scale, offset = DECODE(row_ptr + tl.minimum(kb + j, last - 1) * S, lane, part)  # [BN, 32], [BN, 1]
                unit = (kb + j) * (V // 32) + part  # the activations' block of 32
                xq = tl.load(xq_ptr + x_row[:, None] * cols + unit * 32 + lane, mask=in_k[:, None], other=0)  # int8
                xd = tl.load(xd_ptr + x_row * (cols // 32) + unit, mask=in_k, other=0.0)  # [BM]
                dot = tl.dot(xq, tl.trans(q.to(tl.int8)), out_dtype=tl.int32).to(tl.float32)
                if MINS:
                    xs_at = xs_ptr + x_row * (cols // 16) + 2 * unit
                    xs = tl.load(xs_at, mask=in_k, other=0.0) + tl.load(xs_at + 1, mask=in_k, other=0.0)
                if EVEN_K:  # two multiply-adds a part (docs/kernels.md, "The 8-bit GEMM")
                    if MINS:
                        acc += xs[:, None] * tl.reshape(offset, (1, BN))
                    acc += (dot * xd[:, None]) * tl.reshape(scale, (1, BN))
                else:  # a block past the split's end adds 0 (not `term * 0`: a random bench bank's scales may be inf)
                    term = (dot * xd[:, None]) * tl.reshape(scale, (1, BN))
                    if MINS:
                        term += xs[:, None] * tl.reshape(offset, (1, BN))
                    acc += tl.where(in_k[:, None], term, 0.0)
    out_at = ids[:, None] * n_rows + r[None, :]
    out_ok = ok[:, None] & (r < n_rows)[None, :]
    tl.store(out_ptr + tl.program_id(2).to(tl.int64) * n_ids * n_rows + out_at, acc, mask=out_ok)
    if SPLIT:
        # The sum in the last program, not a launch of its own after (~2 us each, a few hundred a decode step of
        # several sequences), and not atomic adds on the output: their order, so the logits, would change run to
        # run. The barrier puts every thread's partial sums before the count, whose release and acquire order them
        # for the program that adds them up; it reads them past L1 (.cg).
        tl.debug_barrier()
        tile = counter_ptr + m * tl.num_programs(1) + tl.program_id(1)
        if tl.atomic_add(tile, 1, sem="acq_rel") == tl.num_programs(2) - 1:
            total = tl.zeros((BM, BN), tl.float32)
            for k in range(tl.num_programs(2)):
                total += tl.load(out_ptr + k * n_ids * n_rows + out_at, mask=out_ok, other=0.0, cache_modifier=".cg")
            tl.store(sum_ptr + out_at, total, mask=out_ok)
            tl.atomic_xchg(tile, 0)


@triton.jit
def _decode_kernel(
    w_ptr,
    out_ptr,
    n_rows,
    n_blocks,
    row_bytes,
    DECODE: tl.constexpr,
    V: tl.constexpr,
    S: tl.constexpr,
    P: tl.constexpr,
    R: tl.constexpr,
    B: tl.constexpr,
):
    """Program (i, j): rows i*R .. i*R+R-1, blocks j*B .. j*B+B-1 of the weight, decoded to bfloat16 into out
    (n_rows, n_blocks * V)."""
    r = tl.program_id(0) * R + tl.arange(0, R)
    b = tl.program_id(1) * B + tl.arange(0, B)
    ok = (r < n_rows)[:, None, None] & (b < n_blocks)[None, :, None]
    blk = (
        w_ptr
        + tl.minimum(r, n_rows - 1).to(tl.int64)[:, None, None] * row_bytes
        + tl.minimum(b, n_blocks - 1)[None, :, None] * S
    )  # [R, B, 1]
    lane = tl.arange(0, P)[None, None, :]
    out_row = out_ptr + r.to(tl.int64)[:, None, None] * (n_blocks * V) + b[None, :, None] * V + lane
    for part in tl.static_range(V // P):
        tl.store(out_row + part * P, DECODE(blk, lane, part).to(tl.bfloat16), mask=ok)


def gemm(
    x: torch.Tensor,
    w: QWeight,
    bt: BlockType,
    out: torch.Tensor,
    n_ids: int,
    x_div: int,
    grouped: tuple[torch.Tensor, torch.Tensor] | None,
    tiles: tuning.GemmTiles,
    on_i8: bool = False,
    i8: QAct | None = None,
) -> None:
    """The GEMM over the blocks: with `on_i8` the 8-bit one (the type's gemm8 decoder) on x's rounding, `i8` where
    given, else made here (quantize_i8); else decoded to bfloat16."""
    ids, block_slot = grouped if grouped is not None else (out, out)
    n_m = block_slot.numel() if grouped is not None else triton.cdiv(n_ids, tiles.block_m)
    row_bytes = w.data.shape[-1]
    if on_i8:
        if i8 is None:
            i8 = quantize_i8(x.reshape(-1, w.cols))
        assert i8.rounds(x, w.cols), (tuple(i8.q.shape), tuple(x.shape))
        n_blocks = w.cols // bt.values
        step_blocks = min(tiles.blocks, n_blocks)
        split_blocks = triton.cdiv(triton.cdiv(n_blocks, tiles.split), step_blocks) * step_blocks
        n_splits = triton.cdiv(n_blocks, split_blocks)
        grid = (n_m, triton.cdiv(w.rows, tiles.block_n), n_splits)
        partial = out if n_splits == 1 else torch.empty(n_splits, *out.shape, dtype=out.dtype, device=out.device)
        counters = out if n_splits == 1 else split_counters(out.device, grid[0] * grid[1])
        _gemm_i8_kernel[grid](
            i8.q,
            i8.d,
            i8.s,
            w.data,
            ids,
            block_slot,
            partial,
            out,
            counters,
            n_ids,
            w.rows,
            n_blocks,
            row_bytes,
            w.slot_bytes,
            w.cols,
            x_div,
            split_blocks,
            DECODE=bt.gemm8,
            V=bt.values,
            S=bt.nbytes,
            BM=tiles.block_m,
            BN=tiles.block_n,
            B=step_blocks,
            MINS=bt.gemm8_mins,
            GROUPED=grouped is not None,
            EVEN_K=n_blocks % split_blocks == 0,
            SPLIT=n_splits > 1,
            num_warps=tiles.num_warps,
            num_stages=tiles.num_stages,
        )
        return
    # The products take bfloat16 inputs; rounding them here (to nearest, as the kernel would) halves the bytes the
    # programs read and the shared memory their pipelined loads take. Triton's interpreter keeps bfloat16 as its raw
    # uint16 bits, its tl.dot multiplies those bits as integers and its float32 -> bfloat16 conversion truncates, so
    # there the GEMM widens its (bfloat16) inputs and multiplies them with the float32 weights (DOT_IN_F32).
    x = x.to(torch.bfloat16)
    _gemm_kernel[(n_m, triton.cdiv(w.rows, tiles.block_n))](
        x,
        w.data,
        ids,
        block_slot,
        out,
        n_ids,
        w.rows,
        w.cols // bt.values,
        row_bytes,
        w.slot_bytes,
        w.cols,
        x_div,
        DECODE=bt.decode,
        V=bt.values,
        S=bt.nbytes,
        P=bt.part,
        BM=tiles.block_m,
        BN=tiles.block_n,
        B=tiles.blocks,
        GROUPED=grouped is not None,
        DOT_IN_F32=INTERPRETED,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )


def decode(w: QWeight, bt: BlockType) -> torch.Tensor:
    """The weight (N, C) of block type bt decoded to bfloat16, in a new tensor (_decode_kernel)."""
    n_blocks = w.cols // bt.values
    out = torch.empty(w.rows, w.cols, dtype=torch.bfloat16, device=w.data.device)
    rows, blocks = tuning.DECODE_TILES
    _decode_kernel[(triton.cdiv(w.rows, rows), triton.cdiv(n_blocks, blocks))](
        w.data,
        out,
        w.rows,
        n_blocks,
        w.data.shape[-1],
        DECODE=bt.decode,
        V=bt.values,
        S=bt.nbytes,
        P=bt.part,
        R=rows,
        B=blocks,
    )
    return out


_split_counters: dict[torch.device, torch.Tensor] = {}


def split_counters(device: torch.device, n_tiles: int) -> torch.Tensor:
    """The device's int32 zeros that the split 8-bit GEMM's programs count their arrivals in, one per output tile
    (each tile's last program sets its count back to 0). Made, or grown, outside a CUDA graph capture: a captured
    step runs once eagerly first, with the same shapes. One set per device serves products that run one after the
    other, as a model's do on its device's stream; two at once on two streams of one device would mix their counts."""
    counters = _split_counters.get(device)
    if counters is None or counters.numel() < n_tiles:
        assert not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()), "grown during a capture"
        counters = _split_counters[device] = torch.zeros(max(n_tiles, 1024), dtype=torch.int32, device=device)
    return counters
