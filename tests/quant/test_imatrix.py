"""Importance matrices: GGUF round trip (checked with libggml's own GGUF reader), legacy .dat, corrupt files."""

from __future__ import annotations

import ctypes
import os
import struct

import gguf
import numpy as np
import pytest

from moeprep.errors import MoeprepError
from moeprep.quant import imatrix as im

DENSE = "blk.0.attn_q.weight"
EXPERTS = "blk.0.ffn_up_exps.weight"


def sample_entries(rng: np.random.Generator) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """A dense weight (P = 64) and a 4-expert stack (P = 32) with one expert that saw no token."""
    return {
        EXPERTS: ((rng.random((4, 32)) * 100).astype(np.float32), np.array([30, 0, 12, 5], np.float32)),
        DENSE: ((rng.random(64) * 50).astype(np.float32), np.array([40], np.float32)),
    }


def write_legacy(path, entries: list[tuple[str, int, np.ndarray]], trailer: tuple[int, str] | None) -> None:
    """llama-imatrix's .dat layout: count, then (name, ncall, nval, values) per entry, then the optional trailer."""
    out = bytearray(struct.pack("<i", len(entries)))
    for name, ncall, values in entries:
        raw = name.encode()
        out += struct.pack("<i", len(raw)) + raw + struct.pack("<ii", ncall, values.size)
        out += values.astype("<f4").tobytes()
    if trailer is not None:
        chunks, dataset = trailer
        out += struct.pack("<ii", chunks, len(dataset)) + dataset.encode()
    path.write_bytes(bytes(out))


class _GgufInitParams(ctypes.Structure):
    _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.POINTER(ctypes.c_void_p))]


def read_with_libggml(lib: ctypes.CDLL, path: str) -> tuple[dict[str, object], dict[str, np.ndarray]]:
    """Read an imatrix as llama.cpp does: libggml's gguf reader, then in_sum2 / lround(count) (1 where count is 0).
    -> (keys, importance [M, P] per weight)."""
    v, i64, s = ctypes.c_void_p, ctypes.c_int64, ctypes.c_char_p
    for name, res, args in [
        ("gguf_init_from_file", v, [s, _GgufInitParams]),
        ("gguf_find_key", i64, [v, s]),
        ("gguf_get_val_u32", ctypes.c_uint32, [v, i64]),
        ("gguf_get_val_str", s, [v, i64]),
        ("gguf_get_arr_n", ctypes.c_size_t, [v, i64]),
        ("gguf_get_arr_str", s, [v, i64, ctypes.c_size_t]),
        ("gguf_get_n_tensors", i64, [v]),
        ("gguf_get_tensor_name", s, [v, i64]),
        ("ggml_get_tensor", v, [v, s]),
        ("ggml_n_dims", ctypes.c_int, [v]),
        ("ggml_nrows", i64, [v]),
        ("ggml_nelements", i64, [v]),
        ("ggml_get_data_f32", ctypes.POINTER(ctypes.c_float), [v]),
        ("gguf_free", None, [v]),
        ("ggml_free", None, [v]),
    ]:
        getattr(lib, name).restype, getattr(lib, name).argtypes = res, args
    ctx = ctypes.c_void_p()
    g = lib.gguf_init_from_file(path.encode(), _GgufInitParams(False, ctypes.pointer(ctx)))
    assert g, f"libggml cannot read {path}"
    try:
        key = lambda k: lib.gguf_find_key(g, k.encode())  # noqa: E731
        keys = {
            gguf.Keys.General.TYPE: lib.gguf_get_val_str(g, key(gguf.Keys.General.TYPE)).decode(),
            gguf.Keys.IMatrix.CHUNK_COUNT: lib.gguf_get_val_u32(g, key(gguf.Keys.IMatrix.CHUNK_COUNT)),
            gguf.Keys.IMatrix.CHUNK_SIZE: lib.gguf_get_val_u32(g, key(gguf.Keys.IMatrix.CHUNK_SIZE)),
            gguf.Keys.IMatrix.DATASETS: [
                lib.gguf_get_arr_str(g, key(gguf.Keys.IMatrix.DATASETS), j).decode()
                for j in range(lib.gguf_get_arr_n(g, key(gguf.Keys.IMatrix.DATASETS)))
            ],
            "has general.architecture": key(gguf.Keys.General.ARCHITECTURE) != -1,
            "tensor order": [lib.gguf_get_tensor_name(g, t).decode() for t in range(lib.gguf_get_n_tensors(g))],
        }
        importance = {}
        for name in keys["tensor order"][::2]:
            base = name.removesuffix(im.IN_SUM2_SUFFIX)
            sums_t = lib.ggml_get_tensor(ctx, (base + im.IN_SUM2_SUFFIX).encode())
            counts_t = lib.ggml_get_tensor(ctx, (base + im.COUNTS_SUFFIX).encode())
            m = lib.ggml_nrows(sums_t)
            keys[f"{base} dims"] = (lib.ggml_n_dims(sums_t), lib.ggml_n_dims(counts_t))
            sums = np.ctypeslib.as_array(lib.ggml_get_data_f32(sums_t), (lib.ggml_nelements(sums_t),)).reshape(m, -1)
            counts = np.ctypeslib.as_array(lib.ggml_get_data_f32(counts_t), (m,))
            c = np.floor(counts.astype(np.float64) + 0.5).astype(np.float32)[:, None]
            importance[base] = np.where(c > 0, sums / np.where(c > 0, c, 1), np.float32(1)).astype(np.float32)
        return keys, importance
    finally:
        lib.gguf_free(g)
        lib.ggml_free(ctx)


def test_gguf_round_trip_and_llama_cpp_reads_it(ggml, tmp_path):
    entries = sample_entries(np.random.default_rng(0))
    path = tmp_path / "imatrix.gguf"
    im.write_imatrix_gguf(path, entries, ["wiki.train.raw", "code.txt"], chunk_count=17, chunk_size=512)
    assert os.listdir(tmp_path) == ["imatrix.gguf"]  # the temp file was renamed, nothing left behind

    keys, importance = read_with_libggml(ggml.lib, str(path))
    assert keys[gguf.Keys.General.TYPE] == "imatrix"
    assert not keys["has general.architecture"]
    assert keys[gguf.Keys.IMatrix.DATASETS] == ["wiki.train.raw", "code.txt"]
    assert (keys[gguf.Keys.IMatrix.CHUNK_COUNT], keys[gguf.Keys.IMatrix.CHUNK_SIZE]) == (17, 512)
    assert keys["tensor order"] == [DENSE + ".in_sum2", DENSE + ".counts", EXPERTS + ".in_sum2", EXPERTS + ".counts"]
    assert keys[f"{DENSE} dims"] == (1, 1) and keys[f"{EXPERTS} dims"] == (2, 2)  # llama-imatrix's shapes

    imx = im.read_imatrix(path)
    assert not imx.is_legacy and imx.entry_count == 2
    assert (imx.datasets, imx.chunk_count, imx.chunk_size) == (["wiki.train.raw", "code.txt"], 17, 512)
    dense, experts = imx.for_tensor(DENSE), imx.for_tensor(EXPERTS)
    assert dense.shape == (64,) and experts.shape == (4, 32)
    np.testing.assert_array_equal(dense, importance[DENSE][0])
    np.testing.assert_array_equal(experts, importance[EXPERTS])
    np.testing.assert_array_equal(experts[0], entries[EXPERTS][0][0] / np.float32(30))
    assert (experts[1] == 1).all()  # an expert that saw no token gets importance 1
    assert imx.for_tensor("blk.9.ffn_down.weight") is None
    assert imx.quantize_kv() == {
        im.QUANTIZE_IMATRIX_FILE: str(path),
        im.QUANTIZE_IMATRIX_DATASET: "wiki.train.raw",
        im.QUANTIZE_IMATRIX_N_ENTRIES: 2,
        im.QUANTIZE_IMATRIX_N_CHUNKS: 17,
    }


def test_gguf_write_is_atomic(tmp_path):
    path = tmp_path / "imatrix.gguf"
    path.write_bytes(b"old")
    bad = {DENSE: (np.ones(10, np.float32), np.ones(3, np.float32))}  # 10 sums do not split into 3 matrices
    with pytest.raises(ValueError):
        im.write_imatrix_gguf(path, bad, ["wiki.train.raw"], 1, 512)
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["imatrix.gguf"]
    with pytest.raises(ValueError, match="at least one dataset"):
        im.write_imatrix_gguf(path, sample_entries(np.random.default_rng(0)), [], 1, 512)


def test_legacy_dat(tmp_path):
    rng = np.random.default_rng(1)
    dense, experts = (rng.random(64) * 8).astype(np.float32), (rng.random(4 * 32) * 8).astype(np.float32)
    path = tmp_path / "imatrix.dat"
    write_legacy(path, [(DENSE, 10, dense), (EXPERTS, 0, experts)], trailer=(42, "wiki.train.raw"))
    imx = im.read_imatrix(path)
    assert imx.is_legacy and imx.entry_count == 2
    assert (imx.datasets, imx.chunk_count, imx.chunk_size) == (["wiki.train.raw"], 42, 0)
    np.testing.assert_array_equal(imx.for_tensor(DENSE), dense / np.float32(10))
    np.testing.assert_array_equal(imx.for_tensor(EXPERTS), experts)  # ncall 0: values as stored
    assert imx.for_tensor(EXPERTS, n_per_row=32).shape == (4, 32)  # the flat expert stack, split per expert
    with pytest.raises(MoeprepError, match="not a multiple of the tensor's row length 48"):
        imx.for_tensor(EXPERTS, n_per_row=48)
    assert imx.quantize_kv()[im.QUANTIZE_IMATRIX_N_CHUNKS] == 42

    write_legacy(path, [(DENSE, 10, dense)], trailer=None)  # the trailer is optional
    imx = im.read_imatrix(path)
    assert (imx.datasets, imx.chunk_count) == ([], 0)
    assert im.QUANTIZE_IMATRIX_N_CHUNKS not in imx.quantize_kv()


def test_non_finite_importance_is_refused(tmp_path):
    path = tmp_path / "imatrix.dat"
    write_legacy(path, [(DENSE, 1, np.array([1.0, np.nan], np.float32))], trailer=None)
    with pytest.raises(MoeprepError, match="NaN/Inf"):
        im.read_imatrix(path).for_tensor(DENSE)


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", "truncated"),
        (b"\x00\x00\x00\x00", "entry count 0"),
        (struct.pack("<ii", 1, 1_000_000) + b"abc", "truncated at the name of entry 0"),
        (struct.pack("<ii", 1, 3) + b"abc" + struct.pack("<ii", 1, 8) + b"\x00" * 12, "truncated at the values of abc"),
        (b"\x89PNG\r\n\x1a\n" + b"\x00" * 64, "not a llama.cpp imatrix"),
        (b"GGUF" + b"\xff" * 40, "corrupt GGUF imatrix"),
    ],
)
def test_corrupt_files_are_one_line_errors(tmp_path, content, message):
    path = tmp_path / "bad.imatrix"
    path.write_bytes(content)
    with pytest.raises(MoeprepError, match=message) as e:
        im.read_imatrix(path)
    assert "\n" not in str(e.value) and str(path) in str(e.value)


def test_model_gguf_is_not_an_imatrix(tmp_path):
    path = tmp_path / "model.gguf"
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_type(gguf.GGUFType.MODEL)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(MoeprepError, match="type 'model', not an importance matrix"):
        im.read_imatrix(path)


def test_missing_file(tmp_path):
    with pytest.raises(MoeprepError, match="cannot read imatrix"):
        im.read_imatrix(tmp_path / "nope.gguf")
