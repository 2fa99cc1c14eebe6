"""Profiling real (synthetic) models through moerun: counts against llama.cpp's ffn_moe_topk, determinism, skew,
and the importance matrix from the same pass."""

from __future__ import annotations

from pathlib import Path

import moerun
import numpy as np
import pytest
from gguf import GGMLQuantizationType

from moeprep.profile.dataset import DatasetSpec, calibration_chunks
from moeprep.profile.format import encode_profile
from moeprep.profile.heldout import POLICIES
from moeprep.profile.profile import Profile
from moeprep.profile.run import ProfileRequest, profile_model
from tests.profile.conftest import CALIBRATION

SPEC = DatasetSpec(str(CALIBRATION))
CTX = 64


def run_profile(path: Path, chunks: int = 6, holdout: float = 0.0, **kw) -> Profile:  # noqa: ANN003
    return profile_model(ProfileRequest(path, SPEC, ctx=CTX, chunks=chunks, holdout=holdout, **kw))


def llama_histogram(path: Path, p: Profile, n_chunks: int) -> tuple[np.ndarray, float]:
    """llama.cpp's [M, E] histogram of ffn_moe_topk over the same chunks, and the share of our per-token choices
    it agrees with."""
    from tests.oracle import llama_eval

    tok = moerun.load_model(path, n_ctx=CTX).tokenizer
    chunks = calibration_chunks(SPEC, tok.encode, tok.bos_id if tok.add_bos else None, CTX, n_chunks)
    hist = np.zeros_like(p.counts.selections)
    same = 0
    for c, chunk in enumerate(chunks):
        topk = llama_eval(path, chunk.tolist()).topk
        for m, block in enumerate(p.model.moe_layers):
            hist[m] += np.bincount(topk[block].reshape(-1), minlength=p.model.n_expert)
            ours = p.trace.chunk(c)[:, m]
            same += sum(len(set(a) & set(b)) for a, b in zip(ours.tolist(), topk[block].tolist()))
    return hist, same / hist.sum()


@pytest.mark.parametrize("kind, types, floor", [
    ("f32", dict(expert_type="F32", attn_type="F32"), 0.999),
    ("f16", dict(expert_type="F16", attn_type="F16"), 0.999),
    # llama.cpp rounds activations to 8 bits for quantized matmuls: near-tied routers may flip
    ("q8_0", dict(expert_type="Q8_0", attn_type="Q8_0"), 0.99),
])
def test_counts_match_llama_cpp(synth, kind: str, types: dict, floor: float) -> None:  # noqa: ANN001
    path = synth(f"tiny-{kind}", skew=0.6, **types)
    p = run_profile(path)
    hist, per_token = llama_histogram(path, p, 6)
    agreement = np.minimum(hist, p.counts.selections).sum() / hist.sum()
    assert hist.sum() == p.counts.selections.sum() == 6 * CTX * len(p.model.moe_layers) * p.model.n_expert_used
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
    run_profile(path, 2, imatrix_out=out)
    ours = read_imatrix(out).entries
    tok = moerun.load_model(path, n_ctx=CTX).tokenizer
    theirs = llama_imatrix(path, calibration_chunks(SPEC, tok.encode, tok.bos_id if tok.add_bos else None, CTX, 2))
    assert set(ours) == set(theirs)
    for name, (sums, counts) in theirs.items():
        assert ours[name].counts.tolist() == counts.tolist(), name
        assert np.allclose(ours[name].sums.reshape(sums.shape), sums, rtol=2e-3, atol=1e-6), name
