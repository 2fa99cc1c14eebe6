"""The layers the newer architectures brought, against float64 references written here from the algorithm: the
gated delta net (layers/delta_net.py, over layers/delta_rule.py: a prompt prefilled in chunks, then decoded token by
token from the state it left, two sequences side by side, a sequence started anew), gated attention
(layers/gated_attention.py), Llama 4's chunked and temperature-scaled attentions (models/llama4.py), Gemma's GEGLU
(layers/ffn.py), logit soft-capping (layers/softcap.py), Gemma 4's attention (models/gemma4.py), the output-gated
attention of AFMoE (with and without RoPE), step35 (gated per head, half of each head rotated with divisors) and
Laguna (softplus gates) (layers/attention.py, layers/rope.py), RoPE with and without the model's context scaling
(layers/rope.py: Laguna's sliding layers), the post-normed block (layers/block.py), ReGLU and step35's clamped SwiGLU
(layers/ffn.py), LFM2's gated short convolution (layers/short_conv.py), Kimi-K3's situ activation (layers/ffn.py),
latent MoE (layers/moe.py) and cross-layer residual mix (models/kimi_k3.py), the hyper-connections of GLM-5.3-Flash
and DeepSeek-V4 (layers/hyper_connections.py), and DeepSeek-V4's compressed keys and tail rotation
(layers/kv_compression.py), sqrt-softplus scores and hash routing (layers/moe.py)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from moerun.hooks import Hooks
from moerun.kv_cache import KVCache
from moerun.layers import TORCH_KERNELS, Linear, RMSNorm, Rope
from moerun.layers.delta_net import GatedDeltaNet
from moerun.layers.delta_rule import delta_rule_chunked, delta_rule_recurrent
from moerun.layers.gated_attention import GatedAttention
from moerun.step import Step

D, HK, HV, DK, DV, K, EPS = 24, 2, 4, 8, 6, 4, 1e-6


def linear(gen: torch.Generator, rows: int, cols: int) -> Linear:
    return Linear(torch.randn(rows, cols, generator=gen) / math.sqrt(cols), None, "w", Hooks())


def delta_net_f64(x: np.ndarray, w: dict[str, np.ndarray], grouped: bool = False) -> np.ndarray:
    """The layer from position 0 in float64, token by token, with the state as a plain (Hv, Dk, Dv) array; value
    head h reads key head h mod Hk, or h // (Hv / Hk) when `grouped`."""
    T = len(x)
    qkv, z, b, a = (x @ w[name].T for name in ("qkv", "z", "b", "a"))
    rows = np.concatenate([np.zeros((K - 1, qkv.shape[1])), qkv])
    conv = np.stack([(rows[t : t + K] * w["conv"].T).sum(0) for t in range(T)])
    mixed = conv / (1 + np.exp(-conv))
    S, out = np.zeros((HV, DK, DV)), np.zeros((T, HV, DV))
    for t in range(T):
        q = mixed[t, : HK * DK].reshape(HK, DK)
        k = mixed[t, HK * DK : 2 * HK * DK].reshape(HK, DK)
        v = mixed[t, 2 * HK * DK :].reshape(HV, DV)
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + EPS) / math.sqrt(DK)
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + EPS)
        decay = np.exp(np.log1p(np.exp(a[t] + w["dt"])) * w["A"])  # (Hv,)
        beta = 1 / (1 + np.exp(-b[t]))
        for h in range(HV):
            kh, qh = (k[h // (HV // HK)], q[h // (HV // HK)]) if grouped else (k[h % HK], q[h % HK])
            S[h] *= decay[h]
            S[h] += np.outer(kh, beta[h] * (v[h] - S[h].T @ kh))
            out[t, h] = S[h].T @ qh
    normed = out / np.sqrt((out * out).mean(-1, keepdims=True) + EPS) * w["norm"]
    gated = normed * (z / (1 + np.exp(-z))).reshape(T, HV, DV)
    return gated.reshape(T, HV * DV) @ w["out"].T


class Projections(torch.nn.Module):
    def __init__(self, *linears: Linear) -> None:
        super().__init__()
        self.linears = torch.nn.ModuleList(linears)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(lin(x) for lin in self.linears)


def make_delta_net(seed: int, n_seq: int = 1, grouped: bool = False) -> tuple[GatedDeltaNet, dict[str, np.ndarray]]:
    gen = torch.Generator().manual_seed(seed)
    C = 2 * HK * DK + HV * DV
    proj = [linear(gen, C, D), linear(gen, HV * DV, D), linear(gen, HV, D), linear(gen, HV, D)]
    conv = torch.randn(C, K, generator=gen) / math.sqrt(K)
    dt, A = torch.randn(HV, generator=gen), -torch.exp(0.3 * torch.randn(HV, generator=gen))
    norm_w = 1 + 0.1 * torch.randn(DV, generator=gen)
    out = linear(gen, D, HV * DV)
    layer = GatedDeltaNet(
        project=Projections(*proj),
        conv=conv,
        dt_bias=dt,
        A=A,
        norm=RMSNorm(norm_w, EPS, TORCH_KERNELS),
        out=out,
        n_k_heads=HK,
        n_v_heads=HV,
        k_dim=DK,
        v_dim=DV,
        eps=EPS,
        n_seq=n_seq,
        grouped_heads=grouped,
    )
    weights = {name: lin.weight.double().numpy() for name, lin in zip(("qkv", "z", "b", "a"), proj)}
    weights |= {
        "conv": conv.double().numpy(),
        "dt": dt.double().numpy(),
        "A": A.double().numpy(),
        "norm": norm_w.double().numpy(),
        "out": out.weight.double().numpy(),
    }
    return layer, weights


@pytest.mark.parametrize("grouped", [False, True], ids=["tiled", "grouped"])
@pytest.mark.parametrize("n", [5, 64, 150])
def test_delta_net_prefill_then_decode_equals_float64(n: int, grouped: bool) -> None:
    layer, w = make_delta_net(n, grouped=grouped)
    x = torch.randn(n + 3, D, generator=torch.Generator().manual_seed(100 + n))
    want = delta_net_f64(x.double().numpy(), w, grouped)
    got = [layer(x[:n], Step(torch.arange(n), n_slots=n))]  # one prefill, in chunks past 64 tokens
    got += [
        layer(x[t : t + 1], Step(torch.tensor([t]), n_slots=t + 1)) for t in range(n, n + 3)
    ]  # then decode from its state
    got = torch.cat(got).double().numpy()
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    # position 0 starts anew: the same prompt again gives the same outputs, whatever the state held
    again = layer(x[:n], Step(torch.arange(n), n_slots=n)).double().numpy()
    assert np.abs(again - want[:n]).max() <= 1e-5 * np.abs(want).max()


def test_delta_net_sequences_keep_their_own_state() -> None:
    layer, w = make_delta_net(7, n_seq=2)
    gen = torch.Generator().manual_seed(8)
    a, b = torch.randn(10, D, generator=gen), torch.randn(12, D, generator=gen)
    want_a, want_b = delta_net_f64(a.double().numpy(), w), delta_net_f64(b.double().numpy(), w)
    layer(b[:11], Step(torch.arange(11), n_slots=11, seq=1))
    layer(a[:9], Step(torch.arange(9), n_slots=9, seq=0))
    both = layer(torch.stack([a[9], b[11]]), Step(torch.tensor([9, 11]), n_slots=12, seqs=torch.tensor([0, 1])))
    scale = max(np.abs(want_a).max(), np.abs(want_b).max())
    assert np.abs(both[0].double().numpy() - want_a[9]).max() <= 1e-5 * scale
    assert np.abs(both[1].double().numpy() - want_b[11]).max() <= 1e-5 * scale


@pytest.mark.parametrize("n", [3, 64, 130])
def test_delta_rule_with_one_decay_per_head_and_unequal_sizes(n: int) -> None:
    """The gated delta net's use of the shared rule: the decay the same on every key channel, Dk != Dv."""
    gen = torch.Generator().manual_seed(n)
    H = 3
    q, k = (F.normalize(torch.randn(n, H, DK, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(n, H, DV, generator=gen)
    g = (-torch.exp(torch.randn(n, H, 1, generator=gen))).expand(n, H, DK)
    beta, S = torch.rand(n, H, generator=gen), torch.randn(H, DK, DV, generator=gen)
    S_ref, want = S.double().numpy().copy(), np.zeros((n, H, DV))
    qn, kn, vn, gn, bn = (t.double().numpy() for t in (q, k, v, g, beta))
    for t in range(n):
        for h in range(H):
            S_ref[h] *= np.exp(gn[t, h, 0])
            S_ref[h] += np.outer(kn[t, h], bn[t, h] * (vn[t, h] - S_ref[h].T @ kn[t, h]))
            want[t, h] = S_ref[h].T @ qn[t, h]
    for rule in (delta_rule_recurrent, delta_rule_chunked):
        out, state = rule(q, k, v, g, beta, S)
        assert np.abs(out.double().numpy() - want).max() <= 1e-5 * np.abs(want).max(), rule.__name__
        assert np.abs(state.double().numpy() - S_ref).max() <= 1e-5 * np.abs(S_ref).max(), rule.__name__


def test_gated_attention_equals_float64() -> None:
    """Per head: query and gate rows from one projection, per-head Q/K RMSNorm, NeoX RoPE on part of each head,
    causal softmax attention over grouped KV heads, output times sigmoid(gate), then the output projection."""
    gen = torch.Generator().manual_seed(3)
    T, H, G, Dh, R = 9, 4, 2, 8, 4
    wq, wk, wv, wo = linear(gen, 2 * H * Dh, D), linear(gen, G * Dh, D), linear(gen, G * Dh, D), linear(gen, D, H * Dh)
    qn, kn = 1 + 0.1 * torch.randn(Dh, generator=gen), 1 + 0.1 * torch.randn(Dh, generator=gen)
    # the fields of ModelArgs that a plain (unscaled) Rope reads
    args = SimpleNamespace(
        rope_dim=R, rope_base=10000.0, rope_style="neox", rope_scaling="none", rope_freq_scale=1.0, rope_attn_factor=1.0
    )
    rope = Rope(args, 64, torch.device("cpu"))
    layer = GatedAttention(
        wq=wq,
        wk=wk,
        wv=wv,
        wo=wo,
        q_norm=RMSNorm(qn, EPS, TORCH_KERNELS),
        k_norm=RMSNorm(kn, EPS, TORCH_KERNELS),
        rope=rope,
        cache=KVCache(64, G, Dh, Dh, torch.float32, torch.device("cpu")),
        n_heads=H,
        n_kv_heads=G,
        head_dim=Dh,
        scale=Dh**-0.5,
        kernels=TORCH_KERNELS,
    )
    x = torch.randn(T, D, generator=gen)
    got = layer(x, Step(torch.arange(T), n_slots=64)).double().numpy()

    xd = x.double().numpy()
    qg = (xd @ wq.weight.double().numpy().T).reshape(T, H, 2, Dh)
    q, gate = qg[:, :, 0], qg[:, :, 1].reshape(T, H * Dh)
    k = (xd @ wk.weight.double().numpy().T).reshape(T, G, Dh)
    v = (xd @ wv.weight.double().numpy().T).reshape(T, G, Dh)
    rms = lambda t, w: t / np.sqrt((t * t).mean(-1, keepdims=True) + EPS) * w.double().numpy()  # noqa: E731

    def rotate(t: np.ndarray) -> np.ndarray:
        out, half = t.copy(), R // 2
        freq = 10000.0 ** (-np.arange(half) * 2 / R)
        ang = np.arange(T)[:, None, None] * freq
        a, b = t[..., :half], t[..., half:R]
        out[..., :half], out[..., half:R] = a * np.cos(ang) - b * np.sin(ang), a * np.sin(ang) + b * np.cos(ang)
        return out

    q, k = rotate(rms(q, qn)), rotate(rms(k, kn))
    out = np.zeros((T, H, Dh))
    for h in range(H):
        s = q[:, h] @ k[:, h // (H // G)].T * Dh**-0.5
        s[np.triu_indices(T, 1)] = -np.inf
        p = np.exp(s - s.max(-1, keepdims=True))
        out[:, h] = (p / p.sum(-1, keepdims=True)) @ v[:, h // (H // G)]
    want = (out.reshape(T, H * Dh) / (1 + np.exp(-gate))) @ wo.weight.double().numpy().T
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("rope", [True, False], ids=["chunked", "temperature"])
def test_llama4_attention_equals_float64(rope: bool) -> None:
    """Llama 4's two attentions past position 8192, where they differ from plain attention: RoPE'd layers see only
    their own chunk of 8192 positions and RMS-normalise Q and K; RoPE-less ones see everything with the query scaled
    by log(floor((p + 1) / 8192) + 1) / 10 + 1."""
    from moerun.models.llama4 import CHUNK, Llama4Attention

    gen = torch.Generator().manual_seed(5)
    T, H, G, Dh, start = 12, 4, 2, 8, CHUNK - 6  # the step crosses the chunk boundary at its 7th token
    wq, wk, wv, wo = linear(gen, H * Dh, D), linear(gen, G * Dh, D), linear(gen, G * Dh, D), linear(gen, D, H * Dh)
    args = SimpleNamespace(
        rope_dim=Dh,
        rope_base=10000.0,
        rope_style="normal",
        rope_scaling="none",
        rope_freq_scale=1.0,
        rope_attn_factor=1.0,
    )
    n_ctx = start + T
    layer = Llama4Attention(
        wq=wq,
        wk=wk,
        wv=wv,
        wo=wo,
        rope=Rope(args, n_ctx, torch.device("cpu")) if rope else None,
        qk_norm=True,
        chunk=CHUNK if rope else 0,
        cache=KVCache(n_ctx, G, Dh, Dh, torch.float32, torch.device("cpu")),
        n_heads=H,
        n_kv_heads=G,
        head_dim=Dh,
        eps=EPS,
        kernels=TORCH_KERNELS,
    )
    x = torch.randn(start + T, D, generator=gen)
    layer(x[:start], Step(torch.arange(start), n_slots=start))
    got = layer(x[start:], Step(torch.arange(start, start + T), n_slots=start + T)).double().numpy()

    xd, pos = x.double().numpy(), np.arange(start + T)
    q = (xd @ wq.weight.double().numpy().T).reshape(-1, H, Dh)[start:]
    k = (xd @ wk.weight.double().numpy().T).reshape(-1, G, Dh)
    v = (xd @ wv.weight.double().numpy().T).reshape(-1, G, Dh)
    if rope:

        def rotate(t: np.ndarray, p: np.ndarray) -> np.ndarray:  # adjacent pairs
            ang = p[:, None, None] * 10000.0 ** (-np.arange(Dh // 2) * 2 / Dh)
            a, b = t[..., 0::2], t[..., 1::2]
            return np.stack([a * np.cos(ang) - b * np.sin(ang), a * np.sin(ang) + b * np.cos(ang)], -1).reshape(t.shape)

        unit = lambda t: t / np.sqrt((t * t).mean(-1, keepdims=True) + EPS)  # noqa: E731
        q, k = unit(rotate(q, pos[start:])), unit(rotate(k, pos))
    else:
        q = q * (np.log(np.floor((pos[start:] + 1.0) / CHUNK) + 1) * 0.1 + 1)[:, None, None]
    out = np.zeros((T, H, Dh))
    for t in range(T):
        p = start + t
        first = p // CHUNK * CHUNK if rope else 0
        for h in range(H):
            kk, vv = k[first : p + 1, h // (H // G)], v[first : p + 1, h // (H // G)]
            s = kk @ q[t, h] / math.sqrt(Dh)
            e = np.exp(s - s.max())
            out[t, h] = e @ vv / e.sum()
    want = out.reshape(T, H * Dh) @ wo.weight.double().numpy().T
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def gelu_tanh_f64(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * x * (1 + 0.044715 * x * x)))


def test_geglu_equals_float64_within_its_float16_table() -> None:
    """Gemma's GEGLU as llama.cpp's CPU backend computes it: GELU (tanh form) read from a float16 table, so within
    two float16 roundings (input and entry, 2^-11 relative each) of float64; the gate itself above 10, 0 below -10."""
    from moerun.layers.ffn import geglu

    g = torch.cat([torch.linspace(-12, 12, 4801), torch.linspace(-1e-4, 1e-4, 101)]).float()
    u = torch.linspace(-2, 3, len(g)).float()
    got = geglu(g, u).double().numpy()
    gd, ud = g.double().numpy(), u.double().numpy()
    want = np.where(gd >= 10, gd, np.where(gd <= -10, 0.0, gelu_tanh_f64(gd))) * ud
    # input rounding moves GELU by at most 1.13 |g| 2^-11 (its slope stays under 1.13), the entry's by |GELU| 2^-11;
    # below 2^-14 float16 is subnormal, its steps 2^-24 apart, half a step each rounding
    rel = (1.13 * np.abs(gd) + np.abs(gelu_tanh_f64(gd))) * 2.0**-11
    bound = (rel + 2.0**-24 * 1.13) * np.abs(ud)
    assert (np.abs(got - want) <= bound).all()
    table = (np.abs(gd) < 10) & (np.abs(gd) > 1e-3)
    assert (np.abs(got - want)[table] > 1e-7 * np.abs(want)[table]).any()  # the table's roundings are there
    plain = (g * u).double().numpy()  # the gate itself times up, in float32
    assert np.array_equal(got[gd >= 10], plain[gd >= 10]) and (got[gd <= -10] == 0).all()


def test_softcap_equals_float64() -> None:
    from moerun.layers.softcap import SoftCappedHead, softcap

    gen = torch.Generator().manual_seed(3)
    head = linear(gen, 50, D)
    x = torch.randn(7, D, generator=gen) * 20
    got = SoftCappedHead(head, 5.0)(x).double().numpy()
    logits = x.double().numpy() @ head.weight.double().numpy().T
    want = 5.0 * np.tanh(logits / 5.0)
    assert np.abs(got - want).max() <= 1e-5 * 5.0
    assert np.abs(got).max() <= 5.0 and np.abs(logits).max() > 10  # the cap bites
    assert torch.equal(softcap(torch.tensor([0.0]), 5.0), torch.tensor([0.0]))


def test_gemma4_attention_equals_float64() -> None:
    """Gemma 4's attention on a full layer whose values are its keys' projection (no attn_v) and on a sliding one:
    Q and K RMS-normalised per head with weights, V without one; NeoX RoPE turning only the pairs whose rope_freqs
    divisor is 1 (the others 1e30); unscaled scores; the window on the sliding layer. A prompt, then a decode step."""
    from moerun.layers import Attention

    gen = torch.Generator().manual_seed(11)
    T, H, G, Dh, window, rotated = 20, 4, 2, 8, 6, 1  # one of Dh/2 = 4 pairs turns
    args = SimpleNamespace(
        rope_dim=Dh,
        rope_base=10000.0,
        rope_style="neox",
        rope_scaling="none",
        rope_freq_scale=1.0,
        rope_attn_factor=1.0,
    )
    factors = torch.tensor([1.0] * rotated + [1e30] * (Dh // 2 - rotated))
    for sliding in (False, True):
        wq, wk, wo = linear(gen, H * Dh, D), linear(gen, G * Dh, D), linear(gen, D, H * Dh)
        wv = linear(gen, G * Dh, D) if sliding else wk
        qn, kn = (1 + 0.2 * torch.randn(Dh, generator=gen) for _ in range(2))
        layer = Attention(
            wq=wq,
            wk=wk,
            wv=wv,
            wo=wo,
            rope=Rope(args, T, torch.device("cpu"), freq_factors=factors),
            cache=KVCache(T, G, Dh, Dh, torch.float32, torch.device("cpu")),
            n_heads=H,
            n_kv_heads=G,
            head_dim=Dh,
            v_head_dim=Dh,
            scale=1.0,
            q_norm=RMSNorm(qn, EPS, TORCH_KERNELS),
            k_norm=RMSNorm(kn, EPS, TORCH_KERNELS),
            window=window if sliding else 0,
            v_norm_eps=EPS,
            kernels=TORCH_KERNELS,
        )
        x = torch.randn(T, D, generator=gen)
        got = torch.cat(
            [
                layer(x[:-1], Step(torch.arange(T - 1), n_slots=T - 1)),
                layer(x[-1:], Step(torch.tensor([T - 1]), n_slots=T)),
            ]
        )
        xd, pos = x.double().numpy(), np.arange(T)
        unit = lambda t: t / np.sqrt((t * t).mean(-1, keepdims=True) + EPS)  # noqa: E731
        q = unit((xd @ wq.weight.double().numpy().T).reshape(T, H, Dh)) * qn.double().numpy()
        k_raw = (xd @ wk.weight.double().numpy().T).reshape(T, G, Dh)
        k = unit(k_raw) * kn.double().numpy()
        v = unit((xd @ wv.weight.double().numpy().T).reshape(T, G, Dh))

        def rotate(t: np.ndarray) -> np.ndarray:  # NeoX halves; pairs past `rotated` stand still
            ang = pos[:, None, None] * 10000.0 ** (-np.arange(Dh // 2) * 2 / Dh) * (np.arange(Dh // 2) < rotated)
            a, b = t[..., : Dh // 2], t[..., Dh // 2 :]
            return np.concatenate([a * np.cos(ang) - b * np.sin(ang), a * np.sin(ang) + b * np.cos(ang)], -1)

        q, k = rotate(q), rotate(k)
        out = np.zeros((T, H, Dh))
        for t in range(T):
            first = max(0, t - window + 1) if sliding else 0
            for h in range(H):
                s = k[first : t + 1, h // (H // G)] @ q[t, h]
                e = np.exp(s - s.max())
                out[t, h] = e @ v[first : t + 1, h // (H // G)] / e.sum()
        want = out.reshape(T, H * Dh) @ wo.weight.double().numpy().T
        assert np.abs(got.double().numpy() - want).max() <= 1e-5 * np.abs(want).max(), f"sliding={sliding}"


# (gate function, per-head gate, rotated channels as a share of the head (0: a NoPE layer), RoPE divisors): AFMoE's
# layers with and without RoPE, a step35 full-attention layer (half of each head rotated, a divisor table twice as
# long as it reads, as the one step35 tensor serves wider rotations too), Laguna M.1's and XS.2's layers.
GATED_ATTENTION_CASES = {
    "afmoe-rope": ("sigmoid", False, 1.0, False),
    "afmoe-nope": ("sigmoid", False, 0.0, False),
    "step35": ("sigmoid", True, 0.5, True),
    "laguna-m1": ("softplus", False, 1.0, False),
    "laguna-xs2": ("softplus", True, 1.0, False),
}


@pytest.mark.parametrize("case", GATED_ATTENTION_CASES)
def test_output_gated_attention_equals_float64(case: str) -> None:
    """The shared Attention with an OutputGate (layers/attention.py), as AFMoE, step35 and Laguna build it: per-head
    Q/K RMSNorm, NeoX RoPE over the first channels of each head (with per-pair frequency divisors, or none), causal
    softmax over grouped KV heads within a sliding window, the output times fn(attn_gate x) channel by channel or
    head by head, then the output projection. A prompt, then a decode step."""
    from moerun.layers import Attention, OutputGate

    function, per_head, share, divided = GATED_ATTENTION_CASES[case]
    gen = torch.Generator().manual_seed(17)
    T, H, G, Dh, window = 20, 4, 2, 8, 6
    rot = int(Dh * share) or Dh
    args = SimpleNamespace(
        rope_dim=Dh,
        rope_base=10000.0,
        rope_style="neox",
        rope_scaling="none",
        rope_freq_scale=1.0,
        rope_attn_factor=1.0,
    )
    divisors = 1 + 3 * torch.rand(Dh // 2, generator=gen) if divided else None
    wq, wk, wv, wo = linear(gen, H * Dh, D), linear(gen, G * Dh, D), linear(gen, G * Dh, D), linear(gen, D, H * Dh)
    wgate = linear(gen, H if per_head else H * Dh, D)
    qn, kn = (1 + 0.2 * torch.randn(Dh, generator=gen) for _ in range(2))
    layer = Attention(
        wq=wq,
        wk=wk,
        wv=wv,
        wo=wo,
        rope=Rope(args, T, torch.device("cpu"), dim=rot, freq_factors=divisors, rotate=share > 0),
        cache=KVCache(T, G, Dh, Dh, torch.float32, torch.device("cpu")),
        n_heads=H,
        n_kv_heads=G,
        head_dim=Dh,
        v_head_dim=Dh,
        scale=Dh**-0.5,
        q_norm=RMSNorm(qn, EPS, TORCH_KERNELS),
        k_norm=RMSNorm(kn, EPS, TORCH_KERNELS),
        window=window,
        gate=OutputGate(wgate, function, per_head),
        kernels=TORCH_KERNELS,
    )
    x = torch.randn(T, D, generator=gen)
    got = torch.cat(
        [layer(x[:-1], Step(torch.arange(T - 1), n_slots=T - 1)), layer(x[-1:], Step(torch.tensor([T - 1]), n_slots=T))]
    )
    xd, pos = x.double().numpy(), np.arange(T)
    w = {name: t.weight.double().numpy() for name, t in (("q", wq), ("k", wk), ("v", wv), ("o", wo), ("g", wgate))}
    rms = lambda t, g: t / np.sqrt((t * t).mean(-1, keepdims=True) + EPS) * g.double().numpy()  # noqa: E731
    q, k = rms((xd @ w["q"].T).reshape(T, H, Dh), qn), rms((xd @ w["k"].T).reshape(T, G, Dh), kn)
    v = (xd @ w["v"].T).reshape(T, G, Dh)
    if share > 0:
        inv_freq = 10000.0 ** (-np.arange(rot // 2) * 2 / rot)
        if divided:
            inv_freq = inv_freq / divisors.double().numpy()[: rot // 2]
        ang = pos[:, None, None] * inv_freq

        def rotate(t: np.ndarray) -> np.ndarray:
            a, b, rest = t[..., : rot // 2], t[..., rot // 2 : rot], t[..., rot:]
            return np.concatenate([a * np.cos(ang) - b * np.sin(ang), a * np.sin(ang) + b * np.cos(ang), rest], -1)

        q, k = rotate(q), rotate(k)
    out = np.zeros((T, H, Dh))
    for t in range(T):
        first = max(0, t - window + 1)
        for h in range(H):
            s = k[first : t + 1, h // (H // G)] @ q[t, h] * Dh**-0.5
            e = np.exp(s - s.max())
            out[t, h] = e @ v[first : t + 1, h // (H // G)] / e.sum()
    g = xd @ w["g"].T  # (T, H) or (T, H * Dh)
    g = 1 / (1 + np.exp(-g)) if function == "sigmoid" else np.log1p(np.exp(g))
    gated = out * g[:, :, None] if per_head else out * g.reshape(T, H, Dh)
    want = gated.reshape(T, H * Dh) @ w["o"].T
    assert np.abs(got.double().numpy() - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("scaled", [True, False], ids=["yarn", "plain"])
def test_rope_with_and_without_context_scaling_equals_float64(scaled: bool) -> None:
    """A model with YaRN (factor 4): its scaled table blends interpolated and original frequencies between the
    correction dims and scales the magnitude; `scaled` False (Laguna's sliding layers) is plain RoPE over its own
    base and channel count whatever the model's scaling. NeoX halves over the first `dim` of 16 channels."""
    Dh, dim, base, T, factor, orig, fast, slow = 16, 12, 5000.0, 40, 4.0, 64, 32.0, 1.0
    args = SimpleNamespace(
        rope_dim=8,
        rope_base=500000.0,
        rope_style="neox",
        rope_scaling="yarn",
        rope_freq_scale=1 / factor,
        rope_orig_ctx=orig,
        yarn_beta_fast=fast,
        yarn_beta_slow=slow,
        yarn_log_mul=0.0,
        rope_attn_factor=1.0,
    )
    rope = Rope(args, T, torch.device("cpu"), base=base, dim=dim, scaled=scaled)
    x = torch.randn(T, 3, Dh, generator=torch.Generator().manual_seed(23))
    got = rope(x, torch.arange(T)).double().numpy()
    theta = base ** (-np.arange(0, dim, 2) / dim)  # (dim/2,)
    magnitude = 1.0
    if scaled:
        corr = lambda n: dim * math.log(orig / (n * 2 * math.pi)) / (2 * math.log(base))  # noqa: E731
        low, high = max(0.0, math.floor(corr(fast))), min(dim - 1.0, math.ceil(corr(slow)))
        keep = 1 - np.clip((np.arange(dim // 2) - low) / max(0.001, high - low), 0, 1)
        theta = theta / factor * (1 - keep) + theta * keep
        # YaRN's magnitude 1 + 0.1 ln(factor) (llama.cpp's context divides it out of its attention factor only for
        # its rope op to multiply it back)
        magnitude = 1.0 + 0.1 * math.log(factor)
    ang = np.arange(T)[:, None, None] * theta
    xd = x.double().numpy()
    a, b = xd[..., : dim // 2], xd[..., dim // 2 : dim]
    rotated = np.concatenate([a * np.cos(ang) - b * np.sin(ang), a * np.sin(ang) + b * np.cos(ang)], -1) * magnitude
    want = np.concatenate([rotated, xd[..., dim:]], -1)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_sandwich_block_equals_float64() -> None:
    """h = x + post_a(attn(norm_a(x))); out = h + post_f(ffn(norm_f(h))), with the input handed over as a pair
    (x, delta) as blocks hand it on, and the output pair summed."""
    from moerun.layers import SandwichBlock

    gen = torch.Generator().manual_seed(19)
    T = 7
    norms = [1 + 0.2 * torch.randn(D, generator=gen) for _ in range(4)]
    wa, wf = linear(gen, D, D), linear(gen, D, D)

    class Sublayer(torch.nn.Module):  # a projection and a tanh: anything that is not its input's scale
        def __init__(self, w: Linear) -> None:
            super().__init__()
            self.w = w

        def forward(self, x: torch.Tensor, step: Step, i8=None) -> torch.Tensor:
            return torch.tanh(self.w(x))

    block = SandwichBlock(
        RMSNorm(norms[0], EPS, TORCH_KERNELS),
        Sublayer(wa),
        RMSNorm(norms[1], EPS, TORCH_KERNELS),
        RMSNorm(norms[2], EPS, TORCH_KERNELS),
        Sublayer(wf),
        RMSNorm(norms[3], EPS, TORCH_KERNELS),
    )
    x, delta = torch.randn(T, D, generator=gen), torch.randn(T, D, generator=gen)
    h, f = block(x, delta, Step(torch.arange(T), n_slots=T))
    got = (h + f).double().numpy()
    rms = lambda t, g: t / np.sqrt((t * t).mean(-1, keepdims=True) + EPS) * g.double().numpy()  # noqa: E731
    xd = (x + delta).double().numpy()
    hd = xd + rms(np.tanh(rms(xd, norms[0]) @ wa.weight.double().numpy().T), norms[1])
    want = hd + rms(np.tanh(rms(hd, norms[2]) @ wf.weight.double().numpy().T), norms[3])
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_swiglu_limited_equals_float64() -> None:
    """step35's clamped SwiGLU: min(silu(gate), limit) * clamp(up, -limit, limit), across both clamps."""
    from moerun.layers.ffn import swiglu_limited

    g = torch.linspace(-6, 6, 1201, dtype=torch.float32)
    u = torch.flip(g, [0]) * 0.7 + 0.1
    gd, ud, limit = g.double().numpy(), u.double().numpy(), 1.5
    want = np.minimum(gd / (1 + np.exp(-gd)), limit) * np.clip(ud, -limit, limit)
    assert np.abs(swiglu_limited(g, u, limit).double().numpy() - want).max() <= 1e-6 * np.abs(want).max()
    assert (gd / (1 + np.exp(-gd)) > limit).any() and (np.abs(ud) > limit).any()  # both clamps bite


def test_situ_equals_float64() -> None:
    """Kimi-K3's situ: beta tanh(gate / beta) sigmoid(gate) * up_beta tanh(up / up_beta), both saturations biting;
    with up_beta 0 the up branch passes as it is."""
    from moerun.layers.ffn import situ

    g = torch.linspace(-6, 6, 1201, dtype=torch.float32)
    u = torch.flip(g, [0]) * 0.7 + 0.1
    gd, ud, beta, up_beta = g.double().numpy(), u.double().numpy(), 2.0, 1.5
    act = beta * np.tanh(gd / beta) / (1 + np.exp(-gd))
    for ub, up in ((up_beta, up_beta * np.tanh(ud / up_beta)), (0.0, ud)):
        want = act * up
        assert np.abs(situ(g, u, beta, ub).double().numpy() - want).max() <= 1e-6 * np.abs(want).max()
    assert (np.abs(gd) > 2 * beta).any() and (np.abs(ud) > 2 * up_beta).any()  # deep in both saturations


def test_residual_mix_equals_float64() -> None:
    """Kimi-K3's residual attention: softmax over sum(rms_norm(c) w) of the banked inputs and the stream, then the
    candidates summed with those weights; the stream itself while nothing is banked."""
    from moerun.models.kimi_k3 import residual_mix

    rng = np.random.default_rng(0)
    T, B, D = 5, 3, 32
    banked, h = rng.standard_normal((T, B, D)) * rng.uniform(0.5, 4, (T, B, 1)), rng.standard_normal((T, D))
    w = rng.standard_normal(D) / np.sqrt(D)
    cand = np.concatenate([banked, h[:, None]], axis=1)
    scores = (cand / np.sqrt((cand**2).mean(-1, keepdims=True) + EPS) * w).sum(-1)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = (cand * p[..., None]).sum(1)
    f = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
    got = residual_mix(f(banked), f(h), f(w), EPS).double().numpy()
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    assert (p.max(-1) < 0.9).all()  # no token takes one candidate alone
    assert torch.equal(residual_mix(f(banked[:, :0]), f(h), f(w), EPS), f(h))


def test_reglu_equals_float64() -> None:
    """SmallThinker's experts: relu(gate) * up, across the kink at 0."""
    from moerun.layers.ffn import reglu

    g = torch.linspace(-3, 3, 601, dtype=torch.float32)
    u = torch.flip(g, [0]) * 0.7 + 0.1
    want = np.maximum(g.double().numpy(), 0.0) * u.double().numpy()
    assert np.abs(reglu(g, u).double().numpy() - want).max() <= 1e-6 * np.abs(want).max()


def short_conv_f64(x: np.ndarray, w: dict[str, np.ndarray]) -> np.ndarray:
    """LFM2's short convolution from position 0 in float64: b, c, v = in_proj x; y_t = sum_j conv[:, j] (b v)_{t-K+1+j}
    (zeros before the first token); out = out_proj (c y)."""
    b, c, v = np.split(x @ w["in"].T, 3, axis=-1)
    K = w["conv"].shape[1]
    bx = np.concatenate([np.zeros((K - 1, b.shape[1])), b * v])
    y = np.stack([(bx[t : t + K] * w["conv"].T).sum(0) for t in range(len(x))])
    return (c * y) @ w["out"].T


def test_short_conv_equals_float64_in_pieces_and_per_sequence() -> None:
    """A prompt in two pieces, then a decode step of two sequences side by side, then a sequence started anew at
    position 0 (its old state ignored)."""
    from moerun.layers.short_conv import ShortConv

    gen = torch.Generator().manual_seed(23)
    taps = 3
    w_in, w_out = linear(gen, 3 * D, D), linear(gen, D, D)
    conv = torch.randn(D, taps, generator=gen) / math.sqrt(taps)
    layer = ShortConv(in_proj=w_in, conv=conv, out_proj=w_out, n_seq=2)
    w = {"in": w_in.weight.double().numpy(), "out": w_out.weight.double().numpy(), "conv": conv.double().numpy()}
    a, b = torch.randn(10, D, generator=gen), torch.randn(6, D, generator=gen)
    want_a, want_b = short_conv_f64(a.double().numpy(), w), short_conv_f64(b.double().numpy(), w)
    scale = max(np.abs(want_a).max(), np.abs(want_b).max())
    got_a = [layer(a[:4], Step(torch.arange(4), n_slots=4, seq=0)), layer(a[4:9], Step(torch.arange(4, 9), n_slots=9))]
    got_b = layer(b[:5], Step(torch.arange(5), n_slots=5, seq=1))
    both = layer(torch.stack([a[9], b[5]]), Step(torch.tensor([9, 5]), n_slots=10, seqs=torch.tensor([0, 1])))
    assert np.abs(torch.cat(got_a).double().numpy() - want_a[:9]).max() <= 1e-5 * scale
    assert np.abs(got_b.double().numpy() - want_b[:5]).max() <= 1e-5 * scale
    assert np.abs(both.double().numpy() - np.stack([want_a[9], want_b[5]])).max() <= 1e-5 * scale
    again = layer(b[:3], Step(torch.arange(3), n_slots=3, seq=0))  # sequence 0 anew: a's rows forgotten
    assert np.abs(again.double().numpy() - want_b[:3]).max() <= 1e-5 * scale


def test_latent_moe_equals_float64(synth_model) -> None:
    """Kimi-K3's LatentMoE (layers/moe.py) on its synthetic file (F32): the experts the router chose run situ on
    ffn_routed_down x (L < D), their weighted sum RMS-normed by ffn_routed_norm and taken back to D by ffn_routed_up,
    plus the situ shared expert on x itself."""
    import moerun
    from moeprep.gguf.reader import open_gguf
    from moerun.layers import LatentMoE
    from moerun.weights import Weights

    path = synth_model("kimi-k3", expert_type="F32", attn_type="F32")
    model = moerun.load_model(path)
    layer = 1
    moe = model.net.blocks[layer].ffn
    assert isinstance(moe, LatentMoE)
    w = Weights(open_gguf(path), torch.float64, torch.device("cpu"))
    t = lambda name: w.dense(f"blk.{layer}.{name}.weight").numpy()  # noqa: E731
    L, D = t("ffn_routed_down").shape
    assert L < D
    beta, up_beta = moe.experts.activation.limit, moe.experts.activation.up_limit
    situ = lambda g, u: beta * np.tanh(g / beta) / (1 + np.exp(-g)) * up_beta * np.tanh(u / up_beta)  # noqa: E731

    x = torch.randn(7, D, generator=torch.Generator().manual_seed(0))
    chosen = []
    handle = model.add_routing_hook(lambda ev: chosen.append((ev.expert_ids, ev.weights)))
    got = moe(x, Step(torch.arange(7), n_slots=7)).double().numpy()
    handle.remove()
    (ids, weights), xd = chosen[0], x.double().numpy()
    gate, up, down = (w.dense(f"blk.{layer}.ffn_{p}_exps.weight").numpy() for p in ("gate", "up", "down"))
    latent = xd @ t("ffn_routed_down").T  # (T, L)
    routed = np.zeros_like(latent)
    for i in range(len(xd)):
        for e, g in zip(ids[i].tolist(), weights[i].double().tolist()):
            routed[i] += g * down[e] @ situ(gate[e] @ latent[i], up[e] @ latent[i])
    normed = routed / np.sqrt((routed**2).mean(-1, keepdims=True) + EPS) * t("ffn_routed_norm")
    shared = situ(xd @ t("ffn_gate_shexp").T, xd @ t("ffn_up_shexp").T) @ t("ffn_down_shexp").T
    want = normed @ t("ffn_routed_up").T + shared
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


# --- DeepSeek-V4: compressed keys, the tail rotation, sqrt-softplus scores, hash routing -----------------------------


def rotate_tail_f64(x: np.ndarray, positions: np.ndarray, dim: int, base: float, sign: float = 1.0) -> np.ndarray:
    """x (T, ..., d): adjacent pairs of the last `dim` channels turned by sign * position * base^(-2i/dim)."""
    angles = sign * positions[:, None] * base ** (-np.arange(0, dim, 2) / dim)  # (T, dim/2)
    angles = angles.reshape(len(x), *([1] * (x.ndim - 2)), dim // 2)
    out = x.astype(np.float64).copy()
    a, b = x[..., -dim::2], x[..., -dim + 1 :: 2]
    out[..., -dim::2] = a * np.cos(angles) - b * np.sin(angles)
    out[..., -dim + 1 :: 2] = a * np.sin(angles) + b * np.cos(angles)
    return out


def test_rotate_tail_and_back():
    """RoPE on the last channels of a head (DeepSeek-V4's layout: the rotated part after the rest), and its inverse."""
    from moerun.layers.kv_compression import rotate_tail

    T, Dh, dim, base = 11, 16, 6, 40000.0
    args = SimpleNamespace(
        rope_dim=dim,
        rope_base=base,
        rope_style="normal",
        rope_scaling="none",
        rope_freq_scale=1.0,
        rope_attn_factor=1.0,
    )
    rope = Rope(args, T, torch.device("cpu"))
    x = torch.randn(T, 3, Dh, generator=torch.Generator().manual_seed(31))
    positions = torch.arange(T)
    got = rotate_tail(rope, x, positions).double().numpy()
    np.testing.assert_allclose(got, rotate_tail_f64(x.double().numpy(), np.arange(T), dim, base), atol=1e-5)
    back = rotate_tail(rope, rotate_tail(rope, x, positions), positions, inverse=True)
    torch.testing.assert_close(back, x, atol=1e-5, rtol=1e-5)


def compressed_f64(
    x: np.ndarray, w: dict[str, np.ndarray], ratio: int, overlap: bool, dim: int, base: float
) -> np.ndarray:
    """Every complete block's entry of the sequence x (T, D) in float64: per channel, the softmax over the block's
    tokens (and, overlapping, the previous block's first halves) of gate x + ape weighting kv x; RMS-normed, rotated
    at the block's first position."""
    kv, score = x @ w["kv"].T, x @ w["gate"].T + w["ape"][np.arange(len(x)) % ratio]
    W = w["norm"].shape[0]
    entries = []
    for b in range(len(x) // ratio):
        own = slice(b * ratio, (b + 1) * ratio)
        if overlap:
            prev_v = kv[own.start - ratio : own.start, :W] if b else np.zeros((ratio, W))
            prev_s = score[own.start - ratio : own.start, :W] if b else np.full((ratio, W), -np.inf)
            values, scores = np.concatenate([prev_v, kv[own, W:]]), np.concatenate([prev_s, score[own, W:]])
        else:
            values, scores = kv[own], score[own]
        p = np.exp(scores - scores.max(0))
        entry = (p / p.sum(0) * values).sum(0)
        entries.append(entry / np.sqrt((entry**2).mean() + EPS) * w["norm"])
    entries = np.array(entries)
    return rotate_tail_f64(entries, np.arange(len(entries)) * ratio, dim, base)


@pytest.mark.parametrize("ratio,overlap", [(4, True), (8, False)])
def test_kv_compressor(ratio, overlap):
    """The entries a sequence completes, fed as a prompt in chunks of odd lengths and then as decode steps of both
    sequences side by side (so blocks straddle steps and the state's ring), equal the float64 reference over the
    whole sequence; starting over at position 0 reads nothing of the first run."""
    from moerun.layers.kv_compression import KVCompressor

    gen = torch.Generator().manual_seed(37)
    T, W, dim, base, c = 45, 8, 4, 20000.0, 2 if overlap else 1
    args = SimpleNamespace(
        rope_dim=dim,
        rope_base=base,
        rope_style="normal",
        rope_scaling="none",
        rope_freq_scale=1.0,
        rope_attn_factor=1.0,
    )
    kv, gate = linear(gen, c * W, D), linear(gen, c * W, D)
    ape, norm = torch.randn(ratio, c * W, generator=gen), 1 + 0.1 * torch.randn(W, generator=gen)
    layer = KVCompressor(
        kv, gate, ape, RMSNorm(norm, EPS, TORCH_KERNELS), Rope(args, 64, torch.device("cpu")), ratio, overlap, 64, 2
    )
    w = {"kv": kv.weight.double().numpy(), "gate": gate.weight.double().numpy(), "ape": ape.double().numpy()}
    w["norm"] = norm.double().numpy()
    xs = [torch.randn(T, D, generator=gen) for _ in range(2)]
    for seq, x in enumerate(xs):
        for a, b in ((0, 13), (13, 19)):
            layer.update(x[a:b], seq, torch.arange(a, b))
    for t in range(19, T):  # both sequences' decode steps side by side
        layer.update_tokens(torch.stack([xs[0][t], xs[1][t]]), torch.tensor([0, 1]), torch.tensor([t, t]))
    for seq, x in enumerate(xs):
        want = compressed_f64(x.double().numpy(), w, ratio, overlap, dim, base)
        np.testing.assert_allclose(layer.cache[seq, : T // ratio].double().numpy(), want, atol=1e-4, rtol=1e-4)
    layer.update(xs[1][:10], 0, torch.arange(10))  # sequence 0 anew, from sequence 1's first tokens
    want = compressed_f64(xs[1][:10].double().numpy(), w, ratio, overlap, dim, base)
    np.testing.assert_allclose(layer.cache[0, : 10 // ratio].double().numpy(), want, atol=1e-4, rtol=1e-4)


def test_sqrt_softplus_and_hash_routing():
    """sqrt(softplus) scores with a selection bias (DeepSeek-V4's Router), and the hash router: the token's experts
    from its table row, weighted by those scores, renormalised and scaled, as in float64."""
    from moerun.config import GATING_SQRT_SOFTPLUS
    from moerun.layers import HashRouter, Router

    gen = torch.Generator().manual_seed(41)
    T, E, k, V, scale = 10, 8, 3, 20, 1.5
    args = SimpleNamespace(
        n_experts_used=k,
        gating=GATING_SQRT_SOFTPLUS,
        expert_weights_norm=True,
        expert_weights_scale=scale,
        n_expert_groups=0,
        n_group_used=0,
    )
    gate, bias = linear(gen, E, D), 0.3 * torch.randn(E, generator=gen)
    table = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(V)])
    x, tokens = torch.randn(T, D, generator=gen), torch.randint(0, V, (T,), generator=gen)
    logits = x.double().numpy() @ gate.weight.double().numpy().T
    scores = np.sqrt(np.log1p(np.exp(logits)))

    def weights_f64(ids: np.ndarray) -> np.ndarray:
        chosen = np.take_along_axis(scores, ids, -1)
        return chosen / chosen.sum(-1, keepdims=True) * scale

    ids, weights = Router(gate, args, TORCH_KERNELS, selection_bias=bias)(x)
    want_ids = np.argsort(-(scores + bias.double().numpy()), -1)[:, :k]
    assert all(set(a) == set(b) for a, b in zip(ids.numpy(), want_ids))
    np.testing.assert_allclose(weights.double().numpy(), weights_f64(ids.numpy()), rtol=1e-5)
    step = Step(torch.arange(T), n_slots=T, tokens=tokens)
    ids, weights = HashRouter(gate, args, TORCH_KERNELS, table)(x, step)
    np.testing.assert_array_equal(ids.numpy(), table[tokens].numpy())
    np.testing.assert_allclose(weights.double().numpy(), weights_f64(table[tokens].numpy()), rtol=1e-5)


def test_hyper_connections():
    """A mixing site (layers/hyper_connections.py) against float64: the pre weights sum the streams into the sublayer's
    input; Sinkhorn (softmax over destinations, then columns and rows normalised in turn) makes the mixing doubly
    stochastic; the merge gives post_d y + sum_s comb[s, d] stream_s; the head mix sums the streams by its own weights."""
    from moerun.layers.hyper_connections import HyperConnection, HyperHead

    gen = torch.Generator().manual_seed(43)
    T, N, iterations, hc_eps = 5, 4, 20, 1e-6
    fn, base, scale = linear(gen, N * (2 + N), N * D), torch.randn(N * (2 + N), generator=gen), torch.rand(3) + 0.5
    site = HyperConnection(fn, base, scale, N, EPS, hc_eps, iterations)
    head_fn, head_base = linear(gen, N, N * D), torch.randn(N, generator=gen)
    head = HyperHead(head_fn, head_base, scale[:1], EPS, hc_eps)
    streams, y = torch.randn(T, N, D, generator=gen), torch.randn(T, D, generator=gen)
    s = streams.double().numpy()
    flat = s.reshape(T, N * D)
    mixes = flat / np.sqrt((flat**2).mean(-1, keepdims=True) + EPS) @ fn.weight.double().numpy().T
    b, c = base.double().numpy(), scale.double().numpy()
    sigmoid = lambda v: 1 / (1 + np.exp(-v))  # noqa: E731
    pre = sigmoid(mixes[:, :N] * c[0] + b[:N]) + hc_eps
    post = 2 * sigmoid(mixes[:, N : 2 * N] * c[1] + b[N : 2 * N])
    comb = (mixes[:, 2 * N :] * c[2] + b[2 * N :]).reshape(T, N, N)  # [t, src, dst]
    comb = np.exp(comb - comb.max(-1, keepdims=True))
    comb = comb / comb.sum(-1, keepdims=True) + hc_eps
    comb = comb / (comb.sum(1, keepdims=True) + hc_eps)
    for _ in range(iterations - 1):
        comb = comb / (comb.sum(2, keepdims=True) + hc_eps)
        comb = comb / (comb.sum(1, keepdims=True) + hc_eps)
    h, got_post, got_comb = site.split(streams)
    np.testing.assert_allclose(h.double().numpy(), (s * pre[:, :, None]).sum(1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_post.double().numpy(), post, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_comb.double().numpy(), comb, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(comb.sum(1), 1, atol=1e-4)  # doubly stochastic, to Sinkhorn's precision
    np.testing.assert_allclose(comb.sum(2), 1, atol=1e-3)
    merged = post[:, :, None] * y.double().numpy()[:, None, :] + np.einsum("tsd,tse->tde", comb, s)
    np.testing.assert_allclose(site.merge(y, streams, got_post, got_comb).double().numpy(), merged, atol=1e-5)
    head_mix = flat / np.sqrt((flat**2).mean(-1, keepdims=True) + EPS) @ head_fn.weight.double().numpy().T
    weights = sigmoid(head_mix * c[0] + head_base.double().numpy()) + hc_eps
    np.testing.assert_allclose(head(streams).double().numpy(), (s * weights[:, :, None]).sum(1), atol=1e-5)
