"""llama.cpp importance matrices: read the GGUF format and the legacy .dat format, write the GGUF format.

GGUF (llama-imatrix's default since 2025): general.type = "imatrix", the keys imatrix.datasets (string array),
imatrix.chunk_count and imatrix.chunk_size (u32), and per weight tensor NAME two F32 tensors, sorted by name:
  NAME.in_sum2  [M, P]  sum over tokens of the squared input activation, per matrix (M experts; 1 for a dense weight)
  NAME.counts   [M, 1]  tokens seen per matrix
(with M = 1 both are stored 1-D, as ggml drops trailing unit dimensions). The importance llama-quantize uses is
in_sum2 / count per matrix, and 1 for a matrix that saw no token.

Legacy .dat: int32 n_entries; per entry int32 name_len, name, int32 ncall, int32 nval, float32[nval] values
(already averaged, times ncall); then optionally int32 chunk count, int32 len and the dataset name. The importance
is values / ncall.

Shapes: M matrices of an entry (experts), P values per row of the weight (its input width).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType, Keys

from moeprep.atomic import atomic_output
from moeprep.errors import MoeprepError

IN_SUM2_SUFFIX = ".in_sum2"
COUNTS_SUFFIX = ".counts"

# Keys llama-quantize writes into a model quantized with an imatrix (tools/quantize/quantize.cpp; gguf-py has none).
QUANTIZE_IMATRIX_FILE = "quantize.imatrix.file"
QUANTIZE_IMATRIX_DATASET = "quantize.imatrix.dataset"
QUANTIZE_IMATRIX_N_ENTRIES = "quantize.imatrix.entries_count"
QUANTIZE_IMATRIX_N_CHUNKS = "quantize.imatrix.chunks_count"

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class ImatrixEntry:
    """Raw statistics of one weight tensor."""

    sums: np.ndarray  # [M, P] float32 (legacy: [1, nval], values already scaled by ncall)
    counts: np.ndarray  # [M] int64 (legacy: [ncall])


@dataclass
class ImportanceMatrix:
    """An importance matrix file, read; `for_tensor` gives what llama-quantize hands to ggml_quantize_chunk."""

    path: str
    entries: dict[str, ImatrixEntry]
    datasets: list[str] = field(default_factory=list)
    chunk_count: int = 0
    chunk_size: int = 0
    is_legacy: bool = False

    @property
    def entry_count(self) -> int:
        return len(self.entries)

    def for_tensor(self, name: str, n_per_row: int | None = None) -> np.ndarray | None:
        """Importance for weight `name`: [P] for a dense weight, [M, P] for an expert stack; None if absent.

        A legacy file stores an expert stack flat; pass n_per_row (the weight's input width) to get [M, P] and to
        check the size, as llama-quantize does."""
        entry = self.entries.get(name)
        if entry is None:
            return None
        if self.is_legacy:
            ncall = int(entry.counts[0])
            imp = entry.sums / np.float32(ncall) if ncall > 0 else entry.sums.copy()
        else:
            count = entry.counts.astype(np.float32)[:, None]  # [M, 1]
            with np.errstate(divide="ignore", invalid="ignore"):
                imp = np.where(count > 0, entry.sums / count, np.float32(1)).astype(np.float32)
        if n_per_row is not None:
            if imp.size % n_per_row != 0:
                raise MoeprepError(
                    f"{self.path}: imatrix entry {name} has {imp.size} values, not a multiple of the "
                    f"tensor's row length {n_per_row}; the imatrix was made for another model"
                )
            imp = imp.reshape(-1, n_per_row)
        if not np.isfinite(imp).all():
            raise MoeprepError(f"{self.path}: imatrix entry {name} has NaN/Inf values; regenerate the imatrix")
        return imp[0] if imp.shape[0] == 1 else imp

    def quantize_kv(self) -> dict[str, str | int]:
        """The quantize.imatrix.* keys llama-quantize records in the model it writes, with its omissions and its
        127-byte limit on the two strings (they pass through a char[128] override)."""

        def c_str(v: str) -> str:
            return v.encode()[:127].decode(errors="ignore")

        kv: dict[str, str | int] = {QUANTIZE_IMATRIX_FILE: c_str(self.path)}
        if self.datasets:
            kv[QUANTIZE_IMATRIX_DATASET] = c_str(self.datasets[0])
        kv[QUANTIZE_IMATRIX_N_ENTRIES] = self.entry_count
        if self.chunk_count > 0:
            kv[QUANTIZE_IMATRIX_N_CHUNKS] = self.chunk_count
        return kv


def read_imatrix(path: str | os.PathLike[str]) -> ImportanceMatrix:
    """Read a GGUF or legacy .dat importance matrix (chosen by the GGUF magic, as llama.cpp does)."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise MoeprepError(f"{path}: cannot read imatrix: {e.strerror}") from e
    return _read_gguf(path) if magic == GGUF_MAGIC else _read_legacy(path)


def _field_value(reader: gguf.GGUFReader, key: str) -> object:
    f = reader.get_field(key)
    return None if f is None else f.contents()


def _read_gguf(path: str) -> ImportanceMatrix:
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # gguf-py's reader reports damage as whatever numpy or struct raised on the way
        detail = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise MoeprepError(f"{path}: corrupt GGUF imatrix ({detail}); regenerate it with llama-imatrix") from e

    gtype = _field_value(reader, Keys.General.TYPE)
    if gtype is not None and gtype != gguf.GGUFType.IMATRIX:
        raise MoeprepError(f"{path}: a GGUF of type '{gtype}', not an importance matrix; pass the imatrix file")
    datasets = _field_value(reader, Keys.IMatrix.DATASETS)
    chunk_count = _field_value(reader, Keys.IMatrix.CHUNK_COUNT)
    chunk_size = _field_value(reader, Keys.IMatrix.CHUNK_SIZE)
    if datasets is None or chunk_count is None or chunk_size is None:
        raise MoeprepError(
            f"{path}: missing imatrix metadata ({Keys.IMatrix.DATASETS}, {Keys.IMatrix.CHUNK_COUNT}, "
            f"{Keys.IMatrix.CHUNK_SIZE}); not an imatrix written by llama-imatrix"
        )

    sums: dict[str, np.ndarray] = {}
    counts: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        for suffix, table in ((IN_SUM2_SUFFIX, sums), (COUNTS_SUFFIX, counts)):
            if t.name.endswith(suffix):
                if t.tensor_type != GGMLQuantizationType.F32:
                    raise MoeprepError(f"{path}: imatrix tensor {t.name} is {t.tensor_type.name}, expected F32")
                table[t.name[: -len(suffix)]] = np.array(t.data, dtype=np.float32)
    if not sums and not counts:
        raise MoeprepError(f"{path}: no imatrix entries (no *{IN_SUM2_SUFFIX} tensors)")
    if sums.keys() != counts.keys():
        odd = sorted(sums.keys() ^ counts.keys())[0]
        raise MoeprepError(f"{path}: imatrix entry {odd} lacks its {IN_SUM2_SUFFIX} or {COUNTS_SUFFIX} tensor")

    entries = {}
    for name in sorted(sums):
        raw = counts[name].reshape(-1).astype(np.float64)
        c = (np.sign(raw) * np.floor(np.abs(raw) + 0.5)).astype(np.int64)  # llama.cpp reads counts with lround
        if sums[name].size % c.size != 0:
            raise MoeprepError(
                f"{path}: imatrix entry {name}: {sums[name].size} sums do not split into {c.size} matrices"
            )
        entries[name] = ImatrixEntry(sums[name].reshape(c.size, -1), c)
    return ImportanceMatrix(path, entries, [str(d) for d in datasets], int(chunk_count), int(chunk_size))


class _Cursor:
    """Little-endian reads from a legacy .dat buffer; running past the end is a MoeprepError."""

    def __init__(self, path: str, data: bytes):
        self.path, self.data, self.pos = path, data, 0

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise MoeprepError(f"{self.path}: not a llama.cpp imatrix (GGUF or legacy .dat): truncated at {what}")
        b = self.data[self.pos : self.pos + n]
        self.pos += n
        return b

    def int32(self, what: str) -> int:
        return struct.unpack("<i", self.take(4, what))[0]

    @property
    def left(self) -> int:
        return len(self.data) - self.pos


def _read_legacy(path: str) -> ImportanceMatrix:
    data = Path(path).read_bytes()
    cur = _Cursor(path, data)
    n_entries = cur.int32("the entry count")
    if n_entries < 1:
        raise MoeprepError(f"{path}: not a llama.cpp imatrix (GGUF or legacy .dat): entry count {n_entries}")
    entries = {}
    for i in range(n_entries):
        raw_name = cur.take(cur.int32(f"entry {i}"), f"the name of entry {i}")
        try:
            name = raw_name.decode("utf-8")
        except UnicodeDecodeError as e:
            raise MoeprepError(
                f"{path}: not a llama.cpp imatrix (GGUF or legacy .dat): entry {i} has a name that is not UTF-8"
            ) from e
        ncall = cur.int32(f"entry {name}")
        nval = cur.int32(f"entry {name}")
        if nval < 1:
            raise MoeprepError(f"{path}: not a llama.cpp imatrix: entry {name} has {nval} values")
        values = np.frombuffer(cur.take(4 * nval, f"the values of {name}"), dtype="<f4").astype(np.float32)
        entries[name] = ImatrixEntry(values.reshape(1, nval), np.array([ncall], np.int64))

    chunk_count, datasets = 0, []
    if cur.left >= 4:  # the trailer (chunk count, dataset name) is optional, as in llama.cpp's loader
        chunk_count = cur.int32("the chunk count")
        if cur.left >= 4:
            n = cur.int32("the dataset name")
            if n > 0:
                datasets.append(cur.take(n, "the dataset name").decode("utf-8", errors="replace"))
    return ImportanceMatrix(path, entries, datasets, chunk_count, 0, is_legacy=True)


def write_imatrix_gguf(
    path: str | os.PathLike[str],
    entries: dict[str, tuple[np.ndarray, np.ndarray]],
    datasets: list[str],
    chunk_count: int,
    chunk_size: int,
) -> None:
    """Write llama.cpp's GGUF imatrix, atomically (temp file in the same folder, then rename).

    entries: weight name -> (in_sum2 [M, P] or [P], counts [M]), raw sums and token counts, as llama-imatrix keeps
    them; M = 1 for a dense weight. Tensors are written sorted by name, like llama-imatrix.
    datasets must name at least one dataset: llama-quantize refuses a file without imatrix.datasets, and gguf-py
    cannot write an empty array."""
    if not datasets:
        raise ValueError("write_imatrix_gguf needs at least one dataset name (imatrix.datasets)")
    with atomic_output(path) as tmp:
        writer = gguf.GGUFWriter(tmp, arch="")
        # llama-imatrix's file has no general.architecture; GGUFWriter always queues one
        writer.kv_data[0].pop(Keys.General.ARCHITECTURE, None)
        writer.add_type(gguf.GGUFType.IMATRIX)
        writer.add_array(Keys.IMatrix.DATASETS, list(datasets))
        writer.add_uint32(Keys.IMatrix.CHUNK_COUNT, chunk_count)
        writer.add_uint32(Keys.IMatrix.CHUNK_SIZE, chunk_size)
        for name in sorted(entries):
            in_sum2, counts = entries[name]
            counts = np.asarray(counts, np.float32).reshape(-1)
            in_sum2 = np.asarray(in_sum2, np.float32).reshape(counts.size, -1)
            if counts.size == 1:  # ggml stores [P, 1] and [1, 1] as 1-D
                in_sum2, counts = in_sum2[0], counts
            else:
                counts = counts[:, None]
            writer.add_tensor(name + IN_SUM2_SUFFIX, np.ascontiguousarray(in_sum2))
            writer.add_tensor(name + COUNTS_SUFFIX, np.ascontiguousarray(counts))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
