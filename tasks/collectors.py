"""Gauges read at scrape time, and the worker's exporter (names documented in docs/operate.md).

The top floor of the metrics: rows by state, the quarantined count, the ordinals
(free, held, held by a quarantined row), the age of the oldest ``lease_failed``
row, the live child executions and the audit events written, whether dispatch is
paused, and worker presence (each ordinal's last call, ordinals without a worker or
busy, rows waiting ``assigned`` past a lease) are read from the store (``store.numbers``,
what ``poolctl status`` shows); each pass's last scan, whether it is late, and the
queue depth from Redis (``tasks.liveness``, which reads the registry of passes); the
ready tasks from the board (the autoscaling signal with the ordinals: docs/deploy.md). The
counters the passes bump live below, in ``tasks.metrics``, which imports nothing of
the plane: a pass importing its counter never reaches back up here.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, multiprocess, start_http_server
from prometheus_client.core import GaugeMetricFamily

from board import TaskStatus, open_board
from core.errors import PoolError
from store import numbers
from tasks import liveness


class StoreCollector:
    """Gauges read from the store when Prometheus scrapes."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self.store.session(readonly=True) as s:
            found = numbers.read(s, self.store.pool_size)
        now = time.time()
        yield _by("poolkeeper_rows", "Pool store rows by state.", "state", found.rows)
        yield GaugeMetricFamily(
            "poolkeeper_quarantined_rows",
            "Rows quarantined after repeated failures.",
            value=found.quarantined,
        )
        yield _by(
            "poolkeeper_ordinals",
            "Ordinals: free, held by a healthy live row, or held by a quarantined one (an operator's call).",
            "state",
            found.ordinals,
        )
        oldest = found.oldest_lease_failed_at
        yield GaugeMetricFamily(
            "poolkeeper_oldest_lease_failed_seconds",
            "Seconds the longest-waiting lease_failed row has waited (0: none), as `poolctl status` shows.",
            value=0.0 if oldest is None else max(0.0, now - oldest),
        )
        yield GaugeMetricFamily(
            "poolkeeper_live_children",
            "Child executions registered or running under a current grant.",
            value=found.live_children,
        )
        yield GaugeMetricFamily(
            "poolkeeper_audit_events_written",
            "The audit trail's highest event id: events appended so far.",
            value=found.audit_events,
        )
        yield GaugeMetricFamily(
            "poolkeeper_dispatch_paused",
            "1 while an operator has paused dispatch (no new claims; claimed runs go on).",
            value=int(found.dispatch.paused),
        )
        yield _by(
            "poolkeeper_board_dispatch_paused",
            "1 for each board an operator has paused on its own (no new claims from it; the others go on).",
            "board",
            {board: 1 for board in found.paused_boards},
        )
        yield from _presence(found, now, self.store.lease_seconds)


class PlaneCollector:
    """Gauges read from Redis when Prometheus scrapes: each pass's last scan, the queue depth.

    A Redis that does not answer leaves them out and says so in ``poolkeeper_redis_up``.
    """

    def __init__(self, settings: Any, client: Any) -> None:
        self.settings, self.client = settings, client

    def collect(self) -> Iterator[GaugeMetricFamily]:
        health = liveness.read(self.client, self.settings, time.time())
        yield GaugeMetricFamily(
            "poolkeeper_redis_up", "Whether Redis answered this scrape.", value=int(health.error is None)
        )
        if health.error is not None:
            return
        yield _by(
            "poolkeeper_last_scan_timestamp_seconds",
            "When each pass's scanner last finished (epoch seconds; beat liveness).",
            "pass_name",
            {p.name: p.last for p in health.scans if p.last is not None},
        )
        yield _by(
            "poolkeeper_pass_late",
            "1 while a pass has not scanned within 3 of its intervals (or was never seen): `poolctl status`.",
            "pass_name",
            {p.name: int(bool(p.late)) for p in health.scans},
        )
        yield GaugeMetricFamily(
            "poolkeeper_queue_depth",
            "Messages waiting in the deployment's maintenance queue.",
            value=health.queue_depth or 0,
        )
        yield GaugeMetricFamily(
            "poolkeeper_claims_waiting",
            "Claimed runs with no row yet, waiting for the next free ordinal (dispatch serves them first).",
            value=health.waiting_claims or 0,
        )
        yield GaugeMetricFamily(
            "poolkeeper_beat_alive",
            "1 while some pass was scanned within 3 of its intervals.",
            value=int(bool(health.beat_alive)),
        )


def _presence(found: numbers.PoolNumbers, now: float, lease_seconds: float) -> Iterator[GaugeMetricFamily]:
    """Worker presence: seconds since each ordinal's last worker call, and what waits on a missing worker."""
    yield _by(
        "poolkeeper_ordinal_last_seen_seconds",
        "Seconds since the ordinal's worker last called offer, heartbeat or result (absent: never seen).",
        "ordinal",
        {str(p.ordinal): now - p.at for p in found.presence if p.at is not None},
    )
    yield GaugeMetricFamily(
        "poolkeeper_ordinals_without_worker",
        "Ordinals with no worker call for longer than a lease (or none ever seen).",
        value=len(found.without_worker(now, lease_seconds)),
    )
    yield GaugeMetricFamily(
        "poolkeeper_assigned_over_lease_rows",
        "Rows that have waited `assigned` for longer than a lease: their ordinal's worker is missing.",
        value=len(found.waiting_assigned(now, lease_seconds)),
    )
    states = Counter(found.worker_states(now, lease_seconds).values())
    yield GaugeMetricFamily(
        "poolkeeper_ordinals_busy",
        "Ordinals whose worker holds a grant (its row is running): demand an autoscaler keeps staffed.",
        value=states[numbers.WorkerState.BUSY],
    )


class BoardCollector:
    """Demand the store cannot see yet, read from the board when Prometheus scrapes: its ready tasks.

    Dispatch claims a ready task as soon as a staffed ordinal is free, so the tasks still ready
    are those waiting for one (or for a resumed dispatch). A board that does not answer leaves
    the gauge out (``poolkeeper_board_up`` 0); the scrape still succeeds.
    """

    def __init__(self, board: Any) -> None:
        self.board = board

    def collect(self) -> Iterator[GaugeMetricFamily]:
        try:
            ready = self.board.counts_by_status()[TaskStatus.READY.value]
        except PoolError:
            yield GaugeMetricFamily("poolkeeper_board_up", "Whether the board answered this scrape.", value=0)
            return
        yield GaugeMetricFamily("poolkeeper_board_up", "Whether the board answered this scrape.", value=1)
        yield GaugeMetricFamily(
            "poolkeeper_ready_tasks_waiting",
            "Ready tasks on the board: each waits for a free staffed ordinal (dispatch claims at once).",
            value=ready,
        )


def _by(name: str, documentation: str, label: str, values: Mapping[str, float]) -> GaugeMetricFamily:
    """A gauge with one sample per label value."""
    family = GaugeMetricFamily(name, documentation, labels=[label])
    for value, n in values.items():
        family.add_metric([value], n)
    return family


def start_exporter(port: int, host: str, store: Any, settings: Any) -> None:
    """Serve /metrics from the worker's main process: all children's counters, store and plane gauges."""
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    registry.register(StoreCollector(store))
    registry.register(PlaneCollector(settings, liveness.client_for(settings)))
    registry.register(BoardCollector(open_board(settings)))
    start_http_server(port, addr=host, registry=registry)
