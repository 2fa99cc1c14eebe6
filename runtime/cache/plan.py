"""Which plan the expert cache runs, and which policy, chosen at start by a cost model of a decode step's expert
traffic. numpy only.

Three plans fill the same VRAM (the slots' room, after the non-expert weights and the reserve):

- `cache`: every MoE layer gets slots (placement.py splits them by measured need) and the policy decides which
  experts they hold;
- `static`: llama.cpp's `--n-cpu-moe` split, run by moerun. As many whole layers as fit hold every one of their
  experts (pinned: never evicted, no policy runs on them); the other layers keep the counts' hottest experts in the
  slots left (at least one each) and never change them once filled; their misses are streamed, or computed by the
  CPU, whichever the model predicts faster;
- `blend`: some whole layers pinned, the room left cached by the policy over the other layers.

`cache` and `blend` read their misses the way the cache does (streamed over the bus where the experts are
page-locked on a GPU, else computed by the CPU).

The cost model counts the bytes a decode token moves for its routed experts, per MoE layer that is not pinned:

    seconds = expert_bytes * ((1 - hit) * K / miss_gbps + uploads / bus_gbps) / 1e9

hit and uploads (per token and layer) are the policy's at that layer's share of experts cached, read from a
`HitCurve`; miss_gbps is the bus's where decode steps stream their misses from page-locked RAM, else moerun's CPU
experts' (`Bandwidths`). The static plan is one of the candidates, so the plan taken never predicts slower than
the static split run by moerun. llama.cpp's own split of the same VRAM, (M - n_split) * K * expert_bytes /
split_gbps (its CPU reading every expert of its layers), is printed beside it. The GPU's own step (the hits'
kernels, attention, routers) is the same in every plan and left out.

Hit curves come, best first, from a routing trace replayed through the runtime's own policies (`moerun bench
--routing`'s trace, or the held-out chunks a profile recorded), else from expert counts (a profile's or those
baked into the GGUF: the hottest set's share, which a static set hits), else the flat guess hit = share.

Letters: M MoE layers, E experts per layer, K experts per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moeprep.errors import MoeprepError
from moeprep.profile.heldout import cache_slots
from moeprep.profile.policy import DEFAULT_POLICY, POLICIES
from moeprep.profile.tracefile import TraceFile

PLANS = ("auto", "cache", "blend", "static")
AUTO = "auto"
REPLAY_TOKENS = 1024  # tokens of a trace replayed at start to measure the policies (a second or so per policy)
CURVE_SIZES = (0.05, 0.10, 0.25, 0.38, 0.50, 0.75)  # shares of a layer's experts where a trace is replayed
GENERAL_POLICY = DEFAULT_POLICY  # without routing to measure: at least the best of LRU, LFU and ClassLRU by hit rate
# in every cell of the policy table (docs/BENCHMARKS.md, "Cache policies on named routing regimes")


@dataclass(frozen=True)
class Bandwidths:
    """The measured speeds of a decode step's expert traffic, GB/s of expert bytes. Defaults: the H200 machine
    (docs/BENCHMARKS.md): decode misses streamed from page-locked RAM and uploads cross PCIe at about 48; moerun's CPU
    expert kernels computing a decode step's misses reach 7.4 (compute-bound at about 2 per core, a few experts per
    layer split over 16 threads); llama.cpp's CPU experts reach 60 there."""

    bus_gbps: float = 48.0  # host to GPU: streamed misses and uploads
    cpu_gbps: float = 7.4  # moerun's CPU computing misses
    split_gbps: float = 60.0  # llama.cpp's CPU computing the experts of its --n-cpu-moe layers


@dataclass(frozen=True)
class HitCurve:
    """One policy's hit rate and uploads per token per layer at shares of a layer's experts cached."""

    policy: str
    sizes: tuple[float, ...]
    hits: tuple[float, ...]
    uploads: tuple[float, ...] | None  # None: not measured (counted as none)
    source: str

    def hit(self, share: float) -> float:
        """Interpolated between the measured shares, through 0 at no slots and 1 at every expert."""
        return float(np.interp(share, (0.0, *self.sizes, 1.0), (0.0, *self.hits, 1.0)))

    def uploads_at(self, share: float) -> float:
        if self.uploads is None or share >= 1.0:
            return 0.0
        return float(np.interp(share, (0.0, *self.sizes, 1.0), (self.uploads[0], *self.uploads, 0.0)))


def trace_curves(
    t: TraceFile,
    policies: tuple[str, ...],
    source: str,
    sizes: tuple[float, ...] = CURVE_SIZES,
    max_tokens: int = REPLAY_TOKENS,
    free: int | None = None,
) -> dict[str, HitCurve]:
    """Each policy's curve from replaying the trace's first chunks (up to max_tokens), every chunk a fresh session
    with caches starting empty, at most `free` uploads per layer and token (the runtime's cap)."""
    from moeprep.profile.routing_stats import hit_rates

    t = first_tokens(t, max_tokens)
    sizes = tuple(s for s in sizes if cache_slots(s, t.n_expert) < t.n_expert) or (sizes[0],)
    _, hits, uploads = hit_rates(t, sizes, policies, free=free)  # [P, S, 2, M], [P, S, M]
    return {
        p: HitCurve(
            p,
            sizes,
            tuple(float(h) for h in hits[i, :, 0].mean(axis=1)),
            tuple(float(u) for u in uploads[i].mean(axis=1)),
            f"{source}, {t.n_tokens} tokens replayed",
        )
        for i, p in enumerate(policies)
    }


def first_tokens(t: TraceFile, max_tokens: int) -> TraceFile:
    """The trace's whole chunks up to max_tokens (at least its first chunk, cut to max_tokens)."""
    ends = t.starts[1:]
    n_chunks = max(1, int(np.searchsorted(ends, max_tokens, side="right")))
    end = min(int(ends[n_chunks - 1]), max_tokens)
    starts = np.minimum(t.starts[: n_chunks + 1], end)
    return TraceFile(t.ids[:end], starts, t.n_expert, regime=t.regime, source=t.source)


def usage_curve(usage: np.ndarray | None, n_expert: int) -> HitCurve:
    """The static set's curve from counts [M, E]: a layer's hottest experts' share of its choices, averaged over
    layers; without counts the flat guess (hit = share)."""
    sizes = CURVE_SIZES
    if usage is None or not np.asarray(usage).sum():
        return HitCurve("static", sizes, sizes, None, "no expert counts: hit rate guessed as the share cached")
    usage = np.asarray(usage, np.float64)
    usage = usage[usage.sum(axis=1) > 0]
    cover = np.cumsum(-np.sort(-usage, axis=1), axis=1) / usage.sum(axis=1, keepdims=True)  # [M, E]
    # the hottest k of E cover at least k / E; the max only undoes cache_slots' rounding down
    hits = tuple(max(s, float(cover[:, cache_slots(s, n_expert) - 1].mean())) for s in sizes)
    return HitCurve("static", sizes, hits, (0.0,) * len(sizes), "the expert counts' hottest experts")


@dataclass(frozen=True)
class Shape:
    """What the plan needs of the model and the budget."""

    n_moe: int  # M
    n_expert: int  # E
    top_k: int  # K
    expert_bytes: int  # one expert (its gate, up and down), the mean over MoE layers
    room: int  # bytes for slots, all GPUs together

    @property
    def layer_bytes(self) -> int:
        return self.n_expert * self.expert_bytes

    @property
    def most_pinned(self) -> int:
        """Whole layers that fit while every other layer keeps at least one slot."""
        n = min(self.n_moe, self.room // self.layer_bytes)
        while n > 0 and self.room - n * self.layer_bytes < (self.n_moe - n) * self.expert_bytes:
            n -= 1
        return int(n)

    def rest_share(self, n_pin: int) -> float:
        """The share of its experts each layer that is not pinned caches, on average, in the room left (placement.py
        hands out every slot that fits)."""
        rest = self.n_moe - n_pin
        if not rest:
            return 1.0
        return min(1.0, (self.room - n_pin * self.layer_bytes) // self.expert_bytes / (rest * self.n_expert))


def token_seconds(shape: Shape, curve: HitCurve, bw: Bandwidths, n_pin: int, stream: bool) -> float:
    """Predicted seconds of expert traffic per decode token with n_pin whole layers pinned and the others cached
    under `curve`'s policy (module docstring)."""
    rest = shape.n_moe - n_pin
    if not rest:
        return 0.0
    share = shape.rest_share(n_pin)
    miss_gbps = bw.bus_gbps if stream else bw.cpu_gbps
    per_layer = (1.0 - curve.hit(share)) * shape.top_k / miss_gbps + curve.uploads_at(share) / bw.bus_gbps
    return rest * shape.expert_bytes * per_layer / 1e9


def split_seconds(shape: Shape, bw: Bandwidths) -> tuple[int, float]:
    """llama.cpp's `--n-cpu-moe` split of the same room, its CPU computing the experts of the layers it does not
    hold: (layers whose experts it holds, seconds per token)."""
    n_split = int(min(shape.n_moe, shape.room // shape.layer_bytes))
    return n_split, (shape.n_moe - n_split) * shape.top_k * shape.expert_bytes / (bw.split_gbps * 1e9)


@dataclass(frozen=True)
class Plan:
    name: str  # cache, blend or static
    pinned: int  # whole MoE layers holding every expert
    policy: str  # the policy of the other layers
    stream: bool  # decode steps stream misses (else the CPU computes them)
    seconds: float  # predicted expert traffic per decode token
    split_layers: int  # llama.cpp's split of the same VRAM: whole layers on the GPU
    split_seconds: float
    others: tuple[tuple[str, float], ...]  # the other plans considered, best of each
    source: str  # where the hit rates came from

    def describe(self) -> str:
        """The line moerun prints at start: the plan and the numbers behind it."""
        others = ", ".join(f"{name} {s * 1e3:.3g}" for name, s in self.others)
        return (
            f"cache plan {self.name}: {self.pinned} whole layers pinned, the rest under {self.policy}; "
            f"predicted {self.seconds * 1e3:.3g} ms/token of expert traffic ({others or 'nothing else'}; "
            f"llama.cpp's --n-cpu-moe split of the same VRAM, {self.split_layers} layers on the GPU: "
            f"{self.split_seconds * 1e3:.3g}); hit rates from {self.source}"
        )


def choose_plan(asked: str, shape: Shape, curve: HitCurve, static: HitCurve, bw: Bandwidths, can_stream: bool) -> Plan:
    """The plan `asked` (auto: the one of fewest predicted seconds; ties go to the simpler, cache first). `curve`:
    the policy's; `static`: the hottest set's, for the static plan's layers that are not pinned."""
    if asked not in PLANS:
        raise MoeprepError(f"unknown cache plan {asked!r}; choose one of {', '.join(PLANS)}")
    top = shape.most_pinned
    paths = (True, False) if can_stream else (False,)  # the static plan's misses: streamed or the CPU's
    candidates: dict[str, list[tuple[float, int, str, bool]]] = {
        "cache": [(token_seconds(shape, curve, bw, 0, can_stream), 0, curve.policy, can_stream)],
        "blend": [
            (token_seconds(shape, curve, bw, n, can_stream), n, curve.policy, can_stream) for n in range(1, top + 1)
        ],
        "static": [(token_seconds(shape, static, bw, top, stream), top, "static", stream) for stream in paths],
    }
    best = {name: min(c) for name, c in candidates.items() if c}
    name = min(best, key=lambda n: (best[n][0], PLANS.index(n))) if asked == AUTO else asked
    if name not in best:
        name = "cache"  # blend asked where no whole layer fits beside a slot in every other
    seconds, pinned, policy, stream = best[name]
    n_split, split = split_seconds(shape, bw)
    source = static.source if policy == "static" else curve.source
    return Plan(
        name, pinned, policy, stream, seconds, n_split, split, tuple((n, best[n][0]) for n in best if n != name), source
    )


def choose_policy(curves: dict[str, HitCurve], shape: Shape, bw: Bandwidths, stream: bool) -> tuple[str, str]:
    """(the policy of fewest predicted seconds in the cache plan, the line that says why), among the measured
    curves of the runtime's policies; without any, GENERAL_POLICY."""
    measured = {p: c for p, c in curves.items() if p in POLICIES}
    if not measured:
        return GENERAL_POLICY, (
            f"cache policy {GENERAL_POLICY}: no routing measured (give --expert-profile of a "
            "profile with held-out chunks); as many hits as the best of lru, lfu and classlru on every "
            "routing regime of the policy table"
        )
    cost = {p: token_seconds(shape, c, bw, 0, stream) for p, c in measured.items()}
    best = min(cost, key=lambda p: (cost[p], p != GENERAL_POLICY, p))
    share = shape.rest_share(0)
    ranked = ", ".join(
        f"{p} {measured[p].hit(share):.1%} hits {cost[p] * 1e3:.3g} ms" for p in sorted(cost, key=cost.get)
    )
    return best, (
        f"cache policy {best}: fewest predicted ms/token of expert traffic at {share:.0%} cached "
        f"({ranked}; from {measured[best].source})"
    )


def pinned_layers(usage: np.ndarray | None, n_pin: int, n_moe: int, share: float, n_expert: int) -> tuple[int, ...]:
    """Which MoE layers (0..M-1) to pin whole: those a cache of `share` serves worst, the ones whose hottest
    experts take the smallest share of their choices (without counts, the last layers, as llama.cpp keeps them)."""
    if n_pin <= 0:
        return ()
    if usage is None or not np.asarray(usage).sum():
        return tuple(range(n_moe - n_pin, n_moe))
    usage = np.asarray(usage, np.float64)
    total = np.maximum(usage.sum(axis=1), 1)
    k = cache_slots(share, n_expert) if share > 0 else 1
    cover = -np.sort(-usage, axis=1)[:, :k].sum(axis=1) / total
    cover[usage.sum(axis=1) == 0] = 0.0  # a layer without counts is as bad as it gets
    order = np.lexsort((-np.arange(n_moe), cover))  # least covered first, later layers first on ties
    return tuple(sorted(int(m) for m in order[:n_pin]))
