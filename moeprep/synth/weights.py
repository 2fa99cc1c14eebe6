"""Synthetic weights: how each tensor's values are drawn, and how they become GGUF bytes.

Scales keep activations O(1) through any depth: input projections are N(0, 1/fan_in); projections that write
into the residual stream are further scaled by 1/sqrt(2 L), so L layers add O(1) in total; norm weights are
1 + N(0, 0.1^2), so a runtime that drops a norm weight is visibly wrong.

The bias channel (how `skew` works without a router bias): every token embedding holds BIAS_CHANNEL_VALUE in
channel BIAS_CHANNEL, and every tensor that writes into the residual stream has a zero row there, so the
channel keeps that value through all layers and reaches each router as roughly BIAS_CHANNEL_NORMED after
RMSNorm. Router column BIAS_CHANNEL therefore acts as a per-expert logit offset, and holds nothing else. `skew`
puts a Zipf-like ranking there: expert e of rank r (a seeded permutation per layer) gets the offset
-skew * scale * ln(1 + r), the log of a Zipf weight (1 + r)^(-skew * scale), so low ranks win far more often.
Sigmoid-gated archs put the same offsets into exp_probs_b instead (scale in score units), which moves only the
choice of experts, not their weights. The scales live with the gating kinds in moeprep/synth/parts.py.

Quantized types come from `quantize` (float weights through a real quantizer) or `random_blocks`
(fast_random_blocks: valid blocks written directly as bytes, scale fields set so the values have the intended std).
Shapes are numpy order; E experts, D hidden, I expert hidden, R rows.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Protocol

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from moeprep.quant import registry

Q = GGMLQuantizationType
BIAS_CHANNEL = 0
BIAS_CHANNEL_VALUE = 4.0
BIAS_CHANNEL_NORMED = 3.0  # a typical RMSNorm output there: 4 / rms(x), with rms(x) a little above 1
NORM_NOISE = 0.1
BIAS_STD = 0.2  # attention/expert biases: large enough that a runtime ignoring them fails its tests
SINK_STD = 0.5  # gpt-oss attention sinks, in attention-logit units
PROBS_BIAS_NOISE = 0.05  # exp_probs_b at skew 0: small, but it still changes some choices (so it is tested)


def tensor_rng(seed: int, name: str) -> np.random.Generator:
    """A generator for one tensor: its values depend on (seed, name) only, not on write order or other tensors."""
    digest = hashlib.sha256(name.encode()).digest()
    return np.random.default_rng([seed, int.from_bytes(digest[:8], "little")])


class Init(Protocol):
    """How a tensor's float values are drawn; `std` is their scale, used by random_blocks in fast mode."""

    std: float

    def sample(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray: ...


@dataclass(frozen=True)
class Normal:
    std: float
    mean: float = 0.0

    def sample(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(self.std) + np.float32(self.mean)


@dataclass(frozen=True)
class Embedding:
    """N(0, 1) token embeddings [V, D] carrying the constant bias channel."""

    std: float = 1.0

    def sample(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        values = rng.standard_normal(shape, dtype=np.float32)
        values[:, BIAS_CHANNEL] = BIAS_CHANNEL_VALUE
        return values


def skew_offsets(rng: np.random.Generator, n_expert: int, skew: float, scale: float) -> np.ndarray:
    """Per-expert offsets [E]: -skew * scale * ln(1 + rank), ranks a seeded permutation."""
    rank = rng.permutation(n_expert)
    return (-skew * scale * np.log1p(rank) + 0.0).astype(np.float32)  # + 0.0: no negative zeros at skew 0


@dataclass(frozen=True)
class Router:
    """Router [E, D]: logits ~ N(0, logit_std^2) for a normed hidden state; skew offsets in the bias channel."""

    std: float  # logit_std / sqrt(D)
    skew: float
    skew_scale: float  # 0 when this arch skews through exp_probs_b instead

    def sample(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        values = Normal(self.std).sample(rng, shape)
        # the column holds only the skew, so skew 0 routes evenly rather than by a random per-expert offset
        values[:, BIAS_CHANNEL] = skew_offsets(rng, shape[0], self.skew, self.skew_scale) / BIAS_CHANNEL_NORMED
        return values


@dataclass(frozen=True)
class ProbsBias:
    """exp_probs_b [E]: the selection-only bias of sigmoid routing, with the skew offsets."""

    skew: float
    skew_scale: float
    std: float = PROBS_BIAS_NOISE

    def sample(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        noise = Normal(self.std).sample(rng, shape)
        return noise + skew_offsets(rng, shape[0], self.skew, self.skew_scale)


@dataclass(frozen=True)
class KvBPart:
    """attn_k_b or attn_v_b cut from the attn_kv_b draw, so both MLA layouts of one seed are the same model.

    attn_kv_b [H * (N + V), C] holds per head the K rows (N) then the V rows (V); attn_k_b is the K part
    transposed to [H, C, N], attn_v_b the V part as [H, V, C]. H heads, C kv_lora_rank, N qk_nope, V v_head."""

    std: float
    n_head: int
    nope: int
    v: int
    kv_lora: int
    part: str  # "k" or "v"

    def sample(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        kv_b = Normal(self.std).sample(rng, (self.n_head * (self.nope + self.v), self.kv_lora))
        per_head = kv_b.reshape(self.n_head, self.nope + self.v, self.kv_lora)
        cut = per_head[:, : self.nope].transpose(0, 2, 1) if self.part == "k" else per_head[:, self.nope :]
        return np.ascontiguousarray(cut)


# --- bytes -----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockLayout:
    """Where a block keeps its scale, and the std of its dequantized values when that scale is 1.

    With uniformly random bytes elsewhere, a block decodes to values of std unit_std * d. Q4_K's second fp16
    field (dmin) is 7.5 d, which cancels the mean of its unsigned 4-bit codes (d * sc * q - dmin * m has mean
    zero when E[q] = 7.5 and sc, m share one distribution)."""

    unit_std: float
    fp16_scales: tuple[tuple[int, float], ...] = ()  # (byte offset, multiple of d) of each fp16 scale field
    e8m0_offset: int | None = None  # byte offset of an E8M0 exponent e: scale 2**(e - 128), ggml's MXFP4 convention


RANDOM_BLOCKS: dict[GGMLQuantizationType, BlockLayout] = {
    Q.Q8_0: BlockLayout(73.9, ((0, 1.0),)),  # int8 codes
    Q.Q4_0: BlockLayout(4.61, ((0, 1.0),)),  # codes 0..15 minus 8
    Q.Q4_K: BlockLayout(254.0, ((0, 1.0), (2, 7.5))),  # d, dmin, 6-bit scales/mins, 4-bit codes
    Q.Q6_K: BlockLayout(1366.0, ((208, 1.0),)),  # 6-bit codes minus 32 times int8 scales; d last
    Q.MXFP4: BlockLayout(5.85, e8m0_offset=0),  # E2M1 codes (ggml stores them doubled)
}


def byte_shape(shape: tuple[int, ...], qtype: GGMLQuantizationType) -> tuple[int, ...]:
    block, type_size = GGML_QUANT_SIZES[qtype]
    return (*shape[:-1], shape[-1] // block * type_size)


def random_blocks(
    rng: np.random.Generator, shape: tuple[int, ...], qtype: GGMLQuantizationType, std: float
) -> np.ndarray:
    """Valid random blocks of qtype for a tensor of `shape`, decoding to values of about N(0, std^2) scale."""
    layout = RANDOM_BLOCKS[qtype]
    block, type_size = GGML_QUANT_SIZES[qtype]
    n_blocks = int(np.prod(shape, dtype=np.int64)) // block
    blocks = rng.integers(0, 256, (n_blocks, type_size), dtype=np.uint8)
    d = std / layout.unit_std
    for offset, ratio in layout.fp16_scales:
        blocks[:, offset : offset + 2] = np.array([d * ratio], dtype=np.float16).view(np.uint8)
    if layout.e8m0_offset is not None:
        blocks[:, layout.e8m0_offset] = np.uint8(128 + round(float(np.log2(d))))
    return blocks.reshape(byte_shape(shape, qtype))


def quantize(values: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """Bytes of float `values` in qtype: moeprep's quantizers (byte-equal to ggml's) for every type they cover,
    gguf-py for the rest (MXFP4); integer tables (I32) as they are."""
    if qtype == Q.I32:
        return np.ascontiguousarray(values, dtype=np.int32).view(np.uint8)
    rows = values.reshape(-1, values.shape[-1])
    if qtype in registry.QUANTIZERS:
        data = registry.quantize_rows(rows, qtype)
    else:
        data = np.ascontiguousarray(gguf.quants.quantize(rows, qtype)).view(np.uint8)
    return data.reshape(byte_shape(values.shape, qtype))
