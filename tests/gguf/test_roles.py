"""The role table of every listed architecture classifies its real tensor names."""

from __future__ import annotations

import pytest

from moeprep.gguf.roles import ROLE_TABLES, TensorRole, parse_tensor_name, role_table, tensor_role

R = TensorRole
COMMON = {
    "token_embd.weight": R.EMBEDDING,
    "output_norm.weight": R.NORM,
    "output.weight": R.OUTPUT,
    "blk.0.attn_norm.weight": R.NORM,
    "blk.0.ffn_norm.weight": R.NORM,
    "blk.1.ffn_gate_inp.weight": R.ROUTER,
    "blk.1.ffn_gate_exps.weight": R.EXPERT,
    "blk.1.ffn_up_exps.weight": R.EXPERT,
    "blk.1.ffn_down_exps.weight": R.EXPERT,
}
GQA = {
    "blk.0.attn_q.weight": R.ATTENTION,
    "blk.0.attn_k.weight": R.ATTENTION,
    "blk.0.attn_v.weight": R.ATTENTION,
    "blk.0.attn_output.weight": R.ATTENTION,
}
QK_NORM = {"blk.0.attn_q_norm.weight": R.NORM, "blk.0.attn_k_norm.weight": R.NORM}
SHEXP = {
    "blk.1.ffn_gate_shexp.weight": R.SHARED_EXPERT,
    "blk.1.ffn_up_shexp.weight": R.SHARED_EXPERT,
    "blk.1.ffn_down_shexp.weight": R.SHARED_EXPERT,
}
DENSE = {"blk.0.ffn_gate.weight": R.DENSE_FFN, "blk.0.ffn_up.weight": R.DENSE_FFN, "blk.0.ffn_down.weight": R.DENSE_FFN}
EXPECTED: dict[str, dict[str, TensorRole]] = {
    "qwen3moe": COMMON | GQA | QK_NORM,
    "qwen2moe": COMMON | GQA | SHEXP | {"blk.1.ffn_gate_inp_shexp.weight": R.ROUTER, "blk.0.attn_q.bias": R.ATTENTION},
    "deepseek2": COMMON
    | SHEXP
    | DENSE
    | {
        "blk.0.attn_q_a.weight": R.ATTENTION,
        "blk.0.attn_q_b.weight": R.ATTENTION,
        "blk.0.attn_kv_a_mqa.weight": R.ATTENTION,
        "blk.0.attn_kv_b.weight": R.ATTENTION,
        "blk.0.attn_k_b.weight": R.ATTENTION,
        "blk.0.attn_v_b.weight": R.ATTENTION,
        "blk.0.attn_q_a_norm.weight": R.NORM,
        "blk.0.attn_kv_a_norm.weight": R.NORM,
        "blk.0.attn_output.weight": R.ATTENTION,
        "blk.1.exp_probs_b.bias": R.ROUTER,
        "blk.61.nextn.eh_proj.weight": R.OTHER,
        "blk.61.nextn.enorm.weight": R.OTHER,
        "blk.3.indexer.proj.weight": R.ATTENTION,  # DeepSeek-V3.2 files converted as deepseek2
    },
    "glm4moe": COMMON
    | GQA
    | QK_NORM
    | SHEXP
    | DENSE
    | {
        "blk.1.exp_probs_b.bias": R.ROUTER,
        "blk.0.attn_q.bias": R.ATTENTION,
        "blk.0.post_attention_norm.weight": R.NORM,
        "blk.46.nextn.shared_head_head.weight": R.OTHER,
    },
    "gpt-oss": COMMON
    | GQA
    | {
        "blk.0.attn_sinks.weight": R.ATTENTION,
        "blk.0.attn_output.bias": R.ATTENTION,
        "blk.0.ffn_gate_inp.bias": R.ROUTER,
        "blk.0.ffn_up_exps.bias": R.EXPERT,
        "blk.0.post_attention_norm.weight": R.NORM,
    },
    "llama": COMMON | GQA,
    "olmoe": COMMON | GQA | QK_NORM,
    "qwen3next": COMMON
    | GQA
    | QK_NORM
    | SHEXP
    | {
        "blk.0.attn_gate.weight": R.ATTENTION,
        "blk.0.ssm_conv1d.weight": R.OTHER,
        "blk.0.ssm_out.weight": R.ATTENTION,
        "blk.0.ssm_a": R.OTHER,
        "blk.0.ssm_dt.bias": R.OTHER,
        "blk.1.ffn_gate_inp_shexp.weight": R.ROUTER,
    },
    "qwen35moe": COMMON
    | GQA
    | QK_NORM
    | SHEXP
    | {"blk.0.attn_gate.weight": R.ATTENTION, "blk.0.ssm_in.weight": R.ATTENTION},
}


def test_every_listed_architecture_has_a_table() -> None:
    assert set(EXPECTED) <= set(ROLE_TABLES)


@pytest.mark.parametrize("arch", sorted(EXPECTED))
def test_role_table(arch: str) -> None:
    table, known = role_table(arch)
    assert known
    wrong = {
        name: (tensor_role(name, table), role)
        for name, role in EXPECTED[arch].items()
        if tensor_role(name, table) != role
    }
    assert not wrong, f"{arch}: (got, expected) {wrong}"


def test_unknown_architecture_falls_back_to_patterns() -> None:
    table, known = role_table("mystery-moe")
    assert not known
    assert tensor_role("blk.3.ffn_down_exps.weight", table) == R.EXPERT
    assert tensor_role("blk.3.attn_kv_b.weight", table) == R.ATTENTION
    assert tensor_role("blk.3.something_new.weight", table) == R.OTHER


def test_parse_tensor_name() -> None:
    parsed = parse_tensor_name("blk.12.nextn.eh_proj.weight")
    assert (parsed.block, parsed.base, parsed.suffix) == (12, "nextn.eh_proj", "weight")
    parsed = parse_tensor_name("token_embd.weight")
    assert (parsed.block, parsed.base, parsed.suffix) == (None, "token_embd", "weight")
