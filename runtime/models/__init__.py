"""Architectures by GGUF general.architecture; finding one is a dict lookup. An architecture's module is imported
when a model of it is loaded, so refusing a file of another architecture needs neither the modules nor torch."""

from __future__ import annotations

import importlib
from types import ModuleType

from moeprep.errors import MoeprepError

ARCHS: dict[str, str] = {  # general.architecture -> its module in moerun.models
    "afmoe": "afmoe",
    "bailingmoe2": "bailingmoe2",
    "deepseek2": "deepseek2",
    "deepseek32": "deepseek32",
    "deepseek4": "deepseek4",
    "glm4moe": "glm4moe",
    "glm-dsa": "glm_dsa",
    "glm5-next": "glm5_next",
    "dots1": "dots1",
    "ernie4_5-moe": "ernie4_5_moe",
    "gemma4": "gemma4",
    "gpt-oss": "gpt_oss",
    "granitehybrid": "granite_hybrid",
    "hunyuan-moe": "hunyuan_moe",
    "laguna": "laguna",
    "kimi-k3": "kimi_k3",
    "llama": "llama",
    "llama4": "llama4",
    "lfm2moe": "lfm2moe",
    "mimo2": "mimo2",
    "minimax-m2": "minimax_m2",
    "nemotron_h_moe": "nemotron_h_moe",
    "olmoe": "olmoe",
    "qwen2moe": "qwen2moe",
    "qwen35moe": "qwen35moe",
    "qwen3moe": "qwen3moe",
    "qwen3next": "qwen3next",
    "smallthinker": "smallthinker",
    "step35": "step35",
}


def check_arch(arch: str, path: object = "") -> None:
    if arch not in ARCHS:
        raise MoeprepError(f"{path}: architecture '{arch}' is not supported; supported: {', '.join(sorted(ARCHS))}")


def arch_module(arch: str, path: object = "") -> ModuleType:
    check_arch(arch, path)
    return importlib.import_module(f"moerun.models.{ARCHS[arch]}")
