"""One runner over every architecture in moerun.models.ARCHS, against llama.cpp on the same synthetic file.

For each arch: prefill shape, cached decode equal to one long prefill, and (CPU, float32) next-token logits and
per-layer expert choices compared with llama.cpp's over 256 positions of the calibration text. Relative error is
max |ours - llama.cpp| / max |llama.cpp| over all positions and the whole vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFValueType

import moerun
from moeprep.gguf.reader import open_gguf
from moeprep.gguf.writer import KVValue, write_gguf
from moerun.models import ARCHS
from tests.oracle import llama_eval

ARCH_NAMES = sorted(ARCHS)
N_POSITIONS = 256


@dataclass
class Comparison:
    ours: np.ndarray  # (T, V) logits
    ref: np.ndarray  # (T, V) llama.cpp's logits
    our_experts: dict[int, np.ndarray]  # MoE layer -> (T, K)
    ref_experts: dict[int, np.ndarray]

    @property
    def rel_error(self) -> float:
        return float(np.abs(self.ours - self.ref).max() / np.abs(self.ref).max())

    @property
    def top1_agreement(self) -> float:
        return float((self.ours.argmax(-1) == self.ref.argmax(-1)).mean())

    @property
    def expert_agreement(self) -> float:
        """Share of (token, MoE layer) pairs where both chose the same set of experts."""
        assert self.our_experts.keys() == self.ref_experts.keys()
        same = [set(a) == set(b) for layer in self.ref_experts
                for a, b in zip(self.our_experts[layer], self.ref_experts[layer])]
        return float(np.mean(same))


_comparisons: dict[Path, Comparison] = {}


def compare(path: Path, text: str) -> Comparison:
    if path not in _comparisons:
        model = moerun.load_model(path)
        tokens = model.tokenizer.encode(text)[:N_POSITIONS]
        assert len(tokens) == N_POSITIONS
        experts: dict[int, np.ndarray] = {}
        handle = model.add_routing_hook(lambda ev: experts.__setitem__(ev.layer, ev.expert_ids.numpy()))
        ours = model.forward(torch.tensor(tokens)).numpy()
        handle.remove()
        run = llama_eval(path, tokens)
        _comparisons[path] = Comparison(ours, run.logits, experts, {k: v.astype(np.int64) for k, v in run.topk.items()})
    return _comparisons[path]


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_prefill_shape(arch, synth_model):
    model = moerun.load_model(synth_model(arch))
    logits = model.forward(torch.tensor(model.tokenizer.encode("Hello world, hello MoE.")))
    assert logits.dtype == torch.float32
    assert logits.shape == (len(model.tokenizer.encode("Hello world, hello MoE.")), model.args.n_vocab)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_cached_decode_equals_uncached(arch, synth_model, calibration_text):
    """A prompt in pieces (a chunk, then single tokens) gives the logits of one prefill of the whole sequence.

    F32 weights: with F16 ones the inputs are rounded to F16 (as llama.cpp does), which turns the last-bit
    differences of differently shaped matmuls into whole F16 steps."""
    model = moerun.load_model(synth_model(arch, expert_type="F32", attn_type="F32"))
    tokens = torch.tensor(model.tokenizer.encode(calibration_text)[:40])
    full = model.forward(tokens)
    pieces = [model.forward(tokens[:24], 0), model.forward(tokens[24:32], 24)]
    pieces += [model.forward(tokens[i : i + 1], i) for i in range(32, 40)]
    torch.testing.assert_close(torch.cat(pieces), full, rtol=1e-4, atol=1e-4 * full.abs().max().item())
    # starting over at position 0 ignores what the cache held
    torch.testing.assert_close(model.forward(tokens[:24], 0), full[:24], rtol=1e-4, atol=1e-4 * full.abs().max().item())


@pytest.mark.parametrize("weights", ["F32", "F16"])
@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_matches_llama_cpp(arch, weights, synth_model, calibration_text):
    c = compare(synth_model(arch, expert_type=weights, attn_type=weights), calibration_text)
    assert c.rel_error <= 1e-3, f"logits differ from llama.cpp's: relative error {c.rel_error:.2e}"
    assert c.top1_agreement == 1.0, f"top-1 differs at {np.flatnonzero(c.ours.argmax(-1) != c.ref.argmax(-1))}"
    assert c.expert_agreement >= 0.999, f"experts agree at only {c.expert_agreement:.2%} of (token, layer) pairs"


# Quantized weights: llama.cpp rounds activations to 8 bits and we round the same way (moerun/rounding.py), but
# the last bits of a sum still differ, an 8-bit rounding can land the other way, and near-tied routers can flip.
# Given llama.cpp's own inputs, each of our layers reproduces its outputs to float32 precision; the synthetic
# sigmoid-routed models (deepseek2: two chained quantized query matmuls, then MLA) amplify those flips more.
CHAOTIC = pytest.mark.xfail(strict=False, reason="measured 94.5-98.4% top-1 (deepseek2), 98.0-98.4% (glm4moe): "
                                                 "8-bit rounding flips amplified by the synthetic sigmoid routers")
QUANTIZED = [("qwen3moe", "Q8_0"), ("qwen3moe", "Q4_K"), ("qwen3moe", "Q6_K"), ("gpt-oss", "MXFP4"),
             ("gpt-oss", "Q8_0"), ("llama", "Q4_K"), ("qwen2moe", "Q6_K"), ("olmoe", "Q8_0"),
             pytest.param("glm4moe", "Q4_K", marks=CHAOTIC), pytest.param("deepseek2", "Q4_K", marks=CHAOTIC)]


@pytest.mark.parametrize("arch,qtype", QUANTIZED)
def test_quantized_matches_llama_cpp(arch, qtype, synth_model, calibration_text):
    """Row lengths of the "small" preset are multiples of 256, so K-quants apply to every matrix."""
    c = compare(synth_model(arch, preset="small", expert_type=qtype, attn_type=qtype), calibration_text)
    assert c.expert_agreement >= 0.99, f"experts agree at only {c.expert_agreement:.2%} of (token, layer) pairs"
    assert c.top1_agreement >= 0.99, f"top-1 agrees at only {c.top1_agreement:.2%} of positions"


def _with_keys(src: Path, out: Path, **keys: tuple[object, GGUFValueType]) -> Path:
    write_gguf(out, open_gguf(src), kv_set={k: KVValue(v, t) for k, (v, t) in keys.items()})
    return out


U32 = GGUFValueType.UINT32


@pytest.mark.parametrize("arch,options", [
    ("deepseek2", {"mla_split": True}),  # attn_k_b / attn_v_b instead of attn_kv_b
    ("deepseek2", {"yarn": True}),  # YaRN with deepseek2's yarn_log_multiplier
    ("qwen3moe", {"yarn": True}),
    ("gpt-oss", {"yarn": True}),
], ids=lambda v: v if isinstance(v, str) else ",".join(v))
def test_variants_match_llama_cpp(arch, options, synth_model, calibration_text):
    c = compare(synth_model(arch, expert_type="F32", attn_type="F32", **options), calibration_text)
    assert c.rel_error <= 1e-3 and c.top1_agreement == 1.0 and c.expert_agreement >= 0.999


def test_group_limited_routing_matches_llama_cpp(synth_model, calibration_text, tmp_path):
    """DeepSeek-V3's group-limited top-k: 16 experts in 4 groups, only the 2 best groups compete."""
    path = _with_keys(synth_model("deepseek2", expert_type="F32", attn_type="F32"), tmp_path / "grouped.gguf",
                      **{"deepseek2.expert_group_count": (4, U32), "deepseek2.expert_group_used_count": (2, U32)})
    assert moerun.load_model(path).args.n_expert_groups == 4
    c = compare(path, calibration_text)
    assert c.rel_error <= 1e-3 and c.top1_agreement == 1.0 and c.expert_agreement >= 0.999
    groups = np.concatenate([ids // 4 for ids in c.our_experts.values()])  # (T * layers, K) group of each expert
    assert max(len(set(row)) for row in groups) <= 2


def test_split_set_loads_like_the_single_file(synth_model, tmp_path):
    src = synth_model("qwen3moe")
    shards = write_gguf(tmp_path / "split.gguf", open_gguf(src), split_max_size=200_000)
    assert len(shards) > 1
    tokens = torch.tensor(moerun.load_model(src).tokenizer.encode("split sets load as one model"))
    torch.testing.assert_close(moerun.load_model(shards[0]).forward(tokens), moerun.load_model(src).forward(tokens))
