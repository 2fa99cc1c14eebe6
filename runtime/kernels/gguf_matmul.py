"""Products of activations with weights stored as GGUF blocks, decoded in registers: no dequantized copy is written.

Two kernels (and a variant), generic over the block type through qtypes.BLOCK_TYPES (the decoder is a compile-time
argument):
- `_gemv_kernel` (decode: up to tuning.GEMV_MAX_TOKENS tokens; the experts of up to MOE_GEMV_MAX_TOKENS, gate and
  up together of up to MOE_GLU_GEMV_MAX_TOKENS) streams a
  tile of R weight rows x B blocks per step and multiplies each decoded value with every token's input in float32, so
  the weight bytes are read once for all tokens; on its 8-bit route (tuning.GEMV_INT8, the types with a qtypes dot8
  decoder) the inputs are rounded to int8 first (`quantize_i8`, or by the kernel that wrote them: `carry_i8`), a
  tile's B are units of a block (qtypes, a lane's share) and four packed quants meet four inputs per dp4a
  instruction, in exact integers.
- `_gemm_kernel` (prefill) decodes a [BN rows, B blocks] tile per K step to bfloat16 and multiplies it with a
  [BM tokens, K] input tile through tl.dot, accumulating in float32; on the types with a qtypes gemm8 decoder,
  `_gemm_i8_kernel` instead multiplies int8 tiles of the quants with int8 activations (quantize_i8) per 32 values on
  tensor cores, for the experts of a long prompt step (tuning.GEMM_INT8, GEMM_I8_MIN_TOKENS) and for dense products
  of a few tokens (DENSE_I8_MIN_TOKENS .. DENSE_I8_MAX_TOKENS: a decode batch, a short prompt), K split over several
  programs there.
A dense product of more tokens on a GPU decodes its weight to bfloat16 once instead (`_decode_kernel`) and
multiplies on cuBLAS. Which one runs, for how many tokens, and on which tiles: tuning.py.
Both take an optional slot per program (a row of a bank of expert matrices): the MoE entry points use it, -1 meaning
"skip": the program reads no weight bytes and its outputs are zeros.

Shapes: T tokens, K experts per token, N rows (output features), C columns (input features), E slots in a bank.
Nothing here synchronises with the host: grouping tokens by expert for the prefill GEMM is done with sort/scatter/
cumsum on the device into buffers of a size known from the shapes alone, so every call can be captured in a CUDA graph.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import weakref

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType as Q

from moerun.kernels import tuning
from moerun.kernels.qtypes import BLOCK_TYPES, INTERPRETED, BlockType
from moerun.kernels.qweight import QWeight  # noqa: F401 (its home; imported from here too)


def supports(qtype: Q) -> bool:
    return qtype in BLOCK_TYPES


@triton.jit
def _gemv_step(acc, acc2, x_ptr, x_row, row_ptr, row2_ptr, lane, every_row, kb, n_blocks,
               DECODE: tl.constexpr, V: tl.constexpr, S: tl.constexpr, P: tl.constexpr, B: tl.constexpr,
               GLU: tl.constexpr, TAIL: tl.constexpr):
    """Blocks kb .. kb+B-1 of the tile's rows into the [TG, R, B, P] accumulators. TAIL: the last, partial step,
    whose blocks past the row read the last block again with zero inputs (the full steps need no masks)."""
    b = kb + tl.arange(0, B)
    if TAIL:
        b_ok = (b < n_blocks)[None, None, :, None]
        b = tl.minimum(b, n_blocks - 1)
    b = b[None, None, :, None]
    blk = row_ptr + b * S  # [1, R, B, 1]
    for part in tl.static_range(V // P):
        x_at = x_ptr + x_row + b * V + part * P + lane + every_row
        if TAIL:
            xv = tl.load(x_at, mask=b_ok, other=0.0).to(tl.float32)
        else:
            xv = tl.load(x_at).to(tl.float32)
        acc += DECODE(blk, lane, part) * xv  # [1, R, B, P] weights times [TG, R, B, P] inputs
        if GLU:
            acc2 += DECODE(row2_ptr + b * S, lane, part) * xv
    return acc, acc2


@triton.jit
def _dp4a(a, b, EMULATE: tl.constexpr):
    """The sum of the products of a's and b's four signed bytes, per int32 (PTX dp4a; the interpreter, which runs no
    PTX, adds the four products up)."""
    a, b = tl.broadcast(a, b)
    if EMULATE:
        total = ((a << 24) >> 24) * ((b << 24) >> 24)
        for i in tl.static_range(1, 4):
            total += ((a << (24 - 8 * i)) >> 24) * ((b << (24 - 8 * i)) >> 24)
    else:
        total = tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, tl.zeros_like(a)],
                                          dtype=tl.int32, is_pure=True, pack=1)
    return total


@triton.jit
def _gemv_step_i8(acc, acc2, x_ptr, xd_ptr, xs_ptr, x_row, row_ptr, row2_ptr, word, every_row, kb, n_blocks,
                  DOT8: tl.constexpr, V: tl.constexpr, B: tl.constexpr, GLU: tl.constexpr,
                  TAIL: tl.constexpr, EMULATE: tl.constexpr):
    """_gemv_step on the 8-bit route, over units kb .. kb+B-1 of V values (qtypes: a lane's unit; n_blocks counts
    units here), a quad of 16 values at a time: x_ptr holds the int8 activations as int32 words, xd_ptr their scale d
    per 32 values, xs_ptr d * (sum of quants) per 16; x_row is the token's first value. A quad adds scale * d *
    (q_w . q_x) + offset * d * sum(q_x), its four words' dot products (one dp4a each) summed in integers first, in a
    thread (the words are its own): the accumulators are [TG, R, B, 1]."""
    b = kb + tl.arange(0, B)
    if TAIL:
        b_ok = (b < n_blocks)[None, None, :, None]
        b = tl.minimum(b, n_blocks - 1)
    b = b[None, None, :, None]
    x_at = x_ptr + (x_row // 4 + b * (V // 4) + every_row + word)  # the unit's first words: [TG, R, B, 4]
    xd_at = xd_ptr + (x_row // 32 + b * (V // 32) + every_row)  # [TG, R, B, 1]
    xs_at = xs_ptr + (x_row // 16 + b * (V // 16) + every_row)
    for quad in tl.static_range(V // 16):
        if TAIL:
            xw = tl.load(x_at + quad * 4, mask=b_ok, other=0)
            xd = tl.load(xd_at + quad // 2, mask=b_ok, other=0.0)
            xs = tl.load(xs_at + quad, mask=b_ok, other=0.0)
        else:
            xw = tl.load(x_at + quad * 4)
            xd = tl.load(xd_at + quad // 2)
            xs = tl.load(xs_at + quad)
        q, scale, offset = DOT8(row_ptr, b, word, quad)
        dot = tl.sum(_dp4a(q, xw, EMULATE), axis=3, keep_dims=True).to(tl.float32)
        acc += dot * (scale * xd) + offset * xs
        if GLU:
            q, scale, offset = DOT8(row2_ptr, b, word, quad)
            dot = tl.sum(_dp4a(q, xw, EMULATE), axis=3, keep_dims=True).to(tl.float32)
            acc2 += dot * (scale * xd) + offset * xs
    return acc, acc2


# Integer arguments that change with a step's size (tokens, pairs; in fused.py rows and KV slots) are not specialized:
# Triton compiles a kernel again for each new pattern of "divisible by 16" among its integer arguments, 1-3 s each on
# the H200 machine, which `moerun serve` met as multi-second stalls on its first prompts of new lengths.
@triton.jit(do_not_specialize=["n_groups", "n_tokens", "second_delta", "second2_delta"])
def _gemv_kernel(x_ptr, xd_ptr, xs_ptr, w_ptr, w2_ptr, slot_ptr, out_ptr, n_groups, n_rows, n_blocks, row_bytes,
                 slot_bytes, cols, x_div, n_tokens, second_delta, second2_delta,
                 DECODE: tl.constexpr, V: tl.constexpr, S: tl.constexpr, P: tl.constexpr, TG: tl.constexpr,
                 R: tl.constexpr, B: tl.constexpr, SLOTTED: tl.constexpr, GLU: tl.constexpr, I8: tl.constexpr,
                 EMULATE: tl.constexpr, ALIGN: tl.constexpr):
    """Program g + i * n_groups: rows i*R .. i*R+R-1 for the TG input rows of group g. (One grid axis: a second
    one holds at most 65535 programs, and an output head of 152k rows makes 152k row tiles on one-row tiles; groups
    vary fastest, so that the pairs of one expert read its rows at about the same time, from L2 after the first.)

    I8: the 8-bit route (quantize_i8's activations at x_ptr, xd_ptr, xs_ptr; DECODE a qtypes dot8 decoder, P unused);
    otherwise x_ptr holds float32 or bfloat16 activations and xd_ptr, xs_ptr are unused.

    Group g reads input rows (g // x_div) * TG + t and writes output rows g * TG + t, t < n_tokens; with SLOTTED, its
    weights are matrix slot[g] of the bank (none when -1), or, for slot[g] = -2 - e, matrix e of its second bank at
    byte offset second_delta from w_ptr (QWeight.second: host memory read over the bus, or a staging bank). With GLU
    it multiplies the same input by a second matrix of the same shape and type (w2: up, w: gate; its second bank at
    second2_delta) and writes silu(x w^T) * (x w2^T).

    ALIGN: what the launcher knows every matrix's byte offset (slot, second bank) to be a multiple of. Triton cannot
    see it through the loaded slot and the unspecialized deltas, and without it loads the 16-byte aligned words of
    Q4_K/Q5_K blocks 4 bytes at a time (the dense weights' come 16 at a time from the arguments' specialization).
    """
    g = tl.program_id(0) % n_groups
    r = tl.program_id(0) // n_groups * R + tl.arange(0, R)
    w_base = w_ptr
    w2_base = w2_ptr
    n_steps = n_blocks
    if SLOTTED:
        slot = tl.load(slot_ptr + g).to(tl.int64)
        streamed = slot < -1
        at = tl.where(streamed, -2 - slot, tl.maximum(slot, 0)) * slot_bytes
        at1 = at + tl.where(streamed, second_delta, 0)
        at2 = at + tl.where(streamed, second2_delta, 0)
        if ALIGN > 1:
            at1 = tl.multiple_of(at1, ALIGN)
            at2 = tl.multiple_of(at2, ALIGN)
        w_base = w_ptr + at1
        w2_base = w2_ptr + at2
        n_steps = tl.where(slot != -1, n_blocks, 0)
    # Tiles are 4-D [TG, R, B, P] from the start, the weights [1, R, B, P], so that products only broadcast, and the
    # accumulators keep that shape until the loop ends: each thread sums its own products (one FMA per value and
    # input), and the sums across threads happen once, after the loop. Rows past the matrix read its last row and
    # tokens past n_tokens the last token's input (their outputs are not stored), so that only the last partial step
    # needs masks.
    row_offset = tl.minimum(r, n_rows - 1)[None, :, None, None] * row_bytes  # [1, R, 1, 1]
    row_ptr = w_base + row_offset
    row2_ptr = w2_base + row_offset
    t = tl.arange(0, TG)
    x_row = ((g // x_div) * TG + tl.minimum(t, n_tokens - 1))[:, None, None, None] * cols  # [TG, 1, 1, 1]
    every_row = tl.zeros((1, R, 1, 1), tl.int32)  # x is read per row of the tile too: [TG, R, B, P] like w
    n_full = n_steps // B * B
    if I8:  # a lane is a word of four values
        lane = tl.arange(0, 4)[None, None, None, :]
        acc = tl.zeros((TG, R, B, 1), tl.float32)
        acc2 = tl.zeros((TG, R, B, 1), tl.float32)
        for kb in range(0, n_full, B):
            acc, acc2 = _gemv_step_i8(acc, acc2, x_ptr, xd_ptr, xs_ptr, x_row, row_ptr, row2_ptr, lane, every_row,
                                      kb, n_blocks, DECODE, V, B, GLU, False, EMULATE)
        if n_full < n_steps:
            acc, acc2 = _gemv_step_i8(acc, acc2, x_ptr, xd_ptr, xs_ptr, x_row, row_ptr, row2_ptr, lane, every_row,
                                      n_full, n_blocks, DECODE, V, B, GLU, True, EMULATE)
    else:
        lane = tl.arange(0, P)[None, None, None, :]
        acc = tl.zeros((TG, R, B, P), tl.float32)
        acc2 = tl.zeros((TG, R, B, P), tl.float32)
        for kb in range(0, n_full, B):
            acc, acc2 = _gemv_step(acc, acc2, x_ptr, x_row, row_ptr, row2_ptr, lane, every_row, kb, n_blocks,
                                   DECODE, V, S, P, B, GLU, False)
        if n_full < n_steps:
            acc, acc2 = _gemv_step(acc, acc2, x_ptr, x_row, row_ptr, row2_ptr, lane, every_row, n_full, n_blocks,
                                   DECODE, V, S, P, B, GLU, True)
    acc = tl.sum(tl.sum(acc, axis=3), axis=2)
    if GLU:
        acc2 = tl.sum(tl.sum(acc2, axis=3), axis=2)
        acc = acc / (1.0 + tl.exp(-acc)) * acc2
    out_row = (g * TG + t)[:, None] * n_rows
    tl.store(out_ptr + out_row + r[None, :], acc, mask=(t < n_tokens)[:, None] & (r < n_rows)[None, :])


@triton.jit
def _program_ids(m, ids_ptr, block_slot_ptr, w_ptr, n_ids, n_blocks, slot_bytes, BM: tl.constexpr,
                 GROUPED: tl.constexpr):
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
def _gemm_kernel(x_ptr, w_ptr, ids_ptr, block_slot_ptr, out_ptr, n_ids, n_rows, n_blocks, row_bytes, slot_bytes,
                 cols, x_div,
                 DECODE: tl.constexpr, V: tl.constexpr, S: tl.constexpr, P: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, B: tl.constexpr, GROUPED: tl.constexpr,
                 DOT_IN_F32: tl.constexpr):
    """Program (m, i): output rows i*BN .. i*BN+BN-1 for the BM ids of _program_ids (dense or GROUPED). An id reads
    input row id // x_div and writes output row id."""
    m = tl.program_id(0)
    r = tl.program_id(1) * BN + tl.arange(0, BN)
    ids, ok, w_base, n_steps = _program_ids(m, ids_ptr, block_slot_ptr, w_ptr, n_ids, n_blocks, slot_bytes, BM,
                                            GROUPED)
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
def _gemm_i8_kernel(xq_ptr, xd_ptr, xs_ptr, w_ptr, ids_ptr, block_slot_ptr, out_ptr, sum_ptr, counter_ptr, n_ids,
                    n_rows, n_blocks, row_bytes, slot_bytes, cols, x_div, split_blocks,
                    DECODE: tl.constexpr, V: tl.constexpr, S: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    B: tl.constexpr, MINS: tl.constexpr, GROUPED: tl.constexpr, EVEN_K: tl.constexpr,
                    SPLIT: tl.constexpr):
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
    ids, ok, w_base, n_steps = _program_ids(m, ids_ptr, block_slot_ptr, w_ptr, n_ids, n_blocks, slot_bytes, BM,
                                            GROUPED)
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
def _decode_kernel(w_ptr, out_ptr, n_rows, n_blocks, row_bytes,
                   DECODE: tl.constexpr, V: tl.constexpr, S: tl.constexpr, P: tl.constexpr,
                   R: tl.constexpr, B: tl.constexpr):
    """Program (i, j): rows i*R .. i*R+R-1, blocks j*B .. j*B+B-1 of the weight, decoded to bfloat16 into out
    (n_rows, n_blocks * V)."""
    r = tl.program_id(0) * R + tl.arange(0, R)
    b = tl.program_id(1) * B + tl.arange(0, B)
    ok = (r < n_rows)[:, None, None] & (b < n_blocks)[None, :, None]
    blk = (w_ptr + tl.minimum(r, n_rows - 1).to(tl.int64)[:, None, None] * row_bytes
           + tl.minimum(b, n_blocks - 1)[None, :, None] * S)  # [R, B, 1]
    lane = tl.arange(0, P)[None, None, :]
    out_row = out_ptr + r.to(tl.int64)[:, None, None] * (n_blocks * V) + b[None, :, None] * V + lane
    for part in tl.static_range(V // P):
        tl.store(out_row + part * P, DECODE(blk, lane, part).to(tl.bfloat16), mask=ok)


def _block_type(w: QWeight) -> BlockType:
    bt = BLOCK_TYPES[Q(w.qtype)]
    assert w.data.dtype == torch.uint8 and w.data.is_contiguous(), (w.data.dtype, w.qtype)
    assert w.cols % bt.values == 0 and w.data.shape[-2:] == (w.rows, w.cols // bt.values * bt.nbytes), (
        tuple(w.data.shape), Q(w.qtype).name, w.rows, w.cols)
    assert w.data.data_ptr() % 4 == 0, "fp16 fields are loaded as fp16: the bytes must start aligned"
    return bt


def _gemv(x: torch.Tensor, w: QWeight, bt: BlockType, out: torch.Tensor, groups: int, tokens: int, x_div: int,
          slots: torch.Tensor | None, up: QWeight | None = None) -> None:
    """The matrix-vector kernel; with `up`, its GLU form: silu(x w^T) * (x up^T). On the 8-bit route where the type
    has one (tuning.GEMV_INT8): the activations are rounded to int8 first (quantize_i8)."""
    group = triton.next_power_of_2(tokens)
    i8 = tuning.GEMV_INT8 and bt.dot8 is not None
    # registers per (token, row, block) that grow with the tokens: a part's float accumulators, or a quad's four
    # accumulators and four activation words (8-bit; counting the accumulators alone, T=8 spilled: 741 us for 4096^2)
    per_block = 8 if i8 else bt.part
    # the GLU keeps two products per value: tiles for twice the tokens keep its accumulators in registers
    tiles = tuning.gemv_tiles(Q(w.qtype), bt.values, per_block, group * (2 if up is not None else 1),
                              grouped_blocks=0 if slots is None else w.cols // bt.values, i8=i8)
    if i8:
        xq, xd, xs = carried_i8(x) or quantize_i8(x.view(-1, w.cols))
        x, xd_xs = xq.view(-1).view(torch.int32), (xd, xs)
    else:
        xd_xs = (x, x)
    row_bytes = w.data.shape[-1]
    values = bt.dot8_values if i8 else bt.values  # per step of a lane: the 8-bit route's unit, or a block
    deltas = (_second_delta(w), _second_delta(w if up is None else up))
    # 16-byte loads of the experts' words: the 60 GB model's gate+up 1555 -> 1766 GB/s on the H200 (kernels.md)
    align = 16 if slots is not None and all(n % 16 == 0 for n in (w.rows * row_bytes, *deltas)) else 1
    grid = (groups * triton.cdiv(w.rows, tiles.rows),)
    _gemv_kernel[grid](
        x, *xd_xs, w.data, w.data if up is None else up.data, x if slots is None else slots, out, groups, w.rows,
        w.cols // values, row_bytes, w.rows * row_bytes, w.cols, x_div, tokens, *deltas,
        DECODE=bt.dot8 if i8 else bt.decode, V=values, S=bt.nbytes, P=bt.part, TG=group,
        R=tiles.rows, B=tiles.blocks, SLOTTED=slots is not None, GLU=up is not None, I8=i8, EMULATE=INTERPRETED,
        ALIGN=align,
        num_warps=tiles.num_warps)


@triton.jit
def store_i8(v, blk, ok, row, cols, q_ptr, d_ptr, s_ptr, NB: tl.constexpr):
    """Round the blocks v [NB, 32] float32 of an activation row as quantize_i8 does and store them: blocks blk [NB] of
    row `row` of a (rows, cols) activation, those with ok [NB]. d = max |x| / 127, q = round(x / d) (half up; 0 where
    the block is all zeros); d into d_ptr per 32 values and d * sum(q) into s_ptr per 16. The kernel calling it runs
    with enable_fp_fusion=False: x * (127 / max) is rounded before the + 0.5, as the torch reference in the tests
    does."""
    row = row.to(tl.int64)
    amax = tl.max(tl.abs(v), axis=1)
    inv = tl.where(amax > 0, tl.math.div_rn(tl.full(amax.shape, 127.0, tl.float32), tl.maximum(amax, 1e-30)), 0.0)
    q = tl.floor(v * inv[:, None] + 0.5)
    d = tl.math.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32))
    col = blk[:, None] * 32 + tl.arange(0, 32)[None, :]
    tl.store(q_ptr + row * cols + col, q.to(tl.int8), mask=ok[:, None])
    tl.store(d_ptr + row * (cols // 32) + blk, d, mask=ok)
    halves = tl.sum(tl.reshape(q, (NB, 2, 16)), axis=2) * d[:, None]  # [NB, 2]
    tl.store(s_ptr + row * (cols // 16) + blk[:, None] * 2 + tl.arange(0, 2)[None, :], halves, mask=ok[:, None])


@triton.jit
def _quantize_i8_kernel(x_ptr, q_ptr, d_ptr, s_ptr, cols, NB: tl.constexpr):
    """Program (i, j): blocks j*NB .. j*NB+NB-1 of 32 values of row i, through store_i8."""
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1) * NB + tl.arange(0, NB)
    ok = blk < cols // 32
    col = blk[:, None] * 32 + tl.arange(0, 32)[None, :]
    v = tl.load(x_ptr + row * cols + col, mask=ok[:, None], other=0.0).to(tl.float32)
    store_i8(v, blk, ok, row, cols, q_ptr, d_ptr, s_ptr, NB)


def quantize_i8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Activations (rows, C) float32 or bfloat16, C a multiple of 32 -> the 8-bit route's inputs: quants (rows, C)
    int8, their scale d per 32 values (rows, C / 32) float32 and d * (sum of the quants) per 16 (rows, C / 16)
    float32. Each block of 32 is rounded on its own scale max |x| / 127, as llama.cpp's GPU matrix-vector products
    round theirs; values are d * q."""
    rows, cols = x.shape
    assert cols % 32 == 0 and x.is_contiguous(), (tuple(x.shape), x.stride())
    q, d, s = i8_buffers(x.numel(), x.device)
    if rows:
        _quantize_i8_kernel[(rows, triton.cdiv(cols // 32, tuning.QUANTIZE_BLOCKS))](
            x, q, d, s, cols, NB=tuning.QUANTIZE_BLOCKS, enable_fp_fusion=False)  # no FMA: see store_i8
    return q.view(rows, cols), d.view(rows, cols // 32), s.view(rows, cols // 16)


def i8_buffers(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Empty quants, scales and sums (store_i8) for n activation values, flat."""
    return (torch.empty(n, dtype=torch.int8, device=device), torch.empty(n // 32, dtype=torch.float32, device=device),
            torch.empty(n // 16, dtype=torch.float32, device=device))


# A kernel that writes activations can round them for the 8-bit route in the same pass (fused.rms_norm,
# add_rms_norm and attend_decode call store_i8 on the values they store) and hand the result along with its output
# tensor: the products that read that output on the 8-bit route then skip quantize_i8's launch, three of the four
# per layer of a decode step. The rounding is of the tensor's bytes in order, by 32, so it serves any view of the
# whole tensor whose rows are a multiple of 32 long (attention's (T, H, Dv) output read as (T, H * Dv)); views are
# found by address, as tensors made in inference mode record no base. It holds only while the tensor is not written
# again: torch's version counter (shared by views) says so, except in inference mode, which keeps none; the layers
# write no activation in place.
_CARRIERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # (device, address) -> the carrying tensor


def _version(x: torch.Tensor) -> int | None:
    return None if x.is_inference() else x._version


def carry_i8(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, s: torch.Tensor) -> None:
    """Hand along with x (contiguous, as its writer allocated it) the flat quantize_i8 rounding of its values."""
    assert x.is_contiguous() and 0 < q.numel() == x.numel() == 32 * d.numel() == 16 * s.numel()
    x._moerun_i8 = (_version(x), q, d, s)
    _CARRIERS[x.device, x.data_ptr()] = x


def carried_i8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The rounding handed along with the tensor x views all of (carry_i8), flat, if unchanged since; else None.
    (While that tensor lives, nothing else is allocated at its address.)"""
    carrier = _CARRIERS.get((x.device, x.data_ptr()))
    if (carrier is None or carrier._moerun_i8[0] != _version(carrier) or x.numel() != carrier.numel()
            or x.dtype != carrier.dtype or not x.is_contiguous() or x.shape[-1] % 32):
        return None
    return carrier._moerun_i8[1:]


@triton.jit
def _stage_kernel(slot_ptr, dst_ptr, src_delta, words, BLOCK: tl.constexpr):
    """Program (p, c): words c*BLOCK .. c*BLOCK+BLOCK-1 of the matrix that pair p names in the second bank (slot
    -2 - e; the bank at src_delta words from dst_ptr), copied to matrix p of the staging bank at dst_ptr. Pairs
    with other slots copy nothing."""
    p = tl.program_id(0)
    slot = tl.load(slot_ptr + p).to(tl.int64)
    if slot < -1:
        i = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = i < words
        tl.store(dst_ptr + p * words + i, tl.load(dst_ptr + src_delta + (-2 - slot) * words + i, mask=ok), mask=ok)


def stage_second(slots: torch.Tensor, banks: tuple[QWeight, ...], stages: tuple[torch.Tensor, ...],
                 ) -> tuple[tuple[QWeight, ...], torch.Tensor]:
    """Copy the second-bank matrices that `slots` (T, K) name (-2 - e) into the device staging banks `stages`
    ((>= T*K, N, row_bytes) uint8 each, one per bank), in wide coalesced loads: from page-locked host memory such a
    copy reads 44-50 GB/s on the H200 machine, where the matrix-vector kernel's own loads over the bus reach 24
    (docs/BENCHMARKS.md). Matrix p = t*K + k of a stage holds pair p's expert; in a batch of several tokens, an
    expert streamed for several pairs is copied once, into its first pair's matrix, which the others read too.
    -> the banks with the staging banks as their second, and the slots of the streamed pairs pointing there (-2 - p)."""
    n_pairs = slots.numel()
    if slots.shape[0] > 1:  # one token's K experts differ: only a batch repeats one
        copies, owner = _first_pairs(slots, banks[0].second.shape[0])
    else:
        copies, owner = slots, torch.arange(n_pairs, device=slots.device).view(slots.shape)
    staged = []
    for w, stage in zip(banks, stages):
        matrix = w.data[0].numel()
        delta = _second_address(w) - stage.data_ptr()
        # the widest words that divide the matrix and both banks' addresses (a host copy may start 4 bytes past one)
        size = next(n for n in (8, 4, 1) if matrix % n == 0 and delta % n == 0 and stage.data_ptr() % n == 0)
        assert stage.shape[0] >= n_pairs and stage.shape[1:] == w.data.shape[1:]
        words = stage.view(-1).view({8: torch.int64, 4: torch.int32, 1: torch.uint8}[size])
        _stage_kernel[(n_pairs, triton.cdiv(matrix // size, tuning.STAGE_WORDS))](
            copies, words, delta // size, matrix // size, BLOCK=tuning.STAGE_WORDS, num_warps=tuning.STAGE_WARPS)
        staged.append(dataclasses.replace(w, second=stage))
    return tuple(staged), torch.where(slots < -1, -2 - owner, slots).to(slots.dtype)


def _first_pairs(slots: torch.Tensor, n_expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For the streamed pairs of `slots` (T, K) (slot -2 - e), the first pair p0 = t*K + k that streams the same
    expert, on the device: (the slots the copy kernel takes: the pair's own where it is that first pair, else -1;
    p0 of every pair, itself where it streams nothing)."""
    flat = slots.reshape(-1).long()
    pairs = torch.arange(flat.numel(), device=slots.device)
    streamed = flat < -1
    expert = torch.where(streamed, -2 - flat, n_expert)  # the others share a spare bucket
    first = torch.full((n_expert + 1,), flat.numel(), dtype=torch.long, device=slots.device)
    first.scatter_reduce_(0, expert, pairs, reduce="amin")
    owner = torch.where(streamed, first[expert], pairs)
    copies = torch.where(streamed & (owner == pairs), flat, -1).to(slots.dtype)
    return copies.view(slots.shape), owner.view(slots.shape)


def _second_delta(w: QWeight) -> int:
    """Where the bank's second bank lies for the kernel, as a byte offset from its bytes (0: it has none)."""
    return 0 if w.second is None else _second_address(w) - w.data.data_ptr()


def _second_address(w: QWeight) -> int:
    """The address the bank's device reads its second bank at (host memory through the driver's mapping)."""
    assert w.second.shape[1:] == w.data.shape[1:] and w.second.data_ptr() % 4 == 0, (tuple(w.second.shape),
                                                                                      tuple(w.data.shape))
    return _bus_address(w.second.data_ptr(), w.data.is_cuda and not w.second.is_cuda)


@functools.cache
def _bus_address(address: int, on_host: bool) -> int:
    """The address a GPU reads page-locked host memory at (`on_host`: the driver's mapping; on x86-64 Linux the
    host's own address); memory on the kernel's own device is where it is."""
    if not on_host:
        return address
    mapped = ctypes.c_uint64()
    error = _libcuda().cuMemHostGetDevicePointer_v2(ctypes.byref(mapped), ctypes.c_void_p(address), 0)
    if error:
        raise RuntimeError(f"host memory at {address:#x} is not page-locked for CUDA (driver error {error})")
    return mapped.value


@functools.cache
def _libcuda() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _gemm(x: torch.Tensor, w: QWeight, bt: BlockType, out: torch.Tensor, n_ids: int, x_div: int,
          grouped: tuple[torch.Tensor, torch.Tensor] | None, tiles: tuning.GemmTiles, i8: bool = False) -> None:
    """The GEMM over the blocks: with `i8` the 8-bit one (the type's gemm8 decoder), else decoded to bfloat16."""
    ids, block_slot = grouped if grouped is not None else (out, out)
    n_m = block_slot.numel() if grouped is not None else triton.cdiv(n_ids, tiles.block_m)
    row_bytes = w.data.shape[-1]
    if i8:
        rounding = carried_i8(x) or quantize_i8(x.reshape(-1, w.cols))
        carry_i8(x, *rounding)  # a layer's gate and up read the same input: rounded once for both
        n_blocks = w.cols // bt.values
        step_blocks = min(tiles.blocks, n_blocks)
        split_blocks = triton.cdiv(triton.cdiv(n_blocks, tiles.split), step_blocks) * step_blocks
        n_splits = triton.cdiv(n_blocks, split_blocks)
        grid = (n_m, triton.cdiv(w.rows, tiles.block_n), n_splits)
        partial = out if n_splits == 1 else torch.empty(n_splits, *out.shape, dtype=out.dtype, device=out.device)
        counters = out if n_splits == 1 else split_counters(out.device, grid[0] * grid[1])
        _gemm_i8_kernel[grid](
            *rounding, w.data, ids, block_slot, partial, out, counters, n_ids, w.rows, n_blocks, row_bytes,
            w.rows * row_bytes, w.cols, x_div, split_blocks, DECODE=bt.gemm8, V=bt.values, S=bt.nbytes,
            BM=tiles.block_m, BN=tiles.block_n, B=step_blocks, MINS=bt.gemm8_mins, GROUPED=grouped is not None,
            EVEN_K=n_blocks % split_blocks == 0, SPLIT=n_splits > 1, num_warps=tiles.num_warps,
            num_stages=tiles.num_stages)
        return
    # The products take bfloat16 inputs; rounding them here (to nearest, as the kernel would) halves the bytes the
    # programs read and the shared memory their pipelined loads take. Triton's interpreter keeps bfloat16 as its raw
    # uint16 bits, its tl.dot multiplies those bits as integers and its float32 -> bfloat16 conversion truncates, so
    # there the GEMM widens its (bfloat16) inputs and multiplies them with the float32 weights (DOT_IN_F32).
    x = x.to(torch.bfloat16)
    _gemm_kernel[(n_m, triton.cdiv(w.rows, tiles.block_n))](
        x, w.data, ids, block_slot, out, n_ids, w.rows, w.cols // bt.values, row_bytes, w.rows * row_bytes,
        w.cols, x_div,
        DECODE=bt.decode, V=bt.values, S=bt.nbytes, P=bt.part, BM=tiles.block_m, BN=tiles.block_n, B=tiles.blocks,
        GROUPED=grouped is not None, DOT_IN_F32=INTERPRETED, num_warps=tiles.num_warps, num_stages=tiles.num_stages)


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


def moe_gemm_i8(bt: BlockType, n_tokens: int) -> bool:
    """Does a prompt step of n_tokens run its experts on the 8-bit GEMM (tuning.GEMM_INT8, GEMM_I8_MIN_TOKENS)?"""
    return tuning.GEMM_INT8 and bt.gemm8 is not None and n_tokens >= tuning.GEMM_I8_MIN_TOKENS


def dense_gemm_i8(bt: BlockType, n_tokens: int) -> bool:
    """Does a dense product of n_tokens run on the 8-bit GEMM (tuning.GEMM_INT8, DENSE_I8_MIN/MAX_TOKENS)?"""
    return (tuning.GEMM_INT8 and bt.gemm8 is not None
            and tuning.DENSE_I8_MIN_TOKENS <= n_tokens <= tuning.DENSE_I8_MAX_TOKENS)


def gguf_mm(x: torch.Tensor, w: QWeight) -> torch.Tensor:
    """x (T, C) float32 or bfloat16 @ w.T -> (T, N) float32."""
    bt = _block_type(w)
    assert x.dim() == 2 and x.shape[1] == w.cols and w.data.dim() == 2, (tuple(x.shape), tuple(w.data.shape))
    x = x.contiguous()
    n_tokens = x.shape[0]
    i8 = dense_gemm_i8(bt, n_tokens)
    if not i8 and n_tokens >= tuning.DECODED_GEMM_MIN_TOKENS and x.is_cuda and not INTERPRETED:
        return _decoded_mm(x, w)
    out = torch.empty(n_tokens, w.rows, dtype=torch.float32, device=x.device)
    if n_tokens == 0:
        return out
    if i8:
        _gemm(x, w, bt, out, n_tokens, 1, None, tuning.dense_i8_tiles(Q(w.qtype)), i8=True)
    elif n_tokens <= tuning.GEMV_MAX_TOKENS:
        _gemv(x, w, bt, out, groups=1, tokens=n_tokens, x_div=1, slots=None)
    else:
        _gemm(x, w, bt, out, n_tokens, 1, None, tuning.gemm_tiles(Q(w.qtype), bt.values, grouped=False))
    return out


def gguf_mv(x: torch.Tensor, w: QWeight) -> torch.Tensor:
    """x (T, C) @ w.T -> (T, N) float32 on the matrix-vector kernel alone, T <= tuning.GEMV_MAX_TOKENS: products in
    float32 for a float32 weight, where gguf_mm takes bfloat16 routes from DECODED_GEMM_MIN_TOKENS tokens (a router,
    whose near-ties decide the experts)."""
    bt = _block_type(w)
    assert x.dim() == 2 and x.shape[1] == w.cols and 0 < x.shape[0] <= tuning.GEMV_MAX_TOKENS, tuple(x.shape)
    out = torch.empty(x.shape[0], w.rows, dtype=torch.float32, device=x.device)
    _gemv(x.contiguous(), w, bt, out, groups=1, tokens=x.shape[0], x_div=1, slots=None)
    return out


def _decoded_mm(x: torch.Tensor, w: QWeight) -> torch.Tensor:
    """x @ w.T through the weight decoded to bfloat16 and cuBLAS, in row chunks of at most
    tuning.DECODED_CHUNK_BYTES of bfloat16 (one scratch at a time) -> (T, N) float32. A chunk is a multiple of 4
    rows, so that each starts 4-byte aligned whatever a row's bytes (Q8_0's 34-byte blocks)."""
    x = x.to(torch.bfloat16)
    chunk = max(4, tuning.DECODED_CHUNK_BYTES // (2 * w.cols) // 4 * 4)
    if chunk >= w.rows:
        return bf16_mm(x, decode_bf16(w))
    out = torch.empty(x.shape[0], w.rows, dtype=torch.float32, device=x.device)
    for start in range(0, w.rows, chunk):
        part = dataclasses.replace(w, data=w.data[start:start + chunk], rows=min(chunk, w.rows - start))
        out[:, start:start + part.rows] = bf16_mm(x, decode_bf16(part))
    return out


def bf16_mm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (T, C) rounded to bfloat16 @ weight (N, C) bfloat16 .T -> (T, N), accumulated and returned in float32: on
    cuBLAS (a Triton kernel for a few tokens lost to it: docs/kernels.md), on the CPU, which has no bfloat16 product
    with a float32 result, through float32 (the same products and sums)."""
    x = x.to(torch.bfloat16)
    if x.is_cuda:
        return torch.mm(x, weight.t(), out_dtype=torch.float32)
    return x.float() @ weight.float().t()


def decode_bf16(w: QWeight) -> torch.Tensor:
    """The weight (N, C) decoded to bfloat16, in a new tensor. A product of several tokens (a prompt, or a decode
    batch of 4 or more sequences) reads each weight value once per token: decoding it once (2 bytes a value written
    and read back) and multiplying on cuBLAS beats decoding it in every GEMM program (the 4096x4096 Q4_K at T = 512:
    410 us in _gemm_kernel, 43 decoded) and the matrix-vector kernel's float32 products (tuning.py has the numbers)."""
    bt = _block_type(w)
    n_blocks = w.cols // bt.values
    out = torch.empty(w.rows, w.cols, dtype=torch.bfloat16, device=w.data.device)
    rows, blocks = tuning.DECODE_TILES
    _decode_kernel[(triton.cdiv(w.rows, rows), triton.cdiv(n_blocks, blocks))](
        w.data, out, w.rows, n_blocks, w.data.shape[-1], DECODE=bt.decode, V=bt.values, S=bt.nbytes, P=bt.part,
        R=rows, B=blocks)
    return out


@triton.jit(do_not_specialize=["n_pairs", "n_slots", "n_blocks"])
def _group_kernel(slots_ptr, ids_ptr, block_slot_ptr, n_pairs, n_slots, n_blocks, BM: tl.constexpr,
                  CHUNK: tl.constexpr, BINS: tl.constexpr):
    """Program s writes slot s's run of group_by_slot's ids and block_slot; the last program also the spare blocks.

    Every program counts the pairs of every slot (BINS >= n_slots + 1 bins; the pairs the GEMM does not run, slot -1
    and a second bank's -2 - e, count in bin n_slots), so that it knows where its run starts without waiting for the
    others: after the runs of the slots before it, each padded to a multiple of BM."""
    s = tl.program_id(0)
    lane = tl.arange(0, CHUNK)
    bins = tl.arange(0, BINS)
    counts = tl.zeros((BINS,), tl.int32)
    for c in range(0, n_pairs, CHUNK):
        key = tl.load(slots_ptr + c + lane, mask=c + lane < n_pairs, other=-1).to(tl.int32)
        counts += tl.histogram(tl.where((key >= 0) & (key < n_slots), key, n_slots), BINS)
    padded = tl.where(bins < n_slots, (counts + BM - 1) // BM * BM, 0)
    first = tl.sum(tl.where(bins < s, padded, 0))  # where slot s's run starts in ids
    mine = tl.sum(tl.where(bins == s, counts, 0))
    run = tl.sum(tl.where(bins == s, padded, 0))
    at = first
    for c in range(0, n_pairs, CHUNK):  # slot s's pair ids in their order
        key = tl.load(slots_ptr + c + lane, mask=c + lane < n_pairs, other=-1).to(tl.int32)
        hit = (key == s).to(tl.int32)
        tl.store(ids_ptr + at + tl.cumsum(hit, 0) - 1, c + lane, mask=hit != 0)
        at += tl.sum(hit)
    pad = tl.arange(0, BM)
    tl.store(ids_ptr + first + mine + pad, -1, mask=pad < run - mine)
    for j in range(0, run, BM):
        tl.store(block_slot_ptr + (first + j) // BM, s)
    if s == n_slots - 1:  # the spare blocks past the last run
        used = tl.sum(padded)
        for c in range(used, n_blocks * BM, CHUNK):
            tl.store(ids_ptr + c + lane, -1, mask=c + lane < n_blocks * BM)
        for c in range(used // BM, n_blocks, CHUNK):
            tl.store(block_slot_ptr + c + lane, -1, mask=c + lane < n_blocks)


def group_by_slot(slots: torch.Tensor, n_slots: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """slots (T, K) -> (ids, block_slot): the (t, k) pair ids t*K + k grouped by slot (in pair order within a slot),
    each slot's run padded with -1 to a multiple of block_m, and the slot of every block of block_m ids (-1 for the
    spare blocks at the end). Pairs of slot -1 (and of a second bank, -2 - e) are left out.

    Sizes depend only on T*K, n_slots and block_m (at most one partly filled block per slot present), so nothing
    waits for the device. One launch (_group_kernel): the torch sort, counts, cumsum and searchsorted it replaced
    were ~20 kernels, 88-93 us a prompt layer on the H200 (docs/BENCHMARKS.md).
    """
    pairs = slots.reshape(-1)
    n_pairs = pairs.numel()
    n_blocks = triton.cdiv(n_pairs, block_m) + min(n_slots, n_pairs)
    ids = torch.empty(n_blocks * block_m, dtype=torch.int32, device=slots.device)
    block_slot = torch.empty(n_blocks, dtype=torch.int32, device=slots.device)
    # one chunk size for any number of pairs: a step of another size compiles nothing
    _group_kernel[(n_slots,)](pairs, ids, block_slot, n_pairs, n_slots, n_blocks, BM=block_m, CHUNK=1024,
                              BINS=triton.next_power_of_2(n_slots + 1))
    return ids, block_slot


def gguf_moe(x: torch.Tensor, w: QWeight, slots: torch.Tensor, groups: dict | None = None) -> torch.Tensor:
    """Each token's K experts of a bank in one launch: -> (T, K, N) float32.

    w.data: (E, N, row_bytes); slots (T, K) int32 or int64: the bank slot of token t's k-th expert, -1 to skip it
    (zeros out). x: (T, C), shared by the token's K experts (gate, up), or (T, K, C), one input per (t, k) (down).
    `groups`: where the prefill path keeps its group_by_slot of these slots for the other banks of the same layer
    (made once a layer, not once a bank).
    """
    bt = _block_type(w)
    assert w.data.dim() == 3 and slots.dim() == 2 and slots.dtype in (torch.int32, torch.int64), (
        tuple(w.data.shape), slots.dtype)
    n_tokens, k = slots.shape
    assert x.shape == (n_tokens, w.cols) or x.shape == (n_tokens, k, w.cols), (tuple(x.shape), tuple(slots.shape))
    x_div = k if x.dim() == 2 else 1  # pair id t*K + k reads input row t, or its own row
    x, slots = x.contiguous(), slots.contiguous()
    if n_tokens * k == 0:
        return torch.zeros(n_tokens, k, w.rows, dtype=torch.float32, device=x.device)
    if n_tokens <= tuning.MOE_GEMV_MAX_TOKENS:
        out = torch.empty(n_tokens * k, w.rows, dtype=torch.float32, device=x.device)
        _gemv(x, w, bt, out, groups=n_tokens * k, tokens=1, x_div=x_div, slots=slots)
    else:
        out = torch.zeros(n_tokens * k, w.rows, dtype=torch.float32, device=x.device)  # skipped pairs stay zero
        i8 = moe_gemm_i8(bt, n_tokens)
        tiles = tuning.gemm_tiles(Q(w.qtype), bt.values, grouped=True, grouped_blocks=w.cols // bt.values, i8=i8,
                                  n_tokens=n_tokens)
        key, groups = (w.data.shape[0], tiles.block_m), {} if groups is None else groups
        if key not in groups:
            groups[key] = group_by_slot(slots, *key)
        _gemm(x, w, bt, out, n_tokens * k, x_div, groups[key], tiles, i8)
    return out.view(n_tokens, k, w.rows)


def glu_supports(gate: QWeight, up: QWeight) -> bool:
    """gguf_moe_glu needs gate and up banks of one type and shape."""
    return (gate.qtype == up.qtype and gate.data.shape == up.data.shape and gate.rows == up.rows
            and gate.cols == up.cols)


def gguf_moe_glu(x: torch.Tensor, gate: QWeight, up: QWeight, slots: torch.Tensor,
                 groups: dict | None = None) -> torch.Tensor:
    """silu(gguf_moe(x, gate, slots)) * gguf_moe(x, up, slots): -> (T, K, N) float32, skipped slots zeros.

    Decode-sized steps run both banks in one matrix-vector launch (the input read once, the SwiGLU done on the
    accumulators); prefill runs the two grouped GEMMs on one grouping, and the product.
    """
    assert glu_supports(gate, up), (Q(gate.qtype).name, Q(up.qtype).name, tuple(gate.data.shape))
    n_tokens, k = slots.shape
    if n_tokens * k == 0 or n_tokens > tuning.MOE_GLU_GEMV_MAX_TOKENS:
        groups = {} if groups is None else groups
        g, u = gguf_moe(x, gate, slots, groups), gguf_moe(x, up, slots, groups)
        return torch.nn.functional.silu(g) * u
    bt = _block_type(gate)
    _block_type(up)
    assert x.shape == (n_tokens, gate.cols), (tuple(x.shape), tuple(slots.shape))
    x, slots = x.contiguous(), slots.contiguous()
    out = torch.empty(n_tokens * k, gate.rows, dtype=torch.float32, device=x.device)
    _gemv(x, gate, bt, out, groups=n_tokens * k, tokens=1, x_div=k, slots=slots, up=up)
    return out.view(n_tokens, k, gate.rows)
