"""Does a trained router's full score vector predict expert reuse? The `trained` regime's cache policies, with and
without every expert's routing probability.

    python bench/bench_router_scores.py [--model bench/models/bench-qwen3moe-f16.gguf] [--text bench/data/heldout.txt]
                                        [--windows 64] [--scores OUT.npz | --from-scores IN.npz] [--json OUT]
    python bench/bench_router_scores.py --regimes all [--layers 4] [--tokens 4096] [--json OUT]

The model runs in moerun on the CPU over the held-out text in 512-token windows, each a fresh sequence, as
bench/train_moe/routing.py recorded the `trained` regime's trace (moeprep/data/trained-routing.npz holds its first
64 windows); a forward hook on each MoE layer's router records every expert's probability, as the model's own gating
gives it (softmax over the router logits for this model), per layer per token, beside the K experts it chose. The
chosen experts are checked against the recorded trace.

The replay follows bench/bench_cache_policy.py --regimes: every window a fresh session, every layer a cache of its
own starting empty, 10 / 25 / 38 / 50% of the experts cached, hit rates after a window's first 64 tokens, no upload
cap; net saving per token per layer in expert reads = hits x K - uploads x 1.62. Rows: LRU, payback, Belady, and
payback with one more predictor in its pool: the router's probabilities (or their logarithms, which rank as the
logits do) averaged with a decay over h tokens, alone or added to the 4-token decayed counts. A step observes its
token's probabilities with its choices, so the extra predictor knows no more than the runtime's router has computed
by the time the cache plans. `scores-only` ranks by the mean probability (or log-probability) alone, outside payback.
"steps ranked by the scores": the share of (cache, token) steps at which payback's pool chose the extra predictor.
Below each table, what the scores say beyond the choices: among the experts a token did not choose, how well its
scores rank those the next token chooses (AUC, 0.5 is chance).

With --regimes, the same rows on the generated regimes (moeprep/profile/regimes.py), whose router scores are the
expected logits of each token's context state (regimes.Hidden at 0 tokens ahead: the router's logits less the
token's own term and the noise), in `logit` form (the mean of the logits over h tokens).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from moeprep.errors import MoeprepError
from moeprep.profile.heldout import cache_slots
from moeprep.profile.policy import SPAN, Payback, Replacement, UploadCost, replay
from moeprep.profile.regimes import REGIMES, TRAINED_TRACE, Shape, generate_with_hidden
from moeprep.profile.routing_stats import CHUNK_BATCH, SIZES, WARM_AFTER, hit_rates
from moeprep.profile.tracefile import TraceFile

HERE = Path(__file__).resolve().parent
HALF_LIVES = (1.0, 2.0, 4.0, 8.0, 16.0)
KINDS = ("prob", "logprob", "prob+decay-4")


def record(model_path: Path, text: str, n_ctx: int, windows: int) -> tuple[np.ndarray, np.ndarray]:
    """-> experts [N, L, K] (router order) and probabilities float32 [N, L, E] of every MoE layer."""
    import torch

    import moerun
    from moerun.layers.moe import GATING_PROBS, MoE

    model = moerun.load_model(model_path, n_ctx=n_ctx)
    tokens = model.tokenizer.encode(text, add_bos=False)
    n = min(len(tokens) // n_ctx, windows) * n_ctx
    moes = sorted((m for m in model.net.modules() if isinstance(m, MoE)), key=lambda m: m.layer)
    probs: dict[int, list[np.ndarray]] = {m.layer: [] for m in moes}
    chosen: dict[int, list[np.ndarray]] = {m.layer: [] for m in moes}

    def on_router(layer: int, router):
        def hook(_module, inputs, output):
            logits = router.gate(inputs[0]).float()
            probs[layer].append(GATING_PROBS[router.gating](logits).cpu().numpy())
            chosen[layer].append(output[0].cpu().numpy())

        return hook

    handles = [m.router.register_forward_hook(on_router(m.layer, m.router)) for m in moes]
    t0 = time.perf_counter()
    for w, start in enumerate(range(0, n, n_ctx)):
        model.forward(torch.tensor(tokens[start : start + n_ctx], dtype=torch.long), 0)
        print(f"\rwindow {w + 1}/{n // n_ctx}, {time.perf_counter() - t0:.0f} s", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    for h in handles:
        h.remove()
    experts = np.stack([np.concatenate(chosen[m.layer]) for m in moes], axis=1)
    return experts.astype(np.int64), np.stack([np.concatenate(probs[m.layer]) for m in moes], axis=1)


class ScoresOnly(Replacement):
    """Keeps the experts whose router probability (`kind` "prob") or its logarithm ("logprob"), averaged with a decay
    over `half_life` tokens, is highest. scores [B, T, E]: each row's probabilities, one per token it observes."""

    name = "scores-only"
    KINDS = ("prob", "logprob", "logit")

    def __init__(self, slots, n_expert: int, top_k: int, scores: np.ndarray, half_life: float, kind: str = "prob"):
        super().__init__(slots, n_expert, top_k)
        self.scores = np.log(np.maximum(scores, 1e-30)) if kind == "logprob" else scores  # prob, logit: as given
        self.decay = 0.5 ** (1.0 / half_life)
        self.mean = np.zeros((len(self.slots), n_expert))

    def priority(self, rows: np.ndarray) -> np.ndarray:
        return self.mean[rows] * SPAN + self.last[rows]

    def _used(self, rows, flat_rows, flat_ids, flat_tok, n_tok) -> None:
        assert n_tok == 1, "replayed one token per step"
        fresh = self.tokens[rows] == 0  # a log-probability mean starts at the first token's, not at 0
        now = self.scores[rows, self.tokens[rows]]
        self.mean[rows] = np.where(fresh[:, None], now, self.mean[rows] * self.decay + (1 - self.decay) * now)


class ScoredPayback(Payback):
    """Payback with one more predictor in its pool: the router's scores [B, T, E] (one per token a row observes)
    averaged with a decay over `half_life` tokens; `kind` "prob" (the probabilities), "logprob" (their logarithms,
    ranked as the logits are), "logit" (scores that are logits already: a generated regime's), or "prob+decay-4"
    (the mean probability times K plus the 4-token decayed count rate, both in uses per token)."""

    def __init__(self, slots, n_expert: int, top_k: int, scores: np.ndarray, half_life: float, kind: str):
        self.ESTIMATES = (*Payback.ESTIMATES, f"{kind}-{half_life:g}")
        self.scores, self.kind = (np.log(np.maximum(scores, 1e-30)) if kind == "logprob" else scores), kind
        self.score_decay_h = 0.5 ** (1.0 / half_life)
        super().__init__(slots, n_expert, top_k)
        self.mean = np.zeros((len(self.slots), n_expert))
        self.extra_chosen = 0  # row-steps whose cache ranked by the extra predictor

    def estimates(self, rows: np.ndarray) -> np.ndarray:
        extra = self.mean[rows]
        if self.kind == "prob+decay-4":
            extra = extra * self.top_k + self.recent[0, rows] * (1.0 - self.decays[0])
        return np.concatenate([super().estimates(rows), extra[None]])

    def _used(self, rows, flat_rows, flat_ids, flat_tok, n_tok) -> None:
        assert n_tok == 1, "replayed one token per step"
        d = self.score_decay_h
        fresh = self.tokens[rows] == 0  # a log-probability mean starts at the first token's, not at 0
        self.mean[rows] = np.where(
            fresh[:, None], self.scores[rows, 0], self.mean[rows] * d + (1 - d) * self.scores[rows, self.tokens[rows]]
        )
        super()._used(rows, flat_rows, flat_ids, flat_tok, n_tok)
        self.extra_chosen += int((self.predictor(rows) == len(self.ESTIMATES) - 1).sum())


def scored_rates(policy_of, ids: np.ndarray, probs: np.ndarray, n_ctx: int, n_expert: int):
    """-> hit rates [S] (after WARM_AFTER tokens of each window), uploads per token per layer [S] and the share of
    steps whose cache ranked by the router-score predictor (payback's extra one) of the policy built by
    policy_of(slots [B], scores [B, T, E]); rows are (window, size, layer), CHUNK_BATCH windows side by side (as
    routing_stats.hit_rates replays them: payback pools its ghost scores over the rows of one size)."""
    n_w = len(ids) // n_ctx
    n_m, n_k = ids.shape[1], ids.shape[2]
    slots = np.array([cache_slots(s, n_expert) for s in SIZES])
    w_ids = ids[: n_w * n_ctx].reshape(n_w, n_ctx, n_m, n_k).transpose(0, 2, 1, 3)  # [W, M, T, K]
    w_probs = probs[: n_w * n_ctx].reshape(n_w, n_ctx, n_m, n_expert).transpose(0, 2, 1, 3)  # [W, M, T, E]
    hits, uploads, chosen = np.zeros(len(SIZES)), np.zeros(len(SIZES)), 0.0
    for first in range(0, n_w, CHUNK_BATCH):
        b_ids, b_probs = w_ids[first : first + CHUNK_BATCH], w_probs[first : first + CHUNK_BATCH]
        shape = (len(b_ids), len(SIZES), n_m)
        rows_ids = np.ascontiguousarray(np.broadcast_to(b_ids[:, None], (*shape, n_ctx, n_k))).reshape(-1, n_ctx, n_k)
        rows_probs = np.broadcast_to(b_probs[:, None], (*shape, n_ctx, n_expert)).reshape(-1, n_ctx, n_expert)
        rows_slots = np.broadcast_to(slots[None, :, None], shape).reshape(-1)
        policy = policy_of(rows_slots, np.ascontiguousarray(rows_probs, np.float32))
        r = replay(policy, rows_ids)
        hits += r.hits.reshape(*shape, n_ctx)[..., WARM_AFTER:].sum(axis=(0, 2, 3))
        uploads += r.uploads.reshape(*shape, n_ctx).sum(axis=(0, 2, 3))
        chosen += getattr(policy, "extra_chosen", 0)
    steps = n_w * n_m * n_ctx
    return hits / (n_w * n_m * (n_ctx - WARM_AFTER) * n_k), uploads / steps, chosen / (steps * len(SIZES))


def next_choice_auc(ids: np.ndarray, scores: np.ndarray, chunk: int, sample: int = 2000) -> float:
    """How well a token's scores rank, among the experts it did not choose, those the next token chooses: the mean
    over layers and (a seeded sample of) tokens of the Mann-Whitney AUC (0.5: no better than chance, 1: every such
    expert above every other). Only what the scores add to the choices shows here."""
    n, n_m, _ = ids.shape
    n_e = scores.shape[2]
    rng = np.random.default_rng(0)
    at = np.flatnonzero((np.arange(n - 1) + 1) % chunk != 0)  # t and t + 1 in one chunk
    at = rng.choice(at, min(sample, len(at)), replace=False)
    aucs = []
    for m in range(n_m):
        now, nxt = np.zeros((2, len(at), n_e), bool)
        np.put_along_axis(now, ids[at, m], True, axis=1)
        np.put_along_axis(nxt, ids[at + 1, m], True, axis=1)
        for s, cand, pos in zip(scores[at, m], ~now, nxt):
            p, q = s[cand & pos], s[cand & ~pos]
            if len(p) and len(q):
                aucs.append((p[:, None] > q[None]).mean() + 0.5 * (p[:, None] == q[None]).mean())
    return float(np.mean(aucs))


def measure(ids: np.ndarray, scores: np.ndarray, chunk: int, kinds: tuple[str, ...]) -> tuple[list[int], dict]:
    """ids [N, M, K], scores [N, M, E] in chunks of `chunk` tokens -> slots [S] and, per policy, (hit rates [S],
    uploads per token per layer [S], share of steps ranked by the scores)."""
    n_expert, n_k = scores.shape[2], ids.shape[2]
    t = TraceFile(ids, np.arange(0, len(ids) + 1, chunk, dtype=np.int64), n_expert)
    base = ("lru", "payback", "belady")
    slots, hits, uploads = hit_rates(t, SIZES, base)
    rows = {name: (hits[i, :, 1].mean(axis=1), uploads[i].mean(axis=1), 0.0) for i, name in enumerate(base)}
    for kind in kinds:
        if kind in ScoresOnly.KINDS:
            for h in HALF_LIVES:
                rows[f"scores-only {kind}-{h:g}"] = scored_rates(
                    lambda s, sc: ScoresOnly(s, n_expert, n_k, sc, h, kind), ids, scores, chunk, n_expert
                )
    for kind in kinds:
        for h in HALF_LIVES:
            t0 = time.perf_counter()
            rows[f"payback+{kind}-{h:g}"] = scored_rates(
                lambda s, sc: ScoredPayback(s, n_expert, n_k, sc, h, kind), ids, scores, chunk, n_expert
            )
            print(f"payback+{kind}-{h:g}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return [int(s) for s in slots], rows


def report(title: str, slots: list[int], rows: dict, n_k: int, auc: float) -> dict:
    """Print one table; -> its rows as JSON-ready dicts, with each policy's mean share of the way to Belady."""
    cost = UploadCost()
    upload_in_reads = cost.upload_s / cost.hit_saves_s
    lru, belady = rows["lru"][0], rows["belady"][0]
    print(
        f"\n{title}: hit rate after 64 tokens / uploads per token per layer / net saving per token per layer "
        "(expert reads)"
    )
    print(
        "| policy | "
        + " | ".join(f"{s:.0%} ({n})" for s, n in zip(SIZES, slots))
        + " | of the way LRU -> Belady | steps ranked by the scores |"
    )
    print("|---|" + "---:|" * (len(SIZES) + 2))
    out = {}
    for name, (hit, up, chosen) in rows.items():
        way = float(((hit - lru) / np.maximum(belady - lru, 1e-9)).mean())
        net = hit * n_k - up * upload_in_reads
        out[name] = {"hit": hit.tolist(), "uploads": up.tolist(), "net": net.tolist(), "way": way, "chosen": chosen}
        cells = [f"{h:.1%} / {u:.2f} / {x:.2f}" for h, u, x in zip(hit, up, net)]
        print(f"| {name} | " + " | ".join(cells) + f" | {way:.0%} | {chosen:.0%} |")
    print(f"the scores rank the next token's new experts above the other unchosen ones with an AUC of {auc:.2f}")
    return {"slots": slots, "policies": out, "next_choice_auc": auc}


def regime_scores(name: str, layers: int, tokens: int) -> tuple[np.ndarray, np.ndarray, int]:
    """A generated regime's trace and, as its router scores, the expected logits of the token's own context state
    (regimes.Hidden, ahead 0: what the router's logits say beyond the token's id and the noise) -> ids, scores,
    chunk length."""
    r = REGIMES[name]
    t, hidden = generate_with_hidden(name, Shape(layers, r.shape.experts, r.shape.top_k), tokens, r.target_chunk)
    if t.n_tokens % r.target_chunk:
        raise ValueError(f"--tokens must be a multiple of {name}'s chunk of {r.target_chunk}")
    scores = np.stack([hidden.expected_logits(m, hidden.states, 0) for m in range(layers)], axis=1)
    return t.ids, scores.astype(np.float32), r.target_chunk


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=HERE / "models" / "bench-qwen3moe-f16.gguf")
    p.add_argument("--text", type=Path, default=HERE / "data" / "heldout.txt")
    p.add_argument("--windows", type=int, default=64, help="windows of the text to replay (the trace holds 64)")
    p.add_argument("--ctx-size", type=int, default=512)
    p.add_argument("--scores", type=Path, help="write the recorded experts and probabilities here (.npz)")
    p.add_argument("--from-scores", type=Path, help="read them from a file --scores wrote; run no model")
    p.add_argument("--regimes", help="comma-separated generated regimes (or all) to measure instead of the model")
    p.add_argument("--layers", type=int, default=4, help="with --regimes: MoE layers of each trace")
    p.add_argument("--tokens", type=int, default=4096, help="with --regimes: tokens of each trace")
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    results = {}
    try:
        if a.regimes:
            generated = [n for n in REGIMES if n != "trained"]
            names = generated if a.regimes == "all" else a.regimes.split(",")
            if unknown := [n for n in names if n not in generated]:
                raise ValueError(f"not a generated regime: {', '.join(unknown)} (choose from {', '.join(generated)})")
            for name in names:
                ids, scores, chunk = regime_scores(name, a.layers, a.tokens)
                slots, rows = measure(ids, scores, chunk, ("logit",))
                title = f"{name} ({a.layers} layers, {scores.shape[2]} experts, top-{ids.shape[2]}, {len(ids)} tokens)"
                results[name] = report(title, slots, rows, ids.shape[2], next_choice_auc(ids, scores, chunk))
            if a.json:
                a.json.write_text(json.dumps(results, indent=1))
            return
        if a.windows < 1 or a.ctx_size <= WARM_AFTER:
            raise ValueError(f"--windows must be at least 1 and --ctx-size above {WARM_AFTER}")
        if a.from_scores:
            with np.load(a.from_scores) as z:
                ids, probs = z["experts"].astype(np.int64), z["probs"].astype(np.float32)
            if ids.ndim != 3 or probs.shape[:2] != ids.shape[:2]:
                raise ValueError(f"{a.from_scores}: experts {ids.shape} and probs {probs.shape} do not match")
            ids, probs = ids[: a.windows * a.ctx_size], probs[: a.windows * a.ctx_size]
        else:
            ids, probs = record(a.model, a.text.read_text(encoding="utf-8"), a.ctx_size, a.windows)
        if len(ids) < a.ctx_size:
            raise ValueError(f"fewer than {a.ctx_size} tokens to replay")
    except (OSError, KeyError, ValueError, MoeprepError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if a.scores:
        experts = ids.astype(np.uint8 if probs.shape[2] <= 256 else np.uint16)
        np.savez_compressed(a.scores, experts=experts, probs=probs.astype(np.float16))
    n_expert, n_k = probs.shape[2], ids.shape[2]
    line = f"{len(ids)} tokens, {ids.shape[1]} MoE layers, {n_expert} experts, top-{n_k}"
    with np.load(TRAINED_TRACE) as z:
        recorded = z["experts"][: len(ids)].astype(np.int64)
    if recorded.shape[1:] == ids.shape[1:]:  # the trained bench model's shape: check against its recorded trace
        n = min(len(recorded), len(ids))
        same = np.sort(recorded[:n], axis=2) == np.sort(ids[:n], axis=2)
        line += f"; choices equal to the `trained` trace's: {same.mean():.2%} of {same.size}"
    print(line)
    slots, rows = measure(ids, probs, a.ctx_size, KINDS)
    auc = next_choice_auc(ids, probs, a.ctx_size)
    results["trained"] = report(f"trained, recorded scores ({len(ids)} tokens)", slots, rows, n_k, auc)
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
