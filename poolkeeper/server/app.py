"""The ASGI app of ``poolctl serve``: the worker protocol over HTTP/JSON (docs/design.md, "Wire protocol").

``create_app`` only builds objects: no database work happens until a request
asks for it, so the port is up before the store is and ``/readyz`` says when
the store is reachable and migrated. Worker endpoints are plain functions, so
FastAPI runs them in its thread pool and the event loop keeps serving others
while one waits on the store. Each is one ``PoolStore`` call, whose errors
``errors.install`` maps to a status by class. A child execution's calls use
the token of its run's ordinal, or the grant's child token (``holder_of``); a
child token is refused everywhere else (``not_a_child``).
"""

# No ``from __future__ import annotations`` here: FastAPI reads the endpoints' annotations, and
# ``Caller`` is local to ``create_app``.
import contextlib
import threading
from importlib import resources
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Response
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from core import db, validate
from core.errors import InvalidInput, PoolError, SettingsError, TransientError
from core.settings import Settings
from poolkeeper import tokens
from poolkeeper.server import console, errors, limits
from poolkeeper.server.models import (
    Child,
    ChildHeartbeat,
    ChildHeartbeatResponse,
    ChildRegistration,
    ChildResult,
    DeliveryResponse,
    Envelope,
    ErrorBody,
    Grant,
    Health,
    OfferRequest,
    OfferResponse,
    ReleaseResponse,
    ResultEnvelope,
    Status,
    VanishedChild,
    VanishedResponse,
)
from poolkeeper.tokens import Principal
from store import PoolStore, lineage, queries, rows

API_VERSION = "1"
_bearer = HTTPBearer(
    auto_error=False,
    description="`poolctl token --ordinal N` (acts for ordinal N only), `poolctl token --operator`, or a"
    " grant's `child_token` (its /v1/children calls only).",
)


def _refusals(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {code: {"model": ErrorBody} for code in (*codes, 401, 413, 422)}


WORKER_REFUSALS = _refusals(403, 404, 408, 409, 503)


def create_app(settings: Settings, *, local_only: bool = False, store: PoolStore | None = None) -> FastAPI:
    """The app, for ``settings``. Without a server secret only a ``local_only`` app exists (no auth)."""
    if not settings.server_secret and not local_only:
        raise SettingsError("POOL_SERVER_SECRET: not set; serve only with --local-only on a loopback address")
    pool = store or server_store(settings)
    secret = settings.server_secret
    # SQLite has one writer at a time. This process's writers queue on a mutex for it, instead of
    # polling the file lock in the busy handler, whose growing sleeps starve some callers for seconds
    # under load (p99 at 8 clients: 1.7 s without, under 0.1 s with; bench/api_bench.py). Other
    # processes (the plane) still meet the busy handler. PostgreSQL takes row locks: no queue.
    writing = _OneWriter() if pool.engine.dialect.name == "sqlite" else contextlib.nullcontext()

    def authenticated(creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> Principal:
        if creds is None:
            raise errors.Unauthenticated("an Authorization: Bearer token is required")
        found = tokens.verify(secret, creds.credentials)
        if found is None:
            raise errors.Unauthenticated("the bearer token is not one this server issued")
        return found

    def local() -> Principal:
        return tokens.LOCAL

    caller = authenticated if secret else local  # the schema declares bearer auth only where it applies

    def not_a_child(who: Principal) -> None:
        if who.grant is not None:
            raise errors.Forbidden(
                f"a child token (of {who}) acts only on /v1/children for that grant, nothing else"
            )

    def worker_of(ordinal: int, who: Principal) -> None:
        not_a_child(who)
        if not who.acts_for(ordinal):
            raise errors.Forbidden(f"a token of {who} cannot act for ordinal {ordinal}")

    def operator(who: Annotated[Principal, Depends(caller)]) -> Principal:
        """The dependency for admin actions (the console will use it)."""
        not_a_child(who)
        if not who.is_operator:
            raise errors.Forbidden(f"a token of {who} cannot take operator actions")
        return who

    Caller = Annotated[Principal, Depends(caller)]
    v1 = APIRouter(prefix="/v1", tags=["worker protocol"])

    @v1.post("/offer", response_model=OfferResponse, responses=WORKER_REFUSALS)
    def offer(body: OfferRequest, who: Caller) -> OfferResponse:
        """Take the ordinal's grant: its assigned run, under a new fence; ``grant: null`` when none."""
        worker_of(body.ordinal, who)
        with writing:
            got = pool.offer(body.ordinal, owner=body.owner)
        if got is None:
            return OfferResponse(grant=None, lease_seconds=pool.lease_seconds)
        child = tokens.child_token(secret, got.row_id, got.fence) if secret else None
        return OfferResponse(grant=Grant.of(got, child_token=child), lease_seconds=pool.lease_seconds)

    @v1.post("/heartbeat", response_model=DeliveryResponse, responses=WORKER_REFUSALS)
    def heartbeat(body: Envelope, who: Caller) -> DeliveryResponse:
        """Extend the lease of the exact attempt and fence the envelope names."""
        worker_of(body.worker_ordinal, who)
        with writing:
            return DeliveryResponse(outcome=pool.heartbeat(body.model_dump()))

    @v1.post("/result", response_model=DeliveryResponse, responses=WORKER_REFUSALS)
    def result(body: ResultEnvelope, who: Caller) -> DeliveryResponse:
        """Deliver the run's result (``done``, or ``blocked`` with a reason); a replay is a duplicate."""
        worker_of(body.worker_ordinal, who)
        with writing:
            return DeliveryResponse(outcome=pool.accept_result(body.model_dump()))

    @v1.post("/release", response_model=ReleaseResponse, responses=WORKER_REFUSALS)
    def release(body: Envelope, who: Caller) -> ReleaseResponse:
        """Hand the run back: re-offered at once (next attempt), or ``lease_failed`` at the last one."""
        worker_of(body.worker_ordinal, who)
        with writing:
            return ReleaseResponse(outcome=pool.release(body.model_dump()))

    def holder_of(row_id: int, fence: int, field: str, who: Principal) -> None:
        """A child call acts for its run's ordinal, or for the one grant a child token names.

        A worker token's ordinal must hold the row: a row's ordinal never changes,
        so reading it before the store call is enough. A child token must name the
        request's row and fence (or epoch); the store then refuses it as stale once
        that grant has ended, as it does the ordinal's token.
        """
        if who.anyone:
            return
        if who.is_operator:
            raise errors.Forbidden(f"a token of {who} cannot act for a worker's children")
        if row_id > validate.INT32_MAX:
            raise InvalidInput(field, f"names row {row_id}, past the largest row id")
        if who.grant is not None:
            if who.grant != (row_id, fence):
                raise errors.Forbidden(
                    f"a child token of {who} cannot act for the grant of row {row_id} under fence {fence}"
                )
            return
        with pool.session(readonly=True) as s:
            ordinal = rows.get_row(s, row_id).ordinal
        worker_of(ordinal, who)

    kids = APIRouter(prefix="/v1/children", tags=["child executions"], responses=WORKER_REFUSALS)

    @kids.post("", response_model=Child)
    def register_child(body: ChildRegistration, who: Caller) -> Child:
        """Register a child under the holder's grant (or a live child of it); ``key``: idempotent."""
        holder_of(body.row_id, body.fence, "row_id", who)
        with writing:
            got = pool.register_child(body.model_dump(exclude_none=True))
        return Child(
            child_id=got.id, epoch=got.epoch, row_id=got.row_id, parent_id=got.parent_id, depth=got.depth
        )

    @kids.post("/heartbeat", response_model=ChildHeartbeatResponse)
    def child_heartbeat(body: ChildHeartbeat, who: Caller) -> ChildHeartbeatResponse:
        """A child is alive (``registered`` → ``running``); stale once it or its parent's grant ended."""
        holder_of(lineage.row_of(body.child_id), body.epoch, "child_id", who)
        with writing:
            return ChildHeartbeatResponse(outcome=pool.child_heartbeat(body.model_dump(exclude_none=True)))

    @kids.post("/result", response_model=DeliveryResponse)
    def child_result(body: ChildResult, who: Caller) -> DeliveryResponse:
        """A child's result: it and its live descendants turn terminal; the same result is a duplicate."""
        holder_of(lineage.row_of(body.child_id), body.epoch, "child_id", who)
        with writing:
            return DeliveryResponse(outcome=pool.child_result(body.model_dump()))

    @kids.post("/vanished", response_model=VanishedResponse)
    def child_vanished(body: VanishedChild, who: Caller) -> VanishedResponse:
        """The holder lost a live child's worker: it and its live descendants turn ``unknown``."""
        holder_of(body.row_id, body.fence, "row_id", who)
        with writing:
            return VanishedResponse(unknown=pool.child_vanished(body.model_dump()))

    @v1.get("/status", response_model=Status, responses=_refusals(403, 503), tags=["operator"])
    def status(_: Annotated[Principal, Depends(operator)]) -> Status:
        """Rows by state, free ordinals, quarantined rows (operator token)."""
        with pool.session(readonly=True) as s:
            return Status(
                rows=queries.counts_by_state(s),
                pool_size=pool.pool_size,
                free_ordinals=queries.free_ordinals(s, pool.pool_size),
                quarantined=queries.quarantined_count(s),
            )

    app = FastAPI(
        title="poolkeeper wire protocol",
        version=API_VERSION,
        summary="Pool workers take grants, heartbeat, deliver results and release runs over HTTP/JSON.",
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",
    )
    app.include_router(v1)
    app.include_router(kids)
    console.install(app, settings, pool)
    _add_probes(app, pool)
    _add_docs(app)
    errors.install(app)
    registry = CollectorRegistry()
    registry.register(_StoreGauges(pool))
    registry.register(console.plane_gauges(settings))
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

    @app.get("/metrics", response_class=PlainTextResponse, tags=["probes"])
    def metrics() -> Response:
        """Prometheus text: request counters and latency, rows by state (read at scrape time)."""
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    # Outermost last: metrics see every answer, including the body limit's.
    app.add_middleware(
        limits.BodyLimit, max_bytes=settings.max_body_bytes, timeout=settings.body_timeout_seconds
    )
    if not secret:  # no token asked of anyone: only requests addressed to loopback (DNS rebinding)
        app.add_middleware(limits.LoopbackHost)
    app.add_middleware(limits.RequestMetrics, requests=requests, seconds=seconds)
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


def server_store(settings: Settings) -> PoolStore:
    """The store with an engine sized for a thread pool, failing fast when the database is away."""
    options: dict[str, Any] = {"pool_size": 8, "max_overflow": 24, "pool_timeout": 5}
    if not settings.database_url.startswith("sqlite"):
        options["connect_args"] = {"connect_timeout": 5}
    return PoolStore.from_settings(settings, engine=db.make_engine(settings.database_url, **options))


def _add_probes(app: FastAPI, pool: PoolStore) -> None:
    @app.get("/healthz", response_model=Health, tags=["probes"])
    async def healthz() -> Health:
        """The process is up (no store access)."""
        return Health(status="ok")

    @app.get("/readyz", response_model=Health, responses={503: {"model": ErrorBody}}, tags=["probes"])
    def readyz() -> Health | JSONResponse:
        """The store answers and its schema is at head (`poolctl init` has run)."""
        try:
            current = db.schema_current(pool.engine, "store")
        except PoolError as err:
            return errors.error_response(503, "NotReady", f"store unreachable: {err}", {"Retry-After": "1"})
        if not current:
            return errors.error_response(
                503, "NotReady", "store schema is not at head: run `poolctl init`", {"Retry-After": "5"}
            )
        return Health(status="ready")


def _add_docs(app: FastAPI) -> None:
    """Swagger UI from the assets ``fastapi-offline`` ships: the page loads nothing from elsewhere."""
    assets = resources.files("fastapi_offline") / "static"
    app.mount("/docs/assets", StaticFiles(directory=str(assets)), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url="/openapi.json",
            title="poolkeeper wire protocol",
            swagger_js_url="/docs/assets/swagger-ui-bundle.js",
            swagger_css_url="/docs/assets/swagger-ui.css",
            swagger_favicon_url="/docs/assets/favicon.png",
            swagger_ui_parameters={"validatorUrl": None},  # no badge fetched from the validator's site
        )


class _StoreGauges(Collector):
    """The plane's store gauges (``tasks.collectors.StoreCollector``), plus whether the store answered."""

    def __init__(self, pool: PoolStore) -> None:
        from tasks.collectors import StoreCollector

        self.inner = StoreCollector(pool)

    def collect(self) -> Any:
        try:
            found = list(self.inner.collect())
        except Exception:  # a scrape never fails because the store is away: it says so instead
            found = []
        yield from found
        yield GaugeMetricFamily(
            "poolkeeper_store_up", "Whether the store answered this scrape.", value=int(bool(found))
        )
