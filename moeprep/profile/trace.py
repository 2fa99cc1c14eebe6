"""The routing trace: which experts every token chose in every MoE layer, in token order, chunk by chunk.

Counts say how hot an expert is; only the trace can replay the order in which experts were needed, which is what
a cache simulation (heldout.py) and outside tools (export's trace-csv) need.

Letters: N tokens of all chunks, C chunks, T tokens of one chunk, M MoE layers, K experts chosen per token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def id_dtype(n_expert: int) -> np.dtype:
    """The smallest unsigned type holding every expert id (uint8 up to 256 experts)."""
    return np.dtype(np.uint8 if n_expert <= 256 else np.uint16)


@dataclass
class RoutingTrace:
    """Chunks laid end to end in `ids`; chunk c is ids[starts[c]:starts[c + 1]]."""

    ids: np.ndarray  # [N, M, K] expert ids
    starts: np.ndarray  # [C + 1] int64 chunk boundaries in N
    heldout: np.ndarray  # [C] bool: kept out of the counts, replayed by the cache simulation

    @classmethod
    def from_chunks(cls, chunks: Sequence[np.ndarray], heldout: Sequence[bool], n_expert: int) -> RoutingTrace:
        """A trace from per-chunk [T, M, K] id arrays (at least one chunk)."""
        lengths = [len(c) for c in chunks]
        ids = np.concatenate([c.astype(id_dtype(n_expert)) for c in chunks])
        return cls(ids, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64), np.asarray(heldout, bool))

    @classmethod
    def concat(cls, traces: Sequence[RoutingTrace]) -> RoutingTrace:
        offsets = np.cumsum([0] + [len(t.ids) for t in traces[:-1]])
        dtype = max((t.ids.dtype for t in traces), key=lambda d: d.itemsize)
        return cls(
            np.concatenate([t.ids.astype(dtype) for t in traces]),
            np.concatenate([[0]] + [t.starts[1:] + off for t, off in zip(traces, offsets)]).astype(np.int64),
            np.concatenate([t.heldout for t in traces]),
        )

    @property
    def n_chunks(self) -> int:
        return len(self.starts) - 1

    @property
    def top_k(self) -> int:
        return self.ids.shape[2]

    def chunk(self, c: int) -> np.ndarray:
        return self.ids[self.starts[c] : self.starts[c + 1]]

    def padded(self, chunks: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """The given chunks stacked for vectorised replay: ids [C, T, M, K] (zero padded) and valid [C, T]."""
        lengths = np.diff(self.starts)[list(chunks)]
        t_max = int(lengths.max()) if len(lengths) else 0
        ids = np.zeros((len(lengths), t_max, *self.ids.shape[1:]), np.int64)
        valid = np.arange(t_max)[None, :] < lengths[:, None]
        for row, c in enumerate(chunks):
            ids[row, : lengths[row]] = self.chunk(c)
        return ids, valid
