"""Caches of the runtime: the attention KV cache (kv.py); the expert cache comes with its own issue."""
