"""``python -m mie serve --replicas N``: N engine replicas on Ray Serve behind one ingress.

The pieces (docs/distributed.md has the picture):

* ``EngineReplica`` -- a Ray Serve deployment holding one ``LLMEngine`` and the single-process
  server's ``EngineLoop`` (its own engine thread, stop strings, per-request aborts, metrics).
  Each replica is its own Serve application with one replica, ``mie-replica-<i>``: the ingress
  must choose *which* engine runs a request (that is the point of prefix-aware routing), and
  Serve's handle to a many-replica deployment chooses for itself. Serve still owns each
  replica's life: it starts it, health-checks it (``check_health``) and starts it again when
  it dies.
* ``RayIngress`` -- the HTTP side, an ``OpenAIFrontend`` like the single-process server, so
  validation, OpenAI's shapes, SSE, body limits, timeouts and shutdown are the same code. It
  tokenizes each prompt once, asks its router (``mie.serve.router``) for an order of
  preference over the live replicas, and streams the request from the first that accepts it:
  token ids go to the replica, text deltas come back. A replica that refuses with a 503 (its
  ``--max-queue`` is full) or is dead is skipped; if none takes it, the client gets a 503
  with ``Retry-After``.
* ``Cluster`` -- starts (or joins) Ray and Serve, deploys the replicas, and removes them (and
  the Ray it started) at the end.

Faults: a client that goes away cancels its Serve call and sends the replica an abort, so
the request's blocks are freed there. A replica that dies fails the requests it was running
with a 502 ``replica_failed`` (an error event on a stream), is marked down at once (and by the
ingress's monitor, which asks every replica for its numbers every ``MONITOR_PERIOD_S``), and
routing skips it until Serve has started it again and it answers.

Ray is imported here only: the single-process server never needs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, fields
from pathlib import Path

import ray
from ray import serve
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response

from mie.engine.config import EngineConfig
from mie.serve import cluster_metrics
from mie.serve.app import (
    DEFAULT_MAX_BODY_BYTES,
    JSON,
    METRICS_MEDIA_TYPE,
    OpenAIFrontend,
    system_fingerprint,
)
from mie.serve.loop import EngineLoop, Update, check_max_queue, unavailable
from mie.serve.metrics import ServerMetrics
from mie.serve.protocol import MAX_CHOICES, APIError, Options
from mie.serve.router import ROUTERS, make_router

APP_PREFIX = "mie-replica-"
MONITOR_PERIOD_S = 0.5  # how often the ingress asks each replica for its numbers
STATS_TIMEOUT_S = 2.0  # a replica that does not answer within this is counted as down
DEPLOY_TIMEOUT_S = 600.0  # replicas must be up (model loaded) within this
END_REQUESTS_TIMEOUT_S = 30.0
DELETE_TIMEOUT_S = 30.0
REAP_TIMEOUT_S = 5.0
# Serve queues calls beyond a replica's max_ongoing_requests in the caller; the engine loop
# has its own queue and limit (--max-queue), so Serve's must never be the one that binds.
MAX_ONGOING_REQUESTS = 100_000

logger = logging.getLogger("mie.serve")


@dataclass(frozen=True)
class EngineSettings:
    """What every replica builds its engine with: the checkpoint, the engine's settings (the
    CLI's engine flags) and the replica's queue limit."""

    model_dir: str
    engine: EngineConfig = field(default_factory=EngineConfig)
    max_queue: int | None = None  # per replica

    def __post_init__(self) -> None:
        """Made in the driver, before Ray starts, so a bad setting is one clear error there
        (``EngineConfig`` checks its own when built), not a replica that fails to deploy (or,
        for ``max_queue``, one that refuses every request)."""
        check_max_queue(self.max_queue)


# -- the replica ---------------------------------------------------------------------------------
class EngineReplica:
    """One engine and its engine loop, as a Ray Serve deployment (see the module doc).

    Requests arrive as token ids (the ingress tokenized them) with their ``SamplingParams``
    and stop strings; ``generate`` yields plain dicts, because exceptions with keyword
    arguments (``APIError``) do not survive pickling: first ``{"accepted": ...}`` or
    ``{"error": ...}``, then one dict per ``Update``.
    """

    def __init__(self, index: int, settings: EngineSettings) -> None:
        from mie import LLMEngine

        self.index = index
        self.settings = s = settings
        self.engine = LLMEngine(s.model_dir, config=s.engine)
        self.metrics = ServerMetrics(Path(s.model_dir).resolve().name, index)
        self.loop = EngineLoop(self.engine, self.metrics, s.max_queue)
        self.loop.start()

    def info(self) -> dict:
        return {
            "index": self.index,
            "pid": os.getpid(),
            "max_model_len": self.engine.max_model_len,
            "eos_token_ids": self.engine.model.config.eos_token_ids,
            "vocab_size": self.engine.model.config.vocab_size,
            "sampling_defaults": self.engine.sampling_defaults,
            "block_size": self.settings.engine.block_size,
            "system_fingerprint": system_fingerprint(self.engine),
        }

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params
    ) -> AsyncIterator[dict]:
        """Run one request: its acceptance, then its updates (module doc of ``loop``)."""
        try:
            stream = self.loop.submit(request_id, None, prompt_token_ids, params)
            await stream.started
        except APIError as error:
            yield {"error": _error_to_wire(error)}
            return
        try:
            yield {"accepted": self.index}
            async for update in stream:
                yield _update_to_wire(update)
        finally:  # done, or cancelled (the client went away): a no-op once it finished
            self.loop.abort(request_id)

    def abort(self, request_id: str) -> None:
        self.loop.abort(request_id)

    def stats(self) -> dict:
        """The replica's numbers: the ingress's monitor, /health and /metrics read them."""
        e = self.metrics.engine
        return {
            "index": self.index,
            "pid": os.getpid(),
            "healthy": self.loop.healthy,
            "stalled": self.loop.stalled(),
            "metrics": self.metrics.render(),
            "running": e.running,
            "waiting": e.waiting,
            "blocks_total": e.blocks_total,
            "blocks_free": e.blocks_free,
            "blocks_cache_only": e.blocks_cache_only,
        }

    def check_health(self) -> None:
        """Serve's health check: a replica whose engine loop died is replaced."""
        if not self.loop.healthy:
            raise RuntimeError(
                f"replica {self.index}: the engine loop is not running ({self.loop.error!r})"
            )

    def end_requests(self) -> None:
        """Shutting down: every open stream ends with "abort", waiting requests get a 503."""
        self.loop.stop()

    def __del__(self) -> None:
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.stop(timeout=5.0)


def _error_to_wire(error: APIError) -> dict:
    return {
        "status": error.status,
        "message": error.message,
        "type": error.type,
        "param": error.param,
        "code": error.code,
        "headers": dict(error.headers),
    }


def _update_to_wire(update: Update) -> dict:
    """An ``Update`` as a dict of its fields, its error as a dict (see ``EngineReplica``)."""
    wire = {f.name: getattr(update, f.name) for f in fields(update)}
    wire["error"] = None if update.error is None else _error_to_wire(update.error)
    return wire


def _update_from_wire(wire: dict) -> Update:
    error = wire["error"]
    return Update(**{**wire, "error": None if error is None else _error_from_wire(error)})


def _error_from_wire(wire: dict) -> APIError:
    return APIError(
        wire["status"],
        wire["message"],
        type=wire["type"],
        param=wire["param"],
        code=wire["code"],
        headers=wire["headers"],
    )


# -- the ingress ---------------------------------------------------------------------------------
@dataclass
class ReplicaState:
    """The ingress's view of one replica."""

    index: int
    handle: object  # a Serve DeploymentHandle
    up: bool = True
    pid: int | None = None
    stalled: str | None = None  # why its engine is stuck (``EngineLoop.stalled``), if it is
    in_flight: int = 0  # requests the ingress has running on it
    routed: int = 0
    failed: int = 0


def replica_failed(index: int, exc: BaseException) -> APIError:
    return APIError(
        502,
        f"replica {index}, which was running this request, failed: {type(exc).__name__}: "
        f"{str(exc).splitlines()[0] if str(exc) else ''}",
        type="server_error",
        code="replica_failed",
    )


class RemoteStream:
    """A request running on a replica, as the frontend's handlers read it: ``Update``s.

    Whatever ends it -- its last update, an error, the client going away -- ``close`` gives
    its slot in the replica's in-flight count back exactly once.
    """

    def __init__(
        self,
        ingress: RayIngress,
        replica: ReplicaState,
        request_id: str,
        num_prompt_tokens: int,
        generator,
    ) -> None:
        self.ingress = ingress
        self.replica = replica
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self._generator = generator
        self._finished = False
        self._closed = False

    async def __aiter__(self) -> AsyncIterator[Update]:
        try:
            async for item in self._generator:
                update = _update_from_wire(item)
                self._finished = update.final
                yield update
                if update.final:
                    return
            raise RuntimeError("the replica's stream ended without a finish reason")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the replica died (ActorDiedError), or the call failed
            if self._finished:
                return
            self._finished = True
            self.ingress._lost(self.replica, exc)
            self.replica.failed += 1
            yield Update("", 0, None, replica_failed(self.replica.index, exc), final=True)
        finally:
            self.close()

    def abort(self) -> None:
        """The client went away: stop the request on its replica (blocks freed there)."""
        if not self._finished:
            self._finished = True
            self._generator.cancel()
            with contextlib.suppress(Exception):
                self.replica.handle.abort.remote(self.request_id)  # in case the cancel is late
        self.close()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.replica.in_flight -= 1


class RayIngress(OpenAIFrontend):
    """The OpenAI endpoints in front of the replicas (module doc)."""

    def __init__(
        self,
        handles: list,
        tokenizer,
        model_dir: str | Path,
        max_model_len: int,
        block_size: int,
        *,
        eos_token_ids: tuple[int, ...],
        vocab_size: int,
        sampling_defaults: dict,
        router: str = "prefix",
        model_name: str | None = None,
        api_key: str | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        system_fingerprint: str | None = None,
        max_samples_per_request: int = MAX_CHOICES,
        auto_tool_parser: str | None = None,
    ) -> None:
        super().__init__(
            tokenizer,
            model_dir,
            max_model_len,
            eos_token_ids=eos_token_ids,
            vocab_size=vocab_size,
            sampling_defaults=sampling_defaults,
            model_name=model_name,
            api_key=api_key,
            max_body_bytes=max_body_bytes,
            system_fingerprint=system_fingerprint,
            max_samples_per_request=max_samples_per_request,
            auto_tool_parser=auto_tool_parser,
        )
        self.replicas = [ReplicaState(i, h) for i, h in enumerate(handles)]
        self.router = make_router(router, range(len(handles)), block_size)
        self.rejected = 0
        self._stopping = False
        self._monitor: asyncio.Task | None = None

    # -- requests --------------------------------------------------------------------------------
    async def _start(
        self, request_id: str, text: str | None, ids: list[int], params, options: Options
    ) -> RemoteStream:
        if self._stopping:
            raise unavailable("the server is shutting down")
        live = [r.index for r in self.replicas if r.up]
        if not live:
            raise APIError(
                503,
                "no engine replica is up; retry later",
                type="server_error",
                code="no_replica",
                headers={"Retry-After": "1"},
            )
        load = {r.index: r.in_flight for r in self.replicas}
        busy = []
        for index in self.router.order(ids, live, load):
            replica = self.replicas[index]
            if not replica.up:  # marked down while we tried another
                continue
            replica.in_flight += 1
            generator = None
            try:
                generator = replica.handle.options(stream=True).generate.remote(
                    request_id, ids, params
                )
                first = await generator.__anext__()
            except asyncio.CancelledError:
                if generator is not None:
                    generator.cancel()
                replica.in_flight -= 1
                raise
            except Exception as exc:  # unreachable, or died before accepting it: nothing ran
                replica.in_flight -= 1
                self._lost(replica, exc)
                continue
            if "error" in first:
                replica.in_flight -= 1
                error = _error_from_wire(first["error"])
                if error.status == 503:  # its queue is full, or it is stopping: the next one
                    busy.append(error)
                    continue
                raise error  # the request's own fault (a 400): the same on every replica
            replica.routed += 1
            return RemoteStream(self, replica, request_id, len(ids), generator)
        if busy:
            self.rejected += 1
            raise APIError(
                503,
                f"every engine replica is busy ({len(busy)} refused: "
                f"{busy[0].message}); retry later",
                type="server_error",
                code="queue_full",
                headers={"Retry-After": "1"},
            )
        raise APIError(
            503,
            "no engine replica could take the request; retry later",
            type="server_error",
            code="no_replica",
            headers={"Retry-After": "1"},
        )

    def _abort(self, stream: RemoteStream) -> None:
        stream.abort()

    def _lost(self, replica: ReplicaState, exc: BaseException) -> None:
        """A call to ``replica`` failed: count it down until the monitor hears from it."""
        if replica.up:
            logger.warning(
                "replica %d is down (%s); routing around it until it is back",
                replica.index,
                type(exc).__name__,
            )
        replica.up = False

    # -- the monitor -----------------------------------------------------------------------------
    async def _stats(self, replica: ReplicaState) -> dict | None:
        """The replica's numbers, or None (and it is marked down) if it does not answer."""
        try:
            stats = await asyncio.wait_for(replica.handle.stats.remote(), STATS_TIMEOUT_S)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._lost(replica, exc)
            return None
        if stats["healthy"] and not replica.up:
            logger.warning("replica %d is up (pid %s)", replica.index, stats["pid"])
        replica.up, replica.pid = stats["healthy"], stats["pid"]
        replica.stalled = stats.get("stalled")
        return stats

    async def _watch(self) -> None:
        while True:
            await asyncio.gather(*(self._stats(r) for r in self.replicas))
            await asyncio.sleep(MONITOR_PERIOD_S)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette):
        self._monitor = asyncio.ensure_future(self._watch())
        try:
            yield
        finally:
            self._monitor.cancel()
            with contextlib.suppress(BaseException):
                await self._monitor

    def end_requests(self) -> None:
        """Shutting down: each replica's engine loop stops, so that every open stream ends
        with "abort" and ``[DONE]`` and every waiting request with a 503, as in the
        single-process server; new requests get a 503. Blocks until the replicas are done."""
        self._stopping = True
        calls = [r.handle.end_requests.remote() for r in self.replicas if r.up]
        for call in calls:
            with contextlib.suppress(Exception):
                call.result(timeout_s=END_REQUESTS_TIMEOUT_S)

    # -- routes ----------------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        up = sum(r.up for r in self.replicas)
        stalled = {r.index: r.stalled for r in self.replicas if r.up and r.stalled}
        replicas = {
            "up": up,
            "total": len(self.replicas),
            "down": [r.index for r in self.replicas if not r.up],
        }
        if stalled:  # only then: what a healthy cluster answers stays as it was
            replicas["stalled"] = {str(i): why for i, why in stalled.items()}
        if self._stopping or up == 0:
            why = "the server is shutting down" if self._stopping else "no engine replica is up"
            error = APIError(
                503,
                f"{why} ({up} of {len(self.replicas)} replicas up)",
                type="server_error",
                code="engine_unavailable",
            )
            return JSON({**error.body(), "replicas": replicas}, status_code=503)
        if len(stalled) == up:  # every replica that is up is stuck: nothing is served
            index, why = next(iter(stalled.items()))
            error = APIError(
                503,
                f"every engine replica is stuck (replica {index}: {why})",
                type="server_error",
                code="engine_stalled",
            )
            return JSON({**error.body(), "replicas": replicas}, status_code=503)
        status = "ok" if up == len(self.replicas) and not stalled else "degraded"
        return JSON({"status": status, "replicas": replicas})

    async def metrics_text(self, request: Request) -> Response:
        stats = await asyncio.gather(*(self._stats(r) for r in self.replicas))
        texts = {s["index"]: s["metrics"] for s in stats if s is not None}
        counts = cluster_metrics.IngressCounts(
            up={r.index: r.up for r in self.replicas},
            routed={r.index: r.routed for r in self.replicas},
            failed={r.index: r.failed for r in self.replicas},
            rejected=self.rejected,
            fallbacks=getattr(self.router, "fallbacks", 0),
        )
        merged = cluster_metrics.merge(texts, self.model_name)
        families = {**merged, **cluster_metrics.ingress_families(counts)}
        return Response(cluster_metrics.render(families), media_type=METRICS_MEDIA_TYPE)


# -- the cluster ---------------------------------------------------------------------------------
class Cluster:
    """Ray, Serve and the replicas: ``start``, then ``ingress(...)``, then ``shutdown``.

    Without ``address`` a local Ray instance is started (with ``num_cpus`` CPUs, default all)
    and stopped by ``shutdown``; with one (``ray start --head``'s address, or ``auto``) the
    running cluster is joined and only mie's applications are removed at the end.
    """

    def __init__(
        self,
        settings: EngineSettings,
        replicas: int,
        *,
        address: str | None = None,
        num_cpus: int | None = None,
        log_to_driver: bool = True,
    ) -> None:
        if replicas < 1:
            raise ValueError(f"--replicas must be at least 1, got {replicas}")
        if settings.max_queue is not None and settings.max_queue < 1:
            raise ValueError(f"max_queue must be at least 1, got {settings.max_queue}")
        self.settings = settings
        self.num_replicas = replicas
        self.address = address
        self.num_cpus = num_cpus
        self.log_to_driver = log_to_driver
        self.handles: list = []
        self.info: list[dict] = []
        self._started_ray = False

    @property
    def app_names(self) -> list[str]:
        return [f"{APP_PREFIX}{i}" for i in range(self.num_replicas)]

    def start(self) -> Cluster:
        from ray.serve.api import RunTarget, run_many

        if not ray.is_initialized():
            ray.init(
                address=self.address or "local",
                num_cpus=None if self.address else self.num_cpus,
                include_dashboard=False,
                log_to_driver=self.log_to_driver,
                configure_logging=False,
            )
            self._started_ray = self.address is None
        serve.start(  # no Serve HTTP proxy: the ingress is mie's own HTTP server
            proxy_location="Disabled", logging_config={"log_level": "WARNING"}
        )
        cpus = ray.cluster_resources().get("CPU", 1.0)
        deployment = serve.deployment(
            EngineReplica,
            name="engine",
            max_ongoing_requests=MAX_ONGOING_REQUESTS,
            health_check_period_s=2.0,
            health_check_timeout_s=30.0,
            graceful_shutdown_timeout_s=5.0,
            ray_actor_options={"num_cpus": min(1.0, cpus / self.num_replicas)},
            logging_config={"enable_access_log": False, "log_level": "WARNING"},
        )
        targets = [
            RunTarget(target=deployment.bind(i, self.settings), name=name, route_prefix=None)
            for i, name in enumerate(self.app_names)
        ]
        try:
            self.handles = run_many(targets)
            self.info = [h.info.remote().result(timeout_s=DEPLOY_TIMEOUT_S) for h in self.handles]
        except BaseException:
            self.shutdown()
            raise
        return self

    def ingress(self, tokenizer, *, router: str = "prefix", **settings) -> RayIngress:
        """An ingress over the replicas; ``settings`` are ``RayIngress``'s keywords."""
        if router not in ROUTERS:
            raise ValueError(f"unknown router {router!r}; choose one of {', '.join(ROUTERS)}")
        return RayIngress(
            self.handles,
            tokenizer,
            self.settings.model_dir,
            self.info[0]["max_model_len"],
            self.settings.engine.block_size,
            eos_token_ids=self.info[0]["eos_token_ids"],
            vocab_size=self.info[0]["vocab_size"],
            sampling_defaults=self.info[0]["sampling_defaults"],
            router=router,
            system_fingerprint=self.info[0]["system_fingerprint"],
            max_samples_per_request=self.settings.engine.max_samples_per_request,
            **settings,
        )

    def replica_pids(self) -> list[int]:
        return [h.stats.remote().result(timeout_s=STATS_TIMEOUT_S * 5)["pid"] for h in self.handles]

    def shutdown(self) -> None:
        """Remove the replicas; stop Ray too when this process started it.

        A local Ray is stopped with ``ray.shutdown`` (Serve's own graceful shutdown can wait
        forever on a raylet that a terminal's Ctrl-C already killed); any process this one
        started that outlives it by ``REAP_TIMEOUT_S`` -- a worker whose raylet died under it
        -- is killed, so that nothing is left behind. On a joined cluster only mie's
        applications are deleted, each within ``DELETE_TIMEOUT_S``.
        """
        if not ray.is_initialized():
            return
        if not self._started_ray:
            for name in self.app_names:
                _bounded(lambda name=name: serve.delete(name), DELETE_TIMEOUT_S)
            return
        started = _descendants(os.getpid())
        # Every stream has had its last chunk by now, but Serve's router may still hold the
        # replicas' response generators, whose callbacks then fire into a disconnected worker
        # and log a traceback ("failed to consume generator ref"): a race inside Ray's own
        # teardown that loses nothing. This process is ending Ray, so Serve's log goes quiet.
        logging.getLogger("ray.serve").setLevel(logging.CRITICAL)
        try:
            ray.shutdown()
        finally:
            _reap(started, REAP_TIMEOUT_S)


def _bounded(fn, timeout: float) -> None:
    """Call ``fn`` in a daemon thread; give up on it (logged) after ``timeout`` seconds."""
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        logger.warning("gave up waiting %.0fs for %s", timeout, fn)


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux's /proc; elsewhere none are known)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _reap(pids: list[int], timeout: float) -> None:
    """Wait up to ``timeout`` for ``pids`` to exit, then SIGKILL those that have not."""
    deadline = time.monotonic() + timeout
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _running(p)]
        time.sleep(0.1)
    for pid in alive:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
            logger.warning("killed process %d, left running after Ray's shutdown", pid)


def _running(pid: int) -> bool:
    """Alive and not a zombie (a zombie has exited; only its parent's wait is missing)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def run(args, engine: EngineConfig) -> int:
    """``python -m mie serve --replicas N ...``: serve until SIGINT/SIGTERM, then clean up.
    ``engine``: every replica's engine settings (``mie.cli.engine_config``)."""
    from mie.engine.tokenizer import Tokenizer
    from mie.serve import server

    settings = EngineSettings(str(Path(args.model).resolve()), engine, args.max_queue)
    tokenizer = Tokenizer(settings.model_dir)  # a bad checkpoint fails here, before Ray starts
    cluster = Cluster(settings, args.replicas, address=args.ray_address)
    started = time.perf_counter()
    cluster.start()
    try:
        ingress = cluster.ingress(
            tokenizer,
            router=args.router,
            model_name=args.served_model_name,
            api_key=args.api_key,
            max_body_bytes=args.max_body_bytes,
            auto_tool_parser=args.auto_tool_parser,
        )
        logger.warning(
            "%d replicas of %s on Ray (%s routing), up in %.1fs; listening on http://%s:%d",
            args.replicas,
            settings.model_dir,
            args.router,
            time.perf_counter() - started,
            args.host,
            args.port,
        )
        timeouts = server.Timeouts(
            args.timeout_keep_alive, args.timeout_request, args.shutdown_grace
        )
        server.run(ingress.app(), args.host, args.port, timeouts)
    finally:
        cluster.shutdown()
    return 0
