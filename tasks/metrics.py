"""Prometheus metrics of the maintenance plane (names documented in the README).

A worker exports them on ``POOL_METRICS_PORT`` (0 = off). Counters and the
histogram are kept in each prefork child and aggregated through
``PROMETHEUS_MULTIPROC_DIR`` (the Celery entry point sets it before this
module loads). Rows by state, the quarantined count, the ordinals (free,
held, held by a quarantined row), the live child executions and the audit
events written are read from the store at scrape time; each pass's last scan
and the queue depth from Redis (``PlaneCollector``, ``tasks.liveness``).
Every label value comes from a closed set: pass names from the registry,
outcomes from ``tasks.declaration.Outcome``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, multiprocess, start_http_server
from prometheus_client.core import GaugeMetricFamily

PASS_OUTCOMES = Counter(
    "poolkeeper_pass_outcomes",
    "Outcomes of per-key maintenance work, by pass and outcome.",
    ["pass_name", "outcome"],
)
LOCK_BUSY = Counter(
    "poolkeeper_lock_busy", "Keys skipped because another worker held their lock.", ["pass_name"]
)
GC_DELETED = Counter("poolkeeper_gc_deleted", "Records deleted by garbage collection.", ["kind"])
EXPIRY_TO_REOFFER = Histogram(
    "poolkeeper_expiry_to_reoffer_seconds",
    "Time from a lease's end to the row being re-offered (or failed).",
    buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 900),
)


class StoreCollector:
    """Gauges read from the store when Prometheus scrapes."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def collect(self) -> Iterator[GaugeMetricFamily]:
        from store import lineage, queries

        with self.store.session(readonly=True) as s:
            counts = queries.counts_by_state(s)
            quarantined = queries.quarantined_count(s)
            free = queries.free_ordinals(s, self.store.pool_size)
            ordinals = queries.ordinal_counts(free, queries.quarantined_ordinals(s), self.store.pool_size)
            live_children = lineage.live_count(s)
            events = queries.audit_events_written(s)
        rows = GaugeMetricFamily("poolkeeper_rows", "Pool store rows by state.", labels=["state"])
        for state, n in counts.items():
            rows.add_metric([state], n)
        yield rows
        yield GaugeMetricFamily(
            "poolkeeper_quarantined_rows", "Rows quarantined after repeated failures.", value=quarantined
        )
        by_state = GaugeMetricFamily(
            "poolkeeper_ordinals",
            "Ordinals: free, held by a healthy live row, or held by a quarantined one (an operator's call).",
            labels=["state"],
        )
        for state, n in ordinals.items():
            by_state.add_metric([state], n)
        yield by_state
        yield GaugeMetricFamily(
            "poolkeeper_live_children",
            "Child executions registered or running under a current grant.",
            value=live_children,
        )
        yield GaugeMetricFamily(
            "poolkeeper_audit_events_written",
            "The audit trail's highest event id: events appended so far.",
            value=events,
        )


class PlaneCollector:
    """Gauges read from Redis when Prometheus scrapes: each pass's last scan, the queue depth.

    A Redis that does not answer leaves them out and says so in ``poolkeeper_redis_up``.
    """

    def __init__(self, settings: Any, client: Any) -> None:
        self.settings, self.client = settings, client

    def collect(self) -> Iterator[GaugeMetricFamily]:
        import time

        from tasks import liveness

        health = liveness.read(self.client, self.settings, time.time())
        yield GaugeMetricFamily(
            "poolkeeper_redis_up", "Whether Redis answered this scrape.", value=int(health.error is None)
        )
        if health.error is not None:
            return
        scans = GaugeMetricFamily(
            "poolkeeper_last_scan_timestamp_seconds",
            "When each pass's scanner last finished (epoch seconds; beat liveness).",
            labels=["pass_name"],
        )
        for p in health.scans:
            if p.last is not None:
                scans.add_metric([p.name], p.last)
        yield scans
        yield GaugeMetricFamily(
            "poolkeeper_queue_depth",
            "Messages waiting in the deployment's maintenance queue.",
            value=health.queue_depth or 0,
        )
        yield GaugeMetricFamily(
            "poolkeeper_beat_alive",
            "1 while some pass was scanned within 3 of its intervals.",
            value=int(bool(health.beat_alive)),
        )


def start_exporter(port: int, host: str, store: Any, settings: Any) -> None:
    """Serve /metrics from the worker's main process: all children's counters, store and plane gauges."""
    from tasks import liveness

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    registry.register(StoreCollector(store))
    registry.register(PlaneCollector(settings, liveness.client_for(settings)))
    start_http_server(port, addr=host, registry=registry)


def child_exited(pid: int) -> None:
    if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
        multiprocess.mark_process_dead(pid)  # type: ignore[no-untyped-call]
