"""Open a GGUF model (one file or a split set) memory-mapped, validate it, and describe its tensors.

moeprep.gguf.header parses each file; this module reads a split set as one model and offers plain dataclasses the
rest of moeprep uses. A corrupt or truncated file becomes one clear MoeprepError. Tensor data is never read into
RAM here: `GGUFModel.raw` returns a view of the memory map.

Shapes are in numpy order (outermost first, row length last), the reverse of GGUF's ne[] order.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from moeprep.errors import MoeprepError
from moeprep.gguf.header import Field, GGUFFile, StringArray, TensorInfo, read_header

__all__ = [
    "SPLIT_RE",
    "Field",
    "GGUFFile",
    "GGUFModel",
    "StringArray",
    "TensorInfo",
    "dequantize_raw",
    "field_value",
    "open_gguf",
    "shard_paths_for",
]

# llama.cpp's shard naming: name-00001-of-00003.gguf
SPLIT_RE = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclass
class GGUFModel:
    """A GGUF model: metadata from the first shard, tensors of all shards in file order."""

    shard_paths: list[Path]
    readers: list[GGUFFile]  # one parsed header per shard
    fields: dict[str, Field]  # the first shard's key/value fields, in file order
    tensors: list[TensorInfo]

    @property
    def path(self) -> Path:
        return self.shard_paths[0]

    @functools.cached_property
    def kv(self) -> dict[str, Any]:
        """Metadata as plain Python values (first shard; split.* keys included), decoded once."""
        return {name: f.value for name, f in self.fields.items()}

    def get(self, key: str, default: Any = None) -> Any:
        field = self.fields.get(key)
        return default if field is None else field.value

    @property
    def arch(self) -> str:
        return str(self.get("general.architecture", "unknown"))

    @property
    def name(self) -> str:
        return str(self.get("general.name", self.path.stem))

    @property
    def file_size(self) -> int:
        return sum(p.stat().st_size for p in self.shard_paths)

    @property
    def alignment(self) -> int:
        return int(self.readers[0].alignment)

    @functools.cached_property
    def _by_name(self) -> dict[str, TensorInfo]:
        return {t.name: t for t in self.tensors}

    def tensor(self, name: str) -> TensorInfo:
        return self._by_name[name]

    def raw(self, t: TensorInfo) -> np.ndarray:
        """The tensor's stored bytes as a uint8 view of the memory map (no copy)."""
        return self.readers[t.shard].data[t.offset : t.offset + t.n_bytes]

    def iter_bytes(self, t: TensorInfo, chunk_size: int = 64 << 20) -> Iterator[bytes]:
        """The tensor's stored bytes in chunks, read from the file rather than the memory map, so that streaming a
        huge model does not leave its pages resident in this process."""
        with open(self.shard_paths[t.shard], "rb", buffering=0) as f:
            f.seek(t.offset)
            left = t.n_bytes
            while left:
                chunk = f.read(min(chunk_size, left))
                if not chunk:
                    raise MoeprepError(f"{self.shard_paths[t.shard]}: file shrank while reading {t.name}")
                left -= len(chunk)
                yield chunk

    def dequantize(self, t: TensorInfo) -> np.ndarray:
        """The tensor as float32 in numpy shape (reads and converts the whole tensor)."""
        return self.dequantize_rows(t).reshape(t.shape)

    def dequantize_rows(self, t: TensorInfo, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows start..stop of the tensor seen as [rows, row_length] (a 3-D tensor's slices one after another), as
        float32; reads and converts only those rows."""
        n_rows = t.n_elements // t.row_length
        stop = n_rows if stop is None else min(stop, n_rows)
        rows = self.raw(t).reshape(n_rows, -1)[start:stop]
        try:
            return dequantize_raw(rows, t.ggml_type, (stop - start, t.row_length))
        except MoeprepError as e:
            raise MoeprepError(f"{self.path}: {t.name}: {e}") from e


def dequantize_raw(raw: np.ndarray, ggml_type: GGMLQuantizationType, shape: tuple[int, ...]) -> np.ndarray:
    """float32 values of numpy `shape` from a tensor's stored bytes (uint8, rows of shape[-1] values); F32 bytes are
    viewed, not copied, and gguf-py converts every other type."""
    if ggml_type == GGMLQuantizationType.F32:
        return raw.view(np.float32).reshape(shape)
    block, type_size = GGML_QUANT_SIZES[ggml_type]
    try:
        values = gguf_dequantize(raw.reshape(-1, shape[-1] // block * type_size), ggml_type)
    except NotImplementedError as e:
        raise MoeprepError(f"gguf-py cannot dequantize tensor type {ggml_type.name}; requantize the model") from e
    return values.astype(np.float32, copy=False).reshape(shape)


def field_value(field: Field) -> Any:
    """A metadata field as a Python value: str, int, float, bool, or a list of them."""
    return field.value


def shard_paths_for(path: Path) -> list[Path]:
    """All shards of a split set given its first shard; [path] for a single file."""
    m = SPLIT_RE.match(path.name)
    if m is None:
        return [path]
    count = int(m["count"])
    if int(m["no"]) != 1:
        raise MoeprepError(
            f"{path}: this is shard {int(m['no'])} of {count}; open the first shard (-00001-of-{count:05d})"
        )
    paths = [path.with_name(f"{m['prefix']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in paths if not p.exists()]
    if missing:
        raise MoeprepError(f"{path}: split set is incomplete, missing {', '.join(missing)}")
    return paths


def open_gguf(path: str | Path) -> GGUFModel:
    """Open a GGUF file or the first shard of a split set; raises MoeprepError on anything unreadable."""
    path = Path(path)
    paths = shard_paths_for(path)
    readers = [read_header(p, i) for i, p in enumerate(paths)]
    first = readers[0]
    if len(paths) > 1:
        count = first.get_field("split.count")
        if count is None or count.value != len(paths):
            raise MoeprepError(f"{path}: split.count does not match the {len(paths)} shard files")
    tensors = [t for r in readers for t in r.tensors]
    if len({t.name for t in tensors}) != len(tensors):
        raise MoeprepError(f"{path}: the same tensor name appears in more than one shard")
    return GGUFModel(shard_paths=paths, readers=readers, fields=first.fields, tensors=tensors)
