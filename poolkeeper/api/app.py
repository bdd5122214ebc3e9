"""The ASGI app of ``poolctl serve``: the worker protocol over HTTP/JSON (docs/design.md, "Wire protocol").

``create_app`` only assembles: it puts the store, the writer (under the write gate) and the secret on
``app.state`` (what ``deps`` hands the routes), includes the routers (``protocol``,
``children``, ``probes``), the error handlers and the middlewares. No
database work happens until a request asks for it, so the port is up before the store
is and ``/readyz`` says when the store is reachable and migrated.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.routing import APIRoute
from prometheus_client import CollectorRegistry, Counter, Histogram

from core import db, shapes, tracing
from core.errors import SettingsError, TransientError
from core.settings import Settings
from poolkeeper.api import board_events, children, deps, group, lane, probes, protocol
from poolkeeper.api.waits import OfferWaits
from poolkeeper.events import events_for
from poolkeeper.http import errors
from poolkeeper.http import middleware as limits
from poolkeeper.status import redis_reader
from store import PoolStore
from tasks import collectors
from tasks.coordination import worker_redis_url

API_VERSION = "1"
# On PostgreSQL: group commits under way at once, each on a connection of its own. One: a batch's
# common case is one set statement (``worker.new_heartbeats``), so more writers only split the
# batches into more transactions (bench/api_bench.py, 8 clients: 1,062/s with one, 648/s with eight).
HEARTBEAT_WRITERS = 1


def create_app(settings: Settings, *, local_only: bool = False, store: PoolStore | None = None) -> FastAPI:
    """The app, for ``settings``. Without a server secret only a ``local_only`` app exists (no auth)."""
    if not settings.server_secret and not local_only:
        raise SettingsError("POOL_SERVER_SECRET: not set; serve only with --local-only on a loopback address")
    pool = store or server_store(settings)
    app = FastAPI(
        title=shapes.WIRE_API_TITLE,
        version=API_VERSION,
        summary="Pool workers take grants, heartbeat, deliver results and release runs over HTTP/JSON.",
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",
    )
    app.state.pool = pool
    app.state.secret = settings.server_secret or None
    # SQLite has one writer at a time. This process's writers queue on a mutex for it, instead of
    # polling the file lock in the busy handler, whose growing sleeps starve some callers for seconds
    # under load (p99 at 8 clients: 1.7 s without, under 0.1 s with; bench/api_bench.py). Other
    # processes (the plane) still meet the busy handler. PostgreSQL takes row locks: no queue.
    sqlite = pool.engine.dialect.name == "sqlite"
    gate = _OneWriter() if sqlite else contextlib.nullcontext()
    app.state.writer = deps.Writer(gate)
    writers = 1 if sqlite else HEARTBEAT_WRITERS
    app.state.heartbeats = group.GroupCommit(
        pool.heartbeats, gate, writers=writers, shard=lambda env: env.worker_ordinal
    )
    redis_url = worker_redis_url(settings)  # the plane's: the local one when none is set
    app.state.events = events_for(settings)
    app.state.offer_waits = OfferWaits(redis_url, settings.namespace, settings.offer_wait_seconds)
    app.state.metrics = registry = CollectorRegistry()
    for router in (protocol.router, children.router, board_events.router, probes.router):
        app.include_router(router)
    probes.mount_docs(app)
    errors.install(app)
    if not settings.server_secret:
        _declare_no_security(app)
    registry.register(probes.StoreGauges(pool))
    registry.register(collectors.PlaneCollector(settings, redis_reader(settings)[0]))
    requests = Counter(
        "poolkeeper_http_requests",
        "HTTP requests by route, method and status.",
        ["route", "method", "status"],
        registry=registry,
    )
    seconds = Histogram(
        "poolkeeper_http_request_seconds",
        "HTTP request latency by route.",
        ["route"],
        registry=registry,
        buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
    )
    # Outermost last: metrics see every answer, including the body limit's.
    app.add_middleware(lane.HeartbeatLane, route=_route(protocol.router, lane.PATH))
    app.add_middleware(
        limits.BodyLimit, max_bytes=settings.max_body_bytes, timeout=settings.body_timeout_seconds
    )
    if not settings.server_secret:  # no token asked of anyone: only requests addressed to loopback
        app.add_middleware(limits.LoopbackHost)
    app.add_middleware(limits.RequestMetrics, requests=requests, seconds=seconds)
    if tracing.enabled():  # outermost: the span holds the whole answer, the lane's too
        app.add_middleware(limits.TraceRequests)
    return app


class _OneWriter:
    """A mutex for SQLite writes; waiting longer than SQLite itself would is a busy store (503)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def __enter__(self) -> None:
        if not self.lock.acquire(timeout=db.SQLITE_BUSY_TIMEOUT_MS / 1000):
            raise TransientError("pool store: busy (too many writes queued in this server)")

    def __exit__(self, *_: object) -> None:
        self.lock.release()


def _route(router: APIRouter, path: str) -> APIRoute:
    found = [r for r in router.routes if isinstance(r, APIRoute) and r.path == path]
    assert len(found) == 1, path
    return found[0]


def server_store(settings: Settings) -> PoolStore:
    """The store with an engine sized for a thread pool, failing fast when the database is away."""
    options: dict[str, Any] = {"pool_size": 8, "max_overflow": 24, "pool_timeout": 5}
    if not settings.database_url.startswith("sqlite"):
        options["connect_args"] = {"connect_timeout": 5}
    return PoolStore.from_settings(settings, engine=db.make_engine(settings.database_url, **options))


def _declare_no_security(app: FastAPI) -> None:
    """A ``--local-only`` app asks no one for a token, so its schema declares no bearer scheme."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            schema.get("components", {}).pop("securitySchemes", None)
            for operations in schema.get("paths", {}).values():
                for operation in operations.values():
                    operation.pop("security", None)
        return app.openapi_schema or build()

    app.openapi = openapi  # type: ignore[method-assign]
