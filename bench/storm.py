"""A storm of expired leases: how fast each way of working re-offers them all.

N running rows whose leases ended (default 10,000), re-offered by:
  (a) the plane: real redis-server, a Celery worker with 2 processes, the
      scanner enqueueing batches; each row its own lock and savepoint;
  (b) a monolithic in-process pass: all rows in one transaction, no isolation;
  (c) a naive plane: one message, one lock, one connection per row;
  (a') the plane again with 1% poisoned rows (the database refuses their
      transition on every attempt).
Prints rows/s for each, ratio = (a)/(b) (target >= 0.5), and what the poisoned
rows cost the healthy ones (target < 5%). All in one run, so the ratios hold
on a noisy machine.

    python bench/storm.py [--rows N] [--naive-rows N]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy import text

from core.settings import Settings
from poolkeeper.embedded import CeleryProc, RedisServer, wait_for
from store import PoolStore, queries, transitions
from tasks import scan
from tasks.celery import make_app
from tasks.plane import Plane, RedisCoordination, queue_name

TICK = 0.25  # the scanner interval of the plane runs (POOL_TICK_SECONDS)
POISON_TRIGGER = """
CREATE TRIGGER poison BEFORE UPDATE OF state ON assignments
WHEN OLD.task_id LIKE 'poison%' AND NEW.state <> OLD.state
BEGIN SELECT RAISE(ABORT, 'poisoned row'); END
"""


def storm(workdir: Path, n: int, redis_url: str, poisoned: int = 0) -> tuple[Settings, PoolStore]:
    """n running rows, leases ended a minute ago; the first ``poisoned`` refuse every transition."""
    settings = Settings(
        database_url=f"sqlite:///{workdir}/pool.db",
        board_url=f"sqlite:///{workdir}/board.db",
        redis_url=redis_url,
        pool_size=n,
        lease_seconds=30,
        max_attempts=3,
        batch_size=200,
        scan_limit=5000,
        quarantine_after=3,
        backoff_base_seconds=60,
    )
    store = PoolStore.from_settings(settings)
    store.migrate()
    past = time.time() - 60
    rows = [
        {
            "board": "b",
            "task_id": f"{'poison' if i < poisoned else 'task'}{i}",
            "ordinal": i,
            "fence": i + 1,
            "lease": past,
            "now": past,
        }
        for i in range(n)
    ]
    with store.session() as s:
        s.execute(
            text(
                "INSERT INTO assignments (board, task_id, run_id, ordinal, state, attempt, fence,"
                " lease_until, payload, payload_digest, created_at, updated_at, failures,"
                " next_attempt_at, quarantined) VALUES (:board, :task_id, 1, :ordinal, 'running', 1,"
                " :fence, :lease, '{}', 'x', :now, :now, 0, 0, false)"
            ),
            rows,
        )
        if poisoned:
            s.execute(text(POISON_TRIGGER))
    return settings, store


def healthy_left(store: PoolStore) -> int:
    with store.session(readonly=True) as s:
        return int(
            s.scalar(
                text(
                    "SELECT count(*) FROM assignments WHERE state = 'running' AND task_id NOT LIKE 'poison%'"
                )
            )
            or 0
        )


def timed_until_done(store: PoolStore, tick: Callable[[], Any], timeout: float = 600) -> float:
    """Run ``tick`` every TICK seconds (as beat would) until no healthy row is left running."""
    start = last_tick = time.perf_counter()
    tick()
    while healthy_left(store):
        now = time.perf_counter()
        if now - start > timeout:
            raise AssertionError(f"the storm did not clear in {timeout}s")
        if now - last_tick >= TICK:
            tick()
            last_tick = now
        time.sleep(0.02)
    return time.perf_counter() - start


def run_plane(workdir: Path, n: int, redis: RedisServer, poisoned: int = 0, concurrency: int = 2) -> float:
    redis.client().flushall()
    settings, store = storm(workdir, n, redis.url, poisoned)
    worker = CeleryProc("worker", settings.env(), workdir, "plane", concurrency=concurrency).wait_ready()
    try:
        plane = Plane(settings, store, None, RedisCoordination(redis.client(), settings))  # type: ignore[arg-type]
        app = make_app(settings)

        def enqueue(pass_name: str, keys: list[Any]) -> None:
            app.send_task(f"{settings.namespace}.process", (pass_name, keys), queue=queue_name(settings))

        def tick() -> None:  # what beat's scanner does each tick
            scan.scan(plane, "expire", time.time(), enqueue)

        seconds = timed_until_done(store, tick)
    finally:
        worker.stop()
    return (n - poisoned) / seconds


def run_monolithic(workdir: Path, n: int) -> float:
    settings, store = storm(workdir, n, "")
    start = time.perf_counter()
    with store.session() as s:
        for row_id in queries.due_expired(s, now=time.time(), limit=n):
            transitions.expire(s, row_id, max_attempts=settings.max_attempts, now=time.time())
    seconds = time.perf_counter() - start
    assert healthy_left(store) == 0
    return n / seconds


def run_naive(workdir: Path, n: int, redis: RedisServer) -> float:
    redis.client().flushall()
    settings, store = storm(workdir, n, redis.url)
    worker = CeleryProc("worker", settings.env(), workdir, "naive", app="bench.naive_plane").wait_ready()
    try:
        app = make_app(settings)
        with store.session(readonly=True) as s:
            due = queries.due_expired(s, now=time.time(), limit=n)
        start = time.perf_counter()
        for row_id in due:
            app.send_task("naive.expire", (row_id,), queue="maintenance")
        wait_for("the naive plane", lambda: healthy_left(store) == 0, 900, every=0.1)
        seconds = time.perf_counter() - start
    finally:
        worker.stop()
    return n / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--naive-rows", type=int, default=2_000, help="the naive plane is slow; a sample")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    n = args.rows
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        redis = RedisServer(root).start()
        try:
            b = a = p = 0.0
            for round_ in range(args.rounds):  # interleaved rounds, best of each: less noise
                fresh = root / f"round{round_}"
                dirs = {name: fresh / name for name in ("a", "b", "p")}
                for d in dirs.values():
                    d.mkdir(parents=True)
                b = max(b, run_monolithic(dirs["b"], n))
                a = max(a, run_plane(dirs["a"], n, redis))
                p = max(p, run_plane(dirs["p"], n, redis, poisoned=n // 100))
            (root / "c").mkdir()
            c = run_naive(root / "c", args.naive_rows, redis)
        finally:
            redis.stop()
    print(
        f"storm of {n} expired leases (naive plane: {args.naive_rows}), SQLite store, 2 worker processes,"
        f" best of {args.rounds} interleaved rounds"
    )
    print(f"(b) monolithic, one transaction, no isolation  {b:8.0f} rows/s")
    print(f"(a) plane: per-row lock + savepoint, batches   {a:8.0f} rows/s   ratio (a)/(b) = {a / b:.2f}")
    print(f"(c) naive: message+lock+connection per row      {c:8.0f} rows/s   ratio (c)/(b) = {c / b:.2f}")
    print(
        f"(a') plane with 1% poisoned rows (healthy rows) {p:8.0f} rows/s   cost to healthy = "
        f"{max(0.0, 1 - p / a):.1%}"
    )


if __name__ == "__main__":
    main()
