"""Retiring a run's children when its grant ends: the cost per child, and the no-child case.

For 0, 10 and 1,000 live children per run, each run's lease is expired with
``store.transitions.expire_many`` (which retires the run's children in the same
transaction), one transaction per run, as the expire pass does. The baseline,
in the same run, is the same expire on the same rows with no lineage: the
child table dropped and the retire step skipped; "+SELECT 1" puts an empty
statement in its place, the price of any extra statement. Prints microseconds
per run, the overhead, the cost per child, and the plan of the no-child probe.

    python bench/lineage_bench.py [--postgres URL] [--rows N]

On SQLite (WAL, synchronous=FULL) a commit's fsync dominates small
transactions; compare the overhead column, not absolute figures.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import create_engine, text

from store import PoolStore, lineage, transitions

T0 = 2_000_000_000.0
LEASE = 30.0
SHAPES = (0, 10, 1000)


@contextmanager
def database(postgres: str | None, tmp: str, name: str) -> Iterator[PoolStore]:
    """A fresh, migrated store: a SQLite file, or a new PostgreSQL database dropped afterwards."""
    if postgres is None:
        store = PoolStore(f"sqlite:///{tmp}/{name}.db", pool_size=100_000, lease_seconds=LEASE)
        store.migrate()
        yield store
        store.engine.dispose()
        return
    db = f"lineage_bench_{uuid.uuid4().hex[:8]}"
    admin = create_engine(postgres, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f"CREATE DATABASE {db}"))
    store = PoolStore(postgres.rsplit("/", 1)[0] + "/" + db, pool_size=100_000, lease_seconds=LEASE)
    try:
        store.migrate()
        yield store
    finally:
        store.engine.dispose()
        with admin.connect() as conn:
            conn.execute(text(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
        admin.dispose()


def given_running_runs(store: PoolStore, runs: int, children: int, *, with_lineage: bool) -> list[int]:
    """``runs`` running rows whose lease has ended, each with ``children`` live children."""
    with store.connection() as conn:
        conn.execute(
            text(
                "INSERT INTO assignments (board, task_id, run_id, ordinal, state, attempt, fence, owner,"
                " lease_until, payload, payload_digest, created_at, updated_at, failures,"
                " next_attempt_at, quarantined) VALUES ('b', :t, 1, :o, 'running', 1, :f, 'w', :l,"
                " '{}', :d, :c, :c, 0, 0, false)"
            ),
            [
                {"t": f"t{i}", "o": i, "f": i + 1, "l": T0 + LEASE, "d": "0" * 64, "c": T0}
                for i in range(runs)
            ],
        )
        ids = [r for (r,) in conn.execute(text("SELECT id FROM assignments ORDER BY id"))]
        conn.execute(text("UPDATE fence_sequence SET value = :v"), {"v": runs})
        if with_lineage and children:
            conn.execute(
                text(
                    "INSERT INTO child_executions (id, row_id, parent_id, status, epoch, depth,"
                    " receipt, receipt_digest, created_at, updated_at)"
                    " VALUES (:id, :r, :p, 'running', :e, 1, :rc, :rd, :c, :c)"
                ),
                [
                    {
                        "id": f"run:{r}/child:{j:012x}",
                        "r": r,
                        "p": f"run:{r}",
                        "e": n + 1,
                        "rc": '{"log":"' + "x" * 200 + '"}',
                        "rd": "1" * 64,
                        "c": T0,
                    }
                    for n, r in enumerate(ids)
                    for j in range(children)
                ],
            )
        if not with_lineage:
            conn.execute(text("DROP TABLE child_executions"))
        if store.engine.dialect.name == "postgresql":
            conn.execute(text("ANALYZE"))
    return ids


def expire_each(store: PoolStore, ids: list[int]) -> float:
    """Microseconds per run: expire it (and retire its children) in its own transaction."""
    start = time.perf_counter()
    for row_id in ids:
        with store.connection() as conn:
            transitions.expire_many(conn, [row_id], max_attempts=3, now=T0 + 2 * LEASE)
    return (time.perf_counter() - start) / len(ids) * 1e6


def measure(postgres: str | None, tmp: str, children: int, runs: int, n: int) -> tuple[float, float, float]:
    """(baseline, baseline plus one empty statement, with lineage), microseconds per run."""
    real = lineage.retire_children
    with database(postgres, tmp, f"base{children}_{n}") as store:
        ids = given_running_runs(store, 2 * runs, children, with_lineage=False)
        try:
            lineage.retire_children = lambda *_a, **_k: 0  # the baseline: no lineage
            base = expire_each(store, ids[:runs])
            lineage.retire_children = lambda conn, *_a, **_k: conn.execute(text("SELECT 1")).scalar()
            trip = expire_each(store, ids[runs:])  # what one more statement costs, whatever it does
        finally:
            lineage.retire_children = real
    with database(postgres, tmp, f"lin{children}_{n}") as store:
        ids = given_running_runs(store, runs, children, with_lineage=True)
        ours = expire_each(store, ids)
        with store.session(readonly=True) as s:
            live = s.execute(text("SELECT count(*) FROM child_executions WHERE status = 'running'")).scalar()
        assert live == 0, f"{live} children outlived their run"
    return base, trip, ours


def no_child_plan(postgres: str | None, tmp: str) -> str:
    with database(postgres, tmp, "plan") as store:
        ids = given_running_runs(store, 2, 0, with_lineage=True)
        with store.connection() as conn:
            conn.execute(
                text(
                    "INSERT INTO child_executions (id, row_id, parent_id, status, outcome, epoch, depth,"
                    " created_at, updated_at) VALUES (:id, :r, 'p', 'terminal', 'retired', 1, 1, 0, 0)"
                ),
                [{"id": f"run:{ids[1]}/child:{j:012x}", "r": ids[1]} for j in range(5000)],
            )
            if store.engine.dialect.name == "postgresql":
                conn.execute(text("ANALYZE child_executions"))
        sql = lineage.RETIRE_RUNS_SQL.format(p=repr(T0), ids=ids[0])
        explain = "EXPLAIN QUERY PLAN " if store.engine.dialect.name == "sqlite" else "EXPLAIN "
        with store.connection() as conn:
            lines = [" ".join(str(c) for c in r) for r in conn.execute(text(explain + sql))]
        return sql + "\n  -> " + "\n  -> ".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--postgres", help="a PostgreSQL URL to create scratch databases through")
    parser.add_argument("--rows", type=int, default=200, help="runs per shape (1,000 children: rows/10)")
    parser.add_argument("--repeat", type=int, default=3, help="take the median of this many runs")
    args = parser.parse_args()
    backend = "PostgreSQL" if args.postgres else "SQLite WAL synchronous=FULL"
    print(f"expire one run per transaction, {backend}; median of {args.repeat}")
    heads = ("children/run", "runs", "baseline", "+SELECT 1", "lineage", "overhead", "per child")
    print("{:>12} {:>5} {:>9} {:>10} {:>8} {:>9} {:>10}   (microseconds)".format(*heads))
    with tempfile.TemporaryDirectory() as tmp:
        for children in SHAPES:
            runs = args.rows if children < 1000 else max(2, args.rows // 10)
            got = [measure(args.postgres, tmp, children, runs, n) for n in range(args.repeat)]
            base, trip, ours = (statistics.median(g[i] for g in got) for i in range(3))
            per_child = f"{(ours - base) / children:10.2f}" if children else f"{'-':>10}"
            figures = f"{base:>9.0f} {trip:>10.0f} {ours:>8.0f} {ours - base:>9.0f}"
            print(f"{children:>12} {runs:>5} {figures} {per_child}")
        print("\nno-child case, the retire statement and its plan:\n" + no_child_plan(args.postgres, tmp))


if __name__ == "__main__":
    main()
