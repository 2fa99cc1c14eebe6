"""moerun.kernels.dequant against gguf-py's numpy dequantizers, bit for bit, on random blocks of every supported type.

Random bytes are valid blocks of every type once the fp16 scale fields hold finite values (any finite fp16: subnormal,
zero, negative, up to 65504). The first row of every sample is all zero bytes. The CUDA cases run only where
torch.cuda.is_available(); CI has no GPU, so there they are skipped.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize

from moerun.kernels.dequant import DEQUANTIZERS, dequantize, supports

# An MXFP4 block with exponent byte 255 has scale 2**127, so its large codes are inf: gguf-py's multiply warns of that.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")

# Byte offsets of each block's fp16 fields (ggml-common.h); the other bytes of a block may hold anything.
FP16_FIELDS: dict[Q, tuple[int, ...]] = {
    Q.Q8_0: (0,),
    Q.Q4_0: (0,),
    Q.Q5_0: (0,),
    Q.Q4_1: (0, 2),
    Q.Q5_1: (0, 2),
    Q.Q2_K: (80, 82),
    Q.Q3_K: (108,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
    Q.MXFP4: (),  # every E8M0 byte is a scale (255 is 2**127, as in ggml)
}
# Plain float types: random words of this width whose exponent field (the mask) is not all ones, so finite floats.
PLAIN_FLOATS: dict[Q, tuple[type[np.unsignedinteger], int]] = {
    Q.F32: (np.uint32, 0x7F800000),
    Q.F16: (np.uint16, 0x7C00),
    Q.BF16: (np.uint16, 0x7F80),
}
# Same-width integer view of each float dtype, for comparing bits.
BITS = {4: torch.int32, 2: torch.int16}

TYPES = list(DEQUANTIZERS)
# (leading dims, row length): one row, a matrix of rows, and a stack of experts [E, rows].
SHAPES = [((), 256), ((7,), 768), ((4, 5), 512)]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


def finite_words(
    rng: np.random.Generator, shape: tuple[int, ...], dtype: type[np.unsignedinteger], exponent_mask: int
) -> np.ndarray:
    """Random float bit patterns; an all-ones exponent (inf/nan) loses its top bit."""
    words = rng.integers(0, np.iinfo(dtype).max, shape, dtype=dtype, endpoint=True)
    top = dtype(1 << (exponent_mask.bit_length() - 1))
    return np.where(words & dtype(exponent_mask) == exponent_mask, words & ~top, words)


def random_rows(qtype: Q, lead: tuple[int, ...], row_length: int, seed: int = 0) -> np.ndarray:
    """[*lead, row_bytes] uint8 of valid random blocks; the first row is all zeros."""
    rng = np.random.default_rng(seed)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n_rows = int(np.prod(lead, dtype=np.int64))
    if qtype in PLAIN_FLOATS:
        dtype, mask = PLAIN_FLOATS[qtype]
        raw = finite_words(rng, (n_rows, row_length), dtype, mask).view(np.uint8)
    else:
        blocks = rng.integers(0, 256, (n_rows, row_length // block_size, type_size), dtype=np.uint8)
        for offset in FP16_FIELDS[qtype]:
            scale = finite_words(rng, (*blocks.shape[:-1], 1), np.uint16, 0x7C00)
            blocks[..., offset : offset + 2] = scale.view(np.uint8)
        raw = blocks.reshape(n_rows, -1)
    raw[:1] = 0
    return raw.reshape(*lead, -1)


def reference(raw: np.ndarray, qtype: Q) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(gguf_dequantize(raw, qtype), dtype=np.float32))


def assert_same_bits(ours: torch.Tensor, expected: torch.Tensor, block_size: int) -> None:
    """Equal dtype, shape and bits; otherwise name how many blocks differ and show the first."""
    assert ours.dtype == expected.dtype and ours.shape == expected.shape, (ours.dtype, ours.shape, expected.shape)
    ours = ours.cpu()
    bits = BITS[ours.element_size()]
    bad = (ours.view(bits) != expected.view(bits)).reshape(-1, block_size).any(-1)
    if bad.any():
        first = int(bad.nonzero()[0])
        pytest.fail(
            f"{int(bad.sum())} of {bad.numel()} blocks differ; block {first}: "
            f"ours {ours.reshape(-1, block_size)[first].tolist()} "
            f"expected {expected.reshape(-1, block_size)[first].tolist()}"
        )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lead,row_length", SHAPES)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_matches_gguf_py(qtype: Q, lead: tuple[int, ...], row_length: int, device: str) -> None:
    raw = random_rows(qtype, lead, row_length)
    ours = dequantize(torch.from_numpy(raw).to(device), qtype, row_length)
    assert ours.device.type == device
    assert_same_bits(ours, reference(raw, qtype), GGML_QUANT_SIZES[qtype][0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_selected_experts(qtype: Q, device: str) -> None:
    """The runtime's use: index a device-resident [E, rows, row_bytes] stack by expert ids, dequantize those."""
    raw = random_rows(qtype, (6, 3), 512, seed=1)
    ids = torch.tensor([4, 0, 4, 5])
    ours = dequantize(torch.from_numpy(raw).to(device)[ids.to(device)], qtype, 512)
    assert_same_bits(ours, reference(raw, qtype)[ids], GGML_QUANT_SIZES[qtype][0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_bfloat16_output(qtype: Q, device: str) -> None:
    """Values come out as gguf-py's float32 rounded once to bfloat16."""
    raw = random_rows(qtype, (5,), 256, seed=2)
    ours = dequantize(torch.from_numpy(raw).to(device), qtype, 256, dtype=torch.bfloat16)
    assert_same_bits(ours, reference(raw, qtype).bfloat16(), GGML_QUANT_SIZES[qtype][0])


def test_unsupported_type_goes_to_gguf_py() -> None:
    assert supports(Q.Q4_K) and not supports(Q.IQ2_XXS)
    with pytest.raises(NotImplementedError, match="gguf.quants.dequantize"):
        dequantize(torch.zeros(66, dtype=torch.uint8), Q.IQ2_XXS, 256)


def test_compiled_dispatch_tells_types_apart() -> None:
    """One compiled dequantize serves types whose rows have the same byte length (Q4_K and Q4_0 at 256 values are
    both 144 bytes; F16 and BF16 are both 2 bytes a value): each call must still use its own type's layout."""
    torch._dynamo.reset()
    compiled = torch.compile(dequantize, fullgraph=True, backend="eager")
    for qtype in (Q.Q4_K, Q.Q4_0, Q.F16, Q.BF16):
        raw = random_rows(qtype, (3,), 256, seed=3)
        assert_same_bits(compiled(torch.from_numpy(raw), qtype, 256), reference(raw, qtype), GGML_QUANT_SIZES[qtype][0])


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.MXFP4], ids=lambda q: q.name)
def test_inductor_keeps_bits(qtype: Q) -> None:
    """Under torch.compile's code generation (fused ops, maybe FMA) the values stay bit-identical."""
    torch._dynamo.reset()
    compiled = torch.compile(dequantize, fullgraph=True, dynamic=False)
    raw = random_rows(qtype, (2, 3), 512, seed=4)
    assert_same_bits(compiled(torch.from_numpy(raw), qtype, 512), reference(raw, qtype), GGML_QUANT_SIZES[qtype][0])


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.IQ4_XS], ids=lambda q: q.name)
def test_the_embedding_keeps_its_rows_and_dequantizes_a_steps(qtype):
    """layers.Embedding holds token_embd as its GGUF rows (the memory map on the CPU) and dequantizes a step's
    tokens: the rows of the float32 table gguf-py makes, bit for bit (IQ4_XS, which the torch dequantizers do not
    read, is kept as that table)."""
    from types import SimpleNamespace

    from moeprep.gguf.reader import dequantize_raw
    from moeprep.synth.weights import quantize
    from moerun.layers import Embedding

    rng = np.random.default_rng(int(qtype))
    n_vocab, dim = 40, 256
    values = rng.standard_normal((n_vocab, dim), dtype=np.float32)
    raw = (
        quantize(values, qtype)
        if qtype != Q.IQ4_XS  # no quantizer writes IQ4_XS: random bytes, sane scales
        else rng.integers(0, 256, (n_vocab, dim // 256 * 136), dtype=np.uint8)
    )
    if qtype == Q.IQ4_XS:
        raw.reshape(n_vocab, -1, 136)[..., :2] = np.array([0.01], np.float16).view(np.uint8)
    table = torch.from_numpy(np.array(dequantize_raw(raw, qtype, (n_vocab, dim)), np.float32))
    info = SimpleNamespace(ggml_type=qtype, shape=(n_vocab, dim))
    weights = SimpleNamespace(
        info=lambda name: info,
        gguf=SimpleNamespace(raw=lambda i: raw),
        device=torch.device("cpu"),
        dense=lambda name, dtype: table.clone(),
    )
    embedding = Embedding(weights, "token_embd.weight")
    assert embedding.rows.dtype == (torch.float32 if qtype == Q.IQ4_XS else torch.uint8)
    tokens = torch.tensor([3, 0, 39, 3, 17])
    assert torch.equal(embedding(tokens), table[tokens])
