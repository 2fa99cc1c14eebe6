"""Architectures by GGUF general.architecture; finding one is a dict lookup."""

from __future__ import annotations

from types import ModuleType

from moeprep.errors import MoeprepError
from moerun.models import llama, olmoe, qwen2moe, qwen3moe

ARCHS: dict[str, ModuleType] = {
    "llama": llama,
    "olmoe": olmoe,
    "qwen2moe": qwen2moe,
    "qwen3moe": qwen3moe,
}


def arch_module(arch: str, path: object = "") -> ModuleType:
    if arch not in ARCHS:
        raise MoeprepError(f"{path}: architecture '{arch}' is not supported; supported: {', '.join(sorted(ARCHS))}")
    return ARCHS[arch]
