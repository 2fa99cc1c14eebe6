"""Expert-cache replacement policies: which experts a layer's slots hold, decided between steps. numpy only.

The definitions live here, in moeprep, so `moeprep profile` simulates them without importing torch; the runtime
imports them as moerun.cache.policy. A policy counts the experts each step selected (`observe`) and, when asked,
names the uploads to make (`plan`): an expert to copy into a slot, evicting the expert there. One object holds B
independent caches ("rows") over E experts each, stepped together; the runtime uses one row per MoE layer
(`observe(layer, ids)`, `plan(layer, resident, free)`), and `replay` steps many rows over a routing trace:
`moeprep profile`'s held-out table (moeprep/profile/heldout.py) and bench/bench_cache_policy.py. So a simulated
hit rate is the runtime's.

A step, as the runtime runs it: the step's tokens look up their experts in the residency at the step's start (the
forward cannot wait for an upload); then the policy counts the uses, and `plan` chooses its uploads, which land
before the next step. Candidates are the step's missed experts (and, while slots are still empty, the best-known
others). They are taken best first, at most `free` beyond the row's empty slots (so a cold cache fills in its first
step, a prompt's, not `free` experts a step): each goes into an empty slot, or replaces the
lowest-priority resident when it has a higher priority and the policy admits it. So after a plan a row holds, of
its residents and the admitted candidates, the S of highest priority. A policy is its priority (which experts to
keep) and its admission test (whether a candidate may replace that victim).

Ticks order uses: the k-th expert of token t of a row gets tick t*K + k + 1 (seeded history has ticks <= 0).
Letters: B rows (caches), R rows of one call, E experts, T tokens of a step, K experts per token, S slots, J
candidates of a plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from moeprep.errors import MoeprepError

SPAN = float(2**32)  # priority = primary * SPAN + last tick: recency breaks ties (ticks stay below 2**32)
SEED_TOKENS = 256  # seeded lifetime counts weigh as much as this many tokens of use (the cache stays adaptive)


class Policy(Protocol):
    """What the runtime's CacheController calls: one row per MoE layer."""

    def observe(self, layer: int, ids: np.ndarray) -> None: ...  # [T, K] experts a step selected in `layer`

    def plan(self, layer: int, resident: np.ndarray, free: int) -> list[tuple[int, int]]: ...  # (slot, expert)

    def seed(self, usage: np.ndarray) -> None: ...  # [L, E] lifetime counts from a profile


class Replacement:
    """B caches of E experts under one policy. Subclasses give `priority` and may override `admits` and the hooks.

    State every policy keeps: `cached` residency (the runtime overwrites a row from its slot table at each plan),
    `uses` lifetime counts (kept for evicted experts too: ghost counts), `last` tick of the last use, `pending`
    experts used since the row's last plan."""

    name = ""
    moving_priority = False  # True: placing and evicting change priorities (LFUDA's age)

    def __init__(self, slots: np.ndarray | list[int], n_expert: int, top_k: int):
        slots = np.asarray(slots, np.int64)
        n = len(slots)
        self.slots, self.n_expert, self.top_k = slots.copy(), n_expert, top_k
        self.cached = np.zeros((n, n_expert), bool)
        self.uses = np.zeros((n, n_expert))
        self.last = np.zeros((n, n_expert), np.int64)
        self.seen = np.zeros((n, n_expert), bool)  # used or seeded: a known candidate for an empty slot
        self.pending = np.zeros((n, n_expert), bool)
        self.tokens = np.zeros(n, np.int64)  # tokens observed per row

    # --- what a policy defines ------------------------------------------------------------------------------------

    def priority(self, rows: np.ndarray) -> np.ndarray:
        """[R, E] float64: larger is kept longer."""
        raise NotImplementedError

    def admits(self, rows: np.ndarray, experts: np.ndarray, victims: np.ndarray) -> np.ndarray:
        """[R] bool: may candidate `experts` replace `victims` (-1: fill an empty slot), given that the candidate's
        priority is the higher? Default: yes."""
        return np.ones(len(rows), bool)

    def _used(
        self, rows: np.ndarray, flat_rows: np.ndarray, flat_ids: np.ndarray, flat_tok: np.ndarray, n_tok: np.ndarray
    ) -> None:
        """Hook after a step's uses are counted: (flat_rows, flat_ids) used at token index flat_tok of the step."""

    def _placed(self, rows: np.ndarray, experts: np.ndarray, victims: np.ndarray) -> None:
        """Hook after `experts` went in, `victims` (-1: an empty slot) out."""

    def _seeded(self, shares: np.ndarray) -> None:
        """Hook after seed: shares [B, E] of each row's selections."""

    # --- the runtime's Policy ---------------------------------------------------------------------------------------

    def observe(self, layer: int, ids: np.ndarray) -> None:
        self.observe_rows(np.array([layer]), np.asarray(ids)[None])

    def plan(self, layer: int, resident: np.ndarray, free: int) -> list[tuple[int, int]]:
        """resident [S]: the expert in each of the layer's slots, -1 for empty; at most `free` uploads."""
        resident = np.asarray(resident)
        self.slots[layer] = len(resident)
        slot, expert = self.plan_slots(np.array([layer]), resident[None], free)
        return [(s, e) for s, e in zip(slot[0].tolist(), expert[0].tolist()) if e >= 0]

    def plan_slots(
        self, rows: np.ndarray, resident: np.ndarray, free: int | np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """`plan` for many layers in one call (one per step instead of one per layer): resident [R, S] expert per
        slot, -1 for empty (a row uses its first `slots[row]` columns). -> (slot [R, J], expert [R, J]), -1 where
        nothing is uploaded. A victim is always a slot's expert from before the plan: a placed candidate outranks
        every later one, so none of this plan's uploads is overwritten by another."""
        resident = np.asarray(resident, np.int64)
        in_use = np.arange(resident.shape[1])[None, :] < self.slots[rows, None]
        self.cached[rows] = False
        r, c = np.nonzero(in_use & (resident >= 0))
        self.cached[rows[r], resident[r, c]] = True
        placed, victims = self.plan_rows(rows, free)
        # victims: the slot holding them; fills: the row's empty slots in order
        slot = (resident[:, None, :] == victims[:, :, None]).argmax(axis=2)  # [R, J]
        empty_slots = np.argsort(~(in_use & (resident < 0)), axis=1, kind="stable")  # empty slots first
        fills = (placed >= 0) & (victims < 0)
        nth_fill = np.cumsum(fills, axis=1) - 1
        slot = np.where(fills, np.take_along_axis(empty_slots, np.maximum(nth_fill, 0), axis=1), slot)
        return np.where(placed >= 0, slot, -1), placed

    def seed(self, usage: np.ndarray) -> None:
        """Lifetime counts [B, E] from a profile (rows of zeros are ignored): the hottest expert counts as the most
        recent use (ticks -1, -2, ... in hottest-first order), and `uses` weigh as SEED_TOKENS tokens."""
        usage = np.asarray(usage, np.float64)
        total = usage.sum(axis=1, keepdims=True)
        shares = np.divide(usage, total, out=np.zeros(usage.shape), where=total > 0)
        known = (total > 0)[:, 0]
        rank = np.argsort(np.argsort(-usage, axis=1, kind="stable"), axis=1)  # [B, E] 0 = hottest
        self.last[known] = -(rank[known] + 1)
        self.uses += shares * (SEED_TOKENS * self.top_k)
        self.seen[known] = True
        self._seeded(shares)

    # --- batched over rows ------------------------------------------------------------------------------------------

    def observe_rows(self, rows: np.ndarray, ids: np.ndarray) -> None:
        """ids [R, T, K]: T tokens of one step for each of `rows` (distinct rows)."""
        n_r, n_t, n_k = ids.shape
        flat_rows = np.repeat(rows, n_t * n_k)
        flat_ids = ids.reshape(-1).astype(np.int64)
        ticks = (self.tokens[rows] * n_k)[:, None] + np.arange(1, n_t * n_k + 1)[None, :]  # [R, T*K]
        if n_t == 1:  # a token's experts are distinct: plain indexing, no repeated (row, expert) pairs
            self.uses[flat_rows, flat_ids] += 1.0
            self.last[flat_rows, flat_ids] = ticks.reshape(-1)
        else:
            np.add.at(self.uses, (flat_rows, flat_ids), 1.0)
            np.maximum.at(self.last, (flat_rows, flat_ids), ticks.reshape(-1))
        self.seen[flat_rows, flat_ids] = True
        self.pending[flat_rows, flat_ids] = True
        flat_tok = np.tile(np.repeat(np.arange(n_t), n_k), n_r)
        self._used(rows, flat_rows, flat_ids, flat_tok, n_t)
        self.tokens[rows] += n_t

    def plan_rows(self, rows: np.ndarray, free: int | np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Uploads for `rows`, at most `free` each beyond their empty slots (None: no cap). -> (placed [R, J],
        victims [R, J]) expert ids, -1 where nothing went in or an empty slot was filled. Updates `cached`; clears
        `pending`."""
        n_r = len(rows)
        cached = self.cached[rows]
        n_empty = np.maximum(self.slots[rows] - cached.sum(axis=1), 0)
        want = self.pending[rows] & ~cached
        self.pending[rows] = False
        sub = np.flatnonzero(want.any(axis=1) | (n_empty > 0))  # rows with anything to place
        if not len(sub):
            return np.full((n_r, 0), -1, np.int64), np.full((n_r, 0), -1, np.int64)
        prio, want = self.priority(rows[sub]), want[sub]
        pool = want
        if n_empty[sub].any():  # while slots are empty, known experts that were not used this step may fill them
            fill = self.seen[rows[sub]] & ~cached[sub] & ~want & (n_empty[sub, None] > 0)
            if fill.any():
                pool = want | (fill & (_rank_desc(np.where(fill, prio, -np.inf)) < n_empty[sub, None]))
        # candidates as flat (row, expert) pairs, each row's best first (ties: the lower expert id)
        r, e = np.nonzero(pool)
        order = np.lexsort((-prio[r, e], r))
        r, e = r[order], e[order]
        j = np.arange(len(r)) - np.searchsorted(r, r)  # rank within the row
        if free is not None:  # the cap bounds evictions: while a row has empty slots, filling them costs no hit
            cap = np.broadcast_to(np.asarray(free), (n_r,))[sub] + n_empty[sub]
            keep = j < cap[r]
            r, e, j = r[keep], e[keep], j[keep]
        n_j = int(j.max(initial=-1)) + 1
        cand = np.full((len(sub), n_j), -1, np.int64)
        cand[r, j] = e
        may_evict = np.zeros((len(sub), n_j), bool)
        may_evict[r, j] = want[r, e]  # fillers only take empty slots
        placed, victims = np.full((2, len(sub), n_j), -1, np.int64)
        for k in range(n_j):
            self._place(rows[sub], cand[:, k], may_evict[:, k], prio, placed[:, k], victims[:, k])
        out = np.full((2, n_r, n_j), -1, np.int64)
        out[:, sub] = placed, victims
        return out[0], out[1]

    def _place(
        self,
        rows: np.ndarray,
        cand: np.ndarray,
        may_evict: np.ndarray,
        prio: np.ndarray,
        placed: np.ndarray,
        victims: np.ndarray,
    ) -> None:
        """One candidate per row (-1: none) into an empty slot, or over the lowest-priority resident when the
        candidate's priority is higher and the policy admits it. prio [R, E]: the rows' priorities at the plan's
        start (recomputed for policies whose priorities move as experts go in and out)."""
        has = np.flatnonzero(cand >= 0)
        cached = self.cached[rows[has]]
        empty = cached.sum(axis=1) < self.slots[rows[has]]
        go = empty | may_evict[has]
        act, cached, empty = has[go], cached[go], empty[go]
        if not len(act):
            return
        r, e, at = rows[act], cand[act], np.arange(len(act))
        prio = self.priority(r) if self.moving_priority else prio[act]
        held = np.where(cached, prio, np.inf)
        v = np.where(empty, -1, held.argmin(axis=1))
        ok = (v < 0) | (prio[at, e] > held[at, np.maximum(v, 0)])
        ok[ok] = self.admits(r[ok], e[ok], v[ok])
        evict = ok & (v >= 0)
        self.cached[r[evict], v[evict]] = False
        self.cached[r[ok], e[ok]] = True
        placed[act[ok]] = e[ok]
        victims[act[evict]] = v[evict]
        self._placed(r[ok], e[ok], v[ok])


def _rank_desc(values: np.ndarray) -> np.ndarray:
    """[R, E] position of each entry in its row sorted largest first (ties: lower index first)."""
    order = np.argsort(-values, axis=1, kind="stable")
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(values.shape[1])[None, :], axis=1)
    return rank


# --- the policies ---------------------------------------------------------------------------------------------------


class Lru(Replacement):
    """Least recently used goes; every miss goes in (it is the most recent)."""

    name = "lru"

    def priority(self, rows: np.ndarray) -> np.ndarray:
        return self.last[rows].astype(np.float64)


class Static(Lru):
    """A fixed set: whatever first fills the slots stays; seeded, that is the profile's hottest experts."""

    name = "static"

    def admits(self, rows, experts, victims) -> np.ndarray:
        return victims < 0


class Lfu(Replacement):
    """The most used stay: lifetime counts, kept for evicted experts too (ghost counts), recency breaking ties. A
    miss goes in only once its count passes the least used resident's."""

    name = "lfu"

    def priority(self, rows: np.ndarray) -> np.ndarray:
        return self.uses[rows] * SPAN + self.last[rows]


class Lfuda(Replacement):
    """LFU with dynamic aging: priority = uses + the cache's age at the expert's last use or upload; each eviction
    raises the age to the victim's priority, so experts that were hot long ago age out. Counts are kept for evicted
    experts (ghost counts), so an expert that comes back resumes its count."""

    name = "lfuda"
    moving_priority = True

    def __init__(self, slots, n_expert: int, top_k: int):
        super().__init__(slots, n_expert, top_k)
        self.age = np.zeros(len(self.slots))
        self.base = np.zeros((len(self.slots), n_expert))

    def priority(self, rows: np.ndarray) -> np.ndarray:
        return (self.uses[rows] + self.base[rows]) * SPAN + self.last[rows]

    def _used(self, rows, flat_rows, flat_ids, flat_tok, n_tok) -> None:
        self.base[flat_rows, flat_ids] = self.age[flat_rows]

    def _placed(self, rows, experts, victims) -> None:
        evicted = victims >= 0
        # the victim's primary term (uses + base), without the recency tie-break
        self.age[rows[evicted]] = (
            self.uses[rows[evicted], victims[evicted]] + self.base[rows[evicted], victims[evicted]]
        )
        self.base[rows, experts] = self.age[rows]


class ClassLru(Replacement):
    """Recency within frequency classes (llama.cpp's upstream cache policy, as its documentation describes it): each
    expert's use count decays with a `half_life` of tokens; class = min(classes - 1, floor(log2(1 + count))), and
    the cache keeps one LRU list per class, evicting from the lowest non-empty class, least recent first. A miss goes
    in when its class is at least the victim's (and it is the more recent, which a miss always is)."""

    name = "classlru"

    def __init__(self, slots, n_expert: int, top_k: int, classes: int = 8, half_life: float = 128.0):
        super().__init__(slots, n_expert, top_k)
        self.classes, self.decay = classes, 0.5 ** (1.0 / half_life)
        self.decayed = np.zeros((len(self.slots), n_expert))

    def priority(self, rows: np.ndarray) -> np.ndarray:
        level = np.minimum(np.floor(np.log2(1.0 + self.decayed[rows])), self.classes - 1)
        return level * SPAN + self.last[rows]

    def _used(self, rows, flat_rows, flat_ids, flat_tok, n_tok) -> None:
        self.decayed[rows] *= self.decay**n_tok
        np.add.at(self.decayed, (flat_rows, flat_ids), self.decay ** (n_tok - 1 - flat_tok))

    def _seeded(self, shares: np.ndarray) -> None:
        # a profile's share as the steady decayed count of an expert used at that rate
        self.decayed += shares * self.top_k / (1.0 - self.decay)


class AdmitAfterRepeat(Lru):
    """LRU, but a miss replaces a resident expert only when the candidate was also used within the previous
    `window` tokens (its second recent use); one-off experts stay on the CPU. Empty slots take any candidate."""

    name = "admit2"

    def __init__(self, slots, n_expert: int, top_k: int, window: int = 16):
        super().__init__(slots, n_expert, top_k)
        self.window = window
        self.last_tok = np.full((len(self.slots), n_expert), -(1 << 40), np.int64)
        self.prev_tok = self.last_tok.copy()

    def _used(self, rows, flat_rows, flat_ids, flat_tok, n_tok) -> None:
        when = self.tokens[flat_rows] + flat_tok
        # the latest two uses per (row, expert): sort by (row, expert, token); a group's last element is the
        # latest use, the one before it (same group) or the stored last use the one before that
        order = np.lexsort((when, flat_ids, flat_rows))
        r, e, w = flat_rows[order], flat_ids[order], when[order]
        same_prev = np.zeros(len(r), bool)
        same_prev[1:] = (r[1:] == r[:-1]) & (e[1:] == e[:-1])
        last = np.flatnonzero(np.append(~same_prev[1:], True))
        r, e = r[last], e[last]
        self.prev_tok[r, e] = np.where(same_prev[last], w[last - 1], self.last_tok[r, e])
        self.last_tok[r, e] = w[last]

    def admits(self, rows, experts, victims) -> np.ndarray:
        repeat = self.last_tok[rows, experts] - self.prev_tok[rows, experts] <= self.window
        return (victims < 0) | repeat


@dataclass(frozen=True)
class UploadCost:
    """What an upload costs and a hit saves. A miss computes the expert on the CPU, reading its bytes from host RAM
    at `cpu_gbps`; an upload copies them to the GPU at `upload_gbps`. Defaults: the H200 machine measured in
    docs/BENCHMARKS.md (host RAM reads 89 GB/s with 16 threads, pinned copies 55 GB/s) and the 60 GB bench model's
    9.28 MiB experts."""

    expert_bytes: int = 9_732_096
    cpu_gbps: float = 89.0
    upload_gbps: float = 55.0

    @property
    def hit_saves_s(self) -> float:
        return self.expert_bytes / (self.cpu_gbps * 1e9)

    @property
    def upload_s(self) -> float:
        return self.expert_bytes / (self.upload_gbps * 1e9)


class Payback(Replacement):
    """The default: each layer's cache ranks its experts by whichever of several predictors of reuse has been paying
    back most for caches of its size, judged on ghost caches (what each predictor would hold), never on the future.

    Predictors (ESTIMATES, in order): the last use (LRU); recent uses decayed with half-lives of 4 and 16 tokens;
    lifetime counts, kept for evicted experts (LFU); ClassLRU's frequency class (8 classes of log2 counts decayed
    over 128 tokens); and that class's rate plus the 4-token rate (frequency with a short-term boost). A tie goes to
    the more recent expert. For every predictor the policy keeps a ghost cache of the row's size: after each step it
    holds, of its own experts and the step's, the S the predictor ranks highest, as an uncapped plan would. A ghost
    hit (a chosen expert the ghost held before the step) scores for its predictor; scores decay with a half-life of
    `adapt` tokens and are pooled over the rows of the same size (a model's layers: one routing, many samples, so the
    choice settles within a few tokens). The real cache ranks by the best-scoring predictor (ties: the earlier one),
    and a miss goes in when it outranks the lowest resident, as in every policy here. A step of several tokens (a
    prompt) counts every token but moves the ghosts once.

    So on routing whose reuse comes from context it keeps the recently and repeatedly used (beating LRU where few
    slots hold only the last token's experts), on skewed routing the frequent, and on mixed routing the frequent
    and recent together; at worst it does what the best of its predictors, LRU, LFU and ClassLRU among them, does."""

    name = "payback"
    ESTIMATES = ("recency", "decay-4", "decay-16", "lifetime", "class", "class+decay-4")
    HALF_LIVES = (4.0, 16.0)  # of the decayed counts
    CLASSES, CLASS_HALF_LIFE = 8, 128.0  # ClassLRU's

    def __init__(self, slots, n_expert: int, top_k: int, adapt: float = 256.0):
        super().__init__(slots, n_expert, top_k)
        n, j = len(self.slots), len(self.ESTIMATES)
        self.decays = 0.5 ** (1.0 / np.array(self.HALF_LIVES))
        self.recent = np.zeros((len(self.HALF_LIVES), n, n_expert))
        self.class_decay = 0.5 ** (1.0 / self.CLASS_HALF_LIFE)
        self.class_count = np.zeros((n, n_expert))
        self.ghost = np.zeros((j, n, n_expert), bool)
        self.score = np.zeros((n, j))  # decayed ghost hits per predictor
        self.score_decay = 0.5 ** (1.0 / adapt)
        self.step_values: tuple[np.ndarray, np.ndarray] | None = None  # (rows, [J, R, E] priorities) of the last step

    def estimates(self, rows: np.ndarray) -> np.ndarray:
        """[J, R, E] each predictor's primary value (larger: kept longer)."""
        level = np.minimum(np.floor(np.log2(1.0 + self.class_count[rows])), self.CLASSES - 1)
        class_rate = self.class_count[rows] * (1.0 - self.class_decay)
        short_rate = self.recent[0, rows] * (1.0 - self.decays[0])
        recency = np.zeros((len(rows), self.n_expert))
        return np.stack([recency, *self.recent[:, rows], self.uses[rows], level, class_rate + short_rate])

    def predictor(self, rows: np.ndarray) -> np.ndarray:
        """[R] the predictor each row's cache ranks by: the best score among the rows of its size."""
        sizes, which = np.unique(self.slots, return_inverse=True)
        pooled = np.zeros((len(sizes), len(self.ESTIMATES)))
        np.add.at(pooled, which, self.score)
        return pooled[which[rows]].argmax(axis=1)

    def values(self, rows: np.ndarray) -> np.ndarray:
        """[J, R, E] every predictor's priorities; those the last step computed where nothing changed since (the
        plan that follows a step reads them again)."""
        if self.step_values is not None and np.array_equal(self.step_values[0], rows):
            return self.step_values[1]
        return self.estimates(rows) * SPAN + self.last[rows][None]

    def priority(self, rows: np.ndarray) -> np.ndarray:
        return self.values(rows)[self.predictor(rows), np.arange(len(rows))]

    def _used(self, rows, flat_rows, flat_ids, flat_tok, n_tok) -> None:
        # ghost hits, on the ghosts from before this step (the flat uses come row by row, n_tok * K each)
        hits = self.ghost[:, flat_rows, flat_ids].reshape(len(self.ESTIMATES), len(rows), -1).sum(axis=2)
        self.score[rows] = self.score[rows] * self.score_decay**n_tok + hits.T
        age = n_tok - 1 - flat_tok
        for h, decay in enumerate(self.decays):
            self.recent[h, rows] *= decay**n_tok
            np.add.at(self.recent[h], (flat_rows, flat_ids), decay**age)
        self.class_count[rows] *= self.class_decay**n_tok
        np.add.at(self.class_count, (flat_rows, flat_ids), self.class_decay**age)
        # each ghost: the row's S experts its predictor ranks highest among its own and this step's
        step = np.zeros((len(self.slots), self.n_expert), bool)
        step[flat_rows, flat_ids] = True
        self.step_values = None
        values = self.values(rows)
        held = self.ghost[:, rows] | step[rows][None]  # [J, R, E]
        worst_first = np.where(held, -values, np.inf)  # held experts have distinct priorities (their last uses)
        kept = np.ones_like(held)
        sizes = self.slots[rows]
        for size in np.unique(sizes[sizes < self.n_expert]):  # rows of one size at once (a model: all its layers)
            at = np.flatnonzero(sizes == size)
            best = np.argpartition(worst_first[:, at], size - 1, axis=2)[..., :size]
            part = np.zeros((len(self.ESTIMATES), len(at), self.n_expert), bool)
            np.put_along_axis(part, best, True, axis=2)
            kept[:, at] = part
        self.ghost[:, rows] = held & kept
        self.step_values = (rows.copy(), values)

    def _seeded(self, shares: np.ndarray) -> None:
        # a profile's share as the steady decayed counts of an expert used at that rate
        self.step_values = None
        self.recent += shares[None] * self.top_k / (1.0 - self.decays[:, None, None])
        self.class_count += shares * self.top_k / (1.0 - self.class_decay)


class CostPayback(Replacement):
    """Cost/benefit (usage decay and pay-back eviction, the kind of policy the GLM fork ships; the chat-glm regime's
    targets are stated for it): an upload happens only when the CPU time it is expected to save beats its own copy
    time.

    Each expert's expected uses over the next `horizon` tokens are its recent uses, decayed by 1 - 1/horizon per
    token (a seeded profile starts them at share * K * horizon). Replacing victim v by candidate c saves
    (uses_c - uses_v) * hit_saves_s of CPU time and costs upload_s, so c goes in only when
    uses_c - uses_v > upload_s / hit_saves_s + margin (the expert's bytes cancel; an empty slot has uses_v = 0).
    The margin keeps two experts of about equal use from trading places every step."""

    name = "cost-payback"

    def __init__(
        self, slots, n_expert: int, top_k: int, cost: UploadCost = UploadCost(), horizon: int = 32, margin: float = 0.5
    ):
        super().__init__(slots, n_expert, top_k)
        self.cost, self.horizon, self.margin = cost, horizon, margin
        self.decay = 1.0 - 1.0 / horizon
        self.recent = np.zeros((len(self.slots), n_expert))

    @property
    def threshold(self) -> float:
        return self.cost.upload_s / self.cost.hit_saves_s + self.margin

    def priority(self, rows: np.ndarray) -> np.ndarray:
        return self.recent[rows] * SPAN + self.last[rows]

    def _used(self, rows, flat_rows, flat_ids, flat_tok, n_tok) -> None:
        self.recent[rows] *= self.decay**n_tok
        np.add.at(self.recent, (flat_rows, flat_ids), self.decay ** (n_tok - 1 - flat_tok))

    def _seeded(self, shares: np.ndarray) -> None:
        self.recent += shares * self.top_k * self.horizon

    def admits(self, rows, experts, victims) -> np.ndarray:
        lost = np.where(victims >= 0, self.recent[rows, np.maximum(victims, 0)], 0.0)
        return self.recent[rows, experts] - lost > self.threshold


class Belady(Replacement):
    """The offline optimum (Belady's MIN with bypass): keep the experts needed soonest; a candidate goes in only if
    it is needed before the victim (the priority test of every plan). Without an upload cap no policy gets more hits
    on the same stream.

    `next_use` [B, T, K]: for each row's token t and choice k, the token index at which that expert is used next in
    the row (`next_uses`), T or more for never. Tokens must be observed one at a time, in trace order."""

    name = "belady"

    def __init__(self, slots, n_expert: int, top_k: int, next_use: np.ndarray):
        super().__init__(slots, n_expert, top_k)
        self.next_use = next_use
        self.never = next_use.shape[1] + 1
        self.next = np.full((len(self.slots), n_expert), self.never, np.int64)

    def priority(self, rows: np.ndarray) -> np.ndarray:
        return -self.next[rows] * SPAN + self.last[rows]

    def _used(self, rows, flat_rows, flat_ids, flat_tok, n_tok) -> None:
        assert n_tok == 1, "Belady replays one token per step"
        self.next[flat_rows, flat_ids] = self.next_use[rows, self.tokens[rows]].reshape(-1)


def next_uses(ids: np.ndarray) -> np.ndarray:
    """ids [B, T, K] -> [B, T, K]: the next token index at which each choice's expert is used again in its row
    (T if never)."""
    n_b, n_t, n_k = ids.shape
    n_e = int(ids.max(initial=0)) + 1
    out = np.empty(ids.shape, np.int64)
    upcoming = np.full((n_b, n_e), n_t, np.int64)
    rows = np.arange(n_b)[:, None]
    for t in range(n_t - 1, -1, -1):
        out[:, t] = upcoming[rows, ids[:, t]]
        upcoming[rows, ids[:, t]] = t
    return out


POLICIES: dict[str, type[Replacement]] = {
    p.name: p for p in (Static, Lru, Lfu, Lfuda, ClassLru, AdmitAfterRepeat, Payback, CostPayback)
}
DEFAULT_POLICY = "payback"


def make_policy(name: str, slots: np.ndarray | list[int], n_expert: int, top_k: int, **params) -> Replacement:
    """A policy by name (a key of POLICIES) over len(slots) rows; params go to its constructor."""
    if name not in POLICIES:
        raise MoeprepError(f"unknown cache policy {name!r}; choose one of {', '.join(POLICIES)}")
    return POLICIES[name](slots, n_expert, top_k, **params)


@dataclass
class Replay:
    hits: np.ndarray  # [B, T] lookups of each token that found their expert cached
    uploads: np.ndarray  # [B, T] uploads planned after each token


def replay(policy: Replacement, ids: np.ndarray, valid: np.ndarray | None = None, free: int | None = None) -> Replay:
    """Step every row of `policy` through ids [B, T, K] one token per step (as decode runs): look up, observe,
    plan at most `free` uploads. valid [B, T]: False skips a row's token (padding of shorter chunks)."""
    n_b, n_t, n_k = ids.shape
    valid = np.ones((n_b, n_t), bool) if valid is None else valid
    hits = np.zeros((n_b, n_t), np.uint8)
    uploads = np.zeros((n_b, n_t), np.uint16)
    for t in range(n_t):
        rows = np.flatnonzero(valid[:, t])
        if not len(rows):
            continue
        step = ids[rows, t]  # [R, K]
        hits[rows, t] = policy.cached[rows[:, None], step].sum(axis=1)
        policy.observe_rows(rows, step[:, None, :])
        placed, _ = policy.plan_rows(rows, free)
        uploads[rows, t] = (placed >= 0).sum(axis=1)
    return Replay(hits, uploads)
