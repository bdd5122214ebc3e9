"""The routes a deployment probes and reads: ``/healthz``, ``/readyz``, ``/metrics``, ``/v1/status``, docs."""

# No ``from __future__ import annotations``: FastAPI reads the endpoints' annotations.
import time
from importlib import resources
from typing import Any

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from core import db, shapes
from core.errors import PoolError
from poolkeeper.api.deps import Pool, Reader
from poolkeeper.api.models import Status
from poolkeeper.http import errors
from poolkeeper.http.errors import ErrorBody, Health, refusals
from store import PoolStore, numbers
from tasks.collectors import StoreCollector

router = APIRouter()


@router.get("/healthz", response_model=Health, tags=["probes"])
async def healthz() -> Health:
    """The process is up (no store access)."""
    return Health(status="ok")


@router.get("/readyz", response_model=Health, responses={503: {"model": ErrorBody}}, tags=["probes"])
def readyz(pool: Pool) -> Health | JSONResponse:
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


@router.get("/metrics", response_class=PlainTextResponse, tags=["probes"])
def metrics(request: Request) -> Response:
    """Prometheus text: request counters and latency, rows by state (read at scrape time)."""
    return Response(generate_latest(request.app.state.metrics), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/status", response_model=Status, responses=refusals(403, 503), tags=["operator"])
def status(_: Reader, pool: Pool) -> Status:
    """Rows by state, free ordinals, quarantined rows, worker presence, dispatch (operator or viewer)."""
    with pool.session(readonly=True) as s:
        found = numbers.read(s, pool.pool_size)
    now = time.time()
    return Status(
        rows=found.rows,
        pool_size=found.pool_size,
        free_ordinals=found.free_ordinals,
        quarantined=found.quarantined,
        ordinals_without_worker=found.without_worker(now, pool.lease_seconds),
        waiting_assigned=[w.id for w in found.waiting_assigned(now, pool.lease_seconds)],
        worker_states=[s.value for s in found.worker_states(now, pool.lease_seconds).values()],
        dispatch_paused=found.dispatch.paused,
        paused_boards=list(found.paused_boards),
    )


@router.get("/docs", include_in_schema=False)
async def docs() -> HTMLResponse:
    """Swagger UI from the assets ``fastapi-offline`` ships (``mount_docs``): nothing from elsewhere."""
    return get_swagger_ui_html(
        openapi_url="/openapi.json",
        title=shapes.WIRE_API_TITLE,
        swagger_js_url="/docs/assets/swagger-ui-bundle.js",
        swagger_css_url="/docs/assets/swagger-ui.css",
        swagger_favicon_url="/docs/assets/favicon.png",
        swagger_ui_parameters={"validatorUrl": None},  # no badge fetched from the validator's site
    )


def mount_docs(app: FastAPI) -> None:
    assets = resources.files("fastapi_offline") / "static"
    app.mount("/docs/assets", StaticFiles(directory=str(assets)), name="docs-assets")


class StoreGauges(Collector):
    """The plane's store gauges (``tasks.collectors.StoreCollector``), plus whether the store answered."""

    def __init__(self, pool: PoolStore) -> None:
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
