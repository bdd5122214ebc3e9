"""What the console's Trends charts cost the store: 1,000,000 audit events over 24 h.

Fills the audit trail of a fresh store (a SQLite file, and PostgreSQL when one answers)
with ``--events`` events spread evenly over the last ``--days`` (24 h), each row a cycle of claim,
grant, expiry, re-grant, result, settle, failure, and its row (settled, ready 1.5 s before
its claim), then reads the Trends page's data (``store.trends.read``: the bisection for the
window's first id and its grouped reads, all five charts) for the last hour and the last
day. Two baselines in the same run, over the same data:

- ``count``: a plain ``SELECT count(*) … WHERE id >= :first``, the same primary-key
  range and nothing else: the floor a chart could cost;
- ``scan``: the charts' grouped read (events by bucket, kind and state change) bounded
  by ``at`` alone, as it runs with no index on ``at`` and no id bound: the whole table.

Each figure is the median of ``--repeat`` reads. Compare ratios, not absolute figures.

    python bench/trends.py [--events N] [--days D] [--repeat K] [--postgres URL | --no-postgres]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable

from sqlalchemy import func, select, text

from bench.api_bench import PG_URL, postgres_database
from core.settings import Settings
from store import PoolStore, queries, trends

E = trends.E
DAY_SECONDS = 86_400
# One row's cycle, eight events in id order: (kind, from, to)
CYCLE = (
    ("claim", None, "assigned"),
    ("grant", "assigned", "running"),
    ("expiry", "running", "assigned"),
    ("grant", "assigned", "running"),
    ("result", "running", "result"),
    ("settle", "result", "finalized"),
    ("failure", "finalized", "finalized"),
    ("children_retired", "finalized", "finalized"),
)


def _case(column: int) -> str:
    arms = " ".join(
        f"WHEN {i} THEN {'NULL' if step[column] is None else repr(step[column])}"
        for i, step in enumerate(CYCLE)
    )
    return f"CASE i % {len(CYCLE)} {arms} END"


def fill(store: PoolStore, events: int, days: float, now: float) -> float:
    """``events`` events over the ``days`` before ``now``, written by the database itself; seconds taken."""
    counted = "WITH RECURSIVE c(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM c WHERE i < :n - 1)"
    numbers = (
        "generate_series(0, :n - 1) AS g(i)"
        if store.engine.dialect.name == "postgresql"
        else f"({counted} SELECT i FROM c)"
    )
    sql = (
        "INSERT INTO audit_events (row_id, at, kind, from_state, to_state, attempt, fence, actor)"
        f" SELECT i / {len(CYCLE)} + 1, :t0 + i * :step, {_case(0)}, {_case(1)}, {_case(2)}, 1, i, 'bench'"
        f" FROM {numbers}"
    )
    # Each cycle's row, settled, with a ready_at 1.5 s before its claim: what the wait chart joins.
    rows = (
        "INSERT INTO assignments (id, board, task_id, run_id, ordinal, state, attempt, payload_digest,"
        " created_at, updated_at, ready_at, failures, next_attempt_at, quarantined)"
        f" SELECT i / {len(CYCLE)} + 1, 'b', 't' || i, 1, 0, 'finalized', 1, 'x', :t0 + i * :step,"
        f" :t0 + i * :step, :t0 + i * :step - 1.5, 0, 0, false FROM {numbers} WHERE i % {len(CYCLE)} = 0"
    )
    started = time.perf_counter()
    with store.session() as s:
        span = days * DAY_SECONDS
        for statement in (sql, rows):
            s.execute(text(statement), {"n": events, "t0": now - span, "step": span / events})
    with store.engine.connect() as conn:
        conn.execute(text("ANALYZE"))
        conn.commit()
    return time.perf_counter() - started


def median_ms(read: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        read()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def bench_backend(name: str, url: str, events: int, days: float, repeat: int) -> list[tuple[str, ...]]:
    store = PoolStore.from_settings(Settings(database_url=url))
    store.migrate()
    now = time.time()
    took = fill(store, events, days, now)
    print(f"{name}: {events:,} events over {days:g} days written in {took:.1f} s", flush=True)
    rows: list[tuple[str, ...]] = []
    try:
        for window in (trends.HOUR, trends.DAY):
            since = (now // window.seconds - window.buckets + 1) * window.seconds
            with store.session(readonly=True) as s:
                current = queries.counts_by_state(s)
                first = trends.first_id(s, since - trends.SLACK_SECONDS)
                assert first is not None
                in_range = s.scalar(select(func.count()).where(E.id >= first))
                charts = median_ms(lambda: trends.read(s, window, now, current), repeat)  # noqa: B023
                count = median_ms(lambda: s.scalar(select(func.count()).where(E.id >= first)), repeat)  # noqa: B023
                whole = trends._counts(0, since, window.seconds)  # id >= 0: every event
                full = median_ms(lambda: s.execute(whole).all(), repeat)  # noqa: B023
            rows.append(
                (
                    name,
                    f"{window.name} ({window.buckets} x {window.seconds} s)",
                    f"{in_range:,}",
                    f"{charts:.1f}",
                    f"{count:.1f}",
                    f"{charts / count:.1f}x",
                    f"{full:.1f}",
                    f"{full / charts:.2f}x",
                )
            )
            print("  " + " | ".join(rows[-1][1:]), flush=True)
    finally:
        store.engine.dispose()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--days", type=float, default=1.0, help="the events' span (a longer retention)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--postgres", default=PG_URL)
    parser.add_argument("--no-postgres", action="store_true")
    args = parser.parse_args()
    rows: list[tuple[str, ...]] = []
    with tempfile.TemporaryDirectory(prefix="poolkeeper-trends-bench-") as tmp:
        rows += bench_backend("sqlite", f"sqlite:///{tmp}/pool.db", args.events, args.days, args.repeat)
    if not args.no_postgres:
        with postgres_database(args.postgres) as pg:
            if pg is not None:
                rows += bench_backend("postgres", pg, args.events, args.days, args.repeat)
    head = (
        "backend",
        "window",
        "events read",
        "charts ms",
        "count ms",
        "charts/count",
        "scan ms",
        "scan/charts",
    )
    print()
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
