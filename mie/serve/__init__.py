"""The OpenAI-compatible HTTP server: ``python -m mie serve`` (see docs/serving.md).

``protocol`` parses and builds OpenAI's JSON, ``chat`` renders chat templates, ``tools`` and
``tool_parsers`` handle tool calls (``tool_choice``, and the calls a model writes), ``loop`` runs
the engine in its own thread, ``metrics`` keeps Prometheus metrics (vLLM's names and mie's),
``app`` is the Starlette app tying them together, and ``server`` runs it under uvicorn.

The names below are resolved on first use, as ``mie``'s are, so importing one module of the
package (``mie.serve.router``, plain Python over plain data) loads that module alone, not
Starlette, uvicorn and the engine.
"""

from __future__ import annotations

from mie import lazy_exports

# name -> the module that defines it.
_EXPORTS = {
    "OpenAIServer": "mie.serve.app",
    "build_app": "mie.serve.app",
    "serve_in_thread": "mie.serve.server",
}

__all__ = list(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
