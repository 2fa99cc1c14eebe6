"""Activations rounded to int8 for the 8-bit routes of the GGUF products: per block of 32 values q = round(x / d)
with d = max |x| / 127, as llama.cpp's GPU matrix-vector products round theirs.

`quantize_i8` rounds a tensor of activations in a launch of its own; `store_i8` is the same rounding as a Triton
function, which the kernels that write activations (fused.py's norms and attention) call on the values they store,
so that the products reading them skip that launch. The products take the rounding as quants (int8, one per value),
their scale d per 32 values and d * (sum of the quants) per 16 (the K-quants' offsets multiply that sum).
"""

from __future__ import annotations

import weakref

import torch
import triton
import triton.language as tl

from moerun.kernels import tuning


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
