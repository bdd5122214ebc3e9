"""An idle worker's offer waits on ``serve`` and is answered the moment its ordinal has a run.

A real ``poolctl serve`` over a SQLite store, a real redis-server for the plane's wake-ups
(``tasks.events``), and the worker's own client; the run is added to the store the way
materialize adds it, and the wake-up is published as the plane's workers publish it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from core.settings import Settings
from poolkeeper import tokens
from poolkeeper.embedded import RedisServer, ServeProc, wait_for
from poolkeeper.workerhost.client import Grant, PoolClient
from store import PoolStore, presence
from tasks.events import Events

SECRET = "8c1f0e5b7a2d94c3e6f1a0b8d7c2e5f49a3b6c1d0e7f2a5b8c9d4e1f0a6b3c7d"


@dataclass
class Pool:
    serve: ServeProc
    store: PoolStore
    events: Events
    client: PoolClient


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[Pool]:
    redis = RedisServer(tmp_path).start()
    url = f"sqlite:///{tmp_path}/pool.db"
    settings = Settings(
        database_url=url, board_url=url, redis_url=redis.url, pool_size=2, offer_wait_seconds=60
    )
    store = PoolStore.from_settings(settings)
    store.migrate()
    serve = ServeProc(settings.env(), tmp_path, secret=SECRET).wait_ready()
    client = PoolClient(serve.url, tokens.ordinal_token(SECRET, 0))
    try:
        yield Pool(serve, store, Events.from_settings(settings, redis.url), client)
    finally:
        client.close()
        serve.stop()
        store.engine.dispose()
        redis.stop()


def offering(pool: Pool, wait: float) -> tuple[threading.Thread, dict[str, Any]]:
    """Ordinal 0's offer, waiting up to ``wait`` seconds, in a thread: its answer and when it came."""
    got: dict[str, Any] = {}

    def ask() -> None:
        started = time.monotonic()
        try:
            got["grant"] = pool.client.offer(0, "w-1", wait=wait)
        except Exception as err:
            got["error"] = err
        got["seconds"] = time.monotonic() - started

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    return thread, got


def waiting(pool: Pool, thread: threading.Thread) -> None:
    """Given the offer on the server, waiting: it has asked the store (noted the worker) and not answered."""

    wait_for("the offer to reach the server", lambda: _noted(pool), 10)
    assert thread.is_alive(), "the offer did not wait"


def test_an_idle_offer_is_answered_when_its_ordinal_is_assigned_a_run(pool: Pool) -> None:
    thread, got = offering(pool, wait=50)
    waiting(pool, thread)
    pool.store.add_run(board="b", task_id="t1", run_id=1, ordinal=0, payload={"title": "t1"})
    pool.events.assigned([0])
    thread.join(20)
    assert isinstance(got.get("grant"), Grant), got
    assert got["grant"].task_id == "t1"
    assert got["seconds"] < 20, "answered when the run came, not when the wait ran out"


def test_a_lost_wake_up_costs_at_most_a_look_again(pool: Pool) -> None:
    thread, got = offering(pool, wait=50)
    waiting(pool, thread)
    pool.store.add_run(board="b", task_id="t1", run_id=1, ordinal=0, payload={"title": "t1"})  # no wake-up
    thread.join(20)
    assert isinstance(got.get("grant"), Grant), got


def test_an_offer_with_nothing_to_take_waits_as_asked_then_answers_null(pool: Pool) -> None:
    thread, got = offering(pool, wait=1.5)
    thread.join(20)
    assert got.get("grant", "missing") is None, got
    assert got["seconds"] >= 1.5


def test_the_server_caps_a_wait_at_its_setting(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/pool.db"
    settings = Settings(database_url=url, board_url=url, redis_url="", pool_size=1, offer_wait_seconds=0.5)
    store = PoolStore.from_settings(settings)
    store.migrate()
    serve = ServeProc(settings.env(), tmp_path, local_only=True).wait_ready()
    try:
        with PoolClient(serve.url) as client:
            started = time.monotonic()
            assert client.offer(0, "w-1", wait=50) is None
            assert time.monotonic() - started < 40, "waited for what was asked, past POOL_OFFER_WAIT_SECONDS"
    finally:
        serve.stop()
        store.engine.dispose()


def test_a_stopping_server_ends_its_waiting_offers_at_once(pool: Pool) -> None:
    thread, got = offering(pool, wait=50)
    waiting(pool, thread)
    started = time.monotonic()
    os.kill(pool.serve.proc.pid, signal.SIGTERM)
    thread.join(20)
    pool.serve.proc.wait(20)
    # Then the offer was answered (null) and serve stopped, without holding the stop for its grace period
    assert got.get("grant", "missing") is None, got
    assert time.monotonic() - started < 8, "the stop waited on the open offer (uvicorn's 10 s grace)"


def test_an_offer_that_asks_to_wait_too_long_is_refused_by_name(pool: Pool) -> None:
    import httpx

    answer = httpx.post(
        f"{pool.serve.url}/v1/offer",
        json={"ordinal": 0, "owner": "w-1", "wait": 3600},
        headers={"Authorization": f"Bearer {tokens.ordinal_token(SECRET, 0)}"},
    )
    assert answer.status_code == 422
    assert "wait" in answer.text


def test_a_worker_killed_while_its_offer_waits_is_granted_nothing(pool: Pool, tmp_path: Path) -> None:
    # Given a worker process whose offer waits on the server, SIGKILLed mid-wait
    script = (
        "import sys; from poolkeeper.workerhost.client import PoolClient; "
        "PoolClient(sys.argv[1], sys.argv[2]).offer(0, 'doomed', wait=50)"
    )
    token = tokens.ordinal_token(SECRET, 0)
    doomed = subprocess.Popen([sys.executable, "-c", script, pool.serve.url, token])
    try:
        wait_for("the doomed offer to reach the server", lambda: _noted(pool), 20)
    finally:
        doomed.kill()
        doomed.wait(10)
    # When a run is assigned to its ordinal, Then the dead request does not take it
    pool.store.add_run(board="b", task_id="t1", run_id=1, ordinal=0, payload={"title": "t1"})
    pool.events.assigned([0])
    with pytest.raises(AssertionError):  # nothing takes it within a few of the waiter's looks
        wait_for("the run to be granted", lambda: _state(pool) != "assigned", 3)
    # And the next worker gets it at once, on its first attempt
    got = pool.client.offer(0, "w-2")
    assert got is not None and (got.attempt, got.owner) == (1, "w-2")


def _noted(pool: Pool) -> bool:
    with pool.store.session(readonly=True) as s:
        return 0 in presence.staffed(s, 2, 0.0)


def _state(pool: Pool) -> str:
    with pool.store.session(readonly=True) as s:
        return str(s.execute(text("SELECT state FROM assignments WHERE task_id = 't1'")).scalar_one())
