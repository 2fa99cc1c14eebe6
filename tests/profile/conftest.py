"""Fixtures: synthetic profiles (skewed random routing with a known hot set) and synthetic models."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from moeprep.profile.counts import ExpertCounts
from moeprep.profile.identity import ModelIdentity
from moeprep.profile.profile import Profile, Provenance, judge
from moeprep.profile.trace import RoutingTrace
from tests.quant.conftest import ggml  # noqa: F401  (libggml's quantizer: the oracle fixture of tests/quant)


def fake_identity(
    n_layer: int = 4, moe_layers: tuple[int, ...] = (1, 2, 3), n_expert: int = 16, k: int = 2, router: str = "ab" * 32
) -> ModelIdentity:
    return ModelIdentity(
        arch="qwen3moe",
        name="fake",
        file_size=12345,
        n_layer=n_layer,
        moe_layers=moe_layers,
        n_expert=n_expert,
        n_expert_used=k,
        router_sha256=router,
    )


def skewed_routing(
    rng: np.random.Generator, n_tokens: int, n_layers: int, n_expert: int, k: int, skew: float
) -> tuple[np.ndarray, np.ndarray]:
    """ids [T, M, K] drawn without replacement from p(rank r) ~ (r+1)^-skew, a fixed expert order per layer."""
    ids = np.zeros((n_tokens, n_layers, k), np.int64)
    for m in range(n_layers):
        order = np.random.default_rng(m).permutation(n_expert)  # same hot set in every call for a layer
        p = (np.arange(n_expert) + 1.0) ** -skew
        p /= p.sum()
        for t in range(n_tokens):
            ids[t, m] = order[rng.choice(n_expert, size=k, replace=False, p=p)]
    weights = rng.random((n_tokens, n_layers, k)).astype(np.float32)
    return ids, weights / weights.sum(axis=2, keepdims=True)


def make_profile(
    seed: int = 0,
    chunks: int = 6,
    heldout: int = 2,
    tokens: int = 80,
    skew: float = 1.2,
    identity: ModelIdentity | None = None,
) -> Profile:
    identity = identity or fake_identity()
    rng = np.random.default_rng(seed)
    m, e, k = len(identity.moe_layers), identity.n_expert, identity.n_expert_used
    counts = ExpertCounts.zeros(identity.moe_layers, e)
    traced, held = [], [c >= chunks - heldout for c in range(chunks)]
    for c in range(chunks):
        ids, w = skewed_routing(rng, tokens - c, m, e, k, skew)  # unequal chunk lengths on purpose
        if not held[c]:
            for row in range(m):
                counts.add(row, ids[:, row], w[:, row])
        traced.append(ids)
    trace = RoutingTrace.from_chunks(traced, held, e)
    source = Provenance("synthetic", None, None, "text", tokens, chunks - heldout, heldout, int(counts.tokens[0]))
    return Profile(identity, [source], counts, trace, judge(counts, trace))


@pytest.fixture
def profile() -> Profile:
    return make_profile()


CALIBRATION = Path(__file__).resolve().parents[2] / "moeprep" / "data" / "calibration.txt"


@pytest.fixture(scope="session")
def synth(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """synth(name, **options) -> path of a synthetic model written once per session."""
    from moeprep.synth.model import write_synth_model

    folder = tmp_path_factory.mktemp("models")
    made: dict[str, Path] = {}

    def make(name: str, **options) -> Path:  # noqa: ANN003
        if name not in made:
            made[name] = write_synth_model(folder / f"{name}.gguf", **options)
        return made[name]

    return make
