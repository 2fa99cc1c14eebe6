"""Activations rounded to int8 for the 8-bit routes of the GGUF products: per block of 32 values q = round(x / d)
with d = max |x| / 127, as llama.cpp's GPU matrix-vector products round theirs.

A rounding is a value, `QAct`: the quants (int8, one per value), their scale d per 32 values and d * (sum of the
quants) per 16 (the K-quants' offsets multiply that sum). `quantize_i8` makes one for a tensor of activations in a
launch of its own; `store_i8` is the same rounding as a Triton function, which the kernels that write activations
(fused.py's norms and attention) call on the values they store and return with them, so that the products reading
those values take it as an argument and skip that launch: three of the four per layer of a decode step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moerun.kernels import tuning


@dataclass(frozen=True)
class QAct:
    """Activations (rows, C) rounded for the 8-bit routes, C a multiple of 32: quants q (rows, C) int8, each block of
    32 values' scale d (rows, C / 32) float32, and d * (sum of the quants) per 16 values s (rows, C / 16) float32;
    value c of row r is d[r, c // 32] * q[r, c].

    It is the rounding of the values its maker read or wrote at that moment: whoever passes it to a product passes it
    with those values, as the product's input `x` (gguf_matmul: the i8 arguments)."""

    q: torch.Tensor
    d: torch.Tensor
    s: torch.Tensor

    def __post_init__(self) -> None:
        rows, cols = self.q.shape
        assert (
            self.q.dtype == torch.int8
            and cols % 32 == 0
            and self.d.shape == (rows, cols // 32)
            and self.s.shape == (rows, cols // 16)
        ), (tuple(self.q.shape), tuple(self.d.shape), tuple(self.s.shape))

    @classmethod
    def empty(cls, rows: int, cols: int, device: torch.device) -> QAct:
        """Uninitialised buffers for the rounding of (rows, cols) activations, for a kernel to store_i8 into."""
        return cls(
            torch.empty(rows, cols, dtype=torch.int8, device=device),
            torch.empty(rows, cols // 32, dtype=torch.float32, device=device),
            torch.empty(rows, cols // 16, dtype=torch.float32, device=device),
        )

    def rounds(self, x: torch.Tensor, cols: int) -> bool:
        """Is it shaped as the rounding of x read as rows of `cols` values (a product's input)?"""
        return self.q.shape == (x.numel() // cols, cols)


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


def quantize_i8(x: torch.Tensor) -> QAct:
    """Activations (rows, C) float32 or bfloat16, C a multiple of 32 -> their rounding for the 8-bit routes. Each
    block of 32 is rounded on its own scale max |x| / 127, as llama.cpp's GPU matrix-vector products round theirs."""
    rows, cols = x.shape
    assert cols % 32 == 0 and x.is_contiguous(), (tuple(x.shape), x.stride())
    out = QAct.empty(rows, cols, x.device)
    if rows:
        _quantize_i8_kernel[(rows, triton.cdiv(cols // 32, tuning.QUANTIZE_BLOCKS))](
            x, out.q, out.d, out.s, cols, NB=tuning.QUANTIZE_BLOCKS, enable_fp_fusion=False
        )  # no FMA: see store_i8
    return out
