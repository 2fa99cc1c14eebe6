"""Replacement policies: the batched code against one cache written the obvious way, the runtime's per-layer calls
against the batched replay, Belady against an exhaustive optimum, and the upload cap."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from moeprep.errors import MoeprepError
from moeprep.profile.policy import (
    POLICIES,
    SEED_TOKENS,
    SPAN,
    AdmitAfterRepeat,
    Belady,
    CostPayback,
    Payback,
    UploadCost,
    make_policy,
    next_uses,
    replay,
)


def skewed_stream(seed: int, n_tokens: int, n_expert: int, k: int, skew: float = 1.0) -> np.ndarray:
    """[T, K] distinct experts per token, hot experts more likely, with some repetition of the previous token."""
    rng = np.random.default_rng(seed)
    p = (np.arange(n_expert) + 1.0) ** -skew
    p /= p.sum()
    out = np.zeros((n_tokens, k), np.int64)
    for t in range(n_tokens):
        keep = out[t - 1, : rng.integers(0, k)] if t else np.zeros(0, np.int64)
        rest = [e for e in rng.choice(n_expert, n_expert, replace=False, p=p) if e not in keep][: k - len(keep)]
        out[t] = np.concatenate([keep, rest])
    return out


class Reference:
    """One cache, dictionaries and loops: what each policy means, step by step."""

    def __init__(self, name: str, slots: int, k: int, free: int | None = None):
        self.name, self.slots, self.k, self.free = name, slots, k, free
        self.cache: set[int] = set()
        self.uses: dict[int, float] = {}
        self.last: dict[int, int] = {}
        self.base: dict[int, float] = {}  # lfuda
        self.age = 0.0
        self.toks: dict[int, list[int]] = {}  # admit2: tokens of use
        self.recent: dict[int, float] = {}  # cost-payback
        self.decayed: dict[int, float] = {}  # classlru, payback's class
        self.short: dict[int, float] = {}  # payback: uses decayed over 4 tokens
        self.mid: dict[int, float] = {}  # and over 16
        self.ghosts: list[set[int]] = [set() for _ in Payback.ESTIMATES]  # payback: each predictor's ghost cache
        self.scores = [0.0] * len(Payback.ESTIMATES)
        self.t = 0

    def estimate(self, j: int, e: int) -> float:
        """payback's predictor j on expert e."""
        class_decay, short_decay = 0.5 ** (1 / 128), 0.5 ** (1 / 4)
        decayed, short = self.decayed.get(e, 0.0), self.short.get(e, 0.0)
        return (
            0.0,
            short,
            self.mid.get(e, 0.0),
            self.uses.get(e, 0.0),
            min(np.floor(np.log2(1.0 + decayed)), 7),
            decayed * (1.0 - class_decay) + short * (1.0 - short_decay),
        )[j]

    def prio(self, e: int) -> tuple[float, int]:
        primary = {
            "lru": 0.0,
            "static": 0.0,
            "lfu": self.uses.get(e, 0.0),
            "lfuda": self.uses.get(e, 0.0) + self.base.get(e, 0.0),
            "admit2": 0.0,
            "cost-payback": self.recent.get(e, 0.0),
            "payback": self.estimate(int(np.argmax(self.scores)), e),
            "classlru": min(np.floor(np.log2(1.0 + self.decayed.get(e, 0.0))), 7),
        }[self.name]
        return primary, self.last.get(e, 0)

    def admits(self, c: int, victim: int | None) -> bool:
        if self.name == "static":
            return victim is None
        if self.name == "admit2":
            uses = self.toks.get(c, [])
            return victim is None or (len(uses) >= 2 and uses[-1] - uses[-2] <= 16)
        if self.name == "cost-payback":
            threshold = UploadCost().upload_s / UploadCost().hit_saves_s + 0.5
            lost = 0.0 if victim is None else self.recent.get(victim, 0.0)
            return self.recent.get(c, 0.0) - lost > threshold
        return True

    def step(self, row: np.ndarray) -> tuple[int, int]:
        """-> (hits, uploads) of one token."""
        row = [int(e) for e in row]
        hits = sum(e in self.cache for e in row)
        for j, ghost in enumerate(self.ghosts):
            self.scores[j] = self.scores[j] * 0.5 ** (1 / 256) + sum(e in ghost for e in row)
        for e in self.short:
            self.short[e] *= 0.5 ** (1 / 4)
        for e in self.mid:
            self.mid[e] *= 0.5 ** (1 / 16)
        for e in self.recent:
            self.recent[e] *= 1 - 1 / 32
        for e in self.decayed:
            self.decayed[e] *= 0.5 ** (1 / 128)
        for k, e in enumerate(row):
            self.uses[e] = self.uses.get(e, 0.0) + 1
            self.last[e] = self.t * self.k + k + 1
            self.base[e] = self.age
            self.toks.setdefault(e, []).append(self.t)
            self.recent[e] = self.recent.get(e, 0.0) + 1
            self.decayed[e] = self.decayed.get(e, 0.0) + 1
            self.short[e] = self.short.get(e, 0.0) + 1
            self.mid[e] = self.mid.get(e, 0.0) + 1
        for j, ghost in enumerate(self.ghosts):
            held = sorted(ghost | set(row), key=lambda e: (self.estimate(j, e), self.last[e]), reverse=True)
            self.ghosts[j] = set(held[: self.slots])
        self.t += 1
        misses = [e for e in row if e not in self.cache]
        n_empty = self.slots - len(self.cache)
        fillers = sorted((e for e in self.last if e not in self.cache and e not in row), key=self.prio, reverse=True)[
            : max(n_empty, 0)
        ]
        pool = sorted(misses + fillers, key=self.prio, reverse=True)
        pool = pool[: self.free + max(n_empty, 0)] if self.free is not None else pool  # empty slots are not capped
        uploads = 0
        for c in pool:
            victim = None
            if len(self.cache) >= self.slots:
                if c not in misses:
                    continue
                victim = min(self.cache, key=self.prio)
                if not self.prio(c) > self.prio(victim):
                    continue
            if not self.admits(c, victim):
                continue
            if victim is not None:
                self.cache.remove(victim)
                self.age = self.uses[victim] + self.base[victim]
            self.cache.add(c)
            self.base[c] = self.age
            uploads += 1
        return hits, uploads


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("free", [None, 1])
def test_batched_policy_matches_reference(name: str, free: int | None) -> None:
    n_expert, k, n_tokens = 12, 3, 160
    slots = [1, 2, 4, 7]
    streams = [skewed_stream(seed, n_tokens, n_expert, k) for seed in range(len(slots))]
    r = replay(make_policy(name, slots, n_expert, k), np.stack(streams), free=free)
    for row, (s, stream) in enumerate(zip(slots, streams)):
        ref = Reference(name, s, k, free)
        want = np.array([ref.step(tok) for tok in stream])
        assert (r.hits[row] == want[:, 0]).all(), (name, s, np.flatnonzero(r.hits[row] != want[:, 0])[:5])
        assert (r.uploads[row] == want[:, 1]).all(), (name, s)
        if free is not None:  # the cap bounds evictions: once the slots are full (caches never shrink), `free` a step
            full = np.cumsum(r.uploads[row]) - r.uploads[row] >= s
            assert r.uploads[row][full].max(initial=0) <= free and r.uploads[row].max() <= free + s


@pytest.mark.parametrize("name", ["lru", "payback"])
def test_an_empty_cache_fills_in_one_step_beyond_the_cap(name: str) -> None:
    """A prompt's step on a cold cache: every slot it can fill is filled at once, while evictions stay capped."""
    n_expert, k, slots, free = 32, 4, 12, 2
    policy = make_policy(name, [slots], n_expert, k)
    prompt = np.arange(40)[:, None] * 3 % n_expert + np.arange(k)[None, :]  # 40 tokens touching 32 experts
    policy.observe(0, prompt % n_expert)
    table = np.full(slots, -1)
    uploads = policy.plan(0, table.copy(), free)
    assert len(uploads) == slots and len({s for s, _ in uploads}) == slots
    for slot, expert in uploads:
        table[slot] = expert
    policy.observe(0, np.array([[e for e in range(n_expert) if e not in table][:k]]))  # four misses
    assert len(policy.plan(0, table.copy(), free)) <= free


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_runtime_calls_equal_the_replay(name: str) -> None:
    """The controller's view, one layer at a time: hits from its own slot table, uploads applied as (slot, expert)
    pairs into empty or evicted slots. Same hits as the batched replay, layer for layer."""
    n_layer, n_expert, k, n_tokens, free = 3, 16, 4, 120, 2
    slots = [3, 5, 8]
    ids = np.stack([skewed_stream(10 + m, n_tokens, n_expert, k) for m in range(n_layer)])  # [L, T, K]
    want = replay(make_policy(name, slots, n_expert, k), ids, free=free).hits
    policy = make_policy(name, [0] * n_layer, n_expert, k)
    table = [np.full(s, -1) for s in slots]  # the slot table: expert per slot
    for t in range(n_tokens):
        for layer in range(n_layer):
            step = ids[layer, t]
            assert np.isin(step, table[layer]).sum() == want[layer, t]
            policy.observe(layer, step[None])
            uploads = policy.plan(layer, table[layer].copy(), free)
            n_empty = int((table[layer] < 0).sum())
            assert len(uploads) <= free + n_empty and len({s for s, _ in uploads}) == len(uploads)
            for slot, expert in uploads:
                assert expert not in table[layer]
                table[layer][slot] = expert


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_one_call_for_every_layer_equals_a_call_per_layer(name: str) -> None:
    n_layer, n_expert, k, free = 4, 16, 4, 2
    slots = [2, 3, 5, 8]
    ids = np.stack([skewed_stream(20 + m, 60, n_expert, k) for m in range(n_layer)])  # [L, T, K]
    batched, single = make_policy(name, slots, n_expert, k), make_policy(name, slots, n_expert, k)
    tables = np.full((n_layer, max(slots)), -1)
    for t in range(ids.shape[1]):
        batched.observe_rows(np.arange(n_layer), ids[:, t, None])
        slot, expert = batched.plan_slots(np.arange(n_layer), tables, free)
        for layer in range(n_layer):
            single.observe(layer, ids[layer, t, None])
            want = single.plan(layer, tables[layer, : slots[layer]].copy(), free)
            got = [(s, e) for s, e in zip(slot[layer].tolist(), expert[layer].tolist()) if e >= 0]
            assert got == want, (t, layer)
            for s, e in got:
                tables[layer, s] = e


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_step_of_many_tokens_counts_as_those_tokens_one_by_one(name: str) -> None:
    """Prefill observes T tokens at once (repeated experts among them); the state must equal T single steps."""
    ids = skewed_stream(5, 24, 10, 3)
    whole, single = make_policy(name, [4], 10, 3), make_policy(name, [4], 10, 3)
    whole.observe(0, ids)
    for row in ids:
        single.observe(0, row[None])
    fields = ("uses", "last", "seen", "pending", "tokens", "last_tok", "prev_tok", "recent", "base", "decayed")
    for field in (*fields, "class_count"):
        if hasattr(whole, field):
            assert np.allclose(getattr(whole, field), getattr(single, field)), field
    if name == "payback":  # its ghost caches step once per step (a prompt is one ghost step); its counts do not
        whole.ghost, whole.score = single.ghost.copy(), single.score.copy()
    assert whole.plan(0, np.full(4, -1), 4) == single.plan(0, np.full(4, -1), 4)


def exhaustive_optimum(stream: np.ndarray, slots: int) -> int:
    """Most hits any cache of `slots` can get when, after each token, it keeps any subset of its experts and that
    token's (dynamic programming over every reachable cache)."""
    best = {frozenset(): 0}
    for row in stream:
        nxt: dict[frozenset, int] = {}
        for cache, hits in best.items():
            hits += sum(int(e) in cache for e in row)
            union = sorted(cache | set(int(e) for e in row))
            for keep in itertools.combinations(union, min(slots, len(union))):
                key = frozenset(keep)
                nxt[key] = max(nxt.get(key, -1), hits)
        best = nxt
    return max(best.values())


@pytest.mark.parametrize("seed", range(4))
def test_belady_is_the_optimum(seed: int) -> None:
    stream = skewed_stream(seed, 14, 7, 2, skew=0.5)
    for slots in (1, 2, 3):
        ids = stream[None]
        belady = replay(Belady([slots], 7, 2, next_uses(ids)), ids).hits.sum()
        assert belady == exhaustive_optimum(stream, slots), slots


def test_belady_beats_every_policy_and_lru_is_not_it() -> None:
    ids = np.stack([skewed_stream(s, 300, 32, 4) for s in range(3)])
    slots = [3, 8, 16]
    best = replay(Belady(slots, 32, 4, next_uses(ids)), ids).hits.sum(axis=1)
    for name in POLICIES:
        assert (replay(make_policy(name, slots, 32, 4), ids).hits.sum(axis=1) <= best).all(), name
    assert (replay(make_policy("lru", slots, 32, 4), ids).hits.sum(axis=1) < best).all()


def test_next_uses() -> None:
    ids = np.array([[[0, 1], [1, 2], [0, 3]]])
    assert next_uses(ids).tolist() == [[[2, 1], [3, 3], [3, 3]]]


def test_seed_warms_with_the_hottest_and_weighs_as_seed_tokens() -> None:
    usage = np.array([[5, 50, 0, 20, 1, 9], [0, 0, 0, 0, 0, 0]])
    lfu = make_policy("lfu", [3, 3], 6, 2)
    lfu.seed(usage)
    assert sorted(e for _, e in lfu.plan(0, np.full(3, -1), 3)) == [1, 3, 5]
    assert lfu.uses[0].sum() == pytest.approx(SEED_TOKENS * 2) and lfu.uses[1].sum() == 0
    assert lfu.plan(1, np.full(3, -1), 3) == []  # a layer without counts stays cold
    lru = make_policy("lru", [2], 6, 2)
    lru.seed(usage[:1])
    assert lru.last[0, 1] == -1 and lru.last[0, 3] == -2  # the hottest counts as the most recent


def test_cost_payback_uploads_only_what_pays_back() -> None:
    """An expert used once is not worth its copy; one used every token is. A copy slower than a CPU read raises
    the bar."""
    p = CostPayback([2], 8, 1)
    p.observe(0, np.array([[3]]))
    assert p.plan(0, np.full(2, -1), 2) == []
    for _ in range(4):
        p.observe(0, np.array([[5]]))
    assert p.plan(0, np.full(2, -1), 2) == [(0, 5)]
    slow = CostPayback([2], 8, 1, cost=UploadCost(upload_gbps=8.9))  # a copy costs 10 CPU reads
    for _ in range(8):
        slow.observe(0, np.array([[5]]))
    assert slow.plan(0, np.full(2, -1), 2) == []
    assert slow.threshold > 10 and float(SPAN) > 1e9


def test_admit_after_repeat_needs_a_recent_second_use() -> None:
    p = AdmitAfterRepeat([1], 8, 1, window=4)
    p.observe(0, np.array([[2]]))
    assert p.plan(0, np.full(1, -1), 1) == [(0, 2)]  # an empty slot takes anything
    p.observe(0, np.array([[6]]))
    assert p.plan(0, np.array([2]), 1) == []  # first use of 6: not admitted over 2
    for _ in range(5):
        p.observe(0, np.array([[1]]))
        p.plan(0, np.array([2]), 0)
    p.observe(0, np.array([[6]]))
    assert p.plan(0, np.array([2]), 1) == []  # second use, but 6 tokens after the first
    p.observe(0, np.array([[6]]))
    assert p.plan(0, np.array([2]), 1) == [(0, 6)]


def test_unknown_policy() -> None:
    with pytest.raises(MoeprepError, match="unknown cache policy"):
        make_policy("fifo", [2], 8, 2)


@pytest.mark.parametrize(
    ("regime", "predictors", "lead"),
    [("skewed-256", {"lifetime"}, 0.0), ("qwen3-30b", {"recency", "decay-4"}, 0.02)],
)
def test_payback_ranks_by_the_predictor_that_pays_back(regime: str, predictors: set[str], lead: float) -> None:
    """On skewed routing payback settles on lifetime counts (LFU's ranking: the same hits), on context-driven
    routing on recent uses, 2 points or more ahead of LRU with 10% of the experts cached (4 measured); never below
    the best of LRU, LFU and ClassLRU."""
    from moeprep.profile.regimes import REGIMES, Shape, generate

    r = REGIMES[regime]
    t = generate(regime, Shape(4, r.shape.experts, r.shape.top_k), 2048, 1024)
    ids = np.ascontiguousarray(t.ids.transpose(1, 0, 2))[:, :1024]  # [layers, tokens, K]: the first chunk
    slots = [max(1, round(0.10 * r.shape.experts))] * len(ids)
    rates = {}
    for name in ("lru", "lfu", "classlru", "payback"):
        policy = make_policy(name, slots, r.shape.experts, r.shape.top_k)
        rates[name] = replay(policy, ids).hits[:, 64:].mean() / r.shape.top_k
    chosen = {Payback.ESTIMATES[j] for j in policy.predictor(np.arange(len(ids)))}
    assert chosen <= predictors, chosen
    assert rates["payback"] >= max(rates[p] for p in ("lru", "lfu", "classlru")) + lead - 0.005, rates
