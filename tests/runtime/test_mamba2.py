"""The Mamba-2 mixer (layers/mamba2.py) against a float64 reference written plainly, token by token: a prompt
prefilled in chunks then decoded from the carried state, sequences keeping their own state, and the chunked scan
against the recurrent one."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from moerun.hooks import Hooks
from moerun.layers import Linear
from moerun.layers.mamba2 import Mamba2, ssd_chunked, ssd_recurrent
from moerun.step import Step

D, H, G, N, P, K, EPS = 24, 4, 2, 8, 6, 4, 1e-5
INNER = H * P
CONV = INNER + 2 * G * N


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-x))


def mamba2_f64(x: np.ndarray, w: dict[str, np.ndarray]) -> np.ndarray:
    """The layer from position 0 in float64, one token and one head at a time."""
    T = len(x)
    proj = x @ w["in"].T
    z, xBC, dt = proj[:, :INNER], proj[:, INNER : INNER + CONV], proj[:, INNER + CONV :]
    rows = np.concatenate([np.zeros((K - 1, CONV)), xBC])
    conv = np.stack([(rows[t : t + K] * w["conv"].T).sum(0) for t in range(T)]) + w["conv_bias"]
    mixed = conv * sigmoid(conv)
    S, y = np.zeros((H, P, N)), np.zeros((T, H, P))
    for t in range(T):
        xs = mixed[t, :INNER].reshape(H, P)
        B = mixed[t, INNER : INNER + G * N].reshape(G, N)
        C = mixed[t, INNER + G * N :].reshape(G, N)
        for h in range(H):
            g = h // (H // G)
            step = np.log1p(np.exp(dt[t, h] + w["dt"][h]))
            S[h] = S[h] * np.exp(step * w["A"][h]) + step * np.outer(xs[h], B[g])
            y[t, h] = S[h] @ C[g] + w["D"][h] * xs[h]
    gated = (y.reshape(T, INNER) * z * sigmoid(z)).reshape(T, G, INNER // G)
    normed = gated / np.sqrt((gated * gated).mean(-1, keepdims=True) + EPS) * w["norm"].reshape(G, -1)
    return normed.reshape(T, INNER) @ w["out"].T


def make_mamba2(seed: int, n_seq: int = 1) -> tuple[Mamba2, dict[str, np.ndarray]]:
    gen = torch.Generator().manual_seed(seed)

    def linear(rows: int, cols: int) -> Linear:
        return Linear(torch.randn(rows, cols, generator=gen) / math.sqrt(cols), None, "w", Hooks())

    in_proj, out = linear(2 * INNER + 2 * G * N + H, D), linear(D, INNER)
    t = {
        "conv": torch.randn(CONV, K, generator=gen) / math.sqrt(K),
        "conv_bias": 0.1 * torch.randn(CONV, generator=gen),
        "dt": torch.randn(H, generator=gen),
        "A": -torch.exp(0.5 * torch.randn(H, generator=gen)),
        "D": 1 + 0.3 * torch.randn(H, generator=gen),
        "norm": 1 + 0.1 * torch.randn(INNER, generator=gen),
    }
    layer = Mamba2(
        in_proj=in_proj,
        conv=t["conv"],
        conv_bias=t["conv_bias"],
        dt_bias=t["dt"],
        A=t["A"][:, None],  # stored as {1, H}, as the files hold it
        D=t["D"][:, None],
        norm=t["norm"].view(G, INNER // G),
        out=out,
        n_heads=H,
        n_groups=G,
        state_size=N,
        inner_size=INNER,
        eps=EPS,
        n_seq=n_seq,
    )
    weights = {name: v.double().numpy() for name, v in t.items()}
    weights |= {"in": in_proj.weight.double().numpy(), "out": out.weight.double().numpy()}
    return layer, weights


@pytest.mark.parametrize("n", [5, 64, 150])
def test_prefill_then_decode_equals_float64(n: int) -> None:
    layer, w = make_mamba2(n)
    x = torch.randn(n + 3, D, generator=torch.Generator().manual_seed(100 + n))
    want = mamba2_f64(x.double().numpy(), w)
    got = [layer(x[:n], Step(torch.arange(n), n_slots=n))]  # one prefill, in chunks past 64 tokens
    got += [layer(x[t : t + 1], Step(torch.tensor([t]), n_slots=t + 1)) for t in range(n, n + 3)]  # then decode
    got = torch.cat(got).double().numpy()
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    # position 0 starts anew: the same prompt again gives the same outputs, whatever the state held
    again = layer(x[:n], Step(torch.arange(n), n_slots=n)).double().numpy()
    assert np.abs(again - want[:n]).max() <= 1e-5 * np.abs(want).max()


def test_prompt_in_pieces_equals_one_prefill() -> None:
    """Chunks of a prompt continue the conv and SSM states where the last chunk left them."""
    layer, w = make_mamba2(3)
    x = torch.randn(90, D, generator=torch.Generator().manual_seed(4))
    want = mamba2_f64(x.double().numpy(), w)
    got = torch.cat([layer(x[a:b], Step(torch.arange(a, b), n_slots=b)) for a, b in ((0, 37), (37, 38), (38, 90))])
    assert np.abs(got.double().numpy() - want).max() <= 1e-5 * np.abs(want).max()


def test_sequences_keep_their_own_state() -> None:
    layer, w = make_mamba2(7, n_seq=2)
    gen = torch.Generator().manual_seed(8)
    a, b = torch.randn(10, D, generator=gen), torch.randn(12, D, generator=gen)
    want_a, want_b = mamba2_f64(a.double().numpy(), w), mamba2_f64(b.double().numpy(), w)
    layer(b[:11], Step(torch.arange(11), n_slots=11, seq=1))
    layer(a[:9], Step(torch.arange(9), n_slots=9, seq=0))
    both = layer(torch.stack([a[9], b[11]]), Step(torch.tensor([9, 11]), n_slots=12, seqs=torch.tensor([0, 1])))
    scale = max(np.abs(want_a).max(), np.abs(want_b).max())
    assert np.abs(both[0].double().numpy() - want_a[9]).max() <= 1e-5 * scale
    assert np.abs(both[1].double().numpy() - want_b[11]).max() <= 1e-5 * scale


@pytest.mark.parametrize("n", [1, 63, 64, 200])
def test_chunked_scan_equals_recurrent(n: int) -> None:
    """From a nonzero state, with decays strong enough that early tokens fade (the masked gaps must not overflow)."""
    gen = torch.Generator().manual_seed(n)
    x, B, C = (torch.randn(n, H, d, generator=gen, dtype=torch.float64) for d in (P, N, N))
    log_decay = -3 * torch.rand(n, H, generator=gen, dtype=torch.float64)
    S = torch.randn(H, P, N, generator=gen, dtype=torch.float64)
    want, want_S = ssd_recurrent(x, log_decay, B, C, S)
    got, got_S = ssd_chunked(x, log_decay, B, C, S, chunk=16)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got_S, want_S, rtol=1e-10, atol=1e-10)
