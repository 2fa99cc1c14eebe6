"""The CPU expert kernels (moerun.kernels.cpu) against float64 dequantize-then-matmul, and moe_rows' contract.

Reference: the weight dequantized by moerun.kernels.dequant (bit-identical to gguf-py; gguf-py itself for IQ4_XS),
the input rounded as moerun.kernels.rounding does for the weight type, the product in float64. The kernels compute the same
rounded input times the same weights, with exact integer block sums; only their float32 scaling and accumulation
differ, so the bars below are float32 rounding bars, not quantization-error bars.

The kernels' tests run twice: on ggml's row dots (kernels/ggml_cpu.py: llama-cpp-python is in the test extra) where they
cover the type, and on moerun's numba kernels alone.
"""

from __future__ import annotations

import threading
import time
from functools import partial

import gguf
import numba
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

import moerun
from moeprep.synth.weights import quantize
from moerun.kernels import ggml_cpu, rounding
from moerun.kernels.cpu import formats, work
from moerun.kernels.cpu.formats import ExpertBytes
from moerun.kernels.cpu.moe_rows import expert_matmul, moe_rows
from moerun.kernels.dequant import dequantize, supports
from moerun.layers import situ, swiglu_clamp, swiglu_limited
from moerun.options import RuntimeOptions

QTYPES = list(formats.FORMATS)


@pytest.fixture(params=["ggml", "numba"])
def ggml(request) -> ggml_cpu.GgmlCPU | None:
    """The kernels under test: ggml's row dots where ggml_cpu covers the type (their numba entry points; the
    library's value), or moerun's numba kernels for every type (None)."""
    if request.param == "numba":
        return None
    library = ggml_cpu.open_library()
    if library is None:
        pytest.skip("libggml-cpu (llama-cpp-python) is not installed")
    return library


# Types no moeprep or gguf-py quantizer writes: random bytes with their scale fields (fp16 d, dmin) set to sane
# values; every byte pattern of the rest is a valid block.
RANDOM_BYTES_SCALES = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.IQ4_XS: (0,)}
EPS32 = 2.0**-24


def expert_bytes(
    rng: np.random.Generator, qtype: Q, n_experts: int, rows: int, cols: int, bias: bool = False
) -> ExpertBytes:
    """Fresh random experts of qtype (values of about N(0, 0.02^2)), never all zeros."""
    if qtype in RANDOM_BYTES_SCALES:
        block, type_size = GGML_QUANT_SIZES[qtype]
        data = rng.integers(0, 256, (n_experts, rows, cols // block, type_size), dtype=np.uint8)
        for offset in RANDOM_BYTES_SCALES[qtype]:
            scales = (rng.uniform(0.5, 1.5, data.shape[:-1]) * 1e-3).astype(np.float16)
            data[..., offset : offset + 2] = scales.view(np.uint8).reshape(*scales.shape, 2)
        data = data.reshape(n_experts, rows, -1)
    else:
        data = quantize((rng.standard_normal((n_experts, rows, cols)) * 0.02).astype(np.float32), qtype)
    b = (rng.standard_normal((n_experts, rows)) * 0.01).astype(np.float32) if bias else None
    return ExpertBytes(data, qtype, rows, cols, b)


def dequantized(t: ExpertBytes, e: int) -> np.ndarray:
    """Expert e of t as float64 (rows, cols)."""
    if supports(t.qtype):
        return dequantize(torch.from_numpy(t.data[e]), t.qtype, t.cols).double().numpy()
    return gguf.quants.dequantize(t.data[e], t.qtype).astype(np.float64)


def rounded_input(x: np.ndarray, qtype: Q) -> np.ndarray:
    """x rounded as llama.cpp rounds a matmul input for weights of qtype (the torch version, as the reference)."""
    round_input = rounding.input_rounding(qtype)
    return x if round_input is None else round_input(torch.from_numpy(x)).numpy()


def reference_matmul(x: np.ndarray, t: ExpertBytes, experts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float64 y[i] = W_{experts[i]} round(x[i]) (+ bias), and sum_j |W_ij round(x)_j| (the scale of its rounding)."""
    xr = rounded_input(x, t.qtype).astype(np.float64)
    ys, scales = [], []
    for xi, e in zip(xr, experts):
        w = dequantized(t, e)
        ys.append(w @ xi + (0.0 if t.bias is None else t.bias[e]))
        scales.append(np.abs(w) @ np.abs(xi))
    return np.array(ys), np.array(scales)


def test_rounding_kernels_equal_torch():
    """The numba roundings give the torch versions' bits, zero blocks and tied peaks included."""
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((12, 1024)) * 10.0 ** rng.integers(-6, 4, (12, 1))).astype(np.float32)
    x[0, :256] = 0.0
    x[1, 3], x[1, 9] = -5.0, 5.0  # two values of largest magnitude, opposite signs: the first one is the peak
    x[2, 40:72] = -0.0
    for fast, reference in (
        (rounding.round_q8_0, rounding._round_q8_0_torch),
        (rounding.round_q8_k, rounding._round_q8_k_torch),
    ):
        a, b = fast(torch.from_numpy(x)), reference(torch.from_numpy(x))
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_matmul_matches_float64(qtype, ggml):
    rng = np.random.default_rng(int(qtype))
    block = GGML_QUANT_SIZES[qtype][0]
    cols = 512 if block == 256 else 320
    t = expert_bytes(rng, qtype, n_experts=3, rows=48, cols=cols, bias=qtype == Q.MXFP4)
    x = rng.standard_normal((5, cols)).astype(np.float32)
    experts = np.array([2, 0, 2, 1, 0])
    y = expert_matmul(x, t, experts, ggml=ggml)
    ref, scale = reference_matmul(x, t, experts)
    # float32 roundings: per block a product and a scaling (exact integer sums inside), then a running sum over
    # the blocks (integer types) or 8 running sums over cols/8 values (float types); plus one rounding of the
    # reference's float32 weights (a K-quant's min). Each is at most 2^-24 of the sum of |products|.
    n_sums = cols // block if block > 1 else cols // 8
    assert np.abs(ref).max() > 0
    assert np.all(np.abs(y - ref) <= (n_sums + 6) * EPS32 * scale[:, None] + 1e-30)


def test_matmul_f32_is_not_rounded(ggml):
    """F32 weights take the input as it is; Q8_0 rounds it (the reference tells the two apart)."""
    rng = np.random.default_rng(3)
    t = expert_bytes(rng, Q.F32, 1, 4, 64)
    x = rng.standard_normal((1, 64)).astype(np.float32)
    exact = dequantized(t, 0) @ x[0].astype(np.float64)
    np.testing.assert_allclose(expert_matmul(x, t, np.zeros(1), ggml=ggml)[0], exact, rtol=1e-5)


def _moe_reference(x, ids, weights, gate, up, down, act) -> np.ndarray:
    out = np.zeros(x.shape, np.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = ids[t, k]
            if e < 0:
                continue
            g, _ = reference_matmul(x[t : t + 1], gate, [e])
            u, _ = reference_matmul(x[t : t + 1], up, [e])
            h = act(torch.from_numpy(g), torch.from_numpy(u)).float().numpy()
            y, _ = reference_matmul(h, down, [e])
            out[t] += weights[t, k] * y[0]
    return out


# The torch activation each of moe_rows' is checked against, and the limits moe_rows is given (about the size of g
# and u below, so that the clamps and situ's saturations bite).
LIMIT, UP_LIMIT = 0.3, 0.2
ACT = {
    "swiglu": moerun.layers.swiglu,
    "swiglu_oai": moerun.layers.swiglu_oai,
    "swiglu_clamp": partial(swiglu_clamp, limit=LIMIT),
    "geglu": moerun.layers.geglu,
    "relu_sqr": moerun.layers.ffn.relu_sqr,
    "reglu": moerun.layers.reglu,
    "swiglu_limited": partial(swiglu_limited, limit=LIMIT),
    "situ": partial(situ, beta=LIMIT, up_beta=UP_LIMIT),
}
CLAMPED = {"swiglu_clamp": swiglu_clamp, "swiglu_limited": swiglu_limited}  # the activations that read a limit


def test_activations_equal_torch():
    """Each numba activation against its torch version on values across the clamps (the exps may round apart)."""
    g = torch.linspace(-12, 12, 4001, dtype=torch.float32)
    u = torch.flip(g, [0]) * 0.7
    for name, act in work.ACTIVATIONS.items():
        limit = 1.5 if name in CLAMPED or name == "situ" else 0.0
        up_limit = 1.2 if name == "situ" else 0.0  # situ's saturation of up
        torch_act = partial(CLAMPED[name], limit=limit) if name in CLAMPED else ACT[name]
        if name == "situ":
            torch_act = partial(situ, beta=limit, up_beta=up_limit)
        fast = np.array(
            [
                act(np.float32(a), np.float32(b), np.float32(limit), np.float32(up_limit))
                for a, b in zip(g.numpy(), u.numpy())
            ]
        )
        np.testing.assert_allclose(fast, torch_act(g, u).numpy(), rtol=4e-6, atol=1e-30, err_msg=name)


@pytest.mark.parametrize(
    "qtype,activation",
    [
        (Q.Q4_K, "swiglu"),
        (Q.Q8_0, "swiglu"),
        (Q.MXFP4, "swiglu_oai"),
        (Q.Q4_K, "swiglu_clamp"),
        (Q.Q4_K, "geglu"),
        (Q.Q8_0, "relu_sqr"),
        (Q.Q4_K, "reglu"),
        (Q.Q4_K, "swiglu_limited"),
        (Q.Q4_K, "situ"),
    ],
    ids=lambda v: getattr(v, "name", v),
)
@pytest.mark.parametrize("T", [1, 5])
def test_moe_rows_matches_float64(qtype, activation, T, ggml):
    """Repeated experts within a token and ids < 0 included; out is added to, not overwritten."""
    rng = np.random.default_rng(T)
    D, I, E, K = 256, 512, 6, 4
    bias = activation == "swiglu_oai"  # gpt-oss has expert biases
    gate, up = (expert_bytes(rng, qtype, E, I, D, bias) for _ in range(2))
    down = expert_bytes(rng, qtype, E, D, I, bias)
    x = rng.standard_normal((T, D)).astype(np.float32)
    ids = rng.integers(0, E, (T, K))
    ids[0, 1] = ids[0, 0]  # the same expert twice
    ids[-1, 2] = -1  # no expert in this slot
    weights = rng.random((T, K)).astype(np.float32)
    start = rng.standard_normal((T, D)).astype(np.float32)
    out = start.copy()
    moe_rows(x, ids, weights, gate, up, down, activation, out, limit=LIMIT, up_limit=UP_LIMIT, ggml=ggml)
    ref = start + _moe_reference(x, ids, weights, gate, up, down, ACT[activation])
    # g and u carry float32 roundings (about 1e-6 relative, test_matmul_matches_float64); h's 8-bit rounding can
    # then land one step (1/127 of its block's peak) the other way on a few of the I values, each moving the
    # output by about 1e-3 of its peak. A wrong expert, weight, bias or skipped slot moves it by O(1).
    assert np.abs(out - ref).max() <= 3e-3 * np.abs(ref - start).max()


def test_moe_rows_skipped_slot_equals_absent_slot(ggml):
    """An id < 0 contributes nothing: the same bits as leaving the slot out."""
    rng = np.random.default_rng(5)
    gate, up, down = (expert_bytes(rng, Q.Q4_K, 4, r, c) for r, c in ((256, 256), (256, 256), (256, 256)))
    x = rng.standard_normal((3, 256)).astype(np.float32)
    ids = np.array([[0, -1, 3], [2, 2, -1], [-1, -1, -1]])
    weights = rng.random((3, 3)).astype(np.float32)
    with_gaps = np.zeros((3, 256), np.float32)
    moe_rows(x, ids, weights, gate, up, down, "swiglu", with_gaps, ggml=ggml)
    for t, keep in enumerate(ids >= 0):
        alone = np.zeros((1, 256), np.float32)
        moe_rows(
            x[t : t + 1], ids[t : t + 1, keep], weights[t : t + 1, keep], gate, up, down, "swiglu", alone, ggml=ggml
        )
        assert np.array_equal(alone[0], with_gaps[t])
    assert not with_gaps[2].any()


def test_moe_rows_rejects_an_expert_past_the_stack(ggml):
    rng = np.random.default_rng(8)
    gate, up, down = (expert_bytes(rng, Q.Q8_0, 2, 64, 64) for _ in range(3))
    out = np.zeros((1, 64), np.float32)
    with pytest.raises(ValueError, match="out of range"):
        moe_rows(
            np.ones((1, 64), np.float32),
            np.array([[0, 2]]),
            np.ones((1, 2), np.float32),
            gate,
            up,
            down,
            "swiglu",
            out,
            ggml=ggml,
        )
    assert not out.any()


def test_threads_do_not_change_the_bits(ggml):
    """Every output element is computed by one task with the same operations, whatever the split."""
    threads = numba.config.NUMBA_NUM_THREADS
    assert threads > 1, "needs a machine with 2 or more cores"
    rng = np.random.default_rng(6)
    gate, up = (expert_bytes(rng, Q.Q4_K, 8, 512, 256) for _ in range(2))
    down = expert_bytes(rng, Q.Q4_0, 8, 256, 512)
    x = rng.standard_normal((7, 256)).astype(np.float32)
    ids = rng.integers(0, 8, (7, 3))
    weights = rng.random((7, 3)).astype(np.float32)
    outs = []
    for n in (1, threads):
        out = np.zeros((7, 256), np.float32)
        moe_rows(x, ids, weights, gate, up, down, "swiglu", out, threads=n, ggml=ggml)
        outs.append(out)
    assert np.array_equal(outs[0], outs[1])


def test_a_token_does_not_depend_on_the_others(ggml):
    """A token's bits are the same alone (few pairs: h rounded once before the down loop, one thread rounds and
    combines) and among 11 others (many pairs: each down item rounds its pairs' h; tokens rounded and combined in
    parallel), at any thread count."""
    rng = np.random.default_rng(9)
    gate, up = (expert_bytes(rng, Q.Q4_K, 6, 512, 256) for _ in range(2))
    down = expert_bytes(rng, Q.Q8_0, 6, 256, 512)
    x = rng.standard_normal((12, 256)).astype(np.float32)
    ids = rng.integers(-1, 6, (12, 4))
    weights = rng.random((12, 4)).astype(np.float32)
    for n in (1, numba.config.NUMBA_NUM_THREADS):
        together = np.zeros((12, 256), np.float32)
        moe_rows(x, ids, weights, gate, up, down, "swiglu", together, threads=n, ggml=ggml)
        for t in range(12):
            alone = np.zeros((1, 256), np.float32)
            moe_rows(
                x[t : t + 1], ids[t : t + 1], weights[t : t + 1], gate, up, down, "swiglu", alone, threads=n, ggml=ggml
            )
            assert np.array_equal(alone[0], together[t])


def test_moe_rows_releases_the_gil(ggml):
    """A Python thread keeps running while moe_rows computes."""
    rng = np.random.default_rng(7)
    gate, up = (expert_bytes(rng, Q.Q8_0, 4, 1024, 1024) for _ in range(2))
    down = expert_bytes(rng, Q.Q8_0, 4, 1024, 1024)
    x = rng.standard_normal((64, 1024)).astype(np.float32)
    ids = rng.integers(0, 4, (64, 4))
    weights = np.ones((64, 4), np.float32)
    out = np.zeros((64, 1024), np.float32)
    moe_rows(x[:1], ids[:1], weights[:1], gate, up, down, "swiglu", out[:1], ggml=ggml)  # compiled before timing
    done = threading.Event()

    def work():
        for _ in range(3):
            moe_rows(x, ids, weights, gate, up, down, "swiglu", out, threads=1, ggml=ggml)
        done.set()

    worker = threading.Thread(target=work)
    start = time.perf_counter()
    worker.start()
    count = 0
    while not done.is_set():
        count += 1
    worker.join()
    elapsed = time.perf_counter() - start
    # Holding the GIL, moe_rows would leave this loop only the moments between its kernel calls.
    assert elapsed > 0.05 and count > 2000 * elapsed, (count, elapsed)


def test_model_on_cpu_uses_cpu_experts(synth_model, ggml):
    """A quantized model on the CPU computes its experts with CPUExperts, which agree with the reference path on the
    same routing; with activation hooks registered, the reference path runs and reports each expert's inputs."""
    from moerun.layers import GGUFExperts
    from moerun.layers.gguf_cpu import CPUExperts

    model = moerun.load_model(
        synth_model("qwen3moe", expert_type="Q8_0", attn_type="Q8_0"), options=RuntimeOptions(ggml_cpu=ggml is not None)
    )
    moe = [b.ffn for b in model.net.blocks if hasattr(b.ffn, "experts")]
    assert moe and all(isinstance(m.experts, CPUExperts) for m in moe)
    x = torch.randn(6, model.args.dim, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ids, weights = moe[0].router(x)
        fast, reference = moe[0].experts(x, ids, weights), GGUFExperts.forward(moe[0].experts, x, ids, weights)
    # the same bar as test_moe_rows_matches_float64: float32 sums, and an 8-bit rounding of h that may land a step
    # the other way
    assert (fast - reference).abs().max() <= 3e-3 * reference.abs().max()
    seen = []
    handle = model.add_activation_hook(lambda ev: seen.append(ev.tensor_name))
    model.forward(torch.tensor(model.tokenizer.encode("the experts of a token")))
    handle.remove()
    assert any("ffn_down_exps" in name for name in seen)


def test_glm5_next_on_cpu_uses_the_clamped_kernel(synth_model, ggml):
    """glm5-next's routed experts on the CPU are CPUExperts running moe_rows' swiglu_clamp at the GGUF's limit; they
    agree with the reference path (torch's clamped SwiGLU) on the same routing, on inputs large enough to clamp."""
    from moerun.layers import GGUFExperts
    from moerun.layers.gguf_cpu import CPUExperts
    from moerun.models.glm5_next import Glm5NextArgs

    model = moerun.load_model(
        synth_model("glm5-next", expert_type="Q8_0", attn_type="Q8_0"),
        options=RuntimeOptions(ggml_cpu=ggml is not None),
    )
    limits = Glm5NextArgs.from_gguf(model.gguf).clamp_exp
    moe = [(i, b.ffn) for i, b in enumerate(model.net.blocks) if hasattr(b.ffn, "experts")]
    assert moe and all(
        isinstance(m.experts, CPUExperts)
        and m.experts.activation.name == "swiglu_clamp"
        and m.experts.activation.limit == limits[i]
        for i, m in moe
    )
    experts = moe[0][1].experts
    x = 8 * torch.randn(6, model.args.dim, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ids, weights = moe[0][1].router(x)
        fast, reference = experts(x, ids, weights), GGUFExperts.forward(experts, x, ids, weights)
        g = experts._matmul_k(experts.gate, x[:1], ids[0], None)
    assert g.abs().max() > limits[moe[0][0]]  # the clamp bites on these inputs
    assert (fast - reference).abs().max() <= 3e-3 * reference.abs().max()


@pytest.mark.parametrize("qtype", ["Q4_K", "Q8_0", "Q6_K", "F16", "BF16"])
def test_cpu_linear_multiplies_the_gguf_blocks(synth_model, qtype, ggml):
    """A quantized (or half-precision, on ggml) Linear on the CPU multiplies the GGUF bytes: on ggml's row dots for
    any number of tokens, with no float32 copy held; on the numba kernels for a decode step's few tokens, a prompt's
    many through its float32 copy (half precision without ggml: the float32 copy alone). Either way the product of the rounded input and the weight values, up to float32
    summation order, a token at a time or many at once."""
    from moerun.layers.gguf_cpu import QUANT_MAX_TOKENS, CPUQuantLinear

    model = moerun.load_model(
        synth_model("qwen3moe", preset="small", expert_type=qtype, attn_type=qtype),
        options=RuntimeOptions(ggml_cpu=ggml is not None),
    )
    attn = model.net.blocks[0].attn.attn
    if ggml is None and qtype in ("F16", "BF16"):  # no numba half kernel (torch's float32 product beats it)
        assert not any(isinstance(linear, CPUQuantLinear) for linear in (attn.wq, attn.wk, attn.wv, attn.wo))
        return
    assert all(isinstance(linear, CPUQuantLinear) for linear in (attn.wq, attn.wk, attn.wv, attn.wo))
    assert (attn.wq.weight is None) == (ggml is not None)
    x = torch.randn(QUANT_MAX_TOKENS + 1, attn.wq.host.cols, generator=torch.Generator().manual_seed(0))
    few = torch.cat([attn.wq(x[i : i + 1]) for i in range(len(x))])  # a token at a time: the integer kernels
    many = attn.wq(x)  # numba: past QUANT_MAX_TOKENS, the float32 copy
    weight = torch.from_numpy(dequantized(attn.wq.host, 0)).double()
    reference = (attn.wq.round_input(x).double() @ weight.T).float()
    assert many.abs().max() > 0.1
    for y in (few, many):
        torch.testing.assert_close(y, reference, rtol=1e-4, atol=1e-4 * float(reference.abs().max()))
