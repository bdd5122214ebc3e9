"""Heartbeats per second through ``poolctl serve`` (HTTP) beside the same calls on the store API (direct).

One run, the same store: a running grant on each of 64 ordinals, lease long
enough never to end. Each client is a thread that heartbeats its own grant
over and over (a new delivery id each time, so each call is one write), for
``--seconds`` per cell. Direct: ``PoolStore.heartbeat`` on an engine sized like
the server's. HTTP: against a real ``poolctl serve`` subprocess (one uvicorn
process), with the ordinal's token. Prints calls/s, p50 and p99 latency and the
HTTP/direct ratio, on SQLite and, when a server answers, PostgreSQL. Compare
ratios, not absolute figures (the machine is shared). ``--serves N`` runs N
``poolctl serve`` processes on their own ports, client ``i`` on the ``i mod N``-th.

The HTTP load (``--load``): ``raw`` (the default) sends each heartbeat as
prebuilt HTTP/1.1 bytes on a kept-alive socket per client and checks the answer
is a 200 ``applied``: a few tens of microseconds of the bench's CPU per call, so
the figure is the server's. ``client`` uses ``PoolClient`` (httpx), whose own
CPU per call (over a millisecond here, measured from ``/proc``) made the bench's
interpreter the bottleneck on two cores: that figure measures httpx as much as
the server.

    python bench/api_bench.py [--seconds 3] [--clients 1,8,64] [--load raw|client] [--serves 1]
                              [--postgres URL | --no-postgres] [--no-sqlite]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import secrets
import socket
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
from poolkeeper.api.app import server_store
from poolkeeper.embedded import ServeProc
from poolkeeper.workerhost.client import Grant, PoolClient
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


class RawHeartbeats:
    """One grant's heartbeats as prebuilt HTTP/1.1 requests on a kept-alive socket; each must be applied."""

    def __init__(self, url: str, token: str, offer: Offer) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.address = (host, int(port))
        self.sock: socket.socket | None = None
        self.head = (
            f"POST /v1/heartbeat HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {token}\r\n"
            "Content-Type: application/json\r\nContent-Length: {}\r\n\r\n"
        )
        self.offer = offer
        self.buffer = b""

    def __call__(self) -> None:
        try:
            self._beat()
        except Exception:
            self.close()  # as a client would: a fresh connection for the next call
            raise

    def _beat(self) -> None:
        if self.sock is None:  # a connection idle past the server's keep-alive was closed
            self.sock = socket.create_connection(self.address)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.buffer = b""
        body = json.dumps(envelope(self.offer)).encode()
        self.sock.sendall(self.head.format(len(body)).encode() + body)
        while b"\r\n\r\n" not in self.buffer:
            self.buffer += self._recv()
        head, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        while len(self.buffer) < length:
            self.buffer += self._recv()
        answer, self.buffer = self.buffer[:length], self.buffer[length:]
        if not head.startswith(b"HTTP/1.1 200") or b'"applied"' not in answer:
            raise AssertionError(f"{head.splitlines()[0]!r}: {answer[:200]!r}")

    def _recv(self) -> bytes:
        assert self.sock is not None
        got = self.sock.recv(65536)
        if not got:
            raise ConnectionError("the server closed the connection")
        return got

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def grants(store: PoolStore) -> list[Offer]:
    offers = []
    for i in range(ORDINALS):
        store.add_run(board="bench", task_id=f"t{i}", run_id=1, ordinal=i, payload={"i": i})
        got = store.offer(i, owner=f"bench-{i}")
        assert got is not None
        offers.append(got)
    return offers


def bench_backend(
    name: str, url: str, workdir: Path, clients: list[int], seconds: float, load: str, serves: int = 1
) -> list[tuple[Any, ...]]:
    settings = Settings(database_url=url, board_url=url, pool_size=ORDINALS, lease_seconds=LEASE)
    store = server_store(settings)  # the same engine options as the server's
    store.migrate()
    offers = grants(store)
    secret = secrets.token_hex(32)
    servers = [
        ServeProc(settings.env(), workdir, secret=secret, name=f"serve-{name}-{k}") for k in range(serves)
    ]
    rows = []
    try:
        for server in servers:
            server.wait_ready()
        http = [  # client i on server i mod --serves
            http_heartbeats(load, servers[i % serves].url, tokens.ordinal_token(secret, o.ordinal), o)
            for i, o in enumerate(offers)
        ]
        hammer(8, 1.0, lambda i: http[i]())  # warm up: connections, thread pool, caches
        hammer(8, 1.0, lambda i: store.heartbeat(envelope(offers[i])))
        for n in clients:
            direct = hammer(n, seconds, lambda i: store.heartbeat(envelope(offers[i])))
            over_http = hammer(n, seconds, lambda i: http[i]())
            rows.append((name, n, direct, over_http))
            print(
                f"  {name} {n:>2} clients: direct {direct.rate:7.0f}/s  http {over_http.rate:7.0f}/s",
                flush=True,
            )
        for c in http:
            c.close()  # type: ignore[attr-defined]
    finally:
        for server in servers:
            server.stop()
        store.engine.dispose()
    return rows


def http_heartbeats(load: str, url: str, token: str, offer: Offer) -> Callable[[], object]:
    """A callable sending one heartbeat of ``offer``'s grant over HTTP (``--load``)."""
    if load == "raw":
        return RawHeartbeats(url, token, offer)
    client = PoolClient(url, token, tries=1, timeout=30)
    grant = Grant(**vars(offer), lease_seconds=LEASE)
    call = functools.partial(client.heartbeat, grant)
    call.close = client.close  # type: ignore[attr-defined]
    return call


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
    parser.add_argument("--load", choices=("raw", "client"), default="raw", help="HTTP load generator")
    parser.add_argument("--postgres", default=PG_URL)
    parser.add_argument("--no-postgres", action="store_true")
    parser.add_argument("--no-sqlite", action="store_true")
    parser.add_argument("--serves", type=int, default=1, help="serve processes, clients spread over them")
    args = parser.parse_args()
    clients = [int(c) for c in args.clients.split(",")]
    assert all(1 <= c <= ORDINALS for c in clients), f"clients: 1..{ORDINALS}"
    rows = []
    with tempfile.TemporaryDirectory(prefix="poolkeeper-api-bench-") as tmp:
        work = Path(tmp)
        run = (clients, args.seconds, args.load, args.serves)
        if not args.no_sqlite:
            rows += bench_backend("sqlite", f"sqlite:///{work}/pool.db", work, *run)
        if not args.no_postgres:
            with postgres_database(args.postgres) as pg:
                if pg is not None:
                    rows += bench_backend("postgres", pg, work, *run)
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
    print("\ntargets (issue 20, item 3): >= 2,000/s at 8 clients, >= 1.0x direct at 64, p99 < 50 ms")
    for name, n, d, h in rows:
        if n == 8:
            goal, ok = f"{h.rate:.0f}/s >= 2,000/s", h.rate >= 2000
        elif n == 64:
            goal, ok = f"{h.rate / d.rate:.2f}x >= 1.0x", h.rate >= d.rate
        else:
            continue
        ok = ok and h.pct(99) < 50
        print(f"  {name} {n} clients: {'met' if ok else 'NOT met'} ({goal}, p99 {h.pct(99):.1f} ms)")


if __name__ == "__main__":
    main()
