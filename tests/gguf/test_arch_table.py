"""Every MoE architecture llama.cpp knows has a role table that classifies every tensor its llama.cpp loader creates.

llama_cpp_moe_tensors.json beside this file lists them, with each tensor's llama.cpp tensor id, layer kind and the
ggml op that reads it, as bench/llama_cpp_moe_tensors.py read them from llama-cpp-python 0.3.36's sources. A role
is checked against llama.cpp's own description of the tensor (its id and op), not against our table's spelling.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from moeprep.gguf.arch_table import ARCHITECTURES, TensorRole
from moeprep.gguf.roles import block_mixers, parse_tensor_name, role_table, tensor_role

R = TensorRole
LLAMA_CPP = json.loads((Path(__file__).parent / "llama_cpp_moe_tensors.json").read_text())
TENSORS = {name: kind for name, kind in LLAMA_CPP["tensors"].items() if name != "//"}
ALIASES = {"glm5next": "glm5-next"}  # unsloth's dialect (moeprep/gguf/dialect.py): not a llama.cpp name

# llama.cpp's tensor id -> the role it must have; ids not listed may be NORM (a norm, read by MUL) or OTHER.
EXACT = [
    (r"FFN_(GATE|UP|DOWN|GATE_UP)_C?H?EXPS", R.EXPERT),
    (r"FFN_(GATE_INP|GATE_INP_SHEXP|EXP_PROBS_B|EXP_PROBS_B_VL|GATE_TID2EID)", R.ROUTER),
    (r"FFN_(GATE|UP|DOWN)_SHEXP", R.SHARED_EXPERT),
    (r"FFN_(GATE|UP|DOWN|LATENT_DOWN|LATENT_UP|ROUTED_DOWN|ROUTED_UP)", R.DENSE_FFN),
    (r"TOKEN_EMBD|PER_LAYER_TOKEN_EMBD|TOKEN_TYPES", R.EMBEDDING),
    (r"OUTPUT", R.OUTPUT),
    # the attention projections (not the KV compressor's), and the sinks
    (r"ATTN_(Q|K|V|QKV|OUT|GATE|Q_A|Q_B|KV_A_MQA|KV_B|K_B|V_B|KV|OUT_A|OUT_B|SINKS)", R.ATTENTION),
]


def expected_role(enum: str, op: str, role: TensorRole) -> set[TensorRole]:
    for pattern, exact in EXACT:
        if re.fullmatch(pattern, enum):
            return {exact}
    if "NORM" in enum and op == "MUL":
        return {R.NORM, R.OTHER}  # a mixer's or side path's own norm may count with it
    if enum.startswith(("SSM_", "INDEXER_")) and op == "MUL_MAT":
        # a linear-attention layer's matrices, and a sparse-attention indexer's, count as attention where llama-quantize
        # requantizes them (test_whole_file_peer.py checks the bytes)
        return {R.OTHER, R.ATTENTION}
    return {R.OTHER}


def test_the_table_lists_exactly_llama_cpps_moe_architectures() -> None:
    assert set(ARCHITECTURES) - set(ALIASES) == set(LLAMA_CPP["architectures"])
    assert len(LLAMA_CPP["architectures"]) >= 60


@pytest.mark.parametrize("arch", sorted(LLAMA_CPP["architectures"]))
def test_every_llama_cpp_tensor_has_its_role(arch: str) -> None:
    listed = LLAMA_CPP["architectures"][arch]
    assert ARCHITECTURES[arch].source == listed["source"]
    table, known = role_table(arch)
    assert known
    missing = [n for n in listed["tensors"] if parse_tensor_name(n.replace("{i}", "0")).base not in table]
    assert not missing, f"{arch}: not in its role table (would fall back): {missing}"
    wrong = {}
    for pattern in listed["tensors"]:
        enum, _, op = TENSORS[pattern]
        name = pattern.replace("{i}", "3")
        role = tensor_role(name, table)
        if role not in expected_role(enum, op, role):
            wrong[name] = (role.value, enum, op)
    assert not wrong, f"{arch}: (role, llama.cpp id, op) {wrong}"
    # a MoE table: stacked experts, a router, attention or a mixer of some kind
    roles = {tensor_role(p.replace("{i}", "0"), table) for p in listed["tensors"]}
    assert {R.EXPERT, R.ROUTER, R.EMBEDDING, R.NORM} <= roles


def test_an_alias_is_its_architecture() -> None:
    for alias, arch in ALIASES.items():
        assert ARCHITECTURES[alias] is ARCHITECTURES[arch]


def test_same_name_different_role_by_family() -> None:
    """A name's role comes from its family's table (the union could not say). Mamba-2's ssm_in and ssm_out are
    requantized as attention's and its small ssm_a/ssm_d kept, as llama-quantize does (the bytes:
    tests/quant/test_whole_file_peer.py on synthetic granitehybrid files)."""
    assert tensor_role("blk.0.ssm_beta.weight", role_table("kimi-linear")[0]) == R.ATTENTION
    assert tensor_role("blk.0.ssm_beta.weight", role_table("qwen35moe")[0]) == R.ATTENTION
    assert tensor_role("blk.0.ssm_conv1d.weight", role_table("qwen35moe")[0]) == R.OTHER
    assert tensor_role("blk.0.attn_kv_a_mqa.weight", role_table("glm5-next")[0]) == R.ATTENTION
    assert tensor_role("blk.0.ssm_in.weight", role_table("nemotron_h_moe")[0]) == R.ATTENTION
    assert tensor_role("blk.0.ssm_out.weight", role_table("granitehybrid")[0]) == R.ATTENTION
    assert tensor_role("blk.0.ssm_d", role_table("granitehybrid")[0]) == R.OTHER


def _blocks(*blocks: tuple[str, ...]) -> list[str]:
    return ["token_embd.weight"] + [f"blk.{i}.{base}.weight" for i, bases in enumerate(blocks) for base in bases]


ATTN = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate_inp", "ffn_up_exps")


@pytest.mark.parametrize(
    "names, mixers",
    [
        (
            _blocks(("ssm_in", "ssm_conv1d", "ssm_out", "ffn_up_exps"), ATTN, ("ssm_in", "ssm_d")),  # granitehybrid
            {"Mamba": [0, 2], "attention": [1]},
        ),
        (
            _blocks(("ssm_in", "ssm_norm"), ("ffn_gate_inp", "ffn_up_exps", "ffn_latent_up"), ATTN),  # nemotron_h_moe
            {"Mamba": [0], "FFN only": [1], "attention": [2]},
        ),
        (
            _blocks(("attn_qkv", "attn_gate", "ssm_ba", "ssm_conv1d", "ssm_out"), ATTN + ("attn_gate",)),  # qwen3next
            {"gated delta-net": [0], "attention": [1]},
        ),
        (_blocks(("attn_qkv", "ssm_alpha", "ssm_beta"), ATTN), {"gated delta-net": [0], "attention": [1]}),  # qwen35moe
        (_blocks(("shortconv.conv", "shortconv.in_proj"), ATTN), {"short conv": [0], "attention": [1]}),  # lfm2moe
        (
            _blocks(("attn_q", "ssm_conv1d_q", "ssm_f_a"), ("attn_q_a", "attn_kv_a_mqa", "attn_kv_b")),  # kimi-linear
            {"KDA": [0], "MLA": [1]},
        ),
        (
            _blocks(("attn_norm", "attn_qkv", "attn_gate", "attn_norm_2"), ATTN),  # minimax-01
            {"lightning attention": [0], "attention": [1]},
        ),
        (_blocks(ATTN, ATTN, ATTN), {}),  # not a hybrid: nothing to say
    ],
    ids=[
        "granitehybrid",
        "nemotron_h_moe",
        "qwen3next",
        "qwen35moe",
        "lfm2moe",
        "kimi-linear",
        "minimax-01",
        "qwen3moe",
    ],
)
def test_block_mixers(names: list[str], mixers: dict[str, list[int]]) -> None:
    n_layer = max(parse_tensor_name(n).block or 0 for n in names) + 1
    assert block_mixers(names, n_layer) == mixers
