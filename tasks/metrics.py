"""The maintenance plane's counters (names documented in docs/operate.md): a leaf the passes import.

Counters and the histograms are kept in each prefork child and aggregated through
``PROMETHEUS_MULTIPROC_DIR`` (the Celery entry point sets it before this module
loads). The gauges read at scrape time and the worker's exporter on
``POOL_METRICS_PORT`` are ``tasks.collectors``: they read the passes' registry,
which imports this module, so they cannot live here. Every label value comes
from a closed set: pass names from the registry, outcomes from
``tasks.declaration.Outcome``.
"""

from __future__ import annotations

import os

from prometheus_client import Counter, Histogram, multiprocess

from store.trends import DURATION_BUCKETS

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
# Both observed in the pass that knows the whole span, once per run; the console's Trends page
# reads the same spans, in the same buckets, from the store (``store.trends``).
TASK_WAIT = Histogram(
    "poolkeeper_task_wait_seconds",
    "Time from a task turning ready on the board to the pool's claim of it (materialize).",
    buckets=DURATION_BUCKETS,
)
RUN_SECONDS = Histogram(
    "poolkeeper_run_seconds",
    "Time from a run's grant to its accepted result (observed as the results pass settles it).",
    buckets=DURATION_BUCKETS,
)


def child_exited(pid: int) -> None:
    if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
        multiprocess.mark_process_dead(pid)  # type: ignore[no-untyped-call]
