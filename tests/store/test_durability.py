"""A writer killed with SIGKILL mid-loop: the store is intact and holds every acknowledged write."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from celery.exceptions import SoftTimeLimitExceeded
from sqlalchemy import text

from core import db
from core.errors import ConfigError
from core.settings import Settings
from store import PoolStore

WRITER = r"""
import sys, time
from core.settings import Settings
from store import PoolStore, transitions
store = PoolStore.from_settings(Settings(database_url=sys.argv[1], pool_size=1, lease_seconds=0.001))
i = 0
while True:
    i += 1
    store.add_run(board="b", task_id=f"t{i}", run_id=1, ordinal=0, payload={"i": i})
    offer = store.offer(0, owner="w")
    time.sleep(0.002)
    with store.session() as s:
        transitions.expire_many(s, [offer.row_id], max_attempts=1, now=time.time())  # -> lease_failed
    print(i, offer.fence, flush=True)  # acknowledged: committed before this line
"""


def test_sigkill_mid_write_loses_no_acknowledged_transition(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/pool.db"
    PoolStore.from_settings(Settings(database_url=url)).migrate()
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, url],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert proc.stdout is not None
    acked: list[tuple[int, int]] = []
    while len(acked) < 150:
        line = proc.stdout.readline()
        assert line, f"writer died early (rc={proc.poll()})"
        i, fence = map(int, line.split())
        acked.append((i, fence))
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)

    with sqlite3.connect(f"{tmp_path}/pool.db") as raw:
        assert raw.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    store = PoolStore.from_settings(Settings(database_url=url))
    with store.session(readonly=True) as s:
        rows = {r.task_id: (r.state, r.fence) for r in s.execute(text("SELECT * FROM assignments"))}
        live = s.scalar(text("SELECT count(*) FROM assignments WHERE state IN ('assigned','running')"))
    for i, fence in acked:
        assert rows[f"t{i}"] == ("lease_failed", fence)
    assert (live or 0) <= 1  # at most the write in flight when the kill landed


def _sqlite_table(path: Path, rows: int) -> None:
    raw = sqlite3.connect(path)
    raw.execute("PRAGMA journal_mode=WAL")
    raw.execute("CREATE TABLE t (v INTEGER)")
    raw.executemany("INSERT INTO t VALUES (?)", [(i,) for i in range(rows)])
    raw.commit()
    raw.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    raw.close()


def test_a_write_on_a_file_damaged_under_an_open_connection_is_a_config_error(tmp_path: Path) -> None:
    """Taking the write lock polls past a busy file only: any other refusal (here SQLite's
    "malformed") reaches ``translate`` as the same statement's error would."""
    path = tmp_path / "t.db"
    _sqlite_table(path, 5000)
    engine = db.make_engine(f"sqlite:///{path}", pool_size=1, max_overflow=0)
    with engine.begin() as conn:
        assert conn.execute(text("SELECT count(*) FROM t")).scalar() == 5000  # a pooled connection
    with open(path, "r+b") as f:
        f.truncate(1)
    with (
        pytest.raises(ConfigError, match=r"damaged or truncated|not a SQLite database"),
        db.transient_errors("store"),
        engine.begin() as conn,
    ):
        conn.execute(text("INSERT INTO t VALUES (1)"))


class _InterruptedAfterPragma(sqlite3.Connection):
    """A connection whose worker is interrupted (a time limit) right after it turned the busy wait off."""

    armed = True

    def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
        cursor = super().execute(sql, *args)
        if sql == "PRAGMA busy_timeout = 0" and _InterruptedAfterPragma.armed:
            _InterruptedAfterPragma.armed = False
            raise SoftTimeLimitExceeded
        return cursor


def test_an_interrupted_begin_leaves_the_pooled_connection_its_busy_timeout(tmp_path: Path) -> None:
    path = tmp_path / "t.db"
    _sqlite_table(path, 10)
    engine = db.make_engine(
        f"sqlite:///{path}",
        pool_size=1,
        max_overflow=0,
        connect_args={"factory": _InterruptedAfterPragma, "timeout": db.SQLITE_BUSY_TIMEOUT_MS / 1000},
    )
    with pytest.raises(SoftTimeLimitExceeded), engine.begin() as conn:
        conn.execute(text("INSERT INTO t VALUES (1)"))
    pooled = engine.raw_connection()  # the same connection, no BEGIN (which would set it again)
    try:
        timeout = pooled.cursor().execute("PRAGMA busy_timeout").fetchone()
        assert timeout == (db.SQLITE_BUSY_TIMEOUT_MS,)
    finally:
        pooled.close()


def test_threads_and_processes_writing_at_once_all_get_their_turn(tmp_path: Path) -> None:
    """One thread of each process polls for the write lock, the others queue behind it: every
    write of 8 threads in each of 2 processes lands, none refused as busy. The busy timeout is made
    long here, so only a writer never given its turn, not a loaded machine's slow turns, fails it."""
    path = tmp_path / "t.db"
    _sqlite_table(path, 0)
    script = (
        "import sys, threading\n"
        "from sqlalchemy import text\n"
        "from core import db\n"
        "db.SQLITE_BUSY_TIMEOUT_MS = 60_000\n"
        "engine = db.make_engine(sys.argv[1], pool_size=8, max_overflow=0)\n"
        "errors = []\n"
        "def write(who):\n"
        "    try:\n"
        "        for i in range(40):\n"
        "            with db.transient_errors('t'), engine.begin() as conn:\n"
        "                conn.execute(text('INSERT INTO t VALUES (:v)'), {'v': i})\n"
        "    except Exception as err:\n"
        "        errors.append(repr(err))\n"
        "threads = [threading.Thread(target=write, args=(n,)) for n in range(8)]\n"
        "[t.start() for t in threads]\n"
        "[t.join() for t in threads]\n"
        "sys.exit('; '.join(errors) or None)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    procs = [
        subprocess.Popen([sys.executable, "-c", script, f"sqlite:///{path}"], env=env, stderr=subprocess.PIPE)
        for _ in range(2)
    ]
    errors = [p.communicate(timeout=300)[1].decode() for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errors
    with sqlite3.connect(path) as raw:
        assert raw.execute("SELECT count(*) FROM t").fetchone() == (2 * 8 * 40,)


def test_a_writer_of_one_file_never_waits_on_the_pollers_of_another(tmp_path: Path) -> None:
    """This thread holds a's write lock while another polls for it, then writes b: b's turn
    is b's own, so it goes at once, commits, and a's poller gets a's lock in its turn."""
    a, b = tmp_path / "a.db", tmp_path / "b.db"
    _sqlite_table(a, 0)
    _sqlite_table(b, 0)
    on_a, on_b = db.make_engine(f"sqlite:///{a}"), db.make_engine(f"sqlite:///{b}")
    errors: list[BaseException] = []

    def second_writer_of_a() -> None:
        try:
            with db.transient_errors("a"), on_a.begin() as conn:
                conn.execute(text("INSERT INTO t VALUES (2)"))
        except Exception as err:
            errors.append(err)

    waiter = threading.Thread(target=second_writer_of_a)
    with on_a.begin() as conn:
        conn.execute(text("INSERT INTO t VALUES (1)"))
        waiter.start()
        deadline = time.monotonic() + 10
        while not db._poller(str(a)).locked():  # the waiter is polling for a's write lock
            assert time.monotonic() < deadline, "the second writer never started polling"
            time.sleep(0.001)
        with on_b.begin() as other:
            other.execute(text("INSERT INTO t VALUES (1)"))
    waiter.join()
    assert not errors
    for path, rows in ((a, 2), (b, 1)):
        with sqlite3.connect(path) as raw:
            assert raw.execute("SELECT count(*) FROM t").fetchone() == (rows,)
