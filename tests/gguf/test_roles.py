"""The role table of every listed architecture classifies its real tensor names."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

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


# ---- docs/quantize.md's table of what `--attn` requantizes, against the role tables -----------------------------
QUANTIZE_DOC = Path(__file__).resolve().parents[2] / "docs" / "quantize.md"


def expand_doc_names(item: str) -> list[str]:
    """`attn_q/k/v/output` -> attn_q, attn_k, attn_v, attn_output; `attn_q_a/q_b` -> attn_q_a, attn_q_b: each
    alternative after a slash replaces as many trailing `_` parts of the first name as it has."""
    first, *rest = item.split("/")
    parts = first.split("_")
    return [first] + ["_".join(parts[: len(parts) - len(alt.split("_"))] + [alt]) for alt in rest]


def doc_table_rows() -> list[tuple[list[str], list[str], list[str]]]:
    """(architectures, names said to be requantized by --attn, names said to be copied) per row of the table."""
    text = QUANTIZE_DOC.read_text(encoding="utf-8")
    table = text.split("| family (examples) |", 1)[1].split("\n\n", 1)[0]
    rows = []
    for line in table.splitlines()[2:]:
        family, attention, copied = (cell.strip() for cell in line.strip().strip("|").split("|"))
        archs = [word for word in re.findall(r"[\w.-]+", family) if word in ROLE_TABLES]
        named = [
            [n for item in re.findall(r"`([^`]+)`", cell) for n in expand_doc_names(item)]
            for cell in (attention, copied)
        ]
        rows.append((archs, named[0], named[1]))
    return rows


@pytest.mark.parametrize("row", doc_table_rows(), ids=lambda row: row[0][0])
def test_quantize_doc_table_says_what_attn_requantizes(row: tuple[list[str], list[str], list[str]]) -> None:
    """Every name the table puts in the `--attn` column is attention in each of the row's architectures that has
    it, every name in the copied column is not; every name is some row architecture's."""
    archs, attention, copied = row
    assert archs, row
    for pattern, want_attention in [(n, True) for n in attention] + [(n, False) for n in copied]:
        found = False
        for arch in archs:
            for base, role in ROLE_TABLES[arch].items():
                if fnmatch.fnmatchcase(base, pattern):
                    found = True
                    assert (role == R.ATTENTION) == want_attention, f"docs/quantize.md: {arch} {base} is {role.value}"
        assert found, f"docs/quantize.md names `{pattern}`, which none of {archs} has"
