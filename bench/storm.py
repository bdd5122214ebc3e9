"""A storm of expired leases: how fast each way of working re-offers them all.

N running rows whose leases ended (10,000 and 50,000 by default: at 10,000 the plane
clears the storm in a quarter of a second, a fifth of it the first batch's latency),
re-offered by:
  (u) the reference every peer is judged by: one set UPDATE over the due rows of
      the same table (the due query as its WHERE, the expire CASE as its SET), in
      one transaction, at the same durability: no lock, outcome, failure record or
      audit event per row, and one poisoned row fails them all;
  (b) the honest baseline: the fastest monolithic pass a careful engineer
      writes without isolation, on the DB-API (sqlite3 / psycopg): one
      transaction, select the due rows, one conditional UPDATE per row, commit;
  (b') the same monolithic pass through the store's own transition functions;
  (a) the plane: real redis-server, a Celery worker with 2 processes, the
      scanner enqueueing batches, at default settings (but a long backoff,
      so a poisoned row stays out once it failed); each row its own lock and
      outcome, one set-based statement per batch, split only where it fails;
  (at) the plane with the poisons' trigger installed and no row poisoned: the
      trigger runs for every row's update, so the poison lines are measured
      against this, not (a);
  (a') the plane again with 1% poisoned rows (the database refuses their
      transition on every attempt), all in the first batches: what they cost
      the healthy rows;
  (a'') the same 1%, one row in every hundred, so that every batch has ten:
      the worst case for finding them by splitting (their first encounter: no
      row has a failure history, so the scanner cannot tell them apart);
  (a''h) the same spread 1%, each poisoned row with a failure history (it failed
      once before and its backoff has run out): the scanner sets them apart in
      batches of their own (tasks.declaration SUSPECTS_PER_BATCH), so clean
      batches never pay the search; what that costs the healthy rows;
  (a0) the plane again with the audit trail switched off (bench/audit_off.py):
      what the trail costs it;
  (aT) the plane with tracing on (``--trace`` runs only this beside the bases): each row
      carries a trace context, each expiry is a span exported over OTLP/HTTP to a receiver in
      this process (issue 30: at least 0.9 of (a));
  (c) a naive plane: one message, one lock, one connection per row.
On SQLite and on PostgreSQL (a fresh database per run), unless ``--backends`` says less.
Then, at the DEFAULT tick, scan and batch settings: a 100,000-row storm (rows/s
and time to clear), the worker's RSS after it beside its RSS after a 1,000-row
storm, and the steady-state delay from a lease's end to its re-offer (p99).
On PostgreSQL (if reachable): the storm with 1, 2 and 4 worker processes.
Every figure is measured in the same run as its baseline, so ratios hold on a
noisy machine.

    python bench/storm.py [--rows N [N ...]] [--backends sqlite postgres] [--big N] [--rounds R] [--quick]
                          [--modes u b b' a at a' a'' a''h a0 aT] [--trace]
"""

from __future__ import annotations

import argparse
import os
import random
import sqlite3
import tempfile
import time
import uuid
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, text

from board import open_board
from core import db
from core.settings import Settings
from poolkeeper.embedded import CeleryProc, RedisServer, wait_for
from store import PoolStore, queries, transitions
from tasks import scan
from tasks.celery import make_app
from tasks.coordination import process_task, queue_name
from tasks.plane import Plane
from tasks.redis_coordination import RedisCoordination

PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
POISON = {
    "sqlite": [
        "CREATE TRIGGER poison BEFORE UPDATE OF state ON assignments"
        " WHEN OLD.task_id LIKE 'poison%' AND NEW.state <> OLD.state"
        " BEGIN SELECT RAISE(ABORT, 'poisoned row'); END"
    ],
    "postgresql": [
        "CREATE FUNCTION poison() RETURNS trigger LANGUAGE plpgsql"
        " AS $$ BEGIN RAISE EXCEPTION 'poisoned row'; END $$",
        "CREATE TRIGGER poison BEFORE UPDATE OF state ON assignments FOR EACH ROW"
        " WHEN (OLD.task_id LIKE 'poison%' AND NEW.state <> OLD.state) EXECUTE FUNCTION poison()",
    ],
}
RAW_EXPIRE = (
    "UPDATE assignments SET state = CASE WHEN attempt < {p} THEN 'assigned' ELSE 'lease_failed' END,"
    " attempt = CASE WHEN attempt < {p} THEN attempt + 1 ELSE attempt END, updated_at = {p},"
    " failures = 0, last_error = NULL, next_attempt_at = 0, quarantined = false"
    " WHERE id = {p} AND state = 'running' AND lease_until > 0 AND lease_until < {p}"
)
# (u): the due query as the WHERE of one UPDATE with RAW_EXPIRE's SET.
RAW_SET_EXPIRE = RAW_EXPIRE.split(" WHERE ")[0] + (
    " WHERE state = 'running' AND lease_until > 0 AND lease_until < {p} AND next_attempt_at <= {p}"
)
RAW_DUE = (
    "SELECT id FROM assignments WHERE state = 'running' AND lease_until > 0 AND lease_until < {p}"
    " AND next_attempt_at <= {p} ORDER BY lease_until, id"
)


def storm(
    url: str,
    n: int,
    redis_url: str,
    *,
    poisoned: Collection[int] = (),
    trigger: bool = False,
    leases: list[float] | None = None,
    history: bool = False,
    traced: bool = False,
    **over: Any,
) -> tuple[Settings, PoolStore]:
    """n running rows (leases ended a minute ago unless given); those at ``poisoned`` refuse every
    change, through a trigger that every row's update runs (also with ``trigger`` and none poisoned).
    With ``history`` the poisoned rows failed once before (``failures`` 1, their backoff run out).
    With ``traced`` each row carries its run's trace context, as materialize stores it with tracing on."""
    settings = Settings(database_url=url, board_url=url, redis_url=redis_url, pool_size=max(n, 1), **over)
    store = PoolStore.from_settings(settings)
    store.migrate()
    board = open_board(settings)
    board.migrate()  # a worker refuses to start on a store or board that is not migrated
    board.close()
    past = time.time() - 60
    bad = set(poisoned)
    rows = [
        {
            "task_id": f"{'poison' if i in bad else 'task'}{i}",
            "ordinal": i,
            "fence": i + 1,
            "lease": past if leases is None else leases[i],
            "now": past,
            "failures": int(history and i in bad),
            "traceparent": f"00-{i + 1:032x}-{i + 1:016x}-01" if traced else None,
        }
        for i in range(n)
    ]
    with store.session() as s:
        s.execute(text("DELETE FROM assignments"))
        s.execute(
            text(
                "INSERT INTO assignments (board, task_id, run_id, ordinal, state, attempt, fence,"
                " lease_until, payload, payload_digest, created_at, updated_at, failures,"
                " next_attempt_at, quarantined, traceparent) VALUES ('b', :task_id, 1, :ordinal,"
                " 'running', 1, :fence, :lease, '{}', 'x', :now, :now, :failures, 0, false, :traceparent)"
            ),
            rows,
        )
        for sql in POISON[store.engine.dialect.name] if bad or trigger else []:
            s.execute(text(sql))
    if not url.startswith("sqlite"):
        with store.engine.connect() as conn:  # fresh statistics, as autovacuum would give a real table
            conn.execute(text("ANALYZE assignments"))
            conn.commit()
    return settings, store


def running_left(store: PoolStore) -> bool:
    """Whether any healthy row is still running: the first one found, not a count (the bench polls
    this every 20 ms, on the same cores as the plane it measures)."""
    with store.session(readonly=True) as s:
        sql = "SELECT 1 FROM assignments WHERE state = 'running' AND task_id NOT LIKE 'poison%' LIMIT 1"
        return s.scalar(text(sql)) is not None


def raw_connection(url: str) -> tuple[Any, str, str]:
    """A DB-API connection with the store's durability settings: (connection, BEGIN, placeholder)."""
    if url.startswith("sqlite"):
        conn: Any = sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None)
        for pragma in ("journal_mode=WAL", "synchronous=FULL", "busy_timeout=5000"):
            conn.execute(f"PRAGMA {pragma}")
        return conn, "BEGIN IMMEDIATE", "?"
    import psycopg

    return psycopg.connect(url.replace("+psycopg", ""), autocommit=True), "BEGIN", "%s"


def in_one_transaction(url: str, n: int, work: Callable[[Any, str, float], None]) -> float:
    """Rows/s of ``work(cursor, placeholder, now)`` over a fresh storm of ``n``, in one DB-API
    transaction with the store's durability settings, the commit included."""
    storm(url, n, "")[1].engine.dispose()
    conn, begin, p = raw_connection(url)
    start = time.perf_counter()
    cur = conn.cursor()
    cur.execute(begin)
    work(cur, p, time.time())
    cur.execute("COMMIT")
    seconds = time.perf_counter() - start
    conn.close()
    return n / seconds


def run_set(url: str, n: int) -> float:
    """(u): one set UPDATE over the due rows."""

    def update(cur: Any, p: str, now: float) -> None:
        cur.execute(RAW_SET_EXPIRE.format(p=p), (3, 3, now, now, now))
        assert cur.rowcount == n, f"the set UPDATE moved {cur.rowcount} of {n} rows"

    return in_one_transaction(url, n, update)


def run_raw(url: str, n: int) -> float:
    """(b): the monolithic pass on the DB-API: select the due rows, one conditional UPDATE each."""

    def row_by_row(cur: Any, p: str, now: float) -> None:
        cur.execute(RAW_DUE.format(p=p), (now, now))
        for (row_id,) in cur.fetchall():
            cur.execute(RAW_EXPIRE.format(p=p), (3, 3, now, row_id, now))

    return in_one_transaction(url, n, row_by_row)


def run_store_monolithic(url: str, n: int) -> float:
    """(b'): the same pass through the store's own functions, one row at a time."""
    settings, store = storm(url, n, "")
    start = time.perf_counter()
    with store.session() as s:
        for row_id in (row.id for row in queries.due_expired(s, now=time.time(), limit=n)):
            transitions.expire_many(s, [row_id], max_attempts=settings.max_attempts, now=time.time())
    seconds = time.perf_counter() - start
    assert not running_left(store)
    store.engine.dispose()
    return n / seconds


def until_clear(store: PoolStore, tick: Callable[[], Any], every: float, timeout: float = 900) -> float:
    """Run ``tick`` every ``every`` seconds (as beat would) until no healthy row is left running."""
    start = last_tick = time.perf_counter()
    tick()
    while running_left(store):
        now = time.perf_counter()
        if now - start > timeout:
            raise AssertionError(f"the storm did not clear in {timeout}s")
        if now - last_tick >= every:
            tick()
            last_tick = now
        time.sleep(0.02)
    return time.perf_counter() - start


class PlaneRun:
    """A real Celery worker over one storm, ticked like beat ticks the expire scanner."""

    def __init__(
        self,
        workdir: Path,
        settings: Settings,
        store: PoolStore,
        redis: RedisServer,
        procs: int,
        app: str = "tasks",
        traced: dict[str, str] | None = None,
    ):
        self.settings, self.store = settings, store
        name = f"w{uuid.uuid4().hex[:6]}"
        env = {**settings.env(), **(traced or {})}  # OTEL_*: the worker traces (aT)
        worker = CeleryProc("worker", env, workdir, name, app=app, concurrency=procs)
        self.worker = worker.wait_ready()
        self.plane = Plane(settings, store, None, RedisCoordination(redis.client(), settings))  # type: ignore[arg-type]
        self.app = make_app(settings)
        # A scanner runs in a worker whose broker connection is open after its first tick;
        # this one opens it before the clock starts, with a message that is a no-op.
        self.app.send_task(process_task(settings), ("expire", []), queue=queue_name(settings))

    def tick(self) -> None:
        def enqueue(pass_name: str, keys: list[Any]) -> None:
            task, queue = process_task(self.settings), queue_name(self.settings)
            self.app.send_task(task, (pass_name, keys), queue=queue)

        scan.scan(self.plane, "expire", time.time(), enqueue)

    def clear(self) -> float:
        return until_clear(self.store, self.tick, self.settings.tick_seconds)

    def rss_mb(self) -> float:
        """The largest resident set among the worker's processes."""
        sizes = []
        for pid in [self.worker.proc.pid, *self.worker.children()]:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    sizes.append(int(line.split()[1]) / 1024)
        return max(sizes)

    def stop(self) -> None:
        self.worker.stop()
        self.store.engine.dispose()


def plane_rate(
    workdir: Path,
    url: str,
    n: int,
    redis: RedisServer,
    procs: int = 2,
    app: str = "tasks",
    poisoned: Collection[int] = (),
    trigger: bool = False,
    history: bool = False,
    traced: dict[str, str] | None = None,
) -> float:
    """Healthy rows re-offered per second (a poisoned row stays out of the run once it failed).

    ``traced``: the ``OTEL_*`` variables of a worker that traces, over rows that carry a trace."""
    redis.client().flushall()
    over: dict[str, Any] = {"backoff_base_seconds": 60}
    settings, store = storm(
        url, n, redis.url, poisoned=poisoned, trigger=trigger, history=history, traced=bool(traced), **over
    )
    run = PlaneRun(workdir, settings, store, redis, procs, app, traced)
    try:
        return (n - len(poisoned)) / run.clear()
    finally:
        run.stop()


TICK = os.sysconf("SC_CLK_TCK")


def proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state first), or None if gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw.rpartition(")")[2].split()


def cpu_of(fields: list[str]) -> float:
    """CPU seconds (utime + stime) of a process's ``proc_stat`` fields."""
    return (int(fields[11]) + int(fields[12])) / TICK


def cpu_seconds(pid: int) -> float:
    """A process's CPU so far (user + system), 0 if it is gone."""
    fields = proc_stat(pid)
    return cpu_of(fields) if fields else 0.0


def floors(url: str, n: int, redis: RedisServer) -> None:
    """What must remain of the plane's work per row, each alone on the same rows: the database's
    (the plane's own guarded UPDATE and its audit events, over all n at once) against (u)'s,
    and Redis's (a lock per row taken and let go, in batches of 1,000), in CPU per row."""
    pg = not url.startswith("sqlite")

    def timed(work: Callable[[Any, Any, list[int]], None]) -> tuple[float, float]:
        """(rows/s, database CPU us/row) of ``work(connection, driver cursor, due ids)``, in one
        transaction, the commit included (the due ids are read before the clock starts)."""
        store = storm(url, n, "")[1]
        with store.session(readonly=True) as s:
            ids = [row.id for row in queries.due_expired(s, now=time.time(), limit=n)]
        start = time.perf_counter()
        with store.connection() as conn:
            driver: Any = conn.connection.driver_connection
            pid = driver.info.backend_pid if pg else 0
            cpu = cpu_seconds(pid) if pg else time.process_time()
            work(conn, driver.cursor(), ids)
        seconds = time.perf_counter() - start
        used = (cpu_seconds(pid) if pg else time.process_time()) - cpu
        store.engine.dispose()
        return n / seconds, used * 1e6 / n

    def set_update(conn: Any, cursor: Any, ids: list[int]) -> None:
        now = time.time()
        cursor.execute(RAW_SET_EXPIRE.format(p=db.placeholder(conn)), (3, 3, now, now, now))
        assert cursor.rowcount == n

    def plane_statement(conn: Any, cursor: Any, ids: list[int]) -> None:
        got = transitions.expire_many(conn, ids, max_attempts=3, now=time.time(), actor="pass:expire")
        assert len(got.moved) == n

    u_rate, u_cpu = timed(set_update)
    e_rate, e_cpu = timed(plane_statement)
    b_rate = run_raw(url, n)
    client = redis.client()
    client.flushall()
    coord = RedisCoordination(client, Settings())
    names = [f"row:{i}" for i in range(n)]
    redis_cpu, own = cpu_seconds(redis.proc.pid) if redis.proc else 0.0, time.process_time()
    start = time.perf_counter()
    for first in range(0, n, 1000):
        part = names[first : first + 1000]
        tokens = coord.lock_many(part)
        coord.finish({k: t for k, t in zip(part, tokens, strict=True) if t}, "expire", [])
    lock_rate = n / (time.perf_counter() - start)
    redis_us = ((cpu_seconds(redis.proc.pid) if redis.proc else 0.0) - redis_cpu) * 1e6 / n
    own_us = (time.process_time() - own) * 1e6 / n
    where = "PostgreSQL backend" if pg else "SQLite, in process"
    print(f"  floors, each alone over the same {n} rows (CPU of {where}):")
    print(f"    (u) one set UPDATE                          {u_rate:9.0f} rows/s  {u_cpu:5.1f} us/row")
    print(f"    (b) monolithic on the DB-API                {b_rate:9.0f} rows/s")
    print(
        f"    the plane's UPDATE + audit events, one call {e_rate:9.0f} rows/s  {e_cpu:5.1f} us/row"
        f"   /(u) = {e_rate / u_rate:.2f}   /(b) = {e_rate / b_rate:.2f}"
    )
    print(
        f"    a Redis lock per row, taken and let go      {lock_rate:9.0f} rows/s"
        f"  redis-server {redis_us:4.1f} + client {own_us:4.1f} us/row"
    )


def profile(workdir: Path, url: str, n: int, redis: RedisServer) -> None:
    """Where the plane's CPU goes per row: (a) once, each process group's CPU from ``/proc``
    (PostgreSQL: the backends of this run's database), against (u) on the same rows."""
    redis.client().flushall()
    settings, store = storm(url, n, redis.url, backoff_base_seconds=60)
    run = PlaneRun(workdir, settings, store, redis, 2)

    def groups() -> dict[str, list[int]]:
        found = {
            "worker main": [run.worker.proc.pid],
            "worker children": run.worker.children(),
            "redis-server": [redis.proc.pid] if redis.proc else [],
            "bench (scan, poll)": [os.getpid()],
        }
        if not url.startswith("sqlite"):
            with store.engine.connect() as conn:
                sql = "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
                found["postgres backends"] = list(conn.scalars(text(sql)))
        return found

    try:
        redis.client().config_resetstat()
        before = {pid: cpu_seconds(pid) for pids in groups().values() for pid in pids}
        wall_start = time.perf_counter()
        seconds = run.clear()
        wall = time.perf_counter() - wall_start
        spent = {
            name: sum(cpu_seconds(pid) - before.get(pid, 0.0) for pid in pids)
            for name, pids in groups().items()
        }
        stats = redis.client().info("commandstats")
    finally:
        run.stop()
    print(f"\nprofile: plane over {n} rows, {url.split(':')[0]}: {n / seconds:.0f} rows/s, wall {wall:.2f}s")
    for name, cpu in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"  {name:20s} {cpu * 1e6 / n:6.1f} us/row")
    total = sum(spent.values())
    print(f"  {'total':20s} {total * 1e6 / n:6.1f} us/row ({total:.2f}s CPU in {wall:.2f}s wall on 2 cores)")
    top = sorted(stats.items(), key=lambda kv: -kv[1]["usec"])[:6]
    print(
        "  redis commands (usec/row, calls):",
        ", ".join(f"{k.removeprefix('cmdstat_')} {v['usec'] / n:.1f} {v['calls']}" for k, v in top),
    )


def run_naive(workdir: Path, url: str, n: int, redis: RedisServer) -> float:
    redis.client().flushall()
    settings, store = storm(url, n, redis.url)
    worker = CeleryProc("worker", settings.env(), workdir, "naive", app="bench.naive_plane").wait_ready()
    try:
        app = make_app(settings)
        with store.session(readonly=True) as s:
            due = [row.id for row in queries.due_expired(s, now=time.time(), limit=n)]
        start = time.perf_counter()
        for row_id in due:
            app.send_task("naive.expire", (row_id,), queue="maintenance")  # bench.naive_plane's queue
        wait_for("the naive plane", lambda: not running_left(store), 900, every=0.1)
        seconds = time.perf_counter() - start
    finally:
        worker.stop()
    return n / seconds


def at_defaults(workdir: Path, url: str, n: int, redis: RedisServer) -> tuple[float, float, float]:
    """A storm at default settings: (rows/s, seconds to clear, worker RSS in MB afterwards)."""
    redis.client().flushall()
    settings, store = storm(url, n, redis.url)
    run = PlaneRun(workdir, settings, store, redis, 2)
    try:
        seconds = run.clear()
        return n / seconds, seconds, run.rss_mb()
    finally:
        run.stop()


def steady_p99(workdir: Path, url: str, n: int, redis: RedisServer) -> tuple[float, float]:
    """Leases ending one by one over a few ticks at default settings: p99 of lease end → re-offer."""
    redis.client().flushall()
    base = Settings()
    start = time.time()
    leases = sorted(start + random.uniform(1, 3 * base.tick_seconds) for _ in range(n))
    settings, store = storm(url, n, redis.url, leases=leases)
    run = PlaneRun(workdir, settings, store, redis, 2)
    try:
        run.clear()
    finally:
        run.stop()
    with store.session(readonly=True) as s:
        delays = sorted(float(d) for d in s.scalars(text("SELECT updated_at - lease_until FROM assignments")))
    return delays[int(0.99 * (len(delays) - 1))], base.tick_seconds


def postgres_url() -> str | None:
    try:
        admin = create_engine(PG_URL, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 3})
        name = f"poolkeeper_storm_{uuid.uuid4().hex[:8]}"
        with admin.connect() as conn:
            conn.execute(text(f"CREATE DATABASE {name}"))
        admin.dispose()
    except Exception:
        return None
    return PG_URL.rsplit("/", 1)[0] + "/" + name


def drop_database(url: str) -> None:
    admin = create_engine(PG_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f"DROP DATABASE IF EXISTS {url.rsplit('/', 1)[1]} WITH (FORCE)"))
    admin.dispose()


Fresh = Callable[[str], tuple[Path, str]]  # name -> (a new folder, a new database's URL)


class Backend:
    """Fresh databases of one kind, one per run: SQLite files in new folders, or PostgreSQL
    databases (dropped by ``clean``, after each run)."""

    def __init__(self, name: str, root: Path) -> None:
        self.name, self.root = name, root
        self.created: list[str] = []

    @property
    def title(self) -> str:
        return "SQLite" if self.name == "sqlite" else "PostgreSQL"

    def fresh(self, name: str) -> tuple[Path, str]:
        d = self.root / f"{name}-{uuid.uuid4().hex[:6]}"
        d.mkdir()
        if self.name == "sqlite":
            return d, f"sqlite:///{d}/pool.db"
        url = postgres_url()
        if url is None:
            raise RuntimeError("PostgreSQL is not reachable")
        self.created.append(url)
        return d, url

    def clean(self) -> None:
        while self.created:
            drop_database(self.created.pop())


MODES = ("u", "b", "b'", "a", "at", "a'", "a''", "a''h", "a0", "aT")
BASES = ("u", "b", "a", "at")  # every ratio's denominator: always run


_SINK: list[Any] = []


def traced() -> dict[str, str]:
    """``OTEL_*`` that export to one receiver in this process, started at first use (aT)."""
    if not _SINK:
        from poolkeeper.testing.otlp import Receiver

        _SINK.append(Receiver(decode=False))
    return dict(_SINK[0].env(delay_ms=None))


def compare(
    n: int,
    rounds: int,
    naive_rows: int | None,
    redis: RedisServer,
    backend: Backend,
    modes: Collection[str] = MODES,
) -> None:
    fresh = backend.fresh
    best: dict[str, float] = {}
    spread = range(50, n, 100)
    for _ in range(rounds):  # interleaved rounds, best of each: less noise
        runs: dict[str, Callable[[], float]] = {
            "u": lambda: run_set(fresh("u")[1], n),
            "b": lambda: run_raw(fresh("b")[1], n),
            "b'": lambda: run_store_monolithic(fresh("b2")[1], n),
            "a": lambda: plane_rate(*fresh("a"), n, redis),
            "at": lambda: plane_rate(*fresh("t"), n, redis, trigger=True),
            "a'": lambda: plane_rate(*fresh("p"), n, redis, poisoned=range(n // 100)),
            "a''": lambda: plane_rate(*fresh("ps"), n, redis, poisoned=spread),
            "a''h": lambda: plane_rate(*fresh("ph"), n, redis, poisoned=spread, history=True),
            "a0": lambda: plane_rate(*fresh("a0"), n, redis, app="bench.audit_off"),
            "aT": lambda: plane_rate(*fresh("aT"), n, redis, traced=traced()),
        }
        for name, fn in runs.items():
            if name not in modes and name not in BASES:
                continue
            try:
                best[name] = max(best.get(name, 0.0), fn())
            finally:
                backend.clean()
    u, b, a, at = (best[k] for k in BASES)
    lines = {
        "b'": lambda r: (
            f"(b') monolithic through the store's functions      {r:9.0f} rows/s   (b')/(b) = {r / b:.2f}"
        ),
        "a'": lambda r: (
            f"(a') plane, 1% poisoned rows, together (healthy)   {r:9.0f} rows/s   tax = {tax(r):.1%}"
        ),
        "a''": lambda r: (
            f"(a'') plane, 1% poisoned, one row in 100 (healthy) {r:9.0f} rows/s   tax = {tax(r):.1%}"
        ),
        "a''h": lambda r: (
            f"(a''h) the same, the poisoned with a failure history {r:7.0f} rows/s   tax = {tax(r):.1%}"
        ),
        "a0": lambda r: (
            f"(a0) plane without the audit trail                 {r:9.0f} rows/s"
            f"   audit cost = {max(0.0, 1 - a / r):.1%}"
        ),
        "aT": lambda r: (
            f"(aT) plane with tracing on, a span per expiry      {r:9.0f} rows/s   (aT)/(a) = {r / a:.2f}"
        ),
    }

    def tax(rate: float) -> float:  # what poison costs the healthy rows, against the trigger's own run
        return max(0.0, 1 - rate / at)

    print(f"\nstorm of {n} expired leases, {backend.title}, 2 worker processes, best of {rounds} rounds")
    print(f"(u)  one set UPDATE over the due rows, no isolation {u:9.0f} rows/s")
    print(f"(b)  monolithic on the DB-API, no isolation        {b:9.0f} rows/s   (b)/(u) = {b / u:.2f}")
    if "b'" in best:
        print(lines["b'"](best["b'"]))
    print(
        f"(a)  plane: per-row lock and outcome, set batches  {a:9.0f} rows/s"
        f"   (a)/(u) = {a / u:.2f}   (a)/(b) = {a / b:.2f}"
    )
    trigger = max(0.0, 1 - at / a)
    print(f"(at) plane, the poison's trigger on, none poisoned {at:9.0f} rows/s   trigger = {trigger:.1%}")
    for name in ("a'", "a''", "a''h", "a0", "aT"):
        if name in best:
            print(lines[name](best[name]))
    if naive_rows:
        try:
            c = run_naive(*fresh("c"), naive_rows, redis)
        finally:
            backend.clean()
        print(f"(c)  naive: message + lock + connection per row    {c:9.0f} rows/s   (c)/(b) = {c / b:.2f}")
    target = "(a)/(u) >= 1.0" if backend.name == "postgres" else "(a)/(b) >= 1.0"
    print(f"targets: {target}, poison tax < 10%, audit cost <= 10%, (aT)/(a) >= 0.9")


def defaults(big: int, redis: RedisServer, fresh: Fresh) -> None:
    base = Settings()
    small = at_defaults(*fresh("d1k"), 1_000, redis)
    rate, seconds, rss = at_defaults(*fresh("dbig"), big, redis)
    p99, tick = steady_p99(*fresh("steady"), 2_000, redis)
    print(
        f"\nat default settings (tick {base.tick_seconds:g}s, scan limit {base.scan_limit},"
        f" store batch {base.store_batch_size}):"
    )
    print(f"  {big} expired leases: {rate:9.0f} rows/s, cleared in {seconds:.1f}s")
    print(
        f"  worker RSS after {big}: {rss:.1f} MB; after 1,000: {small[2]:.1f} MB;"
        f" difference {rss - small[2]:+.1f} MB (target within 20 MB)"
    )
    print(f"  steady state, lease end -> re-offer, p99: {p99:.2f}s (target <= tick + 1s = {tick + 1:g}s)")


def postgres(n: int, redis: RedisServer, fresh: Fresh) -> None:
    pg = postgres_url()
    if pg is None:
        print("\nPostgreSQL: not reachable, skipped")
        return
    try:
        raw = run_raw(pg, n)
        print(f"\nPostgreSQL, storm of {n}: (b) monolithic on the DB-API {raw:9.0f} rows/s")
        for procs in (1, 2, 4):
            rate = plane_rate(fresh("pg")[0], pg, n, redis, procs=procs)
            print(f"  plane, {procs} worker process(es)  {rate:9.0f} rows/s   (a)/(b) = {rate / raw:.2f}")
    finally:
        drop_database(pg)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rows", type=int, nargs="+", default=[10_000, 50_000], help="storm sizes to compare"
    )
    parser.add_argument(
        "--backends", nargs="+", choices=["sqlite", "postgres"], default=["sqlite", "postgres"]
    )
    parser.add_argument("--big", type=int, default=100_000, help="rows of the default-settings storm")
    parser.add_argument("--naive-rows", type=int, default=2_000, help="the naive plane is slow; a sample")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds, best of each")
    parser.add_argument(
        "--quick", action="store_true", help="skip the naive, default-settings and worker-count runs"
    )
    parser.add_argument(
        "--profile", action="store_true", help="only the CPU per row of each process of (a), at each --rows"
    )
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=MODES,
        default=list(MODES),
        help=f"lines to run ({', '.join(BASES)} always)",
    )
    parser.add_argument(
        "--trace", action="store_true", help="only (aT) beside the bases: what tracing costs the plane (a)"
    )
    args = parser.parse_args()
    if args.trace:
        args.modes = ["aT"]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        redis = RedisServer(root).start()
        sqlite = Backend("sqlite", root)
        try:
            for name in args.backends:
                backend = Backend(name, root)
                if name == "postgres" and not postgres_reachable():
                    print("\nPostgreSQL: not reachable, skipped")
                    continue
                for i, n in enumerate(args.rows):
                    if args.profile:
                        try:
                            profile(*backend.fresh("prof"), n, redis)
                            floors(backend.fresh("floor")[1], n, redis)
                        finally:
                            backend.clean()
                        continue
                    naive = None if i or args.quick or name != "sqlite" else args.naive_rows
                    compare(n, args.rounds, naive, redis, backend, args.modes)
            if not (args.quick or args.profile):
                defaults(args.big, redis, sqlite.fresh)
                postgres(args.rows[0], redis, sqlite.fresh)
        finally:
            redis.stop()


def postgres_reachable() -> bool:
    """Whether PostgreSQL answers: a database made and dropped."""
    url = postgres_url()
    if url is not None:
        drop_database(url)
    return url is not None


if __name__ == "__main__":
    main()
