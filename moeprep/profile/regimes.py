"""Routing regimes with names: generators of routing traces that behave, for an expert cache, like the routing of
real models measured in public, at any shape (a replay needs the model's own).

Every regime but `trained` is one generator, `latent_routing`, with its own parameters. Reuse comes from context
as a real router's does: a context state c_t (a point in R^DIMS) drifts from token to token,
c_t = rho * c_{t-1} + sqrt(1 - rho^2) * n_t with n_t standard normal, so consecutive tokens see nearby states and
the state forgets itself over about 1 / (1 - rho) tokens. Each token also has an identity: an id drawn from a Zipf
law over VOCAB ids, each id with a fixed direction w_v. Layer l's router scores expert e as

    logit = context * <u_le, c_t> + token * <u_le, w_v> + noise * g_tle + popularity * b_le

with u_le a random unit direction of the expert, g standard normal per token (what neither context nor token
explains) and b_le a fixed standard normal offset (some experts busier than others), plus `head_boost` for `head`
experts of each layer (a heavy head: a few experts every context favours). The K largest logits are the
token's choice; their softmax, renormalised over the K, its gate weights. A chat session (`turn` > 0) is a series
of turns of about `turn` tokens; at each turn's start the state jumps to a fresh draw (a new message, a new topic)
while the session's cache carries on. `latent_routing_hidden` also gives what the router knows and a cache does not
(`Hidden`: the states c_t, the directions u_le, the offsets), which the policy bench's state oracle ranks by.

A regime's targets are stated at its own shape (`shape`), over a trace of `target_tokens` tokens in chunks of
`target_chunk`, and checked by tests/profile/test_routing.py with `moeprep routing stats`'s definitions
(routing_stats.py). At other shapes the same parameters give the same kind of routing, not the same numbers.

Letters: T tokens of a chunk, M MoE layers, E experts, K experts per token, D context dimensions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moeprep.errors import MoeprepError
from moeprep.profile.routing_stats import RoutingStats, hot_share, routing_stats
from moeprep.profile.tracefile import TraceFile

DIMS = 16  # D: context dimensions
VOCAB = 4096  # token ids of the Zipf draw
ZIPF = 1.1  # exponent of the token-id law (text's is about 1)
SHAPE_STATS = ("hot", "next_reuse", "window_reuse")  # targets that are not a policy's hit rate
TRAINED_TRACE = Path(__file__).resolve().parents[1] / "data" / "trained-routing.npz"


@dataclass(frozen=True)
class Latent:
    """latent_routing's parameters (see the module's docstring)."""

    rho: float  # the context's persistence per token
    context: float
    token: float
    noise: float
    popularity: float
    turn: int = 0  # chat: mean tokens per turn (0: one running text)
    head: int = 0  # experts per layer that every context favours (a heavy head of popularity) ...
    head_boost: float = 0.0  # ... by this much on their logits


@dataclass(frozen=True)
class Target:
    """One measured property a regime's trace must show: `stat` of routing_stats in [low, high].

    stat: "hot" (share of the top `fraction` of experts), "next_reuse", "window_reuse", or a policy name (its hit
    rate with `size` of the experts cached, warm or cold); `label`: only the chunks of that kind."""

    stat: str
    low: float
    high: float
    size: float = 0.0
    warm: bool = True
    fraction: float = 0.10
    label: str | None = None

    def describe(self) -> str:
        where = f" on {self.label}" if self.label else ""
        if self.stat == "hot":
            what = f"top {self.fraction:.1%} of experts' share of choices"
        elif self.stat in ("next_reuse", "window_reuse"):
            what = {"next_reuse": "next-token reuse", "window_reuse": "reuse within 8 tokens"}[self.stat]
        else:
            what = f"{self.stat} hit rate at {self.size:.1%} cached ({'after 64 tokens' if self.warm else 'cold'})"
        return f"{what}{where} in {self.low:.1%}..{self.high:.1%}"

    def measure(self, s: RoutingStats) -> float:
        """The value on stats `s` (for "hot", s must have been taken at this target's fraction)."""
        if self.stat == "hot":
            return float(s.hot_share.mean())
        if self.stat == "next_reuse":
            return float(s.next_reuse.mean())
        if self.stat == "window_reuse":
            return float(s.window_reuse.mean())
        return s.rate(self.stat, self.size, self.warm)


@dataclass(frozen=True)
class Shape:
    layers: int
    experts: int
    top_k: int


@dataclass(frozen=True)
class Regime:
    name: str
    about: str  # one line
    shape: Shape  # the shape the targets are stated at
    targets: tuple[Target, ...]
    generate: Callable[..., TraceFile]  # (shape, lengths, seed, hidden=False) -> trace (and Hidden if hidden)
    source: str  # where the targets come from
    target_tokens: int = 8192
    target_chunk: int = 1024
    labels: tuple[str, ...] = ()  # chunk kinds, alternating


def _zipf_tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    p = 1.0 / np.arange(1, VOCAB + 1) ** ZIPF
    return rng.choice(VOCAB, size=n, p=p / p.sum())


def _context(rng: np.random.Generator, n: int, rho: float, turn: int) -> np.ndarray:
    """[T, D] the drifting state; with `turn`, a fresh draw at each turn's start (turn lengths geometric)."""
    states = np.empty((n, DIMS))
    step = rng.standard_normal((n, DIMS))
    fresh = np.zeros(n, bool)
    fresh[0] = True
    if turn:
        fresh |= rng.random(n) < 1.0 / turn
    keep = np.sqrt(1.0 - rho**2)
    c = step[0]
    for t in range(n):
        c = step[t] if fresh[t] else rho * c + keep * step[t]
        states[t] = c
    return states


@dataclass(frozen=True)
class Hidden:
    """What a latent_routing router knows and a policy that sees only its choices does not: the context states and
    the router's parameters. Given the state at token t, the choices after t do not depend on the choices before
    it, so an online policy can infer from the past at most this (the bench's state oracle ranks by it)."""

    p: Latent
    states: np.ndarray  # [N, D] the context state c_t of every token (chunks laid end to end)
    directions: np.ndarray  # [M, E, D] u_le
    offsets: np.ndarray  # [M, E] popularity * b_le, head boost included

    def expected_logits(self, layer: int, states: np.ndarray, ahead: float) -> np.ndarray:
        """[T, E] the mean of layer's logits `ahead` tokens after each of `states` [T, D], over the unknowns (the
        state's drift, the token's id, the noise): context * rho**ahead * <u_le, c_t> + offset. Every expert's logit
        has the same spread around it, so ranking by it ranks, roughly, by the chance of being chosen then."""
        scale = self.p.context * self.p.rho**ahead
        return scale * states @ self.directions[layer].T + self.offsets[layer]


def latent_routing(
    p: Latent,
    shape: Shape,
    lengths: list[int],
    seed: int,
    labels: list[str] | None = None,
    turns: dict[str, int] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """ids [N, M, K] int64 and weights [N, M, K] float32 for chunks of `lengths` tokens (each a fresh session).
    turns: a chunk label's turn length, over p.turn."""
    ids, weights, _ = latent_routing_hidden(p, shape, lengths, seed, labels, turns)
    return ids, weights


def latent_routing_hidden(
    p: Latent,
    shape: Shape,
    lengths: list[int],
    seed: int,
    labels: list[str] | None = None,
    turns: dict[str, int] | None = None,
) -> tuple[np.ndarray, np.ndarray, Hidden]:
    """latent_routing's ids and weights, and its hidden state."""
    rng = np.random.default_rng(seed)
    m, e, k = shape.layers, shape.experts, shape.top_k
    if k > e:
        raise MoeprepError(f"top-k {k} is more than the {e} experts")
    experts = rng.standard_normal((m, e, DIMS))
    experts /= np.linalg.norm(experts, axis=2, keepdims=True)  # u_le
    offsets = p.popularity * rng.standard_normal((m, e))  # b_le
    for layer in range(m):
        offsets[layer, rng.permutation(e)[: p.head]] += p.head_boost
    words = rng.standard_normal((VOCAB, DIMS)) / np.sqrt(DIMS)  # w_v, about unit length
    ids, weights, states = [], [], []
    for c, n in enumerate(lengths):
        turn = (turns or {}).get(labels[c], p.turn) if labels else p.turn
        state = _context(rng, n, p.rho, turn)  # [T, D]
        tokens = _zipf_tokens(rng, n)
        drive = p.context * state + p.token * words[tokens]  # [T, D]
        chunk_ids = np.empty((n, m, k), np.int64)
        chunk_w = np.empty((n, m, k), np.float32)
        for layer in range(m):
            logits = drive @ experts[layer].T + p.noise * rng.standard_normal((n, e)) + offsets[layer]
            top = np.argpartition(-logits, k - 1, axis=1)[:, :k]
            chosen = np.take_along_axis(logits, top, axis=1)
            order = np.argsort(-chosen, axis=1)  # router order: the most probable first
            top, chosen = np.take_along_axis(top, order, axis=1), np.take_along_axis(chosen, order, axis=1)
            w = np.exp(chosen - chosen[:, :1])
            chunk_ids[:, layer], chunk_w[:, layer] = top, w / w.sum(axis=1, keepdims=True)
        ids.append(chunk_ids)
        weights.append(chunk_w)
        states.append(state)
    return np.concatenate(ids), np.concatenate(weights), Hidden(p, np.concatenate(states), experts, offsets)


def chunk_lengths(tokens: int, chunk: int) -> list[int]:
    """Chunks of `chunk` tokens, the last one shorter if need be."""
    if tokens < 1 or chunk < 1:
        raise MoeprepError("--tokens and --chunk must be at least 1")
    return [chunk] * (tokens // chunk) + ([tokens % chunk] if tokens % chunk else [])


def _latent_generator(
    name: str, p: Latent, source: str, labels: tuple[str, ...] = (), turns: dict[str, int] | None = None
):
    def generate(shape: Shape, lengths: list[int], seed: int, hidden: bool = False) -> TraceFile:
        chunk_labels = [labels[c % len(labels)] for c in range(len(lengths))] if labels else None
        ids, weights, state = latent_routing_hidden(p, shape, lengths, seed, chunk_labels, turns)
        trace = TraceFile(
            ids,
            np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            shape.experts,
            weights,
            regime=name,
            source=f"moeprep routing generate --regime {name} --seed {seed}",
            labels=None if chunk_labels is None else np.array(chunk_labels),
        )
        return (trace, state) if hidden else trace

    generate.__doc__ = f"A `{name}` trace: latent_routing with {p}. Targets from {source}."
    return generate


# --- trained: the bench model's own routing --------------------------------------------------------------------------

TRAINED_SHAPE = Shape(6, 32, 4)


def _trained(shape: Shape, lengths: list[int], seed: int, hidden: bool = False) -> TraceFile:
    """The recorded routing of the trained bench model (bench/models/bench-qwen3moe-f16.gguf: 6 MoE layers, 32
    experts, top-4) on held-out text, taken in order, its 512-token windows laid end to end and cut into `lengths`.
    At another shape, by this rule: layer l follows recorded layer l mod 6, its expert ids relabelled by a permutation
    seeded with l // 6 (so repeated layers are not copies); each recorded expert j stands for the E/32 experts
    j*E/32 .. (j+1)*E/32 - 1 (its split into finer experts), and a choice of j becomes K/4 of them: the block of
    K/4 starting at ((rank // 2) * K/4) mod (E/32), rank the choice's place in the router's order (0: the most
    probable), so a token's first two choices take their experts' first part and its last two the next. E must be
    a multiple of 32 and K of 4, with K/4 <= E/32. Targets from `moeprep profile` of that model on held-out text
    (LRU 50.0% at 25% and 78.5% at 50% cached)."""
    if hidden:
        raise MoeprepError("the trained regime is recorded routing: it has no hidden state to show")
    with np.load(TRAINED_TRACE) as z:
        recorded = z["experts"].astype(np.int64)  # [N, 6, 4]
    if sum(lengths) > len(recorded):
        raise MoeprepError(f"the trained regime has {len(recorded)} recorded tokens; ask for at most that many")
    e0, k0 = TRAINED_SHAPE.experts, TRAINED_SHAPE.top_k
    split, per_choice = shape.experts // e0, shape.top_k // k0
    if shape.experts % e0 or shape.top_k % k0 or per_choice > split:
        raise MoeprepError(
            f"the trained regime maps its {e0} experts top-{k0} to a multiple: experts a multiple of "
            f"{e0} and top-k a multiple of {k0}, top-k/{k0} at most experts/{e0} "
            f"(not {shape.experts} experts top-{shape.top_k})"
        )
    src = recorded[: sum(lengths)]
    out = np.empty((len(src), shape.layers, shape.top_k), np.int64)
    for layer in range(shape.layers):
        ids = src[:, layer % TRAINED_SHAPE.layers]
        if layer >= TRAINED_SHAPE.layers:
            ids = np.random.default_rng(layer // TRAINED_SHAPE.layers).permutation(e0)[ids]
        rank = np.arange(k0)
        first = ((rank // 2) * per_choice) % split  # [K0]
        sub = (first[:, None] + np.arange(per_choice)[None, :]) % split  # [K0, K/K0]
        out[:, layer] = (ids[:, :, None] * split + sub[None]).reshape(len(src), -1)
    return TraceFile(
        out,
        np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        shape.experts,
        regime="trained",
        source="moeprep routing generate --regime trained (recorded routing)",
    )


# --- the regimes -----------------------------------------------------------------------------------------------------

QWEN3 = Latent(rho=0.985, context=3.0, token=0.5, noise=1.5, popularity=0.2)
FINE = Latent(rho=0.85, context=1.3, token=0.4, noise=1.25, popularity=0.4)
SKEWED = Latent(rho=0.5, context=0.3, token=0.3, noise=1.0, popularity=0.3, head=12, head_boost=1.7)
CHAT = Latent(rho=0.99, context=3.0, token=0.5, noise=1.1, popularity=0.4)
CHAT_TURNS = {"chat": 16, "long": 0}  # mean tokens between topic jumps in each kind of chunk (0: none)

SOURCES = {
    "qwen3-30b": "kekzl/imp PR #1359 (per-layer LRU at 40%: 90-95% after warm-up; 45% of choices repeat at the next "
    "token, 80% within 8) and the gpu-container handbook (90% of routing mass needs 45-51% of experts)",
    "fine-512": "kekzl/imp PR #2061 (LRU at 18 / 36 / 54% of 512 experts: 43.5 / 62.0 / 72.0%) and ggml-org/llama.cpp "
    "PR #27861 (LRU trace replay at 12.5 / 25%: about 67 / 81%)",
    "skewed-256": "FreeToken #174 and colibri #864 (LRU at about 4.5% cached: 8-18% against a frequency oracle's 46%; "
    "the top 12.5% of experts take 58.5% of the choices)",
    "chat-glm": "neurall/llama.cpp README and release b11399 (usage decay and pay-back eviction at about 35%: 85-88% "
    "after warm-up on long text, 69.8% in a chat regression check)",
    "trained": "`moeprep profile` of bench/models/bench-qwen3moe-f16.gguf on held-out text (LRU 50.0% at 25% and "
    "78.5% at 50% cached)",
}

REGIMES: dict[str, Regime] = {
    r.name: r
    for r in (
        Regime(
            "qwen3-30b",
            "Qwen3-30B-A3B-like: flat popularity, strong reuse from context",
            Shape(48, 128, 8),
            (
                Target("hot", 0.10, 0.22),
                Target("next_reuse", 0.40, 0.50),
                Target("window_reuse", 0.74, 0.86),
                Target("lru", 0.90, 0.96, size=0.40),
            ),
            _latent_generator("qwen3-30b", QWEN3, SOURCES["qwen3-30b"]),
            SOURCES["qwen3-30b"],
        ),
        Regime(
            "fine-512",
            "fine-grained, Qwen3.8-Flash-Next-like: 512 experts top-10, weaker reuse",
            Shape(8, 512, 10),
            (
                Target("lru", 0.395, 0.475, size=0.18),
                Target("lru", 0.58, 0.66, size=0.36),
                Target("lru", 0.68, 0.76, size=0.54),
            ),
            _latent_generator("fine-512", FINE, SOURCES["fine-512"]),
            SOURCES["fine-512"],
        ),
        Regime(
            "skewed-256",
            "DeepSeek-V4-Flash-like: 256 experts, strongly skewed, little reuse",
            Shape(8, 256, 8),
            (
                Target("hot", 0.525, 0.645, fraction=0.125),
                Target("lru", 0.10, 0.30, size=0.045),
                Target("oracle", 0.38, 0.52, size=0.045),
            ),
            _latent_generator("skewed-256", SKEWED, SOURCES["skewed-256"]),
            SOURCES["skewed-256"],
        ),
        Regime(
            "chat-glm",
            "GLM-5.3-Flash-like: 288 experts top-8, chat turns or long text",
            Shape(8, 288, 8),
            (
                Target("cost-payback", 0.65, 0.75, size=0.35, label="chat"),
                Target("cost-payback", 0.83, 0.90, size=0.35, label="long"),
            ),
            _latent_generator("chat-glm", CHAT, SOURCES["chat-glm"], ("chat", "long"), CHAT_TURNS),
            SOURCES["chat-glm"],
            labels=("chat", "long"),
        ),
        Regime(
            "trained",
            "the trained bench model's own routing, recorded",
            TRAINED_SHAPE,
            (Target("lru", 0.45, 0.55, size=0.25), Target("lru", 0.735, 0.835, size=0.50)),
            _trained,
            SOURCES["trained"],
            target_chunk=512,
        ),
    )
}


def regime(name: str) -> Regime:
    if name not in REGIMES:
        raise MoeprepError(f"unknown routing regime {name!r}; choose one of {', '.join(REGIMES)}")
    return REGIMES[name]


def generate(name: str, shape: Shape, tokens: int, chunk: int, seed: int = 0) -> TraceFile:
    _check_shape(shape)
    return regime(name).generate(shape, chunk_lengths(tokens, chunk), seed)


def generate_with_hidden(name: str, shape: Shape, tokens: int, chunk: int, seed: int = 0) -> tuple[TraceFile, Hidden]:
    """`generate`'s trace and the router's hidden state behind it (latent_routing regimes only)."""
    _check_shape(shape)
    return regime(name).generate(shape, chunk_lengths(tokens, chunk), seed, hidden=True)


def _check_shape(shape: Shape) -> None:
    if min(shape.layers, shape.experts, shape.top_k) < 1:
        raise MoeprepError("--layers, --experts and --top-k must be at least 1")
    if shape.top_k > shape.experts:
        raise MoeprepError(f"--top-k {shape.top_k} is more than --experts {shape.experts}")


@dataclass
class TargetCheck:
    target: Target
    value: float

    @property
    def met(self) -> bool:
        return self.target.low <= self.value <= self.target.high


def check_targets(r: Regime, t: TraceFile, progress=None) -> list[TargetCheck]:
    """Measure every target of `r` on trace `t` (chunks of the target's label only, where it has one)."""
    out = []
    for label in dict.fromkeys(x.label for x in r.targets):
        group = [x for x in r.targets if x.label == label]
        sub = t if label is None else _chunks_labelled(t, label)
        policies = tuple(dict.fromkeys(x.stat for x in group if x.stat not in SHAPE_STATS))
        sizes = tuple(dict.fromkeys(x.size for x in group if x.stat in policies))
        s = routing_stats(sub, sizes, policies, progress=progress)
        for x in group:
            value = float(hot_share(sub.ids, sub.n_expert, x.fraction).mean()) if x.stat == "hot" else x.measure(s)
            out.append(TargetCheck(x, value))
    return out


def _chunks_labelled(t: TraceFile, label: str) -> TraceFile:
    if t.labels is None or label not in set(t.labels.tolist()):
        raise MoeprepError(f"the trace has no chunks labelled {label!r}; generate it with its regime")
    keep = np.flatnonzero(t.labels == label)
    parts = [t.ids[t.starts[c] : t.starts[c + 1]] for c in keep]
    lengths = [len(p) for p in parts]
    return TraceFile(
        np.concatenate(parts),
        np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        t.n_expert,
        regime=t.regime,
        labels=np.array([label] * len(keep)),
    )


def target_shape_trace(r: Regime, seed: int = 0) -> TraceFile:
    """A trace of the regime at the shape and length its targets are stated for."""
    return generate(r.name, r.shape, r.target_tokens, r.target_chunk, seed)
