"""Recipes: one TOML file per model family saying how `moeprep prepare` quantizes, calibrates and publishes it.

The dataclasses below are the schema: a section's fields are the keys it may hold and their annotations the TOML
types; a key left out takes the field's default. Loading checks the types first (an unknown key or a wrong type is
one MoeprepError naming the key), then the values through CHECKS, which reuse the parsers the commands use, so a
recipe that loads is one that `moeprep quantize`, `profile` and `publish` accept. Format: docs/recipes.md.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from huggingface_hub.utils import HFValidationError, validate_repo_id

from moeprep.errors import MoeprepError
from moeprep.gguf.roles import ROLE_TABLES
from moeprep.quant.plan import parse_rule, parse_type
from moeprep.units import parse_size


@dataclass(frozen=True)
class QuantizeSettings:
    attn: str = "Q4_K"  # type of every attention tensor (moeprep quantize --attn)
    imatrix: bool = True  # compute an importance matrix in the calibration pass and quantize with it
    types: tuple[str, ...] = ()  # REGEX=TYPE rules, first match wins (moeprep quantize --type)


@dataclass(frozen=True)
class CalibrationSettings:
    dataset: str = "wikitext"  # Hugging Face dataset name, or a local .txt/.jsonl/.parquet file or folder
    config: str | None = None  # dataset configuration (None: moeprep's default for the dataset)
    split: str = "train"
    text_column: str = "text"
    ctx: int = 512  # tokens per chunk
    chunks: int = 200  # chunks run, held-out ones included
    holdout: float = 0.2  # share of the chunks kept out of the counts to judge the profile


@dataclass(frozen=True)
class PublishSettings:
    base_model: str | None = None  # Hugging Face repo the GGUF was made from (usually given per model: --base-model)
    quantized_by: str | None = None
    license: str | None = None  # None: the GGUF's general.license
    language: tuple[str, ...] = ()  # empty: the GGUF's general.languages
    tags: tuple[str, ...] = ()  # added to the card's tags (gguf, moe and the architecture are always there)
    split_max_size: str | None = None  # None: publish's default, under the Hub's 50 GB file limit


SECTIONS: dict[str, type] = {
    "quantize": QuantizeSettings,
    "calibration": CalibrationSettings,
    "publish": PublishSettings,
}


@dataclass(frozen=True)
class Recipe:
    name: str  # the family, as the model card names it
    arch: str  # GGUF general.architecture of the models it is for (Mixtral: llama)
    quantize: QuantizeSettings = field(default_factory=QuantizeSettings)
    calibration: CalibrationSettings = field(default_factory=CalibrationSettings)
    publish: PublishSettings = field(default_factory=PublishSettings)
    path: Path | None = None  # the file it was read from
    overrides: dict[str, Any] = field(default_factory=dict)  # dotted key -> value given on the command line


# TOML value checks by annotation: (accepts, what to write instead). `X | None` is checked as X.
VALUE_TYPES: dict[Any, tuple[Callable[[Any], bool], str]] = {
    str: (lambda v: isinstance(v, str), "a string"),
    int: (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    float: (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number"),
    bool: (lambda v: isinstance(v, bool), "true or false"),
    tuple[str, ...]: (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of strings"),
}
# Top-level keys: what each is for (both required, both strings).
TOP_LEVEL = {"name": "the family name the model card shows", "arch": "the GGUF general.architecture it is for"}


def _check_arch(v: str) -> None:
    if v not in ROLE_TABLES:
        raise MoeprepError(f"{v!r} is not an architecture moeprep knows; one of {', '.join(ROLE_TABLES)}")


def _check_at_least(n: int | float) -> Callable[[Any], None]:
    def check(v: int | float) -> None:
        if v < n:
            raise MoeprepError(f"{v} is below {n}")

    return check


def _check_holdout(v: float) -> None:
    if not 0 <= v < 1:
        raise MoeprepError(f"{v} is not in [0, 1): it is the share of the chunks held out")


def _check_repo_id(v: str) -> None:
    try:
        validate_repo_id(v)
    except HFValidationError as e:
        raise MoeprepError(f"{v!r} is not a Hugging Face repo id; write it as ORG/NAME") from e


# Value checks by dotted key: each raises MoeprepError saying what is wrong with the value.
CHECKS: dict[str, Callable[[Any], Any]] = {
    "arch": _check_arch,
    "quantize.attn": parse_type,
    "quantize.types": lambda rules: [parse_rule(r) for r in rules],
    "calibration.ctx": _check_at_least(2),
    "calibration.chunks": _check_at_least(1),
    "calibration.holdout": _check_holdout,
    "publish.base_model": _check_repo_id,
    "publish.split_max_size": parse_size,
}


def _hint(annotation: Any) -> Any:
    """`str | None` -> str; anything else unchanged."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        (inner,) = [a for a in typing.get_args(annotation) if a is not type(None)]
        return inner
    return annotation


def _typed(where: str, key: str, value: Any, annotation: Any) -> Any:
    accepts, what = VALUE_TYPES[_hint(annotation)]
    if not accepts(value):
        raise MoeprepError(f"{where}: {key} must be {what}, not {type(value).__name__} {value!r}")
    return tuple(value) if isinstance(value, list) else value


def _section(where: str, name: str, cls: type, raw: Any) -> Any:
    if not isinstance(raw, dict):
        raise MoeprepError(f"{where}: {name} must be a table ([{name}]), not {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    unknown = sorted(raw.keys() - hints.keys())
    if unknown:
        raise MoeprepError(f"{where}: unknown key {name}.{unknown[0]}; [{name}] takes {', '.join(hints)}")
    return cls(**{k: _typed(where, f"{name}.{k}", v, hints[k]) for k, v in raw.items()})


# Overriding the first key drops the file's value of the others, which only make sense with the file's value:
# another dataset does not have wikitext's configuration.
OVERRIDE_RESETS = {"calibration.dataset": ("calibration.config",)}


def _apply_overrides(where: str, raw: dict[str, Any], overrides: Mapping[str, Any]) -> None:
    for key, resets in OVERRIDE_RESETS.items():
        for reset in resets:
            section, _, name = reset.rpartition(".")
            if key in overrides and reset not in overrides and isinstance(raw.get(section), dict):
                raw[section].pop(name, None)
    for key, value in overrides.items():
        section, _, name = key.rpartition(".")
        if section not in SECTIONS or name not in typing.get_type_hints(SECTIONS[section]):
            raise MoeprepError(f"{where}: cannot override {key}: not a recipe key")
        raw.setdefault(section, {})[name] = value


def parse_recipe(text: str, where: str, overrides: Mapping[str, Any] | None = None) -> Recipe:
    """A Recipe from TOML text; `overrides` (dotted key -> value, None ignored) replace the file's values."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise MoeprepError(f"{where}: not valid TOML ({e})") from e
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    _apply_overrides(where, raw, overrides)
    unknown = sorted(raw.keys() - TOP_LEVEL.keys() - SECTIONS.keys())
    if unknown:
        raise MoeprepError(f"{where}: unknown key {unknown[0]}; a recipe has {', '.join([*TOP_LEVEL, *SECTIONS])}")
    missing = [k for k in TOP_LEVEL if k not in raw]
    if missing:
        raise MoeprepError(f"{where}: missing key {missing[0]} ({TOP_LEVEL[missing[0]]})")
    top = {k: _typed(where, k, raw[k], str) for k in TOP_LEVEL}
    sections = {name: _section(where, name, cls, raw.get(name, {})) for name, cls in SECTIONS.items()}
    recipe = Recipe(**top, **sections, overrides=overrides)
    for key, check in CHECKS.items():
        value = _value(recipe, key)
        if value is not None:
            try:
                check(value)
            except MoeprepError as e:
                raise MoeprepError(f"{where}: {key}: {e}") from e
    return recipe


def _value(recipe: Recipe, key: str) -> Any:
    obj: Any = recipe
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def load_recipe(path: str | Path, overrides: Mapping[str, Any] | None = None) -> Recipe:
    """Read and check a recipe file (see parse_recipe)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as e:
        raise MoeprepError(f"{path}: no such recipe file; see recipes/ for one per model family") from e
    except (OSError, UnicodeDecodeError) as e:
        raise MoeprepError(f"{path}: cannot read the recipe ({e})") from e
    return dataclasses.replace(parse_recipe(text, str(path), overrides), path=path)


def recipe_text(recipe: Recipe) -> str:
    """The recipe file as published: its text (comments included), then the command-line overrides as comments,
    so the copy says exactly how the files were made."""
    assert recipe.path is not None
    text = recipe.path.read_text(encoding="utf-8")
    if not recipe.overrides:
        return text
    lines = [
        "# moeprep prepare overrode these values on the command line:",
        *(f"# {key} = {json.dumps(value)}" for key, value in recipe.overrides.items()),
    ]
    return text.rstrip("\n") + "\n\n" + "\n".join(lines) + "\n"
