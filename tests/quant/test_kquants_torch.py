"""kquants_torch on the CPU: the same bytes as kquants (numba) and libggml; and `--device` through registry, quantize
and the CLI. CUDA is measured by bench/bench_quant_torch.py on a GPU machine (CI has none)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from moeprep.cli import main
from moeprep.errors import MoeprepError
from moeprep.quant import kquants, kquants_torch, registry, scalars
from tests.quant.test_kquants import IMATRIX, KTYPES, adversarial_rows, make_imatrix


def torch_bytes(qtype: T, rows: np.ndarray, imatrix: np.ndarray | None, **kw) -> np.ndarray:
    """kquants_torch itself (no kquants fallback) on CPU tensors."""
    w = None if imatrix is None else torch.from_numpy(imatrix)
    return kquants_torch.KQUANTIZERS[qtype](torch.from_numpy(rows), w, **kw).numpy()


@pytest.mark.parametrize("n_per_row", [256, 2048])
@pytest.mark.parametrize("imatrix", IMATRIX)
@pytest.mark.parametrize("qtype", KTYPES, ids=lambda t: t.name)
def test_random_rows_kquants_torch_ggml_equal(ggml, qtype, imatrix, n_per_row):
    rng = np.random.default_rng(n_per_row + 1)
    rows = (rng.standard_t(3, (8, n_per_row)) * rng.exponential(1.0, (8, 1))).astype(np.float32)
    qw = make_imatrix(imatrix, n_per_row, rng)
    theirs = ggml.quantize(rows, qtype, qw)
    label = f"random rows of {n_per_row}, imatrix={imatrix}"
    ggml.assert_same_blocks(kquants.KQUANTIZERS[qtype](rows, qw), theirs, qtype, f"kquants, {label}")
    ggml.assert_same_blocks(torch_bytes(qtype, rows, qw), theirs, qtype, f"torch-cpu, {label}")


@pytest.mark.parametrize("imatrix", IMATRIX)
@pytest.mark.parametrize("qtype", KTYPES, ids=lambda t: t.name)
def test_adversarial_rows_match_ggml(ggml, qtype, imatrix):
    """All of test_kquants' adversarial inputs in one call; a failure names the input of each bad block."""
    rng = np.random.default_rng(7)
    qw = make_imatrix(imatrix, 512, rng)
    named = adversarial_rows(512, rng)
    rows = np.concatenate(list(named.values()))
    ours, theirs = torch_bytes(qtype, rows, qw), ggml.quantize(rows, qtype, qw)
    bad_rows = np.flatnonzero((ours != theirs).any(axis=1))
    names = [name for name, r in named.items() for _ in range(r.shape[0])]
    assert not bad_rows.size, f"{qtype.name} imatrix={imatrix}: rows differ in {sorted({names[i] for i in bad_rows})}"
    assert np.array_equal(kquants.KQUANTIZERS[qtype](rows, qw), theirs)


@pytest.mark.parametrize("qtype", KTYPES, ids=lambda t: t.name)
def test_chunk_boundaries_and_per_row_importance(ggml, qtype):
    rng = np.random.default_rng(3)
    rows = rng.standard_normal((5, 512)).astype(np.float32)
    per_row = (rng.random((5, 512)) + 0.1).astype(np.float32)
    ours = torch_bytes(qtype, rows, per_row, chunk_blocks=3)
    theirs = np.concatenate([ggml.quantize(rows[r : r + 1], qtype, per_row[r]) for r in range(5)])
    ggml.assert_same_blocks(ours, theirs, qtype, "per-row importance over chunks of 3 blocks")


def test_nearest_int_matches_the_numba_one_and_maps_nan_to_zero():
    values = np.array(
        [0.5, 1.5, 2.5, -0.5, -1.5, 3.49, 4194303.0, -4194303.0, 5e6, -9e6, 1e20, np.inf, -np.inf, np.nan, -np.nan],
        np.float32,
    )
    with np.errstate(invalid="ignore", over="ignore"):
        expected = [scalars.nearest_int(v) for v in values]
    assert kquants_torch.nearest_int(torch.from_numpy(values)).tolist() == expected
    # a GPU's canonical NaN (0x7FFFFFFF) gives 0 too, as x86's default NaN does
    assert kquants_torch.nearest_int(torch.tensor([0x7FFFFFFF], dtype=torch.int32).view(torch.float32)).item() == 0


def test_division_and_sqrt_are_correctly_rounded():
    """_div and _sqrt equal numpy's float32 / and sqrt; torch's own CPU sqrt does not (which is why _sqrt exists)."""
    rng = np.random.default_rng(0)
    a = (rng.standard_normal(1 << 16) * np.exp(rng.standard_normal(1 << 16) * 4)).astype(np.float32)
    b = (rng.standard_normal(1 << 16) * np.exp(rng.standard_normal(1 << 16) * 4)).astype(np.float32)
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    assert np.array_equal(kquants_torch._div(ta, tb).numpy(), a / b)
    assert np.array_equal(kquants_torch._div(ta, 63.0).numpy(), a / np.float32(63))
    assert np.array_equal(kquants_torch._div(63.0, tb).numpy(), np.float32(63) / b)
    assert np.array_equal(kquants_torch._sqrt(ta.abs()).numpy(), np.sqrt(np.abs(a)))


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K], ids=lambda t: t.name)
def test_nan_scale_rows_are_requantized_with_x86_bits(ggml, qtype, monkeypatch):
    """|x| ~ 1e30 with an imatrix stores a NaN d; a GPU writes its own NaN bits there (0x7FFF), which
    quantizers_on replaces by kquants.py's rows. Simulated here by writing the GPU's bits on the CPU."""
    rng = np.random.default_rng(7)
    rows = (rng.standard_normal((4, 512)) * 1e30).astype(np.float32)
    rows[1] = rng.standard_normal(512).astype(np.float32)  # an ordinary row in between stays on the device
    qw = make_imatrix("random", 512, rng)
    real = kquants_torch.KQUANTIZERS[qtype]
    seen_bad: list[np.ndarray] = []

    def gpu_like(t: torch.Tensor, w: torch.Tensor | None, chunk_blocks: int) -> torch.Tensor:
        out = real(t, w, chunk_blocks).clone()
        size = GGML_QUANT_SIZES[qtype][1]
        blocks = out.view(-1, size)
        half = blocks[:, 0:2].contiguous().view(torch.int16)
        nan = ((half & 0x7C00) == 0x7C00) & ((half & 0x03FF) != 0)
        blocks[nan[:, 0], 0:2] = torch.tensor([0xFF, 0x7F], dtype=torch.uint8)
        seen_bad.append(np.flatnonzero(nan[:, 0].numpy()))
        return out

    monkeypatch.setitem(kquants_torch.KQUANTIZERS, qtype, gpu_like)
    ours = kquants_torch.quantizers_on("cpu")[qtype](rows, qw)
    assert seen_bad[0].size, "no NaN scale: the test input no longer reaches the case"
    ggml.assert_same_blocks(ours, ggml.quantize(rows, qtype, qw), qtype, "1e30 rows with a GPU's NaN bits")


# --- --device through registry, quantize_model and the CLI ------------------------------------------------------------

needs_no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error for a machine without a GPU")


@needs_no_gpu
def test_cuda_without_gpu_is_a_user_error():
    registry.quantizers_on.cache_clear()
    with pytest.raises(MoeprepError, match="--device cuda: .*use --device cpu"):
        registry.quantize_rows(np.zeros((1, 256), np.float32), T.Q4_K, device="cuda")


@needs_no_gpu
def test_cli_device_cuda_without_gpu_exits_2_with_one_line(tmp_path: Path, synth_small: Path):
    result = CliRunner().invoke(main, ["quantize", str(synth_small), str(tmp_path / "o.gguf"), "--device", "cuda"])
    assert result.exit_code == 2
    assert len(result.output.strip().splitlines()) == 1 and "--device cuda" in result.output
    assert not (tmp_path / "o.gguf").exists()


@pytest.fixture(scope="module")
def synth_small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from moeprep.synth import write_synth_model

    return write_synth_model(tmp_path_factory.mktemp("dev") / "small.gguf", "qwen3moe", preset="small")


def test_device_path_writes_the_same_file(tmp_path: Path, synth_small: Path, monkeypatch):
    """The whole-slice device path (torch on the CPU standing in for the GPU) writes the bytes of --device cpu."""
    monkeypatch.setitem(registry.DEVICES, "cuda", lambda: kquants_torch.quantizers_on("cpu"))
    registry.quantizers_on.cache_clear()
    try:
        digests = {}
        for device in ("cpu", "cuda"):
            out = tmp_path / f"{device}.gguf"
            result = CliRunner().invoke(
                main,
                [
                    "quantize",
                    str(synth_small),
                    str(out),
                    "--attn",
                    "Q6_K",
                    "--device",
                    device,
                    "--threads",
                    "2",
                    "--no-verify",
                ],
            )
            assert result.exit_code == 0, result.output
            digests[device] = hashlib.sha256(out.read_bytes()).hexdigest()
        assert digests["cpu"] == digests["cuda"]
    finally:
        registry.quantizers_on.cache_clear()
