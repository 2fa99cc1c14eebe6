"""A profile in memory: model identity, where the text came from, counts, trace, held-out table; and merging.

The held-out table is derived data: a function of the counts and the trace's held-out chunks. Merging recomputes
it from the merged counts, so a merged profile is judged the same way a single run is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

from moeprep.errors import MoeprepError
from moeprep.profile.counts import ExpertCounts
from moeprep.profile.heldout import HeldoutTable, simulate_caches
from moeprep.profile.identity import ModelIdentity, check_same_model
from moeprep.profile.trace import RoutingTrace


@dataclass(frozen=True)
class Provenance:
    """One calibration run's text: a merged profile keeps one per run, with the weight it was merged at."""

    dataset: str  # Hugging Face name or local path
    config: str | None
    split: str | None
    text_column: str | None
    ctx: int  # tokens per chunk
    chunks: int  # counted chunks
    heldout_chunks: int
    tokens: int  # counted tokens
    weight: int = 1
    # chunks the run asked for, held-out ones included (None: all of the text); above chunks + heldout_chunks when
    # the text ran out first
    chunks_asked: int | None = None

    @property
    def short_of_text(self) -> bool:
        return self.chunks_asked is not None and self.chunks + self.heldout_chunks < self.chunks_asked

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Provenance:
        """Keys this version does not know are skipped, so a profile from a newer moeprep still reads."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


@dataclass
class Profile:
    model: ModelIdentity
    sources: list[Provenance]
    counts: ExpertCounts
    trace: RoutingTrace
    heldout: HeldoutTable | None


def judge(counts: ExpertCounts, trace: RoutingTrace) -> HeldoutTable | None:
    """The held-out table, or None when there is nothing to replay or nothing counted to warm from."""
    if not trace.heldout.any() or counts.selections.sum() == 0:
        return None
    return simulate_caches(trace, counts)


def merge_profiles(profiles: Sequence[tuple[str, Profile]], weights: Sequence[int] | None = None) -> Profile:
    """Weighted sum of the counts of profiles of one model (named by path for errors); traces are concatenated.

    A weight w counts a profile as if its text had been seen w times; its trace is kept once.
    """
    weights = list(weights) if weights is not None else [1] * len(profiles)
    if len(weights) != len(profiles):
        raise MoeprepError(f"--weights: {len(weights)} weights for {len(profiles)} profiles; give one per profile")
    if any(w < 1 for w in weights):
        raise MoeprepError(f"--weights: {weights} has a weight below 1; weights are positive integers")
    first_path, first = profiles[0]
    for path, p in profiles[1:]:
        check_same_model(p.model, first.model, path, first_path)
    counts = first.counts.scaled(weights[0])
    for (_, p), w in zip(profiles[1:], weights[1:]):
        counts = counts + p.counts.scaled(w)
    sources = [
        Provenance(**{**s.to_dict(), "weight": s.weight * w}) for (_, p), w in zip(profiles, weights) for s in p.sources
    ]
    trace = RoutingTrace.concat([p.trace for _, p in profiles])
    return Profile(first.model, sources, counts, trace, judge(counts, trace))
