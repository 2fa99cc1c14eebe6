"""moerun.kernels.fused (Triton) and moerun.kernels.cpu.fused (numba, the CPU's) against the torch reference of
moerun.layers, on random inputs.

Without a GPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1), so the shapes are
tiny; with CUDA the same tests run compiled: `python -m pytest --noconftest tests/runtime/test_fused.py`.
The fused kernels reorder float32 sums (a norm's mean, a softmax's denominator, attention over split slots), so
values are compared within a few float32 roundings of the result's magnitude; expert choices and ids exactly.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from moeprep.gguf.reader import open_gguf
from moerun import backend, layers
from moerun.config import GATING_SIGMOID, GATING_SOFTMAX, GATING_SOFTMAX_WEIGHT
from moerun.hooks import Hooks
from moerun.kernels import fused, gemm, gemv, gguf_matmul, tuning
from moerun.kernels.act_i8 import QAct, quantize_i8
from moerun.kernels.cpu import fused as cpu_fused
from moerun.kernels.gguf_matmul import QWeight, gguf_mm, gguf_moe_glu
from moerun.kernels.tuning import Int8Routes
from moerun.kv_cache import KVCache
from moerun.layers import attention
from moerun.layers.gguf_gpu import QuantLinear, bank_moe
from moerun.layers.moe import GATING_PROBS
from moerun.models import arch_module
from moerun.options import RuntimeOptions
from moerun.step import Step

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RTOL = 2e-6  # float32 values through a different summation order: a few roundings of the largest magnitude


def close(got: torch.Tensor, ref: torch.Tensor, rtol: float = RTOL) -> None:
    got, ref = got.float().cpu(), ref.float().cpu()
    assert got.shape == ref.shape, (tuple(got.shape), tuple(ref.shape))
    scale = ref.abs().max().item()
    assert scale > 0, "reference is all zeros"
    err = (got - ref).abs().max().item()
    assert err <= rtol * scale * 4, f"max error {err:.3g} against max |ref| {scale:.3g}"


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def randn(*shape: int, gen: torch.Generator, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(device=DEVICE, dtype=dtype)


# ----------------------------------------------------------------------------------------------------------- norms


@pytest.mark.parametrize("shape", [(3, 40), (2, 3, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm(shape, dtype, gen):
    x, w = randn(*shape, gen=gen, dtype=dtype) * 3, randn(shape[-1], gen=gen)
    close(fused.rms_norm(x, w, 1e-6), layers.rms_norm(x, w, 1e-6))


def test_rms_norm_of_a_column_slice(gen):
    """deepseek2 norms a slice of a projection's columns (rows strided)."""
    kv = randn(3, 56, gen=gen)
    w = randn(40, gen=gen)
    close(fused.rms_norm(kv[:, :40], w, 1e-5), layers.rms_norm(kv[:, :40], w, 1e-5))


def test_add_rms_norm(gen):
    x, delta, w = randn(2, 48, gen=gen), randn(2, 48, gen=gen), randn(48, gen=gen)
    h, normed = fused.add_rms_norm(x, delta, w, 1e-6)
    h_ref, normed_ref = layers.add_rms_norm(x, delta, w, 1e-6)
    assert torch.equal(h, h_ref)
    close(normed, normed_ref)


def assert_rounds(rounding: QAct | None, rows: torch.Tensor) -> None:
    """`rounding` is the 8-bit routes' rounding of `rows` (a kernel's output as the (T, C) input of a product), equal
    bit for bit to quantize_i8's."""
    assert rounding is not None
    want = quantize_i8(rows.clone())
    for part in ("q", "d", "s"):
        assert torch.equal(getattr(rounding, part), getattr(want, part)), part


@pytest.mark.parametrize("i8", [True, False], ids=["i8", "route-off"])
def test_norms_round_their_output_for_the_8bit_route(i8, gen, monkeypatch):
    """A decode step's norms before its products (add_rms_norm_i8, with a delta or without) write their output's
    int8 blocks in the same pass and return them (with the 8-bit route on, a multiple of 32 values, at most
    fused.rounded_rows() rows): the products reading it skip their own rounding. The values are the plain norms'."""
    routes = Int8Routes(gemv=i8, gemm=i8)
    w = randn(4096, gen=gen) + 2
    x, delta = randn(3, 4096, gen=gen) * 3, randn(3, 4096, gen=gen)
    x[1, 64:96] = 0  # a block of zeros, after a norm too
    same_x, normed, normed_i8 = fused.add_rms_norm_i8(x, None, w, 1e-6, routes)
    h, added, added_i8 = fused.add_rms_norm_i8(x, delta, w, 1e-6, routes)
    assert same_x is x and torch.equal(normed, fused.rms_norm(x, w, 1e-6))
    assert all(torch.equal(a, b) for a, b in zip((h, added), fused.add_rms_norm(x, delta, w, 1e-6)))
    if not i8:
        assert normed_i8 is None and added_i8 is None
        return
    assert_rounds(normed_i8, normed)
    assert_rounds(added_i8, added)
    assert fused.add_rms_norm_i8(x[:, :40], None, w[:40], 1e-6)[2] is None  # 40 values: no blocks of 32
    many = randn(fused.rounded_rows(routes) + 1, 64, gen=gen)
    assert fused.add_rms_norm_i8(many, many, w[:64], 1e-6)[2] is None


# ---------------------------------------------------------------------------------------------------- norm + rope


@pytest.fixture(scope="module")
def qwen3_args(tmp_path_factory):
    from moeprep.synth import write_synth_model

    path = write_synth_model(tmp_path_factory.mktemp("fused") / "qwen3moe.gguf", "qwen3moe")
    return arch_module("qwen3moe", path).read_args(open_gguf(path))


@pytest.mark.parametrize(
    "style,rope_dim,norm", [("neox", 16, True), ("normal", 16, True), ("neox", 8, False), ("normal", 12, False)]
)
def test_qkv_rope(qwen3_args, style, rope_dim, norm, gen):
    """Per-head Q/K norm then RoPE (NeoX halves or adjacent pairs, over all or the first channels of a head), and
    k, v cast to the cache dtype, against layers.norm_rope followed by the cache's cast."""
    args = dataclasses.replace(qwen3_args, rope_style=style, rope_dim=rope_dim)
    rope = layers.Rope(args, 64, torch.device(DEVICE))
    T, H, G, Dh, Dv = 3, 4, 2, 16, 24
    q, k, v = randn(T, H, Dh, gen=gen), randn(T, G, Dh, gen=gen), randn(T, G, Dv, gen=gen)
    q_norm = layers.RMSNorm(randn(Dh, gen=gen), 1e-6, layers.TORCH_KERNELS) if norm else None
    k_norm = layers.RMSNorm(randn(Dh, gen=gen), 1e-6, layers.TORCH_KERNELS) if norm else None
    positions = torch.tensor([5, 17, 63], device=DEVICE)
    got = fused.qkv_rope(
        q,
        k,
        v,
        q_norm.weight if norm else None,
        k_norm.weight if norm else None,
        1e-6,
        rope.cos,
        rope.sin,
        positions,
        style == "neox",
        torch.bfloat16,
    )
    q_ref, k_ref, v_ref = layers.norm_rope(q, k, v, q_norm, k_norm, rope, positions)
    close(got[0], q_ref)
    assert got[1].dtype == got[2].dtype == torch.bfloat16
    # k: the same float32 value up to rounding, then rounded to bfloat16: one bfloat16 step apart at most; v is
    # only rounded (Triton's interpreter truncates to bfloat16 where the GPU rounds to nearest: one step too)
    close(got[1], k_ref, rtol=2**-8)
    if DEVICE == "cuda":
        assert torch.equal(got[2], v_ref.to(torch.bfloat16))
    else:
        close(got[2], v_ref, rtol=2**-8)
    # the same rows written straight into a sequence's cache buffers at row = position, the other rows kept
    k_slots, v_slots = randn(64, G, Dh, gen=gen, dtype=torch.bfloat16), randn(64, G, Dv, gen=gen, dtype=torch.bfloat16)
    before = k_slots.clone(), v_slots.clone()
    q_s, k_s, v_s = fused.qkv_rope(
        q,
        k,
        v,
        q_norm.weight if norm else None,
        k_norm.weight if norm else None,
        1e-6,
        rope.cos,
        rope.sin,
        positions,
        style == "neox",
        torch.bfloat16,
        k_slots,
        v_slots,
    )
    assert k_s is k_slots and v_s is v_slots and torch.equal(q_s, got[0])
    assert torch.equal(k_slots[positions], got[1]) and torch.equal(v_slots[positions], got[2])
    others = torch.ones(64, dtype=torch.bool, device=DEVICE)
    others[positions] = False
    assert torch.equal(k_slots[others], before[0][others]) and torch.equal(v_slots[others], before[1][others])


@pytest.mark.parametrize("norms", ["per-head", "whole-projection", "none"])
@pytest.mark.parametrize("mixed", [False, True], ids=["one-seq", "mixed-seqs"])
def test_norm_rope_store(qwen3_args, norms, mixed, gen):
    """The layers' entry point: fused (k and v written into the sequence's cache rows by the kernel, or through
    KVCache.update for a step across sequences; olmoe's whole-projection norms through the torch reference) against
    the torch one: the same q, the same slots read and the same cache contents."""
    rope = layers.Rope(qwen3_args, 16, torch.device(DEVICE))
    T, H, G, Dh = 2, 4, 2, 16
    q, k, v = randn(T, H, Dh, gen=gen), randn(T, G, Dh, gen=gen), randn(T, G, Dh, gen=gen)
    widths = {"per-head": (Dh, Dh), "whole-projection": (H * Dh, G * Dh), "none": None}[norms]
    q_norm, k_norm = (
        (None, None)
        if widths is None
        else (
            layers.RMSNorm(randn(widths[0], gen=gen), 1e-6, layers.TORCH_KERNELS),
            layers.RMSNorm(randn(widths[1], gen=gen), 1e-6, layers.TORCH_KERNELS),
        )
    )
    positions = torch.tensor([3, 4], device=DEVICE)
    step = (
        Step(positions, n_slots=8, seqs=torch.tensor([1, 0], device=DEVICE))
        if mixed
        else Step(positions, n_slots=8, seq=1)
    )
    results = []
    for kernels in (backend.fused_kernels(), layers.TORCH_KERNELS):
        cache = KVCache(16, G, Dh, Dh, torch.bfloat16, torch.device(DEVICE), n_seq=2)
        out = kernels.norm_rope_store(q, k, v, q_norm, k_norm, rope, step, cache)
        results.append((*out, cache.k, cache.v))
    for got, ref in zip(*results):
        close(got, ref, rtol=2**-8 if got.dtype == torch.bfloat16 else RTOL)


# ------------------------------------------------------------------------------------------------------ attention


@pytest.mark.parametrize(
    "T,H,G,D,S,window,sinks", [(1, 8, 2, 32, 100, 0, False), (3, 4, 4, 16, 70, 0, True), (2, 8, 1, 64, 130, 24, False)]
)
def test_attend_decode(T, H, G, D, S, window, sinks, gen):
    """Queries at the last T positions of S slots (several split chunks, the last partial), a bfloat16 cache read
    as a prefix of a longer buffer, GQA groups of 4, 1 and 8, a sliding window, attention sinks."""
    cache_k, cache_v = (
        randn(S + 30, G, D, gen=gen, dtype=torch.bfloat16),
        randn(S + 30, G, D, gen=gen, dtype=torch.bfloat16),
    )
    k, v = cache_k[:S], cache_v[:S]
    q = randn(T, H, D, gen=gen)
    positions = torch.arange(S - T - 5, S - 5, device=DEVICE)  # the slots past the positions stay masked
    slots = torch.arange(S, device=DEVICE)[None, :]
    allowed = slots <= positions[:, None]
    if window:
        allowed &= slots > positions[:, None] - window
    sink = randn(H, gen=gen) if sinks else None
    assert fused.attend_supports(q, k, v)
    got = fused.attend_decode(q, k, v, allowed, 0.3, sink)
    close(got, layers.attend(q, k, v, allowed, 0.3, sink))
    same, rounding = fused.attend_decode_i8(q, k, v, allowed, 0.3, sink)
    assert torch.equal(same, got)
    if D % 32 == 0:  # its output, read as (T, H * D) by the output projection, comes rounded for the 8-bit route
        assert_rounds(rounding, got.reshape(T, H * D))
    else:
        assert rounding is None


@pytest.mark.parametrize("sinks", [False, True])
def test_attend_decode_batch_of_sequences(sinks, gen):
    """One token of each of 3 of 4 sequences over its own slots, read in place from every sequence's cache
    ((n_seq, S, G, D) KV, a prefix of longer buffers, as KVCache.update returns them for a decode batch), each at its
    own position: the split kernel against torch's attention over the gathered slots."""
    T, H, G, D, S = 3, 8, 2, 32, 130
    k, v = (randn(4, S + 30, G, D, gen=gen, dtype=torch.bfloat16)[:, :S] for _ in range(2))
    seqs = torch.tensor([2, 0, 3], device=DEVICE)
    q = randn(T, H, D, gen=gen)
    positions = torch.tensor([5, 129, 70], device=DEVICE)
    allowed = torch.arange(S, device=DEVICE)[None, :] <= positions[:, None]
    sink = randn(H, gen=gen) if sinks else None
    assert fused.attend_supports(q, k, v, seqs)
    ref = torch.cat(
        [
            layers.attend(q[t : t + 1], k[s], v[s], allowed[t : t + 1], 0.3, sink)  # one sequence at a time
            for t, s in enumerate(seqs.tolist())
        ]
    )
    close(fused.attend_decode(q, k, v, allowed, 0.3, sink, seqs), ref)
    close(layers.attend(q, k, v, allowed, 0.3, sink, seqs), ref)


@pytest.mark.parametrize("window,sinks", [(0, False), (24, True)])
def test_long_prompts_attend_in_blocks_of_queries(window, sinks, gen, monkeypatch):
    """A prompt whose scores would pass `score_bytes` (ATTEND_SCORE_BYTES by default) attends in blocks of query tokens (the last one partial)
    with the result of attending at once."""
    T, H, G, D = 40, 4, 2, 16
    q, k, v = randn(T, H, D, gen=gen), randn(T, G, D, gen=gen), randn(T, G, D, gen=gen)
    positions = torch.arange(T, device=DEVICE)
    slots = torch.arange(T, device=DEVICE)[None, :]
    allowed = slots <= positions[:, None]
    if window:
        allowed &= slots > positions[:, None] - window
    sink = randn(H, gen=gen) if sinks else None
    at_once = layers.attend(q, k, v, allowed, 0.3, sink)
    calls = []
    attend = layers.attend
    monkeypatch.setattr(attention, "attend", lambda *args, **kw: calls.append(args[0].shape[0]) or attend(*args, **kw))
    close(layers.attend(q, k, v, allowed, 0.3, sink, score_bytes=7 * 4 * H * T), at_once)  # blocks of 7 queries
    assert calls == [7, 7, 7, 7, 7, 5]


def test_attend_hands_prefill_and_prompts_to_torch(gen):
    q, k = randn(9, 4, 16, gen=gen), randn(20, 2, 16, gen=gen)
    assert not fused.attend_supports(q, k, k)  # more tokens than a decode step's
    blocks = torch.tensor([0, 1], device=DEVICE)  # a captured prompt step's: 2 blocks of prompt tokens
    assert not fused.attend_supports(q[:4], k[None].expand(3, -1, -1, -1), k[None].expand(3, -1, -1, -1), blocks)


# --------------------------------------------------------------------------------------------------------- router


def router(args, gating: int, normalize: bool, scale: float, k: int) -> layers.Router:
    args = dataclasses.replace(
        args, gating=gating, expert_weights_norm=normalize, expert_weights_scale=scale, n_experts_used=k
    )
    return layers.Router(layers.Linear(torch.zeros(1, 1), None, "gate", None), args, layers.TORCH_KERNELS)


ROUTINGS = pytest.mark.parametrize(
    "gating,normalize,scale",
    [
        (GATING_SOFTMAX, True, 0.0),
        (GATING_SOFTMAX, False, 2.5),
        (GATING_SIGMOID, True, 1.0),
        (GATING_SOFTMAX_WEIGHT, False, 0.0),
    ],
)


@ROUTINGS
def test_route(qwen3_args, gating, normalize, scale, gen):
    E, K = 48, 6
    logits = randn(5, E, gen=gen) * 2
    ref = router(qwen3_args, gating, normalize, scale, K).choose_general(logits)
    ids, weights = fused.route(logits, K, gating, normalize, scale)
    assert torch.equal(ids, ref[0]), (ids, ref[0])
    close(weights, ref[1])


def lowest_index_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """torch.topk's choice on CUDA: all values above the k-th largest, then the lowest ids among those equal to it
    (its gather pass walks the ids in order), here in descending order, equal values by id."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]


def test_route_ties_go_to_the_lowest_id(qwen3_args, gen):
    """Logits from a few distinct values: many experts tie at the k-th place. The choice is torch.topk's on CUDA
    (compared directly when the test runs on a GPU; on the CPU torch.topk breaks ties another way)."""
    E, K = 128, 8
    logits = (torch.randint(0, 4, (6, E), generator=gen).float() * 0.5).to(DEVICE)
    logits[0] = 1.0  # all tied
    for gating in (GATING_SOFTMAX, GATING_SIGMOID, GATING_SOFTMAX_WEIGHT):
        ids, weights = fused.route(logits, K, gating, True, 0.0)
        assert torch.equal(ids, lowest_index_topk(logits, K))
        probs = GATING_PROBS[gating](logits)
        assert torch.equal(ids, lowest_index_topk(probs, K))
        if DEVICE == "cuda":
            assert torch.equal(ids.sort(-1).values, torch.topk(probs, K, dim=-1).indices.sort(-1).values)
        ref = router(qwen3_args, gating, True, 0.0, K)
        ref.choose = ref.choose_general
        chosen = probs.gather(-1, ids)
        ref_weights = torch.softmax(chosen, -1) if gating == GATING_SOFTMAX_WEIGHT else chosen
        close(weights, ref_weights / ref_weights.sum(-1, keepdim=True))


# --------------------------------------------------------------------------------------------------- feed-forward


def test_swiglu(gen):
    gate, up = randn(3, 4, 40, gen=gen) * 4, randn(3, 4, 40, gen=gen)
    close(fused.swiglu(gate, up), layers.swiglu(gate, up))


def test_moe_combine(gen):
    T, K, D = 3, 4, 1100  # two column tiles, the second partial
    y, weights = randn(T, K, D, gen=gen), randn(T, K, gen=gen).abs()
    slots = torch.tensor([[0, 5, -1, 2], [1, 1, 3, 4], [-1, -1, 7, 0]], dtype=torch.int32, device=DEVICE)
    ref = torch.einsum("tkd,tk->td", y.double(), torch.where(slots >= 0, weights, 0.0).double())
    close(fused.moe_combine(y, weights, slots), ref)


def random_q8_0(rng: np.random.Generator, banks: int, rows: int, cols: int) -> QWeight:
    """Random Q8_0 weights (rows, cols), or a bank of `banks` such matrices where banks > 1, scales 0.01 to 0.1."""
    blocks = rng.integers(0, 256, (banks, rows, cols // 32, 34), dtype=np.uint8)
    blocks[..., :2] = rng.uniform(0.01, 0.1, (banks, rows, cols // 32, 1)).astype(np.float16).view(np.uint8)
    data = torch.from_numpy(blocks.reshape(banks, rows, -1) if banks > 1 else blocks.reshape(rows, -1))
    return QWeight(data.to(DEVICE), Q.Q8_0, rows, cols)


def test_stacked_qkv(gen):
    """QuantLinear.stack_rows: one product over q, k and v's rows (one with a bias) equals the three apart, and the
    parts, re-pointed at the stacked bytes, still give their own products."""
    rng = np.random.default_rng(3)
    cols, hooks = 64, Hooks()
    parts = [
        QuantLinear(random_q8_0(rng, 1, n, cols), bias, name, hooks)
        for n, bias, name in ((16, None, "q"), (8, randn(8, gen=gen), "k"), (8, None, "v"))
    ]
    x = randn(3, cols, gen=gen)
    apart = [p(x) for p in parts]
    stacked = QuantLinear.stack_rows(parts)
    assert stacked is not None and stacked.qweight.rows == 32
    for got, ref in zip(stacked(x).split([16, 8, 8], dim=-1), apart):
        close(got, ref)
    for p, ref in zip(parts, apart):
        assert p.qweight.data.untyped_storage().data_ptr() == stacked.qweight.data.untyped_storage().data_ptr()
        close(p(x), ref)
    other = QuantLinear(
        QWeight(torch.zeros(4, 36, dtype=torch.uint8, device=DEVICE), Q.Q4_0, 4, cols), None, "o", hooks
    )
    assert QuantLinear.stack_rows([parts[0], other]) is None  # types differ


def test_kept_decoded_copies(gen, monkeypatch):
    """keep_decoded_copies: every QuantLinear of a module keeps its weight decoded to bfloat16 when all the copies
    fit the free memory with the reserve to spare, none when they do not; a stacked q/k/v is decoded once and its
    parts take views of their rows. One token still runs on the blocks; from KEPT_DECODED_MIN_TOKENS tokens the
    product is the bfloat16 copy's, exactly."""
    from moerun.layers.gguf_gpu import keep_decoded_copies

    rng = np.random.default_rng(4)
    cols, hooks = 64, Hooks()
    parts = [
        QuantLinear(random_q8_0(rng, 1, n, cols), None, name, hooks) for n, name in ((16, "q"), (8, "k"), (8, "v"))
    ]
    net = torch.nn.ModuleList(
        [
            *parts,
            QuantLinear.stack_rows(parts),
            QuantLinear(random_q8_0(rng, 1, 24, cols), randn(24, gen=gen), "o", hooks),
        ]
    )
    x1, x3 = randn(1, cols, gen=gen), randn(tuning.KEPT_DECODED_MIN_TOKENS + 1, cols, gen=gen)
    on_blocks = [(m(x1), m(x3)) for m in net]
    need = 2 * (32 + 24) * cols
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (need + 99, 1 << 40))
    assert keep_decoded_copies(net, reserve=100) == 0
    assert all(m.decoded is None for m in net)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (need + 100, 1 << 40))
    assert keep_decoded_copies(net, reserve=100) == need
    stacked, o = net[3], net[4]
    for p, rows in zip(parts, stacked.decoded.split([16, 8, 8])):
        assert p.decoded.data_ptr() == rows.data_ptr() and p.decoded.shape == (p.qweight.rows, cols)
    for m, (one, three) in zip(net, on_blocks):
        assert m.decoded.dtype == torch.bfloat16
        assert torch.equal(m(x1), one)  # one token: the blocks, as before
        want = x3.bfloat16().float() @ m.decoded.float().T + (0 if m.bias is None else m.bias)
        close(m(x3), want)
        close(m(x3), three, rtol=1e-2)  # the copy holds the blocks' values to bfloat16's 8 bits
    close(o.decoded, gguf_matmul.decode_bf16(o.qweight))


def test_products_take_the_rounding_their_inputs_writer_returns(gen, monkeypatch):
    """The products a decode step runs on a norm's or attention's output (q/k/v, the experts' gate and up, the
    output projection on attention's (T, H * Dv) view) take the 8-bit rounding that kernel returned with it
    instead of rounding again: one launch fewer each, the same result to the bit."""
    rng = np.random.default_rng(5)
    cols = 256
    w, bank = random_q8_0(rng, 1, 8, cols), random_q8_0(rng, 4, 8, cols)
    slots = torch.tensor([[0, 3], [2, 0]], dtype=torch.int32, device=DEVICE)
    q = randn(2, 2, 128, gen=gen)
    kv = randn(40, 1, 128, gen=gen, dtype=torch.bfloat16) * 0.05
    x, norm_weight = randn(2, cols, gen=gen), randn(cols, gen=gen) * 0.05  # silu's exp in range
    rounded = []
    for launcher in (gemv, gemm):
        monkeypatch.setattr(launcher, "quantize_i8", lambda x: rounded.append(x) or quantize_i8(x))
    attended, attended_i8 = fused.attend_decode_i8(q, kv, kv, torch.ones(2, 40, dtype=torch.bool, device=DEVICE), 0.1)
    for out, rounding in (fused.add_rms_norm_i8(x, None, norm_weight, 1e-6)[1:], (attended.view(2, cols), attended_i8)):
        assert rounding is not None
        assert torch.equal(gguf_mm(out, w, rounding), gguf_mm(out, w))
        assert torch.equal(gguf_moe_glu(out, bank, bank, slots, i8=rounding), gguf_moe_glu(out, bank, bank, slots))
    assert len(rounded) == 4  # the products without the rounding only


def test_layers_pass_the_norms_rounding_to_their_products(gen, monkeypatch):
    """On the fused kernels a norm before products (RMSNorm.add_forward_i8) returns its output's int8 rounding, and
    the layers pass it with that output: FeedForward's gate and up (QuantLinear) and the experts' (bank_moe, as
    DeviceExperts runs them) round nothing themselves, only down's input is rounded, and the results are the same
    bits as without it."""
    kernels = backend.fused_kernels()
    rng = np.random.default_rng(8)
    cols, hidden, hooks = 256, 64, Hooks()
    norm = layers.RMSNorm(randn(cols, gen=gen) * 0.05, 1e-6, kernels)
    x, delta = randn(2, cols, gen=gen), randn(2, cols, gen=gen)
    h, normed, i8 = norm.add_forward_i8(x, delta)
    assert i8 is not None and torch.equal(h, x + delta) and torch.equal(normed, norm(h))
    shapes = (("gate", hidden, cols), ("up", hidden, cols), ("down", cols, hidden))
    ffn = layers.FeedForward(
        *(QuantLinear(random_q8_0(rng, 1, r, c), None, name, hooks) for name, r, c in shapes), kernels
    )
    banks = tuple(random_q8_0(rng, 4, r, c) for _, r, c in shapes)
    slots = torch.tensor([[0, 3], [2, 0]], device=DEVICE)
    weights = torch.rand(2, 2, generator=gen).to(DEVICE)
    rounded = []
    for launcher in (gemv, gemm):
        monkeypatch.setattr(launcher, "quantize_i8", lambda x: rounded.append(x) or quantize_i8(x))
    runs = [
        (lambda i8: ffn(normed, None, i8), 3),  # gate, up and down round their inputs without it
        (lambda i8: bank_moe(normed, slots, weights, banks, layers.SWIGLU, fused.swiglu, (None,) * 3, slots, i8), 2),
    ]
    for run, without in runs:
        rounded.clear()
        given = run(i8)
        assert len(rounded) == 1  # down's input only
        assert torch.equal(given, run(None))
        assert len(rounded) == 1 + without


# --------------------------------------------------------------------------------------------------- whole model


@pytest.mark.parametrize("arch", ["qwen3moe", "gemma4"])
def test_model_with_fused_kernels(arch, synth_model, monkeypatch):
    """A prefill and decode steps with every layer on the fused kernels (as on CUDA) against the torch ops, both in
    float32 (on the CPU in CI, on the GPU's path where there is one): the logits agree within float32
    summation-order noise. F32 weights, whose inputs are not rounded to 8-bit blocks (that rounding would turn a
    last-bit difference into a quantization step now and then). gemma4: layers of two head sizes, RoPE with
    frequency divisors, GEGLU and soft-capped logits on the GPU's kernels."""
    import moerun

    path = synth_model(arch, expert_type="F32", attn_type="F32")
    tokens = torch.tensor([3, 17, 99, 5, 250, 1000, 42, 7, 8, 9, 10, 11])
    reference = moerun.load_model(path, device=DEVICE, dtype=torch.float32, options=RuntimeOptions(fused=False))
    options = RuntimeOptions(triton_on_cpu=True)
    model = moerun.load_model(path, device=DEVICE, dtype=torch.float32, options=options)
    assert reference.net.blocks[0].attn_norm.kernels is layers.TORCH_KERNELS
    fused_kernels = backend.backend_for(torch.device(DEVICE), options).kernels
    assert model.net.blocks[0].attn_norm.kernels is fused_kernels and fused_kernels.rms_norm is fused.rms_norm
    for m in (reference, model):
        m.logits = [m.forward(tokens, 0)[-1]] + [
            m.forward(torch.tensor([t]), len(tokens) + i)[0] for i, t in enumerate([20, 21])
        ]
    for got, ref in zip(model.logits, reference.logits):
        close(got, ref, rtol=1e-5)


# ------------------------------------------------------------------------ the CPU's numba kernels (kernels/cpu/fused.py)


@pytest.mark.parametrize("style,rope_dim", [("neox", 16), ("normal", 16), ("neox", 8), ("normal", 12)])
@pytest.mark.parametrize("norms", ["per-head", "whole-projection", "none"])
@pytest.mark.parametrize("step_kind", ["one-seq", "mixed-seqs", "bf16-cache"])
def test_cpu_norm_rope_store(qwen3_args, style, rope_dim, norms, step_kind, gen):
    """Per-head Q/K norm and RoPE (NeoX halves or adjacent pairs, over all or the first channels of a head), k and v
    written into the sequence's cache rows (float32, in place; bfloat16, or a step across sequences: through
    KVCache.update), against the torch reference: the same q, the same slots read and the same cache contents
    (olmoe's whole-projection norms take the reference's own path)."""
    args = dataclasses.replace(qwen3_args, rope_style=style, rope_dim=rope_dim)
    rope = layers.Rope(args, 16, torch.device("cpu"))
    T, H, G, Dh = 2, 4, 2, 16
    q, k, v = (randn(T, n, Dh, gen=gen).cpu() for n in (H, G, G))
    widths = {"per-head": (Dh, Dh), "whole-projection": (H * Dh, G * Dh), "none": None}[norms]
    q_norm, k_norm = (
        (None, None)
        if widths is None
        else (
            layers.RMSNorm(randn(widths[0], gen=gen).cpu(), 1e-6, layers.TORCH_KERNELS),
            layers.RMSNorm(randn(widths[1], gen=gen).cpu(), 1e-6, layers.TORCH_KERNELS),
        )
    )
    positions = torch.tensor([3, 11])
    step = (
        Step(positions, n_slots=12, seqs=torch.tensor([1, 0]))
        if step_kind == "mixed-seqs"
        else Step(positions, n_slots=12, seq=1)
    )
    dtype = torch.bfloat16 if step_kind == "bf16-cache" else torch.float32
    held = randn(2, 2, 16, G, Dh, gen=gen).cpu()  # what the cache rows held: the rows the step does not write keep it
    results = []
    for norm_rope_store in (backend.cpu_kernels().norm_rope_store, layers.norm_rope_store):
        cache = KVCache(16, G, Dh, Dh, dtype, torch.device("cpu"), n_seq=2)
        cache.k.copy_(held[0])
        cache.v.copy_(held[1])
        out = norm_rope_store(q, k, v, q_norm, k_norm, rope, step, cache)
        results.append((*out, cache.k, cache.v))
    for got, ref in zip(*results):
        close(got, ref, rtol=2**-8 if got.dtype == torch.bfloat16 else RTOL)


@ROUTINGS
def test_cpu_route(qwen3_args, gating, normalize, scale, gen):
    logits = randn(5, 48, gen=gen).cpu() * 2
    ids, weights = cpu_fused.route(logits, 6, gating, normalize, scale)
    ref = router(qwen3_args, gating, normalize, scale, 6).choose_general(logits)
    assert torch.equal(ids, ref[0]), (ids, ref[0])
    close(weights, ref[1])
    # equal logits: the lowest expert id first, in descending order
    tied = torch.tensor([[0.5, 2.0, 0.5, 2.0, 1.0, 0.5]])
    assert cpu_fused.route(tied, 4, gating, normalize, scale)[0].tolist() == [[1, 3, 4, 0]]


def test_cpu_model_with_fused_kernels(synth_model, monkeypatch):
    """A qwen3moe prefill and decode steps with the CPU's fused kernels (the default there) against the same model
    on torch ops alone: the logits agree within float32 summation-order noise. F32 weights, whose inputs are not rounded to
    8-bit blocks (that rounding would turn a last-bit difference into a quantization step now and then)."""
    import moerun

    path = synth_model("qwen3moe", expert_type="F32", attn_type="F32")
    tokens = torch.tensor([3, 17, 99, 5, 250, 1000, 42, 7, 8, 9, 10, 11])
    model = moerun.load_model(path, device="cpu", options=RuntimeOptions())
    assert model.net.blocks[0].attn_norm.kernels.route is cpu_fused.route
    reference = moerun.load_model(path, device="cpu", options=RuntimeOptions(fused=False))
    assert reference.net.blocks[0].attn_norm.kernels is layers.TORCH_KERNELS
    for m in (reference, model):
        m.logits = [m.forward(tokens, 0)[-1]] + [
            m.forward(torch.tensor([t]), len(tokens) + i)[0] for i, t in enumerate([20, 21])
        ]
    for got, ref in zip(model.logits, reference.logits):
        close(got, ref, rtol=1e-5)
