"""Scale-out on PostgreSQL, and memory and growth: how the pool grows past one process.

One fresh PostgreSQL database (dropped at the end), one run:

- **Heartbeats over HTTP** through 1, 2 and 4 ``poolctl serve`` processes on their own
  ports over the one store, the client connections spread evenly over them; and the
  idle worker's ``offer`` poll (an ordinal with nothing to run) the same way. 30,000
  running rows, each connection cycling through its own share of them, so an ordinal is
  heartbeated every several seconds and its presence upsert is written as in
  production (a heartbeat every lease/3 = 30 s is always past the 5 s presence gate).
  The load generator is cheap on purpose: client *processes*, each with a few threads,
  each thread one keep-alive socket sending the bytes ``PoolClient`` sends (the ordinal's
  token, a new delivery id per heartbeat) and checking each answer (200, ``applied``).
- **The storm** (``bench/storm.py``'s expired-lease storm, its ``storm`` and ``PlaneRun``):
  rows re-offered per second by one Celery worker with ``-c`` 1, 2 and 4 prefork
  processes, and by 1, 2 and 4 separate workers of ``-c 1`` (what separate worker
  hosts would be; on one machine both share the same two cores).
- Each cell prints its CPU, in cores, per process group, from ``/proc/PID/stat``
  (utime + stime): the serve processes or the Celery workers (every process of their
  groups), the PostgreSQL backends of this database, PostgreSQL's background processes
  (walwriter, checkpointer...: shared with anything else on the machine), Redis, the
  client processes (their own ``process_time``), this process (the storm's scanner and
  its polling), and what else the machine did (``/proc/stat``, other users included).

``--memory`` (on by default; ``--only memory`` alone): the RSS of one serve process
after 2,000 heartbeats and after 100,000 more; a Celery worker's RSS after a
1,000-row and after a 100,000-row storm at default settings (``bench/storm.py``'s
``at_defaults``); bytes per delivery record and per audit event; and the scanners' due
queries (expire with 2,000 due rows, results and lease_failures with none) on a table
of 10,000, 100,000 and 1,000,000 rows, on PostgreSQL and SQLite.

Where it stops on this 2-core machine, and why (docs/design.md, "At scale: 100,000
ordinals"): heartbeats are CPU-bound from the first replica on. Each costs about 3.3 ms
of serve CPU and 1.1 ms of PostgreSQL CPU, so two cores cap the machine near 450/s
however many replicas run; the CPU columns show both cores busy in every cell. What more
replicas buy here is fewer requests in flight per replica: past its 8 pooled
connections a replica opens and closes a PostgreSQL connection per request ("PG sessions
opened", and "pg exited": the CPU of backends that ended within the cell), and at 4
replicas of 8 connections that churn is gone. The storm scales past 2 processes on 2
cores because one worker process is bound by its batches' round trips, not by its CPU
(about 40 µs a row in the worker, 80 µs in PostgreSQL); it stops when PostgreSQL's
backends and the workers together fill the cores. The client processes stay under a
tenth of a core.

    python bench/scale.py [--only scale|memory] [--quick] [--seconds S] [--clients C]
        [--client-procs P] [--storm-rows N] [--heartbeats N] [--big N] [--scan-sizes A,B,C]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import re
import secrets
import socket
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, text

from bench.api_bench import PG_URL, postgres_database
from bench.storm import TICK, PlaneRun, at_defaults, cpu_of, proc_stat, storm
from core.settings import Settings
from core.validate import canonical_json, sha256
from poolkeeper import tokens
from poolkeeper.embedded import CeleryProc, RedisServer, ServeProc
from store import PoolStore, queries
from store.models import RowState
from tasks import gc
from tasks.coordination import LocalCoordination
from tasks.plane import Plane

HEARTBEAT_ROWS = 30_000  # running rows the heartbeats cycle through
IDLE_ORDINALS = 2_000  # ordinals with nothing to run, polled with offer
LEASE = 24 * 3600.0  # never ends during the bench
SCALE = (1, 2, 4)
DIGEST = sha256(canonical_json({}))
CORES = os.cpu_count() or 1
_LENGTH = re.compile(rb"content-length: *(\d+)", re.IGNORECASE)


# ---- CPU by process group, from /proc ----


def group_cpu(pgids: Iterable[int]) -> dict[int, float]:
    """CPU seconds of every live process in the process groups ``pgids``, by pid."""
    wanted, found = set(pgids), {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := proc_stat(int(entry))) and int(fields[2]) in wanted:
            found[int(entry)] = cpu_of(fields)
    return found


def machine_busy() -> float:
    """CPU seconds the whole machine was busy since boot (all cores, all users)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(values) - values[3] - values[4]) / TICK  # less idle and iowait


class Probe:
    """Snapshots of CPU seconds per group: named process groups, and PostgreSQL's processes."""

    def __init__(self, database: str) -> None:
        self.database = database
        self.admin = create_engine(PG_URL, isolation_level="AUTOCOMMIT")  # another database: not counted

    def pg_pids(self) -> tuple[list[int], list[int]]:
        """(this database's client backends, PostgreSQL's background processes)."""
        with self.admin.connect() as conn:
            rows = conn.execute(text("SELECT pid, datname, backend_type FROM pg_stat_activity")).all()
        ours = [r.pid for r in rows if r.datname == self.database and r.backend_type == "client backend"]
        return ours, [r.pid for r in rows if r.backend_type != "client backend"]

    def snapshot(self, groups: dict[str, list[int]]) -> dict[str, dict[int, float]]:
        ours, background = self.pg_pids()
        with self.admin.connect() as conn:
            sql = "SELECT sessions FROM pg_stat_database WHERE datname = :d"
            sessions = conn.scalar(text(sql), {"d": self.database})
        snap = {name: group_cpu(pgids) for name, pgids in groups.items()}
        snap["postgres"] = {p: cpu_of(f) for p in ours if (f := proc_stat(p))}
        snap["pg background"] = {p: cpu_of(f) for p in background if (f := proc_stat(p))}
        first = proc_stat(background[0]) if background else None
        reaped = proc_stat(int(first[1])) if first else None  # the postmaster: its exited children's CPU
        snap["pg exited"] = {0: (int(reaped[13]) + int(reaped[14])) / TICK if reaped else 0.0}
        snap["pg sessions"] = {0: float(sessions or 0)}
        snap["machine"] = {0: machine_busy()}
        snap["this process"] = {0: time.process_time()}
        return snap

    def close(self) -> None:
        self.admin.dispose()


def spent(before: dict[str, dict[int, float]], after: dict[str, dict[int, float]]) -> dict[str, float]:
    """CPU seconds per group between two snapshots (a process born meanwhile counts from 0)."""
    return {
        name: sum(cpu - before.get(name, {}).get(pid, 0.0) for pid, cpu in pids.items())
        for name, pids in after.items()
    }


def cores(cpu: dict[str, float], seconds: float, order: list[str]) -> str:
    """'serve 1.10, postgres 0.62, ... other 0.10 of 2 cores busy 1.95': each group in cores."""
    mine = sum(cpu[k] for k in order)
    parts = [f"{k} {cpu[k] / seconds:.2f}" for k in order]
    other = max(cpu["machine"] - mine, 0.0)
    parts.append(f"other {other / seconds:.2f}")
    return ", ".join(parts) + f" | machine {cpu['machine'] / seconds:.2f} of {CORES}"


# ---- the HTTP load generator: client processes, a keep-alive socket per thread ----


@dataclass(frozen=True)
class Spec:
    """What the client processes send: ``kind`` ("heartbeat" or "offer") to ordinals
    ``first..first+count-1``, connection ``j`` to ``ports[j % len(ports)]`` with the ordinals
    ``o`` where ``(o - first) % connections == j``; for ``seconds``, or ``calls`` per connection."""

    kind: str
    ports: tuple[int, ...]
    secret: str
    first: int
    count: int
    connections: int
    seconds: float = 0.0
    calls: int = 0
    warm: int = 20


@dataclass
class Lane:
    calls: int = 0
    errors: int = 0
    first_error: str = ""


def _requests(spec: Spec, j: int) -> list[tuple[bytes, bytes]]:
    """Connection ``j``'s requests, one per ordinal: (head and body up to the delivery id, the rest)."""
    port = spec.ports[j % len(spec.ports)]
    out = []
    for o in range(spec.first + j, spec.first + spec.count, spec.connections):
        if spec.kind == "heartbeat":
            fields = {"board": "scale", "task_id": f"hb{o}", "run_id": 1, "worker_ordinal": o, "attempt": 1}
            fields |= {"fence": o + 1, "payload_digest": DIGEST}
            pre, rest = b'{"delivery_id":"', canonical_json(fields)[1:].encode()
            rest = b'",' + rest
            length = len(pre) + 32 + len(rest)
        else:
            pre, rest = canonical_json({"ordinal": o, "owner": f"idle-{o}"}).encode(), b""
            length = len(pre)
        head = (
            f"POST /v1/{spec.kind} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Authorization: Bearer {tokens.ordinal_token(spec.secret, o)}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
        ).encode()
        out.append((head + pre, rest))
    return out


def _exchange(sock: socket.socket, request: bytes) -> tuple[bytes, bytes]:
    """Send one request, read one response (head, body) by its Content-Length."""
    sock.sendall(request)
    data = b""
    while (end := data.find(b"\r\n\r\n")) < 0:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed by the server")
        data += chunk
    head, body = data[:end], data[end + 4 :]
    match = _LENGTH.search(head)
    length = int(match.group(1)) if match else 0
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed by the server")
        body += chunk
    return head, body


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


class _Conn:
    """One keep-alive connection sending connection ``j``'s requests in turn, counting what came back."""

    def __init__(self, spec: Spec, j: int) -> None:
        self.port = spec.ports[j % len(spec.ports)]
        self.requests, self.i = _requests(spec, j), 0
        self.new_id = spec.kind == "heartbeat"  # each heartbeat its own delivery, so its own write
        self.expect = b'"applied"' if self.new_id else b'"grant":null'
        self.sock = _connect(self.port)
        self.lane = Lane()
        self.latencies: list[float] = []

    def call(self) -> None:
        pre, rest = self.requests[self.i % len(self.requests)]
        self.i += 1
        t0 = time.perf_counter()
        try:
            head, body = _exchange(
                self.sock, pre + os.urandom(16).hex().encode() + rest if self.new_id else pre
            )
        except OSError as err:
            self._failed(f"{type(err).__name__}: {err}")
            self._reconnect()
            return
        if head.startswith(b"HTTP/1.1 200") and self.expect in body:
            self.lane.calls += 1
            self.latencies.append(time.perf_counter() - t0)
        else:
            self._failed((head.split(b"\r\n", 1)[0] + b" " + body[:200]).decode(errors="replace"))
        if b"connection: close" in head.lower():
            self._reconnect()

    def _failed(self, why: str) -> None:
        self.lane.errors += 1
        self.lane.first_error = self.lane.first_error or why

    def _reconnect(self) -> None:
        self.sock.close()
        self.sock = _connect(self.port)


def _lane(
    spec: Spec, conn: _Conn, warmed: threading.Barrier, go: threading.Event, deadline: list[float]
) -> None:
    for _ in range(spec.warm):  # connections, the server's thread pool and caches
        conn.call()
    conn.lane, conn.latencies = Lane(), []
    warmed.wait()
    go.wait()
    if spec.calls:
        for _ in range(spec.calls):
            conn.call()
    else:
        while time.time() < deadline[0]:
            conn.call()
    conn.sock.close()


def client_process(spec: Spec, conns: list[int], ready: Any, go: Any, deadline: Any, out: Any) -> None:
    """One client process: a thread per connection in ``conns``; reports what it did and its CPU."""
    mine = [_Conn(spec, j) for j in conns]
    warmed, start, until = threading.Barrier(len(mine) + 1), threading.Event(), [0.0]
    threads = [
        threading.Thread(target=_lane, args=(spec, c, warmed, start, until), daemon=True) for c in mine
    ]
    for t in threads:
        t.start()
    warmed.wait()
    ready.put(os.getpid())
    go.wait()
    until[0] = deadline.value
    cpu0 = time.process_time()
    start.set()
    for t in threads:
        t.join()
    cpu = time.process_time() - cpu0
    errors = [c.lane.first_error for c in mine if c.lane.first_error]
    flat = [x for c in mine for x in c.latencies]
    out.put((sum(c.lane.calls for c in mine), sum(c.lane.errors for c in mine), errors[:1], flat, cpu))


@dataclass
class Load:
    calls: int
    errors: int
    first_error: str
    latencies: list[float]
    seconds: float
    cpu: dict[str, float]

    @property
    def rate(self) -> float:
        return self.calls / self.seconds

    def pct(self, q: int) -> float:
        return statistics.quantiles(self.latencies, n=100, method="inclusive")[q - 1] * 1000


def load(spec: Spec, procs: int, probe: Probe, serves: list[ServeProc]) -> Load:
    """Run ``spec`` from ``procs`` client processes, connections dealt round-robin to them."""
    ctx = mp.get_context("spawn")
    ready, out, go, deadline = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Value("d", 0.0)
    parts = [list(range(p, spec.connections, procs)) for p in range(min(procs, spec.connections))]
    children = [
        ctx.Process(target=client_process, args=(spec, part, ready, go, deadline, out)) for part in parts
    ]
    for c in children:
        c.start()
    for _ in children:
        ready.get(timeout=300)
    groups = {"serve": [s.proc.pid for s in serves]}
    before = probe.snapshot(groups)
    began = time.time()
    deadline.value = began + spec.seconds if spec.seconds else float("inf")
    go.set()
    got = [out.get(timeout=3600) for _ in children]
    seconds = time.time() - began
    after = probe.snapshot(groups)
    for c in children:
        c.join(30)
    cpu = spent(before, after)
    cpu["clients"] = sum(g[4] for g in got)
    errors = [e for g in got for e in g[2]]
    flat = [x for g in got for x in g[3]]
    return Load(
        sum(g[0] for g in got), sum(g[1] for g in got), errors[0] if errors else "", flat, seconds, cpu
    )


# ---- part 1: scale-out ----


def heartbeat_rows(store: PoolStore, n: int) -> None:
    """``n`` running rows, ordinal ``i`` holding fence ``i + 1`` under a lease that does not end."""
    now = time.time()
    with store.session() as s:
        s.execute(
            text(
                "INSERT INTO assignments (board, task_id, run_id, ordinal, state, attempt, fence, owner,"
                " lease_until, payload, payload_digest, created_at, updated_at, failures, next_attempt_at,"
                " quarantined) SELECT 'scale', 'hb' || i, 1, i, 'running', 1, i + 1, 'bench', :lease, '{}',"
                " :digest, :now, :now, 0, 0, false FROM generate_series(0, :n - 1) AS i"
            ),
            {"lease": now + LEASE, "digest": DIGEST, "now": now, "n": n},
        )
    with store.engine.connect() as conn:
        conn.execute(text("ANALYZE"))
        conn.commit()


HTTP_ORDER = ["serve", "postgres", "pg exited", "pg background", "clients"]


def serve_scaling(pg: str, work: Path, args: argparse.Namespace, probe: Probe) -> list[tuple[Any, ...]]:
    settings = Settings(
        database_url=pg, board_url=pg, pool_size=HEARTBEAT_ROWS + IDLE_ORDINALS, lease_seconds=LEASE
    )
    store = PoolStore.from_settings(settings)
    store.migrate()
    heartbeat_rows(store, HEARTBEAT_ROWS)
    secret = secrets.token_hex(32)
    serves = [ServeProc(settings.env(), work, secret=secret, name=f"serve{k}") for k in range(max(SCALE))]
    rows = []
    try:
        for s in serves:
            s.wait_ready()
        for kind, first, count in (
            ("heartbeat", 0, HEARTBEAT_ROWS),
            ("offer", HEARTBEAT_ROWS, IDLE_ORDINALS),
        ):
            for n in SCALE:
                ports = tuple(s.port for s in serves[:n])
                spec = Spec(kind, ports, secret, first, count, args.clients, seconds=args.seconds)
                got = load(spec, args.client_procs, probe, serves[:n])
                rows.append((kind, n, got))
                print(
                    f"  {kind:9} {n} serve: {got.rate:7.0f}/s  {cores(got.cpu, got.seconds, HTTP_ORDER)}",
                    flush=True,
                )
        with store.session(readonly=True) as session:
            size = session.scalar(
                text("SELECT pg_total_relation_size('deliveries') / GREATEST(count(*), 1) FROM deliveries")
            )
        print(f"  a delivery record (one per heartbeat) takes {size} bytes with its indexes")
    finally:
        for s in serves:
            s.stop()
        store.engine.dispose()
    return rows


STORM_ORDER = ["workers", "postgres", "pg exited", "pg background", "redis", "this process"]


def storm_cell(
    work: Path, pg: str, n: int, redis: RedisServer, workers: int, procs: int, probe: Probe
) -> tuple[float, dict[str, float], float]:
    """The expired-lease storm cleared by ``workers`` Celery workers of ``-c procs`` each."""
    redis.client().flushall()
    settings, store = storm(pg, n, redis.url, backoff_base_seconds=60)  # as bench/storm.py's plane_rate
    run = PlaneRun(work, settings, store, redis, procs)
    extra = [
        CeleryProc("worker", settings.env(), work, f"x{uuid.uuid4().hex[:6]}", concurrency=procs).wait_ready()
        for _ in range(workers - 1)
    ]
    assert redis.proc is not None
    groups = {"workers": [run.worker.proc.pid, *(w.proc.pid for w in extra)], "redis": [redis.proc.pid]}
    try:
        before = probe.snapshot(groups)
        seconds = run.clear()
        cpu = spent(before, probe.snapshot(groups))
    finally:
        for w in extra:
            w.stop()
        run.stop()
    return n / seconds, cpu, seconds


def storm_scaling(
    pg: str, work: Path, args: argparse.Namespace, probe: Probe, redis: RedisServer
) -> list[tuple[Any, ...]]:
    rows = []
    for label, shape in (("-c N", lambda k: (1, k)), ("N x -c 1", lambda k: (k, 1))):
        for n in SCALE:
            workers, procs = shape(n)
            rate, cpu, seconds = storm_cell(work, pg, args.storm_rows, redis, workers, procs, probe)
            rows.append((label, n, rate, cpu, seconds))
            print(
                f"  storm {label:8} N={n}: {rate:7.0f} rows/s  {cores(cpu, seconds, STORM_ORDER)}", flush=True
            )
    return rows


def print_scaling(
    http: list[tuple[Any, ...]], storms: list[tuple[Any, ...]], args: argparse.Namespace
) -> None:
    print(
        f"\nscale-out on PostgreSQL: {args.clients} client connections, {args.client_procs} client processes"
    )
    head = ["what", "processes", "per s", "x 1 process", "p50 ms", "p99 ms", "errors"]
    head += ["serve/worker µs CPU per call", "postgres µs", "client µs", "PG sessions opened"]
    head.append("machine busy (cores)")
    print("| " + " | ".join(head) + " |")
    print("|" + " --- |" * len(head))
    base: dict[str, float] = {}
    for kind, n, got in http:
        base.setdefault(kind, got.rate)
        c = got.cpu
        cells = [f"{kind} over HTTP", f"{n} serve", f"{got.rate:.0f}", f"{got.rate / base[kind]:.2f}"]
        cells += [
            f"{got.pct(50):.1f}",
            f"{got.pct(99):.1f}",
            f"{got.errors}" + (f" ({got.first_error})" if got.errors else ""),
        ]
        cells += [f"{1e6 * c[k] / max(got.calls, 1):.0f}" for k in ("serve", "postgres", "clients")]
        cells.append(f"{c['pg sessions']:.0f}")
        cells.append(f"{c['machine'] / got.seconds:.2f}")
        print("| " + " | ".join(cells) + " |")
    for label, n, rate, cpu, seconds in storms:
        base.setdefault(label, rate)
        rows = rate * seconds
        cells = [f"storm rows ({label})", f"{n}", f"{rate:.0f}", f"{rate / base[label]:.2f}", "", "", ""]
        cells += [f"{1e6 * cpu['workers'] / rows:.0f}", f"{1e6 * cpu['postgres'] / rows:.0f}", ""]
        cells.append(f"{cpu['pg sessions']:.0f}")
        cells.append(f"{cpu['machine'] / seconds:.2f}")
        print("| " + " | ".join(cells) + " |")


# ---- part 2: memory and growth ----


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def serve_memory(pg: str, work: Path, args: argparse.Namespace, probe: Probe) -> None:
    settings = Settings(database_url=pg, board_url=pg, pool_size=HEARTBEAT_ROWS, lease_seconds=LEASE)
    store = PoolStore.from_settings(settings)
    store.migrate()
    with store.session() as s:
        s.execute(text("DELETE FROM assignments"))  # a storm's rows hold the same ordinals
    heartbeat_rows(store, HEARTBEAT_ROWS)
    secret = secrets.token_hex(32)
    serve = ServeProc(settings.env(), work, secret=secret, name="serve-memory").wait_ready()
    try:
        idle = rss_mb(serve.proc.pid)
        clients = min(args.clients, 8)  # within the serve's 8 pooled connections: no connection churn
        spec = Spec("heartbeat", (serve.port,), secret, 0, HEARTBEAT_ROWS, clients, calls=2_000 // clients)
        load(spec, args.client_procs, probe, [serve])
        warm = rss_mb(serve.proc.pid)
        got = load(replace(spec, calls=max(args.heartbeats // clients, 1)), args.client_procs, probe, [serve])
        after = rss_mb(serve.proc.pid)
    finally:
        serve.stop()
        store.engine.dispose()
    print("\nmemory and growth (PostgreSQL)")
    print(f"  serve RSS: idle {idle:.1f} MB; after 2,000 heartbeats (baseline) {warm:.1f} MB;")
    print(
        f"    after {got.calls:,} more ({got.rate:.0f}/s, {got.errors} errors) {after:.1f} MB:"
        f" {after - warm:+.1f} MB, {after / warm:.2f}x the baseline (target within ±20 MB)"
    )


def worker_memory(pg: str, work: Path, args: argparse.Namespace, redis: RedisServer) -> None:
    _, _, small = at_defaults(work, pg, 1_000, redis)
    rate, seconds, big = at_defaults(work, pg, args.big, redis)
    print(
        f"  Celery worker RSS (default settings, -c 2): after a 1,000-row storm (baseline) {small:.1f} MB;"
        f" after a {args.big:,}-row storm ({rate:.0f} rows/s, {seconds:.1f}s) {big:.1f} MB:"
        f" {big - small:+.1f} MB, {big / small:.2f}x (target within 20 MB)"
    )
    store = PoolStore(pg)
    with store.session(readonly=True) as s:
        sql = "SELECT pg_total_relation_size('audit_events') / GREATEST(count(*), 1) FROM audit_events"
        size = s.scalar(text(sql))
    store.engine.dispose()
    print(f"  an audit event (one per moved row) takes {size} bytes with its index")


DUE = 2_000  # due rows at every size: the default scan limit's page
SCAN_REPEATS = 15
_FILL = (
    "INSERT INTO assignments (board, task_id, run_id, ordinal, state, attempt, fence, owner, lease_until,"
    " payload, payload_digest, created_at, updated_at, failures, next_attempt_at, quarantined)"
    " SELECT 'scan', '{kind}' || i, 1, i, '{state}', 1, i + 1, 'bench', {lease}, {payload}, :digest,"
    " :at, :at, 0, 0, false FROM {series}"
)


def _fill(store: PoolStore, kind: str, lo: int, hi: int, now: float) -> None:
    """Rows ``lo..hi-1`` of ``kind``: ``due`` (lease ended), ``live`` (lease ahead), ``old`` (finalized)."""
    if hi <= lo:
        return
    pg = store.engine.dialect.name == "postgresql"
    series = "generate_series(:lo, :hi - 1) AS s(i)" if pg else "seq"
    state, lease, payload = {
        "due": ("running", ":past", "'{}'"),
        "live": ("running", ":ahead", "'{}'"),
        "old": ("finalized", "NULL", "NULL"),
    }[kind]
    sql = _FILL.format(kind=kind, state=state, lease=lease, payload=payload, series=series)
    if not pg:
        sql = "WITH RECURSIVE seq(i) AS (SELECT :lo UNION ALL SELECT i + 1 FROM seq WHERE i < :hi - 1) " + sql
    with store.session() as s:
        values = {
            "lo": lo,
            "hi": hi,
            "digest": DIGEST,
            "at": now - 3600,
            "past": now - 60,
            "ahead": now + LEASE,
        }
        s.execute(text(sql), values)


SCANS: dict[str, Callable[..., list[queries.Due]]] = {
    "expire": queries.due_expired,
    "results": lambda s, **kw: queries.due_in_state(s, RowState.RESULT, **kw),
    "lease_failures": lambda s, **kw: queries.due_in_state(s, RowState.LEASE_FAILED, **kw),
}


def scan_cost(url: str, sizes: list[int]) -> list[tuple[int, dict[str, float]]]:
    """Median ms of each scanner's first page, as its tick reads it, at each table size."""
    store = PoolStore(url)
    store.migrate()
    with store.session() as s:
        s.execute(text("DELETE FROM assignments"))
    now, limit = time.time(), Settings().scan_limit
    _fill(store, "due", 0, DUE, now)
    live = old = 0
    out = []
    for size in sizes:
        want_live = max(size // 10 - DUE, 0)  # a tenth of the table live, the rest terminal
        _fill(store, "live", 10**7 + live, 10**7 + want_live, now)
        _fill(store, "old", 2 * 10**7 + old, 2 * 10**7 + size - DUE - want_live, now)
        live, old = want_live, size - DUE - want_live
        if store.engine.dialect.name == "postgresql":  # as autovacuum would after such growth
            with store.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                conn.execute(text("VACUUM ANALYZE assignments"))
        took: dict[str, float] = {}
        for name, due in SCANS.items():
            times = []
            for _ in range(3 + SCAN_REPEATS):  # the first three warm the pool and the plan cache
                t0 = time.perf_counter()
                with store.session(readonly=True) as s:
                    page = due(s, now=time.time(), limit=limit)
                times.append(time.perf_counter() - t0)
            assert len(page) == (DUE if name == "expire" else 0), (name, len(page))
            took[name] = statistics.median(times[3:]) * 1000
        out.append((size, took))
    store.engine.dispose()
    return out


def print_scan(backend: str, got: list[tuple[int, dict[str, float]]]) -> None:
    base = got[0][1]
    for size, took in got:
        cells = ", ".join(f"{name} {ms:.2f} ms ({ms / base[name]:.2f}x)" for name, ms in took.items())
        print(f"  {backend:10} {size:>9,} rows, {DUE} due: {cells}")


GC_SQL = {  # n delivery records and n audit events, all past the retention, in one statement each
    "deliveries": "INSERT INTO deliveries (delivery_id, assignment_id, kind, digest, created_at)"
    " SELECT 'd' || i, i, 'heartbeat', :digest, :at FROM {series}",
    "events": "INSERT INTO audit_events"
    " (row_id, kind, actor, from_state, to_state, attempt, fence, detail, at)"
    " SELECT i, 'grant', 'bench', 'assigned', 'running', 1, 1, '', :at FROM {series}",
}


def gc_pace(url: str, n: int) -> tuple[float, float, float]:
    """(records written per second, records gc deletes per second, the old cap's per second): n delivery
    records and n audit events past the retention, written in bulk, then one ``tasks.gc`` sweep."""
    settings = Settings(database_url=url, board_url=url)
    store = PoolStore.from_settings(settings)
    store.migrate()
    pg = store.engine.dialect.name == "postgresql"
    series = "generate_series(1, :n) AS s(i)" if pg else "seq"
    prefix = "" if pg else "WITH RECURSIVE seq(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM seq WHERE i < :n) "
    old = time.time() - 2 * settings.retention_seconds
    t0 = time.perf_counter()
    for sql in GC_SQL.values():
        with store.session() as s:
            s.execute(text(prefix + sql.format(series=series)), {"n": n, "digest": DIGEST, "at": old})
    wrote = 2 * n / (time.perf_counter() - t0)
    plane = Plane(settings, store, None, LocalCoordination())  # type: ignore[arg-type]
    t0 = time.perf_counter()
    got = gc.collect(plane, time.time())
    deleted = (got.deliveries + got.events) / (time.perf_counter() - t0)
    assert (got.deliveries, got.events, got.behind) == (n, n - 1, False), got  # the newest event stays
    store.engine.dispose()
    return wrote, deleted, 2 * 20 * settings.gc_batch / settings.gc_seconds  # 20 batches an interval, once


def print_gc(backend: str, n: int, pace: tuple[float, float, float]) -> None:
    wrote, deleted, cap = pace
    print(
        f"  gc, {backend:10} {n:,} old delivery records + {n:,} old audit events: deleted {deleted:,.0f}/s,"
        f" written in bulk {wrote:,.0f}/s ({deleted / wrote:.2f}x); the old cap of 20 batches an"
        f" interval deleted {cap:.1f}/s ({deleted / cap:,.0f}x less)"
    )


# ---- main ----


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("scale", "memory", "gc"), help="one part (default: all)")
    parser.add_argument("--quick", action="store_true", help="short cells and small sizes: a smoke run")
    parser.add_argument("--seconds", type=float, default=8.0, help="per HTTP cell")
    parser.add_argument("--clients", type=int, default=32, help="client connections")
    parser.add_argument("--client-procs", type=int, default=4, help="client processes")
    parser.add_argument("--storm-rows", type=int, default=50_000)
    parser.add_argument("--heartbeats", type=int, default=100_000, help="through one serve, for its RSS")
    parser.add_argument(
        "--big", type=int, default=100_000, help="rows of the big storm, for the worker's RSS"
    )
    parser.add_argument("--scan-sizes", default="10000,100000,1000000")
    parser.add_argument("--gc-records", type=int, default=200_000, help="of each kind, for gc's pace")
    args = parser.parse_args()
    if args.quick:
        args.seconds, args.storm_rows, args.heartbeats, args.big = 2.0, 5_000, 10_000, 10_000
        args.scan_sizes = "10000,100000"
    sizes = [int(n) for n in args.scan_sizes.split(",")]
    started = time.time()
    print(
        f"load at start: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="poolkeeper-scale-") as tmp, postgres_database(PG_URL) as pg:
        if pg is None:
            raise SystemExit("bench/scale.py needs PostgreSQL")
        work = Path(tmp)
        redis = RedisServer(work).start()
        probe = Probe(pg.rsplit("/", 1)[1])
        try:
            if args.only in (None, "scale"):
                http = serve_scaling(pg, work, args, probe)
                storms = storm_scaling(pg, work, args, probe, redis)
                print_scaling(http, storms, args)
            if args.only in (None, "memory"):
                serve_memory(pg, work, args, probe)
                worker_memory(pg, work, args, redis)
                print(f"  scan cost: each scanner's first page, median of {SCAN_REPEATS}, x smallest")
                print_scan("PostgreSQL", scan_cost(pg, sizes))
                print_scan("SQLite", scan_cost(f"sqlite:///{work}/scan.db", sizes))
            if args.only in (None, "memory", "gc"):
                print_gc("PostgreSQL", args.gc_records, gc_pace(pg, args.gc_records))
                print_gc("SQLite", args.gc_records, gc_pace(f"sqlite:///{work}/gc.db", args.gc_records))
        finally:
            probe.close()
            redis.stop()
    print(f"\n{time.time() - started:.0f}s; load at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
