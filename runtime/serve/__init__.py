"""`moerun serve`: an OpenAI-compatible HTTP server with continuous batching over the model's KV sequences.

protocol.py (request checks, response shapes) -> chat.py (chat template) -> scheduler.py (batching, a plain object)
-> engine.py (the one thread that owns the model) <- http.py (aiohttp routes, `serve`).
"""

from moerun.serve.http import serve

__all__ = ["serve"]
