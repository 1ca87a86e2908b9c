"""The OpenAI-compatible HTTP server: ``python -m mie serve`` (see docs/serving.md).

``protocol`` parses and builds OpenAI's JSON, ``chat`` renders chat templates, ``loop`` runs
the engine in its own thread, ``metrics`` keeps Prometheus metrics (vLLM's names and mie's),
``app`` is the Starlette app tying them together, and ``server`` runs it under uvicorn.
"""

from mie.serve.app import OpenAIServer, build_app
from mie.serve.server import serve_in_thread

__all__ = ["OpenAIServer", "build_app", "serve_in_thread"]
