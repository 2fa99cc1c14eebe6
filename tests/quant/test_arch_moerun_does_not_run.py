"""A MoE architecture moerun does not run (Phi-3.5-MoE, `phimoe`) still inspects, quantizes, verifies and publishes
correctly with moeprep, and moerun refuses it in one line naming the architectures it runs.

The file is written here with moeprep.gguf.writer from the synthetic qwen3moe model: the same attention and experts
under phimoe's names and keys, with the LayerNorm and output biases phimoe's llama.cpp loader requires
(src/models/phimoe.cpp) and without qwen3moe's q/k norms. llama.cpp loads and runs it, so it is a phimoe file.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType

from moeprep.cli import main as moeprep_main
from moeprep.gguf.reader import open_gguf
from moeprep.gguf.writer import KVValue, OutputTensor, copied_tensor, write_gguf
from moeprep.synth import write_synth_model
from moerun.cli import main as moerun_main
from moerun.models import ARCHS
from tests.oracle import llama_eval, llama_quantize

ARCH = "phimoe"
BIASED = ("attn_norm.weight", "attn_output.weight", "ffn_norm.weight", "output_norm.weight", "output.weight")


def moeprep(*args: object):
    return CliRunner().invoke(moeprep_main, [str(a) for a in args])


@pytest.fixture(scope="module")
def phimoe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("phimoe")
    base = open_gguf(write_synth_model(d / "q3.gguf", "qwen3moe", preset="small", expert_type="Q4_K", attn_type="Q8_0"))
    rng = np.random.default_rng(0)
    tensors = []
    for t in base.tensors:
        if t.name.endswith(("attn_q_norm.weight", "attn_k_norm.weight")):
            continue  # phimoe has none
        tensors.append(copied_tensor(base, t))
        if t.name.endswith(BIASED):
            n = t.shape[0] if len(t.shape) == 1 else t.shape[-2]  # output width (numpy order: rows first)
            bias = (0.02 * rng.standard_normal(n)).astype(np.float32)
            tensors.append(OutputTensor(t.name.replace(".weight", ".bias"), T.F32, (n,), lambda b=bias: [b]))
    old = [k for k in base.fields if k.startswith("qwen3moe.")]
    kv = {"general.architecture": KVValue(ARCH, GGUFValueType.STRING)}
    kv |= {k.replace("qwen3moe.", f"{ARCH}.", 1): KVValue(base.get(k), base.fields[k].types[0]) for k in old}
    # phimoe's experts are feed_forward_length wide
    kv[f"{ARCH}.feed_forward_length"] = KVValue(base.get("qwen3moe.expert_feed_forward_length"), GGUFValueType.UINT32)
    path = d / "phimoe.gguf"
    write_gguf(path, base, tensors=tensors, kv_set=kv, kv_remove=old)
    return path


def test_llama_cpp_runs_the_file(phimoe: Path) -> None:
    assert ARCH not in ARCHS, "moerun runs phimoe now: pick an architecture it does not run for this test"
    run = llama_eval(phimoe, list(range(1, 9)))
    assert np.isfinite(run.logits).all() and run.logits.std() > 0
    assert sorted(run.topk) == [0, 1, 2, 3]  # every layer routes


def test_inspect_knows_the_architecture(phimoe: Path) -> None:
    result = moeprep("inspect", phimoe, "--json")
    assert result.exit_code == 0, result.output
    a = json.loads(result.stdout)
    assert a["arch"] == ARCH and a["arch_known"]
    assert a["geometry"]["moe_layers"] == [0, 1, 2, 3] and a["geometry"]["n_expert"] == 16
    roles = {role: s["n_tensors"] for role, s in a["roles"].items()}
    # q, k, v, output and output's bias per layer; norms with their biases; 3 stacked experts and a gate per layer
    assert roles == {"attention": 20, "norm": 18, "expert": 12, "router": 4, "embedding": 1, "output": 2}
    text = moeprep("inspect", phimoe)
    assert text.exit_code == 0 and "unknown" not in text.stdout


def test_quantize_verify_publish(phimoe: Path, tmp_path: Path) -> None:
    """`--attn Q4_K` writes llama.cpp's bytes (llama_model_quantize, pure Q4_K), verifies, and publishes."""
    ours, peer = tmp_path / "ours.gguf", tmp_path / "peer.gguf"
    result = moeprep("quantize", phimoe, ours, "--attn", "Q4_K", "--threads", "2")
    assert result.exit_code == 0, result.output
    assert "verify: " in result.output and str(ours) in result.output
    llama_quantize(phimoe, peer, "Q4_K")
    src, a, b = open_gguf(phimoe), open_gguf(ours), open_gguf(peer)
    peer_tensors = {t.name: t for t in b.tensors}
    assert sorted(peer_tensors) == sorted(t.name for t in a.tensors)
    requantized = {t.name for t in src.tensors if t.ggml_type != peer_tensors[t.name].ggml_type}
    assert requantized == {f"blk.{i}.attn_{p}.weight" for i in range(4) for p in ("q", "k", "v", "output")}
    for t in a.tensors:
        p = peer_tensors[t.name]
        assert (t.ggml_type, t.shape) == (p.ggml_type, p.shape), t.name
        assert bytes(a.raw(t)) == bytes(b.raw(p)), f"{t.name} ({t.ggml_type.name}) differs from llama.cpp's"
    assert moeprep("verify", ours, "--against", phimoe).exit_code == 0
    folder = tmp_path / "upload"
    published = moeprep("publish", ours, folder, "--base-model", "microsoft/Phi-3.5-MoE-instruct")
    assert published.exit_code == 0, published.output
    checked = moeprep("publish", "--check", folder)
    assert checked.exit_code == 0 and checked.stdout.startswith("OK: "), checked.output


def test_moerun_refuses_it_in_one_line(phimoe: Path) -> None:
    result = CliRunner().invoke(moerun_main, ["-m", str(phimoe), "-p", "x"])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.strip().splitlines() if not line.startswith("moerun: running on ")]
    assert len(lines) == 1 and lines[0].startswith("moerun: error: "), result.stderr
    assert f"'{ARCH}' is not supported" in lines[0]
    assert all(arch in lines[0] for arch in ARCHS)
