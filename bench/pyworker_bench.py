"""Per-run overhead of ``poolctl worker --call`` against ``--command`` for the same no-op Python job.

A real ``poolctl serve`` over a SQLite store in a temporary folder, and two real workers on
two ordinals: one runs ``python noop.py`` per grant (an interpreter start each run), the other
``--call noop:run`` in its long-lived runner. Runs alternate between them (so a change of load
touches both alike); this process adds each run, waits for its result in the store and settles
it, as the plane would. A run's figure is its worker's own window, from its ``starting`` line
to its ``done`` line (grant to accepted result: execution, spool, delivery); the medians and
their ratio are printed, with the median end-to-end time from adding the run to its result
(which adds the worker's offer polling, ``--poll 0.05``, alike for both). The first run of
each is left out: it warms caches.

    python bench/pyworker_bench.py [--runs N]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from sqlalchemy import text

from core.settings import Settings
from poolkeeper import tokens
from poolkeeper.embedded import ServeProc
from store import PoolStore, transitions
from store.models import RowState

SECRET = "pyworker-bench-" + "0123456789abcdef" * 3
POOLCTL = [sys.executable, "-c", "from poolkeeper.cli import main; main()"]
NOOP = """
import json, sys


def run(ctx):
    return None


if __name__ == "__main__":
    json.load(sys.stdin)
"""
LINE = re.compile(r"^(\S+ \S+) INFO \S+: bench/t(\d+)(?: run \d+ attempt \d+)?: (starting|done)")


def windows(log: Path) -> list[float]:
    """Seconds from each run's ``starting`` line to its ``done`` line in a worker's log."""
    started: dict[str, datetime] = {}
    found = []
    for line in log.read_text().splitlines():
        m = LINE.match(line)
        if m is None:
            continue
        at = datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f")
        if m[3] == "starting":
            started[m[2]] = at
        elif m[2] in started:
            found.append((at - started.pop(m[2])).total_seconds())
    return found


def one_run(store: PoolStore, n: int, ordinal: int, timeout: float = 60) -> float:
    """Add run ``n`` on ``ordinal``, wait for its result, settle it; seconds from add to result."""
    began = time.perf_counter()
    store.add_run(board="bench", task_id=f"t{n}", run_id=n, ordinal=ordinal, payload={"n": n})
    query = text("SELECT id, state FROM assignments WHERE task_id = :t")
    deadline = time.monotonic() + timeout
    while True:
        with store.session(readonly=True) as s:
            row = s.execute(query, {"t": f"t{n}"}).one()
        if row.state == RowState.RESULT:
            took = time.perf_counter() - began
            break
        if time.monotonic() > deadline:
            raise SystemExit(f"run {n} on ordinal {ordinal}: no result after {timeout:.0f} s ({row.state})")
        time.sleep(0.002)
    with store.session() as s:
        transitions.settle(
            s, row.id, RowState.FINALIZED, expect_state=RowState.RESULT, expect_attempt=1, now=time.time()
        )
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=30, help="runs per worker (30)")
    runs = parser.parse_args().runs
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "noop.py").write_text(NOOP)
        url = f"sqlite:///{folder / 'pool.db'}"
        settings = Settings(database_url=url, board_url=url, pool_size=2, lease_seconds=30)
        store = PoolStore.from_settings(settings)
        store.migrate()
        server = ServeProc(settings.env(), folder, secret=SECRET).wait_ready()
        kinds = {"--command": ["--command", f"{sys.executable} noop.py"], "--call": ["--call", "noop:run"]}
        workers, logs = [], {}
        try:
            for ordinal, (kind, runs_what) in enumerate(kinds.items()):
                logs[kind] = folder / f"worker{ordinal}.log"
                argv = [*POOLCTL, "worker", "--ordinal", str(ordinal), *runs_what, "--url", server.url]
                env = {
                    **os.environ,
                    "POOL_WORKER_TOKEN": tokens.ordinal_token(SECRET, ordinal),
                    "POOL_WORKER_STATE_DIR": str(folder / "state"),
                }
                with logs[kind].open("w") as log:
                    workers.append(
                        subprocess.Popen(
                            [*argv, "--wait", "0", "--poll", "0.05"], cwd=folder, env=env, stderr=log
                        )
                    )
            ends: dict[str, list[float]] = {kind: [] for kind in kinds}
            for n in range(runs):
                for ordinal, kind in enumerate(kinds):
                    ends[kind].append(one_run(store, n * 2 + ordinal + 1, ordinal))
        finally:
            for proc in workers:
                proc.terminate()
                proc.wait(30)
            server.stop()
            store.engine.dispose()
        medians = {}
        for kind in kinds:
            found = windows(logs[kind])[1:]  # the first run of each warms its caches
            medians[kind] = statistics.median(found)
            end = statistics.median(ends[kind][1:])
            print(
                f"{kind:>10}: per run {medians[kind] * 1000:7.1f} ms median (grant to accepted result,"
                f" {len(found)} runs), {end * 1000:7.1f} ms median from add to result"
            )
        print(f"     ratio: --command / --call = {medians['--command'] / medians['--call']:.1f}x")


if __name__ == "__main__":
    main()
