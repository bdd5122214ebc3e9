"""Single-row store transitions per second: poolkeeper's store vs a raw sqlite3 loop.

Three sides on the same schema (migrated the same way) with the same durability
settings (WAL, synchronous=FULL, BEGIN IMMEDIATE), one transaction per
transition: the raw sqlite3 loop (the statements a careful hand-written worker
protocol needs, without the audit trail or lineage), the store through its
public API, and the store again with ``store.audit.append`` patched to a no-op.
The sides take turns call by call and each rate is 1 / the median time of a
call, so another process's burst on the shared machine moves all three alike
and barely moves a median. Compare ratios, not absolute figures.

    python bench/store_bench.py [--rows N]
"""

from __future__ import annotations

import argparse
import sqlite3
import statistics
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any
from unittest import mock

from core.settings import Settings
from core.validate import canonical_json, sha256
from poolkeeper.workerhost.client import envelope
from store import Offer, PoolStore, audit, transitions

T0 = 2_000_000_000.0
LEASE = 30.0
PHASES = ("add", "offer", "heartbeat", "expire", "regrant", "result")  # regrant: setup, not reported
REPORTED = ("add", "offer", "heartbeat", "result", "expire")
DONE = {"status": "done"}
Steps = dict[str, Callable[[int], object]]


def store_steps(store: PoolStore) -> Steps:
    offers: dict[int, Offer] = {}

    def add(i: int) -> None:
        store.add_run(board="b", task_id=f"t{i}", run_id=1, ordinal=i, payload={"i": i}, now=T0)

    def offer(i: int) -> None:
        got = store.offer(i, owner=f"bench-{i}", now=T0)
        assert got is not None
        offers[i] = got

    def heartbeat(i: int) -> None:
        store.heartbeat(envelope(offers[i], f"h{i}"), now=T0 + 1)

    def expire(i: int) -> None:
        with store.session() as s:
            transitions.expire_many(s, [offers[i].row_id], max_attempts=3, now=T0 + 2 * LEASE)

    def regrant(i: int) -> None:
        got = store.offer(i, owner=f"bench-{i}", now=T0 + 2 * LEASE)
        assert got is not None
        offers[i] = got

    def result(i: int) -> None:
        store.accept_result(envelope(offers[i], f"r{i}", payload=DONE), now=T0 + 2 * LEASE + 1)

    return {
        "add": add,
        "offer": offer,
        "heartbeat": heartbeat,
        "expire": expire,
        "regrant": regrant,
        "result": result,
    }


def raw_steps(path: str) -> Steps:
    db = sqlite3.connect(path, isolation_level=None)
    for pragma in ("journal_mode=WAL", "synchronous=FULL", "busy_timeout=5000", "foreign_keys=ON"):
        db.execute(f"PRAGMA {pragma}")
    fences: dict[int, tuple[int, int, int]] = {}  # ordinal: row id, attempt, fence

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

    def grant(now: float) -> Callable[[int], None]:
        def step(i: int) -> None:
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
                    (fence, now + LEASE, now, row_id, attempt),
                )
                assert cur.rowcount == 1
                fences[i] = (row_id, attempt, fence)

            tx(body)

        return step

    def delivery(i: int, kind: str, update: str, values: tuple[Any, ...], now: float) -> None:
        """A holder's write: lock-read the row, look up the delivery id, guarded UPDATE, record it."""

        def body() -> None:
            row_id, attempt, fence = fences[i]
            db.execute("SELECT * FROM assignments WHERE board='b' AND task_id=? AND run_id=1", (f"t{i}",))
            db.execute("SELECT * FROM deliveries WHERE delivery_id=?", (f"{kind}{i}",))
            cur = db.execute(
                f"UPDATE assignments SET {update} WHERE board='b' AND task_id=? AND run_id=1"
                " AND state='running' AND ordinal=? AND attempt=? AND fence=? AND lease_until>=?",
                (*values, f"t{i}", i, attempt, fence, now),
            )
            assert cur.rowcount == 1
            db.execute(
                "INSERT INTO deliveries VALUES (?, ?, ?, ?, ?) ON CONFLICT DO NOTHING RETURNING delivery_id",
                (f"{kind}{i}", row_id, kind, "0" * 64, now),
            ).fetchone()

        tx(body)

    def heartbeat(i: int) -> None:
        delivery(i, "heartbeat", "lease_until=?, updated_at=?", (T0 + 1 + LEASE, T0 + 1), T0 + 1)

    def result(i: int) -> None:
        now = T0 + 2 * LEASE + 1
        text = canonical_json(DONE)
        update = "state='result', result=?, result_digest=?, updated_at=?"
        update += ", failures=0, last_error=NULL, next_attempt_at=0, quarantined=0"
        delivery(i, "result", update, (text, sha256(text), now), now)

    def expire(i: int) -> None:
        def body() -> None:
            row_id, attempt, fence = fences[i]
            db.execute("SELECT * FROM assignments WHERE id=?", (row_id,)).fetchone()
            cur = db.execute(
                "UPDATE assignments SET state='assigned', attempt=attempt+1, lease_until=NULL,"
                " updated_at=?, failures=0, last_error=NULL, next_attempt_at=0, quarantined=0"
                " WHERE id=? AND state='running' AND attempt=? AND fence=?",
                (T0 + 2 * LEASE, row_id, attempt, fence),
            )
            assert cur.rowcount == 1

        tx(body)

    return {
        "add": add,
        "offer": grant(T0),
        "heartbeat": heartbeat,
        "expire": expire,
        "regrant": grant(T0 + 2 * LEASE),
        "result": result,
    }


def no_audit() -> AbstractContextManager[Any]:
    return mock.patch.object(audit, "append", lambda *args, **kwargs: None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2000)
    n = parser.parse_args().rows
    took: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        PoolStore.from_settings(Settings(database_url=f"sqlite:///{tmp}/raw.db")).migrate()  # the same schema
        sides: dict[str, tuple[Steps, Callable[[], AbstractContextManager[Any]]]] = {}
        sides["raw"] = (raw_steps(f"{tmp}/raw.db"), nullcontext)
        for side, patch in (("store", nullcontext), ("no audit", no_audit)):
            store = PoolStore(f"sqlite:///{tmp}/{side}.db", pool_size=n, lease_seconds=LEASE)
            store.migrate()
            sides[side] = (store_steps(store), patch)
        for phase in PHASES:
            for i in range(n):
                for side, (steps, patch) in sides.items():
                    with patch():
                        start = time.perf_counter()
                        steps[phase](i)
                        took.setdefault((side, phase), []).append(time.perf_counter() - start)
    print(f"single-row transitions/s (1 / median time per call), {n} rows, SQLite WAL synchronous=FULL")
    print(f"{'transition':<10} {'store':>8} {'no audit':>9} {'raw':>8} {'store/raw':>10} {'audit cost':>11}")
    for phase in REPORTED:
        ours, bare, raw = (statistics.median(took[(side, phase)]) for side in ("store", "no audit", "raw"))
        rates = f"{1 / ours:>8.0f} {1 / bare:>9.0f} {1 / raw:>8.0f}"
        print(f"{phase:<10} {rates} {raw / ours:>10.2f} {ours / bare - 1:>11.1%}")


if __name__ == "__main__":
    main()
