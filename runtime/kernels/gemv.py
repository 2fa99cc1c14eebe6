"""The matrix-vector kernel over GGUF blocks: the products of a few tokens, the weights decoded in registers.

`_gemv_kernel` (decode: up to tuning.GEMV_MAX_TOKENS tokens; the experts of up to MOE_GEMV_MAX_TOKENS, gate and up
together of up to MOE_GLU_GEMV_MAX_TOKENS) streams a tile of R weight rows x B blocks per step and multiplies each
decoded value with every token's input in float32, so the weight bytes are read once for all tokens; on its 8-bit
route (tuning.Int8Routes.gemv, the types with a qtypes dot8 decoder) the inputs are rounded to int8 first (act_i8: by
quantize_i8, or by the kernel that wrote them), a tile's B are units of a block (qtypes, a lane's share) and four
packed quants meet four inputs per dp4a instruction, in exact integers. Generic over the block type through
qtypes.BLOCK_TYPES (the decoder is a compile-time argument).

It takes an optional slot per program group (a row of a bank of expert matrices): the MoE entry points use it, -1
meaning "skip": the program reads no weight bytes and its outputs are zeros; -2 - e, matrix e of the bank's second
bank (staging.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType as Q

from moerun.kernels import tuning
from moerun.kernels.act_i8 import QAct, quantize_i8
from moerun.kernels.qtypes import INTERPRETED, BlockType
from moerun.kernels.qweight import QWeight
from moerun.kernels.staging import second_delta


@triton.jit
def _gemv_step(
    acc,
    acc2,
    x_ptr,
    x_row,
    row_ptr,
    row2_ptr,
    lane,
    every_row,
    kb,
    n_blocks,
    DECODE: tl.constexpr,
    V: tl.constexpr,
    S: tl.constexpr,
    P: tl.constexpr,
    B: tl.constexpr,
    GLU: tl.constexpr,
    TAIL: tl.constexpr,
):
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
        total = tl.inline_asm_elementwise(
            "dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, tl.zeros_like(a)], dtype=tl.int32, is_pure=True, pack=1
        )
    return total


@triton.jit
def _gemv_step_i8(
    acc,
    acc2,
    x_ptr,
    xd_ptr,
    xs_ptr,
    x_row,
    row_ptr,
    row2_ptr,
    word,
    every_row,
    kb,
    n_blocks,
    DOT8: tl.constexpr,
    V: tl.constexpr,
    B: tl.constexpr,
    GLU: tl.constexpr,
    TAIL: tl.constexpr,
    EMULATE: tl.constexpr,
):
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
def _gemv_kernel(
    x_ptr,
    xd_ptr,
    xs_ptr,
    w_ptr,
    w2_ptr,
    slot_ptr,
    out_ptr,
    n_groups,
    n_rows,
    n_blocks,
    row_bytes,
    slot_bytes,
    cols,
    x_div,
    n_tokens,
    second_delta,
    second2_delta,
    DECODE: tl.constexpr,
    V: tl.constexpr,
    S: tl.constexpr,
    P: tl.constexpr,
    TG: tl.constexpr,
    R: tl.constexpr,
    B: tl.constexpr,
    SLOTTED: tl.constexpr,
    GLU: tl.constexpr,
    I8: tl.constexpr,
    EMULATE: tl.constexpr,
    ALIGN: tl.constexpr,
):
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
            acc, acc2 = _gemv_step_i8(
                acc,
                acc2,
                x_ptr,
                xd_ptr,
                xs_ptr,
                x_row,
                row_ptr,
                row2_ptr,
                lane,
                every_row,
                kb,
                n_blocks,
                DECODE,
                V,
                B,
                GLU,
                False,
                EMULATE,
            )
        if n_full < n_steps:
            acc, acc2 = _gemv_step_i8(
                acc,
                acc2,
                x_ptr,
                xd_ptr,
                xs_ptr,
                x_row,
                row_ptr,
                row2_ptr,
                lane,
                every_row,
                n_full,
                n_blocks,
                DECODE,
                V,
                B,
                GLU,
                True,
                EMULATE,
            )
    else:
        lane = tl.arange(0, P)[None, None, None, :]
        acc = tl.zeros((TG, R, B, P), tl.float32)
        acc2 = tl.zeros((TG, R, B, P), tl.float32)
        for kb in range(0, n_full, B):
            acc, acc2 = _gemv_step(
                acc,
                acc2,
                x_ptr,
                x_row,
                row_ptr,
                row2_ptr,
                lane,
                every_row,
                kb,
                n_blocks,
                DECODE,
                V,
                S,
                P,
                B,
                GLU,
                False,
            )
        if n_full < n_steps:
            acc, acc2 = _gemv_step(
                acc,
                acc2,
                x_ptr,
                x_row,
                row_ptr,
                row2_ptr,
                lane,
                every_row,
                n_full,
                n_blocks,
                DECODE,
                V,
                S,
                P,
                B,
                GLU,
                True,
            )
    acc = tl.sum(tl.sum(acc, axis=3), axis=2)
    if GLU:
        acc2 = tl.sum(tl.sum(acc2, axis=3), axis=2)
        acc = acc / (1.0 + tl.exp(-acc)) * acc2
    out_row = (g * TG + t)[:, None] * n_rows
    tl.store(out_ptr + out_row + r[None, :], acc, mask=(t < n_tokens)[:, None] & (r < n_rows)[None, :])


def gemv(
    x: torch.Tensor,
    w: QWeight,
    bt: BlockType,
    out: torch.Tensor,
    groups: int,
    tokens: int,
    x_div: int,
    slots: torch.Tensor | None,
    up: QWeight | None = None,
    i8: QAct | None = None,
    int8: bool = True,
) -> None:
    """The matrix-vector kernel; with `up`, its GLU form: silu(x w^T) * (x up^T). On the 8-bit route where the type
    has one and `int8` is on (tuning.Int8Routes.gemv): the activations rounded to int8, `i8` where given (x's
    rounding), else here (quantize_i8)."""
    group = triton.next_power_of_2(tokens)
    on_i8 = int8 and bt.dot8 is not None
    # registers per (token, row, block) that grow with the tokens: a part's float accumulators, or a quad's four
    # accumulators and four activation words (8-bit; counting the accumulators alone, T=8 spilled: 741 us for 4096^2)
    per_block = 8 if on_i8 else bt.part
    # the GLU keeps two products per value: tiles for twice the tokens keep its accumulators in registers
    tiles = tuning.gemv_tiles(
        Q(w.qtype),
        bt.values,
        per_block,
        group * (2 if up is not None else 1),
        grouped_blocks=0 if slots is None else w.cols // bt.values,
        i8=on_i8,
    )
    if on_i8:
        if i8 is None:
            i8 = quantize_i8(x.view(-1, w.cols))
        assert i8.rounds(x, w.cols), (tuple(i8.q.shape), tuple(x.shape))
        x, xd_xs = i8.q.view(-1).view(torch.int32), (i8.d, i8.s)
    else:
        xd_xs = (x, x)
    row_bytes = w.data.shape[-1]
    values = bt.dot8_values if on_i8 else bt.values  # per step of a lane: the 8-bit route's unit, or a block
    deltas = (second_delta(w), second_delta(w if up is None else up))
    # 16-byte loads of the experts' words: the 60 GB model's gate+up 1555 -> 1766 GB/s on the H200 (kernels.md)
    align = 16 if slots is not None and all(n % 16 == 0 for n in (w.slot_bytes, *deltas)) else 1
    grid = (groups * triton.cdiv(w.rows, tiles.rows),)
    _gemv_kernel[grid](
        x,
        *xd_xs,
        w.data,
        w.data if up is None else up.data,
        x if slots is None else slots,
        out,
        groups,
        w.rows,
        w.cols // values,
        row_bytes,
        w.slot_bytes,
        w.cols,
        x_div,
        tokens,
        *deltas,
        DECODE=bt.dot8 if on_i8 else bt.decode,
        V=values,
        S=bt.nbytes,
        P=bt.part,
        TG=group,
        R=tiles.rows,
        B=tiles.blocks,
        SLOTTED=slots is not None,
        GLU=up is not None,
        I8=on_i8,
        EMULATE=INTERPRETED,
        ALIGN=align,
        num_warps=tiles.num_warps,
    )
