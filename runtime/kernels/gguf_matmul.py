"""Products of activations with weights stored as GGUF blocks, decoded in registers: no dequantized copy is written.

The entry points, which pick a kernel by the number of tokens (the numbers, and the tiles, in tuning.py):
- gguf_mm, a dense product: the matrix-vector kernel (gemv.py) for a few tokens, the 8-bit GEMM (gemm.py) for a
  decode batch or a short prompt on the types it takes, the GEMM over the blocks for more; a dense product of more
  tokens on a GPU decodes its weight to bfloat16 once instead (decode_bf16) and multiplies on cuBLAS (bf16_mm);
- gguf_mv, a float32 router's product on the matrix-vector kernel alone;
- gguf_moe and gguf_moe_glu, each token's K experts of a bank of expert matrices in one launch: the matrix-vector
  kernel, a program group per (token, expert) pair, for a decode step or a short prompt; past that the pairs grouped
  by expert (moe_align.py) on the grouped GEMM.
The products that take an 8-bit route round their input to int8 first (act_i8.quantize_i8), unless the caller passes
that rounding along with it (`i8`, an act_i8.QAct: made by the kernel that wrote the input, fused.py's norms and
attention, or once for several products of one input, moe_rounding). A product on another route ignores it.

Shapes: T tokens, K experts per token, N rows (output features), C columns (input features), E slots in a bank.
Nothing here synchronises with the host, so every call can be captured in a CUDA graph.
"""

from __future__ import annotations

import dataclasses

import torch
from gguf import GGMLQuantizationType as Q

from moerun.kernels import tuning
from moerun.kernels.act_i8 import QAct, quantize_i8
from moerun.kernels.gemm import decode, gemm
from moerun.kernels.gemv import gemv
from moerun.kernels.moe_align import group_by_slot
from moerun.kernels.qtypes import BLOCK_TYPES, INTERPRETED, BlockType
from moerun.kernels.qweight import QWeight  # noqa: F401 (its home; imported from here too)
from moerun.kernels.tuning import INT8_ON, Int8Routes


def supports(qtype: Q) -> bool:
    return qtype in BLOCK_TYPES


def _block_type(w: QWeight) -> BlockType:
    bt = BLOCK_TYPES[Q(w.qtype)]
    # each matrix's rows contiguous; a bank's matrices may lie further apart (QWeight.slot_bytes)
    rows_contiguous = w.data.stride(-1) == 1 and w.data.stride(-2) == w.data.shape[-1]
    bank_ok = w.data.dim() == 2 or w.data.stride(0) >= w.rows * w.data.shape[-1]
    assert w.data.dtype == torch.uint8 and rows_contiguous and bank_ok, (w.data.dtype, w.qtype, w.data.stride())
    assert w.cols % bt.values == 0 and w.data.shape[-2:] == (w.rows, w.cols // bt.values * bt.nbytes), (
        tuple(w.data.shape),
        Q(w.qtype).name,
        w.rows,
        w.cols,
    )
    assert w.data.data_ptr() % 4 == 0, "fp16 fields are loaded as fp16: the bytes must start aligned"
    return bt


def moe_gemm_i8(bt: BlockType, n_tokens: int, routes: Int8Routes = INT8_ON) -> bool:
    """Does a prompt step of n_tokens run its experts on the 8-bit GEMM (routes.gemm, GEMM_I8_MIN_TOKENS)?"""
    return routes.gemm and bt.gemm8 is not None and n_tokens >= tuning.GEMM_I8_MIN_TOKENS


def dense_gemm_i8(bt: BlockType, n_tokens: int, routes: Int8Routes = INT8_ON) -> bool:
    """Does a dense product of n_tokens run on the 8-bit GEMM (routes.gemm, DENSE_I8_MIN/MAX_TOKENS)?"""
    return routes.gemm and bt.gemm8 is not None and tuning.DENSE_I8_MIN_TOKENS <= n_tokens <= tuning.DENSE_I8_MAX_TOKENS


def gguf_mm(x: torch.Tensor, w: QWeight, i8: QAct | None = None, routes: Int8Routes = INT8_ON) -> torch.Tensor:
    """x (T, C) float32 or bfloat16 @ w.T -> (T, N) float32; `i8`: x's rounding for the 8-bit routes, if made;
    `routes`: which 8-bit routes are on."""
    bt = _block_type(w)
    assert x.dim() == 2 and x.shape[1] == w.cols and w.data.dim() == 2, (tuple(x.shape), tuple(w.data.shape))
    x = x.contiguous()
    n_tokens = x.shape[0]
    on_i8 = dense_gemm_i8(bt, n_tokens, routes)
    if not on_i8 and n_tokens >= tuning.DECODED_GEMM_MIN_TOKENS and x.is_cuda and not INTERPRETED:
        return _decoded_mm(x, w)
    out = torch.empty(n_tokens, w.rows, dtype=torch.float32, device=x.device)
    if n_tokens == 0:
        return out
    if on_i8:
        gemm(x, w, bt, out, n_tokens, 1, None, tuning.dense_i8_tiles(Q(w.qtype)), on_i8=True, i8=i8)
    elif n_tokens <= tuning.GEMV_MAX_TOKENS:
        gemv(x, w, bt, out, groups=1, tokens=n_tokens, x_div=1, slots=None, i8=i8, int8=routes.gemv)
    else:
        gemm(x, w, bt, out, n_tokens, 1, None, tuning.gemm_tiles(Q(w.qtype), bt.values, grouped=False))
    return out


def gguf_mv(x: torch.Tensor, w: QWeight) -> torch.Tensor:
    """x (T, C) @ w.T -> (T, N) float32 on the matrix-vector kernel alone, T <= tuning.GEMV_MAX_TOKENS: products in
    float32 for a float32 weight, where gguf_mm takes bfloat16 routes from DECODED_GEMM_MIN_TOKENS tokens (a router,
    whose near-ties decide the experts)."""
    bt = _block_type(w)
    assert x.dim() == 2 and x.shape[1] == w.cols and 0 < x.shape[0] <= tuning.GEMV_MAX_TOKENS, tuple(x.shape)
    out = torch.empty(x.shape[0], w.rows, dtype=torch.float32, device=x.device)
    gemv(x.contiguous(), w, bt, out, groups=1, tokens=x.shape[0], x_div=1, slots=None)
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
        part = dataclasses.replace(w, data=w.data[start : start + chunk], rows=min(chunk, w.rows - start))
        out[:, start : start + part.rows] = bf16_mm(x, decode_bf16(part))
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
    return decode(w, _block_type(w))


def gguf_moe(
    x: torch.Tensor,
    w: QWeight,
    slots: torch.Tensor,
    groups: dict | None = None,
    i8: QAct | None = None,
    routes: Int8Routes = INT8_ON,
) -> torch.Tensor:
    """Each token's K experts of a bank in one launch: -> (T, K, N) float32.

    w.data: (E, N, row_bytes); slots (T, K) int32 or int64: the bank slot of token t's k-th expert, -1 to skip it
    (zeros out). x: (T, C), shared by the token's K experts (gate, up), or (T, K, C), one input per (t, k) (down).
    `groups`: where the prefill path keeps its group_by_slot of these slots for the other banks of the same layer
    (made once a layer, not once a bank). `i8`: x's rounding for the 8-bit routes, if made; `routes`: which are on.
    """
    bt = _block_type(w)
    assert w.data.dim() == 3 and slots.dim() == 2 and slots.dtype in (torch.int32, torch.int64), (
        tuple(w.data.shape),
        slots.dtype,
    )
    n_tokens, k = slots.shape
    assert x.shape == (n_tokens, w.cols) or x.shape == (n_tokens, k, w.cols), (tuple(x.shape), tuple(slots.shape))
    x_div = k if x.dim() == 2 else 1  # pair id t*K + k reads input row t, or its own row
    x, slots = x.contiguous(), slots.contiguous()
    if n_tokens * k == 0:
        return torch.zeros(n_tokens, k, w.rows, dtype=torch.float32, device=x.device)
    if n_tokens <= tuning.MOE_GEMV_MAX_TOKENS:
        out = torch.empty(n_tokens * k, w.rows, dtype=torch.float32, device=x.device)
        gemv(x, w, bt, out, groups=n_tokens * k, tokens=1, x_div=x_div, slots=slots, i8=i8, int8=routes.gemv)
    else:
        out = torch.zeros(n_tokens * k, w.rows, dtype=torch.float32, device=x.device)  # skipped pairs stay zero
        on_i8 = moe_gemm_i8(bt, n_tokens, routes)
        tiles = tuning.gemm_tiles(
            Q(w.qtype), bt.values, grouped=True, grouped_blocks=w.cols // bt.values, i8=on_i8, n_tokens=n_tokens
        )
        key, groups = (w.data.shape[0], tiles.block_m), {} if groups is None else groups
        if key not in groups:
            groups[key] = group_by_slot(slots, *key)
        gemm(x, w, bt, out, n_tokens * k, x_div, groups[key], tiles, on_i8, i8)
    return out.view(n_tokens, k, w.rows)


def glu_supports(gate: QWeight, up: QWeight) -> bool:
    """gguf_moe_glu needs gate and up banks of one type and shape."""
    return gate.qtype == up.qtype and gate.data.shape == up.data.shape and gate.rows == up.rows and gate.cols == up.cols


def moe_rounding(x: torch.Tensor, bank: QWeight, n_tokens: int, routes: Int8Routes = INT8_ON) -> QAct | None:
    """x (T, C)'s rounding where a prompt step of n_tokens multiplies it with the experts of `bank` on the 8-bit
    GEMM (moe_gemm_i8), else None: made once for the banks that read the same input (gate and up)."""
    if n_tokens > tuning.MOE_GEMV_MAX_TOKENS and moe_gemm_i8(_block_type(bank), n_tokens, routes):
        return quantize_i8(x.contiguous())
    return None


def gguf_moe_glu(
    x: torch.Tensor,
    gate: QWeight,
    up: QWeight,
    slots: torch.Tensor,
    groups: dict | None = None,
    i8: QAct | None = None,
    routes: Int8Routes = INT8_ON,
) -> torch.Tensor:
    """silu(gguf_moe(x, gate, slots)) * gguf_moe(x, up, slots): -> (T, K, N) float32, skipped slots zeros. `i8`:
    x's rounding for the 8-bit routes, if made; `routes`: which are on.

    Decode-sized steps run both banks in one matrix-vector launch (the input read once, the SwiGLU done on the
    accumulators); prefill runs the two grouped GEMMs on one grouping and one rounding, and the product.
    """
    assert glu_supports(gate, up), (Q(gate.qtype).name, Q(up.qtype).name, tuple(gate.data.shape))
    n_tokens, k = slots.shape
    if n_tokens * k == 0 or n_tokens > tuning.MOE_GLU_GEMV_MAX_TOKENS:
        groups = {} if groups is None else groups
        if i8 is None and n_tokens * k:
            i8 = moe_rounding(x, gate, n_tokens, routes)
        g, u = gguf_moe(x, gate, slots, groups, i8, routes), gguf_moe(x, up, slots, groups, i8, routes)
        return torch.nn.functional.silu(g) * u
    bt = _block_type(gate)
    _block_type(up)
    assert x.shape == (n_tokens, gate.cols), (tuple(x.shape), tuple(slots.shape))
    x, slots = x.contiguous(), slots.contiguous()
    out = torch.empty(n_tokens * k, gate.rows, dtype=torch.float32, device=x.device)
    gemv(x, gate, bt, out, groups=n_tokens * k, tokens=1, x_div=k, slots=slots, up=up, i8=i8, int8=routes.gemv)
    return out.view(n_tokens, k, gate.rows)
