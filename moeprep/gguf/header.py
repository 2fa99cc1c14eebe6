"""Parse one GGUF file's header (metadata and tensor infos) straight from its memory map.

The layout, as the GGUF specification gives it (little endian throughout):

    magic "GGUF", version u32 (2 or 3), tensor_count u64, kv_count u64
    kv_count x     key string, value_type u32, value
    tensor_count x name string, n_dims u32, ne u64[n_dims] (row length first), ggml_type u32, offset u64
    padding to general.alignment (default 32), then the tensor data; each offset counts from its start

A string is a u64 byte count and that many UTF-8 bytes; an array is its element type u32, a u64 count and the
elements. Real vocabularies put 150k-260k strings and as many numbers in the metadata, so arrays of numbers are
numpy views of the mapped bytes, and a string array costs one pass that notes where each string starts; its
strings are decoded when first used (StringArray). Opening a 262k-token vocabulary takes a tenth of a second this
way (docs/BENCHMARKS.md); gguf-py's GGUFReader, which makes numpy objects per element, took seconds.
"""

from __future__ import annotations

import functools
import mmap
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from moeprep.errors import MoeprepError

V = GGUFValueType
MAGIC = b"GGUF"
VERSIONS = (2, 3)  # version 1 counted with u32 and is gone from every current tool
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
# Each key/value is at least a string length, a type and a one-byte value; each tensor info at least a string
# length, n_dims, one dimension, a type and an offset: counts that cannot fit the file are refused before parsing.
MIN_KV_BYTES, MIN_TENSOR_INFO_BYTES = 8 + 4 + 1, 8 + 4 + 8 + 4 + 8
U32, U64 = struct.Struct("<I"), struct.Struct("<Q")

# Numeric value types: struct format of a scalar, numpy dtype of an array's elements (arrays are views).
FORMATS: dict[GGUFValueType, tuple[str, str]] = {
    V.UINT8: ("<B", "<u1"),
    V.INT8: ("<b", "<i1"),
    V.UINT16: ("<H", "<u2"),
    V.INT16: ("<h", "<i2"),
    V.UINT32: ("<I", "<u4"),
    V.INT32: ("<i", "<i4"),
    V.UINT64: ("<Q", "<u8"),
    V.INT64: ("<q", "<i8"),
    V.FLOAT32: ("<f", "<f4"),
    V.FLOAT64: ("<d", "<f8"),
    V.BOOL: ("<?", "?"),
}
SCALAR: dict[GGUFValueType, struct.Struct] = {t: struct.Struct(s) for t, (s, _) in FORMATS.items()}
NUMERIC: dict[GGUFValueType, np.dtype] = {t: np.dtype(d) for t, (_, d) in FORMATS.items()}


class HeaderError(Exception):
    """What is wrong with a header; open_gguf prefixes the path and raises it as a MoeprepError."""


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


class StringArray(Sequence[str]):
    """A GGUF array of strings over the mapped bytes, decoded on first use.

    String i's bytes start at starts[i]; its u64 length is the 8 bytes before, so it ends 8 bytes before string
    i+1 starts (the last one at `stop`). Indexing decodes one string; `tolist` decodes all of them at once.
    """

    def __init__(self, data: np.ndarray, starts: np.ndarray, stop: int) -> None:
        self._data, self._starts, self._stop = data, starts, stop
        self._ends = np.append(starts[1:] - 8, stop).astype(np.int64) if len(starts) else starts

    def __len__(self) -> int:
        return len(self._starts)

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> list[str]: ...
    def __getitem__(self, i: int | slice) -> str | list[str]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return bytes(self._data[self._starts[i] : self._ends[i]]).decode("utf-8", errors="replace")

    def tolist(self) -> list[str]:
        """Every string, decoded from one copy of the array's bytes."""
        if not len(self):
            return []
        base = int(self._starts[0])
        raw = bytes(self._data[base : self._stop])
        return [
            raw[a:b].decode("utf-8", errors="replace")
            for a, b in zip((self._starts - base).tolist(), (self._ends - base).tolist())
        ]


@dataclass
class Field:
    """One metadata key/value: its types ([type], or [ARRAY, element type]), where its bytes lie, its contents."""

    name: str
    types: list[GGUFValueType]
    offset: int  # first byte of the key in the file
    nbytes: int  # bytes of the whole key/value
    contents: Any  # scalar: its Python value; array of numbers: a numpy view; of strings: a StringArray

    @functools.cached_property
    def value(self) -> Any:
        """The value as plain Python: str, int, float, bool, or a list of them; decoded at first use."""
        return _plain(self.contents)


def _plain(contents: Any) -> Any:
    if isinstance(contents, (np.ndarray, StringArray)):
        return contents.tolist()
    if isinstance(contents, list):  # an array of arrays
        return [_plain(c) for c in contents]
    return contents


@dataclass
class GGUFFile:
    """One parsed GGUF file: its memory map, metadata fields in file order, and validated tensor infos."""

    path: Path
    data: np.ndarray  # the whole file, uint8, read-only memory map
    version: int
    alignment: int
    data_offset: int  # where the tensor data starts
    fields: dict[str, Field]
    tensors: list[TensorInfo]

    def get_field(self, key: str) -> Field | None:
        return self.fields.get(key)


class _Cursor:
    """Reads the header front to back; every read is bounds-checked."""

    def __init__(self, buf: mmap.mmap, data: np.ndarray) -> None:
        self.buf, self.data, self.pos, self.size = buf, data, 0, len(buf)

    def need(self, n: int) -> int:
        if n < 0 or self.pos + n > self.size:
            raise HeaderError("truncated or corrupt header: it ends before its counts say")
        start = self.pos
        self.pos += n
        return start

    def unpack(self, s: struct.Struct) -> Any:
        return s.unpack_from(self.buf, self.need(s.size))[0]

    def string(self) -> str:
        n = self.unpack(U64)
        start = self.need(n)
        return self.buf[start : start + n].decode("utf-8", errors="replace")

    def value(self, vtype: int) -> tuple[Any, list[GGUFValueType]]:
        if vtype in SCALAR:
            return self.unpack(SCALAR[vtype]), [V(vtype)]
        if vtype == V.STRING:
            return self.string(), [V.STRING]
        if vtype == V.ARRAY:
            sub, count = self.unpack(U32), self.unpack(U64)
            if sub in NUMERIC:
                dtype = NUMERIC[sub]
                start = self.need(count * dtype.itemsize)
                return self.data[start : start + count * dtype.itemsize].view(dtype), [V.ARRAY, V(sub)]
            if sub == V.STRING:
                return self.strings(count), [V.ARRAY, V.STRING]
            if sub == V.ARRAY:
                items = [self.value(V.ARRAY) for _ in range(count)]
                return [c for c, _ in items], [V.ARRAY, *(items[0][1] if items else [V.ARRAY])]
        raise HeaderError(f"corrupt header: unknown metadata value type {vtype}")

    def strings(self, count: int) -> StringArray:
        """One pass over `count` strings, noting where each one's bytes start."""
        if count * 8 > self.size - self.pos:
            raise HeaderError("truncated or corrupt header: it ends before its counts say")
        starts = [0] * count
        pos, read = self.pos, U64.unpack_from
        try:
            for i in range(count):
                pos += 8
                starts[i] = pos
                pos += read(self.buf, pos - 8)[0]
        except (struct.error, OverflowError):  # a length ran past the end of the file
            pos = self.size + 1
        self.need(pos - self.pos)
        return StringArray(self.data, np.array(starts, dtype=np.int64), pos)


def _tensor_info(cur: _Cursor) -> tuple[str, list[int], int, int]:
    name = cur.string()
    n_dims = cur.unpack(U32)
    if not 1 <= n_dims <= MAX_DIMS:
        raise HeaderError(f"corrupt header: tensor {name} has {n_dims} dimensions (GGUF allows 1 to {MAX_DIMS})")
    ne = list(struct.unpack_from(f"<{n_dims}Q", cur.buf, cur.need(8 * n_dims)))
    return name, ne, cur.unpack(U32), cur.unpack(U64)


def _validated(
    name: str, ne: list[int], type_id: int, rel_offset: int, data_offset: int, alignment: int, size: int, shard: int
) -> TensorInfo:
    """Known type, sane shape, aligned, data inside the file."""
    try:
        ggml_type = GGMLQuantizationType(type_id)
    except ValueError:
        raise HeaderError(f"corrupt header: unknown tensor type {type_id} (tensor {name})") from None
    if any(d <= 0 for d in ne):
        raise HeaderError(f"tensor {name} has an invalid shape {ne}")
    block, type_size = GGML_QUANT_SIZES[ggml_type]
    if ne[0] % block:
        raise HeaderError(f"tensor {name} row length {ne[0]} is not a multiple of {block} for {ggml_type.name}")
    if rel_offset % alignment:
        raise HeaderError(f"corrupt header: tensor {name} data offset {rel_offset} is not a multiple of {alignment}")
    n_bytes = int(np.prod(ne, dtype=object)) // block * type_size  # Python ints: a corrupt shape cannot wrap
    offset = data_offset + rel_offset
    if offset + n_bytes > size:
        raise HeaderError(
            f"truncated or corrupt: tensor {name} data ends at byte {offset + n_bytes}, past the end "
            f"of the file ({size} bytes)"
        )
    return TensorInfo(name, ggml_type, tuple(reversed(ne)), n_bytes, shard, offset)


def _map(path: Path) -> tuple[mmap.mmap, np.ndarray]:
    if not path.exists():
        raise MoeprepError(f"{path}: no such file")
    if path.is_dir():
        raise MoeprepError(f"{path}: is a folder; give the path of a .gguf file")
    size = path.stat().st_size
    if size < 24:
        raise MoeprepError(f"{path}: not a GGUF file (only {size} bytes)")
    with open(path, "rb") as f:
        if f.read(4) != MAGIC:
            raise MoeprepError(f"{path}: not a GGUF file (bad magic)")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    return buf, np.frombuffer(buf, dtype=np.uint8)


def read_header(path: Path, shard: int = 0) -> GGUFFile:
    """Parse and validate the GGUF file at `path` (shard `shard` of its set); raises MoeprepError."""
    buf, data = _map(path)
    try:
        return _parse(path, buf, data, shard)
    except HeaderError as e:
        raise MoeprepError(f"{path}: {e}") from None


def _parse(path: Path, buf: mmap.mmap, data: np.ndarray, shard: int) -> GGUFFile:
    cur = _Cursor(buf, data)
    cur.need(4)  # the magic, checked by _map
    version = cur.unpack(U32)
    if version not in VERSIONS:
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        raise HeaderError(
            "big-endian GGUF files are not supported" if swapped in VERSIONS else f"unsupported GGUF version {version}"
        )
    n_tensors, n_kv = cur.unpack(U64), cur.unpack(U64)
    if n_kv * MIN_KV_BYTES + n_tensors * MIN_TENSOR_INFO_BYTES > cur.size:
        raise HeaderError(
            f"truncated or corrupt header: {n_kv} keys and {n_tensors} tensors cannot fit in {cur.size} bytes"
        )
    fields: dict[str, Field] = {}
    for _ in range(n_kv):
        start = cur.pos
        key = cur.string()
        contents, types = cur.value(cur.unpack(U32))
        if key in fields:
            raise HeaderError(f"corrupt header: key {key} appears twice")
        fields[key] = Field(key, types, start, cur.pos - start, contents)
    infos = [_tensor_info(cur) for _ in range(n_tensors)]
    alignment = fields["general.alignment"].value if "general.alignment" in fields else DEFAULT_ALIGNMENT
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise HeaderError(f"corrupt header: general.alignment {alignment} is not a power of two")
    data_offset = -(-cur.pos // alignment) * alignment
    tensors, names = [], set()
    for info in infos:
        if info[0] in names:
            raise HeaderError(f"corrupt header: tensor {info[0]} appears twice")
        names.add(info[0])
        tensors.append(_validated(*info, data_offset, alignment, cur.size, shard))
    return GGUFFile(path, data, version, alignment, data_offset, fields, tensors)
