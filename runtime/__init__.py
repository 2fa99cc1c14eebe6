"""moerun: a GGUF Mixture-of-Experts inference engine in torch, with routing and activation hooks.

    model = moerun.load_model("model.gguf")
    ids = model.tokenizer.encode("Hello")
    for token in moerun.generate(model, ids, 32, moerun.greedy): ...
"""

from moerun.generate import generate, greedy, make_sampler
from moerun.hooks import ActivationEvent, RoutingEvent
from moerun.model import Model, load_model
from moerun.perplexity import perplexity

__all__ = ["ActivationEvent", "Model", "RoutingEvent", "generate", "greedy", "load_model", "make_sampler", "perplexity"]
