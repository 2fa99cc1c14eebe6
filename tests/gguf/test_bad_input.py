"""Bad GGUF input: one line on stderr, exit code 2, no traceback, for every way a file can be wrong."""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from gguf import GGUFReader, GGUFWriter

from moeprep.cli import main


def write_small_gguf(path: Path) -> Path:
    w = GGUFWriter(path, "qwen3moe")
    w.add_block_count(1)
    w.add_expert_count(4)
    w.add_tensor("blk.0.attn_q.weight", np.ones((32, 32), np.float32))
    w.add_tensor("blk.0.ffn_up_exps.weight", np.ones((4, 8, 32), np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def patched(src: Path, dst: Path, offset: int, data: bytes) -> Path:
    raw = bytearray(src.read_bytes())
    raw[offset : offset + len(data)] = data
    dst.write_bytes(bytes(raw))
    return dst


def tensor_info_offsets(path: Path) -> dict[str, int]:
    """Byte offset of each part of the first tensor's info: n_dims, ne[0], type, offset."""
    field = GGUFReader(path).tensors[0].field
    name_len, name, n_dims, dims, ggml_type, data_offset = field.parts
    starts = np.cumsum([0] + [p.nbytes for p in field.parts])
    return {
        "n_dims": field.offset + int(starts[2]),
        "ne0": field.offset + int(starts[3]),
        "type": field.offset + int(starts[4]),
        "offset": field.offset + int(starts[5]),
    }


@pytest.fixture
def good(tmp_path: Path) -> Path:
    return write_small_gguf(tmp_path / "good.gguf")


def bad_files(good: Path, tmp: Path) -> dict[str, tuple[Path, str]]:
    info = tensor_info_offsets(good)
    size = good.stat().st_size
    text = tmp / "notes.gguf"
    text.write_text("this is a text file, not a model\n" * 10)
    trunc_header = tmp / "trunc_header.gguf"
    trunc_header.write_bytes(good.read_bytes()[:60])
    trunc_data = tmp / "trunc_data.gguf"
    trunc_data.write_bytes(good.read_bytes()[: size - 100])
    empty = tmp / "empty.gguf"
    empty.write_bytes(b"")
    return {
        "text file": (text, "not a GGUF"),
        "empty file": (empty, "not a GGUF"),
        "bad magic": (patched(good, tmp / "magic.gguf", 0, b"GGUX"), "bad magic"),
        "truncated header": (trunc_header, "truncated or corrupt header"),
        "truncated data": (trunc_data, "truncated"),
        "absurd tensor count": (patched(good, tmp / "count.gguf", 8, struct.pack("<Q", 1 << 60)), "header"),
        "absurd kv count": (patched(good, tmp / "kvcount.gguf", 16, struct.pack("<Q", 1 << 40)), "header"),
        "absurd tensor offset": (
            patched(good, tmp / "off.gguf", info["offset"], struct.pack("<Q", 1 << 50)),
            "truncated",
        ),
        "overflowing shape": (
            patched(good, tmp / "shape.gguf", info["ne0"], struct.pack("<Q", 1 << 62)),
            "past the end",
        ),
        "zero dimension": (patched(good, tmp / "zero.gguf", info["ne0"], struct.pack("<Q", 0)), "invalid shape"),
        "unknown type": (
            patched(good, tmp / "type.gguf", info["type"], struct.pack("<I", 999)),
            "unknown tensor type 999",
        ),
        "too many dims": (patched(good, tmp / "dims.gguf", info["n_dims"], struct.pack("<I", 200)), "header"),
        "unsupported version": (
            patched(good, tmp / "version.gguf", 4, struct.pack("<I", 99)),
            "unsupported GGUF version 99",
        ),
        "folder": (tmp, "folder"),
        "missing file": (tmp / "nothere.gguf", "no such file"),
    }


@pytest.mark.parametrize(
    "case",
    [
        "text file",
        "empty file",
        "bad magic",
        "truncated header",
        "truncated data",
        "absurd tensor count",
        "absurd kv count",
        "absurd tensor offset",
        "overflowing shape",
        "zero dimension",
        "unknown type",
        "too many dims",
        "unsupported version",
        "folder",
        "missing file",
    ],
)
def test_bad_gguf_is_one_line_exit_2(case: str, good: Path, tmp_path: Path) -> None:
    path, expected = bad_files(good, tmp_path)[case]
    result = CliRunner().invoke(main, ["inspect", str(path)])
    assert result.exit_code == 2, (case, result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moeprep: error: "), result.stderr
    assert "Traceback" not in result.output
    assert expected.lower() in lines[0].lower(), lines[0]


def test_good_file_inspects(good: Path) -> None:
    result = CliRunner().invoke(main, ["inspect", str(good)])
    assert result.exit_code == 0, result.output
    assert "qwen3moe" in result.stdout


def test_missing_shard(good: Path, tmp_path: Path) -> None:
    first = tmp_path / "split-00001-of-00003.gguf"
    shutil.copy(good, first)
    shutil.copy(good, tmp_path / "split-00002-of-00003.gguf")
    result = CliRunner().invoke(main, ["inspect", str(first)])
    assert result.exit_code == 2
    assert "missing split-00003-of-00003.gguf" in result.stderr


def test_not_first_shard(good: Path, tmp_path: Path) -> None:
    second = tmp_path / "split-00002-of-00002.gguf"
    shutil.copy(good, second)
    result = CliRunner().invoke(main, ["inspect", str(second)])
    assert result.exit_code == 2
    assert "open the first shard" in result.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["quantize", "only-one-path.gguf"],
        ["profile", "/no/such/model.gguf", "--dataset", "x", "-o", "out.moeprof"],
        ["inspect", "m.gguf", "--vram"],
        ["no-such-command"],
    ],
)
def test_bad_command_line_is_one_line_exit_2(args: list[str]) -> None:
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moeprep: error: "), result.stderr
