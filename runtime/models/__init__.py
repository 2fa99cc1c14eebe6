"""Architectures by GGUF general.architecture; finding one is a dict lookup."""

from __future__ import annotations

from types import ModuleType

from moeprep.errors import MoeprepError
from moerun.models import deepseek2, glm4moe, glm5_next, gpt_oss, llama, olmoe, qwen2moe, qwen3moe

ARCHS: dict[str, ModuleType] = {
    "deepseek2": deepseek2,
    "glm4moe": glm4moe,
    "glm5-next": glm5_next,
    "gpt-oss": gpt_oss,
    "llama": llama,
    "olmoe": olmoe,
    "qwen2moe": qwen2moe,
    "qwen3moe": qwen3moe,
}


def arch_module(arch: str, path: object = "") -> ModuleType:
    if arch not in ARCHS:
        raise MoeprepError(f"{path}: architecture '{arch}' is not supported; supported: {', '.join(sorted(ARCHS))}")
    return ARCHS[arch]
