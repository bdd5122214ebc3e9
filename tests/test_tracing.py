"""One trace per run: the in-process spans, into the SDK's in-memory exporter.

Given a task on the board, when dispatch claims it, materialize adds its row, the worker
protocol grants it and takes a heartbeat and a result, and the results pass finalizes it,
then every span is in the claim's trace, each a child of the one it continues, and the row
holds the claim's context for the passes a beat scan starts later. With tracing off, nothing
of OpenTelemetry is imported by ``poolctl --version``. (tests/plane/test_tracing_plane.py runs
the same across the real processes, through an OTLP receiver.)
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace

import pytest
from fastapi.testclient import TestClient
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sqlalchemy import text

from board import Board
from core import tracing
from poolkeeper.api.app import create_app
from tasks import expire, runner
from tasks.plane import Plane
from tests.factories import NOW, row_state, scanned

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider)
    yield exporter
    tracing.install(None)


def tp(span: ReadableSpan) -> str:
    context = span.get_span_context()
    assert context is not None
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


def parent_of(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def test_a_run_is_one_trace_from_its_claim(plane: Plane, kanban: Board, spans: InMemorySpanExporter) -> None:
    kanban.add_task("b", "traced", task_id="b0")
    [claim] = scanned(plane, "materialize")["materialize"]
    assert runner.run_key(plane, "materialize", claim, NOW) == "added"
    row = row_state(plane.store, 1)
    with plane.store.session(readonly=True) as s:
        stored = s.execute(text("SELECT traceparent FROM assignments")).scalar()

    by_name = {s.name: s for s in spans.get_finished_spans()}
    claim_span, dispatch, materialize = by_name["claim"], by_name["dispatch"], by_name["materialize"]
    assert claim["traceparent"] == stored == tp(claim_span)  # the claim carries it; the row keeps it
    assert claim_span.parent is None and [link.context.span_id for link in claim_span.links] == [
        dispatch.context.span_id
    ]
    assert materialize.context.trace_id == claim_span.context.trace_id
    assert parent_of(materialize) == claim_span.context.span_id

    settings = replace(plane.settings, redis_url="redis://127.0.0.1:6379/15")
    app = create_app(settings, local_only=True, store=plane.store)
    with TestClient(app, base_url="http://127.0.0.1") as http:
        answer = http.post("/v1/offer", json={"ordinal": row["ordinal"], "owner": "w0"}).json()
        grant = answer["grant"]
        worker_span = "00-" + grant["traceparent"].split("-")[1] + "-00000000000000aa-01"  # the worker's run
        envelope = {
            "delivery_id": "d1",
            "board": "b",
            "task_id": "b0",
            "run_id": 1,
            "worker_ordinal": row["ordinal"],
            "attempt": grant["attempt"],
            "fence": grant["fence"],
            "payload_digest": grant["payload_digest"],
        }
        beat = http.post("/v1/heartbeat", json=envelope, headers={"traceparent": worker_span})
        done = http.post(
            "/v1/result",
            json={**envelope, "delivery_id": "d2", "payload": {"status": "done"}},
            headers={"traceparent": worker_span},
        )
    assert beat.json() == {"outcome": "applied"} and done.json() == {"outcome": "applied"}
    assert runner.run_key(plane, "results", row["id"], NOW) == "finalized"

    by_name = {s.name: s for s in spans.get_finished_spans()}
    grant_span = by_name["grant"]
    assert grant["traceparent"] == tp(grant_span) and parent_of(grant_span) == claim_span.context.span_id
    for name in ("POST /v1/heartbeat", "POST /v1/result"):  # the server's spans continue the worker's
        assert parent_of(by_name[name]) == 0xAA
        assert by_name[name].context.trace_id == claim_span.context.trace_id
    assert beat.headers["traceparent"] == tp(by_name["POST /v1/heartbeat"])  # the answer names its span
    batch = by_name["heartbeat batch"]  # the group commit that applied it, a child of its request
    assert parent_of(batch) == by_name["POST /v1/heartbeat"].context.span_id
    assert batch.context.trace_id == claim_span.context.trace_id
    assert batch.attributes == {"pool.heartbeats": 1}
    assert parent_of(by_name["finalize"]) == claim_span.context.span_id
    assert by_name["finalize"].context.trace_id == claim_span.context.trace_id


def test_an_expired_lease_is_a_span_of_its_run(
    plane: Plane, kanban: Board, spans: InMemorySpanExporter
) -> None:
    kanban.add_task("b", "traced", task_id="b0")
    [claim] = scanned(plane, "materialize")["materialize"]
    assert runner.run_key(plane, "materialize", claim, NOW) == "added"
    row = row_state(plane.store, 1)
    assert plane.store.offer(row["ordinal"], owner="w0", now=NOW) is not None
    later = NOW + plane.settings.lease_seconds + 1
    assert runner.run_key(plane, "expire", row["id"], later) == "reoffered"
    again = plane.store.offer(row["ordinal"], owner="w1", now=later)
    assert again is not None and again.traceparent == claim["traceparent"]  # the re-offer: the same trace
    [expire] = [s for s in spans.get_finished_spans() if s.name == "expire"]
    assert tp_parent(expire) == claim["traceparent"] and expire.attributes == {
        "pool.row_id": row["id"],
        "pool.outcome": "reoffered",
    }


def tp_parent(span: ReadableSpan) -> str:
    assert span.parent is not None
    return f"00-{span.parent.trace_id:032x}-{span.parent.span_id:016x}-{span.parent.trace_flags:02x}"


def test_a_malformed_traceparent_is_neither_stored_nor_continued(
    plane: Plane, kanban: Board, spans: InMemorySpanExporter
) -> None:
    kanban.add_task("b", "traced", task_id="b0")
    [claim] = scanned(plane, "materialize")["materialize"]
    bad = {**claim, "traceparent": "00-" + "0" * 32 + "-" + "1" * 16 + "-01"}  # an all-zero trace id
    assert runner.run_key(plane, "materialize", bad, NOW) == "added"
    [materialize] = [s for s in spans.get_finished_spans() if s.name == "materialize"]
    assert materialize.parent is None  # a root of its own instead
    with plane.store.session(readonly=True) as s:
        stored = s.execute(text("SELECT traceparent FROM assignments")).scalar()
    assert stored == tp(materialize)


def test_with_tracing_off_nothing_is_traced_or_stored(plane: Plane, kanban: Board) -> None:
    assert not tracing.enabled()
    kanban.add_task("b", "untraced", task_id="b0")
    [claim] = scanned(plane, "materialize")["materialize"]
    assert "traceparent" not in claim
    assert runner.run_key(plane, "materialize", claim, NOW) == "added"
    with plane.store.session(readonly=True) as s:
        assert s.execute(text("SELECT traceparent FROM assignments")).scalar() is None
    with tracing.span("anything") as rename:
        rename("still nothing")
        assert tracing.current() is None and tracing.headers() == {}


@pytest.mark.parametrize(
    ("env", "on"),
    [
        ({}, False),
        ({"OTEL_SERVICE_NAME": "pool"}, False),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318"}, True),
        ({"OTEL_TRACES_EXPORTER": "console"}, True),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}, False),
    ],
)
def test_the_standard_variables_turn_tracing_on(env: dict[str, str], on: bool) -> None:
    assert tracing.configured(env) is on


def in_a_process(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``code`` run by a fresh interpreter with ``env``: what a process starting with it does."""
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)


def test_poolctl_version_imports_nothing_of_opentelemetry_when_unconfigured() -> None:
    done = in_a_process(
        "import sys; sys.argv = ['poolctl', '--version']\n"
        "from poolkeeper.cli import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))",
        {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_an_otel_setting_the_sdk_refuses_turns_tracing_off_with_one_warning() -> None:
    done = in_a_process(
        "import logging; logging.basicConfig(format='%(levelname)s %(message)s')\n"
        "from core import tracing\n"
        "for name in ('claim', 'grant'):\n    with tracing.span(name):\n        pass\n"
        "print('ran', tracing.current())",
        {**os.environ, "OTEL_TRACES_EXPORTER": "console", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "0"},
    )
    assert (done.returncode, done.stdout.strip()) == (0, "ran None"), done.stderr
    [line] = [x for x in done.stderr.splitlines() if x.strip()]
    assert line.startswith("WARNING an OTEL_* setting is refused by the SDK") and "tracing off" in line


def test_a_storm_of_expiries_is_one_span_linked_to_each_run(
    plane: Plane, kanban: Board, spans: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(expire, "SPAN_EACH_UPTO", 1)  # two expiries in a batch are a storm here
    for i in range(2):
        kanban.add_task("b", f"traced {i}", task_id=f"b{i}")
    claims = scanned(plane, "materialize")["materialize"]
    rows = []
    for claim in claims:
        assert runner.run_key(plane, "materialize", claim, NOW) == "added"
    for row_id in (1, 2):
        row = row_state(plane.store, row_id)
        assert plane.store.offer(row["ordinal"], owner="w0", now=NOW) is not None
        rows.append(row_id)
    later = NOW + plane.settings.lease_seconds + 1
    assert runner.run_batch(plane, "expire", rows, later).outcomes == {"reoffered": 2}
    [batch] = [s for s in spans.get_finished_spans() if s.name.startswith("expire")]
    assert batch.name == "expire batch" and batch.parent is None and batch.attributes == {"pool.rows": 2}
    linked = {f"00-{link.context.trace_id:032x}-{link.context.span_id:016x}" for link in batch.links}
    assert linked == {c["traceparent"][:52] for c in claims}
