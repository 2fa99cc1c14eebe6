"""moeprep: prepare Mixture-of-Experts GGUF models for expert-cached inference."""

__version__ = "0.1.0"
