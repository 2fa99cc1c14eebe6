"""Routing by a named regime, built into the weights: the model's own router picks experts from a context that
drifts along the text, as a real model's does (moeprep/profile/regimes.py describes the regimes and their targets).

A token's experts come from what the forward pass carries in the residual stream, each part in its own subspace
(orthonormal bases, seeded, zero in the bias channel):

- Its topic: every token v has a topic direction n_v in R^C (C = CONTEXT_DIMS), a seeded random vector centred and
  whitened over the calibration text's tokens (moeprep/data/calibration.txt, weighted by how often each occurs), so
  frequent tokens do not pin the context to one place. The embedding holds it along basis B_topic.
- The context, written by layer 0's attention (ContextLayer). Its queries and keys read only the bias channel (a
  constant), so after the per-head Q/K norm every query and key is a fixed vector whose energy sits in chosen rotary
  pairs; RoPE then makes the score of a key Delta positions back sum_p a_p cos(theta_p (Delta - lag)), a kernel over
  relative position whose coefficients a_p (set through the Q/K norm weights) are fitted by non-negative least
  squares. SHORT heads average the topics with a drop of Delta / window (about exponential weights over `window`
  tokens), LONG heads over LONG_WINDOW times that; the output writes the short average minus the long one along
  B_context, scaled to a steady size. So the context is a band-passed moving average of the recent tokens' topics:
  an AR(1)-like state that forgets itself over about `window` tokens, like the regime generator's latent state,
  except that its steps are the text's own tokens, and without the offset a text's overall leaning would give it.
- Its identity: a private random unit vector z_v in R^Z (Z = TOKEN_DIMS) along B_token, and the previous token's,
  which PREVIOUS heads (a kernel peaked one position back) copy along B_previous: what the context does not
  explain, the per-token spread of a real router, different at every pair of tokens.

Layer l's router row for expert e reads the three with seeded unit directions of its own (u_le in R^C, u'_le and
u''_le in R^Z), compensated channel by channel for the FFN norm's weight, plus per-expert offsets in the bias channel
(popularity, and a favoured head of experts where the regime has one). Scales are set so that, for a normed hidden
state, each part of a logit has the standard deviation the regime names (ContextRouting). Everything else that
writes into the residual stream (the other layers' attention, every expert) is scaled by RESIDUAL_SCALE, so the
parts reach every layer's router nearly unchanged; the other layers' attention and the experts stay random.

This is a weight construction only: the runtime, llama.cpp and `moeprep profile` run the model as any other.
Built for qwen3moe (per-head Q/K norm, NeoX rotary over whole heads), with room for the subspaces and a KV group per
kind of head (MIN_EMBD, MIN_HEAD_DIM, MIN_KV_HEADS); other architectures are refused.
Letters: V vocabulary, D n_embd, H heads, G kv heads, d head_dim, E experts, C context dims, Z token dims.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from moeprep.synth.tokenizer import TOKENIZER_PATH, VOCAB_SIZE
from moeprep.synth.weights import BIAS_CHANNEL, BIAS_CHANNEL_VALUE, Normal, Router, skew_offsets, tensor_rng

if TYPE_CHECKING:  # config imports this module for the regimes' names and shape limits
    from moeprep.synth.config import SynthConfig

CONTEXT_DIMS = 16  # C: the topic and context subspaces
TOKEN_DIMS = 48  # Z: a token's identity and the previous token's (more dims: experts' shares less correlated)
TOPIC_SHARE, TOKEN_SHARE = 0.5, 0.5  # share of an embedding's norm along its topic and its identity
CONTEXT_SHARE, PREVIOUS_SHARE = 0.5, 0.5  # norms the context layer writes, as shares of an embedding's
RESIDUAL_SCALE = 0.05  # the other residual writers' scale
KERNEL_CAP = 14.0  # the recency kernel's drop (in score units) beyond KERNEL_CAP windows
PREVIOUS_DROP = 16.0  # the previous-token kernel's fitted drop away from lag 1
CALIBRATION = TOKENIZER_PATH.parent / "calibration.txt"
ROW_CHUNK = 4096  # embedding rows drawn at once
MIN_EMBD = 2 * CONTEXT_DIMS + 2 * TOKEN_DIMS + 1  # the four subspaces and the bias channel
MIN_HEAD_DIM = TOKEN_DIMS  # a value head carries a whole identity
MIN_KV_HEADS = 3  # a KV group for each kind of context-layer head


@dataclass(frozen=True)
class ContextRouting:
    """A regime's construction: the context's window in tokens, and the standard deviations of a router logit's
    parts: the context, the token's identity, the previous token's identity, a fixed per-expert popularity."""

    window: float
    context: float
    token: float
    previous: float
    popularity: float
    head: int = 0  # experts per layer every context favours (a heavy head of popularity) ...
    head_boost: float = 0.0  # ... by this much on their logits


# regime name -> its construction, tuned with `moeprep profile` and `moeprep routing stats` on the held-out text
# (tests/test_synth_routing.py checks regimes.py's targets for it at a small shape)
CONTEXT_REGIMES: dict[str, ContextRouting] = {
    "qwen3-30b": ContextRouting(window=64.0, context=3.0, token=1.1, previous=1.2, popularity=0.1),
    "fine-512": ContextRouting(window=14.0, context=1.5, token=1.0, previous=1.6, popularity=0.0),
    "skewed-256": ContextRouting(
        window=2.0, context=0.6, token=0.7, previous=0.7, popularity=0.3, head=12, head_boost=1.9
    ),
}  # chat-glm (its chunks' kinds) and trained (a recording) are traces only


# --- the attention kernels ------------------------------------------------------------------------------------------


def _nonnegative_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """min |a x - b| over x >= 0, by least squares on a shrinking set of columns (small problems only)."""
    keep = np.ones(a.shape[1], bool)
    x = np.zeros(a.shape[1])
    for _ in range(a.shape[1]):
        x[:] = 0.0
        x[keep] = np.linalg.lstsq(a[:, keep], b, rcond=None)[0]
        if (x >= 0).all():
            break
        keep &= x > 0
    return np.maximum(x, 0.0)


def _frequencies(base: float, head_dim: int) -> np.ndarray:
    """[d/2] NeoX rotary frequencies base^(-2p/d) (the pairs are coordinates p and p + d/2)."""
    return base ** (-np.arange(0, head_dim, 2) / head_dim)


def _fit(base: float, head_dim: int, lag: int, target, weight, delta: np.ndarray) -> np.ndarray:
    """[d/2] a_p >= 0 with sum_p a_p (1 - cos(theta_p (Delta - lag))) close to target(Delta); the slowest pair is
    left out (it pads a head's vector: nearly constant over any context, see context_norms)."""
    theta = _frequencies(base, head_dim)[:-1]
    drop = 1.0 - np.cos(np.outer(delta - lag, theta))
    w = weight(delta)
    return np.append(_nonnegative_lstsq(drop * w[:, None], target(delta) * w), 0.0)


@functools.cache
def recency_kernel(base: float, head_dim: int, window: float, horizon: int) -> np.ndarray:
    """[d/2] a_p: a key Delta positions back scores sum_p a_p cos(theta_p Delta), its drop from Delta = 0 fitted to
    min(Delta / window, KERNEL_CAP) up to `horizon` (the first 4 windows weigh three times as much)."""
    delta = np.unique(np.concatenate([np.arange(int(8 * window)), np.geomspace(1, max(horizon, 2), 2000).astype(int)]))
    return _fit(
        base,
        head_dim,
        0,
        lambda d: np.minimum(d / window, KERNEL_CAP),
        lambda d: np.where(d < 4 * window, 3.0, 1.0),
        delta,
    )


@functools.cache
def previous_kernel(base: float, head_dim: int, horizon: int) -> np.ndarray:
    """[d/2] a_p: a key Delta positions back scores sum_p a_p cos(theta_p (Delta - 1)), fitted to drop by
    PREVIOUS_DROP everywhere but at Delta = 1 (the token itself and the one before the previous weigh ten times)."""
    delta = np.unique(np.concatenate([np.arange(64), np.geomspace(1, max(horizon, 2), 2000).astype(int)]))
    return _fit(
        base,
        head_dim,
        1,
        lambda d: np.where(d == 1, 0.0, PREVIOUS_DROP),
        lambda d: np.where(np.abs(d - 1) <= 1, 10.0, 1.0),
        delta,
    )


def kernel_weights(a: np.ndarray, base: float, head_dim: int, n: int, lag: int = 0) -> np.ndarray:
    """[n] attention weights over the keys 0..n-1 positions back of a query with n keys behind it (itself
    included), for kernel `a` centred on `lag`."""
    score = np.cos(np.outer(np.arange(n) - lag, _frequencies(base, head_dim))) @ a
    w = np.exp(score - score.max())
    return w / w.sum()


SHORT, PREVIOUS, LONG = 0, 1, 2  # the context layer's kinds of head
LONG_WINDOW = 10.0  # the long average's window, in short windows


def head_kinds(n_head: int, n_kv_head: int) -> np.ndarray:
    """[H] each query head's kind: the last kv group's heads look at the previous token, the group before it
    averages over the long window, the others over the short one."""
    group = np.arange(n_head) // (n_head // n_kv_head)
    return np.where(group == n_kv_head - 1, PREVIOUS, np.where(group == n_kv_head - 2, LONG, SHORT))


@dataclass(frozen=True)
class ContextLayer:
    """Layer 0's attention, as three kinds of head (head_kinds): SHORT heads average the recent topics over about
    `window` tokens, LONG heads over LONG_WINDOW times that, and PREVIOUS heads take the previous token's identity.
    The context is the short average minus the long one: what the text is about now against what it has been about,
    so a text whose words lean one way overall does not keep the same experts busy throughout.

    All kinds share the per-head Q/K norm weight `norm` [d]; a kind's query and key vectors (`query`, `key`
    [3, d]) put share beta_p = a_p / (sqrt(d) norm_p^2) of their energy in pair p (a previous-token query turned
    back by theta_p, so its score peaks one position back) and the rest in the slowest pair, whose cosine stays
    about 1 over the whole context (a constant score, which softmax ignores)."""

    norm: np.ndarray
    query: np.ndarray
    key: np.ndarray
    context_power: float  # mean squared norm of (short - long average) of unit-power vectors, over a long text
    previous_power: float

    @staticmethod
    def build(base: float, head_dim: int, window: float, horizon: int) -> ContextLayer:
        kernels = np.stack(
            [
                recency_kernel(base, head_dim, window, horizon),
                previous_kernel(base, head_dim, horizon),
                recency_kernel(base, head_dim, LONG_WINDOW * window, horizon),
            ]
        )
        half, d = head_dim // 2, head_dim
        used = kernels.max(axis=0) > 0
        norm_sq = np.ones(half)
        norm_sq[used] = kernels.max(axis=0)[used] * used.sum() / np.sqrt(d)
        beta = kernels / (np.sqrt(d) * norm_sq)  # [3, d/2], each row sums to at most 1
        beta[:, -1] = 1.0 - beta[:, :-1].sum(axis=1)
        theta = _frequencies(base, head_dim)
        query, key = np.zeros((3, d)), np.zeros((3, d))
        key[:, :half] = np.sqrt(beta)
        query[:, :half] = np.sqrt(beta)
        query[PREVIOUS, :half] *= np.cos(theta)
        query[PREVIOUS, half:] = -np.sqrt(beta[PREVIOUS]) * np.sin(theta)
        n = min(horizon, 1 << 16)
        short, previous, long = (kernel_weights(k, base, head_dim, n, lag) for k, lag in zip(kernels, (0, 1, 0)))
        return ContextLayer(
            np.tile(np.sqrt(norm_sq), 2), query, key, float(((short - long) ** 2).sum()), float((previous**2).sum())
        )


# --- the directions -----------------------------------------------------------------------------------------------


@functools.cache
def calibration_counts() -> np.ndarray:
    """[VOCAB_SIZE] how often each token occurs in the calibration text."""
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(TOKENIZER_PATH)).encode(CALIBRATION.read_text()).ids
    return np.bincount(np.array(ids), minlength=VOCAB_SIZE).astype(np.float64)


def _unit_rows(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


@functools.cache
def topics(seed: int, n_vocab: int) -> np.ndarray:
    """[V, C] topic directions, centred and whitened over the calibration text (mean squared norm 1 there)."""
    raw = _unit_rows(tensor_rng(seed, "routing.topics").standard_normal((n_vocab, CONTEXT_DIMS)))
    p = np.zeros(n_vocab)
    p[:VOCAB_SIZE] = calibration_counts()[:n_vocab]
    p /= p.sum()
    centred = raw - p @ raw
    # whitened: a few frequent tokens would otherwise hold most of the context's spread in their own directions,
    # and the experts facing those would be busy everywhere
    values, vectors = np.linalg.eigh((centred * p[:, None]).T @ centred)
    return centred @ vectors @ np.diag(1.0 / np.sqrt(values * CONTEXT_DIMS)) @ vectors.T


@functools.cache
def bases(seed: int, n_embd: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(B_topic [D, C], B_context [D, C], B_token [D, Z], B_previous [D, Z]): orthonormal columns, mutually
    orthogonal, zero in the bias channel."""
    q, _ = np.linalg.qr(tensor_rng(seed, "routing.bases").standard_normal((n_embd - 1, MIN_EMBD - 1)))
    q = np.insert(q, BIAS_CHANNEL, 0.0, axis=0)
    cuts = np.cumsum([CONTEXT_DIMS, CONTEXT_DIMS, TOKEN_DIMS])
    return tuple(np.split(q, cuts, axis=1))


def embedding_rms(n_embd: int) -> float:
    """RMS of an embedding row: norm sqrt(D - 1) besides the bias channel."""
    return float(np.sqrt((n_embd - 1 + BIAS_CHANNEL_VALUE**2) / n_embd))


def router_rms(n_embd: int) -> float:
    """RMS of the hidden state a router reads: an embedding plus what the context layer wrote."""
    return float(np.sqrt(((n_embd - 1) * (1 + CONTEXT_SHARE**2 + PREVIOUS_SHARE**2) + BIAS_CHANNEL_VALUE**2) / n_embd))


def _norm_values(seed: int, norm: tuple, n_embd: int) -> np.ndarray:
    """A norm tensor's values from (its Init, its draw name), drawn as the model draws them."""
    init, draw = norm
    return init.sample(tensor_rng(seed, draw), (n_embd,))


# --- the tensors ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RegimeEmbedding:
    """token_embd [V, D]: sqrt(D - 1) * (TOPIC_SHARE n_v along B_topic + TOKEN_SHARE z_v along B_token + a private
    random direction filling the norm), the bias channel constant."""

    seed: int
    std: float = 1.0

    def sample(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        n_vocab, n_embd = shape
        b_topic, _, b_token, _ = bases(self.seed, n_embd)
        used = np.concatenate(bases(self.seed, n_embd), axis=1)
        topic = TOPIC_SHARE * topics(self.seed, n_vocab)
        out = np.empty(shape, np.float32)
        for start in range(0, n_vocab, ROW_CHUNK):
            rows = slice(start, min(start + ROW_CHUNK, n_vocab))
            n = rows.stop - rows.start
            token = _unit_rows(rng.standard_normal((n, TOKEN_DIMS)))
            private = rng.standard_normal((n, n_embd))
            private[:, BIAS_CHANNEL] = 0.0
            private = _unit_rows(private - (private @ used) @ used.T)
            t = topic[rows]
            fill = np.sqrt(np.maximum(1.0 - (t**2).sum(axis=1, keepdims=True) - TOKEN_SHARE**2, 0.05))
            out[rows] = np.sqrt(n_embd - 1) * (t @ b_topic.T + TOKEN_SHARE * token @ b_token.T + fill * private)
        out[:, BIAS_CHANNEL] = BIAS_CHANNEL_VALUE
        return out


@dataclass(frozen=True)
class ConstantProjection:
    """attn_q [H d, D] or attn_k [G d, D] of the context layer: each head's rows read the bias channel only, so the
    head's vector is its kind's (ContextLayer.query or .key) whatever the token."""

    layer: ContextLayer
    n_head: int
    n_kv_head: int
    key: bool
    std: float = 0.0
    exact: ClassVar[bool] = True  # written through the quantizer even in fast_random_blocks mode

    def sample(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        kinds = head_kinds(self.n_head, self.n_kv_head)
        if self.key:  # one key head per kv group: its query heads' kind
            kinds = kinds[:: self.n_head // self.n_kv_head]
        vectors = self.layer.key if self.key else self.layer.query
        out = np.zeros(shape, np.float32)
        out[:, BIAS_CHANNEL] = vectors[kinds].reshape(-1)
        return out


@dataclass(frozen=True)
class KernelNorm:
    """attn_q_norm / attn_k_norm [d] of the context layer: the kernels' shared weight (ContextLayer.norm)."""

    layer: ContextLayer
    std: float = 0.0

    def sample(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        return self.layer.norm.astype(np.float32)


@dataclass(frozen=True)
class ContextValues:
    """attn_v [G d, D] of the context layer: a SHORT or LONG group's first C values are the token's topic n_v, the
    PREVIOUS group's first Z its identity z_v (read from the normed embedding, compensated for the attn_norm
    weight); the rest zero."""

    seed: int
    attn_norm: tuple  # (Init, draw name) of blk.0.attn_norm
    n_head: int
    head_dim: int
    std: float = 0.0
    exact: ClassVar[bool] = True

    def sample(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        rows, n_embd = shape
        n_kv = rows // self.head_dim
        b_topic, _, b_token, _ = bases(self.seed, n_embd)
        weight = _norm_values(self.seed, self.attn_norm, n_embd)
        unit = embedding_rms(n_embd) / np.sqrt(n_embd - 1)
        topic_read = b_topic.T * (unit / TOPIC_SHARE) / weight[None, :]  # [C, D]
        token_read = b_token.T * (unit / TOKEN_SHARE) / weight[None, :]  # [Z, D]
        out = np.zeros(shape, np.float32)
        for g, kind in enumerate(head_kinds(self.n_head, n_kv)[:: self.n_head // n_kv]):
            read = token_read if kind == PREVIOUS else topic_read
            out[g * self.head_dim : g * self.head_dim + len(read)] = read
        return out


@dataclass(frozen=True)
class ContextOutput:
    """attn_output [D, H d] of the context layer: SHORT heads write their topic average along B_context, LONG heads
    subtract theirs there, PREVIOUS heads write theirs along B_previous; scaled to steady norms (CONTEXT_SHARE and
    PREVIOUS_SHARE of sqrt(D - 1); ContextLayer's powers are their mean squares for unit-power values)."""

    seed: int
    layer: ContextLayer
    n_kv_head: int
    head_dim: int
    std: float = 0.0
    exact: ClassVar[bool] = True

    def sample(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        n_embd, cols = shape
        n_head = cols // self.head_dim
        _, b_context, _, b_previous = bases(self.seed, n_embd)
        kinds = head_kinds(n_head, self.n_kv_head)
        count = np.bincount(kinds, minlength=3)
        context = CONTEXT_SHARE * np.sqrt(n_embd - 1) / np.sqrt(self.layer.context_power)
        previous = PREVIOUS_SHARE * np.sqrt(n_embd - 1) / np.sqrt(self.layer.previous_power)
        writes = {
            SHORT: b_context * context / count[SHORT],
            LONG: -b_context * context / count[LONG],
            PREVIOUS: b_previous * previous / count[PREVIOUS],
        }
        out = np.zeros(shape, np.float32)
        for h, kind in enumerate(kinds):
            write = writes[int(kind)]
            out[:, h * self.head_dim : h * self.head_dim + write.shape[1]] = write
        return out


@dataclass(frozen=True)
class ContextRouter:
    """ffn_gate_inp [E, D]: context_scale B_context u_le + token_scale B_token u'_le + previous_scale B_previous
    u''_le, compensated for the FFN norm's weight; popularity and the arch's skew offsets in the bias channel."""

    seed: int
    regime: ContextRouting
    norm: tuple  # (Init, draw name) of the layer's FFN norm
    skew: float
    skew_scale: float
    std: float = 0.0  # an F32 tensor: never drawn as random blocks

    def sample(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        n_expert, n_embd = shape
        _, b_context, b_token, b_previous = bases(self.seed, n_embd)
        r, rms = self.regime, router_rms(n_embd)
        rows = np.zeros(shape)
        for basis, std, share in (
            (b_context, r.context, CONTEXT_SHARE),
            (b_token, r.token, TOKEN_SHARE),
            (b_previous, r.previous, PREVIOUS_SHARE),
        ):
            # a unit direction against a part of norm share * sqrt(D - 1) / rms spread over its dims
            scale = std * np.sqrt(basis.shape[1]) * rms / (share * np.sqrt(n_embd - 1))
            rows += scale * _unit_rows(rng.standard_normal((n_expert, basis.shape[1]))) @ basis.T
        offsets = r.popularity * rng.standard_normal(n_expert) + skew_offsets(rng, n_expert, self.skew, self.skew_scale)
        offsets[rng.permutation(n_expert)[: r.head]] += r.head_boost
        rows[:, BIAS_CHANNEL] = offsets * rms / BIAS_CHANNEL_VALUE
        weight = _norm_values(self.seed, self.norm, n_embd)
        return (rows / weight[None, :]).astype(np.float32)


def shape_context_routing(c: SynthConfig, tensors: list, tensor_name: Callable, ffn_norm) -> list:
    """The tensor list of a model routed by regime c.routing (see the module docstring); `tensor_name(tensor, layer)`
    names a layer's tensor (moeprep/synth/parts.py's), `ffn_norm` is the arch's FFN norm tensor."""
    from gguf import MODEL_TENSOR as T

    regime = CONTEXT_REGIMES[c.routing]
    by_name = {t.name: t for t in tensors}
    layer = ContextLayer.build(c.rope_freq_base, c.head_dim, regime.window, c.n_ctx)
    attn_norm = by_name[tensor_name(T.ATTN_NORM, 0)]
    context = {
        tensor_name(T.ATTN_Q, 0): ConstantProjection(layer, c.n_head, c.n_head_kv, key=False),
        tensor_name(T.ATTN_K, 0): ConstantProjection(layer, c.n_head, c.n_head_kv, key=True),
        tensor_name(T.ATTN_Q_NORM, 0): KernelNorm(layer),
        tensor_name(T.ATTN_K_NORM, 0): KernelNorm(layer),
        tensor_name(T.ATTN_V, 0): ContextValues(c.seed, (attn_norm.init, attn_norm.draw), c.n_head, c.head_dim),
        tensor_name(T.ATTN_OUT, 0): ContextOutput(c.seed, layer, c.n_head_kv, c.head_dim),
    }
    out = []
    for t in tensors:
        if t.name.startswith("token_embd."):
            t = dataclasses.replace(t, init=RegimeEmbedding(c.seed))
        elif t.name in context:
            t = dataclasses.replace(t, init=context[t.name])
        elif isinstance(t.init, Router):
            norm = by_name[tensor_name(ffn_norm, int(t.name.split(".")[1]))]
            init = ContextRouter(c.seed, regime, (norm.init, norm.draw), t.init.skew, t.init.skew_scale)
            t = dataclasses.replace(t, init=init)
        elif t.residual_axis is not None and isinstance(t.init, Normal):
            t = dataclasses.replace(t, init=dataclasses.replace(t.init, std=t.init.std * RESIDUAL_SCALE))
        out.append(t)
    return out
