"""The routing trace file (.npz): the experts, and optionally their gate weights, every MoE layer of a model chose
for every token, chunk by chunk. `moeprep routing generate` writes one from a named regime, `moeprep routing
extract` from a `moeprep profile` output, `moeprep routing stats` summarises one, and `moerun bench --routing`
replays one through the runtime. The layout is in docs/profile-format.md ("Routing trace files").

Letters: N tokens of all chunks, C chunks, M MoE layers, K experts chosen per token, E experts per layer.
"""

from __future__ import annotations

import io
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moeprep.atomic import atomic_output
from moeprep.errors import MoeprepError
from moeprep.profile.trace import RoutingTrace, id_dtype

FORMAT = "moeprep-routing-trace"
VERSION = 1


@dataclass
class TraceFile:
    """A routing trace with what a replay needs to check it against a model."""

    ids: np.ndarray  # [N, M, K] expert ids, each token's K distinct
    starts: np.ndarray  # [C + 1] int64 chunk boundaries in N; every chunk is a fresh sequence (position 0)
    n_expert: int  # E: the experts of each MoE layer the ids index
    weights: np.ndarray | None = None  # [N, M, K] float32 gate weights; None: each choice weighs 1/K
    regime: str = ""  # the regime that generated it ("" for a recorded one)
    source: str = ""  # one line: where the routing came from
    labels: np.ndarray | None = None  # [C] str: each chunk's kind (e.g. chat, long), None: unlabelled

    @property
    def n_layers(self) -> int:
        return self.ids.shape[1]

    @property
    def top_k(self) -> int:
        return self.ids.shape[2]

    @property
    def n_tokens(self) -> int:
        return self.ids.shape[0]

    @property
    def n_chunks(self) -> int:
        return len(self.starts) - 1

    def chunk_lengths(self) -> np.ndarray:
        return np.diff(self.starts)

    def routing_trace(self) -> RoutingTrace:
        """As the profile's RoutingTrace (every chunk held out: all of them are replayed)."""
        return RoutingTrace(self.ids, self.starts, np.ones(self.n_chunks, bool))

    def shape_text(self) -> str:
        return f"{self.n_layers} MoE layers, {self.n_expert} experts, top-{self.top_k}"

    def check_shape(self, n_layers: int, n_expert: int, top_k: int, where: str) -> None:
        """Refuse, in one line, to replay on a model of another shape: nothing is stretched to fit."""
        if (self.n_layers, self.n_expert, self.top_k) != (n_layers, n_expert, top_k):
            raise MoeprepError(
                f"{where}: the trace has {self.shape_text()}; the model has {n_layers} MoE layers, "
                f"{n_expert} experts, top-{top_k}: generate one of the model's shape (moeprep routing "
                "generate --layers/--experts/--top-k) or record one on a model of this shape"
            )


def write_trace(path: str | Path, t: TraceFile) -> None:
    """Write atomically (a temp file renamed into place); an invalid trace is a bug of the caller."""
    path = Path(path)
    if not path.parent.exists():
        raise MoeprepError(f"{path.parent}: output folder does not exist")
    _check(t, str(path))
    arrays = {
        "format": np.array(FORMAT),
        "version": np.array(VERSION, np.int64),
        "ids": t.ids.astype(id_dtype(t.n_expert)),
        "starts": t.starts.astype(np.int64),
        "n_expert": np.array(t.n_expert, np.int64),
        "regime": np.array(t.regime),
        "source": np.array(t.source),
    }
    if t.weights is not None:
        arrays["weights"] = t.weights.astype(np.float32)
    if t.labels is not None:
        arrays["labels"] = np.asarray(t.labels, str)
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **arrays)
    with atomic_output(path) as tmp:
        tmp.write_bytes(buffer.getvalue())


def read_trace(path: str | Path) -> TraceFile:
    """A trace file, or a .moeprof profile (its trace, every chunk); anything else is one MoeprepError."""
    path = Path(path)
    if not path.is_file():
        raise MoeprepError(f"{path}: no such routing trace")
    with open(path, "rb") as f:
        magic = f.read(8)
    if magic == b"MOEPROF\0":
        from moeprep.profile.format import read_profile

        return trace_from_profile(read_profile(path), str(path))
    foreign = f"{path}: not a routing trace (write one with `moeprep routing generate` or `moeprep routing extract`)"
    try:
        with np.load(path, allow_pickle=False) as z:
            if "format" not in z.files or str(z["format"]) != FORMAT:
                raise MoeprepError(foreign)
            version = int(z["version"])
            if version > VERSION:
                raise MoeprepError(
                    f"{path}: routing trace version {version} is newer than this moeprep's ({VERSION}); upgrade moeprep"
                )
            t = TraceFile(
                ids=z["ids"].astype(np.int64),
                starts=z["starts"].astype(np.int64),
                n_expert=int(z["n_expert"]),
                weights=z["weights"].astype(np.float32) if "weights" in z.files else None,
                regime=str(z["regime"]),
                source=str(z["source"]),
                labels=z["labels"] if "labels" in z.files else None,
            )
    except MoeprepError:
        raise
    except (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile, EOFError) as e:
        raise MoeprepError(f"{foreign} ({type(e).__name__}: {e})") from e
    _check(t, str(path))
    return t


def trace_from_profile(p, where: str) -> TraceFile:
    """A profile's recorded routing (counted and held-out chunks alike) as a trace file; a profile keeps no gate
    weights, so a replay of it weighs every choice 1/K."""
    name = p.model.name or p.model.arch
    return TraceFile(
        ids=p.trace.ids.astype(np.int64),
        starts=p.trace.starts.astype(np.int64),
        n_expert=p.model.n_expert,
        source=f"moeprep profile of {name} ({where})",
    )


def _check(t: TraceFile, where: str) -> None:
    """Shapes and ids agree with each other; a file that parses but disagrees with itself is damaged."""
    ids, starts = t.ids, t.starts
    problems = [
        (ids.ndim != 3 or 0 in ids.shape, f"ids have shape {ids.shape}, not [tokens, layers, top-k]"),
        (
            starts.ndim != 1
            or len(starts) < 2
            or starts[0] != 0
            or starts[-1] != len(ids)
            or (np.diff(starts) <= 0).any(),
            "chunk boundaries inconsistent",
        ),
        (
            t.n_expert < 1 or (ids.size and (ids.min() < 0 or ids.max() >= t.n_expert)),
            f"expert ids outside 0..{t.n_expert - 1}",
        ),
        (
            ids.ndim == 3
            and ids.shape[2] > 1
            and (np.sort(ids, axis=2)[..., 1:] == np.sort(ids, axis=2)[..., :-1]).any(),
            "a token chose the same expert twice",
        ),
        (t.weights is not None and t.weights.shape != ids.shape, "weights and ids differ in shape"),
        (t.labels is not None and len(t.labels) != len(starts) - 1, "one chunk label per chunk expected"),
    ]
    bad = [msg for failed, msg in problems if failed]
    if bad:
        raise MoeprepError(f"{where}: damaged routing trace ({bad[0]})")
