"""`moeprep split-experts`: fused ffn_gate_up_exps (weights and biases) back to ffn_gate_exps and ffn_up_exps, byte
for byte, in any type; a model without fused experts, or with a fused scale, is refused in one line."""

from __future__ import annotations

import pytest

from moeprep.errors import MoeprepError
from moeprep.gguf.reader import open_gguf
from moeprep.gguf.split_experts import split_experts
from moeprep.synth import write_synth_model
from tests.fused_experts import fuse_gate_up


@pytest.mark.parametrize("arch,qtype", [("gpt-oss", "F32"), ("qwen3moe", "Q4_K"), ("qwen3moe", "Q8_0")])
def test_split_restores_the_split_tensors(arch, qtype, tmp_path):
    """gpt-oss: expert biases fused too; Q4_K and Q8_0: rows of whole blocks (the small preset's rows are 256)."""
    src = write_synth_model(tmp_path / "src.gguf", arch, preset="small", expert_type=qtype, attn_type=qtype)
    fused = fuse_gate_up(src, tmp_path / "fused.gguf")
    assert any(".ffn_gate_up_exps.bias" in t.name for t in open_gguf(fused).tensors) == (arch == "gpt-oss")
    paths = split_experts(fused, tmp_path / "split.gguf", split_max_size=1 << 20)
    assert len(paths) > 1  # shards too
    a, b = open_gguf(src), open_gguf(paths[0])
    assert [(t.name, t.ggml_type, t.shape) for t in a.tensors] == [(t.name, t.ggml_type, t.shape) for t in b.tensors]
    assert all(bytes(a.raw(t)) == bytes(b.raw(u)) for t, u in zip(a.tensors, b.tensors))
    assert a.kv["general.architecture"] == b.kv["general.architecture"]


def test_split_refuses_what_it_cannot_split(tmp_path):
    src = write_synth_model(tmp_path / "src.gguf", "gpt-oss")
    with pytest.raises(MoeprepError, match="already split"):
        split_experts(src, tmp_path / "out.gguf")
    scaled = fuse_gate_up(src, tmp_path / "scaled.gguf", extra=("blk.0.ffn_gate_up_exps.scale",))
    with pytest.raises(MoeprepError, match="a scale of fused gate/up experts cannot be split"):
        split_experts(scaled, tmp_path / "out.gguf")
    assert not (tmp_path / "out.gguf").exists()
