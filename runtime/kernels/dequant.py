"""GGUF bytes -> float weights in torch, on whatever device the bytes are on (CUDA or CPU).

The runtime keeps routed-expert weights as their raw GGUF bytes (a uint8 tensor on the compute device) and
dequantizes only the experts the router picks. gguf-py's numpy dequantizers do that job on the host; these do it with
plain tensor ops over all blocks at once: no host syncs, no numpy, no device-side tables, so they also run under
`torch.compile`. Types not in `DEQUANTIZERS` are the caller's to send to `gguf.quants.dequantize` (check `supports`).

Block layouts are ggml's (`ggml-common.h`); each function reads them the way gguf-py's `dequantize_blocks` does and
computes the same float32 products in the same order, so the results are bit-identical to gguf-py (tests/runtime/
test_dequant.py). The scale products are exact in float32 (an fp16 significand times small integers stays within 24
bits), so at most one rounding happens per value, in the final add of a min or offset; a fused multiply-add (as
`torch.compile` may emit) rounds that same sum once and gives the same bits.

Shapes: B blocks; S bytes per block and V values per block (gguf.GGML_QUANT_SIZES[type] is (V, S)); a K-quant block
is V=256 values in sub-blocks of 16 or 32 that share a 6- or 8-bit scale.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

# [B, S] uint8 -> [B, V] float32
BlockDequantizer = Callable[[torch.Tensor], torch.Tensor]


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[B, 2] little-endian fp16 bytes (GGUF and every torch device are little-endian) -> [B, 1] float32."""
    return b.view(torch.float16).float()


def _unpack(b: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., n] uint8 -> [..., 8 // bits, n]: field f of every byte, the lowest bits first.

    One scalar shift per field: shifting by a broadcast tensor of shifts is ten times slower on the CPU.
    """
    mask = (1 << bits) - 1
    return torch.stack([(b >> shift) & mask for shift in range(0, 8, bits)], dim=-2)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., n] packed 4-bit quants -> [..., 2n]: the n low nibbles, then the n high ones (ggml's order)."""
    return _unpack(qs, 4).flatten(-2)


def _high_bits_u32(qh: torch.Tensor) -> torch.Tensor:
    """[B, 4] bytes of a little-endian uint32 -> [B, 32]: bit j of the word is element j's fifth bit (Q5_0, Q5_1)."""
    return _unpack(qh, 1).transpose(-1, -2).flatten(-2)  # [B, 8 bits, 4 bytes] -> [B, 4, 8] -> [B, 32]


def _kquant_scales_mins(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K block head (d, dmin as fp16, 12 bytes of 6-bit scales and mins) -> d*sc, dmin*m, each [B, 8, 1].

    Bytes 0-3 of the 12 hold scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3; sub-blocks 4-7 take their low 4 bits
    from a nibble of bytes 8-11 (scale low, min high) and their top 2 bits from the spare top bits of bytes 0-7.
    """
    sc, mn, hi = b[:, 4:16].unflatten(-1, (3, 4)).unbind(-2)  # [B, 4] each
    sc_all = torch.cat([sc & 0x3F, (hi & 0x0F) | ((sc >> 2) & 0x30)], dim=-1)  # [B, 8]
    mn_all = torch.cat([mn & 0x3F, (hi >> 4) | ((mn >> 2) & 0x30)], dim=-1)  # [B, 8]
    return (_f16(b[:, 0:2]) * sc_all.float()).unsqueeze(-1), (_f16(b[:, 2:4]) * mn_all.float()).unsqueeze(-1)


def _e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """[B, 1] E8M0 exponents -> [B, 1] float32 2**(e - 128), half the shared scale (ggml_e8m0_to_fp32_half).

    e < 2 lands below float32's normal range, so its bits are the subnormals 2**-128 and 2**-127.
    """
    e = e.to(torch.int32)
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    return bits.view(torch.float32)


def _e2m1_doubled(code: torch.Tensor) -> torch.Tensor:
    """[...] 4-bit E2M1 codes (sign, 2-bit exponent, 1-bit mantissa) -> twice their value as float32.

    That is 0, 1, 2, 3, 4, 6, 8, 12 and their negatives, computed rather than looked up so that no table has to live
    on the device: exponent 0 is subnormal (the mantissa itself), exponent x > 0 gives (2 + mantissa) << (x - 1).
    """
    exp, man = ((code >> 1) & 3).to(torch.int32), (code & 1).to(torch.int32)
    value = torch.where(exp == 0, man, (2 + man) << (exp - 1).clamp(min=0))
    return torch.where(code >= 8, -value, value).float()


def _f32(b: torch.Tensor) -> torch.Tensor:
    return b.view(torch.float32)  # [B, 4] -> [B, 1]


def _bf16(b: torch.Tensor) -> torch.Tensor:
    return b.view(torch.bfloat16).float()  # [B, 2] -> [B, 1]; bfloat16 is float32's top half, so exact


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    """d (fp16), 32 int8 quants."""
    return b[:, 2:].view(torch.int8).float() * _f16(b[:, 0:2])  # [B, 32]


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    """d (fp16), 16 bytes of nibbles; value = d * (q - 8)."""
    q = _nibbles(b[:, 2:]).to(torch.int8) - 8  # [B, 32]
    return q.float() * _f16(b[:, 0:2])


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    """d, m (fp16), 16 bytes of nibbles; value = d * q + m."""
    return _nibbles(b[:, 4:]).float() * _f16(b[:, 0:2]) + _f16(b[:, 2:4])  # [B, 32]


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    """d (fp16), qh (uint32 of fifth bits), 16 bytes of nibbles; value = d * (q - 16)."""
    q = (_nibbles(b[:, 6:]) | (_high_bits_u32(b[:, 2:6]) << 4)).to(torch.int8) - 16  # [B, 32]
    return q.float() * _f16(b[:, 0:2])


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    """d, m (fp16), qh (uint32 of fifth bits), 16 bytes of nibbles; value = d * q + m."""
    q = _nibbles(b[:, 8:]) | (_high_bits_u32(b[:, 4:8]) << 4)  # [B, 32]
    return q.float() * _f16(b[:, 0:2]) + _f16(b[:, 2:4])


def _mxfp4(b: torch.Tensor) -> torch.Tensor:
    """e (E8M0 shared exponent), 16 bytes of E2M1 nibbles; value = e2m1 * 2**(e - 127)."""
    return _e2m1_doubled(_nibbles(b[:, 1:])) * _e8m0_half(b[:, 0:1])  # [B, 32]


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    """16 scale bytes (low nibble scale, high nibble min), 64 bytes of 2-bit quants, d, dmin (fp16).

    Each 32-byte half covers 128 values: four 2-bit planes of 32 values, each plane two sub-blocks of 16.
    """
    scales, qs = b[:, 0:16], b[:, 16:80]
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    dl = (d * (scales & 0x0F).float()).unsqueeze(-1)  # [B, 16, 1]
    ml = (dmin * (scales >> 4).float()).unsqueeze(-1)  # [B, 16, 1]
    q = _unpack(qs.unflatten(-1, (2, 32)), 2).reshape(-1, 16, 16).float()  # [B, 2, 4 planes, 32] -> [B, 16, 16]
    return (dl * q - ml).flatten(-2)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    """32 bytes hmask (third bits), 64 bytes of 2-bit quants, 12 bytes of 6-bit signed scales, d (fp16).

    Scale i takes its low 4 bits from nibble i of bytes 0-7 (all low nibbles first) and its top 2 bits from 2-bit
    field i // 4 of byte 8 + i % 4. A quant is its 2 low bits minus 4 where its hmask bit is clear.
    """
    hmask, qs, scales, d = b[:, 0:32], b[:, 32:96], b[:, 96:108], _f16(b[:, 108:110])
    low = _nibbles(scales[:, 0:8])  # [B, 16]
    high = _unpack(scales[:, 8:12], 2).flatten(-2)  # [B, 4 fields, 4 bytes] -> [B, 16]
    sc = (low | (high << 4)).to(torch.int8) - 32
    dl = (d * sc.float()).unsqueeze(-1)  # [B, 16, 1]
    ql = _unpack(qs.unflatten(-1, (2, 32)), 2).reshape(-1, 16, 16).to(torch.int8)  # [B, 16, 16]
    qh = _unpack(hmask, 1).reshape(-1, 16, 16).to(torch.int8)  # [B, 8 bits, 32] -> [B, 16, 16]
    return (dl * (ql - 4 * (1 - qh)).float()).flatten(-2)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    """d, dmin (fp16), 12 bytes of 6-bit scales and mins, 128 bytes of nibbles; value = d*sc * q - dmin*m.

    Each 32-byte chunk holds two sub-blocks of 32: the low nibbles, then the high ones.
    """
    ds, dm = _kquant_scales_mins(b)  # [B, 8, 1] each
    q = _nibbles(b[:, 16:].unflatten(-1, (4, 32))).reshape(-1, 8, 32).float()  # [B, 4, 64] -> [B, 8, 32]
    return (ds * q - dm).flatten(-2)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    """Q4_K plus 32 bytes qh before the nibbles: bit j of qh[l] is the fifth bit of sub-block j's value l."""
    ds, dm = _kquant_scales_mins(b)  # [B, 8, 1] each
    ql = _nibbles(b[:, 48:].unflatten(-1, (4, 32))).reshape(-1, 8, 32)  # [B, 8, 32]
    qh = _unpack(b[:, 16:48], 1)  # [B, 8, 32]
    return (ds * (ql | (qh << 4)).float() - dm).flatten(-2)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    """128 bytes low nibbles, 64 bytes of 2-bit high parts, 16 int8 scales, d (fp16); value = d*sc * (q - 32).

    Each half of 128 values: nibbles of 64 bytes (low, then high) and four 2-bit planes of 32 bytes, in one order.
    """
    ql = _nibbles(b[:, 0:128].unflatten(-1, (2, 64))).reshape(-1, 256)  # [B, 2, 128] -> [B, 256]
    qh = _unpack(b[:, 128:192].unflatten(-1, (2, 32)), 2).reshape(-1, 256)  # [B, 2, 4, 32] -> [B, 256]
    q = (ql | (qh << 4)).to(torch.int8) - 32
    ds = (_f16(b[:, 208:210]) * b[:, 192:208].view(torch.int8).float()).unsqueeze(-1)  # [B, 16, 1]
    return (ds * q.unflatten(-1, (16, 16)).float()).flatten(-2)


# Every type read here, the common expert types first; gguf-py dequantizes the rest (see `supports`).
DEQUANTIZERS: dict[Q, BlockDequantizer] = {
    Q.F32: _f32,
    Q.F16: _f16,
    Q.BF16: _bf16,
    Q.Q8_0: _q8_0,
    Q.Q4_K: _q4_k,
    Q.Q6_K: _q6_k,
    Q.Q5_K: _q5_k,
    Q.Q4_0: _q4_0,
    Q.Q5_0: _q5_0,
    Q.MXFP4: _mxfp4,  # gpt-oss experts
    Q.Q4_1: _q4_1,
    Q.Q5_1: _q5_1,
    Q.Q2_K: _q2_k,
    Q.Q3_K: _q3_k,
}


def supports(qtype: Q) -> bool:
    return qtype in DEQUANTIZERS


def dequantize(raw: torch.Tensor, qtype: Q, row_length: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., row_bytes] uint8 GGUF rows -> [..., row_length] of `dtype`, on raw's device.

    Values are computed in float32 (bit-identical to gguf-py) and then cast to `dtype`. Raises NotImplementedError
    for a type not in DEQUANTIZERS (see `supports`): the caller dequantizes those with gguf.quants.dequantize.
    """
    # Rebuilt from its value because torch.compile (2.13) does not guard an enum that is only used as a dict key:
    # without this, a graph traced for Q4_K would be reused for Q4_0 rows of the same byte length.
    qtype = Q(qtype)
    if qtype not in DEQUANTIZERS:
        raise NotImplementedError(f"no torch dequantizer for {qtype.name}; use gguf.quants.dequantize")
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    assert raw.dtype == torch.uint8 and row_length % block_size == 0, (raw.dtype, qtype.name, row_length)
    assert raw.shape[-1] == row_length // block_size * type_size, (tuple(raw.shape), qtype.name, row_length)
    blocks = raw.reshape(raw.numel() // type_size, type_size)  # [B, S]
    values = DEQUANTIZERS[qtype](blocks)  # [B, V]
    return values.reshape(*raw.shape[:-1], row_length).to(dtype)
