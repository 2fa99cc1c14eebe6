"""Expert-cache replacement policies on a real routing stream: hit rate against LRU, LFU and the offline optimum.

    python bench/bench_cache_policy.py [--trace bench/data/routing-trace.npz] [--model bench/models/...gguf]
                                       [--tokens N] [--cap 1] [--json OUT]
    python bench/bench_cache_policy.py --regimes all [--layers 8] [--tokens 8192] [--json OUT]

The stream is the trained bench model's routing on held-out text (bench/train_moe/routing.py wrote it), replayed
as one continuous decode: one token per step, every MoE layer a cache of its own of 10/25/50% of its experts,
starting empty. Every policy of moeprep/profile/policy.py (the runtime's, moerun.cache.policy) runs on the same
stream, uncapped and with at most `--cap` uploads per layer per token, next to Belady's offline optimum (keep the
experts needed soonest; without a cap no policy can hit more). Reported per size: hit rate overall and per layer,
the gap to Belady in points, uploads per token per layer, and the net saving per token per layer in expert reads:
hits - uploads * (upload time / CPU time of one expert), with the H200 machine's 55 GB/s pinned copies and 89 GB/s
host reads. A policy pays back when its net saving beats LRU's.

With --regimes, the streams are instead traces of the named routing regimes (moeprep/profile/regimes.py) at their
own expert count and top-k, with `--layers` MoE layers (a layer's cache is independent of the others', so more
layers only add samples), replayed as `moeprep routing stats` does: every chunk a fresh session, caches starting
empty, at 10 / 25 / 38 / 50% of the experts cached, hit rates after the first 64 tokens of a chunk, no upload cap.
It prints one table per regime and checks payback's targets: at every share a hit rate at least the best of LRU,
LFU and ClassLRU (to TIE: where payback takes a peer's own ranking they differ only in its first steps), and on
average at least half of the way from LRU to Belady.

Two rows have hit rates only. `payback-seeded`: payback as moerun runs it with a profile, each chunk's caches seeded
with the layer's counts over the trace's other chunks (other text on the same router). On the regimes with a latent
router (all but `trained`), `state-oracle`: a cache that ranks experts by what the router's hidden state says of
them (regimes.Hidden: the context state of the token just observed and the router's directions and offsets, which no
policy seeing only the choices can know better), and lets a miss in when it outranks the lowest resident. Given that
state the choices to come do not depend on those before, so it holds everything the past could tell an online
policy; its distance from Belady is the part of Belady's lead that comes from the future's own draws (the next
tokens' ids and noise). It is measured, not proven, a bound: ranking by the expected logit at a horizon is a natural
rule, not shown optimal (the best of HORIZONS is taken at each share, in hindsight, which favours the oracle).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from moeprep.gguf.anatomy import model_geometry
from moeprep.gguf.reader import open_gguf
from moeprep.profile.heldout import SIZES, cache_slots
from moeprep.profile.policy import POLICIES, SPAN, Belady, Replacement, UploadCost, make_policy, next_uses, replay
from moeprep.profile.regimes import REGIMES, Hidden, Shape, generate, generate_with_hidden
from moeprep.profile.routing_stats import SIZES as REGIME_SIZES
from moeprep.profile.routing_stats import WARM_AFTER, hit_rates
from moeprep.profile.tracefile import TraceFile

HERE = Path(__file__).resolve().parent
# every policy that adapts; static needs a profile
COMPARED = ("lru", "lfu", "lfuda", "classlru", "admit2", "payback", "cost-payback")
REGIME_POLICIES = ("lru", "lfu", "classlru", "payback", "cost-payback", "belady", "oracle")
PEERS = ("lru", "lfu", "classlru")  # what payback must match at every share
TIE = 0.0005  # a hit-rate difference this small is a tie: the policies choose the same experts but for a few steps
HORIZONS = (1, 4, 8, 32)  # tokens ahead at which the state oracle ranks the experts' expected logits


class StateOracle(Replacement):
    """Keeps the experts the router's hidden state makes most likely `ahead` tokens after the token just observed:
    priority = Hidden.expected_logits (recency breaking ties). Row b is a cache of MoE layer layers[b] stepping
    through context states states[b] [T, D] (its chunk's, one per token)."""

    name = "state-oracle"

    def __init__(self, slots, n_expert: int, top_k: int, hidden: Hidden, layers, states: np.ndarray, ahead: float):
        super().__init__(slots, n_expert, top_k)
        self.hidden, self.layers, self.states, self.ahead = hidden, np.asarray(layers), states, ahead

    def priority(self, rows: np.ndarray) -> np.ndarray:
        now = self.states[rows, np.maximum(self.tokens[rows] - 1, 0)]  # [R, D] the state of the last token seen
        mu = np.empty((len(rows), self.n_expert))
        for layer in np.unique(self.layers[rows]):
            at = self.layers[rows] == layer
            mu[at] = self.hidden.expected_logits(layer, now[at], self.ahead)
        return mu * SPAN + self.last[rows]


def seeded_rates(t: TraceFile, name: str, sizes=REGIME_SIZES) -> np.ndarray:
    """[S] warm hit rates of policy `name` when each chunk's caches start from a profile, as moerun seeds them: the
    layer's counts over the trace's other chunks (other text on the same router), its hottest experts in the
    slots before the first token."""
    n_m, n_k, n_e = t.n_layers, t.top_k, t.n_expert
    slots = np.array([cache_slots(s, n_e) for s in sizes])
    hits, lookups = np.zeros(len(sizes)), 0
    for c in range(t.n_chunks):
        ids = t.ids[t.starts[c] : t.starts[c + 1]]  # [T, M, K]
        others = np.concatenate([t.ids[: t.starts[c]], t.ids[t.starts[c + 1] :]])
        counts = np.stack([np.bincount(others[:, m].ravel(), minlength=n_e) for m in range(n_m)])  # [M, E]
        policy = make_policy(name, np.repeat(slots, n_m), n_e, n_k)  # rows (size, layer)
        policy.seed(np.tile(counts, (len(sizes), 1)))
        policy.plan_rows(np.arange(len(policy.slots)))
        rows_ids = np.broadcast_to(ids.transpose(1, 0, 2)[None], (len(sizes), *ids.transpose(1, 0, 2).shape))
        r = replay(policy, np.ascontiguousarray(rows_ids).reshape(-1, len(ids), n_k))
        hits += r.hits[:, WARM_AFTER:].reshape(len(sizes), -1).sum(axis=1)
        lookups += max(len(ids) - WARM_AFTER, 0) * n_m * n_k
    return hits / max(lookups, 1)


def state_oracle_rates(t: TraceFile, hidden: Hidden, sizes=REGIME_SIZES, horizons=HORIZONS) -> np.ndarray:
    """[H, S] the state oracle's hit rate (warm, as hit_rates counts it) at each horizon and share: every chunk a
    fresh session, every layer a cache of its own starting empty, no upload cap."""
    n_m, n_k, n_e = t.n_layers, t.top_k, t.n_expert
    slots = np.array([cache_slots(s, n_e) for s in sizes])
    ids, valid = t.routing_trace().padded(range(t.n_chunks))  # [C, T, M, K], [C, T]
    n_c, n_t = valid.shape
    states = np.zeros((n_c, n_t, hidden.states.shape[1]))
    for c in range(n_c):
        states[c, : valid[c].sum()] = hidden.states[t.starts[c] : t.starts[c + 1]]
    shape = (n_c, len(sizes), n_m)  # rows
    rows_ids = np.broadcast_to(ids.transpose(0, 2, 1, 3)[:, None], (*shape, n_t, n_k)).reshape(-1, n_t, n_k)
    rows_valid = np.broadcast_to(valid[:, None, None], (*shape, n_t)).reshape(-1, n_t)
    rows_states = np.broadcast_to(states[:, None, None], (*shape, *states.shape[1:])).reshape(-1, *states.shape[1:])
    rows_slots = np.broadcast_to(slots[None, :, None], shape).reshape(-1)
    rows_layer = np.broadcast_to(np.arange(n_m)[None, None], shape).reshape(-1)
    warm = (rows_valid & (np.arange(n_t) >= WARM_AFTER)[None]).reshape(*shape, n_t)
    out = np.zeros((len(horizons), len(sizes)))
    for hi, ahead in enumerate(horizons):
        oracle = StateOracle(rows_slots, n_e, n_k, hidden, rows_layer, rows_states, ahead)
        hits = replay(oracle, np.ascontiguousarray(rows_ids), rows_valid).hits.reshape(*shape, n_t)
        out[hi] = (hits * warm).sum(axis=(0, 2, 3)) / np.maximum(warm.sum(axis=(0, 2, 3)) * n_k, 1)
    return out


def load_stream(path: Path, n_tokens: int | None) -> np.ndarray:
    """ids [M, N, K] of the trace (one row per MoE layer), in token order."""
    experts = np.load(path)["experts"]  # [N, M, K]
    experts = experts[:n_tokens] if n_tokens else experts
    return np.ascontiguousarray(experts.transpose(1, 0, 2)).astype(np.int64)


def run_policy(name: str, ids: np.ndarray, n_expert: int, caps: tuple[int | None, ...]) -> dict:
    """Replay one policy at every size and cap at once: rows are (cap, size, layer)."""
    n_m, n_t, n_k = ids.shape
    slots = np.array([cache_slots(s, n_expert) for s in SIZES])
    shape = (len(caps), len(SIZES), n_m)
    rows_ids = np.broadcast_to(ids[None, None], (*shape, n_t, n_k)).reshape(-1, n_t, n_k)
    rows_slots = np.broadcast_to(slots[None, :, None], shape).reshape(-1)
    free = np.broadcast_to(np.array([n_expert if c is None else c for c in caps])[:, None, None], shape).reshape(-1)
    if name == "belady":
        policy = Belady(rows_slots, n_expert, n_k, next_uses(rows_ids))
    else:
        policy = make_policy(name, rows_slots, n_expert, n_k)
    t0 = time.perf_counter()
    r = replay(policy, rows_ids, free=free)
    seconds = time.perf_counter() - t0
    hits = r.hits.reshape(*shape, n_t).sum(axis=-1) / (n_t * n_k)  # [caps, S, M]
    uploads = r.uploads.reshape(*shape, n_t).sum(axis=-1) / n_t
    return {"hit": hits, "uploads": uploads, "seconds": seconds}


def regime_table(name: str, layers: int, tokens: int) -> dict:
    """Hit rates (warm) and uploads per token per layer of every policy at every share on one regime's trace."""
    r = REGIMES[name]
    shape = Shape(layers, r.shape.experts, r.shape.top_k)
    if name == "trained":  # recorded routing: no hidden state
        t, oracle = generate(name, shape, tokens, r.target_chunk), None
    else:
        t, hidden = generate_with_hidden(name, shape, tokens, r.target_chunk)
        oracle = state_oracle_rates(t, hidden)
    slots, hits, uploads = hit_rates(t, REGIME_SIZES, REGIME_POLICIES)
    out = {
        "experts": t.n_expert,
        "top_k": t.top_k,
        "layers": layers,
        "tokens": tokens,
        "slots": list(slots),
        "hit": {
            p: [float(hits[i, s, 1].mean()) for s in range(len(REGIME_SIZES))] for i, p in enumerate(REGIME_POLICIES)
        },
        "uploads": {
            p: [float(uploads[i, s].mean()) for s in range(len(REGIME_SIZES))] for i, p in enumerate(REGIME_POLICIES)
        },
    }
    out["hit"]["payback-seeded"] = seeded_rates(t, "payback").tolist()
    if oracle is not None:
        out["state_oracle"] = {f"{h:g}": oracle[i].tolist() for i, h in enumerate(HORIZONS)}
        out["hit"]["state-oracle"] = oracle.max(axis=0).tolist()  # the best horizon at each share
    return out


def way_to_belady(res: dict, policy: str) -> float:
    """The mean over shares of (policy - LRU) / (Belady - LRU), by hit rate."""
    hit = res["hit"]
    lru, belady, mine = (np.array(hit[p]) for p in ("lru", "belady", policy))
    return float(((mine - lru) / np.maximum(belady - lru, 1e-9)).mean())


def payback_verdict(res: dict) -> tuple[np.ndarray, float]:
    """(payback's hit rate minus the best of PEERS at each share, mean share of the way from LRU to Belady)."""
    hit = res["hit"]
    best_peer = np.max([hit[p] for p in PEERS], axis=0)
    return np.array(hit["payback"]) - best_peer, way_to_belady(res, "payback")


def print_regimes(results: dict) -> None:
    cost = UploadCost()
    upload_in_reads = cost.upload_s / cost.hit_saves_s
    for name, res in results.items():
        k = res["top_k"]
        print(
            f"\n{name} ({res['layers']} layers, {res['experts']} experts, top-{k}, {res['tokens']} tokens): hit rate "
            f"after 64 tokens / uploads per token per layer / net saving in expert reads per token per layer"
        )
        print("| policy | " + " | ".join(f"{s:.0%} ({n})" for s, n in zip(REGIME_SIZES, res["slots"])) + " |")
        print("|---|" + "---:|" * len(REGIME_SIZES))
        for p in REGIME_POLICIES:
            cells = [
                f"{h:.1%} / {u:.2f} / {h * k - u * upload_in_reads:.2f}"
                for h, u in zip(res["hit"][p], res["uploads"][p])
            ]
            print(f"| {p} | " + " | ".join(cells) + " |")
        for p in ("payback-seeded", "state-oracle"):
            if p in res["hit"]:
                print(f"| {p} | " + " | ".join(f"{h:.1%}" for h in res["hit"][p]) + " |")
        ahead, way = payback_verdict(res)
        bound = f"; seeded from a profile: {way_to_belady(res, 'payback-seeded'):.0%}"
        if "state-oracle" in res["hit"]:
            bound += f"; the state oracle's: {way_to_belady(res, 'state-oracle'):.0%}"
        print(
            f"payback minus the best of {', '.join(PEERS)}: "
            + " / ".join(f"{100 * d:+.2f}" for d in ahead)
            + f" points (at least it, to {100 * TIE:.2f} points: {'yes' if (ahead >= -TIE).all() else 'no'}); "
            f"of the way from LRU to Belady on average: {way:.0%}{bound}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trace", type=Path, default=HERE / "data" / "routing-trace.npz")
    p.add_argument(
        "--model",
        type=Path,
        default=HERE / "models" / "bench-qwen3moe-f16.gguf",
        help="the model the trace came from (its expert count)",
    )
    p.add_argument("--tokens", type=int, default=None, help="replay only the first N tokens")
    p.add_argument("--cap", type=int, default=1, help="uploads per layer per token in the capped runs")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--regimes", help=f"comma-separated regimes, or all ({', '.join(REGIMES)}): their traces instead")
    p.add_argument("--layers", type=int, default=8, help="with --regimes: MoE layers of each trace")
    a = p.parse_args()
    if a.regimes:
        names = list(REGIMES) if a.regimes == "all" else a.regimes.split(",")
        results = {}
        for name in names:
            t0 = time.perf_counter()
            r = REGIMES[name]
            results[name] = regime_table(name, a.layers, a.tokens or r.target_tokens)
            print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
        print_regimes(results)
        if a.json:
            a.json.write_text(json.dumps(results, indent=1))
        return
    ids = load_stream(a.trace, a.tokens)
    n_expert = model_geometry(open_gguf(a.model)).n_expert
    n_m, n_t, n_k = ids.shape
    caps = (None, a.cap)
    cost = UploadCost()
    upload_in_reads = cost.upload_s / cost.hit_saves_s
    results = {name: run_policy(name, ids, n_expert, caps) for name in (*COMPARED, "belady")}
    print(
        f"{a.trace.name}: {n_t} tokens, {n_m} MoE layers, {n_expert} experts, top-{n_k}; one continuous stream, "
        f"caches start empty; an upload costs {upload_in_reads:.2f} expert reads"
    )
    for ci, cap in enumerate(caps):
        print(f"\n{'no upload cap' if cap is None else f'at most {cap} upload per layer per token'}")
        print("| size (slots) | policy | hit rate | gap to Belady | uploads/token/layer | net saving | per layer |")
        print("|---|---|---|---|---|---|---|")
        for si, size in enumerate(SIZES):
            best = results["belady"]["hit"][ci, si].mean()
            for name, res in results.items():
                hit = res["hit"][ci, si]
                up = res["uploads"][ci, si].mean()
                net = hit.mean() * n_k - up * upload_in_reads
                layers = " ".join(f"{h:.1%}" for h in hit)
                print(
                    f"| {size:.0%} ({cache_slots(size, n_expert)}) | {name} | {hit.mean():.1%} | "
                    f"{100 * (best - hit.mean()):.1f} | {up:.2f} | {net:.2f} | {layers} |"
                )
    print(
        "\nseconds per policy (all sizes and caps): "
        + ", ".join(f"{name} {res['seconds']:.0f}" for name, res in results.items())
    )
    if a.json:
        a.json.write_text(
            json.dumps(
                {
                    "trace": str(a.trace),
                    "tokens": n_t,
                    "caps": list(caps),
                    "sizes": SIZES,
                    "policies": {n: {k: np.asarray(v).tolist() for k, v in r.items()} for n, r in results.items()},
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    assert set(COMPARED) <= set(POLICIES)
    main()
