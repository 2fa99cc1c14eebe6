"""Warm start: which experts each layer's slots hold before the first token, from a profile's counts or those baked
into the GGUF."""

from __future__ import annotations

import numpy as np

from moeprep.errors import MoeprepError
from moeprep.gguf.reader import GGUFModel
from moeprep.profile.export import EXPERT_USAGE_KEY


def warm_experts(usage: np.ndarray | None, layer: int, n_expert: int) -> np.ndarray:
    """A layer's experts hottest first by the warm-start counts (none without counts: the cache starts empty)."""
    if usage is None or usage[layer].sum() == 0:
        return np.zeros(0, np.int64)
    return np.argsort(-usage[layer], kind="stable")


def read_model_profile(g: GGUFModel, profile_path: str):
    """The profile at `profile_path`, refused (one MoeprepError) when it was made for another model."""
    from moeprep.profile.format import read_profile
    from moeprep.profile.identity import check_same_model, identify_model

    profile = read_profile(profile_path)
    check_same_model(profile.model, identify_model(g), profile_path, str(g.path))
    return profile


def expert_usage(g: GGUFModel, profile, n_layer: int) -> np.ndarray | None:
    """Warm-start counts [L, E]: from a profile of this very model (read_model_profile), else from the GGUF's baked
    counts, else None."""
    if profile is not None:
        return profile.counts.block_table(n_layer)
    baked = g.get(EXPERT_USAGE_KEY)
    if baked is None:
        return None
    table = np.asarray(baked, np.int64)
    n_blocks = int(g.get(f"{g.arch}.block_count", n_layer))  # profile bake writes every block, NextN ones too
    if table.size % n_blocks:
        raise MoeprepError(
            f"{g.path}: {EXPERT_USAGE_KEY} holds {table.size} counts, not a multiple of {n_blocks} blocks"
        )
    return table.reshape(n_blocks, -1)[:n_layer]
