"""Prometheus metrics of the maintenance plane (names documented in the README).

Counters and the histogram live in the worker processes; with
``PROMETHEUS_MULTIPROC_DIR`` set (``poolkeeper.metrics`` does it for a worker
that exports) they are aggregated across prefork children. Gauges of rows by
state are read from the store at scrape time.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

PASS_OUTCOMES = Counter(
    "poolkeeper_pass_outcomes",
    "Outcomes of per-key maintenance work, by pass and outcome.",
    ["pass_name", "outcome"],
)
LOCK_BUSY = Counter(
    "poolkeeper_lock_busy",
    "Keys skipped because another worker held their lock.",
    ["pass_name"],
)
EXPIRY_TO_REOFFER = Histogram(
    "poolkeeper_expiry_to_reoffer_seconds",
    "Time from a lease's end to the row being re-offered.",
    buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 900),
)
