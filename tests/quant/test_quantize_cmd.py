"""`moeprep quantize` and `moeprep verify` end to end on synthetic models, with libggml and llama.cpp as oracles."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from gguf import GGMLQuantizationType as T

from moeprep.cli import main
from moeprep.gguf.reader import GGUFModel, open_gguf
from moeprep.quant.imatrix import read_imatrix, write_imatrix_gguf
from moeprep.quant.plan import plan_requant
from moeprep.synth import write_synth_model
from tests.oracle import llama_eval

TOKENS = list(range(1, 33))


def run(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args])


def sha(model: GGUFModel, name: str) -> str:
    return hashlib.sha256(bytes(model.raw(model.tensor(name)))).hexdigest()


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """n_embd 256, F16 attention and experts: every attention row fits Q4_K."""
    return write_synth_model(tmp_path_factory.mktemp("q") / "small.gguf", "qwen3moe", preset="small")


@pytest.fixture(scope="module")
def quantized(small: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    out = tmp_path_factory.mktemp("q4") / "q4.gguf"
    result = run("quantize", small, out, "--attn", "Q4_K", "--threads", "2")
    assert result.exit_code == 0, result.output
    return out, result


def test_attention_is_q4k_bit_exact_and_experts_identical(small: Path, quantized, ggml) -> None:
    out, result = quantized
    src, dst = open_gguf(small), open_gguf(out)
    assert "verify: OK" in result.stdout
    attn = [t for t in src.tensors if ".attn_" in t.name and "norm" not in t.name and len(t.shape) == 2]
    assert attn
    for t in attn:
        q = dst.tensor(t.name)
        assert q.ggml_type == T.Q4_K
        expected = ggml.quantize(src.dequantize(t).reshape(-1, t.row_length), T.Q4_K)
        ggml.assert_same_blocks(np.asarray(dst.raw(q)).reshape(expected.shape), expected, T.Q4_K, t.name)
    for t in src.tensors:
        if "_exps" in t.name or "norm" in t.name or "ffn_gate_inp" in t.name:
            assert dst.tensor(t.name).ggml_type == t.ggml_type and sha(dst, t.name) == sha(src, t.name), t.name


def test_order_and_metadata_kept(small: Path, quantized) -> None:
    out, _ = quantized
    src, dst = open_gguf(small), open_gguf(out)
    assert [t.name for t in dst.tensors] == [t.name for t in src.tensors]
    assert dst.alignment == src.alignment
    kept = [k for k in dst.kv if k in src.kv]
    assert kept == [k for k in src.kv if k in dst.kv]
    assert all(dst.kv[k] == src.kv[k] for k in src.kv if k != "general.file_type")
    assert dst.kv["general.quantization_version"] == 2
    assert dst.kv["moeprep.attn_type"] == "Q4_K" and dst.kv["moeprep.version"]


def test_llama_cpp_runs_the_quantized_model(quantized) -> None:
    out, _ = quantized
    logits = llama_eval(out, TOKENS).logits
    assert logits.shape[0] == len(TOKENS) and np.isfinite(logits).all()


def test_dry_run_writes_nothing(small: Path, tmp_path: Path) -> None:
    result = run("quantize", small, tmp_path / "x.gguf", "--dry-run")
    assert result.exit_code == 0
    assert "blk.0.attn_q.weight" in result.stdout and "F16 -> Q4_K" in result.stdout
    assert "routed expert: copied" in result.stdout
    assert list(tmp_path.iterdir()) == []


def test_fallback_for_rows_not_multiple_of_256(tmp_path: Path) -> None:
    tiny = write_synth_model(tmp_path / "tiny.gguf", "qwen3moe", preset="tiny")
    n_embd = open_gguf(tiny).get("qwen3moe.embedding_length")
    assert n_embd % 256 != 0
    result = run("quantize", tiny, tmp_path / "out.gguf", "--attn", "Q4_K")
    assert result.exit_code == 0, result.output
    assert "fallbacks" in result.stdout and "Q4_K -> Q5_0" in result.stdout
    q = open_gguf(tmp_path / "out.gguf")
    assert q.tensor("blk.0.attn_q.weight").ggml_type == T.Q5_0
    assert np.isfinite(llama_eval(tmp_path / "out.gguf", TOKENS).logits).all()


def test_type_rules_and_already_target_type(small: Path, tmp_path: Path) -> None:
    first = tmp_path / "q8.gguf"
    assert run("quantize", small, first, "--attn", "Q8_0", "--type", "token_embd=Q8_0").exit_code == 0
    m = open_gguf(first)
    assert m.tensor("token_embd.weight").ggml_type == T.Q8_0
    assert m.tensor("output.weight").ggml_type == open_gguf(small).tensor("output.weight").ggml_type
    assert m.kv["general.file_type"] == 7  # MOSTLY_Q8_0: every quantized tensor is Q8_0 now
    again = tmp_path / "q8-again.gguf"
    result = run("quantize", first, again, "--attn", "Q8_0")
    assert "tensors requantized: 0 of" in result.stdout  # already Q8_0: copied, so verify finds them identical
    assert "verify: OK" in result.stdout and "0 requantized" in result.stdout


def test_imatrix_bytes_match_ggml_and_keys_recorded(small: Path, tmp_path: Path, ggml) -> None:
    src = open_gguf(small)
    rng = np.random.default_rng(1)
    entries = {}
    for t in src.tensors:
        if ".attn_" in t.name and "norm" not in t.name and len(t.shape) == 2:
            entries[t.name] = (
                rng.uniform(0.1, 5, (1, t.row_length)).astype(np.float32) * 10,
                np.array([10.0], np.float32),
            )
    imat = tmp_path / "imatrix.gguf"
    write_imatrix_gguf(imat, entries, datasets=["calibration.txt"], chunk_count=3, chunk_size=512)
    out = tmp_path / "imat.gguf"
    result = run("quantize", small, out, "--imatrix", imat)
    assert result.exit_code == 0, result.output
    dst = open_gguf(out)
    assert dst.kv["quantize.imatrix.file"] == str(imat)
    assert dst.kv["quantize.imatrix.dataset"] == "calibration.txt"
    assert dst.kv["quantize.imatrix.entries_count"] == len(entries)
    assert dst.kv["quantize.imatrix.chunks_count"] == 3
    matrix = read_imatrix(imat)
    for name in entries:
        t = src.tensor(name)
        expected = ggml.quantize(src.dequantize(t).reshape(-1, t.row_length), T.Q4_K, matrix.for_tensor(name))
        ggml.assert_same_blocks(np.asarray(dst.raw(dst.tensor(name))).reshape(expected.shape), expected, T.Q4_K, name)


def test_split_output_round_trips_through_llama_cpp(small: Path, quantized, tmp_path: Path) -> None:
    whole, _ = quantized
    result = run("quantize", small, tmp_path / "split.gguf", "--split-max-size", "8M")
    assert result.exit_code == 0, result.output
    shards = sorted(tmp_path.glob("split-*-of-*.gguf"))
    assert len(shards) >= 3 and not (tmp_path / "split.gguf").exists()
    split = open_gguf(shards[0])
    assert [bytes(split.raw(t)) for t in split.tensors] == [
        bytes(open_gguf(whole).raw(t)) for t in open_gguf(whole).tensors
    ]
    np.testing.assert_array_equal(llama_eval(shards[0], TOKENS).logits, llama_eval(whole, TOKENS).logits)
    # split input is read as one model
    again = tmp_path / "joined.gguf"
    assert run("quantize", shards[0], again).exit_code == 0
    verified = run("verify", again, "--against", small)
    assert verified.exit_code == 0 and verified.stdout.startswith("OK:")


def test_verify_catches_a_changed_expert(small: Path, quantized, tmp_path: Path) -> None:
    out, _ = quantized
    tampered = tmp_path / "tampered.gguf"
    raw = bytearray(out.read_bytes())
    t = open_gguf(out).tensor("blk.1.ffn_down_exps.weight")
    raw[t.offset + 100] ^= 0xFF
    tampered.write_bytes(bytes(raw))
    result = run("verify", tampered, "--against", small)
    assert result.exit_code == 1 and "blk.1.ffn_down_exps.weight: bytes differ" in result.stdout


@pytest.mark.parametrize("case", ["same path", "corrupt input", "bad type", "bad rule", "missing imatrix"])
def test_bad_input_exits_2_and_writes_nothing(case: str, small: Path, tmp_path: Path) -> None:
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(small.read_bytes()[:5000])
    out = tmp_path / "out.gguf"
    args = {
        "same path": [small, small],
        "corrupt input": [corrupt, out],
        "bad type": [small, out, "--attn", "Q3_X"],
        "bad rule": [small, out, "--type", "attn_q"],
        "missing imatrix": [small, out, "--imatrix", tmp_path / "none.gguf"],
    }[case]
    result = run("quantize", *args)
    assert result.exit_code == 2, result.output
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["corrupt.gguf"]


def test_interrupted_write_leaves_nothing(small: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import moeprep.quant.quantize as q

    calls = []

    def interrupted(*args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args)

    real = q.quantize_rows
    monkeypatch.setattr(q, "quantize_rows", interrupted)
    with pytest.raises(KeyboardInterrupt):
        q.quantize_model(
            open_gguf(small), tmp_path / "out.gguf", plan_requant(open_gguf(small), T.Q4_K), threads=1, progress=False
        )
    assert list(tmp_path.iterdir()) == []


def test_verify_catches_a_damaged_requantized_tensor(small: Path, quantized, tmp_path: Path) -> None:
    out, _ = quantized
    damaged = tmp_path / "damaged.gguf"
    raw = bytearray(out.read_bytes())
    t = open_gguf(out).tensor("blk.0.attn_q.weight")
    raw[t.offset : t.offset + t.n_bytes] = bytes(t.n_bytes)  # all scales zero: the tensor reads as zeros
    damaged.write_bytes(bytes(raw))
    result = run("verify", damaged, "--against", small, "--threads", "2")
    assert result.exit_code == 1 and "blk.0.attn_q.weight: relative error 1.0000 > 0.14 for Q4_K" in result.stdout


def test_verify_error_over_row_groups_equals_the_whole_tensor(
    small: Path, quantized, monkeypatch: pytest.MonkeyPatch
) -> None:
    import moeprep.quant.verify as v

    out, src = open_gguf(quantized[0]), open_gguf(small)
    monkeypatch.setattr(v, "ERROR_ROWS", 7)  # groups that do not divide the rows
    name = "blk.0.attn_q.weight"
    a, b = out.dequantize(out.tensor(name)).astype(np.float64), src.dequantize(src.tensor(name)).astype(np.float64)
    expected = np.linalg.norm(a - b) / np.linalg.norm(b)
    assert v.relative_error(out, out.tensor(name), src, src.tensor(name)) == pytest.approx(expected, rel=1e-12)


def test_lookahead_stays_within_its_budget_and_gives_each_tensors_bytes(small: Path) -> None:
    """With a budget of one byte the pool may run at most one tensor ahead of the writer; every tensor's bytes are
    those of quantizing it whole."""
    from concurrent.futures import ThreadPoolExecutor

    from moeprep.quant.quantize import Lookahead
    from moeprep.quant.registry import quantize_rows

    model = open_gguf(small)
    plans = [p for p in plan_requant(model, T.Q4_K).tensors if p.requantize]
    assert len(plans) > 3
    with ThreadPoolExecutor(2) as pool:
        lookahead = Lookahead(model, plans, None, pool, "cpu", budget=1)
        for plan in plans:
            got = np.concatenate([np.asarray(c).reshape(-1) for c in lookahead.output_tensor(plan).chunks()])
            assert len(lookahead._submitted) <= 1, "the lookahead ran past its budget"
            rows = model.dequantize(plan.tensor).reshape(-1, plan.tensor.row_length)
            np.testing.assert_array_equal(got, quantize_rows(rows, T.Q4_K).reshape(-1))
