"""How a synthetic model's routers pick experts: the table of routings (`SynthConfig.routing`), and `token-id`.

With random weights a router picks experts nearly uniformly and independently token by token, so an expert cache
gets only its share of the experts, whatever its policy. Real models route with skew (some experts much busier)
and locality (a token reuses many of the previous token's experts). A routing regime's name (`qwen3-30b`) builds
context-driven routing into the weights (moeprep/synth/context_routing.py): what the benchmark models use.
`routing="token-id"` is the older construction, kept for comparison: in effect a lookup from the token id to an
expert set, so context barely moves a token's choice and the hit rate comes from the skew of token frequencies:

- Token directions. Tokens that follow each other in the shipped calibration text (moeprep/data/calibration.txt,
  never the held-out text a benchmark decodes) get nearby directions in an R-dimensional space: a spectral
  embedding (Laplacian eigenmap) of the symmetric next-token graph, i.e. the R leading non-trivial eigenvectors of
  D^-1/2 A D^-1/2 with A[a, b] counting a next to b. Rows are normalised to unit length; tokens the text never
  shows (and padding tokens) get random directions.
- Embeddings carry them. Token v's embedding is sqrt(D - 1) * (EMBED_ALIGNED * B s_v + rest * z_v) with B [D, R]
  an orthonormal basis (seeded) and z_v a random unit vector orthogonal to it; the bias channel keeps its constant.
- The residual stream keeps them. Every tensor that writes into the residual stream (attention output, expert and
  shared-expert down projections) is scaled by RESIDUAL_SCALE, so what a router sees is mostly the token's
  embedding.
- Routers read them. Layer l's router row for expert j is LOGIT_SCALE * B q_lj (scaled for the normed
  embedding), q_lj a random unit direction per layer and expert, divided channel by channel by the layer's FFN norm
  weight so the norm's noise does not blur the choice. A token picks the K experts whose directions are closest to
  its own; consecutive tokens of related text point the same way and share experts, and frequent tokens make their
  experts busy. `skew` still adds the arch's per-expert offsets on top.

Measured with `moeprep profile` on held-out text, see docs/expert-cache.md: the hottest 10% of experts take 25-50%
of the selections and 30-45% of a token's experts are selected again by the next token.
Letters: V vocabulary, D n_embd, R token-direction dimensions, E experts.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from moeprep.synth.config import ROUTING_KINDS, SynthConfig
from moeprep.synth.context_routing import CONTEXT_REGIMES, shape_context_routing
from moeprep.synth.tokenizer import TOKENIZER_PATH, VOCAB_SIZE
from moeprep.synth.weights import BIAS_CHANNEL, BIAS_CHANNEL_VALUE, Normal, Router, skew_offsets, tensor_rng

DIRECTION_DIMS = 10  # R: fewer dimensions, more sharing between neighbours (more reuse and more skew)
EMBED_ALIGNED = 0.95  # share of an embedding's norm along its token direction
LOGIT_SCALE = 4.0  # router logits span about +-LOGIT_SCALE: the gate weights' sharpness
RESIDUAL_SCALE = 0.05  # residual writers' scale: the stream stays close to the token's embedding
CALIBRATION = TOKENIZER_PATH.parent / "calibration.txt"
ROW_CHUNK = 4096  # embedding rows drawn at once (bounds memory for large vocabularies)
SUBSPACE, SUBSPACE_ITERATIONS = 24, 30  # block size (>= R + 1) and steps of the eigenvector iteration


@functools.cache
def token_directions(n_dims: int = DIRECTION_DIMS) -> np.ndarray:
    """[VOCAB_SIZE, R] unit directions from the calibration text's next-token graph; zero rows for tokens the text
    never shows. The leading eigenvectors come from a seeded subspace iteration (a second on a free core; a full
    eigendecomposition takes ten), signs fixed with the largest entry positive."""
    from tokenizers import Tokenizer

    ids = np.array(Tokenizer.from_file(str(TOKENIZER_PATH)).encode(CALIBRATION.read_text()).ids)
    adjacency = np.zeros((VOCAB_SIZE, VOCAB_SIZE))
    np.add.at(adjacency, (ids[:-1], ids[1:]), 1.0)
    adjacency += adjacency.T
    degree = adjacency.sum(axis=1)
    scale = np.divide(1.0, np.sqrt(degree), out=np.zeros(VOCAB_SIZE), where=degree > 0)
    graph = scale[:, None] * adjacency * scale[None, :]  # eigenvalues in [-1, 1]
    shifted = (graph + np.eye(VOCAB_SIZE)) / 2  # the same eigenvectors, eigenvalues in [0, 1]: top ones dominate
    basis = np.linalg.qr(np.random.default_rng(0).standard_normal((VOCAB_SIZE, SUBSPACE)))[0]
    for _ in range(SUBSPACE_ITERATIONS):
        basis = np.linalg.qr(shifted @ (shifted @ basis))[0]
    values, vectors = np.linalg.eigh(basis.T @ graph @ basis)
    lead = (basis @ vectors[:, np.argsort(-values)])[:, 1 : n_dims + 1]  # the first is the trivial sqrt(degree)
    lead *= np.sign(lead[np.abs(lead).argmax(axis=0), np.arange(n_dims)])
    norm = np.linalg.norm(lead, axis=1, keepdims=True)
    return np.where(degree[:, None] > 0, lead / np.maximum(norm, 1e-12), 0.0)


def direction_basis(seed: int, n_embd: int, n_dims: int) -> np.ndarray:
    """[D, R] orthonormal columns, zero in the bias channel: where token directions live in the residual stream."""
    rng = tensor_rng(seed, "routing.basis")
    basis, _ = np.linalg.qr(rng.standard_normal((n_embd - 1, n_dims)))
    return np.insert(basis, BIAS_CHANNEL, 0.0, axis=0)


def _unit_rows(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@dataclass(frozen=True)
class TextEmbedding:
    """token_embd [V, D]: each token along its direction (random for tokens without one), plus a private part."""

    seed: int
    n_dims: int = DIRECTION_DIMS
    std: float = 1.0

    def sample(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        n_vocab, n_embd = shape
        basis = direction_basis(self.seed, n_embd, self.n_dims)
        known = np.zeros((n_vocab, self.n_dims))
        known[:VOCAB_SIZE] = token_directions(self.n_dims)[:n_vocab]
        out = np.empty(shape, np.float32)
        rest = np.sqrt(1.0 - EMBED_ALIGNED**2)
        for start in range(0, n_vocab, ROW_CHUNK):
            rows = slice(start, min(start + ROW_CHUNK, n_vocab))
            direction = known[rows]
            missing = ~direction.any(axis=1)
            direction[missing] = _unit_rows(rng.standard_normal((int(missing.sum()), self.n_dims)))
            private = rng.standard_normal((len(direction), n_embd))
            private[:, BIAS_CHANNEL] = 0.0
            private = _unit_rows(private - (private @ basis) @ basis.T)
            out[rows] = np.sqrt(n_embd - 1) * (EMBED_ALIGNED * direction @ basis.T + rest * private)
        out[:, BIAS_CHANNEL] = BIAS_CHANNEL_VALUE
        return out


@dataclass(frozen=True)
class TextRouter:
    """ffn_gate_inp [E, D]: expert directions of one layer in the token-direction space, compensated for the FFN
    norm's weight `norm` (drawn as that tensor is, from `norm_draw`), with the arch's skew offsets."""

    seed: int
    norm: Normal
    norm_draw: str
    skew: float
    skew_scale: float
    n_dims: int = DIRECTION_DIMS
    std: float = 0.0  # an F32 tensor: never drawn as random blocks

    def sample(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        n_expert, n_embd = shape
        basis = direction_basis(self.seed, n_embd, self.n_dims)
        experts = _unit_rows(rng.standard_normal((n_expert, self.n_dims)))
        # an RMS-normed embedding has norm sqrt(D) * (its aligned share) along its direction, and this bias channel
        normed_rms = np.sqrt((n_embd - 1 + BIAS_CHANNEL_VALUE**2) / n_embd)
        rows = LOGIT_SCALE * normed_rms / (EMBED_ALIGNED * np.sqrt(n_embd - 1)) * experts @ basis.T
        offsets = skew_offsets(rng, n_expert, self.skew, self.skew_scale)
        rows[:, BIAS_CHANNEL] = offsets * normed_rms / BIAS_CHANNEL_VALUE
        weight = self.norm.sample(tensor_rng(self.seed, self.norm_draw), (n_embd,))
        return (rows / weight[None, :]).astype(np.float32)


def _text(c: SynthConfig, tensors: list) -> list:
    from moeprep.synth.archs import ARCHS, tensor_name

    by_name = {t.name: t for t in tensors}
    ffn_norm = ARCHS[c.arch].ffn_norm
    out = []
    for t in tensors:
        if t.name.startswith("token_embd."):
            t = dataclasses.replace(t, init=TextEmbedding(c.seed))
        elif isinstance(t.init, Router):
            layer = int(t.name.split(".")[1])
            norm = by_name[tensor_name(ffn_norm, layer)]
            t = dataclasses.replace(t, init=TextRouter(c.seed, norm.init, norm.draw, t.init.skew, t.init.skew_scale))
        elif t.residual_axis is not None and isinstance(t.init, Normal):
            t = dataclasses.replace(t, init=dataclasses.replace(t.init, std=t.init.std * RESIDUAL_SCALE))
        out.append(t)
    return out


def _regime(c: SynthConfig, tensors: list) -> list:
    from moeprep.synth.archs import ARCHS, tensor_name

    return shape_context_routing(c, tensors, tensor_name, ARCHS[c.arch].ffn_norm)


# SynthConfig.routing -> how the tensor list is changed; "random": as drawn (uniform routing, moved only by skew);
# a regime's name: moeprep/synth/context_routing.py.
ROUTINGS: dict[str, Callable[[SynthConfig, list], list]] = {
    "random": lambda c, tensors: tensors,
    "token-id": _text,
    **{name: _regime for name in CONTEXT_REGIMES},
}
assert tuple(ROUTINGS) == ROUTING_KINDS


def shape_routing(c: SynthConfig, tensors: list) -> list:
    return ROUTINGS[c.routing](c, tensors)


# --- what the construction is judged by (the definitions of bench/train_moe/routing.py) ------------------------------


def hot_share(selections: np.ndarray, fraction: float = 0.1) -> np.ndarray:
    """[M] share of each layer's selections [M, E] taken by its round(E * fraction) most selected experts."""
    n_hot = max(1, round(selections.shape[1] * fraction))
    return -np.sort(-selections, axis=1)[:, :n_hot].sum(axis=1) / np.maximum(selections.sum(axis=1), 1)


def next_token_reuse(ids: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """[M] mean share of a token's K experts the previous token of its chunk also selected; ids [N, M, K] with
    chunks starting at `starts` (a RoutingTrace's ids and starts)."""
    again = (ids[1:, :, :, None] == ids[:-1, :, None, :]).any(axis=-1)  # [N-1, M, K]
    keep = np.ones(len(ids) - 1, bool)
    keep[starts[(starts > 0) & (starts < len(ids))] - 1] = False  # a chunk's first token has no previous one
    return again[keep].mean(axis=(0, 2))
