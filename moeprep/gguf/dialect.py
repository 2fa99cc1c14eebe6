"""Fork dialects of an architecture: a fork's GGUF rewritten as mainline llama.cpp's, metadata only.

unsloth's llama.cpp fork writes GLM-5.3-Flash as `glm5next`; mainline (PR #27773) calls it `glm5-next` and refuses
the fork's name. The tensors are the same, by name and bytes; the metadata differs in the architecture name, which
every architecture key carries as its prefix, and in keys mainline reads that the fork does not write. Rewriting a
file is therefore: the new name, every `<fork>.` key renamed to `<mainline>.` with its value and type, the missing
keys added with the value that reproduces the fork's behaviour, and every tensor copied byte for byte.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gguf import GGUFValueType, Keys

from moeprep.errors import MoeprepError
from moeprep.gguf.reader import GGUFModel, field_value, open_gguf
from moeprep.gguf.writer import KVValue, write_gguf


@dataclass(frozen=True)
class Dialect:
    fork: str  # general.architecture in the fork's files
    mainline: str  # ... in mainline llama.cpp's
    # keys mainline reads that the fork does not write (without the arch prefix), with the fork's behaviour
    added: dict[str, KVValue] = field(default_factory=dict)


DIALECTS: dict[str, Dialect] = {
    d.fork: d
    for d in (
        # The fork always appends the pool still being filled to the indexer's selection; mainline makes it a key
        # (and assumes true when it is absent, so writing it changes nothing llama.cpp computes).
        Dialect("glm5next", "glm5-next", {"attention.indexer.kpool_select_tail": KVValue(True, GGUFValueType.BOOL)}),
    )
}


def field_kv(model: GGUFModel, key: str) -> KVValue:
    """A key's value with its GGUF type, ready to be written under another name."""
    f = model.fields[key]
    if f.types[0] == GGUFValueType.ARRAY and f.types[1] == GGUFValueType.ARRAY:
        raise MoeprepError(f"{model.path}: key {key} is an array of arrays, which moeprep cannot rename")
    return KVValue(field_value(f), f.types[0], f.types[1] if f.types[0] == GGUFValueType.ARRAY else None)


def rename_architecture(
    model: GGUFModel,
    out: str | Path,
    arch: str,
    added: dict[str, KVValue] | None = None,
    dropped: tuple[str, ...] = (),
    split_max_size: int | None = None,
    on_bytes: Callable[[int], None] = lambda n: None,
) -> list[Path]:
    """Write `model` as architecture `arch`: its `<arch>.` keys renamed, `added` set and `dropped` left out (both
    without the prefix), tensors copied byte for byte. Returns the written paths."""
    old = f"{model.arch}."
    prefixed = [key for key in model.fields if key.startswith(old)]
    kv_set = {Keys.General.ARCHITECTURE: KVValue(arch, GGUFValueType.STRING)}
    kv_set |= {f"{arch}.{key[len(old) :]}": field_kv(model, key) for key in prefixed if key[len(old) :] not in dropped}
    kv_set |= {f"{arch}.{key}": kv for key, kv in (added or {}).items()}
    return write_gguf(out, model, kv_set=kv_set, kv_remove=prefixed, split_max_size=split_max_size, on_bytes=on_bytes)


def to_mainline(
    source: str | Path,
    out: str | Path,
    split_max_size: int | None = None,
    on_bytes: Callable[[int], None] = lambda n: None,
) -> tuple[Dialect, list[Path]]:
    """Rewrite a fork-dialect model as mainline llama.cpp's; returns the dialect and the written paths."""
    model = open_gguf(source)
    dialect = DIALECTS.get(model.arch)
    if dialect is None:
        known = ", ".join(f"{d.fork} -> {d.mainline}" for d in DIALECTS.values())
        raise MoeprepError(
            f"{source}: architecture {model.arch!r} is not a fork dialect moeprep rewrites (known: {known})"
        )
    added = {key: kv for key, kv in dialect.added.items() if f"{model.arch}.{key}" not in model.fields}
    return dialect, rename_architecture(
        model, out, dialect.mainline, added, split_max_size=split_max_size, on_bytes=on_bytes
    )
