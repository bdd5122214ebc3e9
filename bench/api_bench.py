"""Heartbeats per second through ``poolctl serve`` (HTTP) beside the same calls on the store API (direct).

One run, the same store: a running grant on each of 64 ordinals, lease long
enough never to end. Each client is a thread that heartbeats its own grant
over and over (a new delivery id each time, so each call is one write
transaction), for ``--seconds`` per cell. Direct: ``PoolStore.heartbeat`` on
an engine sized like the server's. HTTP: ``PoolClient.heartbeat`` with the
ordinal's token against a real ``poolctl serve`` subprocess (one uvicorn
process). Prints calls/s, p50 and p99 latency and the HTTP/direct ratio, on
SQLite and, when a server answers, PostgreSQL. Compare ratios, not absolute
figures (the machine is shared; the client threads share one interpreter).

    python bench/api_bench.py [--seconds 3] [--clients 1,8,64] [--postgres URL | --no-postgres]
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, text

from core.settings import Settings
from poolkeeper import tokens
from poolkeeper.client import Grant, PoolClient
from poolkeeper.embedded import ServeProc
from poolkeeper.server.app import server_store
from store import Offer, PoolStore

ORDINALS = 64
LEASE = 24 * 3600.0
PG_URL = os.environ.get("POOL_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


@dataclass
class Cell:
    calls: int
    errors: int
    seconds: float
    latencies: list[float]

    @property
    def rate(self) -> float:
        return self.calls / self.seconds

    def pct(self, q: float) -> float:
        if not self.latencies:
            return float("nan")
        return statistics.quantiles(self.latencies, n=100, method="inclusive")[int(q) - 1] * 1000


def hammer(clients: int, seconds: float, call: Callable[[int], object]) -> Cell:
    """``clients`` threads, thread ``i`` calling ``call(i)`` until the time is up."""
    latencies: list[list[float]] = [[] for _ in range(clients)]
    errors = [0] * clients
    start = threading.Barrier(clients + 1)
    deadline = 0.0

    def run(i: int) -> None:
        start.wait()
        mine = latencies[i]
        while (t0 := time.perf_counter()) < deadline:
            try:
                call(i)
            except Exception:
                errors[i] += 1
                continue
            mine.append(time.perf_counter() - t0)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    deadline = time.perf_counter() + seconds
    began = time.perf_counter()
    start.wait()
    for t in threads:
        t.join()
    flat = [x for lane in latencies for x in lane]
    return Cell(len(flat), sum(errors), time.perf_counter() - began, flat)


def envelope(o: Offer) -> dict[str, object]:
    return {
        "delivery_id": uuid.uuid4().hex,
        "board": o.board,
        "task_id": o.task_id,
        "run_id": o.run_id,
        "worker_ordinal": o.ordinal,
        "attempt": o.attempt,
        "fence": o.fence,
        "payload_digest": o.payload_digest,
    }


def grants(store: PoolStore) -> list[Offer]:
    offers = []
    for i in range(ORDINALS):
        store.add_run(board="bench", task_id=f"t{i}", run_id=1, ordinal=i, payload={"i": i})
        got = store.offer(i, owner=f"bench-{i}")
        assert got is not None
        offers.append(got)
    return offers


def bench_backend(
    name: str, url: str, workdir: Path, clients: list[int], seconds: float
) -> list[tuple[Any, ...]]:
    settings = Settings(database_url=url, board_url=url, pool_size=ORDINALS, lease_seconds=LEASE)
    store = server_store(settings)  # the same engine options as the server's
    store.migrate()
    offers = grants(store)
    secret = secrets.token_hex(32)
    server = ServeProc(settings.env(), workdir, secret=secret, name=f"serve-{name}")
    rows = []
    try:
        server.wait_ready()
        http = [
            PoolClient(server.url, tokens.ordinal_token(secret, i), tries=1, timeout=30)
            for i in range(ORDINALS)
        ]
        held = [Grant(**vars(o), lease_seconds=LEASE) for o in offers]
        hammer(8, 1.0, lambda i: http[i].heartbeat(held[i]))  # warm up: connections, thread pool, caches
        hammer(8, 1.0, lambda i: store.heartbeat(envelope(offers[i])))
        for n in clients:
            direct = hammer(n, seconds, lambda i: store.heartbeat(envelope(offers[i])))
            over_http = hammer(n, seconds, lambda i: http[i].heartbeat(held[i]))
            rows.append((name, n, direct, over_http))
            print(
                f"  {name} {n:>2} clients: direct {direct.rate:7.0f}/s  http {over_http.rate:7.0f}/s",
                flush=True,
            )
        for c in http:
            c.close()
    finally:
        server.stop()
        store.engine.dispose()
    return rows


@contextmanager
def postgres_database(url: str) -> Iterator[str | None]:
    try:
        admin = create_engine(url, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 3})
        name = f"poolkeeper_bench_{uuid.uuid4().hex[:8]}"
        with admin.connect() as conn:
            conn.execute(text(f"CREATE DATABASE {name}"))
    except Exception as err:
        print(f"PostgreSQL skipped: {type(err).__name__}: {str(err).splitlines()[0][:120]}")
        yield None
        return
    try:
        yield url.rsplit("/", 1)[0] + "/" + name
    finally:
        with admin.connect() as conn:
            conn.execute(text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        admin.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="per cell")
    parser.add_argument("--clients", default="1,8,64")
    parser.add_argument("--postgres", default=PG_URL)
    parser.add_argument("--no-postgres", action="store_true")
    args = parser.parse_args()
    clients = [int(c) for c in args.clients.split(",")]
    assert all(1 <= c <= ORDINALS for c in clients), f"clients: 1..{ORDINALS}"
    rows = []
    with tempfile.TemporaryDirectory(prefix="poolkeeper-api-bench-") as tmp:
        work = Path(tmp)
        rows += bench_backend("sqlite", f"sqlite:///{work}/pool.db", work, clients, args.seconds)
        if not args.no_postgres:
            with postgres_database(args.postgres) as pg:
                if pg is not None:
                    rows += bench_backend("postgres", pg, work, clients, args.seconds)
    print()
    head = (
        "backend",
        "clients",
        "direct/s",
        "p50 ms",
        "p99 ms",
        "http/s",
        "p50 ms",
        "p99 ms",
        "http/direct",
        "errors",
    )
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for name, n, d, h in rows:
        cells = (
            name,
            n,
            f"{d.rate:.0f}",
            f"{d.pct(50):.1f}",
            f"{d.pct(99):.1f}",
            f"{h.rate:.0f}",
            f"{h.pct(50):.1f}",
            f"{h.pct(99):.1f}",
            f"{h.rate / d.rate:.2f}x",
            f"{d.errors}/{h.errors}",
        )
        print("| " + " | ".join(str(c) for c in cells) + " |")
    for name, n, d, h in rows:
        if name == "sqlite" and n == 8:
            ok = h.rate >= 0.5 * d.rate and h.pct(99) < 50
            print(
                f"\ntarget (SQLite, 8 clients: HTTP >= 0.5x direct, p99 < 50 ms): "
                f"{'met' if ok else 'NOT met'} ({h.rate / d.rate:.2f}x, p99 {h.pct(99):.1f} ms)"
            )


if __name__ == "__main__":
    main()
