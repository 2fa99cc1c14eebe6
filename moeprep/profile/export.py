"""A profile in other tools' formats: llama.cpp expert-cache fork state file, CSV trace, JSON; baked into a GGUF.

Formats are a table (EXPORTERS): each writer takes the profile, the model identity to label it with (the profiled
file's, or the one given by --model) and a text stream.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

import numpy as np
from gguf import GGUFValueType

from moeprep.atomic import atomic_output
from moeprep.errors import MoeprepError
from moeprep.gguf.reader import open_gguf
from moeprep.gguf.writer import KVValue, write_gguf
from moeprep.profile.heldout import ABOUT
from moeprep.profile.identity import ModelIdentity, check_same_model, identify_model
from moeprep.profile.profile import Profile

# The GGUF key the expert-cache fork (and moerun) read as a warm start: UINT32[n_layer * n_expert],
# index block * n_expert + expert, dense blocks zero.
EXPERT_USAGE_KEY = "moe_cache.expert_usage"
UINT32_MAX = (1 << 32) - 1


def write_moe_state_ini(p: Profile, label: ModelIdentity, out: TextIO) -> None:
    """The fork's state-file section: `hot.<i>` holds lifetime counts per expert of the i-th MoE layer."""
    out.write(f"[{label.name} {label.file_size}]\n")
    out.write(f"geom = {label.arch}.{label.n_expert}.{label.n_expert_used}\n")
    for i, row in enumerate(usage_table(p.counts.selections)):
        out.write(f"hot.{i} = {' '.join(str(int(c)) for c in row)}\n")


def write_trace_csv(p: Profile, label: ModelIdentity, out: TextIO) -> None:
    """One `pos,layer,id0,...,idK-1` row per token and MoE layer, chunk by chunk; pos restarts at 0 per chunk."""
    layers = np.array(p.counts.layers)
    for c in range(p.trace.n_chunks):
        ids = p.trace.chunk(c)  # [T, M, K]
        n_t, n_m, n_k = ids.shape
        rows = np.concatenate(
            [np.repeat(np.arange(n_t), n_m)[:, None], np.tile(layers, n_t)[:, None], ids.reshape(n_t * n_m, n_k)],
            axis=1,
        )
        np.savetxt(out, rows, fmt="%d", delimiter=",")


def profile_dict(p: Profile, label: ModelIdentity) -> dict:
    c = p.counts
    h = p.heldout
    return {
        "model": label.to_dict(),
        "sources": [s.to_dict() for s in p.sources],
        "layers": [
            {
                "block": b,
                "tokens": int(c.tokens[m]),
                "selections": c.selections[m].tolist(),
                "gate_mass": c.gate_mass[m].tolist(),
            }
            for m, b in enumerate(c.layers)
        ],
        "heldout": None
        if h is None
        else {
            "chunks": h.chunks,
            "tokens": h.tokens,
            "lookups_per_layer": dict(zip(h.windows, h.lookups.tolist())),
            "policies": {name: ABOUT[name] for name in h.policies},
            "rates": [
                {
                    "policy": pol,
                    "size": size,
                    "slots": slots,
                    "window": win,
                    "overall": float(h.overall()[pi, si, wi]),
                    "per_layer": h.layer_rates()[pi, si, wi].tolist(),
                }
                for pi, pol in enumerate(h.policies)
                for si, (size, slots) in enumerate(zip(h.sizes, h.slots))
                for wi, win in enumerate(h.windows)
            ],
        },
    }


def write_json(p: Profile, label: ModelIdentity, out: TextIO) -> None:
    json.dump(profile_dict(p, label), out, indent=1)
    out.write("\n")


EXPORTERS: dict[str, Callable[[Profile, ModelIdentity, TextIO], None]] = {
    "moe-state-ini": write_moe_state_ini,
    "trace-csv": write_trace_csv,
    "json": write_json,
}


def write_export(p: Profile, fmt: str, label: ModelIdentity, out: Path) -> None:
    """Export to a file, atomically (temp file beside it, then rename)."""
    try:
        with atomic_output(out) as tmp, open(tmp, "w", encoding="utf-8") as f:
            EXPORTERS[fmt](p, label, f)
    except OSError as e:
        raise MoeprepError(f"{out}: cannot write ({e.strerror}); check the path") from e


def export_label(p: Profile, profile_path: str, model_path: str | None) -> ModelIdentity:
    """The identity to label an export with: the profiled file's, or `model_path`'s after checking it matches."""
    if model_path is None:
        return p.model
    model = identify_model(open_gguf(model_path))
    check_same_model(p.model, model, profile_path, model_path)
    return model


def usage_table(selections: np.ndarray) -> np.ndarray:
    """Counts as uint32 per layer: a layer whose maximum does not fit is halved until it does, keeping its ratios."""
    out = selections.astype(np.int64).copy()
    for row in out:
        while row.max(initial=0) > UINT32_MAX:
            row >>= 1
    return out.astype(np.uint32)


def bake_profile(p: Profile, profile_path: str, model_path: str, out: str | Path) -> list[Path]:
    """Copy `model_path` to `out` with the counts as EXPERT_USAGE_KEY; tensors and other keys unchanged."""
    model = open_gguf(model_path)
    check_same_model(p.model, identify_model(model), profile_path, model_path)
    table = usage_table(p.counts.block_table(p.model.n_layer))
    value = KVValue(table.reshape(-1), GGUFValueType.ARRAY, GGUFValueType.UINT32)
    return write_gguf(out, model, kv_set={EXPERT_USAGE_KEY: value})
