"""Single-row store transitions per second: poolkeeper's store vs a raw sqlite3 loop.

Both sides run the same statements, one transaction per transition, on the
same schema (migrated the same way) with the same durability settings (WAL,
synchronous=FULL, BEGIN IMMEDIATE), in the same run. Prints each rate and the
ratio store/raw; compare ratios, not absolute figures (the machine is shared).

    python bench/store_bench.py [--rows N]
"""

from __future__ import annotations

import argparse
import sqlite3
import tempfile
import time
from collections.abc import Callable

from core.settings import Settings
from core.validate import canonical_json, sha256
from store import PoolStore, transitions

T0 = 2_000_000_000.0
LEASE = 30.0


def timed(n: int, step: Callable[[int], object]) -> float:
    start = time.perf_counter()
    for i in range(n):
        step(i)
    return n / (time.perf_counter() - start)


def bench_store(path: str, n: int) -> dict[str, float]:
    store = PoolStore(f"sqlite:///{path}", pool_size=n, lease_seconds=LEASE)
    store.migrate()
    offers = {}

    def add(i: int) -> None:
        store.add_run(board="b", task_id=f"t{i}", run_id=1, ordinal=i, payload={"i": i}, now=T0)

    def offer(i: int) -> None:
        offers[i] = store.offer(i, owner=f"bench-{i}", now=T0)

    def heartbeat(i: int) -> None:
        o = offers[i]
        store.heartbeat(
            {
                "delivery_id": f"h{i}",
                "board": o.board,
                "task_id": o.task_id,
                "run_id": o.run_id,
                "worker_ordinal": o.ordinal,
                "attempt": o.attempt,
                "fence": o.fence,
                "payload_digest": o.payload_digest,
            },
            now=T0 + 1,
        )

    def expire(i: int) -> None:
        with store.session() as s:
            transitions.expire(s, offers[i].row_id, max_attempts=3, now=T0 + 2 * LEASE)

    return {
        name: timed(n, fn)
        for name, fn in [("add", add), ("offer", offer), ("heartbeat", heartbeat), ("expire", expire)]
    }


def bench_raw(path: str, n: int) -> dict[str, float]:
    PoolStore.from_settings(Settings(database_url=f"sqlite:///{path}")).migrate()  # the same schema
    db = sqlite3.connect(path, isolation_level=None)
    for pragma in ("journal_mode=WAL", "synchronous=FULL", "busy_timeout=5000", "foreign_keys=ON"):
        db.execute(f"PRAGMA {pragma}")
    fences: dict[int, tuple[int, int]] = {}

    def tx(fn: Callable[[], None]) -> None:
        db.execute("BEGIN IMMEDIATE")
        fn()
        db.execute("COMMIT")

    def add(i: int) -> None:
        def body() -> None:
            db.execute(
                "SELECT id FROM assignments WHERE board=? AND task_id=? AND run_id=?", ("b", f"t{i}", 1)
            )
            text = canonical_json({"i": i})
            db.execute(
                "INSERT INTO assignments (board, task_id, run_id, ordinal, state, attempt, payload,"
                " payload_digest, created_at, updated_at, failures, next_attempt_at, quarantined)"
                " VALUES ('b', ?, 1, ?, 'assigned', 1, ?, ?, ?, ?, 0, 0, 0)",
                (f"t{i}", i, text, sha256(text), T0, T0),
            )

        tx(body)

    def offer(i: int) -> None:
        def body() -> None:
            row_id, attempt, _payload = db.execute(
                "SELECT id, attempt, payload FROM assignments WHERE ordinal=? AND state='assigned'", (i,)
            ).fetchone()
            fence = db.execute(
                "UPDATE fence_sequence SET value=value+1 WHERE id=1 RETURNING value"
            ).fetchone()[0]
            cur = db.execute(
                "UPDATE assignments SET state='running', fence=?, lease_until=?, updated_at=?"
                " WHERE id=? AND state='assigned' AND attempt=?",
                (fence, T0 + LEASE, T0, row_id, attempt),
            )
            assert cur.rowcount == 1
            fences[i] = (row_id, fence)

        tx(body)

    def heartbeat(i: int) -> None:
        def body() -> None:
            row_id, fence = fences[i]
            db.execute("SELECT * FROM deliveries WHERE delivery_id=?", (f"h{i}",))
            cur = db.execute(
                "UPDATE assignments SET lease_until=?, updated_at=? WHERE board='b' AND task_id=?"
                " AND run_id=1 AND state='running' AND ordinal=? AND attempt=1 AND fence=?"
                " AND lease_until>=?",
                (T0 + 1 + LEASE, T0 + 1, f"t{i}", i, fence, T0 + 1),
            )
            assert cur.rowcount == 1
            db.execute("SELECT id FROM assignments WHERE board='b' AND task_id=? AND run_id=1", (f"t{i}",))
            db.execute(
                "INSERT INTO deliveries VALUES (?, ?, 'heartbeat', ?, ?) ON CONFLICT DO NOTHING"
                " RETURNING delivery_id",
                (f"h{i}", row_id, "0" * 64, T0 + 1),
            ).fetchone()

        tx(body)

    def expire(i: int) -> None:
        def body() -> None:
            row_id, fence = fences[i]
            db.execute("SELECT * FROM assignments WHERE id=?", (row_id,)).fetchone()
            cur = db.execute(
                "UPDATE assignments SET state='assigned', attempt=2, lease_until=NULL,"
                " updated_at=?, failures=0, last_error=NULL, next_attempt_at=0, quarantined=0"
                " WHERE id=? AND state='running' AND attempt=1 AND fence=?",
                (T0 + 2 * LEASE, row_id, fence),
            )
            assert cur.rowcount == 1

        tx(body)

    return {
        name: timed(n, fn)
        for name, fn in [("add", add), ("offer", offer), ("heartbeat", heartbeat), ("expire", expire)]
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        raw = bench_raw(f"{tmp}/raw.db", args.rows)
        ours = bench_store(f"{tmp}/store.db", args.rows)
    print(f"single-row transitions/s, {args.rows} rows each, SQLite WAL synchronous=FULL")
    print(f"{'transition':<10} {'store':>10} {'raw sqlite3':>12} {'ratio':>7}")
    for name in raw:
        print(f"{name:<10} {ours[name]:>10.0f} {raw[name]:>12.0f} {ours[name] / raw[name]:>7.2f}")


if __name__ == "__main__":
    main()
