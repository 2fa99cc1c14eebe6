"""Experts stored fused (`ffn_gate_up_exps` [E, 2I, D]: each expert's gate rows, then its up rows, as Gemma 4's
converter writes them) run as they are stored, read in place: the same logits as the split file bit for bit on the
CPU, llama.cpp's agreement, the expert cache (host views, uploads, streamed and staged misses), `moeprep profile`,
batched decode, and the GPU's Triton expert kernels (in Triton's interpreter here) on a gate/up bank that is one
tensor."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import moerun
from moeprep.cli import main as moeprep_main
from moeprep.errors import MoeprepError
from moeprep.gguf.reader import open_gguf
from moeprep.profile.format import read_profile
from moerun.cache.config import CacheConfig
from moerun.cache.experts import CachedExperts
from moerun.layers.gguf_cpu import CPUExperts
from moerun.options import RuntimeOptions
from tests.fused_experts import fuse_gate_up
from tests.runtime.conftest import assert_batched_decode_equals_alone, profile_model
from tests.runtime.test_models import _assert_quantized_agreement, compare

PROMPT = "def bisect(a, x):\n    lo, hi = 0, len(a)"
CASES = [("gemma4", "F32"), ("gemma4", "Q4_K"), ("qwen3moe", "F32"), ("qwen3moe", "Q4_K")]
# The architectures whose loader in llama.cpp 0.3.36 reads the fused layout (create_tensor_gate_up_exps) among those
# moerun runs; moerun reads it for every architecture with gated experts.
LLAMA_CPP_FUSED = [("gemma4", "F32"), ("gemma4", "Q4_K"), ("qwen35moe", "F32"), ("qwen35moe", "Q4_K")]
BUDGET = [8 << 30]
CPU_TOO = frozenset({"cuda", "cpu"})  # a CPU standing in for a GPU streams and stages as a GPU would


@pytest.fixture(scope="module")
def fused_pair(synth_model, tmp_path_factory):
    """fused_pair(arch, qtype) -> (the synthetic split file, its fused copy), each written once."""
    folder = tmp_path_factory.mktemp("fused-experts")
    made = {}

    def make(arch: str, qtype: str):
        if (arch, qtype) not in made:
            # K-quants need rows of 256 values: the "small" preset's
            options = {"preset": "small"} if qtype != "F32" else {}
            split = synth_model(arch, expert_type=qtype, attn_type=qtype, **options)
            made[arch, qtype] = split, fuse_gate_up(split, folder / f"{arch}-{qtype}-fused.gguf")
        return made[arch, qtype]

    return make


def _logits(model, tokens: list[int]) -> torch.Tensor:
    """A prompt's logits, then two decode steps'."""
    out = [model.forward(torch.tensor(tokens))]
    for i, token in enumerate([5, 17]):
        out.append(model.forward(torch.tensor([token]), len(tokens) + i))
    return torch.cat(out)


@pytest.mark.parametrize("arch,qtype", [*CASES, ("gpt-oss", "F32")])
def test_fused_file_gives_the_split_files_logits_bit_for_bit(arch, qtype, fused_pair):
    """gpt-oss: expert biases fused too. The CPU kernels read each half in place: its bytes are the memory map's."""
    split, fused = fused_pair(arch, qtype)
    names = {t.name for t in open_gguf(fused).tensors}
    assert "blk.0.ffn_gate_up_exps.weight" in names and "blk.0.ffn_gate_exps.weight" not in names
    assert ("blk.0.ffn_gate_up_exps.bias" in names) == (arch == "gpt-oss")
    a, b = moerun.load_model(split), moerun.load_model(fused)
    experts = [m for m in b.net.modules() if isinstance(m, CPUExperts)]
    assert experts
    for m in experts:
        gate, up, _ = m.host
        assert gate.kernel_step == up.kernel_step == 2 and np.shares_memory(gate.kernel_data, up.kernel_data)
    tokens = a.tokenizer.encode(PROMPT)
    assert torch.equal(_logits(b, tokens), _logits(a, tokens))


@pytest.mark.parametrize("arch,qtype", LLAMA_CPP_FUSED)
def test_fused_file_matches_llama_cpp(arch, qtype, fused_pair, calibration_text):
    """The bars of tests/runtime/test_models.py on the fused file, which llama.cpp reads in that layout."""
    c = compare(fused_pair(arch, qtype)[1], calibration_text)
    if qtype == "F32":
        assert max(c.layer_errors) <= 1e-4 and c.rel_error <= 1e-3, (max(c.layer_errors), c.rel_error)
        assert c.top1_agreement == 1.0 and c.expert_agreement >= 0.999
    else:
        _assert_quantized_agreement(arch, c)


@pytest.mark.parametrize("arch", ["gemma4", "qwen3moe"])
@pytest.mark.parametrize("stream", [False, True], ids=["eager", "streamed-staged"])
def test_fused_file_through_the_expert_cache(arch, stream, fused_pair):
    """Host views of the halves, uploads into slots, CPU misses; streamed (a CPU standing in for a GPU): misses read
    from the host views, staged as a GPU would. Outputs are the resident model's."""
    split, fused = fused_pair(arch, "F32")
    plain = moerun.load_model(fused)
    options = RuntimeOptions(stream_devices=CPU_TOO, staging_devices=CPU_TOO) if stream else None
    slots = plain.args.n_experts // 2
    cached = moerun.load_model(fused, cache=CacheConfig(budgets=BUDGET, slots_per_layer=slots), options=options)
    layers = [m for m in cached.net.modules() if isinstance(m, CachedExperts)]
    assert layers and cached.expert_cache.streamed == stream
    g = cached.gguf
    for layer in layers:  # the halves are views of the memory map itself, no copy
        stored = g.raw(next(t for t in g.tensors if t.name == f"blk.{layer.layer}.ffn_gate_up_exps.weight"))
        assert all(np.shares_memory(t.data, stored) for t in layer.host[:2])
    tokens = plain.tokenizer.encode(PROMPT)
    prompt = torch.tensor(tokens)
    torch.testing.assert_close(cached.forward(prompt), plain.forward(prompt), rtol=1e-4, atol=1e-4)
    for i, token in enumerate([5, 17, 99, 5, 17]):
        pos = len(tokens) + i
        torch.testing.assert_close(
            cached.forward(torch.tensor([token]), pos), plain.forward(torch.tensor([token]), pos), rtol=1e-4, atol=1e-4
        )
    stats = cached.expert_cache.stats
    assert 0 < stats.hits.sum() < stats.lookups.sum()
    if stream:
        assert stats.streamed > 0


def test_fused_file_profiles_as_the_split_file(fused_pair, tmp_path):
    split, fused = fused_pair("gemma4", "Q4_K")
    a = read_profile(profile_model(split, tmp_path / "split.moeprof")).counts
    b = read_profile(profile_model(fused, tmp_path / "fused.moeprof")).counts
    assert list(a.layers) == list(b.layers) and np.array_equal(a.selections, b.selections)
    assert a.selections.sum() > 0


@pytest.mark.parametrize("arch", ["gemma4", "qwen3moe"])
def test_fused_file_batched_decode_equals_each_sequence_alone(arch, fused_pair):
    fused = fused_pair(arch, "F32")[1]
    assert_batched_decode_equals_alone(fused)


@pytest.mark.parametrize("arch,activation", [("qwen3moe", "swiglu"), ("gemma4", "geglu")])
@pytest.mark.parametrize("n_tokens", [1, 3], ids=["decode", "prompt"])
def test_gpu_expert_kernels_read_a_fused_bank_in_place(arch, activation, n_tokens, fused_pair, monkeypatch):
    """DeviceExperts (the GPU's path; Triton's interpreter here) on the fused file: gate and up banks are views of one
    stored tensor, slots a fused expert apart, and compute what the split file's banks compute, bit for bit (the
    matrix-vector kernel, its SwiGLU form, and the grouped GEMM of a prompt, which 3 tokens take here: the
    interpreter runs a real prompt's programs too slowly)."""
    from moerun.kernels import tuning

    monkeypatch.setattr(tuning, "MOE_GEMV_MAX_TOKENS", 2)
    monkeypatch.setattr(tuning, "MOE_GLU_GEMV_MAX_TOKENS", 2)
    from moerun.hooks import Hooks
    from moerun.layers.ffn import Activation
    from moerun.layers.gguf_gpu import DeviceExperts
    from moerun.layers.reference import TORCH_KERNELS
    from moerun.weights import Weights

    split, fused = fused_pair(arch, "Q4_K")
    layer = next(int(t.name.split(".")[1]) for t in open_gguf(fused).tensors if "ffn_gate_up_exps" in t.name)
    outs = []
    for path in (split, fused):
        w = Weights(open_gguf(path), torch.float32, torch.device("cpu"))
        assert DeviceExperts.can_run(w, layer)
        experts = DeviceExperts.load(w, Hooks(), layer, Activation(activation), TORCH_KERNELS)
        gate, up, _ = experts.banks
        if path == fused:
            assert gate.data.untyped_storage().data_ptr() == up.data.untyped_storage().data_ptr()
            assert gate.slot_bytes == up.slot_bytes == 2 * gate.rows * gate.data.shape[-1]
        n_experts = gate.data.shape[0]
        rng = np.random.default_rng(0)
        x = torch.from_numpy(rng.standard_normal((n_tokens, gate.cols)).astype(np.float32))
        ids = torch.from_numpy(np.stack([rng.choice(n_experts, 2, replace=False) for _ in range(n_tokens)]))
        weights = torch.full((n_tokens, 2), 0.5)
        outs.append(experts(x, ids, weights))
    assert torch.equal(outs[0], outs[1]) and outs[0].abs().sum() > 0


def test_split_experts_still_writes_the_split_layout(fused_pair, tmp_path):
    """`moeprep split-experts` (for tools that want the split layout): the split file's tensors byte for byte."""
    split, fused = fused_pair("gemma4", "F32")
    out = tmp_path / "split-again.gguf"
    result = CliRunner().invoke(moeprep_main, ["split-experts", str(fused), str(out)])
    assert result.exit_code == 0, result.output
    a, b = open_gguf(split), open_gguf(out)
    assert [(t.name, t.ggml_type, t.shape) for t in a.tensors] == [(t.name, t.ggml_type, t.shape) for t in b.tensors]
    assert all(bytes(a.raw(t)) == bytes(b.raw(u)) for t, u in zip(a.tensors, b.tensors))


def test_a_fused_scale_is_refused_in_one_line(synth_model, tmp_path):
    fused = fuse_gate_up(synth_model("gpt-oss"), tmp_path / "scaled.gguf", extra=("blk.0.ffn_gate_up_exps.scale",))
    with pytest.raises(MoeprepError, match="a scale of fused gate/up experts"):
        moerun.load_model(fused)
