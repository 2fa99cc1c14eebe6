"""Profiling real (synthetic) models through moerun: counts against llama.cpp's ffn_moe_topk, determinism, skew,
and the importance matrix from the same pass."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

import moerun
from moeprep.gguf.roles import parse_tensor_name
from moeprep.profile.dataset import DatasetSpec, calibration_chunks
from moeprep.profile.format import encode_profile
from moeprep.profile.heldout import POLICIES
from moeprep.profile.profile import Profile
from moeprep.profile.run import ProfileRequest, profile_model
from tests.near_ties import MIN_JUDGED, judged, router_inputs, routing_margins
from tests.profile.conftest import CALIBRATION

SPEC = DatasetSpec(str(CALIBRATION))
CTX = 64


def run_profile(path: Path, chunks: int = 6, holdout: float = 0.0, **kw) -> Profile:  # noqa: ANN003
    return profile_model(ProfileRequest(path, SPEC, ctx=CTX, chunks=chunks, holdout=holdout, **kw))


@dataclass
class LlamaRouting:
    """llama.cpp's routing of the profiled chunks against the profile's."""

    hist: np.ndarray  # [M, E] histogram of llama.cpp's ffn_moe_topk
    per_token: float  # share of our per-token choices it agrees with, on tokens no near-tie decides
    tied: float  # share of tokens left out for a routing near-tie at some layer (tests/near_ties.py)
    first_flip: int | None  # the first block where some token's choice differs, None if none does


def llama_routing(path: Path, p: Profile, n_chunks: int) -> LlamaRouting:
    from tests.oracle import llama_eval

    model = moerun.load_model(path, n_ctx=CTX)
    tok = model.tokenizer
    chunks = calibration_chunks(SPEC, tok.encode, tok.bos_id if tok.add_bos else None, CTX, n_chunks)
    hist = np.zeros_like(p.counts.selections)
    same = judged_choices = tied = 0
    flips: set[int] = set()
    for c, chunk in enumerate(chunks):
        topk = llama_eval(path, chunk.tolist()).topk
        with router_inputs(model) as inputs:
            model.forward(torch.tensor(chunk))
        clear = judged(routing_margins(model, inputs))  # (CTX,)
        tied += int((~clear).sum())
        for m, block in enumerate(p.model.moe_layers):
            hist[m] += np.bincount(topk[block].reshape(-1), minlength=p.model.n_expert)
            ours = p.trace.chunk(c)[:, m].tolist()
            same += sum(len(set(a) & set(b)) for a, b, keep in zip(ours, topk[block].tolist(), clear) if keep)
            judged_choices += int(clear.sum()) * p.model.n_expert_used
            if any(set(a) != set(b) for a, b in zip(ours, topk[block].tolist())):
                flips.add(block)
    return LlamaRouting(hist, same / judged_choices, tied / (len(chunks) * CTX), min(flips, default=None))


# F32 and F16 weights: llama.cpp and moerun differ only in the last bits of float32 sums (and F16 roundings they
# move), so every choice of a token that no near-tie decides is the same, and the histograms differ by at most the
# choices of the tied tokens.
# Q8_0: llama.cpp rounds activations to 8 bits, a drift no tie bound covers: near-tied routers may flip, and the
# bar is a floor.
@pytest.mark.parametrize(
    "kind, types, floor",
    [
        ("f32", dict(expert_type="F32", attn_type="F32"), None),
        ("f16", dict(expert_type="F16", attn_type="F16"), None),
        ("q8_0", dict(expert_type="Q8_0", attn_type="Q8_0"), 0.99),
    ],
)
def test_counts_match_llama_cpp(synth, kind: str, types: dict, floor: float | None) -> None:  # noqa: ANN001
    path = synth(f"tiny-{kind}", skew=0.6, **types)
    p = run_profile(path)
    r = llama_routing(path, p, 6)
    hist, per_token, tied = r.hist, r.per_token, r.tied
    agreement = np.minimum(hist, p.counts.selections).sum() / hist.sum()
    assert hist.sum() == p.counts.selections.sum() == 6 * CTX * len(p.model.moe_layers) * p.model.n_expert_used
    assert tied <= 1 - MIN_JUDGED, f"{tied:.1%} of the tokens are routing near-ties"
    if floor is None:
        assert per_token == 1.0 and agreement >= 1 - tied, (agreement, per_token, tied)
    else:
        assert agreement >= floor and per_token >= floor, (agreement, per_token)


def test_profiles_are_deterministic(synth) -> None:  # noqa: ANN001
    path = synth("tiny-f16", skew=0.6, expert_type="F16", attn_type="F16")
    assert encode_profile(run_profile(path, 4, 0.25)) == encode_profile(run_profile(path, 4, 0.25))


def test_skew_shows_in_counts_and_heldout(synth) -> None:  # noqa: ANN001
    flat = run_profile(synth("tiny-flat", skew=0.0), 8, 0.25)
    skewed = run_profile(synth("tiny-skewed", skew=1.0), 8, 0.25)
    from moeprep.profile.analysis import effective_experts

    assert effective_experts(skewed.counts.shares()).mean() < effective_experts(flat.counts.shares()).mean() - 2
    static, lru, warm = (POLICIES.index(n) for n in ("static", "lru", "lru-warm"))
    s, f = skewed.heldout.overall(), flat.heldout.overall()  # [P, S, W]
    assert (s[static, :, 0] > f[static, :, 0]).all()
    assert s[static, 1, 0] > 0.25 + 0.15  # the hottest quarter of the experts takes far more than a quarter
    assert s[warm, 1, 1] >= s[lru, 1, 1]  # a warm start helps at the start of a chunk


def test_imatrix_from_the_same_pass(synth, tmp_path: Path, ggml) -> None:  # noqa: ANN001
    """Counts per expert equal the profile's selections, dense counts the tokens; quantizing with it through
    ggml_quantize_chunk gives the same bytes as moeprep's quantizer with it."""
    from moeprep.gguf.reader import open_gguf
    from moeprep.quant.imatrix import read_imatrix
    from moeprep.quant.registry import quantize_rows

    path = synth("small-f16", preset="small", skew=0.6)
    out = tmp_path / "m.imatrix.gguf"
    p = run_profile(path, 3, imatrix_out=out)
    imatrix = read_imatrix(out)
    assert imatrix.chunk_count == 3 and imatrix.chunk_size == CTX and imatrix.datasets == [SPEC.name]
    model = open_gguf(path)
    n_tokens = 3 * CTX
    for m, block in enumerate(p.model.moe_layers):
        for base in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
            assert imatrix.entries[f"blk.{block}.{base}.weight"].counts.tolist() == p.counts.selections[m].tolist()
        for base in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate_inp"):
            assert imatrix.entries[f"blk.{block}.{base}.weight"].counts.tolist() == [n_tokens]
    for name in ("blk.0.attn_q.weight", "blk.1.ffn_up_exps.weight"):
        t = model.tensor(name)
        data = model.dequantize(t).reshape(-1, *t.shape[-2:])  # [experts or 1, R, P]
        weights = imatrix.for_tensor(name, t.row_length).reshape(len(data), -1)
        for qtype in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q4_0):
            for rows, w in zip(data, weights):
                assert np.array_equal(quantize_rows(rows, qtype, w), ggml.quantize(rows, qtype, w)), (name, qtype)


def test_imatrix_matches_llama_imatrix_rule(synth, tmp_path: Path) -> None:  # noqa: ANN001
    """in_sum2 and counts equal what llama.cpp's own matmul inputs give under llama-imatrix's rule (F32 model)."""
    from moeprep.quant.imatrix import read_imatrix
    from tests.profile.imatrix_oracle import llama_imatrix

    path = synth("tiny-f32", skew=0.6, expert_type="F32", attn_type="F32")
    out = tmp_path / "m.imatrix.gguf"
    p = run_profile(path, 2, imatrix_out=out)
    ours = read_imatrix(out).entries
    tok = moerun.load_model(path, n_ctx=CTX).tokenizer
    theirs = llama_imatrix(path, calibration_chunks(SPEC, tok.encode, tok.bos_id if tok.add_bos else None, CTX, 2))
    assert set(ours) == set(theirs)
    # Where llama.cpp's build routes a near-tied token the other way (tests/near_ties.py), that block's experts and
    # everything after it see other inputs; every routing difference must be such a tie, and only what no
    # difference reaches is compared (here, on this machine, everything).
    routing = llama_routing(path, p, 2)
    assert routing.per_token == 1.0, "llama.cpp routes a token no near-tie decides otherwise"
    flip = routing.first_flip

    def reached(name: str) -> bool:
        block = parse_tensor_name(name).block
        return flip is not None and block is not None and (block > flip or (block == flip and "_exps" in name))

    for name, (sums, counts) in theirs.items():
        if reached(name):
            continue
        assert ours[name].counts.tolist() == counts.tolist(), name
        assert np.allclose(ours[name].sums.reshape(sums.shape), sums, rtol=2e-3, atol=1e-6), name
