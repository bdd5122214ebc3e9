"""``celery -A tasks worker|beat`` as real processes: refusing what it cannot serve, quiet logs, no litter."""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from board import TaskStatus, open_board
from core.settings import Settings
from poolkeeper.embedded import ROOT, CeleryProc, RedisServer, free_port, wait_for
from poolkeeper.simulate import Faults, SimPool
from store import PoolStore
from tasks.coordination import process_task, queue_name

pytestmark = pytest.mark.integration

# Celery warns on stderr when it runs as root (as in some CI containers); that line is
# Celery's, not a refusal of ours, and would make "one line on stderr" depend on the user.
ROOT_WARNING = "ignore:You're running the worker with superuser privileges"


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"), bundled=True).start()
    yield server
    server.stop()


@pytest.fixture
def settings(tmp_path: Path, redis_server: RedisServer) -> Settings:
    """A migrated store and board, and an empty broker."""
    redis_server.client().flushdb()
    s = Settings(
        database_url=f"sqlite:///{tmp_path}/pool.db",
        board_url=f"sqlite:///{tmp_path}/board.db",
        redis_url=redis_server.url,
        pool_size=2,
        tick_seconds=0.3,
        reconcile_seconds=1.0,
        task_time_limit=10.0,
        namespace="entry",
    )
    PoolStore.from_settings(s).migrate()
    open_board(s).migrate()
    return s


def run_celery(
    kind: str, env: dict[str, str], cwd: Path, *extra: str, deadline: float = 60
) -> tuple[int, str]:
    """Run until it exits by itself; a process still running at the deadline fails the test."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "tasks",
            kind,
            "-l",
            "info",
            "--logfile",
            cwd / "c.log",
            *extra,
        ],
        env={**os.environ, **env, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": ROOT_WARNING},
        cwd=cwd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, err = proc.communicate(timeout=deadline)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise AssertionError(
            f"celery {kind} was still running after {deadline}s: it did not refuse"
        ) from None
    return proc.returncode, err


def queued_message(settings: Settings) -> None:
    """A real message of this deployment, waiting on its queue before the worker starts."""
    from tasks.celery import make_app

    make_app(settings).send_task(process_task(settings), ("expire", [1]), queue=queue_name(settings))


def empty_sqlite(path: Path) -> str:
    sqlite3.connect(path).close()
    return f"sqlite:///{path}"


BAD_WORKERS: list[tuple[str, Any, list[str], int, str]] = [
    (
        "a database URL that is not one",
        lambda tmp: {"POOL_DATABASE_URL": "pool.db"},
        [],
        78,
        "poolkeeper: POOL_DATABASE_URL: not a database URL SQLAlchemy can open",
    ),
    (
        "a store that was never migrated",
        lambda tmp: {"POOL_DATABASE_URL": empty_sqlite(tmp / "empty.db")},
        [],
        78,
        "poolkeeper: no pool store at sqlite:///",
    ),
    (
        "a board that does not exist",
        lambda tmp: {"POOL_BOARD_URL": f"sqlite:///{tmp}/typo.db"},
        [],
        78,
        "poolkeeper: no board at sqlite:///",
    ),
    (
        "a store server that does not answer",
        lambda tmp: {"POOL_DATABASE_URL": f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/x"},
        [],
        69,
        "poolkeeper: pool store",
    ),
    (
        "a queue of another deployment",
        lambda tmp: {},
        ["-Q", "maintenance"],
        2,
        "poolkeeper: -Q maintenance: this deployment's queue is entry.maintenance",
    ),
]


@pytest.mark.parametrize(
    ("case", "bad", "extra", "code", "line"), BAD_WORKERS, ids=[c[0] for c in BAD_WORKERS]
)
def test_a_worker_that_cannot_serve_refuses_to_start_and_consumes_nothing(
    settings: Settings,
    redis_server: RedisServer,
    tmp_path: Path,
    case: str,
    bad: Any,
    extra: list[str],
    code: int,
    line: str,
) -> None:
    queued_message(settings)
    r, queue = redis_server.client(), queue_name(settings)
    assert r.llen(queue) == 1
    returncode, stderr = run_celery("worker", {**settings.env(), **bad(tmp_path)}, tmp_path, *extra)
    assert returncode == code, stderr
    assert len(stderr.strip().splitlines()) == 1, stderr
    assert stderr.startswith(line), stderr
    assert r.llen(queue) == 1, "the message was taken off its queue"
    assert r.hlen(f"{settings.namespace}:unacked") == 0, "the message was delivered"
    assert not (tmp_path / "typo.db").exists(), "the check created the database it looked for"


def test_a_beat_that_cannot_serve_refuses_to_start(settings: Settings, tmp_path: Path) -> None:
    bad = {"POOL_DATABASE_URL": empty_sqlite(tmp_path / "empty.db")}
    returncode, stderr = run_celery("beat", {**settings.env(), **bad}, tmp_path)
    assert returncode == 78, stderr
    [line] = stderr.strip().splitlines()
    assert line.startswith("poolkeeper: no pool store at sqlite:///"), line
    assert line.endswith(": run `poolctl init` (nothing consumed)"), line


def test_worker_logs_summaries_not_messages_and_leaves_no_temp_dirs(
    settings: Settings, tmp_path: Path
) -> None:
    temp = tmp_path / "tmp"  # the processes' temp folder, to see what they leave in it
    temp.mkdir()
    port = free_port()
    env = {**settings.env(), "POOL_METRICS_PORT": str(port), "TMPDIR": str(temp)}
    kanban, store = open_board(settings), PoolStore.from_settings(settings)
    for i in range(4):
        kanban.add_task("b", f"task {i}", task_id=f"t{i}")
    worker = CeleryProc("worker", env, tmp_path, "w1")
    beat = CeleryProc("beat", env, tmp_path, "beat")
    pool = SimPool(store, Faults(work_seconds=0.05), seed=8)
    try:
        worker.wait_ready()
        beat.wait_ready()
        assert any(p.name.startswith("poolkeeper-metrics-") for p in temp.iterdir())
        pool.start()
        wait_for(
            "every task done", lambda: {t.status for t in kanban.list_tasks("b")} == {TaskStatus.DONE}, 60
        )
        # a message the worker cannot process: its error must still reach the log
        from tasks.celery import make_app

        make_app(settings).send_task(process_task(settings), ("nosuch", [1]))
        failure = re.compile(r"ERROR/.*unknown pass 'nosuch'")
        wait_for("the failure logged", lambda: failure.search(worker.text()), 30)
    finally:
        pool.stop()
        worker.stop()
        beat.stop()
    log = worker.text()
    assert worker.proc.returncode == 0, log[-3000:]
    assert beat.proc.returncode == 0, beat.text()[-3000:]
    assert f"metrics on http://127.0.0.1:{port}/metrics" in log
    assert re.search(r"results [\d, ]+(and \d+ more)?: finalized", log), "lines name the rows"
    assert "Sending due task" not in beat.text(), "beat's per-tick lines are quiet"
    assert not re.search(r"Task \S+ received|succeeded in \d", log), "per-message lines are quiet"
    assert list(temp.iterdir()) == [], "a worker or beat left its temp files behind"
