"""moerun.kernels.gguf_matmul against dequantize-then-matmul in float64, on fresh random GGUF bytes of every type.

CI has no GPU, so there the kernels run in Triton's interpreter (numpy, on the CPU): tests/conftest.py sets
TRITON_INTERPRET=1 on machines without CUDA before anything imports triton. The interpreter costs about a millisecond
per Triton operation per program, so on the CPU the tiles are widened to cover a whole test matrix in one program
(`wide_tiles`); `test_production_tiles` runs the tiles tuning.py ships, on fewer rows. Where CUDA is available the
same tests run compiled, on the GPU, with the shipped tiles.

Error bounds, per output element y = sum_c x_c w_c, with S = sum_c |x_c w_c| and u = 2**-24 (float32 rounding):
- the decoded weights equal the reference's float32 values exactly (every scale product is exact; see qtypes.py), so
  the matrix-vector kernel only rounds its float32 products and sums: |y - ref| <= (C + 1) u S (C = columns, the
  classic bound for a sum of C rounded products in any order), tested with a factor 2 to spare;
- the GEMM rounds x to bfloat16 (to nearest, as torch's .bfloat16() does), and w too on the GPU, and accumulates in
  float32, so it is compared with the float64 product of the same operands, within the same bound (the interpreter
  multiplies bfloat16 x with float32 w: gemm.gemm says why); on the GPU a dense product of
  tuning.DECODED_GEMM_MIN_TOKENS tokens or more multiplies the same bfloat16 operands on cuBLAS (decode_bf16).
- the matrix-vector kernel's 8-bit route (tuning.Int8Routes.gemv, the types with a dot8 decoder) rounds x to int8 per 32
  values (quantize_i8, reproduced here bit for bit by `rounded_i8`) and multiplies exactly in integers, then in
  float32 per 16 values as scale * d * (q . q_x) + offset * d * sum(q_x): it is compared with the float64 product of
  the rounded x, and S counts the two terms apart, |x| (|w - offset| + |offset|) (the offsets are the weights
  decoded with every quant zeroed). The 8-bit GEMM (tuning.Int8Routes.gemm, the types with a gemm8 decoder: the experts of
  prompt steps of tuning.GEMM_I8_MIN_TOKENS tokens or more, and dense products of DENSE_I8_MIN_TOKENS ..
  DENSE_I8_MAX_TOKENS) rounds x the same way and sums per 32 values on tensor cores: the same operands and bound.
Random data are never zeros; a wrong nibble, scale or row order misses these bounds by orders of magnitude.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize

from moerun.kernels import dequant, gemm, gemv, gguf_matmul, tuning
from moerun.kernels.act_i8 import QAct, quantize_i8
from moerun.kernels.fused import moe_combine
from moerun.kernels.gemm import split_counters
from moerun.kernels.gguf_matmul import (
    QWeight,
    bf16_mm,
    dense_gemm_i8,
    gguf_mm,
    gguf_moe,
    gguf_moe_glu,
    gguf_mv,
    moe_gemm_i8,
    supports,
)
from moerun.kernels.moe_align import group_by_slot
from moerun.kernels.qtypes import BLOCK_TYPES
from moerun.kernels.staging import stage_second
from moerun.kernels.tuning import INT8_ON, Int8Routes

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
U = 2.0**-24
FIRST_TYPES = [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0, Q.Q4_0, Q.MXFP4]
# Byte offsets of each block's fp16 scale fields (ggml-common.h); the other bytes may hold anything.
FP16_FIELDS: dict[Q, tuple[int, ...]] = {
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
    Q.Q8_0: (0,),
    Q.Q4_0: (0,),
    Q.MXFP4: (),
    Q.IQ4_XS: (0,),
    Q.Q2_K: (80, 82),
    Q.Q3_K: (108,),
    Q.Q5_0: (0,),
    Q.Q4_1: (0, 2),
    Q.Q5_1: (0, 2),
}
PLAIN_FLOATS = {Q.F16: torch.float16, Q.BF16: torch.bfloat16, Q.F32: torch.float32}
# Columns per type: not powers of two where the block size allows (3 K-quant blocks; 25 blocks of 32).
COLS = {256: 768, 32: 800}


@pytest.fixture
def wide_tiles(monkeypatch):
    """Tiles covering the test matrices in one program each (the interpreter's cost is per program)."""
    if DEVICE != "cpu":
        return
    # num_warps means nothing to the interpreter, but sizes the accumulator budget that tuning.gemv_tiles keeps to
    monkeypatch.setattr(
        tuning,
        "GEMV_BY_BLOCK_VALUES",
        {
            256: tuning.GemvTiles(rows=64, blocks=4, num_warps=32),
            32: tuning.GemvTiles(rows=64, blocks=32, num_warps=32),
        },
    )
    monkeypatch.setattr(
        tuning, "GEMM_BY_BLOCK_VALUES", {256: tuning.GemmTiles(64, 64, 4), 32: tuning.GemmTiles(64, 64, 32)}
    )
    for swept in (
        "GEMV_OVERRIDES",
        "GEMV_GROUPED_OVERRIDES",
        "GEMV_I8_OVERRIDES",
        "GEMV_I8_GROUPED_OVERRIDES",
        "DENSE_GEMM_OVERRIDES",
        "GROUPED_GEMM_OVERRIDES",
        "DENSE_I8_OVERRIDES",
    ):
        monkeypatch.setattr(tuning, swept, {})


@pytest.fixture
def prefill_gemm(monkeypatch):
    """The experts of the tests' 21-token prompts on the grouped GEMM (it takes steps past MOE_GEMV_MAX_TOKENS):
    a smaller step than the matrix-vector kernel's limit keeps the interpreter's work small."""
    monkeypatch.setattr(tuning, "MOE_GEMV_MAX_TOKENS", tuning.GEMV_MAX_TOKENS)
    monkeypatch.setattr(tuning, "MOE_GLU_GEMV_MAX_TOKENS", tuning.GEMV_MAX_TOKENS)


def random_weights(qtype: Q, lead: tuple[int, ...], cols: int, rng: np.random.Generator) -> torch.Tensor:
    """[*lead, row_bytes] uint8 of valid random blocks with scales of moderate size (random signs), never zero."""
    n_rows = int(np.prod(lead))
    if qtype in PLAIN_FLOATS:
        values = torch.from_numpy(rng.standard_normal((n_rows, cols), dtype=np.float32)).to(PLAIN_FLOATS[qtype])
        return values.view(torch.uint8).reshape(*lead, -1).clone()
    block_values, block_bytes = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (n_rows, cols // block_values, block_bytes), dtype=np.uint8)
    for offset in FP16_FIELDS[qtype]:
        scale = rng.choice([-1.0, 1.0], blocks.shape[:-1]) * 2.0 ** rng.uniform(-8, -4, blocks.shape[:-1])
        blocks[..., offset : offset + 2] = scale.astype(np.float16).view(np.uint8).reshape(*blocks.shape[:-1], 2)
    if qtype == Q.MXFP4:
        blocks[..., 0] = rng.integers(118, 128, blocks.shape[:-1])  # E8M0 exponents 2**-9 .. 2**0
    return torch.from_numpy(blocks.reshape(*lead, -1))


def dequantized(data: torch.Tensor, qtype: Q, cols: int) -> torch.Tensor:
    """The reference weights, float64: moerun's torch dequantizers, gguf-py's for the types they lack (IQ4_XS)."""
    if dequant.supports(qtype):
        return dequant.dequantize(data, qtype, cols).double()
    return torch.from_numpy(gguf_dequantize(data.numpy(), qtype).astype(np.float64))


# Byte ranges of each block's quants (ggml-common.h): zeroed, a block decodes to its offsets (Q4_K: -dmin*m).
QUANT_BYTES: dict[Q, tuple[int, int]] = {Q.Q4_K: (16, 144), Q.Q5_K: (16, 176), Q.Q8_0: (2, 34), Q.Q4_0: (2, 18)}


def on_i8(qtype: Q, routes: Int8Routes = INT8_ON) -> bool:
    """Does the matrix-vector kernel take its 8-bit route for this type?"""
    return routes.gemv and BLOCK_TYPES[qtype].dot8 is not None


def rounded_i8(x: torch.Tensor) -> torch.Tensor:
    """x (..., C) as quantize_i8 rounds it, float64: per 32 values q = floor(x * (127 / max|x|) + 0.5) in float32,
    times d = max|x| / 127."""
    blocks = x.float().reshape(*x.shape[:-1], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127) / amax, 0)  # (127 / amax is 127 * (1 / amax) in torch)
    q = torch.floor(blocks * inv + 0.5)
    return (q.double() * (amax / 127).double()).reshape(x.shape)


def operands(
    x: torch.Tensor,
    data: torch.Tensor,
    qtype: Q,
    cols: int,
    gemm: bool,
    gemm8: bool = False,
    routes: Int8Routes = INT8_ON,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the kernels multiply, float64: (x, w, |w| as the bound counts it) for GGUF bytes `data` (..., row_bytes):
    for the GEMM x in bfloat16, and w too on the GPU; on the 8-bit routes (the matrix-vector kernel's; the GEMM's
    with `gemm8`) x rounded to int8 and |w - offset| + |offset| (module docstring)."""
    w = dequantized(data, qtype, cols)
    if gemm and not gemm8:
        w = w.float().bfloat16().double() if DEVICE == "cuda" else w
        return x.bfloat16().double(), w, w.abs()
    if gemm8 or on_i8(qtype, routes):
        start, end = QUANT_BYTES[qtype]
        blocks = data.reshape(*data.shape[:-1], -1, GGML_QUANT_SIZES[qtype][1]).clone()
        blocks[..., start:end] = 0
        offsets = dequantized(blocks.reshape(data.shape), qtype, cols)
        return rounded_i8(x), w, (w - offsets).abs() + offsets.abs()
    return x.double(), w, w.abs()


def assert_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, w_abs: torch.Tensor) -> None:
    """y (T, N) against x (T, C) @ w (N, C).T in float64 within (C + 1) u S, doubled (module docstring); x, w, w_abs:
    `operands`."""
    ref = x @ w.T
    bound = 2 * (x.shape[1] + 1) * U * (x.abs() @ w_abs.T)
    y = y.cpu().double()
    assert y.shape == ref.shape and torch.isfinite(y).all()
    excess = (y - ref).abs() / bound
    assert excess.max() <= 1, (
        f"{int((excess > 1).sum())} of {excess.numel()} outputs out of bound; worst at "
        f"{np.unravel_index(int(excess.argmax()), excess.shape)}: x{float(excess.max()):.1f}"
    )


def run_mm(
    qtype: Q, n_tokens: int, rows: int, rng: np.random.Generator, x_dtype=torch.float32, routes: Int8Routes = INT8_ON
) -> None:
    cols = COLS[BLOCK_TYPES[qtype].values]
    data = random_weights(qtype, (rows,), cols, rng)
    x = torch.from_numpy(rng.standard_normal((n_tokens, cols), dtype=np.float32)).to(x_dtype)
    w = QWeight(data.to(DEVICE), qtype, rows, cols)
    y = gguf_mm(x.to(DEVICE), w, routes=routes)
    assert y.dtype == torch.float32 and y.shape == (n_tokens, rows)
    gemm8 = dense_gemm_i8(BLOCK_TYPES[qtype], n_tokens, routes)
    assert_close(
        y, *operands(x, data, qtype, cols, gemm=gemm8 or on_bfloat16_operands(n_tokens), gemm8=gemm8, routes=routes)
    )


def on_bfloat16_operands(n_tokens: int) -> bool:
    """Does gguf_mm multiply bfloat16 operands for this many tokens (the GEMM, or on the GPU the decoded weight and
    cuBLAS), rather than the float32 matrix-vector kernel?"""
    return n_tokens > tuning.GEMV_MAX_TOKENS or (DEVICE == "cuda" and n_tokens >= tuning.DECODED_GEMM_MIN_TOKENS)


def test_supported_types() -> None:
    assert all(supports(q) for q in [*FIRST_TYPES, Q.IQ4_XS, Q.Q2_K, Q.Q3_K, Q.Q5_0, Q.Q4_1, Q.Q5_1, Q.F16, Q.BF16])
    assert not supports(Q.IQ2_XXS)


@pytest.mark.parametrize("n_tokens", [1, 2, 3, 8, 64])
@pytest.mark.parametrize("qtype", list(FP16_FIELDS) + list(PLAIN_FLOATS), ids=lambda q: q.name)
def test_every_type(wide_tiles, qtype: Q, n_tokens: int) -> None:
    """On 40 rows: matrix-vector (T=1, and a decode step of 2, 3, 8 sequences; on the GPU 8 decodes the weight to
    bfloat16 for cuBLAS) and the prefill GEMM (T=64; on the GPU the decoded weight again)."""
    run_mm(qtype, n_tokens, rows=40, rng=np.random.default_rng([int(qtype), n_tokens]))


@pytest.mark.parametrize("n_tokens", [1, 3])
@pytest.mark.parametrize("qtype", [q for q in FP16_FIELDS if BLOCK_TYPES[q].dot8 is not None], ids=lambda q: q.name)
def test_float_route_of_the_8bit_types(wide_tiles, monkeypatch, qtype: Q, n_tokens: int) -> None:
    """With the matrix-vector kernel's 8-bit route off (Int8Routes.gemv, MOERUN_GEMV_INT8=0), the types that have
    one multiply float32 activations again."""
    off = Int8Routes(gemv=False)
    assert not on_i8(qtype, off)
    run_mm(qtype, n_tokens, rows=40, rng=np.random.default_rng([int(qtype), n_tokens, 3]), routes=off)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K], ids=lambda q: q.name)
def test_split_8bit_products_add_up_the_same_way_every_time(qtype: Q) -> None:
    """A dense product of a few tokens on the 8-bit GEMM splits K over programs (the shipped tiles: 4-8 splits here),
    and the last of a tile's programs adds the partial sums up in split order: the same input gives the same bits
    every time, and the arrival counts are zeros again after it (the next launch, or graph replay, starts from them)."""
    rng = np.random.default_rng([int(qtype), 5])
    rows, cols = 64, 2048
    data = random_weights(qtype, (rows,), cols, rng)
    x = torch.from_numpy(rng.standard_normal((8, cols), dtype=np.float32))
    w = QWeight(data.to(DEVICE), qtype, rows, cols)
    assert dense_gemm_i8(BLOCK_TYPES[qtype], 8) and tuning.dense_i8_tiles(qtype).split > 1
    first, again = gguf_mm(x.to(DEVICE), w), gguf_mm(x.to(DEVICE), w)
    assert torch.equal(first, again)
    assert not split_counters(first.device, 1).any()
    assert_close(first, *operands(x, data, qtype, cols, gemm=True, gemm8=True))


def test_products_over_a_bfloat16_weight() -> None:
    """bf16_mm, a kept bfloat16 copy's product (cuBLAS on a GPU, float32 on the CPU): 1 to 17 tokens equal the
    bfloat16-rounded input times the weight, summed in float32."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(40, 2048, generator=gen).to(torch.bfloat16)
    for n_tokens in range(1, 18):
        x = torch.randn(n_tokens, 2048, generator=gen)
        want = x.to(torch.bfloat16).double() @ weight.double().T
        got = bf16_mm(x.to(DEVICE), weight.to(DEVICE))
        assert got.dtype == torch.float32 and got.shape == (n_tokens, 40)
        torch.testing.assert_close(got.cpu().double(), want, rtol=1e-5, atol=1e-4 * want.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_quantize_i8(dtype) -> None:
    """quantize_i8 against its torch reference, bit for bit: quants, scales, the sums per 16; blocks of zeros give
    zero quants and scale; halves (x = max/2, common in bfloat16) round as the reference rounds them."""
    rng = np.random.default_rng(7)
    x = torch.from_numpy(rng.standard_normal((5, 1056), dtype=np.float32)).to(dtype)
    x[1, 64:96] = 0
    x[2, 0:32] = torch.linspace(-1, 1, 32).to(dtype)  # max 1: values near +-0.5 sit on halves
    rounding = quantize_i8(x.to(DEVICE))
    assert isinstance(rounding, QAct)
    q, d, s = rounding.q.cpu(), rounding.d.cpu(), rounding.s.cpu()
    assert q.dtype == torch.int8 and d.shape == (5, 33) and s.shape == (5, 66)
    assert torch.equal(q.double() * d.double().repeat_interleave(32, 1), rounded_i8(x))
    assert q.abs().max() == 127 and (q[1, 64:96] == 0).all() and d[1, 2] == 0
    torch.testing.assert_close(
        s.double(), q.double().reshape(5, -1, 16).sum(-1) * d.double().repeat_interleave(2, 1), rtol=2**-23, atol=0
    )


@pytest.mark.parametrize("route", ["gemv", "dense-gemm8", "moe-gemv", "moe-gemm8"])
def test_products_take_their_inputs_rounding(wide_tiles, prefill_gemm, monkeypatch, route: str) -> None:
    """A product on an 8-bit route given its input's rounding (`i8`, an act_i8.QAct, as a norm or attention kernel
    returns it) multiplies that instead of rounding again: no quantize_i8 launch, and the same bits as the product
    that rounds inside (once for gate and up together). The routes: the matrix-vector kernel (2 tokens; the experts
    of 3), the 8-bit GEMM (a dense product of 8 tokens; the experts of a 21-token prompt, GEMM_I8_MIN_TOKENS lowered
    to it)."""
    qtype, rows, n_slots = Q.Q4_K, 24, 4
    cols = COLS[BLOCK_TYPES[qtype].values]
    assert on_i8(qtype)
    monkeypatch.setattr(tuning, "GEMM_I8_MIN_TOKENS", 21)
    n_tokens = {"gemv": 2, "dense-gemm8": 8, "moe-gemv": 3, "moe-gemm8": 21}[route]
    assert dense_gemm_i8(BLOCK_TYPES[qtype], 8) and moe_gemm_i8(BLOCK_TYPES[qtype], 21)
    rng = np.random.default_rng(17)
    x = torch.from_numpy(rng.standard_normal((n_tokens, cols), dtype=np.float32)).to(DEVICE)
    given = quantize_i8(x)
    rounded = []
    for module in (gemv, gemm, gguf_matmul):  # where the products round their input
        monkeypatch.setattr(module, "quantize_i8", lambda x: rounded.append(x) or quantize_i8(x))
    if route.startswith("moe"):
        bank = QWeight(random_weights(qtype, (n_slots, rows), cols, rng).to(DEVICE), qtype, rows, cols)
        up = QWeight(random_weights(qtype, (n_slots, rows), cols, rng).to(DEVICE), qtype, rows, cols)
        slots = torch.from_numpy(rng.integers(-1, n_slots, (n_tokens, 2))).to(DEVICE)
        products = [lambda i8: gguf_moe(x, bank, slots, i8=i8), lambda i8: gguf_moe_glu(x, bank, up, slots, i8=i8)]
    else:
        w = QWeight(random_weights(qtype, (rows,), cols, rng).to(DEVICE), qtype, rows, cols)
        products = [lambda i8: gguf_mm(x, w, i8)]
    for product in products:
        rounded.clear()
        with_rounding = product(given)
        assert rounded == []
        assert torch.equal(with_rounding, product(None))
        assert len(rounded) == 1


@pytest.mark.parametrize("n_tokens", [3, 8, 300])
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q4_0], ids=lambda q: q.name)
def test_token_counts(wide_tiles, qtype: Q, n_tokens: int) -> None:
    """Padded token groups in the matrix-vector kernel (3, 8) and several token blocks in the GEMM (300)."""
    run_mm(qtype, n_tokens, rows=24, rng=np.random.default_rng([int(qtype), n_tokens, 1]))


@pytest.mark.parametrize("n_tokens", [1, 5, 40])
def test_bfloat16_input(wide_tiles, n_tokens: int) -> None:
    run_mm(Q.Q4_K, n_tokens, rows=24, rng=np.random.default_rng(n_tokens), x_dtype=torch.bfloat16)


@pytest.mark.parametrize("n_tokens", [1, 2, 8, 20])
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q8_0], ids=lambda q: q.name)
def test_production_tiles(qtype: Q, n_tokens: int) -> None:
    """tuning.py's own tiles: several programs per matrix, a partial last row tile and a partial last K step, for the
    matrix-vector kernel (1, 2, 8) and the prefill GEMM (20) on a part of one row tile."""
    tile_rows = gemv_tile_rows(qtype, min(n_tokens, tuning.GEMV_MAX_TOKENS))
    run_mm(qtype, n_tokens, rows=tile_rows * 2 + 3, rng=np.random.default_rng([int(qtype), n_tokens, 2]))


@pytest.mark.parametrize("n_tokens", [1, 3, tuning.GEMV_MAX_TOKENS])
def test_float32_rows_on_the_matrix_vector_kernel(n_tokens: int) -> None:
    """gguf_mv, a float32 router's route on the GPU (layers.Linear), on the shipped F32 tiles: 40 rows of 800 float32
    columns, each product within the float32 bound at every row count it takes."""
    rng = np.random.default_rng([n_tokens, 31])
    data = random_weights(Q.F32, (40,), 800, rng)
    x = torch.from_numpy(rng.standard_normal((n_tokens, 800), dtype=np.float32))
    y = gguf_mv(x.to(DEVICE), QWeight(data.to(DEVICE), Q.F32, 40, 800))
    assert y.shape == (n_tokens, 40)
    assert_close(y, *operands(x, data, Q.F32, 800, gemm=False))


def gemv_tile_rows(qtype: Q, n_tokens: int) -> int:
    """Rows per program of the matrix-vector kernel's dense tiles for n_tokens (as gemv.gemv picks them)."""
    bt = BLOCK_TYPES[qtype]
    return tuning.gemv_tiles(qtype, bt.values, 8 if on_i8(qtype) else bt.part, n_tokens, i8=on_i8(qtype)).rows


@pytest.mark.parametrize("shared_input", [True, False], ids=["shared-x", "x-per-expert"])
@pytest.mark.parametrize(
    "n_tokens,gemm", [(3, False), (21, False), (21, True)], ids=["decode", "short-prompt", "prefill"]
)
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q4_0, Q.MXFP4], ids=lambda q: q.name)
def test_moe(wide_tiles, request, qtype: Q, n_tokens: int, gemm: bool, shared_input: bool) -> None:
    """Decode (3 tokens: a program per (t, k)), a short prompt (21 tokens, the same) and prefill (21 tokens past a
    lowered MOE_GEMV_MAX_TOKENS: grouped by slot) on a bank of 6 slots, with experts repeated across tokens, -1
    (skipped) slots, and a slot no token uses."""
    if gemm:
        request.getfixturevalue("prefill_gemm")
    check_moe(qtype, n_tokens, shared_input, gemm=n_tokens > tuning.MOE_GEMV_MAX_TOKENS)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q4_0], ids=lambda q: q.name)
def test_moe_prefill_on_swept_grouped_tiles(wide_tiles, prefill_gemm, monkeypatch, qtype: Q) -> None:
    """The grouped GEMM on tiles from tuning.GROUPED_GEMM_OVERRIDES (16-row tiles, as a sweep may pick for ~32
    pairs per expert): several tiles per slot's run, a weight tile past the last row, two blocks per step."""
    bt = BLOCK_TYPES[qtype]
    monkeypatch.setitem(
        tuning.GROUPED_GEMM_OVERRIDES, (qtype, COLS[bt.values] // bt.values), tuning.GemmTiles(16, 16, 2)
    )
    check_moe(qtype, 21, shared_input=True, gemm=True)


@pytest.mark.parametrize("shared_input", [True, False], ids=["shared-x", "x-per-expert"])
@pytest.mark.parametrize("qtype", [q for q in FP16_FIELDS if BLOCK_TYPES[q].gemm8 is not None], ids=lambda q: q.name)
def test_moe_prefill_on_the_8bit_gemm(wide_tiles, prefill_gemm, monkeypatch, qtype: Q, shared_input: bool) -> None:
    """The experts of a prompt step on the 8-bit GEMM (tuning.GEMM_I8_MIN_TOKENS lowered to the test's 21 tokens):
    gguf_moe as test_moe checks it, and gate and up with the SwiGLU (gguf_moe_glu) on the same grouping."""
    monkeypatch.setattr(tuning, "GEMM_I8_MIN_TOKENS", 21)
    assert moe_gemm_i8(BLOCK_TYPES[qtype], 21)
    check_moe(qtype, 21, shared_input, gemm=True)
    check_moe_glu(qtype, 21, np.random.default_rng([int(qtype), shared_input, 13]))


@pytest.mark.parametrize(
    "n_tokens,gemm8,few",
    [(3, False, True), (21, False, True), (21, True, True), (21, True, False)],
    ids=["decode", "prefill", "prefill-8bit-few-tokens", "prefill-8bit"],
)
def test_moe_on_shipped_tiles(prefill_gemm, monkeypatch, n_tokens: int, gemm8: bool, few: bool) -> None:
    """tuning.py's own grouped tiles where the test's rows of 3 Q4_K blocks have them (the 30B down projection's
    GEMV_GROUPED_OVERRIDES, GROUPED_GEMM_OVERRIDES, and the 8-bit GEMM's GEMM_I8_FEW_TOKENS_OVERRIDES and, with
    GEMM_I8_FEW_TOKENS lowered below the test's 21 tokens, GEMM_I8_GROUPED_OVERRIDES)."""
    assert (Q.Q4_K, 3) in tuning.GEMV_GROUPED_OVERRIDES and (Q.Q4_K, 3) in tuning.GROUPED_GEMM_OVERRIDES
    assert (Q.Q4_K, 3) in tuning.GEMM_I8_GROUPED_OVERRIDES and (Q.Q4_K, 3) in tuning.GEMM_I8_FEW_TOKENS_OVERRIDES
    monkeypatch.setattr(tuning, "GEMM_I8_MIN_TOKENS", 21 if gemm8 else 1 << 30)
    monkeypatch.setattr(tuning, "GEMM_I8_FEW_TOKENS", 128 if few else 0)
    expected = (tuning.GEMM_I8_FEW_TOKENS_OVERRIDES if few else tuning.GEMM_I8_GROUPED_OVERRIDES)[Q.Q4_K, 3]
    assert tuning.gemm_tiles(Q.Q4_K, 256, grouped=True, grouped_blocks=3, i8=True, n_tokens=n_tokens) == expected
    check_moe(Q.Q4_K, n_tokens, shared_input=False, gemm=n_tokens > tuning.MOE_GEMV_MAX_TOKENS)


def check_moe(qtype: Q, n_tokens: int, shared_input: bool, gemm: bool) -> None:
    """gguf_moe of n_tokens x 4 experts on a bank of 6 slots against the float64 reference; `gemm`: the test expects
    the grouped GEMM (the 8-bit one where moe_gemm_i8 says so, else on bfloat16 inputs) to run, not the
    matrix-vector kernel."""
    gemm8 = gemm and moe_gemm_i8(BLOCK_TYPES[qtype], n_tokens)
    rng = np.random.default_rng([int(qtype), n_tokens, shared_input])
    n_slots, k, rows = 6, 4, 24
    cols = COLS[BLOCK_TYPES[qtype].values]
    bank = random_weights(qtype, (n_slots, rows), cols, rng)
    slots = torch.from_numpy(rng.permuted(np.tile(np.arange(-1, n_slots - 1), (n_tokens, 1)), axis=1)[:, :k])
    slots = slots.to(torch.int32)  # slot n_slots - 1 is never used; -1 appears in about 1 of 6 places
    x_shape = (n_tokens, cols) if shared_input else (n_tokens, k, cols)
    x = torch.from_numpy(rng.standard_normal(x_shape, dtype=np.float32))
    w = QWeight(bank.to(DEVICE), qtype, rows, cols)
    y = gguf_moe(x.to(DEVICE), w, slots.to(DEVICE)).cpu()
    assert y.shape == (n_tokens, k, rows) and y.dtype == torch.float32
    xs = x[:, None, :].expand(n_tokens, k, cols) if shared_input else x
    for t in range(n_tokens):
        for j in range(k):
            slot = int(slots[t, j])
            if slot < 0:
                assert (y[t, j] == 0).all()
            else:
                assert_close(y[t, j][None], *operands(xs[t, j][None], bank[slot], qtype, cols, gemm, gemm8))


@pytest.mark.parametrize(
    "n_tokens,grouped_tiles",
    [(3, None), (21, None), (2, tuning.GemvTiles(16, 1, 1))],
    ids=["decode", "prefill", "decode-grouped-tiles"],
)
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q8_0], ids=lambda q: q.name)
def test_moe_glu(wide_tiles, prefill_gemm, monkeypatch, qtype: Q, n_tokens: int, grouped_tiles) -> None:
    """gguf_moe_glu = silu(x gate^T) * (x up^T) per (token, expert), on int64 slots with -1 (skipped: zeros):
    one matrix-vector launch at decode (3 tokens), the grouped GEMMs at prefill (21), the decode on tiles from
    tuning.GEMV_GROUPED_OVERRIDES (16 rows x 1 block: a partial row tile, no masked step). Each product is within the bound of assert_close;
    the SwiGLU carries those errors (|silu'| < 1.1) plus a few roundings of its own."""
    if grouped_tiles is not None:
        blocks = COLS[BLOCK_TYPES[qtype].values] // BLOCK_TYPES[qtype].values
        monkeypatch.setitem(tuning.GEMV_GROUPED_OVERRIDES, (qtype, blocks), grouped_tiles)
    check_moe_glu(qtype, n_tokens, np.random.default_rng([int(qtype), n_tokens, 5]))


def check_moe_glu(qtype: Q, n_tokens: int, rng: np.random.Generator) -> None:
    """gguf_moe_glu of n_tokens x 3 experts (int64 slots, -1 among them) on banks of 5 slots against the float64
    reference (assert_glu_close)."""
    n_slots, k, rows = 5, 3, 24
    cols = COLS[BLOCK_TYPES[qtype].values]
    gate_bank, up_bank = (random_weights(qtype, (n_slots, rows), cols, rng) for _ in range(2))
    slots = torch.from_numpy(rng.integers(-1, n_slots, (n_tokens, k)))  # int64
    x = torch.from_numpy(rng.standard_normal((n_tokens, cols), dtype=np.float32))
    y = (
        gguf_moe_glu(
            x.to(DEVICE),
            QWeight(gate_bank.to(DEVICE), qtype, rows, cols),
            QWeight(up_bank.to(DEVICE), qtype, rows, cols),
            slots.to(DEVICE),
        )
        .cpu()
        .double()
    )
    assert y.shape == (n_tokens, k, rows)
    assert_glu_close(y, x, slots, gate_bank, up_bank, qtype, gemm=n_tokens > tuning.MOE_GLU_GEMV_MAX_TOKENS)


@pytest.mark.parametrize("host_offset", [0, 4], ids=["aligned", "4-bytes-past"])
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q8_0], ids=lambda q: q.name)
def test_moe_reads_streamed_experts_from_host(wide_tiles, qtype: Q, host_offset: int) -> None:
    """A bank with a host copy as its second bank (QWeight.second, page-locked on CUDA: the GPU reads it over the
    bus): slot -2 - e runs expert e of the host copy, in the same decode launch as the bank's slots (the expert
    cache's decode step), for the GLU, read in place or staged first, the down projection and the weighted sum,
    which counts those pairs as it counts the bank's. The host copy also starts 4 bytes past a 16-byte boundary: the
    matrix-vector kernel then must not load its words 16 bytes at a time (on CUDA such a load faults), and Q8_0's
    words are joined from aligned halves where the device bank's are not."""
    rng = np.random.default_rng([int(qtype), 11])
    n_tokens, k, rows, n_expert, resident = 3, 3, 24, 6, [4, 0, 2]  # experts 4, 0, 2 sit in slots 0, 1, 2
    cols = COLS[BLOCK_TYPES[qtype].values]
    gate_all, up_all = (random_weights(qtype, (n_expert, rows), cols, rng) for _ in range(2))

    def host(b: torch.Tensor) -> torch.Tensor:
        """b's bytes host_offset bytes into a new (page-locked on CUDA) buffer."""
        buf = torch.empty(b.numel() + 16, dtype=torch.uint8, pin_memory=DEVICE == "cuda")
        copy = buf[host_offset : host_offset + b.numel()].view(b.shape)
        copy.copy_(b)
        assert copy.data_ptr() % 16 == host_offset
        return copy

    gate, up = (QWeight(b[resident].to(DEVICE), qtype, rows, cols, second=host(b)) for b in (gate_all, up_all))
    experts = np.array([[1, 4, 3], [5, 1, 0], [3, 0, 1]])  # experts 1, 3 and 5 streamed, 1 and 3 by several tokens
    slot_of = np.full(n_expert, -1)
    slot_of[resident] = range(len(resident))
    slots = np.where(slot_of[experts] >= 0, slot_of[experts], -2 - experts)
    slots[1, 2] = -1  # skipped
    experts[1, 2] = -1
    assert (slots >= 0).any() and (slots < -1).any()
    x = torch.from_numpy(rng.standard_normal((n_tokens, cols), dtype=np.float32))
    y = gguf_moe_glu(x.to(DEVICE), gate, up, torch.from_numpy(slots).to(DEVICE)).cpu().double()
    assert_glu_close(y, x, torch.from_numpy(experts), gate_all, up_all, qtype, gemm=False)
    # staged first (stage_second copies each streamed expert to a device bank, once, into the matrix of the first
    # pair that streams it): the same bytes, the same sums
    stages = tuple(
        torch.zeros(n_tokens * k + 1, *b.data.shape[1:], dtype=torch.uint8, device=DEVICE) for b in (gate, up)
    )
    (gate_s, up_s), staged = stage_second(torch.from_numpy(slots).to(DEVICE), (gate, up), stages)
    flat = slots.reshape(-1).tolist()
    first = {e: p for p, e in reversed(list(enumerate(flat)))}  # each slot's first pair
    assert staged.cpu().reshape(-1).tolist() == [-2 - first[e] if e < -1 else e for e in flat]
    for stage, full in zip(stages, (gate_all, up_all)):  # first pairs' matrices hold the expert; others untouched
        for p, e in enumerate(flat):
            assert torch.equal(stage[p].cpu(), full[-2 - e] if e < -1 and first[e] == p else torch.zeros_like(full[0]))
    y_staged = gguf_moe_glu(x.to(DEVICE), gate_s, up_s, staged).cpu().double()
    if host_offset == 0:  # the same compiled kernel as in place (16-byte loads both): the same sums to the bit
        torch.testing.assert_close(y_staged, y, rtol=0, atol=0)
    else:  # in place it was compiled without 16-byte loads, and the compiler may then contract other products
        assert_glu_close(y_staged, x, torch.from_numpy(experts), gate_all, up_all, qtype, gemm=False)
    # the down projection from the host copy too, each pair its own input; then the weighted sum of the pairs
    down_all = random_weights(qtype, (n_expert, cols), cols, rng)
    down = QWeight(down_all[resident].to(DEVICE), qtype, cols, cols, second=host(down_all))
    h = torch.from_numpy(rng.standard_normal((n_tokens, k, cols), dtype=np.float32))
    yd = gguf_moe(h.to(DEVICE), down, torch.from_numpy(slots).to(DEVICE)).cpu()
    for t in range(n_tokens):
        for j in range(k):
            if experts[t, j] < 0:
                assert (yd[t, j] == 0).all()
            else:
                assert_close(yd[t, j][None], *operands(h[t, j][None], down_all[experts[t, j]], qtype, cols, False))
    mix = torch.from_numpy(rng.random((n_tokens, k), dtype=np.float32))
    summed = moe_combine(yd.to(DEVICE), mix.to(DEVICE), torch.from_numpy(slots).to(DEVICE)).cpu().double()
    terms = yd.double() * torch.where(torch.from_numpy(experts) >= 0, mix, 0).double()[..., None]
    assert ((summed - terms.sum(1)).abs() <= 4 * k * U * terms.abs().sum(1)).all()  # float32 sums of k products


def assert_glu_close(y, x, slots, gate_bank, up_bank, qtype: Q, gemm: bool) -> None:
    """y (T, K, N) = silu(x gate^T) * (x up^T) for expert slots[t, k] of the banks (host copies), zeros where it is
    -1, within the bound test_moe_glu explains."""
    n_tokens, k = slots.shape
    cols = x.shape[1]
    gemm8 = gemm and moe_gemm_i8(BLOCK_TYPES[qtype], n_tokens)
    for t in range(n_tokens):
        for j in range(k):
            slot = int(slots[t, j])
            if slot < 0:
                assert (y[t, j] == 0).all()
                continue
            (xt, wg, ag), (_, wu, au) = (
                operands(x[t], b[slot], qtype, cols, gemm, gemm8) for b in (gate_bank, up_bank)
            )
            g, u = xt @ wg.T, xt @ wu.T
            eg, eu = (2 * (cols + 1) * U * (xt.abs() @ a.T) for a in (ag, au))
            silu = g * torch.sigmoid(g)
            bound = 1.1 * eg * (u.abs() + eu) + silu.abs() * eu + 8 * U * (silu * u).abs() + 1e-30
            assert ((y[t, j] - silu * u).abs() <= bound).all(), float(((y[t, j] - silu * u).abs() / bound).max())


def test_prefill_groups_the_pairs_once_for_a_layers_banks(wide_tiles, prefill_gemm, monkeypatch) -> None:
    """Gate, up and down of a prompt's layer share one group_by_slot (the same slots, bank size and block_m), and give
    what each bank grouped alone gives."""
    import moerun.kernels.gguf_matmul as gm

    calls = []
    monkeypatch.setattr(gm, "group_by_slot", lambda *a: calls.append(a) or group_by_slot(*a))
    rng = np.random.default_rng(11)
    n_tokens, n_slots, k, rows, qtype = 21, 5, 3, 24, Q.Q4_K
    cols = COLS[BLOCK_TYPES[qtype].values]
    gate, up = (
        QWeight(random_weights(qtype, (n_slots, rows), cols, rng).to(DEVICE), qtype, rows, cols) for _ in range(2)
    )
    down = QWeight(random_weights(qtype, (n_slots, cols), cols, rng).to(DEVICE), qtype, cols, cols)
    slots = torch.from_numpy(rng.integers(-1, n_slots, (n_tokens, k))).to(DEVICE)
    x = torch.from_numpy(rng.standard_normal((n_tokens, cols), dtype=np.float32)).to(DEVICE)
    groups: dict = {}
    h = gguf_moe_glu(x, gate, up, slots, groups)
    shared = gguf_moe(x[:, None, :].expand(n_tokens, k, cols).contiguous(), down, slots, groups)
    assert len(calls) == 1
    torch.testing.assert_close(h, gguf_moe_glu(x, gate, up, slots), rtol=0, atol=0)
    torch.testing.assert_close(
        shared, gguf_moe(x[:, None, :].expand(n_tokens, k, cols).contiguous(), down, slots), rtol=0, atol=0
    )
    assert len(calls) == 1 + 1 + 1  # without `groups`: gguf_moe_glu groups once for gate and up, down once more


def test_no_tokens() -> None:
    data = random_weights(Q.Q4_K, (2, 8), 256, np.random.default_rng(9)).to(DEVICE)
    assert gguf_mm(torch.zeros(0, 256, device=DEVICE), QWeight(data[0], Q.Q4_K, 8, 256)).shape == (0, 8)
    no_slots = torch.zeros(0, 2, dtype=torch.int32, device=DEVICE)
    assert gguf_moe(torch.zeros(0, 256, device=DEVICE), QWeight(data, Q.Q4_K, 8, 256), no_slots).shape == (0, 2, 8)


def grouped_by_slot(slots: torch.Tensor, n_slots: int, block_m: int) -> tuple[list[int], list[int]]:
    """group_by_slot's answer built the plain way: each slot's pair ids in order, padded with -1 to a multiple of
    block_m, the slots in order, then spare blocks of -1 up to the size that T*K, n_slots and block_m give."""
    flat = slots.reshape(-1).tolist()
    ids: list[int] = []
    block_slot: list[int] = []
    for slot in range(n_slots):
        run = [i for i, s in enumerate(flat) if s == slot]
        padded = -(-len(run) // block_m) * block_m
        ids += run + [-1] * (padded - len(run))
        block_slot += [slot] * (padded // block_m)
    n_blocks = -(-len(flat) // block_m) + min(n_slots, len(flat))
    return ids + [-1] * (n_blocks * block_m - len(ids)), block_slot + [-1] * (n_blocks - len(block_slot))


@pytest.mark.parametrize(
    "n_tokens, k, n_slots, block_m, dtype",
    [
        (13, 3, 9, 4, torch.int32),
        (1, 1, 1, 16, torch.int64),
        (5, 2, 3, 16, torch.int32),
        (160, 8, 130, 32, torch.int64),  # more pairs than one chunk of the kernel, a bank size that is no power of 2
    ],
)
def test_group_by_slot(n_tokens: int, k: int, n_slots: int, block_m: int, dtype: torch.dtype) -> None:
    """Every kept pair exactly once, in pair order within its slot's run, the runs padded to blocks of one slot;
    slot -1 and a second bank's -2 - e left out; sizes from T*K, E and BM alone (no host sync needed)."""
    rng = np.random.default_rng([n_tokens, n_slots])
    shapes = set()
    for _ in range(2):
        slots = torch.from_numpy(rng.integers(-3, n_slots, (n_tokens, k))).to(dtype).to(DEVICE)
        ids, block_slot = group_by_slot(slots, n_slots, block_m)
        shapes.add((ids.shape, block_slot.shape))
        assert (ids.tolist(), block_slot.tolist()) == grouped_by_slot(slots.cpu(), n_slots, block_m)
    assert len(shapes) == 1


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q4_0, Q.MXFP4, Q.IQ4_XS, Q.F16], ids=lambda q: q.name)
def test_decode_bf16(qtype: Q) -> None:
    """The prompt's dense path decodes a weight to bfloat16 once (decode_bf16, then cuBLAS where CUDA is: the
    T >= tuning.DECODED_GEMM_MIN_TOKENS rows of test_every_type and test_token_counts run it there): every value is
    the reference's within one bfloat16 step (the GPU rounds to nearest, Triton's interpreter truncates)."""
    from moerun.kernels.gguf_matmul import decode_bf16

    rng = np.random.default_rng([int(qtype), 7])
    rows, cols = 37, COLS[BLOCK_TYPES[qtype].values]
    data = random_weights(qtype, (rows,), cols, rng)
    got = decode_bf16(QWeight(data.to(DEVICE), qtype, rows, cols)).cpu()
    ref = dequantized(data, qtype, cols)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, cols)
    assert ((got.double() - ref).abs() <= ref.abs() * 2.0**-7).all()


@pytest.mark.skipif(DEVICE != "cuda", reason="the decoded route runs on CUDA (cuBLAS)")
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q8_0], ids=lambda q: q.name)
def test_decoded_route_in_row_chunks(monkeypatch, qtype: Q) -> None:
    """A weight larger than tuning.DECODED_CHUNK_BYTES (a large vocabulary's output head) decodes and multiplies in
    row chunks, the last one partial: the same bound as the whole weight at once."""
    # room for 13 rows: chunks of 12 (a multiple of 4, aligned for any row size), 40 rows = 3 x 12 + 4
    monkeypatch.setattr(tuning, "DECODED_CHUNK_BYTES", 2 * COLS[BLOCK_TYPES[qtype].values] * 13)
    run_mm(qtype, 8, rows=40, rng=np.random.default_rng([int(qtype), 9]))


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA's limit on a grid's second axis (the interpreter has none)")
@pytest.mark.parametrize("n_tokens", [1, 2])
def test_more_row_tiles_than_a_grid_axis_holds(n_tokens: int) -> None:
    """The matrix-vector kernel on more row tiles than a CUDA grid's second axis takes (65535): an output head of a
    152k-token vocabulary in Q8_0 makes 152k one-row tiles at T = 1. Its programs run on one axis."""
    run_mm(
        Q.Q8_0, n_tokens, rows=65535 * gemv_tile_rows(Q.Q8_0, n_tokens) + 3, rng=np.random.default_rng([n_tokens, 21])
    )
