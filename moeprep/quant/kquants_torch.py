"""Q4_K, Q5_K and Q6_K in torch, on the CPU or a GPU, with the same bytes as moeprep.quant.kquants (and so as ggml).

It implements the same ggml algorithms as the numba kernels (q4_k_q5_k.py, q6_k.py, searches.py), in the same
float32 operations and order, with their constants and type table imported; where those walk blocks in loops, this
module is vectorised over every block of a chunk at once (element-major search arrays, masks for what the C decides
per block). A change to one is a change to both; tests/quant/test_kquants_torch.py checks kquants == torch ==
libggml bytes on the same inputs.

Besides the numba kernels' habits (jit.py: float32 in C's order, no fused multiply-add, running sums in order,
ggml's nearest_int, C-like narrowing, round-to-nearest-even fp16), torch needs these:
  * every division goes through `_div`, with both operands tensors of the full shape: torch computes
    `scalar / tensor` as `reciprocal() * scalar`, and on CUDA `tensor / python_scalar` as a multiplication by the
    reciprocal; neither is C's correctly rounded division;
  * no fused or reducing ops (addcmul, lerp, matmul, sum): one C operation is one torch op, and a running sum is
    a sequence of adds;
  * scalar constants are computed in numpy float32, as the numba kernels' `F32(...)` constants, and passed as Python
    floats (exactly representable, so torch casts them back without rounding);
  * `nearest_int` maps NaN to 0, as x86 does for its default NaN (0xFFC00000) that ggml and numpy see; a GPU's
    canonical NaN has other mantissa bits. NaN appears in lanes whose result is then discarded (a constant
    sub-block divides 0 by 0), so only this function sees its bits;
  * square roots go through float64 (`_sqrt`): torch's CPU sqrt is not correctly rounded;
  * integers narrow to uint8 through `& 0xFF`, so the wrap of a C cast does not rest on a backend's conversion;
  * a NaN fp16 scale keeps the bits of the NaN the hardware made, which differ between x86 and a GPU:
    `quantizers_on` quantizes such rows (|x| > 1.8e19 only) again with the numba kernels.

The code is device-agnostic: tensors stay on the device of the rows, and only `quantizers_on` crosses to numpy.
Shapes: R rows, P values per row, B super-blocks of QK_K = 256, S sub-blocks, n values per sub-block; search arrays
are element-major [n, S].
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, QK_K, GGMLQuantizationType

from moeprep.quant import kquants
from moeprep.quant.jit import F32
from moeprep.quant.scalars import MAGIC
from moeprep.quant.searches import GROUP_MAX_EPS

FT = torch.float32
EPS = float(GROUP_MAX_EPS)

# Blocks per chunk, per device type: the CPU wants cache-sized chunks (2048 blocks are 2 MiB of float32 rows), a GPU
# chunks large enough to fill it (a Python loop step is one kernel launch): 65536 blocks are 64 MiB.
CHUNK_BLOCKS: dict[str, int] = {"cpu": 2048, "cuda": 1 << 16}

TorchBlocks = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]


def _f(v: float) -> float:
    """A constant as kquants.py's float32 value, as a Python float (exact)."""
    return float(F32(v))


def _div(a: torch.Tensor | float, b: torch.Tensor | float) -> torch.Tensor:
    """a / b, correctly rounded element by element: scalars become full tensors first (see the module docstring)."""
    if not isinstance(a, torch.Tensor):
        a = torch.full_like(b, a)
    if not isinstance(b, torch.Tensor):
        b = torch.full_like(a, b)
    a, b = torch.broadcast_tensors(a, b)
    return torch.div(a, b)


def _sqrt(v: torch.Tensor) -> torch.Tensor:
    """Correctly rounded float32 square root. torch's CPU sqrt is not (it differs from C's sqrtf by an ulp on about
    0.6% of inputs); sqrt in float64 rounded once to float32 is, as 53 >= 2 * 24 + 2 bits."""
    return torch.sqrt(v.to(torch.float64)).to(FT)


def _to_u8(v: torch.Tensor) -> torch.Tensor:
    """int32 -> uint8 as a C cast wraps."""
    return (v & 0xFF).to(torch.uint8)


def nearest_int(v: torch.Tensor) -> torch.Tensor:
    """scalars.nearest_int, elementwise: ggml's magic-number trick on the float32 bits. [...] float32 -> [...] int32."""
    bits = (v + float(MAGIC)).view(torch.int32)
    r = (bits & 0x007FFFFF) - 0x00400000
    return torch.where(torch.isnan(v), 0, r)


def _levels(v: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """max(lo, min(hi, nearest_int(v))) as float32: levels are small integers, exact in float32."""
    return nearest_int(v).clamp(lo, hi).to(FT)


def running_sum(terms: torch.Tensor, start: torch.Tensor | None = None) -> torch.Tensor:
    """`acc += terms[i]` in order, as C's loop does (torch's sum is pairwise). [n, ...] -> [...].

    start=None begins from 0.0f (C's `float s = 0;`); otherwise from a copy of start."""
    acc = torch.zeros(terms.shape[1:], dtype=FT, device=terms.device) if start is None else start.clone()
    for t in terms:
        acc = acc + t
    return acc


def _to_fp16(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GGML_FP32_TO_FP16 then GGML_FP16_TO_FP32: (fp16, read back as float32); `.to(float16)` rounds to nearest
    even."""
    h = v.to(torch.float16)
    return h, h.to(FT)


def _first_along(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x[idx[s], s] for each column s: np.take_along_axis(x, idx[None], 0)[0]. x [n, S], idx [S] -> [S]."""
    return torch.gather(x, 0, idx[None])[0]


def search_min_scale(
    x: torch.Tensor, w: torch.Tensor, nmax: int, rmin: float, rdelta: float, nstep: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """searches.search_min_scale (make_qkx2/qkx3_quants). x, w [n, S] -> scale [S], -min [S], L [n, S] uint8.

    The lanes where C returns early (max == min) are searched too and overwritten at the end."""
    nmax_f = F32(nmax)
    xmin = _first_along(x, x.argmin(dim=0))  # torch's argmin, like numpy's, keeps the first of equal minima
    xmax = x.amax(dim=0)
    sum_w = running_sum(w[1:], start=w[0])
    sum_x = running_sum(w[1:] * x[1:], start=w[0] * x[0])
    xmin = torch.where(xmin > 0, 0.0, xmin)
    flat = xmax == xmin

    iscale = _div(float(nmax_f), xmax - xmin)
    scale = _div(1.0, iscale)
    L = _levels((x - xmin) * iscale, 0, nmax)
    v = L * scale + xmin - x
    best_error = running_sum((v * v) * w)

    for step in range(nstep + 1):
        iscale = _div(float(F32(rmin) + F32(rdelta) * F32(step) + nmax_f), xmax - xmin)
        lf = _levels((x - xmin) * iscale, 0, nmax)
        wl = w * lf
        sum_l, sum_l2, sum_xl = running_sum(torch.stack([wl, wl * lf, wl * x], dim=1))
        D = sum_w * sum_l2 - sum_l * sum_l
        this_scale = _div(sum_w * sum_xl - sum_x * sum_l, D)
        this_min = _div(sum_l2 * sum_x - sum_l * sum_xl, D)
        clamp = this_min > 0
        this_min = torch.where(clamp, 0.0, this_min)
        this_scale = torch.where(clamp, _div(sum_xl, sum_l2), this_scale)
        v = lf * this_scale + this_min - x
        cur_error = running_sum((v * v) * w)
        better = (D > 0) & (cur_error < best_error)
        L = torch.where(better, lf, L)
        best_error = torch.where(better, cur_error, best_error)
        scale = torch.where(better, this_scale, scale)
        xmin = torch.where(better, this_min, xmin)

    L = torch.where(flat, 0.0, L)
    scale = torch.where(flat, 0.0, scale)
    return scale, -xmin, L.to(torch.uint8)


def search_symmetric_scale(x: torch.Tensor, nmax: int, qw: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """searches.search_symmetric_scale (make_qx_quants, rmse_type 1). x, qw [n, S] -> scale [S], L [n, S] uint8."""
    nmax_f = F32(nmax)
    w = x * x if qw is None else qw
    wx = w * x
    ax = x.abs()
    first_max = ax.argmax(dim=0)
    amax = _first_along(ax, first_max)
    vmax = _first_along(x, first_max)
    all_zero = amax < EPS

    def candidate(iscale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lf = torch.round(x * iscale).clamp(-nmax, nmax - 1)  # round half to even, like np.rint
        sumlx, suml2 = running_sum(torch.stack([wx * lf, (w * lf) * lf], dim=1))
        return sumlx, suml2, lf

    sumlx, suml2, L = candidate(_div(float(-nmax_f), vmax))
    scale = torch.where(suml2 != 0, _div(sumlx, suml2), 0.0)
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        sumlx, suml2, lf = candidate(_div(float(-(nmax_f + F32(0.1) * F32(step))), vmax))
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        L = torch.where(better, lf, L)
        scale = torch.where(better, _div(sumlx, suml2), scale)
        best = torch.where(better, scale * sumlx, best)

    L = torch.where(all_zero, 0.0, L + float(nmax_f))
    return torch.where(all_zero, 0.0, scale), L.to(torch.uint8)


def _search_block_scale(x: torch.Tensor, nmax: int, qw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """make_qp_quants on the sub-block scales (or mins) of every super-block, as q4_k_q5_k._search_block_scale.
    x, qw [n, B] -> block scale [B], L [n, B] uint8."""
    n = x.shape[0]
    nmax_f = F32(nmax)
    xmax = torch.zeros_like(x[0])
    for xi in x:
        xmax = torch.where(xmax > xi, xmax, xi)
    all_zero = xmax < EPS

    iscale = _div(float(nmax_f), xmax)
    L = _to_u8(nearest_int(iscale * x))
    scale = _div(1.0, iscale)
    diff = x - scale * L.to(FT)
    best_mse = running_sum((qw * diff) * diff)
    for step in range(-4, 5):
        if step == 0:
            continue
        iscale_is = _div(float(F32(0.1) * F32(step) + nmax_f), xmax)
        scale_is = _div(1.0, iscale_is)
        l = nearest_int(iscale_is * x).clamp(max=nmax)
        diff = x - scale_is * l.to(FT)
        mse = running_sum((qw * diff) * diff)
        better = mse < best_mse
        best_mse = torch.where(better, mse, best_mse)
        iscale = torch.where(better, iscale_is, iscale)

    l = nearest_int(iscale * x).clamp(max=nmax)
    L = _to_u8(l)
    lf = l.to(FT)
    sumlx = running_sum((qw * x) * lf)
    suml2 = running_sum((qw * lf) * lf)
    # Coordinate refinement: C stops after a pass that changes nothing; an unchanged state makes every later pass a
    # no-op too, so running all five passes on every block gives the same result without a per-block stop flag.
    for _ in range(5):
        for i in range(n):
            w, xi = qw[i], x[i]
            li = L[i].to(FT)
            slx = sumlx - (w * xi) * li
            sl2 = suml2 - (w * li) * li
            new_l = nearest_int(_div(xi * sl2, slx)).clamp(max=nmax)
            nlf = new_l.to(FT)
            slx_new = slx + (w * xi) * nlf
            sl2_new = sl2 + (w * nlf) * nlf
            take = (
                (slx > 0)
                & (sl2 > 0)
                & (new_l != L[i].to(torch.int32))
                & ((slx_new * slx_new) * suml2 > (sumlx * sumlx) * sl2_new)
            )
            L[i] = torch.where(take, _to_u8(new_l), L[i])
            sumlx = torch.where(take, slx_new, sumlx)
            suml2 = torch.where(take, sl2_new, suml2)

    scale = torch.where(suml2 > 0, _div(sumlx, suml2), 0.0)
    return torch.where(all_zero, 0.0, scale), torch.where(all_zero, 0, L)


def _block_sigma2(xb: torch.Tensor) -> torch.Tensor:
    """2 * sum(x^2) / QK_K per super-block, summed in order as C does. [B, 256] -> [B]."""
    xt = xb.T.contiguous()
    return _div(2.0 * running_sum(xt * xt), float(QK_K))


def _pack_scales_k4(ls: torch.Tensor, lm: torch.Tensor) -> torch.Tensor:
    """Eight 6-bit scales and mins into ggml's 12-byte layout. ls, lm [B, 8] uint8 -> [B, 12] uint8."""
    lo_s, hi_s, lo_m, hi_m = ls[:, :4], ls[:, 4:], lm[:, :4], lm[:, 4:]
    return torch.cat([lo_s | ((hi_s >> 4) << 6), lo_m | ((hi_m >> 4) << 6), (hi_s & 0xF) | ((hi_m & 0xF) << 4)], dim=1)


def _unpack_scales_k4(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's get_scale_min_k4 for all eight sub-blocks. [B, 12] uint8 -> (sc [B, 8], m [B, 8]) uint8."""
    a, b, c = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = torch.cat([a & 63, (c & 0xF) | ((a >> 6) << 4)], dim=1)
    m = torch.cat([b & 63, (c >> 4) | ((b >> 6) << 4)], dim=1)
    return sc, m


def _fp16_bytes(h: torch.Tensor) -> torch.Tensor:
    """[B] float16 -> [B, 2] uint8, little-endian like ggml's struct."""
    return h.view(torch.uint8).reshape(-1, 2)


def _quantize_k_min(
    xb: torch.Tensor,
    qw: torch.Tensor | None,
    nmax: int,
    ref_search: tuple[float, float, int],
    clamp_weighted_levels: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The shared half of Q4_K and Q5_K (q4_k_q5_k.k_min_rows): eight sub-blocks of 32, 6-bit scales and mins.
    xb, qw [B, 256] -> d [B] fp16, dmin [B] fp16, packed scales [B, 12], L [B, 256] uint8."""
    B = xb.shape[0]
    x = xb.reshape(B * 8, 32).T.contiguous()  # [32, S], S = 8B
    if qw is None:
        av_x = _sqrt(_div(running_sum(x * x), 32.0))
        weights = av_x + x.abs()
        scales, mins, L = search_min_scale(x, weights, nmax, *ref_search)
        scales, mins = scales.reshape(B, 8), mins.reshape(B, 8)
        max_scale = torch.zeros(B, dtype=FT, device=xb.device)
        max_min = torch.zeros(B, dtype=FT, device=xb.device)
        for j in range(8):
            max_scale = torch.where(scales[:, j] > max_scale, scales[:, j], max_scale)
            max_min = torch.where(mins[:, j] > max_min, mins[:, j], max_min)
        inv_scale = torch.where(max_scale > 0, _div(63.0, max_scale), 0.0)
        inv_min = torch.where(max_min > 0, _div(63.0, max_min), 0.0)
        ls = _to_u8(nearest_int(inv_scale[:, None] * scales)).clamp(max=63)
        lm = _to_u8(nearest_int(inv_min[:, None] * mins)).clamp(max=63)
        d_block = _div(max_scale, 63.0)
        m_block = _div(max_min, 63.0)
    else:
        sigma2 = _block_sigma2(xb).repeat_interleave(8)  # [S]
        weights = qw.reshape(B * 8, 32).T.contiguous() * _sqrt(sigma2 + x * x)
        sw = running_sum(weights)
        scales, mins, L = search_min_scale(x, weights, nmax, -0.9, 0.05, 36)
        sw8 = sw.reshape(B, 8).T.contiguous()
        d_block, ls = _search_block_scale(scales.reshape(B, 8).T.contiguous(), 63, sw8)
        m_block, lm = _search_block_scale(mins.reshape(B, 8).T.contiguous(), 63, sw8)
        ls, lm = ls.T, lm.T
        if clamp_weighted_levels:
            ls, lm = ls.clamp(max=63), lm.clamp(max=63)

    packed = _pack_scales_k4(ls, lm)
    d16, d = _to_fp16(d_block)
    dmin16, dmin = _to_fp16(m_block)

    sc, m = _unpack_scales_k4(packed)
    d_sub = d[:, None] * sc.to(FT)  # [B, 8]
    dm_sub = dmin[:, None] * m.to(FT)
    L = L.T.reshape(B, 8, 32)
    xs = xb.reshape(B, 8, 32)
    requant = nearest_int(_div(xs + dm_sub[..., None], d_sub[..., None])).clamp(0, nmax)
    L = torch.where((d_sub != 0)[..., None], requant, L.to(torch.int32)).to(torch.uint8).reshape(B, QK_K)
    return d16, dmin16, packed, L


def _q4_k_blocks(xb: torch.Tensor, qw: torch.Tensor | None) -> torch.Tensor:
    """[B, 256] float32 -> [B, 144] Q4_K bytes: d, dmin (fp16), scales[12], qs[128]."""
    B = xb.shape[0]
    d16, dmin16, packed, L = _quantize_k_min(xb, qw, 15, (-1.0, 0.1, 20), clamp_weighted_levels=False)
    Lr = L.reshape(B, 4, 2, 32)
    qs = (Lr[:, :, 0] | (Lr[:, :, 1] << 4)).reshape(B, 128)
    return torch.cat([_fp16_bytes(d16), _fp16_bytes(dmin16), packed, qs], dim=1)


def _q5_k_blocks(xb: torch.Tensor, qw: torch.Tensor | None) -> torch.Tensor:
    """[B, 256] float32 -> [B, 176] Q5_K bytes: d, dmin (fp16), scales[12], qh[32], qs[128]."""
    B = xb.shape[0]
    d16, dmin16, packed, L = _quantize_k_min(xb, qw, 31, (-0.5, 0.1, 15), clamp_weighted_levels=True)
    Lr = L.reshape(B, 4, 2, 32)
    lo = Lr & 0xF
    qs = (lo[:, :, 0] | (lo[:, :, 1] << 4)).reshape(B, 128)
    hi = (Lr >> 4).reshape(B, 8, 32)
    qh = torch.zeros((B, 32), dtype=torch.uint8, device=xb.device)
    for g in range(8):
        qh = qh | (hi[:, g] << g)
    return torch.cat([_fp16_bytes(d16), _fp16_bytes(dmin16), packed, qh, qs], dim=1)


def _q6_k_blocks(xb: torch.Tensor, qw: torch.Tensor | None) -> torch.Tensor:
    """[B, 256] float32 -> [B, 210] Q6_K bytes: ql[128], qh[64], scales[16] (int8), d (fp16)."""
    B = xb.shape[0]
    x = xb.reshape(B * 16, 16).T.contiguous()  # [16, S], S = 16B
    w = None if qw is None else qw.reshape(B * 16, 16).T.contiguous()
    scales, L = search_symmetric_scale(x, 32, w)
    scales = scales.reshape(B, 16)

    max_scale = torch.zeros(B, dtype=FT, device=xb.device)
    max_abs = torch.zeros(B, dtype=FT, device=xb.device)
    for ib in range(16):
        a = scales[:, ib].abs()
        upd = a > max_abs
        max_abs = torch.where(upd, a, max_abs)
        max_scale = torch.where(upd, scales[:, ib], max_scale)
    zero_block = max_abs < EPS

    iscale = _div(-128.0, max_scale)
    d16, d = _to_fp16(_div(1.0, iscale))
    sc = nearest_int(iscale[:, None] * scales).clamp(max=127).to(torch.int8)  # [B, 16]
    d_sub = d[:, None] * sc.to(FT)
    L = L.T.reshape(B, 16, 16)
    xs = xb.reshape(B, 16, 16)
    requant = nearest_int(_div(xs, d_sub[..., None])).clamp(-32, 31) + 32
    L = torch.where((d_sub != 0)[..., None], requant, L.to(torch.int32)).to(torch.uint8).reshape(B, 2, 4, 32)

    lo, hi = L & 0xF, L >> 4
    ql = torch.cat([lo[:, :, 0] | (lo[:, :, 2] << 4), lo[:, :, 1] | (lo[:, :, 3] << 4)], dim=2).reshape(B, 128)
    qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).reshape(B, 64)
    out = torch.cat([ql, qh, sc.view(torch.uint8), _fp16_bytes(d16)], dim=1)
    out[zero_block] = 0
    return out


def quantize_in_chunks(
    row_fn: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor],
    rows: torch.Tensor,
    imatrix: torch.Tensor | None,
    row_bytes: int,
    chunk_blocks: int,
) -> torch.Tensor:
    """Apply row_fn to chunks of whole rows on the rows' device. rows [R, P], imatrix [P] or [R, P] -> [R, row_bytes]
    uint8; row_fn gets a row chunk [r, P] and its importance [r, P] (or None)."""
    R, P = rows.shape
    rows = rows.to(FT).contiguous()
    weights = None if imatrix is None else imatrix.to(device=rows.device, dtype=FT).expand(R, P)
    out = torch.empty((R, row_bytes), dtype=torch.uint8, device=rows.device)
    step = max(1, chunk_blocks * QK_K // P)
    for r0 in range(0, R, step):
        qw = None if weights is None else weights[r0 : r0 + step].contiguous()
        out[r0 : r0 + step] = row_fn(rows[r0 : r0 + step], qw)
    return out


def _quantizer(block_fn: TorchBlocks, qtype: GGMLQuantizationType):
    """The quantizer of qtype: (rows [R, P], imatrix, chunk_blocks) -> [R, row_bytes] uint8 tensor."""

    def quantize(
        rows: torch.Tensor, imatrix: torch.Tensor | None = None, chunk_blocks: int = CHUNK_BLOCKS["cpu"]
    ) -> torch.Tensor:
        assert rows.ndim == 2 and rows.shape[1] % QK_K == 0, rows.shape
        row_bytes = rows.shape[1] // QK_K * GGML_QUANT_SIZES[qtype][1]

        def row_fn(x: torch.Tensor, qw: torch.Tensor | None) -> torch.Tensor:
            blocks = block_fn(x.reshape(-1, QK_K), None if qw is None else qw.reshape(-1, QK_K))
            return blocks.reshape(x.shape[0], row_bytes)

        with torch.no_grad():
            return quantize_in_chunks(row_fn, rows, imatrix, row_bytes, chunk_blocks)

    quantize.__name__ = f"quantize_{qtype.name.lower()}"
    return quantize


# The same table as kquants.KQUANTIZERS, one torch entry per type.
BLOCK_FNS: dict[GGMLQuantizationType, TorchBlocks] = {
    GGMLQuantizationType.Q4_K: _q4_k_blocks,
    GGMLQuantizationType.Q5_K: _q5_k_blocks,
    GGMLQuantizationType.Q6_K: _q6_k_blocks,
}
assert BLOCK_FNS.keys() == kquants.KQUANTIZERS.keys()
KQUANTIZERS = {qtype: _quantizer(fn, qtype) for qtype, fn in BLOCK_FNS.items()}
quantize_q4_k = KQUANTIZERS[GGMLQuantizationType.Q4_K]
quantize_q5_k = KQUANTIZERS[GGMLQuantizationType.Q5_K]
quantize_q6_k = KQUANTIZERS[GGMLQuantizationType.Q6_K]


# Where each type stores its fp16 scales: d, dmin for Q4_K and Q5_K; d last for Q6_K. bytes [.., type_size].
FP16_FIELDS: dict[GGMLQuantizationType, slice] = {
    GGMLQuantizationType.Q4_K: slice(0, 4),
    GGMLQuantizationType.Q5_K: slice(0, 4),
    GGMLQuantizationType.Q6_K: slice(208, 210),
}
assert FP16_FIELDS.keys() == KQUANTIZERS.keys()


def nan_scale_rows(out: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """Rows of bytes [R, row_bytes] with a block whose fp16 scale is NaN. -> row indices.

    A NaN scale needs |x| > 1.8e19 (x*x overflows float32 and inf - inf follows). Its fp16 bits are those of the
    NaN the hardware made: x86's default NaN (stored 0xFE00) for ggml and numpy, a GPU's canonical NaN (0x7FFF)
    on CUDA. Measured on an H200: the 8 blocks of the "huge-1e30" rows with a random imatrix, Q4_K and Q5_K."""
    type_size = GGML_QUANT_SIZES[qtype][1]
    half = np.ascontiguousarray(out.reshape(out.shape[0], -1, type_size)[..., FP16_FIELDS[qtype]]).view(np.uint16)
    nan = ((half & 0x7C00) == 0x7C00) & ((half & 0x03FF) != 0)
    return np.flatnonzero(nan.reshape(out.shape[0], -1).any(axis=1))


def quantizers_on(device: str | torch.device) -> dict[GGMLQuantizationType, Callable]:
    """KQUANTIZERS with registry's numpy signature (rows [R, P], imatrix) -> [R, row_bytes] uint8, run on device.

    Rows whose bytes hold a NaN scale are quantized again by kquants.py, so that the NaN has x86's bits as in
    ggml (see nan_scale_rows); no realistic weight gets there."""
    device = torch.device(device)
    chunk_blocks = CHUNK_BLOCKS[device.type]

    def on_device(qtype: GGMLQuantizationType, fn: Callable) -> Callable:
        def quantize(rows: np.ndarray, imatrix: np.ndarray | None = None) -> np.ndarray:
            rows = np.ascontiguousarray(rows, F32)
            t = torch.from_numpy(rows).to(device)
            w = None if imatrix is None else torch.from_numpy(np.ascontiguousarray(imatrix, F32)).to(device)
            out = fn(t, w, chunk_blocks).cpu().numpy()
            bad = nan_scale_rows(out, qtype)
            if bad.size:
                qw = None if imatrix is None else (imatrix[bad] if np.ndim(imatrix) == 2 else imatrix)
                out[bad] = kquants.KQUANTIZERS[qtype](rows[bad], qw)
            return out

        return quantize

    return {qtype: on_device(qtype, fn) for qtype, fn in KQUANTIZERS.items()}
