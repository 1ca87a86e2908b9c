"""Running the app under uvicorn: in the foreground (the CLI), or in a thread (tests, bench).

Two things uvicorn does not do on its own, and a server facing real clients needs:

* **A deadline for reading a request.** uvicorn closes a connection idle *between* requests
  (``timeout_keep_alive``) but waits forever for the rest of a request that has begun, or
  for the first byte on a new connection: a client that sends half a request and stops
  (slowloris) holds its connection and socket for good. ``_DeadlineH11Protocol`` closes a
  connection whose request -- headers and body -- is not complete ``timeout_request`` seconds
  after the connection opened or the request's first byte arrived.
* **A shutdown that ends every response.** On SIGINT/SIGTERM uvicorn stops accepting, waits
  ``timeout_graceful_shutdown`` for running responses, then cancels them mid-body: a stream
  ends without its last chunk, unterminated, and the log fills with tracebacks.
  ``GracefulServer`` waits the grace period itself, then stops the engine loop, which ends
  every open stream with a ``finish_reason: "abort"`` chunk and ``data: [DONE]`` and every
  waiting non-streaming request with a 503; those last responses go out, then uvicorn's own
  shutdown finds nothing left to cancel. The process exits 0 on either signal.

  A second signal during the grace period ends the grace at once and nothing more: the engine
  loop stops and every response still gets its last chunks. (uvicorn's second SIGINT forces
  the exit instead, which cuts every running stream mid-body and logs a traceback for each.)
  A process that must die at once takes SIGKILL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType

import h11
import uvicorn
from starlette.applications import Starlette
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import HANDLED_SIGNALS

LOOPBACK = "127.0.0.1"
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 30.0
FLUSH_TIMEOUT_S = 5.0  # after the engine loop stops: time for the last chunks to go out

logger = logging.getLogger("mie.serve")


@dataclass(frozen=True)
class Timeouts:
    """The server's timeouts, in seconds (documented in docs/serving.md)."""

    keep_alive: float = 5.0  # an idle keep-alive connection is closed (uvicorn's default)
    request: float = 30.0  # a request's headers and body must arrive within this
    shutdown_grace: float = 5.0  # running requests may finish this long after a signal


def run(
    app: Starlette,
    host: str = LOOPBACK,
    port: int = 8000,
    timeouts: Timeouts = Timeouts(),
    sock: socket.socket | None = None,
) -> None:
    """Serve until SIGINT or SIGTERM; then shut down as the module doc says, and return.

    ``sock``: a socket already bound to ``host:port`` (the CLI binds it before loading the
    model, so that a port in use is reported at once); without it uvicorn binds one.
    """
    server = GracefulServer(_config(app, timeouts, host=host, port=port, log_level="info"))
    server.run(sockets=[sock] if sock is not None else None)


@contextlib.contextmanager
def serve_in_thread(
    app: Starlette, host: str = LOOPBACK, timeouts: Timeouts = Timeouts()
) -> Iterator[str]:
    """Serve ``app`` on a free port of ``host`` from a background thread; yield its base URL.

    The socket is bound here, before uvicorn starts, so the port is known and cannot be
    taken in between. Startup and shutdown are bounded by timeouts.
    """
    # proto=IPPROTO_TCP, not the default 0: asyncio disables Nagle's algorithm only on sockets
    # that say they are TCP, and with it on, a response's headers and body (two writes) wait
    # ~40 ms for the client's delayed ACK on every keep-alive exchange.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind((host, 0))
    port = sock.getsockname()[1]
    server = GracefulServer(_config(app, timeouts, log_level="warning"))
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


def _config(app: Starlette, timeouts: Timeouts, **kwargs) -> uvicorn.Config:
    protocol = type(
        "MieH11Protocol", (_DeadlineH11Protocol,), {"timeout_request": timeouts.request}
    )
    config = uvicorn.Config(
        app,
        http=protocol,
        timeout_keep_alive=timeouts.keep_alive,  # type: ignore[arg-type]  (float works)
        timeout_graceful_shutdown=FLUSH_TIMEOUT_S,  # type: ignore[arg-type]
        **kwargs,
    )
    config.mie_shutdown_grace = timeouts.shutdown_grace  # read by GracefulServer
    return config


class _DeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, plus a deadline for reading each request (see the module doc).

    The deadline is armed when the connection opens and when a new request's first bytes
    arrive, and disarmed once the request is complete (h11's client state leaves IDLE and
    SEND_BODY); it does not move while a client trickles bytes in, which is the point.
    """

    timeout_request: float = Timeouts.request

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._request_deadline: asyncio.TimerHandle | None = None
        self._arm_request_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY):
            self._arm_request_deadline()  # no-op when already armed: trickling does not help
        else:
            self._disarm_request_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_request_deadline()
        super().connection_lost(exc)

    def _arm_request_deadline(self) -> None:
        if self._request_deadline is None:
            self._request_deadline = self.loop.call_later(
                self.timeout_request, self._request_too_slow
            )

    def _disarm_request_deadline(self) -> None:
        if self._request_deadline is not None:
            self._request_deadline.cancel()
            self._request_deadline = None

    def _request_too_slow(self) -> None:
        self._request_deadline = None
        if self.transport.is_closing():
            return
        # Only a request still being read is cut off; a fully read one is the app's business.
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY):
            self.logger.info(
                "closing a connection whose request took over %ss to arrive", self.timeout_request
            )
            with contextlib.suppress(h11.LocalProtocolError):
                self.conn.send(h11.ConnectionClosed())
            self.transport.close()


class GracefulServer(uvicorn.Server):
    """uvicorn's server with mie's shutdown (see the module doc) and no re-raised signal.

    uvicorn re-raises the signal it caught once it has shut down, so that a SIGTERM still
    kills the process with it; here a signal means "shut down cleanly", and the CLI exits 0.
    A signal after the first only ends the grace period early (``hurry``): ``force_exit``,
    which would abandon running responses mid-body, is never set by a signal.
    """

    hurry = False  # a second signal arrived: end the grace period now

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit:
            self.hurry = True
        else:
            self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:  # no new connections while the grace period runs
            server.close()
        for sock in sockets or []:
            sock.close()
        for connection in list(self.server_state.connections):
            connection.shutdown()  # idle ones close; busy ones close after their response
        grace = getattr(self.config, "mie_shutdown_grace", Timeouts.shutdown_grace)
        if not await self._responses_done_within(grace, or_hurry=True):
            end_requests = _end_requests_hook(self.config)
            if end_requests is not None:
                logger.info(
                    "shutting down: ending %d open request(s) with 'abort'",
                    len(self.server_state.tasks),
                )
                await asyncio.to_thread(end_requests)
                await self._responses_done_within(FLUSH_TIMEOUT_S)
        await super().shutdown(sockets)

    async def _responses_done_within(self, seconds: float, or_hurry: bool = False) -> bool:
        """Wait until no response is running (True), at most ``seconds`` (then False); with
        ``or_hurry``, a second signal ends the wait too (the grace period, not the flush)."""
        deadline = time.monotonic() + seconds
        while self.server_state.tasks and not self.force_exit:
            if time.monotonic() >= deadline or (or_hurry and self.hurry):
                return False
            await asyncio.sleep(0.05)
        return True

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def _end_requests_hook(config: uvicorn.Config) -> Callable[[], None] | None:
    """The app's way to end every open request (``OpenAIServer`` puts it on ``app.state``)."""
    state = getattr(config.app, "state", None)
    return getattr(state, "end_requests", None)
