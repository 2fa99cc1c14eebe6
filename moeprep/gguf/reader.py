"""Open a GGUF model (one file or a split set) memory-mapped, validate it, and describe its tensors.

gguf-py's GGUFReader does the parsing; this module adds what it leaves out: split sets read as one model, checks
that turn a corrupt or truncated file into one clear MoeprepError, and plain dataclasses the rest of moeprep uses.
Tensor data is never read into RAM here: `GGUFModel.raw` returns a view of the memory map.

Shapes are in numpy order (outermost first, row length last), the reverse of GGUF's ne[] order.
"""

from __future__ import annotations

import functools
import re
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.gguf_reader import ReaderField
from gguf.quants import dequantize as gguf_dequantize

from moeprep.errors import MoeprepError

# llama.cpp's shard naming: name-00001-of-00003.gguf
SPLIT_RE = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
MAX_DIMS = 4
# gguf-py's own messages for a damaged header, translated into what is wrong with the file.
READER_ERRORS: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"cannot reshape array of size"), "truncated or corrupt: tensor data extends past the end of the file"),
    (re.compile(r"out of bounds|larger dtype|buffer is smaller"), "truncated or corrupt header: it ends before its counts say"),
    (re.compile(r"(\d+)\) is not a valid GGMLQuantizationType"), "corrupt header: unknown tensor type {0}"),
    (re.compile(r"is not a valid GGUFValueType"), "corrupt header: unknown metadata value type"),
    (re.compile(r"version (\d+)"), "unsupported GGUF version {0}"),
    (re.compile(r"duplicated tensor with name (.*)"), "corrupt header: tensor {0} appears twice"),
]


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's description; its bytes live in shard `shard` at absolute file offset `offset`."""

    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order: row length last
    n_bytes: int
    shard: int
    offset: int

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def row_length(self) -> int:
        return self.shape[-1]

    @property
    def type_name(self) -> str:
        return self.ggml_type.name


@dataclass
class GGUFModel:
    """A GGUF model: metadata from the first shard, tensors of all shards in file order."""

    shard_paths: list[Path]
    readers: list[GGUFReader]
    fields: OrderedDict[str, ReaderField]  # the first shard's key/value fields, in file order
    tensors: list[TensorInfo]

    @property
    def path(self) -> Path:
        return self.shard_paths[0]

    @functools.cached_property
    def kv(self) -> dict[str, Any]:
        """Metadata as plain Python values (first shard; split.* keys included), decoded once."""
        return {name: field_value(f) for name, f in self.fields.items() if not name.startswith("GGUF.")}

    def get(self, key: str, default: Any = None) -> Any:
        field = self.fields.get(key)
        return default if field is None else field_value(field)

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

    def tensor(self, name: str) -> TensorInfo:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)

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


def field_value(field: ReaderField) -> Any:
    """A metadata field as a Python value: str, int, float, bool, or a list of them."""
    main = field.types[0] if field.types else None
    if main == GGUFValueType.ARRAY:
        sub = field.types[-1]
        if sub == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return [field.parts[i][0].item() for i in field.data]
    if main == GGUFValueType.STRING:
        return bytes(field.parts[-1]).decode("utf-8", errors="replace")
    return field.parts[-1][0].item()


def shard_paths_for(path: Path) -> list[Path]:
    """All shards of a split set given its first shard; [path] for a single file."""
    m = SPLIT_RE.match(path.name)
    if m is None:
        return [path]
    count = int(m["count"])
    if int(m["no"]) != 1:
        raise MoeprepError(f"{path}: this is shard {int(m['no'])} of {count}; open the first shard (-00001-of-{count:05d})")
    paths = [path.with_name(f"{m['prefix']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in paths if not p.exists()]
    if missing:
        raise MoeprepError(f"{path}: split set is incomplete, missing {', '.join(missing)}")
    return paths


def _open_reader(path: Path) -> GGUFReader:
    if not path.exists():
        raise MoeprepError(f"{path}: no such file")
    if path.is_dir():
        raise MoeprepError(f"{path}: is a folder; give the path of a .gguf file")
    size = path.stat().st_size
    if size < 24:
        raise MoeprepError(f"{path}: not a GGUF file (only {size} bytes)")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise MoeprepError(f"{path}: not a GGUF file (bad magic)")
    try:
        return GGUFReader(path)
    except (ValueError, IndexError, KeyError, UnicodeDecodeError, OverflowError, TypeError, MemoryError) as e:
        raise MoeprepError(f"{path}: {_explain_reader_error(e)}") from e


def _explain_reader_error(e: Exception) -> str:
    text = str(e)
    for pattern, message in READER_ERRORS:
        m = pattern.search(text)
        if m:
            return message.format(*m.groups())
    return f"corrupt GGUF header ({type(e).__name__}: {text.splitlines()[0] if text else 'no detail'})"


def _tensor_infos(path: Path, reader: GGUFReader, shard: int) -> list[TensorInfo]:
    """Validated tensor descriptions: known types, sane shapes, data inside the file."""
    size = reader.data.shape[0]
    infos = []
    for t in reader.tensors:
        ne = [int(d) for d in t.shape]
        if not 1 <= len(ne) <= MAX_DIMS or any(d <= 0 for d in ne):
            raise MoeprepError(f"{path}: tensor {t.name} has an invalid shape {ne}")
        block, _ = GGML_QUANT_SIZES[t.tensor_type]
        if ne[0] % block:
            raise MoeprepError(f"{path}: tensor {t.name} row length {ne[0]} is not a multiple of {block} for {t.tensor_type.name}")
        if t.data_offset + t.n_bytes > size:
            raise MoeprepError(f"{path}: truncated: tensor {t.name} ends at byte {t.data_offset + t.n_bytes} of {size}")
        infos.append(TensorInfo(t.name, t.tensor_type, tuple(reversed(ne)), int(t.n_bytes), shard, int(t.data_offset)))
    return infos


def open_gguf(path: str | Path) -> GGUFModel:
    """Open a GGUF file or the first shard of a split set; raises MoeprepError on anything unreadable."""
    path = Path(path)
    paths = shard_paths_for(path)
    readers, tensors = [], []
    for i, p in enumerate(paths):
        reader = _open_reader(p)
        readers.append(reader)
        tensors += _tensor_infos(p, reader, i)
    first = readers[0]
    if len(paths) > 1:
        count = first.get_field("split.count")
        if count is None or field_value(count) != len(paths):
            raise MoeprepError(f"{path}: split.count does not match the {len(paths)} shard files")
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        raise MoeprepError(f"{path}: the same tensor name appears in more than one shard")
    return GGUFModel(shard_paths=paths, readers=readers, fields=first.fields, tensors=tensors)
