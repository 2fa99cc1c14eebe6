"""`moeprep quantize` against llama.cpp's own whole-file quantizer (llama_model_quantize) on the same synthetic file:
the same tensors in the same types with the same bytes. Metadata differs by design (our moeprep.* provenance keys,
llama.cpp's file type), so only tensors are compared."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as T

from moeprep.gguf.reader import open_gguf
from moeprep.synth import write_synth_model
from moeprep.synth.archs import ARCHS
from tests.oracle import llama_quantize
from tests.quant.test_quantize_cmd import run

# llama.cpp's `pure` also requantizes dense FFNs (glm4moe's leading dense layer, shared experts, Kimi-K3's latent
# projections): a --type rule asks moeprep for the same.
DENSE_FFN_RULE = r"ffn_(gate|up|down|routed_down|routed_up)(_shexp)?\.weight$"
# Matrices llama.cpp requantizes that moeprep keeps unless a rule names them (OTHER in moeprep/gguf/arch_table.py):
# DeepSeek-V4's hyper-connection mixes, the head's one among them, its KV compressors (llama.cpp protects these only
# for glm5-next) and its NextN block's projection.
OTHER_RULES = {"deepseek4": r"(hc_(attn|ffn)_fn|output_hc_fn|_compressor_(kv|gate|ape)|nextn\.eh_proj)\.weight$"}


def other_rules(arch: str, qtype: str) -> list[str]:
    return ["--type", f"{OTHER_RULES[arch]}={qtype}"] if arch in OTHER_RULES else []


@pytest.mark.parametrize(
    "arch,preset,attn_type,options",
    [
        ("qwen3moe", "small", "Q4_K", {}),
        ("qwen3moe", "small", "Q6_K", {}),
        ("glm4moe", "small", "Q4_K", {}),
        ("olmoe", "small", "Q8_0", {}),
        ("qwen2moe", "small", "Q4_K", {}),
        ("llama", "small", "Q6_K", {}),
        ("deepseek2", "small", "Q4_K", {"mla_split": True}),  # 3-D attn_k_b / attn_v_b, one slice per head
        ("deepseek2", "tiny", "Q4_K", {}),
        ("gpt-oss", "tiny", "Q4_K", {}),  # rows that cannot be Q4_K: the fallbacks
        ("mimo2", "small", "Q4_K", {}),
        ("mimo2", "tiny", "Q4_K", {}),  # per-layer KV heads, sinks on some layers
        ("qwen35moe", "small", "Q4_K", {}),
        ("qwen35moe", "tiny", "Q4_K", {}),  # delta-net tensors
        ("qwen3next", "small", "Q4_K", {}),
        ("qwen3next", "tiny", "Q4_K", {}),  # ssm_in, ssm_ba
        ("minimax-m2", "small", "Q4_K", {}),
        ("llama4", "small", "Q4_K", {}),
        ("deepseek32", "small", "Q4_K", {}),
        ("dots1", "small", "Q4_K", {}),
        ("ernie4_5-moe", "small", "Q4_K", {}),
        ("hunyuan-moe", "small", "Q4_K", {}),
        ("granitehybrid", "small", "Q4_K", {}),
        ("granitehybrid", "tiny", "Q4_K", {}),  # Mamba-2 tensors: ssm_in, ssm_out, 2-D ssm_a/ssm_d/ssm_norm
        ("nemotron_h_moe", "small", "Q4_K", {}),  # ungated experts and shared expert
        ("afmoe", "small", "Q4_K", {}),  # attn_gate
        ("smallthinker", "small", "Q4_K", {}),
        ("laguna", "small", "Q4_K", {}),  # a per-head attn_gate, per-layer query heads
        ("laguna", "small", "Q4_K", {"sliding_window": 0}),  # M.1's per-channel attn_gate
        ("laguna", "tiny", "Q4_K", {}),
        ("kimi-k3", "small", "Q4_K", {}),  # ssm_g, gated MLA, ffn_routed_*, residual scores
        ("kimi-k3", "tiny", "Q4_K", {}),
        ("deepseek4", "small", "Q4_K", {}),  # attn_kv, attn_output_a/b, indexer, compressors, hc_*, tid2eid
        ("deepseek4", "tiny", "Q4_K", {}),
    ],
    ids=lambda v: ",".join(v) if isinstance(v, dict) else v,
)
def test_tensors_equal_llama_cpp_quantize(
    arch: str, preset: str, attn_type: str, options: dict, tmp_path: Path
) -> None:
    """Experts already in the target type (so llama.cpp copies them, as we do), attention in Q8_0/F16 to requantize."""
    source_attn = "F16" if attn_type == "Q8_0" else "Q8_0"
    src = write_synth_model(
        tmp_path / "src.gguf", arch, preset=preset, expert_type=attn_type, attn_type=source_attn, **options
    )
    ours, peer = tmp_path / "ours.gguf", tmp_path / "peer.gguf"
    result = run(
        "quantize",
        src,
        ours,
        "--attn",
        attn_type,
        "--type",
        f"{DENSE_FFN_RULE}={attn_type}",
        *other_rules(arch, attn_type),
        "--threads",
        "2",
    )
    assert result.exit_code == 0, result.output
    llama_quantize(src, peer, attn_type)
    a, b = open_gguf(ours), open_gguf(peer)
    peer_tensors = {t.name: t for t in b.tensors}
    assert sorted(peer_tensors) == sorted(t.name for t in a.tensors)
    requantized = [t.name for t in open_gguf(src).tensors if t.ggml_type != peer_tensors[t.name].ggml_type]
    assert requantized, "the case must requantize something"
    if preset == "tiny":
        assert {peer_tensors[name].ggml_type for name in requantized} - {T[attn_type]}, "no fallback was exercised"
    for t in a.tensors:
        p = peer_tensors[t.name]
        assert (t.ggml_type, t.shape) == (p.ggml_type, p.shape), t.name
        assert bytes(a.raw(t)) == bytes(b.raw(p)), f"{t.name} ({t.ggml_type.name}) differs from llama.cpp's"


# Every block weight asked for the type, as llama.cpp's `pure` does: only the quantizer's protections (and the
# experts, routers and norms moeprep never touches) keep their type.
EVERY_BLOCK_WEIGHT = r"blk\.\d+\..*\.weight$"


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_every_synth_architecture_equals_llama_cpp_pure(arch: str, tmp_path: Path) -> None:
    """Each architecture `moeprep synth` writes, every block weight requested: the same tensors, types and bytes
    as llama.cpp's quantizer, the tensors it protects (moeprep/gguf/arch_table.py) included."""
    src = write_synth_model(tmp_path / "src.gguf", arch, preset="small", expert_type="Q4_K", attn_type="Q8_0")
    ours, peer = tmp_path / "ours.gguf", tmp_path / "peer.gguf"
    rules = ["--type", f"{EVERY_BLOCK_WEIGHT}=Q4_K", *other_rules(arch, "Q4_K")]
    result = run("quantize", src, ours, "--attn", "Q4_K", *rules, "--threads", "2")
    assert result.exit_code == 0, result.output
    llama_quantize(src, peer, "Q4_K")
    a, b = open_gguf(ours), open_gguf(peer)
    peer_tensors = {t.name: t for t in b.tensors}
    assert sorted(peer_tensors) == sorted(t.name for t in a.tensors)
    assert any(t.ggml_type != peer_tensors[t.name].ggml_type for t in open_gguf(src).tensors)
    for t in a.tensors:
        p = peer_tensors[t.name]
        assert (t.ggml_type, t.shape) == (p.ggml_type, p.shape), t.name
        assert bytes(a.raw(t)) == bytes(b.raw(p)), f"{t.name} ({t.ggml_type.name}) differs from llama.cpp's"
