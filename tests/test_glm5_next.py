"""GLM-5.3-Flash (`glm5-next`, and unsloth's `glm5next` dialect): roles, synthetic models, quantize and the dialect
rewrite, each checked against llama.cpp (llama-cpp-python 0.3.36 runs glm5-next)."""

from __future__ import annotations

import ctypes
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

import llama_cpp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType

import moerun
from moeprep.cli import main
from moeprep.errors import MoeprepError
from moeprep.gguf.anatomy import describe_model, plan_vram
from moeprep.gguf.dialect import DIALECTS, rename_architecture
from moeprep.gguf.reader import GGUFModel, open_gguf
from moeprep.gguf.roles import QuantLimit, TensorRole, quant_limit, role_table, tensor_role
from moeprep.gguf.writer import KVValue, OutputTensor, copied_tensor, write_gguf
from moeprep.profile.export import EXPERT_USAGE_KEY
from moeprep.quant.plan import plan_requant
from moeprep.synth import synth_config, write_synth_model
from moeprep.synth.corpus import CALIBRATION_PATH
from moeprep.synth.glm5_next import is_dsa
from moerun.cache.config import CacheConfig
from moerun.cache.placement import place
from moerun.layers.delta_rule import CHUNK as KDA_CHUNK
from moerun.layers.delta_rule import SUBCHUNK as KDA_SUBCHUNK
from moerun.layers.delta_rule import delta_rule_chunked as kda_chunked
from moerun.layers.delta_rule import delta_rule_recurrent as kda_recurrent
from moerun.step import Step
from moerun.tokenizer import Tokenizer
from tests.oracle import GGMLTensor, _backend, _ggml_base, llama_quantize

R = TensorRole
TOKENS = list(range(1, 25))
N_POSITIONS = 256
# One name of each kind, as llama.cpp's glm5-next loader names them (src/models/glm5-next.cpp).
ROLES = {
    "blk.0.hc_attn_fn.weight": R.OTHER,
    "blk.0.hc_ffn_base.weight": R.OTHER,
    "blk.0.hc_attn_scale.weight": R.OTHER,
    "blk.0.attn_q.weight": R.ATTENTION,
    "blk.0.attn_k.weight": R.ATTENTION,
    "blk.0.attn_v.weight": R.ATTENTION,
    "blk.0.attn_output.weight": R.ATTENTION,
    "blk.0.ssm_conv1d_q.weight": R.OTHER,
    "blk.0.ssm_f_a.weight": R.ATTENTION,
    "blk.0.ssm_f_b.weight": R.ATTENTION,
    "blk.0.ssm_g_a.weight": R.ATTENTION,
    "blk.0.ssm_g_b.weight": R.ATTENTION,
    "blk.0.ssm_beta.weight": R.ATTENTION,
    "blk.0.ssm_a": R.OTHER,
    "blk.0.ssm_dt.bias": R.OTHER,
    "blk.0.ssm_norm.weight": R.OTHER,
    "blk.0.ffn_gate.weight": R.DENSE_FFN,
    "blk.0.ffn_down.weight": R.DENSE_FFN,
    "blk.3.attn_q_a.weight": R.ATTENTION,
    "blk.3.attn_q_a_norm.weight": R.NORM,
    "blk.3.attn_q_b.weight": R.ATTENTION,
    "blk.3.attn_kv_a_mqa.weight": R.ATTENTION,
    "blk.3.attn_kv_a_norm.weight": R.NORM,
    "blk.3.attn_k_b.weight": R.ATTENTION,
    "blk.3.attn_v_b.weight": R.ATTENTION,
    "blk.3.indexer.k_norm.bias": R.OTHER,
    "blk.3.indexer.proj.weight": R.OTHER,
    "blk.3.indexer.attn_k.weight": R.OTHER,
    "blk.3.indexer.attn_q_b.weight": R.OTHER,
    "blk.3.indexer_compressor_gate.weight": R.OTHER,
    "blk.3.indexer_compressor_ape.weight": R.OTHER,
    "blk.3.ffn_gate_inp.weight": R.ROUTER,
    "blk.3.exp_probs_b.bias": R.ROUTER,
    "blk.3.ffn_up_exps.weight": R.EXPERT,
    "blk.3.ffn_gate_shexp.weight": R.SHARED_EXPERT,
    "blk.45.nextn.eh_proj.weight": R.OTHER,
    "blk.45.ffn_down_exps.weight": R.EXPERT,
}
KEPT = (
    "hc_attn_fn",
    "hc_ffn_fn",
    "indexer.attn_q_b",
    "indexer.attn_k",
    "indexer.proj",
    "indexer_compressor_gate",
    "indexer_compressor_ape",
    "ssm_f_a",
    "ssm_f_b",
    "ssm_g_a",
    "ssm_g_b",
    "ssm_beta",
    "attn_kv_a_mqa",
    "attn_k_b",
    "attn_v_b",
)


def run(*args: object):
    return CliRunner().invoke(main, [str(a) for a in args])


def llama_logits(path: Path, tokens: list[int] = TOKENS) -> np.ndarray:
    """llama.cpp's logits (T, V) for `tokens` from position 0 (tests/oracle.llama_eval reads l_out as one stream,
    and glm5-next's holds four)."""
    llm = llama_cpp.Llama(model_path=str(path), logits_all=True, n_ctx=256, n_threads=2, verbose=False)
    llm.eval(tokens)
    return np.array(llm.scores[: len(tokens)])


@pytest.mark.parametrize("arch", ["glm5-next", "glm5next"])
def test_role_table_and_limits(arch: str) -> None:
    table, known = role_table(arch)
    assert known
    assert {name: tensor_role(name, table) for name in ROLES} == ROLES
    assert all(quant_limit(arch, f"blk.3.{base}.weight") == QuantLimit.KEEP for base in KEPT)
    for name in ("blk.3.attn_q_a.weight", "blk.3.attn_q_b.weight", "blk.45.nextn.eh_proj.weight"):
        assert quant_limit(arch, name) == QuantLimit.Q8_0_FLOOR
    assert (
        quant_limit(arch, "blk.0.attn_q.weight") is None and quant_limit("deepseek2", "blk.3.attn_k_b.weight") is None
    )


def test_synthetic_layout(tmp_path: Path) -> None:
    """KDA layers with head_count_kv 0, DSA every fourth trunk layer and the NextN block with 1; llama.cpp runs it."""
    path = write_synth_model(tmp_path / "g.gguf", "glm5-next")
    model = open_gguf(path)
    c = synth_config("glm5-next")
    pattern = model.get("glm5-next.attention.head_count_kv")
    assert pattern == [0, 0, 0, 1, 0, 1] == [int(is_dsa(c, il)) for il in range(c.n_layer)]
    assert model.get("glm5-next.nextn_predict_layers") == 1
    names = {t.name for t in model.tensors}
    assert {"blk.0.ssm_a", "blk.3.indexer_compressor_ape.weight", "blk.5.nextn.eh_proj.weight"} <= names
    assert "blk.5.hc_attn_fn.weight" not in names and "blk.3.ssm_beta.weight" not in names
    logits = llama_logits(path)
    assert np.isfinite(logits).all() and 0.3 < logits.std() < 3.0
    assert not np.allclose(logits[0], logits[-1])


@pytest.fixture(scope="module")
def small_q8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every row a multiple of 256 but the KDA gates' (head_dim 64): Q8_0 non-experts, Q4_K experts."""
    return write_synth_model(
        tmp_path_factory.mktemp("g") / "src.gguf", "glm5-next", preset="small", expert_type="Q4_K", attn_type="Q8_0"
    )


def test_quantize_equals_llama_cpp_pure(small_q8: Path, tmp_path: Path) -> None:
    """Every block tensor asked for Q4_K, as llama.cpp's `pure` does: the tensors llama.cpp never requantizes
    (hyper-connections, indexer, KDA gates, attn_kv_a_mqa/k_b/v_b) stay, all the rest match byte for byte."""
    ours, peer = tmp_path / "ours.gguf", tmp_path / "peer.gguf"
    result = run(
        "quantize", small_q8, ours, "--attn", "Q4_K", "--type", r"blk\.\d+\..*\.weight$=Q4_K", "--threads", "2"
    )
    assert result.exit_code == 0, result.output
    llama_quantize(small_q8, peer, "Q4_K")
    src, a, b = open_gguf(small_q8), open_gguf(ours), open_gguf(peer)
    peer_tensors = {t.name: t for t in b.tensors}
    assert sorted(peer_tensors) == sorted(t.name for t in a.tensors)
    requantized = {t.name for t in src.tensors if t.ggml_type != peer_tensors[t.name].ggml_type}
    assert {"blk.3.attn_q_a.weight", "blk.1.attn_q.weight", "blk.0.ffn_gate.weight"} <= requantized
    kept = {t.name for t in src.tensors if quant_limit("glm5-next", t.name) == QuantLimit.KEEP and len(t.shape) > 1}
    assert kept and not kept & requantized
    for t in a.tensors:
        p = peer_tensors[t.name]
        assert (t.ggml_type, t.shape) == (p.ggml_type, p.shape), t.name
        assert bytes(a.raw(t)) == bytes(b.raw(p)), f"{t.name} ({t.ggml_type.name}) differs from llama.cpp's"


def llama_quantize_default(path: Path, out: Path) -> None:
    """llama.cpp's quantizer with its own type choices (not `pure`) for Q4_K_S: glm5-next's Q8_0 floor applies."""
    _backend()
    types = {t.name: int(t.ggml_type) for t in open_gguf(path).tensors}
    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread, params.ftype, params.allow_requantize = 2, llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_S, True
    params.token_embedding_type, params.output_tensor_type = types["token_embd.weight"], types["output.weight"]
    assert llama_cpp.llama_model_quantize(str(path).encode(), str(out).encode(), ctypes.byref(params)) == 0


def test_q8_0_floor_as_llama_cpp(tmp_path: Path) -> None:
    """From F16, `--attn Q4_K` gives attn_q_a/attn_q_b Q8_0, the bytes llama.cpp's own choice writes; the rest of
    the attention becomes Q4_K and the protected tensors are copied."""
    src = write_synth_model(tmp_path / "f16.gguf", "glm5-next", preset="small")
    ours, peer = tmp_path / "ours.gguf", tmp_path / "peer.gguf"
    result = run("quantize", src, ours, "--attn", "Q4_K", "--threads", "2")
    assert result.exit_code == 0, result.output
    llama_quantize_default(src, peer)
    a, b, s = open_gguf(ours), open_gguf(peer), open_gguf(src)
    for name in ("blk.3.attn_q_a.weight", "blk.3.attn_q_b.weight", "blk.5.attn_q_a.weight"):
        assert a.tensor(name).ggml_type == b.tensor(name).ggml_type == T.Q8_0, name
        assert bytes(a.raw(a.tensor(name))) == bytes(b.raw(b.tensor(name))), name
    for base in KEPT:
        name = f"blk.3.{base}.weight" if base.startswith(("indexer", "attn_")) else f"blk.1.{base}.weight"
        assert bytes(a.raw(a.tensor(name))) == bytes(s.raw(s.tensor(name))) == bytes(b.raw(b.tensor(name))), name
    assert (
        a.tensor("blk.1.attn_q.weight").ggml_type == T.Q4_K and a.tensor("blk.3.attn_output.weight").ggml_type == T.Q4_K
    )


def test_unsloth_dialect_to_mainline(tmp_path: Path) -> None:
    """A glm5next file (mainline refuses it) becomes a glm5-next file llama.cpp runs to the same logits, tensors
    byte for byte."""
    mainline = write_synth_model(tmp_path / "mainline.gguf", "glm5-next")
    fork = tmp_path / "fork.gguf"
    dialect = DIALECTS["glm5next"]
    rename_architecture(open_gguf(mainline), fork, "glm5next", dropped=tuple(dialect.added))
    assert "glm5next.attention.indexer.kpool_select_tail" not in open_gguf(fork).kv
    _backend()
    params = llama_cpp.llama_model_default_params()
    refused = llama_cpp.llama_model_load_from_file(str(fork).encode(), params)
    assert not refused, "mainline llama.cpp is expected to refuse the fork's architecture name"

    out = tmp_path / "converted.gguf"
    result = run("to-mainline", fork, out)
    assert result.exit_code == 0, result.output
    assert "glm5next -> glm5-next" in result.output
    a, m = open_gguf(out), open_gguf(mainline)
    assert a.arch == "glm5-next" and a.kv == m.kv  # the same keys and values (dicts ignore their order)
    assert [t.name for t in a.tensors] == [t.name for t in m.tensors]
    assert all(bytes(a.raw(t)) == bytes(m.raw(m.tensor(t.name))) for t in a.tensors)
    np.testing.assert_array_equal(llama_logits(out), llama_logits(mainline))


def test_fork_dialect_plans_like_mainline(small_q8: Path, tmp_path: Path) -> None:
    """inspect and quantize read an unsloth glm5next file as they read the mainline one."""
    fork = tmp_path / "fork.gguf"
    rename_architecture(open_gguf(small_q8), fork, "glm5next")
    plans = [plan_requant(open_gguf(path), T.Q4_K) for path in (small_q8, fork)]
    assert [(p.tensor.name, p.role, p.new_type) for p in plans[0].tensors] == [
        (p.tensor.name, p.role, p.new_type) for p in plans[1].tensors
    ]
    anatomy = describe_model(open_gguf(fork))
    assert (
        anatomy.arch_known
        and anatomy.roles["attention"].n_tensors == describe_model(open_gguf(small_q8)).roles["attention"].n_tensors
    )


def test_to_mainline_refuses_other_architectures(tmp_path: Path) -> None:
    src = write_synth_model(tmp_path / "q.gguf", "qwen3moe")
    result = run("to-mainline", src, tmp_path / "out.gguf")
    assert result.exit_code == 2 and "not a fork dialect" in result.output
    assert not (tmp_path / "out.gguf").exists()


# --- moerun against llama.cpp -----------------------------------------------------------------------------------


def attention(block: torch.nn.Module) -> torch.nn.Module:
    """A block's attention module, unwrapped where the Transformer wraps it (moerun.models.base.ByGroups)."""
    return getattr(block.attn, "attn", block.attn)


@dataclass
class LlamaRun:
    logits: np.ndarray  # (T, V)
    topk: dict[int, np.ndarray]  # MoE layer -> (T, K) chosen experts
    streams: dict[int, np.ndarray]  # layer -> (T, 4, D): llama.cpp's l_out, the 4 residual streams


def llama_run(path: Path, tokens: list[int], out_prefix: bytes = b"l_out-") -> LlamaRun:
    """tokens in one batch from position 0, F32 KV cache, no flash attention; records ffn_moe_topk-N and the 4-stream
    l_out-N (`out_prefix`: deepseek4's graph names them l_last-N) through the graph callback (as
    tests/oracle.llama_eval does for one-stream models)."""
    _backend()
    mparams = llama_cpp.llama_model_default_params()
    mparams.n_gpu_layers = 0
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), mparams)
    assert model
    topk: dict[int, np.ndarray] = {}
    streams: dict[int, np.ndarray] = {}

    def layer_of(name: bytes, prefix: bytes) -> int | None:
        rest = name[len(prefix) :]
        return int(rest) if name.startswith(prefix) and rest.isdigit() else None

    @llama_cpp.ggml_backend_sched_eval_callback
    def on_tensor(tensor_p, ask, user_data):
        t = GGMLTensor.from_address(tensor_p)
        k_layer, l_layer = layer_of(t.name, b"ffn_moe_topk-"), layer_of(t.name, out_prefix)
        if ask:
            return k_layer is not None or l_layer is not None
        if k_layer is not None:
            rows = np.empty((t.ne[1], t.ne[0]), dtype=np.int32)
            for r in range(t.ne[1]):
                _ggml_base().ggml_backend_tensor_get(tensor_p, rows[r].ctypes.data, r * t.nb[1], t.ne[0] * 4)
            topk[k_layer] = rows
        elif l_layer is not None:
            out = np.empty((t.ne[2], t.ne[1], t.ne[0]), dtype=np.float32)
            _ggml_base().ggml_backend_tensor_get(tensor_p, out.ctypes.data, 0, out.nbytes)
            streams[l_layer] = out
        return True

    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = max(256, -(-len(tokens) // 256) * 256)
    cparams.n_threads = cparams.n_threads_batch = 2
    cparams.type_k = cparams.type_v = 0  # F32
    cparams.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    cparams.cb_eval = on_tensor
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    batch = llama_cpp.llama_batch_init(len(tokens), 0, 1)
    try:
        for i, tok in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, i, 1, True
            batch.seq_id[i][0] = 0
        batch.n_tokens = len(tokens)
        assert llama_cpp.llama_decode(ctx, batch) == 0
        n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits(ctx), shape=(len(tokens) * n_vocab,))
        logits = logits.reshape(len(tokens), n_vocab).copy()
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)
    return LlamaRun(logits, topk, streams)


@pytest.fixture(scope="module")
def calibration_tokens() -> list[int]:
    return list(
        Tokenizer(open_gguf(write_synth_model(Path(tempfile.mkdtemp()) / "t.gguf", "qwen3moe"))).encode(
            CALIBRATION_PATH.read_text(encoding="utf-8")
        )[:N_POSITIONS]
    )


@pytest.mark.parametrize("weights", ["F32", "F16"])
def test_moerun_matches_llama_cpp(weights: str, calibration_tokens: list[int], tmp_path: Path) -> None:
    """Logits within 1e-3 relative, the same top-1 token and the same experts at every (token, MoE layer); and each
    block, fed llama.cpp's 4 streams, gives llama.cpp's next streams."""
    path = write_synth_model(tmp_path / "g.gguf", "glm5-next", expert_type=weights, attn_type=weights, skew=0.3)
    model = moerun.load_model(path)
    ref = llama_run(path, calibration_tokens)
    experts: dict[int, np.ndarray] = {}
    handle = model.add_routing_hook(lambda ev: experts.__setitem__(ev.layer, ev.expert_ids.numpy()))
    ours = model.forward(torch.tensor(calibration_tokens)).numpy()
    handle.remove()
    error = np.abs(ours - ref.logits).max()
    assert error / np.abs(ref.logits).max() <= 1e-3
    # top-1 where llama.cpp's best logit leads by more than twice the largest difference (F16 has a 2e-5 near-tie)
    top2 = np.sort(ref.logits, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 2 * error
    assert clear.mean() > 0.9 and (ours.argmax(-1) == ref.logits.argmax(-1))[clear].all()
    assert sorted(experts) == sorted(ref.topk) == [1, 2, 3, 4]
    for layer, ids in ref.topk.items():
        assert all(set(a) == set(b) for a, b in zip(experts[layer], ids)), f"layer {layer} chose other experts"
    net, T = model.net, len(calibration_tokens)
    step = Step(torch.arange(T), n_slots=T)
    with torch.inference_mode():
        for layer, block in enumerate(net.blocks[:-1]):  # the last one returns the mean of its streams
            x = net.embed(torch.tensor(calibration_tokens)) if layer == 0 else torch.from_numpy(ref.streams[layer - 1])
            got, want = block(x, None, step)[0].numpy(), ref.streams[layer]
            assert np.abs(got - want).max() / np.abs(want).max() <= 1e-3, f"block {layer}"


@pytest.mark.parametrize("scaling", ["linear", "yarn"])
def test_rope_scaling_changes_nothing(scaling: str, calibration_tokens: list[int], tmp_path: Path) -> None:
    """llama.cpp's glm5-next graph rotates nothing and scales its scores by 1/sqrt(head size) alone, so a file with
    context scaling runs as the one without it, in both engines (deepseek2's MLA would scale the scores)."""
    options = dict(expert_type="F32", attn_type="F32", n_ctx=512)
    path = write_synth_model(tmp_path / "scaled.gguf", "glm5-next", rope_scaling=scaling, **options)
    plain = write_synth_model(tmp_path / "plain.gguf", "glm5-next", **options)
    ref = llama_logits(path, calibration_tokens)
    ours = moerun.load_model(path).forward(torch.tensor(calibration_tokens)).numpy()
    assert np.abs(ours - ref).max() <= 1e-3 * np.abs(ref).max()
    assert np.abs(ref - llama_logits(plain, calibration_tokens)).max() <= 1e-6 * np.abs(ref).max()


def test_cached_decode_equals_prefill(calibration_tokens: list[int], tmp_path: Path) -> None:
    """Chunks, then single tokens, carry the KDA convolution and recurrent state and the MLA cache; position 0
    starts over; two sequences side by side in one batch keep their own states."""
    model = moerun.load_model(
        write_synth_model(tmp_path / "g.gguf", "glm5-next", expert_type="F32", attn_type="F32"), n_seq=2
    )
    tokens = torch.tensor(calibration_tokens[:40])
    full = model.forward(tokens)
    pieces = [model.forward(tokens[:24], 0), model.forward(tokens[24:32], 24)]
    pieces += [model.forward(tokens[i : i + 1], i) for i in range(32, 40)]
    tol = dict(rtol=1e-4, atol=1e-4 * full.abs().max().item())
    torch.testing.assert_close(torch.cat(pieces), full, **tol)
    torch.testing.assert_close(model.forward(tokens[:24], 0), full[:24], **tol)
    other = torch.tensor(calibration_tokens[100:140])
    other_full = model.forward(other, 0, seq=1)
    model.forward(tokens[:30], 0, seq=0)
    model.forward(other[:30], 0, seq=1)
    batched = [
        model.forward_batch(torch.stack([tokens[i], other[i]]), torch.tensor([i, i]), torch.tensor([0, 1]))
        for i in range(30, 40)
    ]
    torch.testing.assert_close(torch.stack([b[0] for b in batched]), full[30:40], **tol)
    torch.testing.assert_close(torch.stack([b[1] for b in batched]), other_full[30:40], **tol)


def test_sparse_indexer_matches_llama_cpp(tmp_path: Path) -> None:
    """Past 2051 positions DSA attends to its indexer's 512 best pools of 4 positions plus the query's unfinished
    pool. The DSA block fed llama.cpp's 4 streams gives llama.cpp's next streams at every position whose 512th and
    513th pool scores are not tied: the synthetic scores are often exactly 0 (relu of every indexer head), and
    where a tie decides, each engine's top-k order picks. Attending to every position instead would not match."""
    n = 2200
    path = write_synth_model(tmp_path / "g.gguf", "glm5-next", expert_type="F32", attn_type="F32")
    model = moerun.load_model(path, n_ctx=n)
    tokens = model.tokenizer.encode(CALIBRATION_PATH.read_text(encoding="utf-8"))[:n]
    assert len(tokens) == n
    ref = llama_run(path, tokens)
    block, step = model.net.blocks[3], Step(torch.arange(n), n_slots=n)  # blocks 3 and 5 (NextN) are DSA
    indexer = attention(block).indexer
    keep = indexer.n_top  # 512 pools
    x, want = torch.from_numpy(ref.streams[2]), ref.streams[3]
    with torch.inference_mode():
        errors = np.abs(block(x, None, step)[0].numpy() - want).max((1, 2)) / np.abs(want).max()
        h, _, _ = block.hc_attn.split(x)
        ranked = indexer.pool_scores(block.attn_norm(h), step).sort(-1, descending=True).values
        indexer.n_top = n  # every pool: dense attention
        dense_errors = np.abs(block(x, None, step)[0].numpy() - want).max((1, 2)) / np.abs(want).max()
    sparse = np.arange(n) >= 2051
    judged = sparse & (ranked[:, keep - 1] != ranked[:, keep]).numpy()
    assert judged.sum() >= 0.8 * sparse.sum()
    assert errors[~sparse].max() <= 1e-3 and errors[judged].max() <= 1e-3
    assert dense_errors[judged].max() > 10 * errors[judged].max()


SHARED_TOP_K = 32


def shared_indexer_model(tmp_path: Path, types: list[int]) -> Path:
    """A 10-block synthetic model (DSA blocks 3 and 7, NextN block 9) with attention.indexer.types set and the
    indexer tensors of the blocks that share another's left out, as in a real file; its indexer keeps the top 32
    positions (8 pools), so that attention is sparse from position 35 on."""
    src = write_synth_model(tmp_path / "g.gguf", "glm5-next", n_layer=10, expert_type="F32", attn_type="F32")
    model = open_gguf(src)
    shared = tuple(f"blk.{il}.indexer" for il, full in enumerate(types) if not full)
    out = tmp_path / "shared.gguf"
    write_gguf(
        out,
        model,
        tensors=[copied_tensor(model, t) for t in model.tensors if not t.name.startswith(shared)],
        kv_set={
            "glm5-next.attention.indexer.types": KVValue(types, GGUFValueType.ARRAY, GGUFValueType.INT32),
            "glm5-next.attention.indexer.top_k": KVValue(SHARED_TOP_K, GGUFValueType.UINT32),
        },
    )
    return out


def test_shared_indexer_matches_llama_cpp(tmp_path: Path) -> None:
    """DSA block 7 without an indexer of its own (attention.indexer.types 0) attends to what block 3's indexer
    selected, as llama.cpp does: fed llama.cpp's 4 streams, block 7 gives llama.cpp's next streams wherever block
    3's 8th and 9th pool scores are not tied, and attending to every position would not; so do the logits while
    attention is dense."""
    n = N_POSITIONS
    path = shared_indexer_model(tmp_path, [1, 1, 1, 1, 1, 1, 1, 0, 1])
    assert not any(t.name.startswith("blk.7.indexer") for t in open_gguf(path).tensors)
    model = moerun.load_model(path, n_ctx=n)
    source, shared = model.net.blocks[3], model.net.blocks[7]
    assert attention(shared).indexer is None and attention(shared).selection is attention(source).selection
    tokens = model.tokenizer.encode(CALIBRATION_PATH.read_text(encoding="utf-8"))[:n]
    ref = llama_run(path, tokens)
    dense = slice(0, SHARED_TOP_K + 3)
    ours = model.forward(torch.tensor(tokens)).numpy()[dense]
    assert np.abs(ours - ref.logits[dense]).max() / np.abs(ref.logits[dense]).max() <= 1e-3
    step, keep = Step(torch.arange(n), n_slots=n), attention(source).indexer.n_top
    want = ref.streams[7]
    with torch.inference_mode():
        x3 = torch.from_numpy(ref.streams[2])
        source(x3, None, step)  # block 3 selects
        h, _, _ = source.hc_attn.split(x3)
        ranked = attention(source).indexer.pool_scores(source.attn_norm(h), step).sort(-1, descending=True).values
        x6 = torch.from_numpy(ref.streams[6])
        errors = np.abs(shared(x6, None, step)[0].numpy() - want).max((1, 2)) / np.abs(want).max()
        attention(source).selection.record(step, None)  # every position
        dense_errors = np.abs(shared(x6, None, step)[0].numpy() - want).max((1, 2)) / np.abs(want).max()
    sparse = np.arange(n) >= SHARED_TOP_K + 3
    judged = sparse & (ranked[:, keep - 1] != ranked[:, keep]).numpy()
    assert judged.sum() >= 0.8 * sparse.sum()
    assert errors[~sparse].max() <= 1e-3 and errors[judged].max() <= 1e-3
    assert dense_errors[judged].max() > 10 * errors[judged].max()


def test_shared_indexer_in_a_mixed_batch(tmp_path: Path) -> None:
    """Past the dense range, one step holding a token of one sequence and a chunk of another gives each the logits
    of its own single pass: the sharing block attends with the selection made for the same rows."""
    n = 100
    model = moerun.load_model(shared_indexer_model(tmp_path, [1, 1, 1, 1, 1, 1, 1, 0, 1]), n_ctx=n + 4, n_seq=2)
    text = model.tokenizer.encode(CALIBRATION_PATH.read_text(encoding="utf-8"))
    a, b = torch.tensor(text[: n + 1]), torch.tensor(text[500 : 500 + n + 1])
    full_a, full_b = model.forward(a, 0, seq=0)[n:], model.forward(b, 0, seq=1)[n - 2 :]
    model.forward(a[:n], 0, seq=0)
    model.forward(b[: n - 2], 0, seq=1)
    mixed = model.forward_batch(
        torch.cat([a[n:], b[n - 2 :]]), torch.tensor([n, n - 2, n - 1, n]), torch.tensor([0, 1, 1, 1])
    )
    tol = dict(rtol=1e-4, atol=1e-4 * full_a.abs().max().item())
    torch.testing.assert_close(mixed[:1], full_a, **tol)
    torch.testing.assert_close(mixed[1:], full_b, **tol)


def test_shared_indexer_needs_an_earlier_one(tmp_path: Path) -> None:
    path = shared_indexer_model(tmp_path, [1, 1, 1, 0, 1, 1, 1, 1, 1])
    with pytest.raises(MoeprepError, match="DSA block 3 shares the indexer of an earlier DSA block, and there is none"):
        moerun.load_model(path)


def test_perplexity_matches_llama_cpp(calibration_tokens: list[int], tmp_path: Path) -> None:
    """moerun.perplexity against llama-perplexity's rule on llama.cpp's logits (3 chunks of 64, second halves)."""
    path = write_synth_model(tmp_path / "g.gguf", "glm5-next")
    model = moerun.load_model(path, n_ctx=64)
    tokens, n_ctx = calibration_tokens[: 3 * 64], 64
    assert model.tokenizer.bos_id is None or not model.tokenizer.add_bos  # chunks start with their own token
    nll, count = 0.0, 0
    for start in range(0, len(tokens), n_ctx):
        chunk = tokens[start : start + n_ctx]
        logits = llama_run(path, chunk).logits.astype(np.float64)[n_ctx // 2 : n_ctx - 1]
        log_norm = logits.max(-1) + np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1))
        nll -= (logits[np.arange(len(logits)), chunk[n_ctx // 2 + 1 :]] - log_norm).sum()
        count += len(logits)
    reference = math.exp(nll / count)
    ours = moerun.perplexity(model, tokens, n_ctx)
    assert abs(ours / reference - 1) <= 0.005, f"perplexity {ours:.4f} vs llama.cpp's {reference:.4f}"


def test_baked_usage_warms_the_decoder_blocks(tmp_path: Path) -> None:
    """`profile bake` writes a row per block, the NextN block's too: moerun's cache warms from the decoder's
    blocks' rows and places slots for them."""
    src = write_synth_model(tmp_path / "g.gguf", "glm5-next", expert_type="F32", attn_type="F32")
    n_expert = synth_config("glm5-next").n_expert
    table = np.random.default_rng(0).integers(1, 100, (6, n_expert)).astype(np.uint32)
    table[0] = 0  # the dense block
    baked = tmp_path / "baked.gguf"
    write_gguf(
        baked,
        open_gguf(src),
        kv_set={EXPERT_USAGE_KEY: KVValue(table.reshape(-1), GGUFValueType.ARRAY, GGUFValueType.UINT32)},
    )
    model = moerun.load_model(baked, cache=CacheConfig(budgets=[1 << 40]))
    np.testing.assert_array_equal(model.expert_cache.config.usage, table[:5])
    assert model.expert_cache.placement.slots == (0,) + (n_expert,) * 4


def test_inspect_shows_the_attention_pattern(tmp_path: Path) -> None:
    path = write_synth_model(tmp_path / "g.gguf", "glm5-next", n_layer=10)
    result = run("inspect", path)
    assert result.exit_code == 0, result.output
    assert "attention     KDA x7: 0, 1, 2, 4, 5, 6, 8; DSA x3: 3, 7, 9" in result.output
    assert describe_model(open_gguf(write_synth_model(tmp_path / "q.gguf", "qwen3moe"))).geometry.attention == {}


def test_slot_plan_leaves_the_nextn_block_out(tmp_path: Path) -> None:
    """The NextN block's *_exps are routed experts by role (quantize keeps them byte for byte), but no decoder runs
    the block: the geometry lists it apart, and the slot plan (inspect --vram, moerun's placement) gives it no slot
    and puts none of its weights on a GPU. A profile's block table of the decoder's blocks places as the same
    counts per MoE layer do."""
    path = write_synth_model(tmp_path / "g.gguf", "glm5-next")
    model = open_gguf(path)
    anatomy = describe_model(model)
    geo = anatomy.geometry
    assert (geo.nextn_layers, geo.moe_layers, geo.dense_layers) == ([5], [1, 2, 3, 4], [0])

    def block_bytes(block: int, experts: bool) -> int:
        return sum(
            t.n_bytes for t in model.tensors if t.name.startswith(f"blk.{block}.") and ("_exps" in t.name) == experts
        )

    assert anatomy.roles["expert"].n_bytes == sum(block_bytes(b, True) for b in range(6))
    non_expert = sum(s.n_bytes for role, s in anatomy.roles.items() if role != "expert")
    reserve = 1 << 20
    budget = non_expert + reserve + 3 * sum(block_bytes(b, True) for b in range(6)) // geo.n_expert
    plan = plan_vram(anatomy, [budget], reserve)
    assert plan.slot_bytes == sum(block_bytes(b, True) for b in geo.moe_layers) // geo.n_expert
    assert plan.gpus[0].non_expert == non_expert - block_bytes(5, False)
    placement = place(anatomy, [budget], reserve)
    assert len(placement.slots) == len(placement.device) == 5  # the decoder's blocks, as moerun builds them
    assert min(placement.slots[1:]) > 0 and placement.moe_layers == (1, 2, 3, 4)
    counts = np.random.default_rng(0).integers(0, 100, (4, geo.n_expert))
    decoder_blocks = np.vstack([np.zeros((1, geo.n_expert), int), counts])  # blocks 0-4, as moerun's profile gives
    assert place(anatomy, [budget], reserve, decoder_blocks).slots == place(anatomy, [budget], reserve, counts).slots
    result = run("inspect", path, "--vram", "1G")
    assert result.exit_code == 0, result.output
    assert "layers        6 (4 MoE, 1 dense: 0; 1 NextN: 5)" in result.output
    assert "an expert in each of 4 MoE layers" in result.output


# --- KDA ----------------------------------------------------------------------------------------------------------


def f32(model: GGUFModel, name: str) -> np.ndarray:
    t = model.tensor(name)
    assert t.ggml_type == T.F32, name
    return np.asarray(model.raw(t)).view(np.float32).reshape(t.shape)


def rewrite(src: Path, out: Path, kv: dict[str, KVValue], arrays: dict[str, np.ndarray]) -> Path:
    """`src` with keys set and some F32 tensors replaced by `arrays`."""
    model = open_gguf(src)
    tensors = [
        OutputTensor(t.name, t.ggml_type, t.shape, lambda a=arrays[t.name]: [a.astype(np.float32).tobytes()])
        if t.name in arrays
        else copied_tensor(model, t)
        for t in model.tensors
    ]
    write_gguf(out, model, tensors=tensors, kv_set=kv)
    return out


@pytest.mark.parametrize("n", [2, 63, 64, 200])
def test_kda_chunked_equals_token_by_token(n: int) -> None:
    """Prefill runs the delta rule in chunks: the same outputs and final state as the token-by-token recurrence
    (computed in float64 here), over several chunk boundaries and a ragged last chunk, from a nonzero state, with
    gates from barely decaying (g = -1e-4) to wiping the state (g = -8e3, where a float32 running sum of g alone
    would lose the differences between tokens)."""
    gen = torch.Generator().manual_seed(n)
    H, Hd = 3, 16
    q, k = (F.normalize(torch.randn(n, H, Hd, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(n, H, Hd, generator=gen)
    g = -torch.exp(3 * torch.randn(n, H, Hd, generator=gen))
    beta, S = torch.rand(n, H, generator=gen), torch.randn(H, Hd, Hd, generator=gen)
    want, want_state = kda_recurrent(*(t.double() for t in (q, k, v, g, beta, S)))
    token_by_token, _ = kda_recurrent(q, k, v, g, beta, S)
    assert (token_by_token.double() - want).abs().max() <= 1e-5
    for chunk, sub in ((KDA_CHUNK, KDA_SUBCHUNK), (16, 4), (32, 32)):
        out, state = kda_chunked(q, k, v, g, beta, S, chunk=chunk, sub=sub)
        assert (out.double() - want).abs().max() <= 1e-5 * want.abs().max(), (chunk, sub)
        assert (state.double() - want_state).abs().max() <= 1e-5 * want_state.abs().max(), (chunk, sub)


LOWER_BOUND = -5.0


def kda_layer_f64(g: GGUFModel, layer: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A KDA attention layer from position 0 in float64, written from llama.cpp's graph (src/models/glm5-next.cpp):
    -> (its output (T, D), the decay gate (T, H, Hd))."""
    arch = g.arch
    w = lambda name: f32(g, f"blk.{layer}.{name}").astype(np.float64)  # noqa: E731
    sigmoid = lambda z: 1 / (1 + np.exp(-z))  # noqa: E731
    H, Hd = int(g.get(f"{arch}.attention.head_count")), int(g.get(f"{arch}.kda.head_dim"))
    n, K = len(x), int(g.get(f"{arch}.ssm.conv_kernel"))
    qkv = []
    for name in "qkv":
        proj = x @ w(f"attn_{name}.weight").T  # (T, Di)
        padded = np.concatenate([np.zeros((K - 1, H * Hd)), proj])
        taps = w(f"ssm_conv1d_{name}.weight").reshape(H * Hd, K)
        conv = sum(padded[j : j + n] * taps[:, j] for j in range(K))
        qkv.append((conv * sigmoid(conv)).reshape(n, H, Hd))
    q, k, v = qkv
    q, k = (t / np.sqrt((t * t).sum(-1, keepdims=True) + 1e-6) for t in (q, k))
    f = ((x @ w("ssm_f_a.weight").T) @ w("ssm_f_b.weight").T + w("ssm_dt.bias")).reshape(n, H, Hd)
    gate = LOWER_BOUND * sigmoid(-f * w("ssm_a")[:, None])
    beta = sigmoid(x @ w("ssm_beta.weight").T)
    S, out = np.zeros((H, Hd, Hd)), np.zeros((n, H, Hd))
    for t in range(n):
        S = S * np.exp(gate[t])[:, :, None]
        S = S + k[t][:, :, None] * (beta[t][:, None] * (v[t] - np.einsum("hkv,hk->hv", S, k[t])))[:, None, :]
        out[t] = np.einsum("hkv,hk->hv", S, q[t]) / np.sqrt(Hd)
    eps = float(g.get(f"{arch}.attention.layer_norm_rms_epsilon"))
    normed = out / np.sqrt((out * out).mean(-1, keepdims=True) + eps) * w("ssm_norm.weight")
    out_gate = sigmoid((x @ w("ssm_g_a.weight").T) @ w("ssm_g_b.weight").T).reshape(n, H, Hd)
    return (normed * out_gate).reshape(n, H * Hd) @ w("attn_output.weight").T, gate


def test_kda_gate_lower_bound(calibration_tokens: list[int], tmp_path: Path) -> None:
    """With kda.gate_lower_bound set, the decay gate is lower_bound * sigmoid(-(f ssm_a)), in (lower_bound, 0):
    ssm_dt.bias raised by 60 on every other channel puts those channels on the bound (a decay of exp(-5) per
    token). A KDA layer then matches a float64 computation of the layer, in one 150-token prefill (chunked) and
    token by token; and the model matches llama.cpp, which without the key computes other logits."""
    src = write_synth_model(tmp_path / "g.gguf", "glm5-next", expert_type="F32", attn_type="F32")
    plain = open_gguf(src)
    c = synth_config("glm5-next")
    raised = {}
    for il in range(c.n_layer):
        if not is_dsa(c, il):
            bias = f32(plain, f"blk.{il}.ssm_dt.bias").copy()
            bias[::2] += 60
            raised[f"blk.{il}.ssm_dt.bias"] = bias
    bounded = rewrite(
        src,
        tmp_path / "bounded.gguf",
        {"glm5-next.kda.gate_lower_bound": KVValue(LOWER_BOUND, GGUFValueType.FLOAT32)},
        raised,
    )
    unbounded = rewrite(src, tmp_path / "unbounded.gguf", {}, raised)
    g = open_gguf(bounded)
    model = moerun.load_model(bounded)
    attn = attention(model.net.blocks[0])
    assert attn.lower_bound == LOWER_BOUND

    n = 150
    x = np.random.default_rng(0).standard_normal((n, c.n_embd)).astype(np.float32)
    want, gate = kda_layer_f64(g, 0, x.astype(np.float64))
    on_bound = np.abs(gate / LOWER_BOUND - 1) < 1e-6
    assert on_bound.mean() > 0.3 and (gate / LOWER_BOUND < 0.9).mean() > 0.3  # both regimes present
    with torch.inference_mode():
        prefill = attn(torch.from_numpy(x), Step(torch.arange(n), n_slots=n)).numpy()
        steps = np.concatenate(
            [attn(torch.from_numpy(x[t : t + 1]), Step(torch.tensor([t]), n_slots=t + 1)).numpy() for t in range(n)]
        )
    scale = np.abs(want).max()
    assert np.abs(prefill - want).max() <= 1e-5 * scale and np.abs(steps - want).max() <= 1e-5 * scale

    tokens = calibration_tokens[:n]
    ref = llama_run(bounded, tokens).logits
    ours = model.forward(torch.tensor(tokens)).numpy()
    error = np.abs(ours - ref).max() / np.abs(ref).max()
    assert error <= 1e-3
    assert np.abs(llama_run(unbounded, tokens).logits - ref).max() / np.abs(ref).max() > 100 * error
