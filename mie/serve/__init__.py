"""The OpenAI-compatible HTTP server: ``python -m mie serve`` (see docs/serving.md).

``protocol`` parses and builds OpenAI's JSON, ``chat`` renders chat templates, ``loop`` runs
the engine in its own thread, ``metrics`` keeps Prometheus metrics (vLLM's names and mie's),
``app`` is the Starlette app tying them together, and ``server`` runs it under uvicorn.

The names below are resolved on first use, as ``mie``'s are, so importing one module of the
package (``mie.serve.router``, plain Python over plain data) loads that module alone, not
Starlette, uvicorn and the engine.
"""

from __future__ import annotations

import importlib

# name -> the module that defines it.
_EXPORTS = {
    "OpenAIServer": "mie.serve.app",
    "build_app": "mie.serve.app",
    "serve_in_thread": "mie.serve.server",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'mie.serve' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # once resolved, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
