"""A writer killed with SIGKILL mid-loop: the store is intact and holds every acknowledged write."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

from sqlalchemy import text

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
        transitions.expire(s, offer.row_id, max_attempts=1, now=time.time())  # -> lease_failed
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
