"""write_gguf: byte-identical copies, keys kept in order, llama.cpp split layout, atomic on failure."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from moeprep.errors import MoeprepError
from moeprep.gguf.reader import open_gguf
from moeprep.gguf.writer import KVValue, OutputTensor, copied_tensor, write_gguf


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def model_path(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    path = tmp_path / "m.gguf"
    w = GGUFWriter(path, "qwen3moe")
    w.add_name("writer test")
    w.add_block_count(2)
    w.add_array("tokenizer.ggml.tokens", ["a", "b", "<s>"])
    w.add_array("test.floats", [0.5, 1.5])
    w.add_bool("test.flag", True)
    for i in range(2):
        w.add_tensor(f"blk.{i}.attn_q.weight", rng.standard_normal((32, 64)).astype(np.float32))
        w.add_tensor(f"blk.{i}.ffn_up_exps.weight", rng.standard_normal((4, 16, 64)).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_plain_copy_is_byte_identical(model_path: Path, tmp_path: Path) -> None:
    out = write_gguf(tmp_path / "copy.gguf", open_gguf(model_path))
    assert out == [tmp_path / "copy.gguf"]
    assert sha256(out[0]) == sha256(model_path)


def test_kv_set_and_remove_keep_order(model_path: Path, tmp_path: Path) -> None:
    model = open_gguf(model_path)
    out = write_gguf(
        tmp_path / "kv.gguf",
        model,
        kv_remove=["test.flag"],
        kv_set={
            "general.name": KVValue("renamed", GGUFValueType.STRING),
            "moe_cache.expert_usage": KVValue([1, 2, 3], GGUFValueType.ARRAY, GGUFValueType.UINT32),
        },
    )
    kv = open_gguf(out[0]).kv
    expected = [k for k in model.kv if k != "test.flag"] + ["moe_cache.expert_usage"]
    assert list(kv) == expected
    assert kv["general.name"] == "renamed" and kv["moe_cache.expert_usage"] == [1, 2, 3]
    assert kv["test.floats"] == [0.5, 1.5]


def test_split_round_trip(model_path: Path, tmp_path: Path) -> None:
    model = open_gguf(model_path)
    paths = write_gguf(tmp_path / "s.gguf", model, split_max_size=20000)  # two 8 KiB tensors per shard
    assert [p.name for p in paths] == ["s-00001-of-00002.gguf", "s-00002-of-00002.gguf"]
    split = open_gguf(paths[0])
    assert [t.name for t in split.tensors] == [t.name for t in model.tensors]
    for a, b in zip(split.tensors, model.tensors):
        assert bytes(split.raw(a)) == bytes(model.raw(b))
    assert split.get("split.count") == 2 and split.get("split.tensors.count") == 4
    second = GGUFReader(paths[1]).fields  # metadata lives in the first shard only
    assert "general.name" not in second and "split.no" in second
    # a split set written back as one file equals the original
    joined = write_gguf(tmp_path / "joined.gguf", split)
    assert sha256(joined[0]) == sha256(model_path)


def test_refuses_to_overwrite_input(model_path: Path) -> None:
    with pytest.raises(MoeprepError, match="refusing to overwrite"):
        write_gguf(model_path, open_gguf(model_path))


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_failure_leaves_nothing_behind(model_path: Path, tmp_path: Path, error: type[BaseException]) -> None:
    model = open_gguf(model_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.gguf").write_bytes(b"old contents")

    def failing_chunks():
        yield b"\0" * 16
        raise error("interrupted")

    tensors = [copied_tensor(model, t) for t in model.tensors]
    tensors[2] = OutputTensor(tensors[2].name, tensors[2].ggml_type, tensors[2].shape, failing_chunks)
    with pytest.raises(error):
        write_gguf(out / "keep.gguf", model, tensors=tensors)
    assert sorted(p.name for p in out.iterdir()) == ["keep.gguf"]
    assert (out / "keep.gguf").read_bytes() == b"old contents"


def test_copies_without_kernel_support_stream_the_same_bytes(
    model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno
    import os

    def unsupported(*args, **kwargs):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "copy_file_range", unsupported)
    out = write_gguf(tmp_path / "streamed.gguf", open_gguf(model_path))
    assert sha256(out[0]) == sha256(model_path)
