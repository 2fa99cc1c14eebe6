"""`moeprep profile MODEL`: calibration text through moerun, counted, traced, judged on held-out chunks.

The last `holdout` share of the chunks is held out: it runs through the model like the rest, but only the trace
keeps it, for the cache simulation. Taking the tail rather than every n-th chunk keeps the held-out text away from
the counted text, so the table shows how a profile carries over to text it has not seen. The importance matrix
(--imatrix-out) takes every chunk, held-out ones included: it is not judged, and more text makes it better.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np

from moeprep.errors import MoeprepError
from moeprep.gguf.reader import open_gguf
from moeprep.profile.collect import ActivationRecorder, collect
from moeprep.profile.dataset import DatasetSpec, calibration_chunks
from moeprep.profile.identity import identify_model
from moeprep.profile.profile import Profile, Provenance, judge


@dataclass(frozen=True)
class ProfileRequest:
    model: Path
    dataset: DatasetSpec
    ctx: int = 512
    chunks: int | None = None  # None: every full chunk of the text (as llama-imatrix)
    tokens: int | None = None  # alternative to chunks: enough chunks for this many tokens
    holdout: float = 0.2
    device: str = "cpu"
    imatrix_out: Path | None = None

    @property
    def max_chunks(self) -> int | None:
        return math.ceil(self.tokens / self.ctx) if self.tokens is not None else self.chunks


def heldout_mask(n_chunks: int, holdout: float, where: str) -> np.ndarray:
    """[C] True for the held-out tail: round(holdout * C) chunks, at least one, never all."""
    mask = np.zeros(n_chunks, bool)
    if holdout == 0:
        return mask
    if n_chunks < 2:
        raise MoeprepError(
            f"{where}: only {n_chunks} chunk; holding some out needs 2 or more: give more text, a "
            "smaller --ctx, or --holdout 0"
        )
    n = min(max(1, round(holdout * n_chunks)), n_chunks - 1)
    mask[n_chunks - n :] = True
    return mask


def short_text_warning(dataset: str, n_chunks: int, ctx: int, asked: int | None) -> str | None:
    """The line saying the text gave fewer chunks than asked, or None when it gave them all."""
    if asked is None or n_chunks >= asked:
        return None
    return (
        f"moeprep: warning: dataset {dataset} gave {n_chunks} chunk{'s' if n_chunks != 1 else ''} of {ctx} "
        f"tokens, fewer than the {asked} asked; the results rest on only that much text (give more text, a "
        "smaller --ctx, or ask fewer chunks)"
    )


def profile_model(req: ProfileRequest) -> Profile:
    import moerun

    g = open_gguf(req.model)
    identity = identify_model(g)  # refuses a dense model before any weight is loaded
    model = moerun.load_model(g, device=req.device, n_ctx=req.ctx)
    tok = model.tokenizer
    chunks = calibration_chunks(req.dataset, tok.encode, tok.bos_id if tok.add_bos else None, req.ctx, req.max_chunks)
    warning = short_text_warning(req.dataset.name, len(chunks), req.ctx, req.max_chunks)
    if warning is not None:  # before the pass, which can take hours: the user may stop it and give more text
        click.echo(warning, err=True)
    heldout = heldout_mask(len(chunks), req.holdout, req.dataset.name)
    imatrix = None
    if req.imatrix_out is not None:
        # matrices per weight: the expert axis of a stack (3-D), else one
        imatrix = ActivationRecorder({t.name: t.shape[0] if len(t.shape) == 3 else 1 for t in model.gguf.tensors})
        handle = model.add_activation_hook(imatrix)
    try:
        counts, trace = collect(model, chunks, heldout, identity.moe_layers, identity.n_expert, identity.n_expert_used)
    finally:
        if imatrix is not None:
            handle.remove()
    spec = req.dataset
    local_file = spec.local is not None and spec.local.is_file()
    source = Provenance(
        dataset=spec.name,
        config=spec.resolved_config,
        split=None if local_file else spec.split,
        text_column=spec.text_column,
        ctx=req.ctx,
        chunks=int((~heldout).sum()),
        heldout_chunks=int(heldout.sum()),
        tokens=int(chunks[~heldout].size),
        chunks_asked=req.max_chunks,
    )
    if imatrix is not None:
        from moeprep.quant.imatrix import write_imatrix_gguf

        write_imatrix_gguf(req.imatrix_out, imatrix.entries(), [spec.name], len(chunks), req.ctx)
    return Profile(identity, [source], counts, trace, judge(counts, trace))
