"""Write a GGUF model derived from another one: keys kept in order, tensors kept or replaced, streamed, atomic.

Every command that writes a model (quantize, profile bake, publish) goes through `write_gguf`. Untouched key/value
fields are copied as their original bytes, so values, types and order survive exactly; tensors whose bytes do not
change are copied from the source memory map in chunks, so memory stays small whatever the model size. Output goes
to temp files beside the destination, renamed into place only when every shard is complete.

Split output follows llama.cpp's gguf-split layout: `<stem>-00001-of-0000N.gguf`, every shard carrying split.no,
split.count and split.tensors.count, the first shard carrying all other metadata.
"""

from __future__ import annotations

import errno
import os
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, Keys

from moeprep.atomic import atomic_outputs
from moeprep.errors import MoeprepError
from moeprep.gguf.reader import GGUFModel, TensorInfo

GGUF_VERSION = 3
COPY_CHUNK = 64 << 20  # bytes copied per step for untouched tensors

# struct format of each scalar value type (little endian, as GGUF is).
SCALAR_FORMATS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.FLOAT64: "<d",
    GGUFValueType.BOOL: "<?",
}
SPLIT_KEYS = (Keys.Split.LLM_KV_SPLIT_NO, Keys.Split.LLM_KV_SPLIT_COUNT, Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT)


@dataclass(frozen=True)
class FileRange:
    """Where a copied tensor's bytes already lie: a file and the absolute offset in it."""

    path: Path
    offset: int


@dataclass
class OutputTensor:
    """A tensor to write: its header fields and a callable yielding its bytes in order; `source`, when the bytes
    are a copy of a file's, lets the kernel copy them file to file instead (os.copy_file_range)."""

    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order: row length last
    chunks: Callable[[], Iterable[bytes | np.ndarray]]
    source: FileRange | None = None

    @property
    def n_bytes(self) -> int:
        block, type_size = GGML_QUANT_SIZES[self.ggml_type]
        return int(np.prod(self.shape, dtype=np.int64)) // block * type_size


@dataclass
class KVValue:
    """A metadata value with its GGUF type; `sub_type` is the element type of an ARRAY."""

    value: Any
    vtype: GGUFValueType
    sub_type: GGUFValueType | None = None


def copied_tensor(model: GGUFModel, t: TensorInfo) -> OutputTensor:
    """An output tensor that is a byte-for-byte copy of `t`: copied by the kernel, or streamed in chunks where the
    file system cannot."""
    return OutputTensor(
        t.name,
        t.ggml_type,
        t.shape,
        lambda: model.iter_bytes(t, COPY_CHUNK),
        FileRange(model.shard_paths[t.shard], t.offset),
    )


def _pack_string(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _pack_value(value: Any, vtype: GGUFValueType, sub_type: GGUFValueType | None) -> bytes:
    if vtype == GGUFValueType.STRING:
        return _pack_string(value)
    if vtype == GGUFValueType.ARRAY:
        assert sub_type is not None, "an ARRAY value needs its element type"
        head = struct.pack("<IQ", sub_type, len(value))
        if sub_type in SCALAR_FORMATS:  # fast path for numeric arrays
            return head + np.asarray(value, dtype=SCALAR_FORMATS[sub_type]).tobytes()
        return head + b"".join(_pack_value(v, sub_type, None) for v in value)
    return struct.pack(SCALAR_FORMATS[vtype], value)


def pack_kv(key: str, kv: KVValue) -> bytes:
    """One key/value field in GGUF's binary layout."""
    return _pack_string(key) + struct.pack("<I", kv.vtype) + _pack_value(kv.value, kv.vtype, kv.sub_type)


def _original_kv_bytes(model: GGUFModel) -> dict[str, bytes]:
    """The first shard's key/value fields as their exact bytes, in file order."""
    data = model.readers[0].data
    return {name: bytes(data[f.offset : f.offset + f.nbytes]) for name, f in model.fields.items()}


def _pad(n: int, align: int) -> int:
    return (align - n % align) % align


def _tensor_info_bytes(t: OutputTensor, offset: int) -> bytes:
    ne = list(reversed(t.shape))
    return (
        _pack_string(t.name)
        + struct.pack("<I", len(ne))
        + struct.pack(f"<{len(ne)}Q", *ne)
        + struct.pack("<IQ", t.ggml_type, offset)
    )


def plan_shards(tensors: list[OutputTensor], split_max_size: int | None) -> list[list[OutputTensor]]:
    """Group tensors, in order, into shards of at most split_max_size data bytes (one tensor may exceed it alone)."""
    if not split_max_size:
        return [tensors]
    shards: list[list[OutputTensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.n_bytes > split_max_size:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.n_bytes
    return shards


def shard_path(out: Path, index: int, count: int) -> Path:
    """llama.cpp's shard name for shard `index` (0-based) of `count`; the plain name when not split."""
    if count == 1:
        return out
    stem = out.name[:-5] if out.name.endswith(".gguf") else out.name
    return out.with_name(f"{stem}-{index + 1:05d}-of-{count:05d}.gguf")


def _write_shard(
    f: BinaryIO, kv_fields: list[bytes], tensors: list[OutputTensor], align: int, on_bytes: Callable[[int], None]
) -> None:
    header = struct.pack("<4sIQQ", b"GGUF", GGUF_VERSION, len(tensors), len(kv_fields))
    offsets, offset = [], 0
    for t in tensors:
        offsets.append(offset)
        offset += t.n_bytes + _pad(t.n_bytes, align)
    infos = b"".join(_tensor_info_bytes(t, o) for t, o in zip(tensors, offsets))
    meta = header + b"".join(kv_fields) + infos
    f.write(meta + b"\0" * _pad(len(meta), align))
    for t in tensors:
        if t.source is None or not _kernel_copy(f, t.source, t.n_bytes, on_bytes):
            written = 0
            for chunk in t.chunks():
                b = chunk.tobytes() if isinstance(chunk, np.ndarray) else chunk
                f.write(b)
                written += len(b)
                on_bytes(len(b))
            if written != t.n_bytes:
                raise AssertionError(f"{t.name}: wrote {written} bytes, expected {t.n_bytes}")
        f.write(b"\0" * _pad(t.n_bytes, align))


# copy_file_range's answers for "not between these files" (other file systems on old kernels, unsupported ones):
# the caller then streams the bytes through Python instead.
NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF}


def _kernel_copy(f: BinaryIO, source: FileRange, n_bytes: int, on_bytes: Callable[[int], None]) -> bool:
    """Append n_bytes of `source` to `f` inside the kernel, as `cp` does; False if this pair of files cannot."""
    f.flush()  # the kernel writes at the descriptor's offset: everything buffered must be there first
    with open(source.path, "rb", buffering=0) as src:
        offset, left = source.offset, n_bytes
        while left:
            try:
                done = os.copy_file_range(src.fileno(), f.fileno(), min(left, COPY_CHUNK), offset)
            except OSError as e:
                if e.errno in NO_KERNEL_COPY and left == n_bytes:
                    return False
                raise
            if done == 0:
                raise MoeprepError(f"{source.path}: file shrank while copying from byte {offset}")
            offset += done
            left -= done
            on_bytes(done)
    return True


def write_gguf(
    out: str | Path,
    model: GGUFModel,
    *,
    tensors: list[OutputTensor] | None = None,
    kv_set: dict[str, KVValue] | None = None,
    kv_remove: Iterable[str] = (),
    split_max_size: int | None = None,
    on_bytes: Callable[[int], None] = lambda n: None,
) -> list[Path]:
    """Write `model` to `out` with keys set/removed and tensors replaced; returns the written shard paths.

    `tensors` defaults to byte copies of the model's tensors, in order. Keys in `kv_set` that the model already has
    keep their position; new ones are appended. `on_bytes` is called with each chunk's size (progress bars).
    """
    out = Path(out)
    if tensors is None:
        tensors = [copied_tensor(model, t) for t in model.tensors]
    kv_set = dict(kv_set or {})
    drop = set(kv_remove) | set(SPLIT_KEYS)
    fields: dict[str, bytes] = {}
    for key, raw in _original_kv_bytes(model).items():
        if key in kv_set:
            fields[key] = pack_kv(key, kv_set.pop(key))
        elif key not in drop:
            fields[key] = raw
    fields.update({key: pack_kv(key, kv) for key, kv in kv_set.items()})

    shards = plan_shards(tensors, split_max_size)
    paths = [shard_path(out, i, len(shards)) for i in range(len(shards))]
    sources = {p.resolve() for p in model.shard_paths}
    for p in paths:
        if p.resolve() in sources:
            raise MoeprepError(f"{p}: refusing to overwrite the input model; choose another output path")
    if not out.parent.exists():
        raise MoeprepError(f"{out.parent}: output folder does not exist")
    align = model.alignment
    with atomic_outputs(paths) as temps:
        for i, (tmp, shard) in enumerate(zip(temps, shards)):
            kv_fields = list(fields.values()) if i == 0 else []
            if len(shards) > 1:
                kv_fields.append(pack_kv(Keys.Split.LLM_KV_SPLIT_NO, KVValue(i, GGUFValueType.UINT16)))
                kv_fields.append(pack_kv(Keys.Split.LLM_KV_SPLIT_COUNT, KVValue(len(shards), GGUFValueType.UINT16)))
                kv_fields.append(
                    pack_kv(Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT, KVValue(len(tensors), GGUFValueType.INT32))
                )
            with open(tmp, "wb") as f:
                _write_shard(f, kv_fields, shard, align, on_bytes)
    return paths
