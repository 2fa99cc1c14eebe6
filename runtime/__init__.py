"""moerun: a GGUF Mixture-of-Experts inference engine in torch, with routing and activation hooks.

    model = moerun.load_model("model.gguf")
    ids = model.tokenizer.encode("Hello")
    for token in moerun.generate(model, ids, 32, moerun.greedy): ...

The names below are imported on first use: `moerun --help`, and refusing a file moerun cannot run, need no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moerun.generation import generate, greedy, make_sampler
    from moerun.hooks import ActivationEvent, RoutingEvent
    from moerun.model import Model, load_model
    from moerun.perplexity import perplexity

EXPORTS = {
    "generate": "moerun.generation",
    "greedy": "moerun.generation",
    "make_sampler": "moerun.generation",
    "ActivationEvent": "moerun.hooks",
    "RoutingEvent": "moerun.hooks",
    "Model": "moerun.model",
    "load_model": "moerun.model",
    "perplexity": "moerun.perplexity",
}
__all__ = ["ActivationEvent", "Model", "RoutingEvent", "generate", "greedy", "load_model", "make_sampler", "perplexity"]
assert sorted(__all__) == sorted(EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in EXPORTS:
        raise AttributeError(f"module 'moerun' has no attribute {name!r}")
    value = getattr(importlib.import_module(EXPORTS[name]), name)
    globals()[name] = value  # also replaces the submodule attribute of the same name (moerun.perplexity)
    return value
