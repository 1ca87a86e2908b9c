"""Running the app under uvicorn: in the foreground (the CLI), or in a thread (tests, bench)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from starlette.applications import Starlette

LOOPBACK = "127.0.0.1"
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 30.0


def run(app: Starlette, host: str = LOOPBACK, port: int = 8000) -> None:
    """Serve until Ctrl-C (uvicorn handles the signals and the graceful shutdown)."""
    uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5)


@contextmanager
def serve_in_thread(app: Starlette, host: str = LOOPBACK) -> Iterator[str]:
    """Serve ``app`` on a free port of ``host`` from a background thread; yield its base URL.

    The socket is bound here, before uvicorn starts, so the port is known and cannot be
    taken in between. Startup and shutdown are bounded by timeouts.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((host, 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="mie-http", daemon=True
    )
    thread.start()
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {host}:{port}")
            time.sleep(0.01)
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(STOP_TIMEOUT_S)
        sock.close()
