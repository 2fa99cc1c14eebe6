"""What each tensor of a MoE model is for, by architecture, and what llama.cpp's quantizer leaves alone.

The data (every MoE architecture llama.cpp knows, its role table and quantizer rules) is in
moeprep/gguf/arch_table.py; this module reads tensor names and looks them up. An architecture that is not in the
table is classified with the union of all tables, and `classify_tensors` says so.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from moeprep.gguf.arch_table import (
    ARCHITECTURES,
    DEFAULT_WINDOWS,
    KEEP_EVERYWHERE,
    KEEP_NAMES,
    MIXERS,
    NO_MIXER,
    WINDOW_RULES,
    QuantLimit,
    TensorRole,
)

__all__ = [
    "ROLE_TABLES",
    "FALLBACK_TABLE",
    "QuantLimit",
    "TensorRole",
    "TensorName",
    "attention_kinds",
    "block_mixers",
    "parse_tensor_name",
    "quant_limit",
    "role_table",
    "tensor_role",
    "window_kinds",
]

R = TensorRole
ROLE_TABLES: dict[str, dict[str, TensorRole]] = {name: arch.roles for name, arch in ARCHITECTURES.items()}
FALLBACK_TABLE: dict[str, TensorRole] = {k: v for table in ROLE_TABLES.values() for k, v in table.items()}

# blk.<i>.<base>.<suffix>, where base may itself contain dots (nextn.eh_proj).
TENSOR_NAME_RE = re.compile(r"^(?:blk\.(?P<block>\d+)\.)?(?P<base>.+?)(?:\.(?P<suffix>weight|bias|scale))?$")


@dataclass(frozen=True)
class TensorName:
    block: int | None
    base: str
    suffix: str | None


def parse_tensor_name(name: str) -> TensorName:
    m = TENSOR_NAME_RE.match(name)
    assert m is not None, name  # the pattern accepts any non-empty string
    block = m["block"]
    return TensorName(None if block is None else int(block), m["base"], m["suffix"])


def role_table(arch: str) -> tuple[dict[str, TensorRole], bool]:
    """The role table for `arch` and whether it is known (False: the name-pattern fallback)."""
    table = ROLE_TABLES.get(arch)
    return (table, True) if table is not None else (FALLBACK_TABLE, False)


def tensor_role(name: str, table: dict[str, TensorRole]) -> TensorRole:
    return table.get(parse_tensor_name(name).base, R.OTHER)


def quant_limit(arch: str, name: str) -> QuantLimit | None:
    """The quantizer's limit on tensor `name` of an `arch` model, None where its role alone decides.

    KEEP where llama.cpp's tensor_allows_quantization refuses the name (it does not end in "weight", or it holds one
    of the substrings it lists, some for one architecture only); Q8_0_FLOOR where llama_tensor_get_type_impl keeps
    it at Q8_0 or better for the architecture (src/llama-quant.cpp)."""
    spec = ARCHITECTURES.get(arch)
    keep = KEEP_EVERYWHERE + (spec.keep if spec else ())
    if not name.endswith("weight") or name in KEEP_NAMES or any(s in name for s in keep):
        return QuantLimit.KEEP
    if spec and any(s in name for s in spec.q8_0_floor):
        return QuantLimit.Q8_0_FLOOR
    return None


def attention_kinds(arch: str, metadata: dict[str, object]) -> dict[str, list[int]]:
    """Blocks by attention kind for a hybrid architecture ({"KDA": [0, 1, 2, 4, ...], "DSA": [3, ...]}), else {}."""
    spec = ARCHITECTURES.get(arch)
    key, names = (spec.attention_kinds if spec else None) or ("", {})
    per_block = metadata.get(f"{arch}.{key}")
    if not isinstance(per_block, list):
        return {}
    kinds: dict[str, list[int]] = {}
    for block, value in enumerate(per_block):
        kinds.setdefault(names.get(value, str(value)), []).append(block)
    return kinds


def window_kinds(arch: str, metadata: dict[str, object], n_layer: int) -> dict[str, list[int]]:
    """The decoder's blocks by how far back they attend, {"sliding 4096": [0, 1, 2, 4, ...], "full": [3, ...]} (llama4:
    "chunked 8192"), as the arch's loader reads attention.sliding_window and attention.sliding_window_pattern (a
    per-block list, or a period: arch_table.WindowRule); {} when every block attends the same way."""
    rule = WINDOW_RULES.get(arch, DEFAULT_WINDOWS)
    window = metadata.get(f"{arch}.attention.sliding_window")
    if rule.chunk:  # no key: chunks; a key of 0: none
        if window is not None and int(window) == 0:
            return {}
        chunked = [(block + 1) % rule.full_every != 0 for block in range(n_layer)]
        return _split_blocks(chunked, f"chunked {rule.chunk}")
    if rule.window < 0 or not window or int(window) <= 0:
        return {}
    pattern = metadata.get(f"{arch}.attention.sliding_window_pattern", rule.period)
    if isinstance(pattern, list):
        sliding = [bool(p) for p in pattern[:n_layer]]
    else:
        n = int(pattern)
        offset = 0 if rule.full_first else n - 1  # where the full block sits in each period
        sliding = [n == 0 or block % n != offset for block in range(n_layer)]
    return _split_blocks(sliding, f"sliding {rule.window or int(window)}")


def _split_blocks(recent: list[bool], name: str) -> dict[str, list[int]]:
    kinds = {name: [b for b, r in enumerate(recent) if r], "full": [b for b, r in enumerate(recent) if not r]}
    return kinds if all(kinds.values()) else {}


def block_mixers(names: list[str], n_layer: int) -> dict[str, list[int]]:
    """Blocks by token mixer, told by their tensors (arch_table.MIXERS), for a model that mixes kinds
    ({"Mamba": [0, 1, 3, ...], "attention": [2, ...]}); {} when every block runs the same one."""
    bases: dict[int, set[str]] = {}
    for name in names:
        parsed = parse_tensor_name(name)
        if parsed.block is not None:
            bases.setdefault(parsed.block, set()).add(parsed.base)
    kinds: dict[str, list[int]] = {}
    for block in range(n_layer):
        have = bases.get(block, set())
        kind = next((kind for kind, marks in MIXERS if have & set(marks)), NO_MIXER)
        kinds.setdefault(kind, []).append(block)
    return kinds if len(kinds) > 1 else {}
