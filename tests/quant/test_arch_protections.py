"""The quantizer's protections of every MoE architecture, against llama.cpp's quantizer itself.

For each architecture of moeprep/gguf/arch_table.py, every tensor its llama.cpp loader creates (the names in
tests/gguf/llama_cpp_moe_tensors.json, block 0, as 2-D or, for stacked experts, 3-D F16 headers) is handed to
libllama's own rule functions (tests/quant/llama_quant_rules.py): the tensors llama.cpp refuses to requantize must
be exactly those moeprep's quant_limit marks KEEP, and those it keeps at Q8_0 when asked for less exactly the
Q8_0_FLOOR ones.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moeprep.gguf.arch_table import ARCHITECTURES, KEEP_EVERYWHERE, KEEP_NAMES, QuantLimit
from moeprep.gguf.roles import parse_tensor_name, quant_limit
from tests.quant.llama_quant_rules import GGML_TYPE_Q4_0, GGML_TYPE_Q8_0, llama_quant_rules

LLAMA_CPP = json.loads((Path(__file__).parent.parent / "gguf" / "llama_cpp_moe_tensors.json").read_text())
OWN_TYPE_MIX = {"token_embd.weight", "output.weight", "per_layer_token_embd.weight"}  # Q4_0's mix changes these


def shapes(arch: str) -> dict[str, tuple[int, ...]]:
    out = {}
    for pattern in LLAMA_CPP["architectures"][arch]["tensors"]:
        op = LLAMA_CPP["tensors"][pattern][2]
        out[pattern.replace("{i}", "0")] = (256, 256, 16) if op == "MUL_MAT_ID" else (256, 256)
    return out


@pytest.mark.parametrize("arch", sorted(LLAMA_CPP["architectures"]))
def test_protections_equal_llama_cpps(arch: str) -> None:
    tensors = shapes(arch)
    theirs = llama_quant_rules(arch, tensors)
    kept = {n for n, t in theirs.items() if t is None}
    floored = {n for n, t in theirs.items() if t == GGML_TYPE_Q8_0 and n not in OWN_TYPE_MIX}
    assert {n for n, t in theirs.items() if t not in (None, GGML_TYPE_Q8_0, GGML_TYPE_Q4_0)} <= OWN_TYPE_MIX
    assert {n for n in tensors if quant_limit(arch, n) == QuantLimit.KEEP} == kept
    assert {n for n in tensors if quant_limit(arch, n) == QuantLimit.Q8_0_FLOOR} == floored


def test_the_rules_are_exercised() -> None:
    """Across the architectures llama.cpp both keeps tensors of many kinds and floors glm5-next's."""
    kinds = set()
    for arch in LLAMA_CPP["architectures"]:
        kinds |= {parse_tensor_name(n).base for n in shapes(arch) if quant_limit(arch, n) == QuantLimit.KEEP}
    assert {
        "ssm_conv1d",
        "attn_norm",
        "ffn_gate_inp",
        "hc_attn_fn",
        "shortconv.conv",
        "indexer.k_proj",
        "ssm_a",
        "ffn_gate_tid2eid",
        "attn_k_b",
    } <= kinds
    assert ARCHITECTURES["glm5-next"].q8_0_floor and quant_limit("glm5-next", "blk.0.attn_q_a.weight")


def keep_example(rule: str) -> str:
    """A tensor name that holds `rule` and nothing else llama.cpp's quantizer refuses."""
    if rule.endswith((".", "_")):
        return f"blk.0.{rule}0.weight"
    if rule.startswith("."):
        return f"v{rule}.weight"
    return f"blk.0.{rule}" if rule.endswith("weight") else f"blk.0.{rule}.weight"


def test_every_shared_keep_rule_is_llama_cpps() -> None:
    """Each name rule of KEEP_EVERYWHERE and KEEP_NAMES (RWKV, vision and audio ones too, which no MoE loader
    creates) is one llama.cpp applies, for any architecture; names around them are requantized by both."""
    kept = [keep_example(rule) for rule in KEEP_EVERYWHERE] + list(KEEP_NAMES) + ["blk.0.ssm_a", "blk.0.attn_q.bias"]
    allowed = [
        "blk.0.attn_q.weight",
        "blk.0.time_mix_key.weight",
        "blk.0.ssm_in.weight",
        "v.blk.0.attn_q.weight",
        "blk.0.ffn_gate_inp_shexp.weight",
        "blk.0.indexer.attn_k.weight",
        "blk.0.hc_attn_fn.weight",
    ]
    for arch in ("qwen3moe", "deepseek2"):
        theirs = llama_quant_rules(arch, {name: (256, 256) for name in kept + allowed})
        assert [n for n in kept if theirs[n] is not None] == []
        assert [n for n in allowed if theirs[n] is None] == []
        assert all(quant_limit(arch, n) == QuantLimit.KEEP for n in kept)
        assert all(quant_limit(arch, n) is None for n in allowed)
