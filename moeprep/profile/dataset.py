"""Calibration text: a Hugging Face dataset or local files, tokenized and cut into ctx-token chunks.

Everything goes through `datasets`: a Hub name with `load_dataset(name, config, split)` (from the local cache when
offline), a local file with the builder its extension calls for, a folder with `load_from_disk` when
`save_to_disk` wrote it, else `load_dataset(folder)`, which reads a folder of data files or a downloaded dataset
repository. Rows are joined into one text stream, each ending in a newline, and tokenized a piece at a time until
there are enough tokens. The stream is cut into chunks of ctx tokens as llama-imatrix does: a chunk's first token
is replaced by BOS when the model adds one, and the incomplete tail is dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moeprep.errors import MoeprepError

DEFAULT_CONFIGS = {"wikitext": "wikitext-2-raw-v1", "Salesforce/wikitext": "wikitext-2-raw-v1"}
# extension -> (datasets builder, its options); .txt keeps line breaks so the joined rows are the file's text
LOCAL_BUILDERS: dict[str, tuple[str, dict[str, Any]]] = {
    ".txt": ("text", {"keep_linebreaks": True}),
    ".raw": ("text", {"keep_linebreaks": True}),  # wikitext's own wiki.train.raw
    ".jsonl": ("json", {}),
    ".json": ("json", {}),
    ".parquet": ("parquet", {}),
}
SAVED_DATASET_FILES = ("dataset_dict.json", "state.json")  # what Dataset(Dict).save_to_disk leaves in a folder
PIECE_CHARS = 1 << 16  # characters of text tokenized per call
ROW_BATCH = 1024
LOCAL_HINT = "pass a local file or folder: --dataset wiki.train.raw (.txt, .jsonl, .parquet or a folder of them)"

Encode = Callable[[str, bool], list[int]]  # (text, add_bos) -> token ids


@dataclass(frozen=True)
class DatasetSpec:
    name: str  # Hugging Face dataset name, or a local file or folder
    config: str | None = None  # None: DEFAULT_CONFIGS or the dataset's default
    split: str = "train"
    text_column: str = "text"

    @property
    def local(self) -> Path | None:
        path = Path(self.name).expanduser()
        return path if path.exists() else None

    @property
    def resolved_config(self) -> str | None:
        return self.config if self.config or self.local else DEFAULT_CONFIGS.get(self.name)


def load_rows(spec: DatasetSpec) -> Any:
    """The split as a `datasets.Dataset`; every failure becomes one MoeprepError saying what to do."""
    import datasets
    from datasets.exceptions import DatasetsError

    path = spec.local
    try:
        if path is None:
            if Path(spec.name).suffix in LOCAL_BUILDERS or spec.name.startswith((".", "/", "~")):
                raise MoeprepError(f"{spec.name}: no such file; check the path")
            return datasets.load_dataset(spec.name, spec.resolved_config, split=spec.split)
        if path.is_dir():
            if any((path / f).exists() for f in SAVED_DATASET_FILES):
                loaded = datasets.load_from_disk(str(path))
                return loaded[spec.split] if isinstance(loaded, datasets.DatasetDict) else loaded
            return datasets.load_dataset(str(path), spec.config, split=spec.split)
        if path.suffix not in LOCAL_BUILDERS:
            raise MoeprepError(
                f"{path}: unknown text file type {path.suffix!r}; use one of {', '.join(LOCAL_BUILDERS)}"
            )
        builder, options = LOCAL_BUILDERS[path.suffix]
        return datasets.load_dataset(builder, data_files=str(path), split="train", **options)
    except ConnectionError as e:
        raise MoeprepError(
            f"{spec.name}: not in the local Hugging Face cache and the Hub cannot be reached "
            f"({e}); run once online to cache it (HF_HUB_OFFLINE=1 then skips the Hub), "
            f"or {LOCAL_HINT}"
        ) from e
    except (DatasetsError, FileNotFoundError, ValueError, KeyError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise MoeprepError(
            f"{spec.name}: cannot load this dataset ({reason}); check the name, --dataset-config and "
            f"--split, or {LOCAL_HINT}"
        ) from e


def text_pieces(rows: Any, column: str, where: str) -> Iterator[str]:
    """Rows joined into one stream (each ending in a newline), yielded in pieces of about PIECE_CHARS."""
    if column not in rows.column_names:
        texts = [n for n, f in rows.features.items() if getattr(f, "dtype", None) in ("string", "large_string")]
        raise MoeprepError(f"{where}: no column {column!r}; pass --text-column, one of: {', '.join(texts) or '(none)'}")
    piece: list[str] = []
    size = 0
    for batch in rows.iter(batch_size=ROW_BATCH):
        for text in batch[column]:
            if not text:
                continue
            text = text if text.endswith("\n") else text + "\n"
            piece.append(text)
            size += len(text)
            if size >= PIECE_CHARS:
                yield "".join(piece)
                piece, size = [], 0
    if piece:
        yield "".join(piece)


def tokenize(pieces: Iterator[str], encode: Encode, add_bos: bool, max_tokens: int | None) -> np.ndarray:
    """Token ids of the stream (BOS first when the model adds one), stopping once max_tokens are there."""
    tokens: list[int] = []
    for i, piece in enumerate(pieces):
        tokens += encode(piece, add_bos and i == 0)
        if max_tokens is not None and len(tokens) >= max_tokens:
            break
    return np.asarray(tokens, np.int64)


def make_chunks(tokens: np.ndarray, ctx: int, bos_id: int | None, max_chunks: int | None = None) -> np.ndarray:
    """[C, ctx] chunks; the first token of each becomes BOS when bos_id is given."""
    n = len(tokens) // ctx if max_chunks is None else min(max_chunks, len(tokens) // ctx)
    chunks = tokens[: n * ctx].reshape(n, ctx).copy()
    if bos_id is not None:
        chunks[:, 0] = bos_id
    return chunks


def calibration_chunks(
    spec: DatasetSpec, encode: Encode, bos_id: int | None, ctx: int, max_chunks: int | None
) -> np.ndarray:
    """Load, tokenize and chunk; bos_id None when the model does not add BOS."""
    pieces = text_pieces(load_rows(spec), spec.text_column, spec.name)
    tokens = tokenize(pieces, encode, bos_id is not None, None if max_chunks is None else max_chunks * ctx)
    chunks = make_chunks(tokens, ctx, bos_id, max_chunks)
    if len(chunks) == 0:
        raise MoeprepError(
            f"{spec.name}: only {len(tokens)} tokens, less than one chunk of --ctx {ctx}; "
            "use a smaller --ctx or more text"
        )
    return chunks
